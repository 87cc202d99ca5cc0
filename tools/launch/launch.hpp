// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::launch: the launcher core behind tools/ddprun, one node's agent (detail::LaunchAgent):
/// it hosts or joins the rendezvous store, starts the workers with their environment, forwards
/// their output line by line, watches them and the other nodes, agrees with the other agents on
/// restarts and on the root cause of a failure, and stops everything on a failure or a signal.
/// Only the tools use it; it includes nothing of ddp but <ddp/ddp.hpp>, so it builds against
/// include/ and against the single header alike. Its rooms: options.hpp (the options),
/// agent.hpp (the agent's state), rendezvous.hpp, workers.hpp,
/// outcome.hpp.

#include "agent.hpp"
#include "outcome.hpp"
#include "rendezvous.hpp"
#include "workers.hpp"

DDP_BEGIN_NAMESPACE
namespace detail {

inline int LaunchAgent::run() {
  struct sigaction sa {};
  sa.sa_handler = launch_on_signal;
  ::sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  struct sigaction previous[4]{};
  const int sigs[4] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
  // First, while no thread exists: the guardian that removes whatever the workers started
  // however this process ends (guardian.hpp).
  guardian_ = std::make_unique<LaunchGuardian>(
      concat(launch_tag_prefix, random_value<std::uint64_t>(), "=1"));
  if (::pipe2(launch_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) fail_errno(errno, "pipe2");
  for (int i = 0; i < 4; ++i) ::sigaction(sigs[i], &sa, &previous[i]);
  struct Restore {
    const int* sigs;
    struct sigaction* previous;
    ~Restore() {
      for (int i = 0; i < 4; ++i) ::sigaction(sigs[i], &previous[i], nullptr);
      ::close(launch_signal_pipe[0]);
      ::close(launch_signal_pipe[1]);
      launch_signal_pipe[0] = launch_signal_pipe[1] = -1;
    }
  } restore{sigs, previous};

  StoreOptions so;
  so.token = EnvReader().get("DDP_TOKEN");
  so.timeout = o_.join_timeout;
  port_ = o_.master_port;
  if (!o_.store_url.empty()) {  // etcd: nobody hosts; nodes are numbered as they come
    so.lease_ttl = std::chrono::seconds(5);
    try {
      root_store_ = std::make_unique<Store>(connect_etcd_interruptibly(so));
      store_ = std::make_unique<Store>(root_store_->prefixed("ddprun/"));
    } catch (const RendezvousInterrupted& i) {
      return 128 + i.sig;
    }
  } else if (o_.node_rank ==
             -1) {  // the launcher that can listen there is node 0; the others are clients
    try {
      server_ = std::make_unique<StoreServer>(o_.master_addr, port_, so);
      o_.node_rank = 0;
    } catch (const Error& e) {  // in use (node 0 is there) or not an address of this machine
      if (e.code() != Errc::address_in_use && e.code() != Errc::system) throw;
    }
  } else if (o_.node_rank == 0) {
    try {
      server_ = std::make_unique<StoreServer>(o_.master_addr, port_, so);
    } catch (const Error& e) {
      if (e.code() != Errc::address_in_use) throw;
      std::string why = e.what();  // its advice names the variable; ours names the flags
      if (const auto k = why.find("; choose another MASTER_PORT"); k != std::string::npos)
        why.resize(k);
      fail(Errc::address_in_use, "cannot host the rendezvous store: ", why,
           o_.nnodes > 1
               ? concat("; if another node's launcher runs here with the same node rank (0 "
                        "unless --node-rank says otherwise), give each node its own "
                        "--node-rank or use --rdzv-backend c10d (nodes numbered as they "
                        "join); else pick another ",
                        o_.port_flag)
               : concat("; pick another ", o_.port_flag, ", or --standalone for a free one"));
    }
    port_ = server_->port();
  }
  if (!store_) {
    root_store_ = std::make_unique<Store>(Store(o_.master_addr, port_, so));
    store_ = std::make_unique<Store>(root_store_->prefixed("ddprun/"));
  }
  if (o_.node_rank == -1 && o_.min_nodes > 0) {
    // --nnodes MIN:MAX: the lowest node rank free, also one a node that lost its workers left.
    const std::string me = concat(o_.nproc_per_node, '|', ::getpid());
    for (int k = o_.store_url.empty() ? 1 : 0; k < o_.nnodes && o_.node_rank == -1; ++k)
      if (store_->compare_set(concat("node/", k), "", me) == me) o_.node_rank = k;
    if (o_.node_rank == -1)
      fail(Errc::invalid_argument, "the job at ", host_port(o_.master_addr, port_),
           " already has its maximum of ", o_.nnodes, " nodes (--nnodes ", o_.min_nodes, ":",
           o_.nnodes, "); a node rank is freed when a node's workers are all lost");
    claimed_ = true;
  } else if (o_.node_rank == -1) {
    // Node 0 hosts the store and does not count itself; with etcd every node counts.
    const std::int64_t n = store_->add("arrived", 1) - (o_.store_url.empty() ? 0 : 1);
    if (n >= o_.nnodes)
      fail(Errc::invalid_argument, "more launchers than --nnodes ", o_.nnodes,
           " joined the rendezvous at ", store_->where(),
           o_.store_url.empty() ? " (is another job using it?)"
                                : " (is another job using this --rdzv-id? give each job a new "
                                  "one)");
    o_.node_rank = static_cast<int>(n);
  }
  try {
    register_node();
  } catch (const RendezvousInterrupted& i) {
    return 128 + i.sig;
  }
  prepare_dirs();
  LaunchFailure f;
  int failed_in_a_row = 0;
  std::chrono::milliseconds delay{0};
  for (int attempt = first_attempt_;; ++attempt) {
    if (delay.count() > 0) wait_before_restart(delay, attempt);
    if (elastic_restart() && attempt > first_attempt_ && interrupted_ == 0) {
      try {
        next_round(attempt);
      } catch (const RendezvousInterrupted& i) {
        return 128 + i.sig;
      }
    }
    const auto began = Clock::now();
    f = run_attempt(attempt);
    if (membership_changed_ && interrupted_ == 0 && f.code == 0) {  // torchrun's way
      membership_changed_ = false;
      say("a node is waiting to enter: restarting every worker with it (a membership change, "
          "not counted in --max-restarts)");
      delay = std::chrono::milliseconds(0);
      continue;
    }
    if (f.code == 0 && restarts_ > 0)
      say("every worker succeeded after ", restarts_, restarts_ == 1 ? " restart" : " restarts");
    if (f.code == 0 || !f.restartable || interrupted_ != 0 || restarts_ >= o_.max_restarts) break;
    ++restarts_;
    failed_in_a_row = Clock::now() - began >= o_.restart_backoff_reset ? 1 : failed_in_a_row + 1;
    delay = restart_delay(failed_in_a_row);
    say("restarting the workers",
        delay.count() > 0 ? concat(" in ", seconds_text(delay), " s") : std::string(), " (restart ",
        restarts_, " of ", o_.max_restarts, ")");
  }
  if (!lost_logs_.empty()) {
    std::string which;
    for (const auto& l : lost_logs_) which += concat(which.empty() ? "" : ", ", l);
    const std::string lost =
        lost_logs_.size() == 1 ? std::string("a log") : concat(lost_logs_.size(), " logs");
    if (f.code == 0) {
      f = LaunchFailure{
          o_.node_rank, 1, false,
          concat("every worker succeeded, but ", lost, " could not be written in full: ", which)};
      say(f.what, "; exit status 1");
    } else {
      say("also, ", lost, " could not be written in full: ", which);
    }
  }
  if (f.code != 0) write_own_error_file(f);
  finish();
  return f.code;
}

}  // namespace detail

/// Runs `options.command` as `nproc_per_node` workers on this node, as one node of a job of
/// `nnodes`, and returns the status a launcher should exit with: 0 when every worker of every node
/// succeeded, else the root cause's exit status (128 + N for signal N). Node 0 hosts the
/// rendezvous store. While it runs, SIGINT, SIGTERM and SIGHUP are forwarded to the workers (a
/// second one kills them) and SIGCHLD is handled; the previous handlers are restored afterwards.
/// Throws ddp::Error for bad options and when the nodes cannot meet (Errc::invalid_argument,
/// Errc::timeout, Errc::address_in_use, ...).
inline int launch(const LaunchOptions& options) { return detail::LaunchAgent(options).run(); }

DDP_END_NAMESPACE
