// Communicator::enter and grow across real processes: a newcomer joins a running job of 3 ranks
// at a step boundary on shm, tcp and two hosts; newcomers with another ticket, claiming a live
// rank's place, with a wrong token, or that nobody admits are refused with errors that name it
// and the job goes on; a newcomer dying before and after its admission; a restarted rank
// rejoining after shrink(). Processes report to files; the parent checks.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace growth_tests {
using namespace std::chrono_literals;
namespace {

// `members` ranks init() a job of their own size; the `newcomers` processes after them (world
// ranks members, members + 1, ...) run newcomer(env) instead, which may join() it.
void run_job(int members, int newcomers, const mp::Path& path,
             const std::function<void(Comm&)>& member,
             const std::function<void(ddp::Environment&, const ddp::Options&)>& newcomer,
             ddp::Options o = {}, std::string* spawn_error = nullptr) {
  o.transport = path.transport;
  o.segment_bytes = mp::test_segment;
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  try {
    ddp::spawn(
        members + newcomers,
        [&](ddp::Environment env) {
          path.enter(env.rank, members + newcomers);
          if (env.rank >= members) {
            newcomer(env, o);
            return;
          }
          env.world_size = members;
          env.local_world_size = std::min(env.local_world_size, members);
          auto comm = Comm::init(env, o);
          member(comm);
        },
        so);
    if (spawn_error != nullptr) *spawn_error = "";
  } catch (const ddp::Error& e) {
    if (spawn_error == nullptr) throw;
    *spawn_error = e.what();
  }
}

// Members: collectives until rank 0 sees `n` processes waiting to enter (agreed by an
// all_reduce), then grow(), again until all n are admitted (one whose request is not written
// yet is admitted at a later grow()). Returns the grown communicator.
Comm grow_when_waiting(Comm& comm, int n, const std::string& ticket = "t") {
  std::optional<Comm> grown;
  Comm* now = &comm;
  for (int i = 0; now->size() < comm.size() + n; ++i) {
    std::vector<double> waiting{now->rank() == 0 ? static_cast<double>(now->waiting_to_enter())
                                                 : 0.0};
    now->all_reduce(waiting, ddp::ReduceOp::max);
    if (waiting[0] >= (grown ? 1 : n)) {
      grown.emplace(now->grow({.ticket = ticket}));
      now = &*grown;
    }
    MP_EXPECT(i < 2000, "nobody asked to join within 20 s");
    std::this_thread::sleep_for(10ms);
  }
  return std::move(*grown);
}

// "<epoch> <size> <rank> <previous ranks...> | <sum of world ranks>" after a working all_reduce.
void report(const mp::TempDir& dir, const std::string& who, Comm& comm, int world_rank) {
  std::vector<double> v{static_cast<double>(world_rank)};
  comm.all_reduce(v);
  std::string line = std::to_string(comm.epoch()) + " " + std::to_string(comm.size()) + " " +
                     std::to_string(comm.rank());
  for (int r : comm.previous_ranks()) line += " " + std::to_string(r);
  line += " | " + std::to_string(static_cast<long long>(v[0]));
  mp::TempDir::write(dir.file(who), line);
}

// What a refused or failed process saw: "<errc> <message>".
void report_error(const mp::TempDir& dir, const std::string& who, const ddp::Error& e) {
  mp::TempDir::write(dir.file(who), std::string(ddp::to_string(e.code())) + " " + e.what());
}

}  // namespace

TEST_CASE("grow: a newcomer joins a running job at a step boundary, on every path") {
  for (const mp::Path& path : mp::paths()) {
    CAPTURE(mp::name(path));
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = 20s;
    run_job(
        3, 1, path,
        [&](Comm& comm) {
          const int world_rank = comm.rank();
          Comm grown = grow_when_waiting(comm, 1);
          MP_EXPECT(grown.size() == 4, "grown to " << grown.size());
          MP_EXPECT(grown.rank() == world_rank, "a member keeps its rank");
          try {
            comm.barrier();
            MP_EXPECT(false, "the communicator grow() replaced still works");
          } catch (const ddp::Error& e) {
            MP_EXPECT(e.code() == ddp::Errc::aborted, e.what());
          }
          std::vector<float> big(100'000, 1.0f);  // larger than the test segment
          grown.all_reduce(big);
          MP_EXPECT(big[99'999] == 4.0f, "all_reduce over 4: " << big[99'999]);
          report(dir, "rank" + std::to_string(world_rank), grown, world_rank);
        },
        [&](ddp::Environment& env, const ddp::Options& opts) {
          auto comm = Comm::enter(env, opts, {.ticket = "t"});
          std::vector<float> big(100'000, 1.0f);
          comm.all_reduce(big);
          report(dir, "rank3", comm, env.rank);
        },
        o);
    for (int r = 0; r < 4; ++r)
      CHECK(mp::TempDir::read(dir.file("rank" + std::to_string(r))) ==
            "1 4 " + std::to_string(r) + " 0 1 2 -1 | 6");
  }
}

TEST_CASE("grow: a job of one under a launcher admits a newcomer (the launcher's store)") {
  for (const auto transport : {ddp::HostTransport::shm, ddp::HostTransport::tcp}) {
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = 20s;
    run_job(
        1, 1, transport,
        [&](Comm& comm) {
          Comm grown = grow_when_waiting(comm, 1);
          MP_EXPECT(grown.size() == 2, "grown to " << grown.size());
          report(dir, "rank0", grown, 0);
          Comm alone = grown.shrink({.exclude = {1}});  // and back to one
          MP_EXPECT(alone.size() == 1 && alone.epoch() == 2, "shrunk to " << alone.size());
        },
        [&](ddp::Environment& env, const ddp::Options& opts) {
          auto comm = Comm::enter(env, opts, {.ticket = "t"});
          report(dir, "rank1", comm, env.rank);
          try {
            comm.barrier();  // left out by the shrink above
          } catch (const ddp::Error&) {
          }
        },
        o);
    CHECK(mp::TempDir::read(dir.file("rank0")) == "1 2 0 0 -1 | 1");
    CHECK(mp::TempDir::read(dir.file("rank1")) == "1 2 1 0 -1 | 1");
  }
}

TEST_CASE("grow: a newcomer slow to write its request after taking its number is admitted later") {
  // The newcomer stalls 1.5 s between its number and its request (a loaded machine): the grow()
  // that sees the number first does not pass it over; a later one admits it.
  mp::TempDir dir;
  ddp::Options o;
  o.timeout = 20s;
  run_job(
      2, 1, ddp::HostTransport::shm,
      [&](Comm& comm) {
        Comm grown = grow_when_waiting(comm, 1);
        report(dir, "rank" + std::to_string(grown.rank()), grown, grown.rank());
      },
      [&](ddp::Environment& env, const ddp::Options& opts) {
        ddp::detail::join_phase_hook() = [](const char* phase) {
          if (std::string_view(phase) == "numbered") std::this_thread::sleep_for(1500ms);
        };
        auto comm = Comm::enter(env, opts, {.ticket = "t"});
        report(dir, "rank2", comm, env.rank);
      },
      o);
  for (int r = 0; r < 3; ++r)
    CHECK(mp::TempDir::read(dir.file("rank" + std::to_string(r))) ==
          "1 3 " + std::to_string(r) + " 0 1 -1 | 3");
}

TEST_CASE(
    "enter: bad newcomers are refused, each with an error that names it, and the job goes on") {
  // Process 3: another ticket; 4: claims live rank 1's place; 5: a wrong token; 6: asks with a
  // short wait before the members look (timeout, withdrawn). The members grow once all four have
  // asked: nobody is admitted, and they go on as they were.
  mp::TempDir dir;
  ddp::Options o;
  o.timeout = 20s;
  ::setenv("DDP_TOKEN", "secret", 1);  // spawn's store and the members take it
  run_job(
      3, 4, ddp::HostTransport::shm,
      [&](Comm& comm) {
        // Wait for the withdrawn one (6) to give up before growing. Rank 0 looks (the requests
        // waiting, 6's answer) and the all_reduce tells the others: every rank leaves the loop
        // at the same step (each looking at the file itself, they could disagree).
        for (int i = 0; i < 2000; ++i) {
          const bool lead = comm.rank() == 0;
          std::vector<double> n{lead ? static_cast<double>(comm.waiting_to_enter()) : 0.0,
                                lead && mp::TempDir::exists(dir.file("p6")) ? 1.0 : 0.0};
          comm.all_reduce(n, ddp::ReduceOp::max);
          if (n[0] >= 3 && n[1] > 0) break;
          std::this_thread::sleep_for(10ms);
        }
        Comm same = comm.grow({.ticket = "model 10 floats;step int"});
        MP_EXPECT(same.epoch() == 0 && same.size() == 3, "nobody was admitted");
        same.barrier();
        report(dir, "rank" + std::to_string(same.rank()), same, same.rank());
      },
      [&](ddp::Environment& env, const ddp::Options& opts) {
        ddp::Options mine = opts;
        ddp::EnterOptions j{.ticket = "model 10 floats;step int"};
        if (env.rank == 3) j.ticket = "model 12 floats;step int";
        if (env.rank == 4) env.rank = 1;
        if (env.rank == 5) mine.token = "guess";
        if (env.rank == 6) j.wait = 300ms;
        const std::string who = "p" + std::to_string(env.rank == 1 ? 4 : env.rank);
        try {
          auto comm = Comm::enter(env, mine, j);
          mp::TempDir::write(dir.file(who), "admitted");
        } catch (const ddp::Error& e) {
          report_error(dir, who, e);
        }
      },
      o);
  ::unsetenv("DDP_TOKEN");
  for (int r = 0; r < 3; ++r)
    CHECK(mp::TempDir::read(dir.file("rank" + std::to_string(r))) ==
          "0 3 " + std::to_string(r) + " | 3");
  const std::string p3 = mp::TempDir::read(dir.file("p3"));
  CHECK_MESSAGE(p3.starts_with("mismatch "), p3);
  CHECK_MESSAGE(p3.find("\"model 12 floats\" where the members' has \"model 10 floats\"") !=
                    std::string::npos,
                p3);
  const std::string p4 = mp::TempDir::read(dir.file("p4"));
  CHECK_MESSAGE(p4.starts_with("invalid_argument "), p4);
  CHECK_MESSAGE(p4.find("claims rank 1's place, which a live process holds") != std::string::npos,
                p4);
  const std::string p5 = mp::TempDir::read(dir.file("p5"));
  CHECK_MESSAGE(p5.starts_with("unauthorized "), p5);
  const std::string p6 = mp::TempDir::read(dir.file("p6"));
  CHECK_MESSAGE(p6.starts_with("timeout "), p6);
  CHECK_MESSAGE(p6.find("no member admitted this process within 300 ms") != std::string::npos, p6);
}

TEST_CASE("enter: a newcomer whose job ends before admitting it fails at once, not at its wait") {
  mp::TempDir dir;
  ddp::Options o;
  o.timeout = 30s;
  run_job(
      2, 1, ddp::HostTransport::shm,
      [&](Comm& comm) {
        // The members see the newcomer waiting, and end without admitting it.
        for (int i = 0; i < 2000; ++i) {
          std::vector<double> n{comm.rank() == 0 ? static_cast<double>(comm.waiting_to_enter())
                                                 : 0.0};
          comm.all_reduce(n, ddp::ReduceOp::max);
          if (n[0] >= 1) break;
          std::this_thread::sleep_for(10ms);
        }
      },
      [&](ddp::Environment& env, const ddp::Options& opts) {
        const long long t0 = now_ms();
        try {
          auto comm = Comm::enter(env, opts, {.ticket = "t", .wait = 30s});
          mp::TempDir::write(dir.file("p2"), "admitted");
        } catch (const ddp::Error& e) {
          report_error(dir, "p2", e);
          mp::TempDir::write(dir.file("ms"), std::to_string(now_ms() - t0));
        }
      },
      o);
  const std::string p2 = mp::TempDir::read(dir.file("p2"));
  CHECK_MESSAGE(p2.starts_with("peer_lost "), p2);
  CHECK_MESSAGE(p2.find("every member of the running job has ended") != std::string::npos, p2);
  const std::string ms = mp::TempDir::read(dir.file("ms"));
  REQUIRE(!ms.empty());
  CHECK(std::stoll(ms) < 15000);  // not the 30 s wait
}

namespace {
const mp::TempDir* hook_dir = nullptr;
void die_when_asked(const char* phase) {
  if (std::string(phase) != "asked") return;
  mp::TempDir::write(hook_dir->file("asked"), "");
  std::_Exit(4);
}
void die_when_admitted(const char* phase) {
  if (std::string(phase) == "admitted") std::_Exit(4);
}
}  // namespace

TEST_CASE("grow: a newcomer that dies before or after its admission, and the members go on") {
  for (const char* when : {"before", "after"}) {
    CAPTURE(when);
    mp::TempDir dir;
    hook_dir = &dir;
    ddp::Options o;
    o.timeout = 20s;
    std::string spawn_error;
    const bool before = std::string(when) == "before";
    const long long t0 = now_ms();
    run_job(
        3, 1, ddp::HostTransport::tcp,
        [&](Comm& comm) {
          const int me = comm.rank();
          if (before) {  // it asked and died: passed over, nobody admitted
            while (!mp::TempDir::exists(dir.file("asked"))) std::this_thread::sleep_for(10ms);
            std::this_thread::sleep_for(300ms);
            Comm same = comm.grow({.ticket = "t"});
            report(dir, "rank" + std::to_string(me), same, me);
            return;
          }
          try {
            Comm grown = grow_when_waiting(comm, 1);
            grown.barrier();
            MP_EXPECT(false, "grew with a newcomer that died");
          } catch (const ddp::Error& e) {
            MP_EXPECT(e.code() == ddp::Errc::peer_lost, e.what());
            MP_EXPECT(std::string(e.what()).find("newcomer") != std::string::npos, e.what());
          }
          Comm again = comm.shrink({.wait_for_ranks = 10s});  // the old one still agrees
          report(dir, "rank" + std::to_string(me), again, me);
        },
        [&](ddp::Environment& env, const ddp::Options& opts) {
          ddp::detail::join_phase_hook() = before ? die_when_asked : die_when_admitted;
          auto comm = Comm::enter(env, opts, {.ticket = "t", .wait = 20s});
          MP_EXPECT(false, "the newcomer lived on");
        },
        o, &spawn_error);
    CHECK_MESSAGE(spawn_error.find("rank 3") != std::string::npos, spawn_error);
    const std::string epoch = before ? "0" : "1";
    for (int r = 0; r < 3; ++r)
      CHECK(mp::TempDir::read(dir.file("rank" + std::to_string(r))) ==
            epoch + " 3 " + std::to_string(r) + (before ? "" : " 0 1 2") + " | 3");
    CHECK(now_ms() - t0 < 15'000);  // nobody waited out the 20 s timeout
  }
}

TEST_CASE("grow: a killed rank's restarted process rejoins as its rank after shrink()") {
  mp::TempDir dir;
  ddp::Options o;
  o.timeout = 20s;
  std::string spawn_error;
  run_job(
      3, 1, ddp::HostTransport::shm,
      [&](Comm& comm) {
        const int me = comm.rank();
        comm.barrier();
        if (me == 1) std::_Exit(5);
        try {
          for (int i = 0; i < 1000; ++i) comm.barrier();
        } catch (const ddp::Error&) {
        }
        Comm smaller = comm.shrink({.wait_for_ranks = 10s});
        mp::TempDir::write(dir.file("shrunk" + std::to_string(me)), "");
        Comm grown = grow_when_waiting(smaller, 1);
        report(dir, "rank" + std::to_string(me), grown, me);
        // Then world rank 2 dies too: the rejoined process is not taken for its dead first life.
        if (me == 2) std::_Exit(6);
        try {
          for (int i = 0; i < 1000; ++i) grown.barrier();
        } catch (const ddp::Error&) {
        }
        Comm last = grown.shrink({.wait_for_ranks = 10s});
        report(dir, "last" + std::to_string(me), last, me);
      },
      [&](ddp::Environment& env, const ddp::Options& opts) {
        while (!mp::TempDir::exists(dir.file("shrunk0")) ||
               !mp::TempDir::exists(dir.file("shrunk2")))
          std::this_thread::sleep_for(10ms);
        env.rank = 1;  // the restarted rank 1
        auto comm = Comm::enter(env, opts, {.ticket = "t"});
        report(dir, "newcomer", comm, 1);
        try {
          for (int i = 0; i < 1000; ++i) comm.barrier();
        } catch (const ddp::Error&) {
        }
        Comm last = comm.shrink({.wait_for_ranks = 10s});
        report(dir, "newcomer_last", last, 1);
      },
      o, &spawn_error);
  CHECK(mp::TempDir::read(dir.file("rank0")) == "2 3 0 0 1 -1 | 3");
  CHECK(mp::TempDir::read(dir.file("rank2")) == "2 3 1 0 1 -1 | 3");
  CHECK(mp::TempDir::read(dir.file("newcomer")) == "2 3 2 0 1 -1 | 3");
  CHECK(mp::TempDir::read(dir.file("last0")) == "3 2 0 0 2 | 1");
  CHECK(mp::TempDir::read(dir.file("newcomer_last")) == "3 2 1 0 2 | 1");
}

TEST_CASE("grow: damaged store values are refused as protocol errors, never crash") {
  using ddp::detail::Growth;
  CHECK(Growth::parse("5|0,1,2|7:3", 0).claims == std::vector<int>{3});
  for (const char* bad : {"zz|0,1,2|", "5|0,1|7", "5||", "5|0,x|", "|0|", "5|0,1,2|7:-3"}) {
    CAPTURE(bad);
    try {
      (void)Growth::parse(bad, 1);
      FAIL("accepted");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::protocol);
      CHECK(std::string(e.what()).starts_with("rank 1: grow: the growth decision"));
    }
  }
  CHECK(ddp::detail::parse_claim("3 1234") == 3);
  CHECK(ddp::detail::parse_claim("-1 1234") == -1);
  CHECK(ddp::detail::parse_claim("99999999999 1") == -1);
  CHECK(ddp::detail::parse_claim("x") == -1);
}

TEST_CASE(
    "grow: numbers taken without requests, bad claims and a damaged reply, and the job goes on") {
  // Process 3 first plays a hostile client of the job's store: 100,000 numbers taken without a
  // request, requests claiming ranks -1 and 99999999999, and a damaged reply waiting for the
  // next number; then it joins (and gets the damaged reply: a protocol error). Process 4 joins
  // properly afterwards and is admitted within a few steps.
  mp::TempDir dir;
  ddp::Options o;
  o.timeout = 20s;
  const long long t0 = now_ms();
  run_job(
      3, 2, ddp::HostTransport::shm,
      [&](Comm& comm) {
        for (int i = 0; i < 2000 && comm.size() < 4; ++i) {
          const bool look = comm.rank() == 0 && mp::TempDir::exists(dir.file("hostile"));
          std::vector<double> n{look ? static_cast<double>(comm.waiting_to_enter()) : 0.0};
          comm.all_reduce(n, ddp::ReduceOp::max);  // every member decides alike
          if (n[0] > 0) comm = comm.grow({.ticket = "t"});
          std::this_thread::sleep_for(10ms);
        }
        report(dir, "rank" + std::to_string(comm.rank()), comm, comm.rank());
      },
      [&](ddp::Environment& env, const ddp::Options& opts) {
        if (env.rank == 4) {
          while (!mp::TempDir::exists(dir.file("p3"))) std::this_thread::sleep_for(10ms);
          auto comm = Comm::enter(env, opts, {.ticket = "t"});
          report(dir, "rank3", comm, 4);
          return;
        }
        ddp::Store raw(env.master_addr, env.store_port != 0 ? env.store_port : env.master_port);
        ddp::Store job = raw.prefixed("ddp/0/default/");
        const std::int64_t first = job.add("join/next", 100'000);
        for (const char* claim : {"-1 1\nt", "99999999999 1\nt"}) {
          const std::int64_t id = job.add("join/next", 1);
          job.set("join/" + std::to_string(id), claim);
        }
        job.set("join/" + std::to_string(first + 3) + "/reply", "admit zz");
        mp::TempDir::write(dir.file("hostile"), "");
        try {
          auto comm = Comm::enter(env, opts, {.ticket = "t"});
          mp::TempDir::write(dir.file("p3"), "admitted");
        } catch (const ddp::Error& e) {
          report_error(dir, "p3", e);
        }
        for (const std::int64_t id : {first + 1, first + 2}) {  // the bad claims: refused
          const std::string reply = job.get("join/" + std::to_string(id) + "/reply");
          MP_EXPECT(reply.starts_with("refuse 1 it claims no valid rank"), reply);
        }
      },
      o);
  const std::string p3 = mp::TempDir::read(dir.file("p3"));
  CHECK_MESSAGE(p3.starts_with("protocol rank 3: enter: the reply to this process's request is "
                               "damaged"),
                p3);
  for (int r = 0; r < 4; ++r)
    CHECK(mp::TempDir::read(dir.file("rank" + std::to_string(r))) ==
          "1 4 " + std::to_string(r) + " 0 1 2 -1 | 7");
  CHECK(now_ms() - t0 < 15'000);
}

TEST_CASE("grow: a member that dies before grow() or does not call it is named") {
  for (const char* what : {"dies", "absent"}) {
    CAPTURE(what);
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = std::string(what) == "dies" ? 20s : 3s;
    std::string spawn_error;
    const long long t0 = now_ms();
    run_job(
        3, 1, ddp::HostTransport::tcp,
        [&](Comm& comm) {
          const int me = comm.rank();
          for (;;) {
            std::vector<double> n{me == 0 ? static_cast<double>(comm.waiting_to_enter()) : 0.0};
            comm.all_reduce(n, ddp::ReduceOp::max);
            if (n[0] > 0) break;
            std::this_thread::sleep_for(10ms);
          }
          if (me == 2 && std::string(what) == "dies") std::_Exit(5);
          if (me == 2) {  // absent: does not call grow()
            std::this_thread::sleep_for(5s);
            return;
          }
          try {
            Comm grown = comm.grow({.ticket = "t"});
            MP_EXPECT(false, "grew without rank 2");
          } catch (const ddp::Error& e) {
            report_error(dir, "rank" + std::to_string(me), e);
          }
        },
        [&](ddp::Environment& env, const ddp::Options& opts) {
          try {
            auto comm = Comm::enter(env, opts, {.ticket = "t"});
          } catch (const ddp::Error& e) {
            report_error(dir, "newcomer", e);
          }
        },
        o, &spawn_error);
    for (const char* who : {"rank0", "rank1", "newcomer"}) {
      const std::string m = mp::TempDir::read(dir.file(who));
      CAPTURE(who);
      if (std::string(what) == "dies") {
        CHECK_MESSAGE(m.starts_with("peer_lost "), m);
        CHECK_MESSAGE(m.find("rank 2 of membership epoch 1 (world rank 2, a member) died before "
                             "it connected") != std::string::npos,
                      m);
      } else {
        CHECK_MESSAGE(m.starts_with("timeout "), m);
        CHECK_MESSAGE(m.find("rank 2 of membership epoch 1 (world rank 2, a member) did not "
                             "connect within the timeout: every member must call grow() at the "
                             "same step") != std::string::npos,
                      m);
      }
    }
    if (std::string(what) == "dies") CHECK(now_ms() - t0 < 10'000);  // not the 20 s timeout
  }
}

TEST_CASE("init: a process restarted to rejoin (DDP_REJOIN) is told to call enter()") {
  ddp::Environment env;
  env.rank = 1;
  env.world_size = 2;
  env.master_port = 1;
  env.rejoin = true;
  try {
    auto comm = Comm::init(env);
    FAIL("init() accepted a rejoining process");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    CHECK(std::string(e.what()).find("make its communicator with Communicator::enter") !=
          std::string::npos);
  }
}

}  // namespace growth_tests
