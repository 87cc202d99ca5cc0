// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/state.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <functional>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE CommState::CommState() = default;
DDP_INLINE CommState::~CommState() = default;

DDP_INLINE void CommState::configure(const Options& o) {
  options = o;
  recorder.resize(o.trace_entries);
  install_error_file_handler();  // an uncaught exception reaches the launcher's error file
}

DDP_INLINE void CommState::abandon() noexcept {
  (void)executor.release();
  (void)new std::shared_ptr<StoreServer>(std::move(server));
  (void)new std::shared_ptr<Store>(std::move(root_store));
  (void)new std::shared_ptr<Store>(std::move(store));
#if DDP_HAS_CUDA
  (void)staging.release();
#endif
}

DDP_INLINE void CommState::relay_failure(int rank, const Error& e) {
  // Leaving, this rank then records this failure ("left/<rank>"), not a finish: ranks already
  // past the rendezvous, waiting for it in a collective, read that record.
  poison_with(e);
  if (e.origin_rank() >= 0 && e.origin_rank() != rank)  // another rank's, via the store
    fail_within(e, "rank ", rank, ": ");
  std::string_view why = e.what();
  if (const std::string own = concat("rank ", rank, ": "); why.starts_with(own))
    why.remove_prefix(own.size());  // the relayed message names the rank once
  if (store && !store->lost()) {
    try {
      (void)store->compare_set(
          "failed", "",
          Store::stop_value(Error(e.code(), concat("the rendezvous failed on rank ", rank, ": "),
                                  rank, why, e.lost_ranks())));
    } catch (...) {  // the store is gone too: the peers learn from it
    }
  }
}

DDP_INLINE void CommState::monitored_barrier(int rank, int size, std::chrono::milliseconds timeout,
                                             bool wait_all_ranks) {
  detail::monitored_barrier(*store, monitored_barriers++, rank, size, timeout, wait_all_ranks);
}

DDP_INLINE void CommState::check_membership_after_gap(int rank, const char* name) {
  // Half the time after which the others may have left it out: the timeout, or the heartbeat.
  const auto limit = options.heartbeat.count() > 0 ? std::min(options.timeout, options.heartbeat)
                                                   : options.timeout;
  if (!after_gap(limit) || !root_store) [[likely]]
    return;
  std::string why = excluded(rank, name);
  if (why.empty()) why = shrinking(rank, name);
  if (!why.empty()) {
    poison_with(why, Errc::aborted);
    fail(Errc::aborted, why);
  }
}

}  // namespace detail
DDP_END_NAMESPACE
