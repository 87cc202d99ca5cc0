// Helpers of the tests that make things fail across real processes (ddp-test-failures): each rank
// reports what it saw to a file ("<errc> <ms> <message>"), ranks run without stopping the others
// when one fails, and the /dev/shm entries a run leaves behind are listed.
#pragma once

#include "multiprocess.hpp"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

// Unqualified in every file that includes this one.
using mp::Comm;
using Clock = std::chrono::steady_clock;

inline long long now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

/// What a rank saw: "<errc> <ms> <message>" or "ok"; with report(), the error's origin rank and
/// lost ranks too ("fields<rank>": "<origin> <lost ranks...>").
struct Outcome {
  std::string code;
  long long ms = 0;
  std::string message;
  int origin = -2;  // -2: not reported
  std::vector<int> lost;
};

inline Outcome read_outcome(const mp::TempDir& dir, int rank) {
  std::istringstream in(mp::TempDir::read(dir.file("rank" + std::to_string(rank))));
  Outcome o;
  in >> o.code >> o.ms;
  std::getline(in, o.message);
  const std::string fields = dir.file("fields" + std::to_string(rank));
  if (::access(fields.c_str(), F_OK) == 0) {
    std::istringstream f(mp::TempDir::read(fields));
    f >> o.origin;
    for (int r; f >> r;) o.lost.push_back(r);
  }
  return o;
}

inline void report(const mp::TempDir& dir, int rank, const ddp::Error& e, long long ms) {
  std::string fields = std::to_string(e.origin_rank());
  for (const int r : e.lost_ranks()) fields += " " + std::to_string(r);
  mp::TempDir::write(dir.file("fields" + std::to_string(rank)), fields);
  mp::TempDir::write(
      dir.file("rank" + std::to_string(rank)),
      std::string(ddp::to_string(e.code())) + " " + std::to_string(ms) + " " + e.what());
}

/// Runs body on `world` ranks without stopping the others when one fails.
inline void run_faulty(int world, const mp::Path& t, const std::function<void(Comm&)>& body,
                       ddp::Options o = {}, std::string* spawn_error = nullptr) {
  o.transport = t.transport;
  o.segment_bytes = mp::test_segment;
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  try {
    ddp::spawn(
        world,
        [&](ddp::Environment env) {
          t.enter(env.rank, env.world_size);
          auto comm = Comm::init(env, o);
          body(comm);
        },
        so);
    if (spawn_error != nullptr) *spawn_error = "";
  } catch (const ddp::Error& e) {
    if (spawn_error == nullptr) throw;
    *spawn_error = e.what();
  }
}

/// Each of `world` ranks makes a communicator with options(rank) and reports (to `dir`) the
/// ddp::Error its init raised, if any; nothing stops the others when one fails.
inline void init_outcomes(int world, const mp::TempDir& dir,
                          const std::function<ddp::Options(ddp::Environment&)>& options) {
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  try {
    ddp::spawn(
        world,
        [&](ddp::Environment env) {
          const ddp::Options o = options(env);
          try {
            auto comm = Comm::init(env, o);
          } catch (const ddp::Error& e) {
            report(dir, env.rank, e, 0);
          }
        },
        so);
  } catch (const ddp::Error&) {
  }
}

inline std::vector<std::string> our_shm_entries() {
  std::vector<std::string> out;
  const std::string prefix = "ddp-" + std::to_string(::getuid()) + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) out.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return out;
}

/// ddp's /dev/shm entries that were not in `before` and are still there after a grace period:
/// other test programs running at the same time create entries too, but theirs are unlinked
/// within moments (every segment is unlinked once all its ranks have mapped it), while one that
/// a killed run left behind stays.
inline std::vector<std::string> lasting_new_shm_entries(const std::vector<std::string>& before) {
  std::vector<std::string> fresh;
  for (int attempt = 0; attempt < 60; ++attempt) {
    fresh.clear();
    for (auto& e : our_shm_entries()) {
      if (std::find(before.begin(), before.end(), e) == before.end()) fresh.push_back(e);
    }
    if (fresh.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return fresh;
}
