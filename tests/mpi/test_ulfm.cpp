// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// backend::Mpi recovering from lost ranks with ULFM (MPIX_Comm_shrink), run by
// tests/mpi/ulfm_test.py under an MPI library that has it (Open MPI 5 from PyPI, started with
// `mpirun --with-ft ulfm`):
//
//   test_ulfm train V1:S1[,V2:S2]  ranks V1 (of the first communicator) dies before step S1's
//                                  all_reduce, then V2 (a rank of the second) before S2's; the
//                                  survivors shrink, restore the last commit and go on; at the
//                                  end every survivor's parameters equal a reference bitwise
//   test_ulfm refused              started without --with-ft: shrink() refused, the communicator
//                                  still works
//   test_ulfm lone                 rank 1 alone calls shrink() (the others sleep 30 s): the
//                                  watchdog ends the job at the 3 s timeout, naming shrink
// Each survivor prints "ok rank R" at the end; a failed check prints "FAIL ..." and exits 1.

#include "ddp/backend/mpi.hpp"
#include "ddp/ddp.hpp"

#include <signal.h>
#include <unistd.h>

#include <csignal>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Mpi = ddp::Communicator<ddp::backend::Mpi>;
constexpr std::size_t n_params = 4099;  // odd: no collective sees a round size
constexpr int steps = 10;

int world_rank = -1;
volatile std::sig_atomic_t current_step = -1;

/// Says which signal ended this process and where, with write(2) only: a crash ("CRASH") is a
/// failure of the test; SIGTERM ("TERM") is Open MPI's launcher tearing the job down.
extern "C" void on_signal(int sig) {
  char line[96];
  const int n = std::snprintf(line, sizeof line, "%s world rank %d, signal %d, step %d\n",
                              sig == SIGTERM ? "TERM" : "CRASH", world_rank, sig,
                              static_cast<int>(current_step));
  if (n > 0) (void)!::write(1, line, static_cast<std::size_t>(n));
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void say_how_it_ends() {
  for (int sig : {SIGTERM, SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) std::signal(sig, on_signal);
}

void expect(bool ok, const std::string& what) {
  if (ok) return;
  std::printf("FAIL world rank %d: %s\n", world_rank, what.c_str());
  std::fflush(stdout);
  std::exit(1);
}

/// SIGPIPE's action now: ignored on a job started with ULFM (a survivor's write to a dead peer's
/// connection would otherwise end it without a word), the default on one without.
bool sigpipe_ignored() {
  struct sigaction now {};
  ::sigaction(SIGPIPE, nullptr, &now);
  return now.sa_handler == SIG_IGN;
}

/// Rank `who`'s gradient at `step` (small integers: every sum is exact in float, so the result
/// does not depend on the order in which MPI adds them).
float grad(int who, int step, std::size_t i) {
  return static_cast<float>(
      (static_cast<std::size_t>(who + 1) * (i + 3) + static_cast<std::size_t>(step) * 5) % 13);
}

/// One step on `params`: the members' (world ranks) gradients averaged, half of it subtracted.
void apply(std::vector<float>& params, const std::vector<int>& members, int step) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    float sum = 0;
    for (int m : members) sum += grad(m, step, i);
    params[i] -= 0.5f * (sum / static_cast<float>(members.size()));
  }
}

/// "V:S,V:S" → {(V, S), ...}
std::vector<std::pair<int, int>> parse_kills(const char* s) {
  std::vector<std::pair<int, int>> out;
  for (std::string rest = s; !rest.empty();) {
    const auto comma = rest.find(',');
    const std::string one = rest.substr(0, comma);
    const auto colon = one.find(':');
    out.emplace_back(std::stoi(one.substr(0, colon)), std::stoi(one.substr(colon + 1)));
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
  }
  return out;
}

int train(const char* spec) {
  const auto kills = parse_kills(spec);
  say_how_it_ends();
  Mpi comm = Mpi::init();
  world_rank = comm.rank();
  expect(sigpipe_ignored(), "SIGPIPE is ignored on a fault-tolerant job");
  std::vector<int> members;  // world ranks of the current communicator's ranks
  for (int r = 0; r < comm.size(); ++r) members.push_back(r);
  std::vector<float> params(n_params, 100.0f);
  std::int64_t step = 0, done = 0;
  ddp::TrainingState state;
  state.track("params", params).track_object("done", done);
  state.start(comm);
  std::size_t losses = 0;
  // The reference: which members took each step.
  std::vector<std::vector<int>> took(steps);
  for (;;) {
    try {
      for (; step < steps; ++step) {
        current_step = static_cast<int>(step);
        if (losses < kills.size() && step == kills[losses].second &&
            comm.rank() == kills[losses].first) {
          std::fflush(stdout);
          // Lost as a crash or a kill is: Open MPI 5's launcher ends the whole job at the
          // second process that exits with a nonzero status, but not for killed ones.
          std::raise(SIGKILL);
        }
        std::vector<float> g(n_params);
        for (std::size_t i = 0; i < n_params; ++i)
          g[i] = grad(world_rank, static_cast<int>(step), i);
        comm.all_reduce(g, ddp::ReduceOp::avg);
        for (std::size_t i = 0; i < n_params; ++i) params[i] -= 0.5f * g[i];
        took[static_cast<std::size_t>(step)] = members;
        done = step + 1;
        state.commit(comm);
      }
      break;
    } catch (const ddp::Error& e) {
      expect(losses < kills.size(), std::string("unexpected failure: ") + e.what());
      const int victim = kills[losses].first;
      expect(e.code() == ddp::Errc::peer_lost,
             std::string("a lost rank gives Errc::peer_lost, got: ") + e.what());
      const std::string dead = "rank " + std::to_string(victim) + " died";
      const std::string what = e.what();
      // The rank that saw the failure names the dead rank; one that learned of it through the
      // revoked communicator says so.
      expect(what.find(dead) != std::string::npos || what.find("revoked") != std::string::npos,
             "the error names the dead rank or the revocation: " + what);
      const std::uint64_t epoch = comm.epoch();
      Mpi next = comm.shrink();
      expect(next.size() == comm.size() - 1,
             "one rank fewer after shrink: " + std::to_string(comm.size()) + " -> " +
                 std::to_string(next.size()));
      expect(next.epoch() == epoch + 1, "the membership epoch advances");
      std::vector<int> expected;
      for (int r = 0; r < comm.size(); ++r)
        if (r != victim) expected.push_back(r);
      expect(next.previous_ranks() == expected, "previous_ranks() maps to the old ranks in order");
      std::vector<int> now;
      for (int r : next.previous_ranks()) now.push_back(members[static_cast<std::size_t>(r)]);
      members = now;
      try {  // the old communicator is replaced: its calls fail, naming that
        std::vector<float> x(1);
        comm.all_reduce(x);
        expect(false, "the replaced communicator still works");
      } catch (const ddp::Error& old) {
        expect(old.code() == ddp::Errc::aborted || old.code() == ddp::Errc::peer_lost,
               std::string("the replaced communicator fails: ") + old.what());
      }
      comm = std::move(next);
      state.restore(comm);
      step = done;
      ++losses;
    }
  }
  expect(losses == kills.size(), "every planned loss happened");
  // The reference: the same steps, each by the members that took it.
  std::vector<float> reference(n_params, 100.0f);
  for (int s = 0; s < steps; ++s) apply(reference, took[static_cast<std::size_t>(s)], s);
  expect(std::memcmp(reference.data(), params.data(), n_params * sizeof(float)) == 0,
         "parameters equal the reference bitwise");
  // ... and every survivor holds the same (gathered, compared bitwise).
  std::vector<float> all(n_params * static_cast<std::size_t>(comm.size()));
  comm.all_gather(params, all);
  for (int r = 0; r < comm.size(); ++r)
    expect(std::memcmp(all.data() + static_cast<std::size_t>(r) * n_params, params.data(),
                       n_params * sizeof(float)) == 0,
           "every survivor holds the same parameters");
  std::printf("ok rank %d of %d (world rank %d, epoch %llu)\n", comm.rank(), comm.size(),
              world_rank, static_cast<unsigned long long>(comm.epoch()));
  std::fflush(stdout);
  return 0;
}

int refused() {
  Mpi comm = Mpi::init();
  world_rank = comm.rank();
  expect(!ddp::backend::Mpi::fault_tolerant(), "started without --with-ft: not fault tolerant");
  expect(!sigpipe_ignored(), "SIGPIPE keeps its action on a job without fault tolerance");
  try {
    (void)comm.shrink();
    expect(false, "shrink() accepted without ULFM enabled");
  } catch (const ddp::Error& e) {
    expect(e.code() == ddp::Errc::unsupported, std::string("unsupported: ") + e.what());
    expect(std::string(e.what()).find("--with-ft ulfm") != std::string::npos,
           std::string("the refusal says how to start the job: ") + e.what());
  }
  std::vector<float> v{1.0f};
  comm.all_reduce(v);
  expect(v[0] == static_cast<float>(comm.size()), "the communicator still works");
  std::printf("ok rank %d of %d\n", comm.rank(), comm.size());
  std::fflush(stdout);
  return 0;
}

int lone() {
  ddp::Options o;
  o.timeout = std::chrono::seconds(3);
  Mpi comm = Mpi::init(ddp::Environment::detect(), o);
  world_rank = comm.rank();
  if (comm.rank() == 1) {
    (void)comm.shrink();  // the others never come: ended by the watchdog
    expect(false, "a lone shrink() returned");
  }
  std::this_thread::sleep_for(std::chrono::seconds(30));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "train") == 0) return train(argv[2]);
  if (argc >= 2 && std::strcmp(argv[1], "refused") == 0) return refused();
  if (argc >= 2 && std::strcmp(argv[1], "lone") == 0) return lone();
  std::fprintf(stderr, "usage: test_ulfm train V:S[,V:S] | refused | lone\n");
  return 2;
}
