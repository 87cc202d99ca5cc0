// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How a process joins a running job (Communicator::enter) and how the job's members admit it
/// (Communicator::grow), over the rendezvous store, under the prefix of the communicator that
/// init() made (its "join/" keys):
///  1. a newcomer takes a number ("join/next"), writes its request ("join/<id>": the world rank
///     it claims, its process id, then its ticket) and waits for the reply ("join/<id>/reply");
///  2. at a step boundary every member calls grow(); rank 0 reads the requests that arrived
///     since the last growth and answers each with one compare-and-set: refused (written as
///     "refuse <errc> <why>": a ticket unlike the members', the place of a live rank claimed)
///     or admitted ("admit <epoch> <tag>"); a newcomer that gave up meanwhile has written
///     "withdrawn" first and is passed over; a number whose request is not written yet ends the
///     answers there (it and those after it wait for a later grow(), for 5 s, then a number
///     still without a request is passed over). Rank 0 then writes the decision (the requests
///     handled, the members' world ranks, the admitted requests in order) for the members
///     ("e<E>/g<tag>/decision.<call>", the call tagging each grow() of one communicator) and
///     each admitted newcomer ("join/<id>/decision"); the other members wait for it (failing at
///     once should rank 0 die);
///  3. members and newcomers connect a new backend under "e<E>/g<tag>/comm/": the members keep
///     their order (ranks 0..n-1), the newcomers follow in the order of their requests.
/// A process that dies meanwhile fails the others' connecting at once (its connection's
/// on-close record sets that communicator's "failed" key); the members then still hold the
/// communicator they had, and shrink() it.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/membership/watch.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Test hook for fault injection: called with the phase of join() reached ("numbered": its
/// number taken, its request not written; "asked": its request written; "admitted": admitted,
/// not yet connecting). Null outside tests.
inline void (*&join_phase_hook() noexcept)(const char*) {
  static void (*hook)(const char*) = nullptr;
  return hook;
}

/// One growth of the job (step 2's decision).
struct Growth {
  std::int64_t upto = 0;          ///< the requests handled: every id up to this one
  std::vector<int> members;       ///< the members' world ranks, in rank order
  std::vector<std::int64_t> ids;  ///< the admitted requests, in order
  std::vector<int> claims;        ///< their world ranks
  std::int64_t from = 0;          ///< the requests answered before it (its keys' tag)

  [[nodiscard]] std::string text() const;
  /// The decision `t` as rank 0 wrote it; Errc::protocol when it is damaged.
  static Growth parse(std::string_view t, int rank);
};

/// A join request's claimed world rank ("<claim> <pid>" on its first line): -1 when it is not a
/// number from 0 to 2^30.
[[nodiscard]] DDP_INLINE int parse_claim(std::string_view line);

[[nodiscard]] inline std::string join_key(std::int64_t id, std::string_view what = {}) {
  return what.empty() ? concat("join/", id) : concat("join/", id, "/", what);
}
/// A growth's keys: "e<epoch>/g<from>/<what>", `from` the requests answered before it (one
/// epoch may be tried more than once: a growth that admitted nobody leaves the epoch as it was).
[[nodiscard]] inline std::string growth_key(std::uint64_t epoch, std::int64_t from,
                                            std::string_view what) {
  return concat("e", epoch, "/g", from, "/", what);
}

/// Where two tickets (pieces separated by ';') first differ, for a refusal.
[[nodiscard]] DDP_INLINE std::string ticket_difference(std::string_view theirs,
                                                       std::string_view ours);

/// Whether number `id`'s missing request is still awaited: for 5 s after a grow() first saw it
/// missing (the time kept in the store, so a later rank 0 keeps it), then it is passed over (a
/// number taken without a request, by a broken or hostile client, or a newcomer that died).
DDP_INLINE bool late_request(Store& base, std::int64_t id);

/// Records in the job's store space (`job`: under init()'s prefix) the members of membership
/// epoch `epoch` by world rank ("members": "<epoch>:<ranks>"), unless a later epoch's are there:
/// a newcomer waiting to be admitted reads it to learn whether anyone is left to admit it.
DDP_INLINE void record_members(Store& job, std::uint64_t epoch,
                               const std::vector<int>& world_ranks);

/// Whether every member of the running job (its last recorded membership, else the world ranks
/// below `world_size`) other than `claim` is gone (its process ended): nobody is left to admit a
/// newcomer.
[[nodiscard]] DDP_INLINE bool job_ended(Store& job, int claim, int world_size);

/// Rank 0 of the members: answers the requests that arrived since the last growth of `old`
/// (this process's communicator, of `size` ranks) and writes the decision of epoch `epoch`.
DDP_INLINE Growth decide_growth(MembershipWatch& old, Store& base, std::uint64_t epoch,
                                const std::string& ticket);

/// The other members: rank 0's decision of epoch `epoch` (rank 0 dying fails it at once).
DDP_INLINE Growth await_growth(const MembershipWatch& old, Store& base, std::uint64_t epoch,
                               int rank, Clock::time_point deadline);

/// Before connecting (step 3), every process of the grown communicator: says it is connecting
/// ("e<E>/g<tag>/ready/<new rank>", the store marking its death from then on), then waits until
/// every other has too. One known gone (its process's mark under the job prefix `job`) fails it at
/// once with Errc::peer_lost; one that never comes (a member that did not call grow(), a stopped
/// newcomer) with Errc::timeout; either way naming it. `root`: the store without prefix; `g`:
/// the growth decision.
DDP_INLINE void await_participants(Store& root, const std::string& job, std::uint64_t epoch,
                                   int rank, const std::vector<int>& world_ranks, const Growth& g,
                                   Clock::time_point deadline);

/// The newcomer's side of step 1: its request's id once written, and its reply once there.
class JoinRequest {
 public:
  JoinRequest(Store& base, int claim, const std::string& ticket, int world_size = 1);
  [[nodiscard]] std::int64_t id() const noexcept { return id_; }

  /// The reply ("admit <E> <tag>" or "refuse <errc> <why>"), or "withdrawn" when none came by
  /// `deadline` (the request is then withdrawn, unless a reply won the race), or "ended" (also
  /// withdrawn) when every member of the job has ended meanwhile: nobody is left to admit it.
  std::string await(Clock::time_point deadline);

 private:
  Store& base_;
  int claim_ = 0, world_size_ = 1;
  std::int64_t id_ = 0;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/membership/impl/growth.ipp"
#endif
