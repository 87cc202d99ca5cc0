// The survivors' agreement of shrink() (membership/agreement.hpp: detail::MembershipChange) in
// one process, with nothing of the communicator: threads as ranks, each a MembershipWatch with
// its own connection to a store server of this process (the real store engine, its data in
// memory; a rank "dies" when its connection closes, as a process's does). What the
// multi-process tests (comm/test_membership.cpp) check end to end, here at the protocol's own
// scale: who is waited for, who is left out, and the round a failure while connecting costs.
#include <ddp/membership/agreement.hpp>
#include <ddp/store/server.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using ddp::detail::MembershipChange;
using ddp::detail::MembershipWatch;

/// A job of `size` ranks over one store server: each rank's state as init() leaves it (its own
/// connection, the job's prefixes, its exit record should its connection close).
struct AgreementJob {
  explicit AgreementJob(int size) : server("127.0.0.1", 0) {
    for (int r = 0; r < size; ++r) {
      auto s = std::make_unique<MembershipWatch>();
      s->options.timeout = 10s;
      ddp::StoreOptions so;
      so.timeout = 10s;
      s->root_store = std::make_shared<ddp::Store>("127.0.0.1", server.port(), so);
      s->prefix = s->base_prefix = s->job_prefix = "ddp/0/g/";
      s->world_rank = s->world_rank_in_group = r;
      s->world_size = size;
      for (int w = 0; w < size; ++w) s->world_ranks.push_back(w);
      const std::pair<std::string, std::string> on_close[] = {
          {ddp::detail::concat(s->prefix, "exit/", r), ""}};
      s->root_store->set_on_close(on_close);
      ranks.push_back(std::move(s));
    }
  }

  /// Rank r's process dies: its connection to the store closes.
  void kill(int r) { ranks[static_cast<std::size_t>(r)].reset(); }

  /// What the store holds at `key` (under the job's prefix), "" when absent.
  std::string peek(const std::string& key) {
    ddp::Store s("127.0.0.1", server.port());
    return ddp::detail::peek_key(s, "ddp/0/g/" + key);
  }

  ddp::StoreServer server;
  std::vector<std::unique_ptr<MembershipWatch>> ranks;
};

/// What one rank's shrink() agreement ended with.
struct AgreementOutcome {
  std::vector<int> members;  // old ranks, the last round's
  int new_rank = -1;
  int rounds = 0;
  std::optional<ddp::Errc> code;  // none: it succeeded
  std::string error;
};

/// Runs the agreement on each rank of `who` in a thread of its own: decide(), then settle() with
/// `connected(rank, round)` standing for connecting the new backend.
std::vector<AgreementOutcome> agree_on(AgreementJob& job, const std::vector<int>& who,
                                       const ddp::ShrinkOptions& o,
                                       const std::function<bool(int, int)>& connected = {}) {
  std::vector<AgreementOutcome> out(job.ranks.size());
  std::vector<std::thread> threads;
  for (int r : who) {
    threads.emplace_back([&, r] {
      AgreementOutcome& mine = out[static_cast<std::size_t>(r)];
      try {
        MembershipWatch& s = *job.ranks[static_cast<std::size_t>(r)];
        MembershipChange change(s, r, static_cast<int>(job.ranks.size()), o);
        change.announce();
        for (;;) {
          mine.members = change.decide();
          mine.new_rank = change.new_rank();
          const bool ok = !connected || connected(r, change.round());
          ++mine.rounds;
          if (change.settle(ok)) break;
        }
      } catch (const ddp::Error& e) {
        mine.code = e.code();
        mine.error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST_CASE("membership agreement: the survivors of a dead rank agree on themselves, renumbered") {
  AgreementJob job(4);
  job.kill(2);
  const auto out = agree_on(job, {0, 1, 3}, {});
  for (int r : {0, 1, 3}) {
    const AgreementOutcome& o = out[static_cast<std::size_t>(r)];
    CAPTURE(r);
    CHECK_MESSAGE(o.error.empty(), o.error);
    CHECK(o.members == std::vector<int>{0, 1, 3});
    CHECK(o.rounds == 1);
  }
  CHECK(out[0].new_rank == 0);
  CHECK(out[1].new_rank == 1);
  CHECK(out[3].new_rank == 2);
  // A rank that comes back to the old communicator reads that it was replaced, and by whom.
  CHECK(job.peek("superseded") == "1:0, 1, 3");
  CHECK(job.peek("shrinking") == "1");
  CHECK(job.peek("e1/r0/members") == "0, 1, 3");
  CHECK(job.peek("e1/r0/outcome") == "ok");
}

TEST_CASE("membership agreement: a rank that is silent past wait_for_ranks is left out, fenced") {
  AgreementJob job(3);
  ddp::ShrinkOptions o;
  o.wait_for_ranks = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  auto out = agree_on(job, {0, 1}, o);  // rank 2 lives, but says nothing: stopped, or slow
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(waited >= 300ms);
  CHECK(waited < 5s);  // not the 10 s timeout
  CHECK(out[0].members == std::vector<int>{0, 1});
  CHECK(out[1].members == std::vector<int>{0, 1});
  // It wakes and tries to take part: the decision stands, and it is excluded for good.
  const auto late = agree_on(job, {2}, o);
  CHECK(late[2].code == ddp::Errc::aborted);
  CHECK(late[2].error.find("this rank was excluded") != std::string::npos);
  CHECK_MESSAGE(late[2].error.find("epoch 1 of ranks 0, 1") != std::string::npos, late[2].error);
}

TEST_CASE("membership agreement: ranks named by ShrinkOptions::exclude are not waited for") {
  AgreementJob job(4);
  ddp::ShrinkOptions o;
  o.exclude = {1, 3};
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = agree_on(job, {0, 2}, o);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK(out[0].members == std::vector<int>{0, 2});
  CHECK(out[2].members == std::vector<int>{0, 2});
  CHECK(out[2].new_rank == 1);
  // Naming itself, or a rank that does not exist, is refused before anything is written.
  ddp::ShrinkOptions self;
  self.exclude = {0};
  CHECK(agree_on(job, {0}, self)[0].code == ddp::Errc::invalid_argument);
  ddp::ShrinkOptions bad;
  bad.exclude = {7};
  CHECK(agree_on(job, {0}, bad)[0].error.find("names rank 7") != std::string::npos);
}

TEST_CASE("membership agreement: a member that fails while connecting costs one more round") {
  AgreementJob job(4);
  job.kill(3);
  // Rank 2 cannot connect the new backend in round 0 (alive still): every member retries.
  const auto out = agree_on(job, {0, 1, 2}, {}, [&](int r, int round) {
    if (r == 2 && round == 0) return false;
    return true;
  });
  CHECK(out[0].members == std::vector<int>{0, 1, 2});  // round 1: rank 2 is still alive
  CHECK(out[0].rounds == 2);
  CHECK(job.peek("e1/r0/outcome") == "retry");
  CHECK(job.peek("e1/r1/outcome") == "ok");

  // The same, with rank 2 dying after its failure: round 1 is formed of the two others.
  AgreementJob again(4);
  again.kill(3);
  std::thread two([&] {
    MembershipWatch& s = *again.ranks[2];
    MembershipChange change(s, 2, 4, {});
    change.announce();
    (void)change.decide();
    (void)change.settle(false);
    again.kill(2);  // its connection closes: "exit/2" for the next round
  });
  const auto rest = agree_on(again, {0, 1}, {});
  two.join();
  CHECK(rest[0].members == std::vector<int>{0, 1});
  CHECK(rest[1].members == std::vector<int>{0, 1});
  CHECK(rest[0].rounds == 2);
  CHECK(again.peek("e1/r1/members") == "0, 1");
}

TEST_CASE("membership agreement: a rank whose heartbeat ran out is counted lost, even awake") {
  AgreementJob job(3);
  ddp::Store(("127.0.0.1"), job.server.port()).set("ddp/0/g/stalled/1", "");
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = agree_on(job, {0, 2}, {});
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);  // not waited for
  CHECK(out[0].members == std::vector<int>{0, 2});
  CHECK(out[2].members == std::vector<int>{0, 2});
}
