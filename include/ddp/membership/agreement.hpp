// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How the survivors of a failure agree on who is alive and form a communicator of themselves
/// (Communicator::shrink), over the rendezvous store. The store is the one place every rank
/// reads alike, so each decision is one compare-and-set there: the first proposal wins and every
/// rank follows it, whoever made it.
///
/// Round k of forming membership epoch E (keys under the communicator's base prefix,
/// "e<E>/r<k>/"):
///  1. each survivor says it is alive ("alive/<old rank>"), then waits until every candidate
///     (round 0: every rank; later rounds: the previous round's members) has either said so or
///     is known dead ("exit/<old rank>" of the old communicator, which the store writes when a
///     process's connection closes), or until ShrinkOptions::wait_for_ranks has passed;
///  2. it proposes the candidates that said they are alive; "members" takes the first proposal;
///     a rank left out fails with Errc::aborted (it is fenced: a stopped rank that wakes up;
///     its old communicator was poisoned by the caller, Communicator::shrink, when it began);
///  3. the members connect a new backend under "e<E>/r<k>/comm/", ranks renumbered densely in
///     the order of their old ranks; a member that dies meanwhile fails the others at once (its
///     connection's on-close record sets that communicator's "failed" key);
///  4. each member says whether it connected ("ready/<old rank>"); "outcome" takes the first
///     verdict: "ok" once every member is ready, "retry" once one has failed or died. On
///     "retry" the survivors go to round k + 1, so a second failure during the agreement costs
///     one more round, never a split.
/// Once formed, "superseded" of the old communicator names the new epoch and its members: a
/// fenced rank that later calls the old communicator reads it and fails naming the epoch.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/membership/growth.hpp"
#include "ddp/membership/watch.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Test hook for fault injection: called with the phase of shrink() reached ("alive",
/// "decided", "connected", "ready"); tests kill the process there. Null outside tests.
inline void (*&shrink_phase_hook() noexcept)(const char*) {
  static void (*hook)(const char*) = nullptr;
  return hook;
}

/// BackendInit::reach_window of a membership change's connection under `timeout`: a quarter of
/// it, at least 1 s and at most 10 s, never past the timeout.
[[nodiscard]] inline std::chrono::milliseconds reach_window_for(
    std::chrono::milliseconds timeout) noexcept {
  using std::chrono::milliseconds;
  return std::min(timeout, std::clamp<milliseconds>(timeout / 4, std::chrono::seconds(1),
                                                    std::chrono::seconds(10)));
}

/// One membership change of communicator `old` (see the file comment).
class MembershipChange {
 public:
  MembershipChange(MembershipWatch& old, int old_rank, int old_size, const ShrinkOptions& o);

  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// Says in the old communicator's store space that it is being replaced ("shrinking": the
  /// epoch), so that a rank coming back to it after a long absence learns so before acting.
  void announce();
  [[nodiscard]] int round() const noexcept { return round_; }

  /// Steps 1 and 2 of the current round: the members (old ranks, ascending). Fails with
  /// Errc::aborted when this rank is left out.
  std::vector<int> decide();

  /// The new communicator's store prefix (under the job's), and this rank's place in it.
  [[nodiscard]] std::string prefix() const { return concat(old_.base_prefix, tag(), "comm/"); }
  [[nodiscard]] int new_rank() const;

  /// Before saying it is alive: should this process die from then on, the store fails the
  /// round's connecting at once, and marks it gone in the old communicator (a later round does
  /// not wait for it).
  void watch_connecting();

  /// Steps 3-4: whether the round formed the communicator (every member connected); false:
  /// another round, without the members that failed or died, and, when members could not
  /// connect to each other (`cut`: the members this rank could not reach, by their new ranks),
  /// without the fewest members whose removal leaves a set that all reach each other. Fails with
  /// Errc::aborted when this rank is among those left out.
  bool settle(bool connected, const std::vector<int>& cut = {});

 private:
  [[nodiscard]] std::string tag() const { return concat("e", epoch_, "/r", round_, "/"); }

  /// The value at `key` (under the base prefix), "" when absent, without waiting.
  std::string peek(const std::string& key) { return peek_key(*base_, key); }

  void hook(const char* phase) const {
    if (shrink_phase_hook() != nullptr) shrink_phase_hook()(phase);
  }

  /// Whether rank r is known gone: the store's mark, or (a process on this machine) its pid
  /// found ended, which this rank then marks for the others (no lease to wait out).
  bool gone(int r);
  /// Whether rank r's process ran out of heartbeat (the store's mark).
  bool stalled(int r) const;

  /// Waits until every candidate has said it is alive or is known dead, or wait_ has passed, or
  /// another rank has decided; returns the candidates alive.
  std::vector<int> await_candidates(const std::string& at);

  [[noreturn]] void excluded(const std::string& why);

  /// After a round that some member could not connect: waits (until the deadline) for every
  /// member's report, then the members that reach each other (see keep_connected), as the
  /// round's outcome ("retry:<ranks>"; "retry" when no member reported a cut).
  std::string partition_outcome(const std::string& at);

  /// Runs body, turning the loss of the store into an error that says what it means here.
  template <class F>
  auto guarded(const F& body) -> decltype(body()) {
    try {
      return body();
    } catch (const Error& e) {
      if (e.code() != Errc::peer_lost || !old_.root_store->lost()) throw;
      fail(Errc::peer_lost, "rank ", me_, ": shrink: the rendezvous store at ",
           old_.root_store->host(), ":", old_.root_store->port(),
           " is gone (its process ended or stopped answering: when rank 0 hosts it, losing rank "
           "0 loses it), so the survivors cannot agree. Run the job under ddprun or ddp::spawn, "
           "whose store outlives every worker, or keep the store in etcd (DDP_STORE) (",
           e.what(), ")");
    }
  }

  MembershipWatch& old_;
  int me_;
  int size_;
  std::uint64_t epoch_;
  int round_ = 0;
  std::chrono::milliseconds wait_{};
  Clock::time_point deadline_;
  std::shared_ptr<Store> base_;
  std::vector<int> candidates_, members_;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/membership/impl/agreement.ipp"
#endif
