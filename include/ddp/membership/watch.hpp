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

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/membership/impl/watch.ipp"
#endif
