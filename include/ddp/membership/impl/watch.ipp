// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/membership/watch.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE int MembershipWatch::waiting_to_enter() const {
  if (!root_store || base_prefix != job_prefix) return 0;
  Store base = root_store->prefixed(base_prefix).unwatched();
  return static_cast<int>(std::max<std::int64_t>(0, base.add("join/next", 0) - joins_seen));
}

DDP_INLINE bool MembershipWatch::after_gap(std::chrono::milliseconds limit) {
  timespec ts{};
  (void)::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  const std::int64_t now = std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  const std::int64_t last = last_call_ns.exchange(now, std::memory_order_relaxed);
  const std::int64_t half = std::chrono::nanoseconds(limit).count() / 2;
  return last != 0 && now - last >= half;
}

DDP_INLINE std::string MembershipWatch::excluded(int rank, const char* name) const {
  if (stalled())
    return concat("rank ", rank, ": ", name,
                  ": this process sent no sign of life to the rendezvous store for longer than "
                  "the heartbeat (",
                  options.heartbeat.count(),
                  " ms: it was stopped, hung or cut off), so the job counts it as lost and "
                  "goes on without it; it can never act on this communicator again: restart "
                  "the process (it may rejoin the job as a new rank)");
  const std::string v = peek_membership("superseded");
  if (v.empty()) return {};
  const std::size_t colon = v.find(':');
  const std::string members = v.substr(colon + 1);
  const std::vector<int> ranks = parse_ranks(members);
  if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) return {};
  return concat("rank ", rank, ": ", name,
                ": this rank was excluded from the communicator: the other ranks formed "
                "membership epoch ",
                v.substr(0, colon), " of ranks ", members,
                " without it (it was stopped or too slow to take part); it can never act on "
                "this communicator again: restart the process (it may rejoin the job as a new "
                "rank)");
}

DDP_INLINE std::string MembershipWatch::shrinking(int rank, const char* name) const {
  const std::string next = peek_membership("shrinking");
  if (next.empty()) return {};
  return concat("rank ", rank, ": ", name,
                ": the other ranks are replacing this communicator after a failure (forming "
                "membership epoch ",
                next, "): call shrink() to take part");
}

DDP_INLINE bool MembershipWatch::stalled() const {
  if (!root_store || root_store->lost() || job_prefix.empty() || options.heartbeat.count() <= 0)
    return false;
  try {
    Store plain = root_store->unwatched();
    const std::string k[] = {concat(job_prefix, "stalled/", world_rank)};
    return plain.check(k);
  } catch (...) {
    return false;
  }
}

DDP_INLINE void MembershipWatch::watch_peers(std::function<void(const Error&)> lost) {
  if (!root_store || options.heartbeat.count() <= 0 || job_prefix.empty() ||
      world_ranks.size() < 2 || stall_tick != 0)
    return;
  stall_tick = root_store->add_tick([this, lost = std::move(lost)](Store& s) {
    const std::int64_t n = s.add(concat(job_prefix, "stalls"), 0);
    if (n == stalls_seen || stall_reported) return;
    for (std::size_t r = 0; r < world_ranks.size(); ++r) {
      const std::string k[] = {concat(job_prefix, "stalled/", world_ranks[r])};
      if (static_cast<int>(r) == world_rank_in_group || !s.check(k)) continue;
      stall_reported = true;
      const int gone = static_cast<int>(r);
      lost(Error(Errc::peer_lost, concat("rank ", world_rank_in_group, ": "), -1,
                 concat("rank ", r, " (world rank ", world_ranks[r],
                        ") stopped answering: no sign of life reached the rendezvous store for ",
                        options.heartbeat.count(),
                        " ms (the heartbeat; its process is stopped, hung or cut off), so the "
                        "job counts it as lost; shrink() to go on without it"),
                 {gone}));
      return;
    }
    stalls_seen = n;
  });
}

DDP_INLINE void MembershipWatch::unwatch_peers() {
  if (stall_tick != 0 && root_store) root_store->remove_tick(stall_tick);
  stall_tick = 0;
}

DDP_INLINE std::string MembershipWatch::peek_membership(const char* key) const {
  if (!root_store || root_store->lost()) return {};
  try {
    Store plain = root_store->prefixed(prefix).unwatched();
    return peek_key(plain, key);
  } catch (...) {
    return {};
  }
}

}  // namespace detail
DDP_END_NAMESPACE
