// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::spawn: like torch.multiprocessing.spawn. Forks `nprocs` processes on this host, each
/// running fn(env) with its Environment (also exported as RANK, WORLD_SIZE, ... so that
/// Environment::detect() and Communicator::init() work inside), and waits for them. The parent
/// hosts the rendezvous store. If a child throws or dies, the parent stops the others (SIGTERM,
/// then SIGKILL) and throws a ddp::Error naming the rank and carrying the child's message.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/process.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/observe/recorder.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"
#include "ddp/store/protocol.hpp"
#include "ddp/store/server.hpp"

#include <fcntl.h>
#include <signal.h>

#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// How spawn() starts, hosts and stops its workers.
struct SpawnOptions {
  /// Address the store listens on and workers connect to.
  std::string master_addr = "127.0.0.1";
  /// Port of the store; 0 picks a free one.
  int master_port = 0;
  /// Grace period between SIGTERM and SIGKILL when stopping the others after a failure.
  std::chrono::milliseconds grace{std::chrono::seconds(3)};
  /// Extra environment variables for the workers ("NAME=value"). A DDP_TOKEN here is also the
  /// token of the store spawn() hosts.
  std::vector<std::string> env;
  /// Stop the other workers as soon as one fails (torchrun's behaviour; with $DDP_TRACE_DUMP set,
  /// a second later, so that they can write their flight recorders). Fault-injection tests turn
  /// it off to watch how the survivors react.
  bool stop_on_failure = true;
  /// With stop_on_failure false: end (SIGKILL) a worker that the job left out alive, stopped or
  /// hung past the heartbeat or too slow for the others' shrink() (it can never act again, and
  /// spawn would wait for it for ever), as ddprun does; spawn then fails naming it. Tests of
  /// fencing, which wake such a worker to watch it refused, turn it off.
  bool end_left_out = true;
};

/// Runs fn(env) in nprocs forked processes and waits for all of them (see the file comment).
DDP_INLINE void spawn(int nprocs, const std::function<void(Environment)>& fn,
                      const SpawnOptions& options = {});

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/spawn.ipp"
#endif
