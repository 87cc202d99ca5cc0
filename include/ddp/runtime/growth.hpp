// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How a process joins a running job (Communicator::join) and how the job's members admit it
/// (Communicator::grow), over the rendezvous store, under the prefix of the communicator that
/// init() made (its "join/" keys):
///  1. a newcomer takes a number ("join/next"), writes its request ("join/<id>": the world rank
///     it claims, its process id, then its ticket) and waits for the reply ("join/<id>/reply");
///  2. at a step boundary every member calls grow(); rank 0 reads the requests that arrived
///     since the last growth and answers each with one compare-and-set: refused (written as
///     "refuse <errc> <why>": a ticket unlike the members', the place of a live rank claimed)
///     or admitted ("admit <epoch>"); a newcomer that gave up meanwhile has written "withdrawn"
///     first and is passed over. Rank 0 then writes the decision ("e<E>/g/decision": the
///     requests handled, the members' world ranks, the admitted requests in order); the other
///     members wait for it (failing at once should rank 0 die);
///  3. members and newcomers connect a new backend under "e<E>/g/comm/": the members keep their
///     order (ranks 0..n-1), the newcomers follow in the order of their requests.
/// A process that dies meanwhile fails the others' connecting at once (its connection's
/// on-close record sets that communicator's "failed" key); the members then still hold the
/// communicator they had, and shrink() it.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/runtime/comm_state.hpp"
#include "ddp/store/client.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Test hook for fault injection: called with the phase of join() reached ("asked": its request
/// written; "admitted": admitted, not yet connecting). Null outside tests.
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

  [[nodiscard]] std::string text() const {
    std::string s = concat(upto, "|", ranks_text(members), "|");
    for (std::size_t i = 0; i < ids.size(); ++i)
      s += concat(i == 0 ? "" : ",", ids[i], ":", claims[i]);
    return s;
  }
  static Growth parse(std::string_view t) {
    Growth g;
    const std::size_t a = t.find('|'), b = t.find('|', a + 1);
    if (a == std::string_view::npos || b == std::string_view::npos)
      fail(Errc::protocol, "join: a damaged growth decision in the store: \"", t, "\"");
    g.upto = std::stoll(std::string(t.substr(0, a)));
    g.members = parse_ranks(t.substr(a + 1, b - a - 1));
    const std::vector<int> rest = parse_ranks(t.substr(b + 1));  // id, claim, id, claim, ...
    for (std::size_t i = 0; i + 1 < rest.size(); i += 2) {
      g.ids.push_back(rest[i]);
      g.claims.push_back(rest[i + 1]);
    }
    return g;
  }
};

[[nodiscard]] inline std::string join_key(std::int64_t id, std::string_view what = {}) {
  return what.empty() ? concat("join/", id) : concat("join/", id, "/", what);
}
[[nodiscard]] inline std::string growth_key(std::uint64_t epoch, std::string_view what) {
  return concat("e", epoch, "/g/", what);
}

/// The value at `key`, "" when absent, without waiting.
inline std::string peek_key(Store& s, const std::string& key) {
  const std::string k[] = {key};
  return s.check(k) ? s.get(key) : std::string();
}

/// Where two tickets (pieces separated by ';') first differ, for a refusal.
[[nodiscard]] inline std::string ticket_difference(std::string_view theirs, std::string_view ours) {
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

/// Rank 0 of the members: answers the requests that arrived since the last growth of `old`
/// (this process's communicator, of `size` ranks) and writes the decision of epoch `epoch`.
inline Growth decide_growth(CommState& old, Store& base, std::uint64_t epoch,
                            const std::string& ticket) {
  Growth g;
  g.upto = base.add("join/next", 0);
  g.members = old.world_ranks;
  std::vector<int> taken = old.world_ranks;
  for (std::int64_t id = old.joins_seen + 1; id <= g.upto; ++id) {
    const std::string reply = join_key(id, "reply");
    // A newcomer writes its request just after taking its number: wait a moment for it.
    const std::string req_key[] = {join_key(id)};
    (void)base.missing_after(req_key, std::chrono::milliseconds(500));
    const std::string request = peek_key(base, req_key[0]);
    const std::string gone[] = {join_key(id, "gone")};
    if (request.empty() || base.check(gone)) {
      (void)base.compare_set(reply, "", "withdrawn");
      continue;
    }
    const std::size_t line = request.find('\n');
    const std::vector<int> head = parse_ranks(std::string_view(request).substr(0, line));
    const std::string theirs = line == std::string::npos ? std::string() : request.substr(line + 1);
    const int claim = head.empty() ? -1 : head[0];
    std::string refusal;
    if (theirs != ticket) {
      refusal = concat(static_cast<int>(Errc::mismatch), " ", ticket_difference(theirs, ticket),
                       ": a newcomer must run the same program (the same TrainingState: model, "
                       "optimizer and objects, tracked in the same order) with the same "
                       "JoinOptions::ticket as the members' GrowOptions::ticket");
    } else if (claim < 0) {
      refusal = concat(static_cast<int>(Errc::invalid_argument),
                       " it claims no rank (Environment::rank is negative)");
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
    const std::string admitted = concat("admit ", epoch);
    if (base.compare_set(reply, "", admitted) != admitted) continue;  // it gave up meanwhile
    g.ids.push_back(id);
    g.claims.push_back(claim);
    taken.push_back(claim);
  }
  base.set(growth_key(epoch, "decision"), g.text());
  return g;
}

/// The other members: rank 0's decision of epoch `epoch` (rank 0 dying fails it at once).
inline Growth await_growth(const CommState& old, Store& base, std::uint64_t epoch, int rank,
                           Clock::time_point deadline) {
  const std::string key[] = {growth_key(epoch, "decision")};
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
  return Growth::parse(base.get(key[0]));
}

/// The members, before connecting: every admitted newcomer is connecting too (it wrote
/// "join/<id>/connecting" once the store would mark its death), or one died first: then
/// Errc::peer_lost, on every member alike, and the communicator they had goes on.
inline void await_newcomers(Store& base, const Growth& g, int rank, Clock::time_point deadline) {
  for (std::size_t i = 0; i < g.ids.size();) {
    const std::string ready[] = {join_key(g.ids[i], "connecting")};
    const std::string gone[] = {join_key(g.ids[i], "gone")};
    if (base.check(ready)) {
      ++i;
      continue;
    }
    if (base.check(gone))
      fail(Errc::peer_lost, "rank ", rank, ": grow: the newcomer claiming rank ", g.claims[i],
           " died after it was admitted; this communicator is unchanged: shrink() it to go on");
    if (Clock::now() > deadline)
      fail(Errc::timeout, "rank ", rank, ": grow: the newcomer claiming rank ", g.claims[i],
           " was admitted but did not connect within the timeout");
    (void)base.missing_after(ready, std::chrono::milliseconds(20));
  }
}

/// The newcomer's side of step 1: its request's id once written, and its reply once there.
class JoinRequest {
 public:
  JoinRequest(Store& base, int claim, const std::string& ticket) : base_(base) {
    id_ = base_.add("join/next", 1);
    // Should this process die while it waits, rank 0 passes its request over.
    const std::pair<std::string, std::string> on_close[] = {{join_key(id_, "gone"), ""}};
    base_.set_on_close(on_close);
    base_.set(join_key(id_), concat(claim, " ", ::getpid(), "\n", ticket));
    if (join_phase_hook() != nullptr) join_phase_hook()("asked");
  }
  [[nodiscard]] std::int64_t id() const noexcept { return id_; }

  /// The reply ("admit <E>" or "refuse <errc> <why>"), or "withdrawn" when none came by
  /// `deadline` (the request is then withdrawn, unless a reply won the race).
  std::string await(Clock::time_point deadline) {
    const std::string key[] = {join_key(id_, "reply")};
    for (;;) {
      if (base_.check(key)) return base_.get(key[0]);
      if (Clock::now() > deadline) return base_.compare_set(key[0], "", "withdrawn");
      (void)base_.missing_after(key, std::chrono::milliseconds(20));
    }
  }

 private:
  Store& base_;
  std::int64_t id_ = 0;
};

}  // namespace detail
DDP_END_NAMESPACE
