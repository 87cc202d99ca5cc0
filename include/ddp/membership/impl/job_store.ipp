// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/membership/job_store.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::shared_ptr<Store> JobStore::connect_store(const Environment& env) {
  const EnvReader launcher;  // what the launcher that hosts the store says
  launcher_prefix = concat("ddp/", launcher.get("DDP_RESTART_COUNT", "0"), "/");
  prefix = concat(launcher_prefix, options.group, "/");
  base_prefix = prefix;
  job_prefix = prefix;
  for (int r = 0; r < env.world_size; ++r) world_ranks.push_back(r);
  StoreOptions so;
  so.timeout = options.timeout;
  so.unreachable_window = unreachable_window_for(options.timeout);
  so.token = options.token;
  so.refusal_key = prefix + "failed";  // a wrong token fails this rendezvous at once
  so.refusal_rank = env.rank;
  int store_port = env.store_port != 0 ? env.store_port : env.master_port;
  const int ports = env.store_port != 0 ? std::max(1, env.store_ports) : 1;
  // With several candidate ports, the store says whose it is: a probing rank must not join
  // another job's store that took one of them.
  const std::string job = store_job_name(env);
  const bool hosted = options.external_store || launcher.get("DDP_STORE_HOSTED") == "1";
  if (!options.store.empty()) {  // an etcd cluster: nobody hosts it
    root_store = open_etcd_store(options.store, env.rank, options.heartbeat, so);
  } else {
    if (env.rank == 0 && !hosted) {
      store_port = host_store(server, env, store_port, ports, so);
    } else if (ports > 1) {
      store_port = find_store(env, store_port, ports, so, job, rendezvous_deadline);
    }
    root_store = std::make_shared<Store>(env.master_addr, store_port, so);
    if (server && ports > 1) root_store->set(store_job_key, job);
  }
  store = std::make_shared<Store>(
      root_store->prefixed(prefix).watching("failed").with_deadline(rendezvous_deadline));
  world_size = env.world_size;
  claim_rank(*store, env.rank, options.group);
  joined = true;
  // Should this process die before the rendezvous is over, the store tells the others at once,
  // and counts it as gone (the store's host does not wait for it to leave).
  const std::pair<std::string, std::string> on_close[] = {
      {"failed",
       Store::stop_value(Error(Errc::peer_lost,
                               concat("the rendezvous failed on rank ", env.rank, ": "), env.rank,
                               "its process closed its connection to the store (it "
                               "died or was killed) before the rendezvous was over",
                               {env.rank}))},
      {concat("exit/", env.rank), ""}};
  store->set_on_close(on_close);
  return store;
}

DDP_INLINE void JobStore::connect_to_job(const Environment& env) {
  if (env.master_port == 0 && options.store.empty())
    fail(Errc::invalid_argument,  // enter_state names the rank and the call
         "MASTER_PORT is not set; export MASTER_ADDR and MASTER_PORT of the running job, or "
         "launch with ddprun");
  const EnvReader launcher;
  launcher_prefix = concat("ddp/", launcher.get("DDP_RESTART_COUNT", "0"), "/");
  prefix = concat(launcher_prefix, options.group, "/");
  base_prefix = prefix;
  job_prefix = prefix;
  StoreOptions so;
  so.timeout = options.timeout;
  so.unreachable_window = unreachable_window_for(options.timeout);
  so.token = options.token;
  int store_port = env.store_port != 0 ? env.store_port : env.master_port;
  const int ports = env.store_port != 0 ? std::max(1, env.store_ports) : 1;
  if (!options.store.empty()) {
    root_store = open_etcd_store(options.store, env.rank, options.heartbeat, so);
    return;
  }
  if (ports > 1)
    store_port = find_store(env, store_port, ports, so, store_job_name(env),
                            Deadline::after(options.timeout).at);
  root_store = std::make_shared<Store>(
      env.master_addr.empty() ? std::string("127.0.0.1") : env.master_addr, store_port, so);
}

DDP_INLINE void JobStore::end_rendezvous() {
  if (!store) return;
  *store = store->with_deadline(Clock::time_point::max());
  // This communicator's mark, and (for one made by shrink()) the process's mark in init()'s.
  std::vector<std::pair<std::string, std::string>> on_close{
      {concat(store->prefix(), "exit/", world_rank_in_group), ""}};
  if (const std::string mine = process_exit_key(); !mine.empty()) on_close.emplace_back(mine, "");
  Store root = root_store ? root_store->unwatched() : store->prefixed("");
  if (root_store) {
    root.set_on_close(on_close);
    // Where this process runs: a survivor on the same machine can tell that it died without
    // waiting for the store to notice (MembershipChange).
    if (!job_prefix.empty()) root.set(concat(job_prefix, "proc/", world_rank), process_identity());
    // Heartbeat: should this process stop signing (stopped, hung, cut off), the store counts
    // it gone (the records above), marks it stalled and counts the stall for the watchers.
    if (options.heartbeat.count() > 0 && !job_prefix.empty()) {
      const LeaseRecord on_expire[] = {
          {concat(job_prefix, "stalled/", world_rank), "", 0, false},
          {concat(job_prefix, "stalls"), "", 1, true},
          {concat(launcher_prefix, "left/", world_rank), "its heartbeat stopped", 0, false}};
      root.lease(options.heartbeat, on_expire);
    }
  } else {
    const std::pair<std::string, std::string> own[] = {{concat("exit/", world_rank_in_group), ""}};
    store->set_on_close(own);
  }
}

DDP_INLINE bool JobStore::rank_gone(int r) const {
  const auto seen = [&](const std::string& key) {
    const std::string k[] = {key};
    return root_store->check(k);
  };
  if (seen(concat(prefix, "exit/", r))) return true;
  const auto i = static_cast<std::size_t>(r);
  return i < world_ranks.size() && !job_prefix.empty() &&
         seen(concat(job_prefix, "gone/", world_ranks[i]));
}

DDP_INLINE std::string JobStore::process_exit_key() const {
  return job_prefix.empty() ? std::string() : concat(job_prefix, "gone/", world_rank);
}

DDP_INLINE void JobStore::announce_leaving(const std::optional<Error>& why, std::uint64_t issued) {
  if (!store || !joined || store->lost()) return;
  try {
    Store plain = store->unwatched();
    const int r = world_rank_in_group;
    if (!why)
      plain.set(concat("done/", r), std::to_string(issued));
    else
      (void)plain.compare_set(concat("left/", r), "", Store::stop_value(*why));
    plain.set(concat("exit/", r), "");
  } catch (...) {  // leaving anyway
  }
}

DDP_INLINE void JobStore::wait_for_the_others(bool connected, bool failed) {
  if (!store || !joined || store->lost() || !server || server.use_count() > 1) return;
  try {
    Store plain = store->unwatched();  // the waits below must not end at "failed"
    const auto limit =
        std::min<std::chrono::milliseconds>(options.timeout, std::chrono::seconds(10));
    if (connected && !failed) {
      std::vector<std::string> keys;
      for (int r = 0; r < world_size; ++r) keys.push_back(concat("exit/", r));
      (void)plain.missing_after(keys, limit);
    } else if (!connected) {
      // Within the rendezvous's one timeout (and a moment for the others to read why).
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(rendezvous_deadline - Clock::now());
      linger_after_failed_rendezvous(plain,
                                     std::clamp(left, std::chrono::milliseconds(250), limit));
    }
  } catch (...) {  // leaving anyway
  }
}

DDP_INLINE void JobStore::linger_after_failed_rendezvous(Store& plain,
                                                         std::chrono::milliseconds limit) const {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    bool all_left = true, all_claimed = true;
    for (int r = 0; r < world_size && all_left; ++r) {
      const std::string claim = concat("claim/", r);
      const std::string left = concat("exit/", r);
      if (!plain.check(std::span<const std::string>(&claim, 1)))
        all_claimed = false;
      else if (!plain.check(std::span<const std::string>(&left, 1)))
        all_left = false;
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    if ((all_left && (all_claimed || waited > std::chrono::seconds(1))) || waited > limit) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace detail
DDP_END_NAMESPACE
