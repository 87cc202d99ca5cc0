// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/membership/growth.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>

DDP_BEGIN_NAMESPACE
namespace detail {

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

DDP_INLINE int parse_claim(std::string_view line) {
  long long v = -1;
  const std::string_view first = line.substr(0, line.find(' '));
  const auto [end, ec] = std::from_chars(first.data(), first.data() + first.size(), v);
  if (ec != std::errc{} || end != first.data() + first.size() || v < 0 || v > (1LL << 30))
    return -1;
  return static_cast<int>(v);
}

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

DDP_INLINE bool late_request(Store& base, std::int64_t id) {
  const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  const std::string first = base.compare_set(join_key(id, "missing"), "", std::to_string(now));
  long long since = now;
  (void)std::from_chars(first.data(), first.data() + first.size(), since);
  return now - since < 5000;
}

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

}  // namespace detail
DDP_END_NAMESPACE
