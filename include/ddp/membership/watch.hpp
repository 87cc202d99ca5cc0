// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::MembershipWatch: what a member of a communicator knows of its membership: the epoch,
/// the ranks before the last change, the newcomers waiting, and how it learns that the others
/// went on without it (fenced after a stop, excluded by their shrink(), stalled past the
/// heartbeat) or that a peer stopped answering (the heartbeat's watch).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/error.hpp"
#include "ddp/membership/job_store.hpp"
#include "ddp/membership/rendezvous.hpp"
#include "ddp/store/client.hpp"

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

struct MembershipWatch : JobStore {
  /// Membership epoch: 0 from init() or split(), one more at each shrink().
  std::uint64_t epoch = 0;
  /// After shrink(): each rank's number in the communicator it was made from.
  std::vector<int> previous;
  /// The join requests (Communicator::enter) answered so far: every id up to this one.
  std::int64_t joins_seen = 0;
  /// grow() calls on this communicator (every member's the same): tags each decision, since a
  /// grow() that admits nobody leaves the epoch and joins_seen as they were.
  std::uint64_t grow_calls = 0;
  /// When the last call on this communicator began (CLOCK_MONOTONIC_COARSE, ns; 0: none yet).
  std::atomic<std::int64_t> last_call_ns{0};

  /// How many processes asked to join the job (Communicator::enter) since its last growth: one
  /// store read. 0 without a store, or for a communicator that split() made.
  [[nodiscard]] int waiting_to_enter() const;

  /// Whether the call that began now follows a gap of half `limit` or more since the last one
  /// (one clock read): then the others may have left this rank out meanwhile.
  [[nodiscard]] bool after_gap(std::chrono::milliseconds limit);

  /// After a failure: when the other ranks formed a communicator without this rank (shrink()
  /// wrote "superseded": the epoch and the members), the message that says so; else "".
  [[nodiscard]] std::string excluded(int rank, const char* name) const;

  /// When the other ranks are forming a new membership from this communicator (shrink() wrote
  /// "shrinking"), the message that says so; else "".
  [[nodiscard]] std::string shrinking(int rank, const char* name) const;

  /// Whether the store marked this process stalled (its heartbeat lease ran out).
  [[nodiscard]] bool stalled() const;

  /// The heartbeat's watch: after each sign of life, when the store counted a new stall, checks
  /// whether a member of this communicator stalled, and then calls `lost` (once) with why.
  void watch_peers(std::function<void(const Error&)> lost);
  /// Ends the watch (before the backend goes); a tick running now finishes first.
  void unwatch_peers();

 private:
  std::uint64_t stall_tick = 0;   // the watch's tick on root_store (0: none)
  std::int64_t stalls_seen = -1;  // the stall count the watch last checked (its thread only)
  bool stall_reported = false;    // (its thread only)

  /// This communicator's store key `key`, "" when absent or the store is unreachable.
  [[nodiscard]] std::string peek_membership(const char* key) const;
};

#if DDP_BODIES
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
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
