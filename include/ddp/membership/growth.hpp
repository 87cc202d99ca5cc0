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

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
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

#if DDP_BODIES
DDP_INLINE std::string Growth::text() const {
  std::string s = concat(upto, "|", ranks_text(members), "|");
  for (std::size_t i = 0; i < ids.size(); ++i)
    s += concat(i == 0 ? "" : ",", ids[i], ":", claims[i]);
  return s;
}

DDP_INLINE Growth Growth::parse(std::string_view t, int rank) {
  Growth g;
  const std::size_t a = t.find('|'), b = a == std::string_view::npos ? a : t.find('|', a + 1);
  const auto bad = [&] {
    fail(Errc::protocol, "rank ", rank, ": grow: the growth decision in the store is damaged (\"",
         t.substr(0, 200), "\"): is another program writing into this job's store?");
  };
  if (b == std::string_view::npos) bad();
  const auto numbers = [&](std::string_view list) {
    std::vector<std::int64_t> out;
    while (!list.empty()) {
      const std::size_t at = list.find_first_of(",:");
      std::string_view item = list.substr(0, at);
      while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
      std::int64_t v = -1;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
      if (ec != std::errc{} || end != item.data() + item.size() || v < 0 || v > (1LL << 40)) bad();
      out.push_back(v);
      list = at == std::string_view::npos ? std::string_view{} : list.substr(at + 1);
    }
    return out;
  };
  const std::vector<std::int64_t> head = numbers(t.substr(0, a));
  if (head.size() != 1) bad();
  g.upto = head[0];
  for (const std::int64_t m : numbers(t.substr(a + 1, b - a - 1)))
    g.members.push_back(static_cast<int>(std::min<std::int64_t>(m, 1 << 30)));
  const std::vector<std::int64_t> rest = numbers(t.substr(b + 1));  // id:claim,id:claim,...
  if (rest.size() % 2 != 0 || g.members.empty()) bad();
  for (std::size_t i = 0; i < rest.size(); i += 2) {
    g.ids.push_back(rest[i]);
    g.claims.push_back(static_cast<int>(std::min<std::int64_t>(rest[i + 1], 1 << 30)));
  }
  return g;
}
#endif  // DDP_BODIES

/// A join request's claimed world rank ("<claim> <pid>" on its first line): -1 when it is not a
/// number from 0 to 2^30.
[[nodiscard]] DDP_INLINE int parse_claim(std::string_view line);
#if DDP_BODIES
DDP_INLINE int parse_claim(std::string_view line) {
  long long v = -1;
  const std::string_view first = line.substr(0, line.find(' '));
  const auto [end, ec] = std::from_chars(first.data(), first.data() + first.size(), v);
  if (ec != std::errc{} || end != first.data() + first.size() || v < 0 || v > (1LL << 30))
    return -1;
  return static_cast<int>(v);
}
#endif  // DDP_BODIES

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
#if DDP_BODIES
DDP_INLINE std::string ticket_difference(std::string_view theirs, std::string_view ours) {
  const auto piece = [](std::string_view t, std::size_t k) {
    for (std::size_t i = 0; i < k && !t.empty(); ++i) {
      const std::size_t at = t.find(';');
      t = at == std::string_view::npos ? std::string_view{} : t.substr(at + 1);
    }
    const std::string_view p = t.substr(0, t.find(';'));
    return std::string(p.substr(0, 120));
  };
  for (std::size_t k = 0;; ++k) {
    const std::string a = piece(theirs, k), b = piece(ours, k);
    if (a != b)
      return concat("its ticket has \"", a.empty() ? "(nothing)" : a,
                    "\" where the members' has \"", b.empty() ? "(nothing)" : b, "\" (piece ", k,
                    ")");
    if (a.empty()) return "its ticket differs from the members'";
  }
}
#endif  // DDP_BODIES

/// Whether number `id`'s missing request is still awaited: for 5 s after a grow() first saw it
/// missing (the time kept in the store, so a later rank 0 keeps it), then it is passed over (a
/// number taken without a request, by a broken or hostile client, or a newcomer that died).
DDP_INLINE bool late_request(Store& base, std::int64_t id);
#if DDP_BODIES
DDP_INLINE bool late_request(Store& base, std::int64_t id) {
  const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  const std::string first = base.compare_set(join_key(id, "missing"), "", std::to_string(now));
  long long since = now;
  (void)std::from_chars(first.data(), first.data() + first.size(), since);
  return now - since < 5000;
}
#endif  // DDP_BODIES

/// Records in the job's store space (`job`: under init()'s prefix) the members of membership
/// epoch `epoch` by world rank ("members": "<epoch>:<ranks>"), unless a later epoch's are there:
/// a newcomer waiting to be admitted reads it to learn whether anyone is left to admit it.
DDP_INLINE void record_members(Store& job, std::uint64_t epoch,
                               const std::vector<int>& world_ranks);
#if DDP_BODIES
DDP_INLINE void record_members(Store& job, std::uint64_t epoch,
                               const std::vector<int>& world_ranks) {
  const std::string mine = concat(epoch, ":", ranks_text(world_ranks));
  for (std::string held = peek_key(job, "members");;) {
    std::uint64_t theirs = 0;
    const bool ok =
        !held.empty() &&
        std::from_chars(held.data(), held.data() + held.size(), theirs).ec == std::errc{};
    if (ok && theirs >= epoch) return;
    const std::string now = job.compare_set("members", held, mine);
    if (now == mine || now == held) return;
    held = now;
  }
}
#endif  // DDP_BODIES

/// Whether every member of the running job (its last recorded membership, else the world ranks
/// below `world_size`) other than `claim` is gone (its process ended): nobody is left to admit a
/// newcomer.
[[nodiscard]] DDP_INLINE bool job_ended(Store& job, int claim, int world_size);
#if DDP_BODIES
DDP_INLINE bool job_ended(Store& job, int claim, int world_size) {
  std::vector<int> ranks;
  const std::string held = peek_key(job, "members");
  if (const std::size_t colon = held.find(':'); colon != std::string::npos)
    ranks = parse_ranks(std::string_view(held).substr(colon + 1));
  else
    for (int r = 0; r < world_size; ++r) ranks.push_back(r);
  for (const int r : ranks) {
    const std::string gone[] = {concat("gone/", r)};
    if (r != claim && !job.check(gone)) return false;
  }
  return true;
}
#endif  // DDP_BODIES

/// Rank 0 of the members: answers the requests that arrived since the last growth of `old`
/// (this process's communicator, of `size` ranks) and writes the decision of epoch `epoch`.
DDP_INLINE Growth decide_growth(MembershipWatch& old, Store& base, std::uint64_t epoch,
                                const std::string& ticket);
#if DDP_BODIES
DDP_INLINE Growth decide_growth(MembershipWatch& old, Store& base, std::uint64_t epoch,
                                const std::string& ticket) {
  Growth g;
  g.upto = base.add("join/next", 0);
  g.from = old.joins_seen;
  g.members = old.world_ranks;
  std::vector<int> taken = old.world_ranks;
  // At most the last max_requests numbers taken (a newcomer waits on its own; numbers taken
  // without a request, by a broken or hostile client, are passed over once late_request says
  // so), and a request written just after its number is waited for, all within one budget.
  constexpr std::int64_t max_requests = 1024;
  const auto budget = Clock::now() + std::chrono::milliseconds(500);
  std::int64_t stop = 0;  // the first number whose request is late: the decision ends before it
  for (std::int64_t id = std::max(old.joins_seen + 1, g.upto - max_requests + 1); id <= g.upto;
       ++id) {
    const std::string reply = join_key(id, "reply");
    const std::string req_key[] = {join_key(id)};
    if (Clock::now() < budget)
      (void)base.missing_after(
          req_key, std::chrono::duration_cast<std::chrono::milliseconds>(budget - Clock::now()));
    const std::string request = peek_key(base, req_key[0]);
    const std::string gone[] = {join_key(id, "gone")};
    if (request.empty() && !base.check(gone) && late_request(base, id)) {
      // Its number is taken, its request not written yet (a slow newcomer on a loaded machine):
      // it and those after it are answered at a later grow().
      if (stop == 0) stop = id;
      continue;
    }
    if (stop != 0) continue;
    if (request.empty() || base.check(gone)) {
      (void)base.compare_set(reply, "", "withdrawn");
      continue;
    }
    const std::size_t line = request.find('\n');
    const std::string theirs = line == std::string::npos ? std::string() : request.substr(line + 1);
    const int claim = parse_claim(std::string_view(request).substr(0, line));
    std::string refusal;
    if (theirs != ticket) {
      refusal = concat(static_cast<int>(Errc::mismatch), " ", ticket_difference(theirs, ticket),
                       ": a newcomer must run the same program (the same TrainingState: model, "
                       "optimizer and objects, tracked in the same order) with the same "
                       "EnterOptions::ticket as the members' GrowOptions::ticket");
    } else if (claim < 0) {
      refusal = concat(static_cast<int>(Errc::invalid_argument),
                       " it claims no valid rank (Environment::rank must be 0 to 2^30)");
    } else if (std::find(taken.begin(), taken.end(), claim) != taken.end()) {
      refusal = concat(static_cast<int>(Errc::invalid_argument), " it claims rank ", claim,
                       "'s place, which a live process holds (a member of the job, or a newcomer "
                       "admitted before it): a process rejoins as the rank it had only once that "
                       "rank's process is gone; give an added process a rank of its own");
    }
    if (!refusal.empty()) {
      (void)base.compare_set(reply, "", concat("refuse ", refusal));
      continue;
    }
    const std::string admitted = concat("admit ", epoch, " ", g.from);
    if (base.compare_set(reply, "", admitted) != admitted) continue;  // it gave up meanwhile
    // A restarted process claims the rank of one that is gone: that one's mark would make the
    // newcomer look dead from the start (its own death marks it again).
    (void)base.erase(concat("gone/", claim));
    (void)base.erase(concat("stalled/", claim));  // and its heartbeat's, had it stalled
    g.ids.push_back(id);
    g.claims.push_back(claim);
    taken.push_back(claim);
  }
  if (stop != 0) g.upto = stop - 1;
  const std::string text = g.text();
  for (const std::int64_t id : g.ids) base.set(join_key(id, "decision"), text);    // newcomers'
  base.set(growth_key(epoch, g.from, concat("decision.", old.grow_calls)), text);  // members'
  if (!g.ids.empty()) {
    std::vector<int> all = g.members;
    all.insert(all.end(), g.claims.begin(), g.claims.end());
    record_members(base, epoch, all);
  }
  return g;
}
#endif  // DDP_BODIES

/// The other members: rank 0's decision of epoch `epoch` (rank 0 dying fails it at once).
DDP_INLINE Growth await_growth(const MembershipWatch& old, Store& base, std::uint64_t epoch,
                               int rank, Clock::time_point deadline);
#if DDP_BODIES
DDP_INLINE Growth await_growth(const MembershipWatch& old, Store& base, std::uint64_t epoch,
                               int rank, Clock::time_point deadline) {
  const std::string key[] = {
      growth_key(epoch, old.joins_seen, concat("decision.", old.grow_calls))};
  while (!base.check(key)) {
    if (old.rank_gone(0))
      fail(Errc::peer_lost, "rank ", rank,
           ": grow: rank 0, which admits the newcomers, died before it decided; shrink() the "
           "communicator and go on without it");
    if (Clock::now() > deadline)
      fail(Errc::timeout, "rank ", rank, ": grow: rank 0 did not decide within the timeout (",
           old.options.timeout.count(), " ms): every member must call grow() at the same step");
    (void)base.missing_after(key, std::chrono::milliseconds(20));
  }
  Growth g = Growth::parse(base.get(key[0]), rank);
  g.from = old.joins_seen;
  if (g.members != old.world_ranks)
    fail(Errc::protocol, "rank ", rank, ": grow: the growth decision in the store names members ",
         ranks_text(g.members), ", not this communicator's (", ranks_text(old.world_ranks),
         "): is another program writing into this job's store?");
  return g;
}
#endif  // DDP_BODIES

/// Before connecting (step 3), every process of the grown communicator: says it is connecting
/// ("e<E>/g<tag>/ready/<new rank>", the store marking its death from then on), then waits until
/// every other has too. One known gone (its process's mark under the job prefix `job`) fails it at
/// once with Errc::peer_lost; one that never comes (a member that did not call grow(), a stopped
/// newcomer) with Errc::timeout; either way naming it. `root`: the store without prefix; `g`:
/// the growth decision.
DDP_INLINE void await_participants(Store& root, const std::string& job, std::uint64_t epoch,
                                   int rank, const std::vector<int>& world_ranks, const Growth& g,
                                   Clock::time_point deadline);
#if DDP_BODIES
DDP_INLINE void await_participants(Store& root, const std::string& job, std::uint64_t epoch,
                                   int rank, const std::vector<int>& world_ranks, const Growth& g,
                                   Clock::time_point deadline) {
  const int members = static_cast<int>(g.members.size());
  const auto ready = [&](int r) { return concat(job, growth_key(epoch, g.from, "ready/"), r); };
  root.set(ready(rank), "");
  const auto who = [&](int r) {
    return concat("rank ", r, " of membership epoch ", epoch, " (world rank ",
                  world_ranks[static_cast<std::size_t>(r)],
                  r < members ? ", a member" : ", a newcomer", ")");
  };
  const char* unchanged = "; the members' communicator is unchanged: shrink() it to go on";
  for (int r = 0; r < static_cast<int>(world_ranks.size());) {
    const std::string here[] = {ready(r)};
    if (root.check(here)) {
      ++r;
      continue;
    }
    // A member's process mark; a newcomer's request's (its rank's mark may be its earlier
    // life's, until rank 0 erased it).
    const std::string gone[] = {
        r < members ? concat(job, "gone/", world_ranks[static_cast<std::size_t>(r)])
                    : concat(job, join_key(g.ids[static_cast<std::size_t>(r - members)], "gone"))};
    if (root.check(gone))
      fail(Errc::peer_lost, "rank ", rank, ": grow: ", who(r), " died before it connected",
           unchanged);
    if (Clock::now() > deadline)
      fail(Errc::timeout, "rank ", rank, ": grow: ", who(r),
           " did not connect within the timeout: every member must call grow() at the same step, "
           "and a newcomer must not be stopped",
           unchanged);
    (void)root.missing_after(here, std::chrono::milliseconds(20));
  }
}
#endif  // DDP_BODIES

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

#if DDP_BODIES
DDP_INLINE JoinRequest::JoinRequest(Store& base, int claim, const std::string& ticket,
                                    int world_size)
    : base_(base), claim_(claim), world_size_(world_size) {
  id_ = base_.add("join/next", 1);
  if (join_phase_hook() != nullptr) join_phase_hook()("numbered");
  // Should this process die while it waits, rank 0 passes its request over.
  const std::pair<std::string, std::string> on_close[] = {{join_key(id_, "gone"), ""}};
  base_.set_on_close(on_close);
  base_.set(join_key(id_), concat(claim, " ", ::getpid(), "\n", ticket));
  if (join_phase_hook() != nullptr) join_phase_hook()("asked");
}

DDP_INLINE std::string JoinRequest::await(Clock::time_point deadline) {
  const std::string key[] = {join_key(id_, "reply")};
  auto look = Clock::now() + std::chrono::milliseconds(250);
  for (;;) {
    if (base_.check(key)) return base_.get(key[0]);
    if (Clock::now() > deadline) return base_.compare_set(key[0], "", "withdrawn");
    if (Clock::now() > look) {
      look = Clock::now() + std::chrono::milliseconds(250);
      if (job_ended(base_, claim_, world_size_)) {
        const std::string r = base_.compare_set(key[0], "", "withdrawn");
        return r == "withdrawn" ? std::string("ended") : r;
      }
    }
    (void)base_.missing_after(key, std::chrono::milliseconds(20));
  }
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
