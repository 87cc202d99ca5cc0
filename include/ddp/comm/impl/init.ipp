// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/init.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE BackendInit begin_init(CommState& state, const Environment& env, Options& options,
                                  bool needs_store, std::exception_ptr& bad_setting) {
  if (env.rejoin && needs_store)
    fail(Errc::invalid_argument, "rank ", env.rank,
         ": Communicator::init: the launcher restarted this process to join the running job "
         "(DDP_REJOIN is set): make its communicator with Communicator::enter (README, \"Fault "
         "tolerance\"), or launch with --on-failure shrink, which restarts nobody");
  options = options.with_env(EnvReader(), bad_setting);
  if (!bad_setting &&
      (options.heartbeat.count() < 0 ||
       (options.heartbeat.count() > 0 && options.heartbeat < std::chrono::milliseconds(100)))) {
    try {
      fail(Errc::invalid_argument, "rank ", env.rank, ": Options::heartbeat is ",
           options.heartbeat.count(),
           " ms; give 0 (no heartbeat) or at least 100 ms (shorter, a process merely waiting for "
           "a core would count as lost)");
    } catch (const Error&) {
      bad_setting = std::current_exception();
    }
  }
  state.configure(options);
  state.rendezvous_deadline = Deadline::after(options.timeout).at;
  state.world_rank = env.rank;
  BackendInit bi;
  bi.rank = env.rank;
  bi.size = env.world_size;
  bi.local_rank = env.local_rank;
  state.local_rank_hint = env.local_rank;
  bi.options = options;
  // A world of one joins a store too when a launcher hosts it (ddprun, ddp::spawn): it can then
  // admit newcomers (grow()).
  const bool hosted = options.external_store || EnvReader().get("DDP_STORE_HOSTED") == "1" ||
                      !options.store.empty();
  if ((env.world_size > 1 || (hosted && (env.master_port != 0 || !options.store.empty()))) &&
      needs_store) {
    if (env.master_port == 0 && options.store.empty()) {
      fail(Errc::invalid_argument, "rank ", env.rank,
           ": Communicator::init: MASTER_PORT is not set (world size ", env.world_size,
           "); export MASTER_ADDR and MASTER_PORT, or launch with ddprun");
    }
    if (env.master_addr.empty() && options.store.empty()) {
      const int hosts = (env.world_size + env.local_world_size - 1) / env.local_world_size;
      fail(Errc::invalid_argument, "rank ", env.rank, ": Communicator::init: the job spans ", hosts,
           " hosts but MASTER_ADDR is not set, and ", env.launcher,
           " does not say which host rank 0 runs on; export MASTER_ADDR=<rank 0's host> to every "
           "rank (mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port>)");
    }
    bi.store = state.connect_store(env);
  }
  if (bad_setting && !bi.store) std::rethrow_exception(bad_setting);
  return bi;
}

DDP_INLINE void refuse_mixed_modes(int rank, const char* what) {
  if ((ddp_program_modes & 3U) != 3U) return;
  fail(Errc::invalid_argument, "rank ", rank, ": ", what,
       ": this program's units were compiled in both of ddp's modes, some header-only and some "
       "with DDP_SEPARATE_COMPILATION (ddp::compiled), so two copies of ddp's state would run "
       "side by side; compile every unit of the program in one mode (link ddp::compiled, or "
       "define DDP_SEPARATE_COMPILATION, in all of them or in none)");
}

DDP_INLINE void inherit_settings(CommState& sub, const CommState& parent, const Options& options) {
  sub.configure(options);
  sub.world_rank = parent.world_rank;
  sub.local_rank_hint = parent.local_rank_hint;
}

DDP_INLINE BackendInit begin_split(CommState& sub, const CommState& parent,
                                   const std::vector<std::pair<int, int>>& all, int color, int rank,
                                   std::uint64_t n, const Options& options) {
  std::vector<std::pair<int, int>> members;  // (key, old rank)
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[static_cast<std::size_t>(r)].first == color)
      members.emplace_back(all[static_cast<std::size_t>(r)].second, r);
  }
  std::sort(members.begin(), members.end());
  inherit_settings(sub, parent, options);
  sub.root_store = parent.root_store;
  sub.server = parent.server;
  sub.prefix = concat(parent.prefix, "split", n, "/", color, "/");
  sub.base_prefix = sub.prefix;
  sub.job_prefix = parent.job_prefix;
  BackendInit bi;
  bi.size = static_cast<int>(members.size());
  for (int i = 0; i < bi.size; ++i) {
    const int old = members[static_cast<std::size_t>(i)].second;
    if (old == rank) bi.rank = i;
    if (static_cast<std::size_t>(old) < parent.world_ranks.size())
      sub.world_ranks.push_back(parent.world_ranks[static_cast<std::size_t>(old)]);
  }
  bi.options = options;
  bi.local_rank = parent.local_rank_hint;
  if (parent.root_store) {
    bi.store = std::make_shared<Store>(parent.root_store->prefixed(sub.prefix).watching("failed"));
    sub.store = bi.store;
    sub.world_size = bi.size;
    sub.joined = true;
  }
  return bi;
}

DDP_INLINE const char* membership_refusal(std::string_view backend, std::string_view what) {
  if (backend == "mpi")
    return what == "shrink"
               ? "it would need an MPI library with ULFM fault tolerance (MPIX_Comm_shrink, as in "
                 "Open MPI 5 built with it)"
               : "MPI cannot add processes to a running job's communicator that way";
  return "this backend has no rendezvous store to agree on a new membership in";
}

}  // namespace detail
DDP_END_NAMESPACE
