// Helpers for tests that fork real processes (ddp::spawn) and check collectives in each.
#pragma once

#include <ddp/backend/host.hpp>
#include <ddp/communicator.hpp>
#include <ddp/spawn.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// ASan's quarantine and TSan's shadow memory hold memory on purpose: RSS limits are not checked
// under them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MP_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define MP_SANITIZED 1
#endif
#endif
#ifndef MP_SANITIZED
#define MP_SANITIZED 0
#endif

namespace mp {

using Comm = ddp::Communicator<ddp::backend::Host>;
using namespace std::chrono_literals;

/// In a child process doctest's CHECK would be lost: failures throw, and spawn carries the
/// message back to the parent, which fails the test.
#define MP_EXPECT(cond, ...)                                                            \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::ostringstream mp_os_;                                                        \
      mp_os_ << __FILE__ << ":" << __LINE__ << ": expected " #cond ": " << __VA_ARGS__; \
      throw std::runtime_error(mp_os_.str());                                           \
    }                                                                                   \
  } while (false)

/// In a child: how many hosts its ranks play (Path::enter), for references whose order depends
/// on it (collective_cases.hpp).
inline int current_hosts = 1;

/// Where the ranks of a test run: every rank on shared memory, or on TCP, or split into
/// `hosts` hosts of consecutive ranks (DDP_HOST_ID) with the automatic transport: shared memory
/// inside each, TCP between, and all_reduce hierarchical.
struct Path {
  ddp::HostTransport transport = ddp::HostTransport::automatic;
  int hosts = 1;
  Path(ddp::HostTransport t) : transport(t) {}  // NOLINT(google-explicit-constructor)
  Path(ddp::HostTransport t, int h) : transport(t), hosts(h) {}
  /// In a child, before Comm::init: this rank's host.
  void enter(int rank, int world) const {
    current_hosts = hosts;
    if (hosts > 1) ::setenv("DDP_HOST_ID", std::to_string(rank * hosts / world).c_str(), 1);
  }
};

inline std::string name(const Path& p) {
  if (p.hosts > 1) return std::to_string(p.hosts) + " hosts (shm inside, tcp between)";
  return p.transport == ddp::HostTransport::shm ? "shm" : "tcp";
}

/// Two hosts: ranks {0, 1} and {2, 3} for 4 ranks (slices), {0, 1} and {2} for 3 (leaders).
inline const Path two_hosts{ddp::HostTransport::automatic, 2};

/// Every path: shm, tcp and two hosts.
inline std::vector<Path> paths() {
  return {ddp::HostTransport::shm, ddp::HostTransport::tcp, two_hosts};
}

/// Segment size used by the tests: small, so that "larger than any internal chunk" is cheap.
inline constexpr std::size_t test_segment = 64 * 1024;

/// A TCP port of 127.0.0.1 that was free a moment ago.
inline int free_port() {
  const ddp::detail::Fd l = ddp::detail::listen_tcp("127.0.0.1", 0);
  return ddp::detail::local_port(l.get());
}

/// Rank `rank` of `world` of a job whose store is at 127.0.0.1:`port`, for ranks forked by hand.
inline ddp::Environment local_env(int rank, int world, int port) {
  ddp::Environment env;
  env.rank = rank;
  env.world_size = world;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  return env;
}

/// Runs body(env) on `world` forked ranks; a rank that fails or dies does not stop the others.
/// Returns spawn's error ("" when every rank succeeded).
inline std::string spawn_all(int world, const std::function<void(ddp::Environment)>& body) {
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  try {
    ddp::spawn(world, body, so);
  } catch (const ddp::Error& e) {
    return e.what();
  }
  return {};
}

/// Runs body(comm) on `world` forked ranks over `transport`; fails the doctest case on error.
inline void run(int world, const Path& transport, const std::function<void(Comm&)>& body,
                ddp::Options options = {}) {
  options.transport = transport.transport;
  if (options.segment_bytes == 0) options.segment_bytes = test_segment;
  if (options.timeout == std::chrono::minutes(5)) options.timeout = 60s;
  try {
    ddp::spawn(world, [&](ddp::Environment env) {
      transport.enter(env.rank, env.world_size);
      auto comm = Comm::init(env, options);
      body(comm);
    });
  } catch (const ddp::Error& e) {
    FAIL_CHECK("world " << world << " over " << name(transport) << ": " << std::string(e.what()));
  }
}

/// The world sizes each_world runs: all it is given, or only those also listed in
/// DDP_TEST_WORLDS (e.g. "1,3,4": the sanitizer stages, where every rank runs ~3x slower; 3 and
/// 4 still take every path, the two hosts' leaders and slices included).
inline bool world_selected(int w) {
  const char* only = std::getenv("DDP_TEST_WORLDS");
  if (only == nullptr || *only == '\0') return true;
  const std::string list = std::string(",") + only + ",";
  return list.find("," + std::to_string(w) + ",") != std::string::npos;
}

/// Runs body over every world size on each of `on` (two hosts: 3 and 4 ranks only).
inline void each_world_on(const std::vector<Path>& on, const std::function<void(Comm&)>& body,
                          const std::vector<int>& worlds = {1, 2, 3, 4}) {
  for (const Path& t : on) {
    for (int w : worlds) {
      if (t.hosts > 1 && w < 3) continue;
      if (!world_selected(w)) continue;
      CAPTURE(w);
      run(w, t, body);
    }
  }
}

/// Runs body over every world size and both transports, and over two hosts for 3 and 4 ranks.
inline void each_world(const std::function<void(Comm&)>& body,
                       const std::vector<int>& worlds = {1, 2, 3, 4}) {
  each_world_on(paths(), body, worlds);
}

/// A scratch directory for results that children report to the parent.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/ddp-test-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { [[maybe_unused]] const int rc = std::system(("rm -rf " + path).c_str()); }
  [[nodiscard]] std::string file(const std::string& name) const { return path + "/" + name; }
  static void write(const std::string& file, const std::string& text) {
    std::ofstream(file) << text;
  }
  [[nodiscard]] static bool exists(const std::string& file) { return std::ifstream(file).good(); }
  [[nodiscard]] static std::string read(const std::string& file) {
    std::ifstream in(file);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
};

/// Milliseconds since `t0`.
/// Runs `call` on `comm`'s rank and expects Errc::invalid_argument whose message names the rank
/// and contains `needle`.
template <class F>
void expect_refused(const Comm& comm, const char* what, const std::string& needle, F&& call) {
  try {
    call();
    MP_EXPECT(false, what << " was accepted");
  } catch (const ddp::Error& e) {
    const std::string m = e.what();
    MP_EXPECT(e.code() == ddp::Errc::invalid_argument, what << ": " << m);
    MP_EXPECT(m.find("rank " + std::to_string(comm.rank())) != std::string::npos, m);
    MP_EXPECT(m.find(needle) != std::string::npos, what << ": " << m);
  }
}

/// In a rank: expects `call` to fail with Errc::invalid_argument whose message contains `needle`.
template <class F>
void expect_invalid(const std::string& needle, F&& call) {
  try {
    call();
    MP_EXPECT(false, "accepted: " << needle);
  } catch (const ddp::Error& e) {
    MP_EXPECT(e.code() == ddp::Errc::invalid_argument &&
                  std::string(e.what()).find(needle) != std::string::npos,
              e.what());
  }
}

inline long long ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               t0)
      .count();
}

/// Runs `body(comm, first rank)` in 4 processes, some of which die on purpose: the survivors
/// go on (a 20 s timeout); what the launcher reports at the end is left to the caller's checks.
template <class Body>
void run_with_losses(Body&& body) {
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  try {
    ddp::spawn(
        4,
        [&](ddp::Environment env) {
          ddp::Options o;
          o.timeout = std::chrono::seconds(20);
          auto comm = Comm::init(env, o);
          const int first = comm.rank();
          body(comm, first);
        },
        so);
  } catch (const ddp::Error&) {  // the ranks that died on purpose
  }
}

}  // namespace mp
