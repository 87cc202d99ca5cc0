// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// LaunchAgent's rendezvous: the agents of a job meet in the rendezvous store (ddprun's own, or
/// etcd), agree on the node ranks, the workers' address and port and, with --nnodes MIN:MAX, on
/// each round's members; a late node waits for the next round.

#include "agent.hpp"

DDP_BEGIN_NAMESPACE
namespace detail {

inline int LaunchAgent::pick_worker_port() const {
  std::uint64_t x = random_value<std::uint64_t>();
  for (int i = 0; i < 64; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const int port = 15000 + static_cast<int>((x >> 33) % 17000);
    try {
      const Fd fd = listen_tcp(worker_addr_.empty() ? o_.master_addr : worker_addr_, port, 1);
      return port;
    } catch (const Error&) {
    }
  }
  const Fd fd = listen_tcp(worker_addr_.empty() ? o_.master_addr : worker_addr_, 0, 1);
  return local_port(fd.get());
}

inline Store LaunchAgent::connect_etcd_interruptibly(StoreOptions so) {
  const auto until = Clock::now() + o_.join_timeout;
  // Endpoints that refuse all along fail after the window, counted from the first probe.
  so.tried_since = Clock::now();
  so.unreachable_window = unreachable_window_for(o_.join_timeout);
  for (;;) {
    check_join_signals();
    StoreOptions probe = so;
    probe.timeout = std::min<std::chrono::milliseconds>(
        std::chrono::seconds(1),
        std::max(std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()),
                 std::chrono::milliseconds(1)));
    try {
      (void)Store(connect_etcd(o_.store_url, "--rdzv-endpoint", etcd_namespace(), probe));
      return Store(connect_etcd(o_.store_url, "--rdzv-endpoint", etcd_namespace(), so));
    } catch (const Error& e) {
      if (e.code() != Errc::timeout && e.code() != Errc::peer_lost) throw;
      if (Clock::now() >= until)
        fail(Errc::timeout, "the etcd cluster at ", o_.store_url.substr(7),
             " did not answer within ", fixed1(static_cast<double>(o_.join_timeout.count()) / 1000),
             " s (", e.what(), "); is a majority of its members up, and --rdzv-endpoint right?");
    }
  }
}

inline void LaunchAgent::register_node() {
  if (!server_) {
    // Should this agent die, the others stop waiting for it (the store applies this record).
    const std::pair<std::string, std::string> gone[] = {{concat("agent_gone/", o_.node_rank), ""}};
    store_->set_on_close(gone);
  }
  if (!o_.store_url.empty()) worker_addr_ = store_->local_address();  // reaches the cluster
  if (leader()) {
    worker_port_ = pick_worker_port();
    store_->set("worker_port", std::to_string(worker_port_));
    store_->set("worker_addr", worker_addr_);
  }
  const std::string me = concat(o_.nproc_per_node, '|', ::getpid());
  // --nnodes MIN:MAX: a node that claims its rank once the job started is late (a node that
  // left freed that rank: its workers join as newcomers).
  const std::string started[] = {"members"};
  replacing_ = o_.min_nodes > 0 && store_->check(started);
  const bool taken = !claimed_ && store_->compare_set(concat("node/", o_.node_rank), "", me) != me;
  if (taken && !o_.store_url.empty())
    fail(Errc::invalid_argument, "node rank ", o_.node_rank, " is already taken in ",
         store_->where(),
         ": another launcher of this job has it, or a run that used this --rdzv-id before (its "
         "keys vanish a minute after it ended): give each node its own --node-rank (or none), "
         "and each job a new --rdzv-id");
  if (taken)
    fail(Errc::invalid_argument, "node rank ", o_.node_rank,
         " is already taken by another launcher (each node needs its own --node-rank from 0 "
         "to ",
         o_.nnodes - 1,
         o_.min_nodes > 0 ? "; with --nnodes MIN:MAX a node frees its rank when its workers "
                            "are all lost, and --rdzv-backend c10d takes a free one)"
                          : ")");
  (void)store_->add("agents", 1);
  if (o_.min_nodes > 0) {
    register_node_elastic();
    return;
  }
  std::vector<std::string> keys;
  for (int i = 0; i < o_.nnodes; ++i) keys.push_back(concat("node/", i));
  // In slices, so that SIGINT, SIGTERM or SIGHUP ends the wait at once (128 + N).
  const auto join_until = Clock::now() + o_.join_timeout;
  std::vector<std::string> missing = keys;
  while (!missing.empty() && Clock::now() < join_until) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(join_until - Clock::now());
    missing = store_->missing_after(keys, std::min(left, std::chrono::milliseconds(200)));
    check_join_signals();
  }
  if (!missing.empty()) {
    std::string who;
    for (const auto& k : missing) who += concat(who.empty() ? "" : ", ", k.substr(5));
    fail(Errc::timeout, o_.nnodes - static_cast<int>(missing.size()), "/", o_.nnodes,
         " nodes joined within ", fixed1(static_cast<double>(o_.join_timeout.count()) / 1000),
         " s; missing node", missing.size() == 1 ? " " : "s ", who, " (start ", o_.name,
         " on every node with the same --nnodes, ", o_.endpoint_flags, ")");
  }
  for (int i = 0; i < o_.nnodes; ++i) {
    const int n = std::atoi(store_->get(keys[static_cast<std::size_t>(i)]).c_str());
    if (i < o_.node_rank) base_rank_ += n;
    world_ += n;
  }
  read_worker_address();
}

inline bool LaunchAgent::take_members(const std::vector<int>& members) {
  base_rank_ = world_ = 0;
  round_members_ = members;
  bool in = false;
  for (int i : members) {
    const int n = std::atoi(store_->get(concat("node/", i)).c_str());
    if (i < o_.node_rank) base_rank_ += n;
    if (i == o_.node_rank) in = true;
    world_ += n;
  }
  return in;
}

inline std::vector<int> LaunchAgent::nodes_present() {
  std::vector<int> out;
  for (int i = 0; i < o_.nnodes; ++i) {
    const std::string claim[] = {concat("node/", i)}, gone[] = {concat("agent_gone/", i)};
    if (store_->check(claim) && !store_->check(gone)) out.push_back(i);
  }
  return out;
}

inline void LaunchAgent::next_round(int attempt) {
  const std::string key = concat("members/", attempt);
  const auto until = Clock::now() + o_.join_timeout;
  for (;;) {
    check_join_signals();
    const std::string k[] = {key};
    if (store_->check(k)) break;
    const std::vector<int> here = nodes_present();
    if (!here.empty() && here.front() == o_.node_rank &&
        static_cast<int>(here.size()) >= o_.min_nodes) {
      std::string list;
      for (int i : here) list += concat(list.empty() ? "" : ",", i);
      (void)store_->compare_set(key, "", list);
      store_->set("round", std::to_string(attempt));
      break;
    }
    if (Clock::now() >= until)
      fail(Errc::timeout, "fewer than ", o_.min_nodes, " nodes (--nnodes ", o_.min_nodes, ":",
           o_.nnodes, ") were there to restart the workers within ",
           fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s");
    (void)store_->missing_after(std::vector<std::string>{key}, std::chrono::milliseconds(100));
  }
  waiting_seen_ = store_->add("waiting", 0);
  if (!take_members(detail::parse_ranks(store_->get(key))))
    fail(Errc::invalid_argument, "node ", o_.node_rank, " was left out of the job's round ",
         attempt, " (more than --nnodes ", o_.nnodes, " nodes?)");
}

inline void LaunchAgent::await_round_with_me() {
  (void)store_->add("waiting", 1);
  const auto until = Clock::now() + o_.join_timeout;
  for (int seen = std::atoi(detail::peek_key(*store_, "round").c_str());;) {
    check_join_signals();
    for (int a = seen + 1;; ++a) {
      const std::string k[] = {concat("members/", a)};
      if (!store_->check(k)) break;
      seen = a;
      if (take_members(detail::parse_ranks(store_->get(k[0])))) {
        first_attempt_ = a;
        waiting_seen_ = store_->add("waiting", 0);
        return;
      }
    }
    if (Clock::now() >= until)
      fail(Errc::timeout, "node ", o_.node_rank, " was not taken into the running job within ",
           fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

inline void LaunchAgent::read_worker_address() {
  if (leader()) return;
  worker_port_ = std::atoi(store_->get("worker_port").c_str());
  if (!o_.store_url.empty()) worker_addr_ = store_->get("worker_addr");
}

inline void LaunchAgent::check_join_signals() {
  unsigned char sigs[64];
  const ssize_t n = ::read(launch_signal_pipe[0], sigs, sizeof sigs);  // non-blocking
  for (ssize_t i = 0; i < n; ++i) {
    if (sigs[i] == SIGCHLD) continue;
    say("received ", signal_name(sigs[i]), " while waiting for the nodes to join: stopping");
    throw RendezvousInterrupted{sigs[i]};
  }
}

inline void LaunchAgent::register_node_elastic() {
  const auto join_until = Clock::now() + o_.join_timeout;
  const std::string members_key[] = {"members"};
  if (leader()) {
    std::vector<int> there;
    auto settled = Clock::time_point::max();
    for (;;) {
      check_join_signals();
      std::vector<int> now;
      for (int i = 0; i < o_.nnodes; ++i) {
        const std::string k[] = {concat("node/", i)};
        if (store_->check(k)) now.push_back(i);
      }
      if (now.size() != there.size()) settled = Clock::now() + o_.last_call;
      there = now;
      const int n = static_cast<int>(there.size());
      if (n >= o_.nnodes || (n >= o_.min_nodes && Clock::now() >= settled)) break;
      if (Clock::now() >= join_until)
        fail(Errc::timeout, n, "/", o_.min_nodes, " nodes (at least) joined within ",
             fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s (start ", o_.name,
             " on every node with the same --nnodes, ", o_.endpoint_flags, ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::string list;
    for (int i : there) list += concat(list.empty() ? "" : ",", i);
    (void)store_->compare_set("members", "", list);
  }
  while (!store_->check(members_key)) {
    check_join_signals();
    if (Clock::now() >= join_until)
      fail(Errc::timeout, "node 0 did not start the job within ",
           fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s (start ", o_.name,
           " on node 0 with the same --nnodes, ", o_.endpoint_flags, ")");
    (void)store_->missing_after(std::vector<std::string>{"members"},
                                std::chrono::milliseconds(200));
  }
  const std::vector<int> members = detail::parse_ranks(store_->get("members"));
  const bool in = take_members(members);
  waiting_seen_ = store_->add("waiting", 0);
  if ((!in || replacing_) && elastic_restart()) {
    // torchrun's way: every worker restarts with the new node at the next round.
    say("node ", o_.node_rank,
        " came after the job started: the running workers are restarted with this node's (a "
        "membership change)");
    await_round_with_me();
    read_worker_address();
    return;
  }
  if (!in || replacing_) {  // late: ranks after every rank given so far
    late_ = true;
    base_rank_ =
        world_ + static_cast<int>(store_->add("late_ranks", o_.nproc_per_node)) - o_.nproc_per_node;
    world_ = base_rank_ + o_.nproc_per_node;
    say("node ", o_.node_rank, " came after the job started: its workers (ranks ", base_rank_,
        " to ", world_ - 1, ") join the running job");
  }
  read_worker_address();
}

inline void LaunchAgent::finish() {
  try {
    store_->add("exited", 1);
    if (server_) {
      const auto until = Clock::now() + std::chrono::seconds(10);
      while (store_->add("exited", 0) < store_->add("agents", 0) && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error&) {  // node 0 is gone already: nothing left to coordinate
  }
}

}  // namespace detail
DDP_END_NAMESPACE
