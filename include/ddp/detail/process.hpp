// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Starting and stopping worker processes, the one way ddp::spawn and ddprun's agent both do it:
/// a fork that gives the child default signal dispositions and ties its life to its parent's,
/// the variables that place a worker in its job (torchrun's names), a stop in two steps
/// (SIGTERM, then SIGKILL after a grace period) and the words for how a process ended.

#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Where a worker stands in its job: what RANK, WORLD_SIZE, ... tell it.
struct WorkerPlace {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 0;
};

/// "RANK=r", "WORLD_SIZE=n", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
/// "MASTER_ADDR", "MASTER_PORT" (torchrun's names) and "DDP_STORE_HOSTED=1": the parent hosts the
/// rendezvous store, or reaches the one that does, for the worker's whole life.
[[nodiscard]] DDP_INLINE std::vector<std::string> worker_variables(const WorkerPlace& p);

/// fork() for a worker. Signals are blocked across it, so that none reaches the child before the
/// child has its own dispositions. In the child (0 is returned): the signals a parent handles
/// (SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE and the crash signals) back to their defaults, the
/// previous mask back, killed when its parent dies (PR_SET_PDEATHSIG; it exits with 127 at once
/// when the parent is already gone) and, with `own_group`, in a process group of its own (so that
/// stopping it stops what it started). The child makes async-signal-safe calls only. In the
/// parent: the child's pid; fails with Errc::system.
[[nodiscard]] DDP_INLINE pid_t fork_worker(bool own_group);

/// "exited with status N", "was killed by SIGKILL (signal 9)" for a waitpid() status.
[[nodiscard]] DDP_INLINE std::string describe_status(int status);

/// A stop in two steps, as torchrun and mpirun stop their workers: SIGTERM, then SIGKILL to what
/// has not ended when the grace period is over. Only the times: the owner sends the signals that
/// due() names, to its own processes.
class GracefulStop {
 public:
  using Clock = std::chrono::steady_clock;

  /// SIGTERM at `now + delay` (time for the workers to write their flight recorders), SIGKILL
  /// `grace` after that.
  void begin(Clock::time_point now, std::chrono::milliseconds delay,
             std::chrono::milliseconds grace) {
    term_at_ = now + delay;
    kill_at_ = term_at_ + grace;
  }
  /// The first signal is sent already (passed on from the launcher's own): SIGKILL `grace` later.
  void begin_sent(Clock::time_point now, std::chrono::milliseconds grace) {
    term_at_ = Clock::time_point::max();
    kill_at_ = now + grace;
  }
  /// No stop under way.
  void reset() { term_at_ = kill_at_ = Clock::time_point::max(); }
  /// Whether SIGKILL is still to come: a stop is under way and its grace period not over.
  [[nodiscard]] bool kill_pending() const { return kill_at_ != Clock::time_point::max(); }
  /// The signal due at `now`: SIGTERM, then SIGKILL, each named once; 0 when none is.
  [[nodiscard]] int due(Clock::time_point now) {
    if (now >= term_at_) {
      term_at_ = Clock::time_point::max();
      return SIGTERM;
    }
    if (now >= kill_at_) {
      kill_at_ = Clock::time_point::max();
      return SIGKILL;
    }
    return 0;
  }

 private:
  Clock::time_point term_at_ = Clock::time_point::max();
  Clock::time_point kill_at_ = Clock::time_point::max();
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/process.ipp"
#endif
