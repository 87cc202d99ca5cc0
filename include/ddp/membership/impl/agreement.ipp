// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/membership/agreement.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE MembershipChange::MembershipChange(MembershipWatch& old, int old_rank, int old_size,
                                              const ShrinkOptions& o)
    : old_(old), me_(old_rank), size_(old_size), epoch_(old.epoch + 1) {
  if (!old.root_store)
    fail(Errc::unsupported, "rank ", me_,
         ": shrink: this communicator has no rendezvous store to agree in (a world of one "
         "started without a launcher, or a group that backend::Nccl's split() made: shrink the "
         "communicator init() made, then split it again)");
  if (o.wait_for_ranks.count() < 0)
    fail(Errc::invalid_argument, "rank ", me_, ": shrink: ShrinkOptions::wait_for_ranks is ",
         o.wait_for_ranks.count(), " ms; give 0 (the communicator's timeout) or more");
  for (int r : o.exclude) {
    if (r < 0 || r >= size_)
      fail(Errc::invalid_argument, "rank ", me_, ": shrink: ShrinkOptions::exclude names rank ", r,
           ", not a rank of this communicator of ", size_);
  }
  wait_ = o.wait_for_ranks.count() > 0 ? o.wait_for_ranks : old.options.timeout;
  deadline_ = Clock::now() + old.options.timeout + wait_;
  base_ = std::make_shared<Store>(old.root_store->prefixed(old.base_prefix).unwatched());
  for (int r = 0; r < size_; ++r) {
    if (std::find(o.exclude.begin(), o.exclude.end(), r) == o.exclude.end())
      candidates_.push_back(r);
  }
  if (std::find(candidates_.begin(), candidates_.end(), me_) == candidates_.end())
    fail(Errc::invalid_argument, "rank ", me_, ": shrink: ShrinkOptions::exclude names this rank");
}

DDP_INLINE void MembershipChange::announce() {
  guarded([&] {
    (void)old_.root_store->prefixed(old_.prefix)
        .unwatched()
        .compare_set("shrinking", "", std::to_string(epoch_));
    return 0;
  });
}

DDP_INLINE std::vector<int> MembershipChange::decide() {
  return guarded([&] {
    const std::string at = tag();
    if (old_.stalled())
      excluded(
          concat("this process sent no sign of life to the store for longer than the "
                 "heartbeat (",
                 old_.options.heartbeat.count(),
                 " ms: stopped, hung or cut off), so the job counts it as lost"));
    watch_connecting();
    base_->set(concat(at, "alive/", me_), std::to_string(::getpid()));
    hook("alive");
    std::string decided = peek(concat(at, "members"));
    if (decided.empty()) {
      const std::vector<int> alive = await_candidates(at);
      decided = base_->compare_set(concat(at, "members"), "", ranks_text(alive));
    }
    members_ = parse_ranks(decided);
    if (std::find(members_.begin(), members_.end(), me_) == members_.end())
      excluded(concat("the other ranks formed membership epoch ", epoch_, " of ranks ",
                      ranks_text(members_),
                      " (old numbers) without it: it did not say it was "
                      "alive within ",
                      wait_.count(),
                      " ms of the first of them (stopped, or "
                      "slow to notice the failure), or another rank's ShrinkOptions::exclude "
                      "named it"));
    hook("decided");
    return members_;
  });
}

DDP_INLINE int MembershipChange::new_rank() const {
  return static_cast<int>(std::find(members_.begin(), members_.end(), me_) - members_.begin());
}

DDP_INLINE void MembershipChange::watch_connecting() {
  guarded([&] {
    const std::pair<std::string, std::string> on_close[] = {
        {concat(prefix(), "failed"),
         Store::stop_value(Errc::peer_lost,
                           concat("rank ", me_,
                                  " (of the communicator being shrunk) died while the "
                                  "survivors were forming membership epoch ",
                                  epoch_))},
        {concat(old_.prefix, "exit/", me_), ""},
        {old_.process_exit_key(), ""}};
    old_.root_store->set_on_close(std::span(on_close, old_.process_exit_key().empty() ? 2 : 3));
    return 0;
  });
}

DDP_INLINE bool MembershipChange::settle(bool connected, const std::vector<int>& cut) {
  return guarded([&] {
    const std::string at = tag();
    if (connected) hook("connected");
    std::vector<int> cut_old;  // in old ranks, as the reports are read
    for (const int j : cut)
      if (j >= 0 && static_cast<std::size_t>(j) < members_.size())
        cut_old.push_back(members_[static_cast<std::size_t>(j)]);
    base_->set(concat(at, connected ? "ready/" : "broken/", me_), ranks_text(cut_old));
    if (connected) hook("ready");
    std::string verdict = peek(concat(at, "outcome"));
    while (verdict.empty()) {
      std::vector<std::string> ready;
      bool broken = !connected;
      for (int r : members_) {
        ready.push_back(concat(at, "ready/", r));
        const std::string failed[] = {concat(at, "broken/", r)};
        broken = broken || base_->check(failed) || gone(r);
      }
      if (broken) {
        verdict = partition_outcome(at);
        break;
      }
      if (base_->missing_after(ready, std::chrono::milliseconds(20)).empty()) {
        verdict = base_->compare_set(concat(at, "outcome"), "", "ok");
        break;
      }
      verdict = peek(concat(at, "outcome"));
      if (verdict.empty() && Clock::now() > deadline_)
        verdict = base_->compare_set(concat(at, "outcome"), "", "retry");
    }
    if (verdict == "ok") {
      (void)old_.root_store->prefixed(old_.prefix)
          .unwatched()
          .compare_set("superseded", "", concat(epoch_, ":", ranks_text(members_)));
      // The live processes left out (fenced), for their launcher, which ends them (ddprun).
      // Dead ones end on their own, and a stalled one's heartbeat wrote its record when it
      // stopped: written once, no record can reach a process that the launcher started since.
      if (new_rank() == 0 && !old_.launcher_prefix.empty() &&
          old_.base_prefix == old_.job_prefix) {  // the job's own, not a split()'s
        Store root = old_.root_store->unwatched();
        for (int r = 0; r < size_; ++r)
          if (std::find(members_.begin(), members_.end(), r) == members_.end() && !gone(r) &&
              !stalled(r) && static_cast<std::size_t>(r) < old_.world_ranks.size())
            (void)root.compare_set(
                concat(old_.launcher_prefix, "left/",
                       old_.world_ranks[static_cast<std::size_t>(r)]),
                "", "the others went on without it: it did not answer their shrink()");
      }
      if (old_.base_prefix == old_.job_prefix && new_rank() == 0) {  // for newcomers
        std::vector<int> world;
        for (const int m : members_)
          if (static_cast<std::size_t>(m) < old_.world_ranks.size())
            world.push_back(old_.world_ranks[static_cast<std::size_t>(m)]);
        Store job = old_.root_store->prefixed(old_.job_prefix).unwatched();
        record_members(job, epoch_, world);
      }
      return true;
    }
    candidates_ = members_;
    if (verdict.starts_with("retry:")) {  // a partition: only the members that reach each other
      candidates_ = parse_ranks(std::string_view(verdict).substr(6));
      if (std::find(candidates_.begin(), candidates_.end(), me_) == candidates_.end()) {
        std::vector<int> reached;
        for (const int m : members_)
          if (m != me_ && std::find(cut_old.begin(), cut_old.end(), m) == cut_old.end())
            reached.push_back(m);
        excluded(concat(
            "the members could not all connect to each other (a partition: links between them "
            "down or cut, while every one of them still reaches the store), and the largest set "
            "of members that reach each other, ranks ",
            ranks_text(candidates_), " (old numbers), goes on without it",
            cut_old.empty()
                ? std::string()
                : concat(" (this rank could not connect to ranks ", ranks_text(cut_old), ")")));
      }
    }
    ++round_;
    if (Clock::now() > deadline_)
      fail(Errc::timeout, "rank ", me_, ": shrink: membership epoch ", epoch_,
           " could not be formed within the timeout (", round_,
           " rounds: ranks kept failing while connecting)");
    return false;
  });
}

DDP_INLINE std::string MembershipChange::partition_outcome(const std::string& at) {
  // Every member's report: ready, broken (with the members it could not reach), or gone.
  std::vector<std::vector<int>> cut(static_cast<std::size_t>(size_));
  std::vector<int> alive;
  for (;;) {
    const std::string decided = peek(concat(at, "outcome"));
    if (!decided.empty()) return decided;
    alive.clear();
    bool all = true;
    for (const int r : members_) {
      if (gone(r)) continue;
      alive.push_back(r);
      const std::string keys[] = {concat(at, "broken/", r)};
      if (base_->check(keys)) {
        cut[static_cast<std::size_t>(r)] = parse_ranks(base_->get(keys[0]));
        continue;
      }
      const std::string ready[] = {concat(at, "ready/", r)};
      all = all && base_->check(ready);
    }
    if (all || Clock::now() > deadline_) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Members r and j cannot talk when either said so. While some pair of the members left
  // cannot, leave out the one that cannot reach the most others (the higher rank of equals):
  // the side of a partition with more members, or rank 0's of equal sides, goes on.
  const auto bad = [&](int r, int j) {
    const auto& a = cut[static_cast<std::size_t>(r)];
    const auto& b = cut[static_cast<std::size_t>(j)];
    return std::find(a.begin(), a.end(), j) != a.end() ||
           std::find(b.begin(), b.end(), r) != b.end();
  };
  std::vector<int> keep = alive;
  bool any = false;
  for (;;) {
    int worst = -1, most = 0;
    for (const int r : keep) {
      int n = 0;
      for (const int j : keep) n += j != r && bad(r, j) ? 1 : 0;
      if (n > 0 && n >= most) {
        worst = r;
        most = n;
      }
    }
    if (worst < 0) break;
    keep.erase(std::find(keep.begin(), keep.end(), worst));
    any = true;
  }
  return base_->compare_set(concat(at, "outcome"), "",
                            any ? concat("retry:", ranks_text(keep)) : std::string("retry"));
}

DDP_INLINE bool MembershipChange::gone(int r) {
  if (old_.rank_gone(r)) return true;
  const auto i = static_cast<std::size_t>(r);
  if (i >= old_.world_ranks.size() || old_.job_prefix.empty()) return false;
  Store job = old_.root_store->prefixed(old_.job_prefix).unwatched();
  const std::string who = peek_key(job, concat("proc/", old_.world_ranks[i]));
  if (who.empty() || !ended_here(who)) return false;
  (void)job.compare_set(concat("gone/", old_.world_ranks[i]), "", "");
  return true;
}

DDP_INLINE bool MembershipChange::stalled(int r) const {
  const auto i = static_cast<std::size_t>(r);
  if (i >= old_.world_ranks.size() || old_.job_prefix.empty()) return false;
  const std::string k[] = {concat(old_.job_prefix, "stalled/", old_.world_ranks[i])};
  return old_.root_store->check(k);
}

DDP_INLINE std::vector<int> MembershipChange::await_candidates(const std::string& at) {
  const auto until = std::min(deadline_, Clock::now() + wait_);
  for (;;) {
    std::vector<int> alive;
    std::vector<std::string> pending;
    for (int r : candidates_) {
      const std::string said[] = {concat(at, "alive/", r)};
      if (stalled(r)) continue;  // counted lost by its heartbeat, even should it wake
      if (base_->check(said)) {
        alive.push_back(r);
      } else if (!gone(r)) {
        pending.push_back(said[0]);
      }
    }
    const std::string members[] = {concat(at, "members")};
    if (pending.empty() || Clock::now() >= until || base_->check(members)) return alive;
    (void)base_->missing_after(pending, std::chrono::milliseconds(20));
  }
}

DDP_INLINE void MembershipChange::excluded(const std::string& why) {
  const std::string msg =
      concat("rank ", me_, ": shrink: this rank was excluded: ", why,
             "; it can never act on this communicator again: restart the process (it may "
             "rejoin the job as a new rank)");
  fail(Errc::aborted, msg);
}

}  // namespace detail
DDP_END_NAMESPACE
