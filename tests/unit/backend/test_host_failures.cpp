// backend::Host when the ranks' collectives go wrong, across real processes: mismatched
// collectives (both fingerprints named, Options::verify_collectives), a killed peer, a stalled or
// frozen one, ranks that skip a collective. Survivors report to files; the parent checks.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

TEST_CASE("mismatched collectives fail on every rank with both fingerprints") {
  struct Case {
    const char* name;
    std::function<void(Comm&)> call;
    const char* theirs;
  };
  const std::vector<Case> cases = {
      {"different collective",
       [](Comm& c) {
         std::vector<float> v(10);
         c.broadcast(v, 0);
       },
       "broadcast(float32, count=10, root=0) #0"},
      {"different count",
       [](Comm& c) {
         std::vector<float> v(11);
         c.all_reduce(v);
       },
       "all_reduce(float32, count=11, op=sum) #0"},
      {"different dtype",
       [](Comm& c) {
         std::vector<double> v(10);
         c.all_reduce(v);
       },
       "all_reduce(float64, count=10, op=sum) #0"},
      {"different op",
       [](Comm& c) {
         std::vector<float> v(10);
         c.all_reduce(v, ddp::ReduceOp::max);
       },
       "all_reduce(float32, count=10, op=max) #0"},
      {"large vs small",
       [](Comm& c) {
         std::vector<float> v(100000);
         c.all_reduce(v);
       },
       "all_reduce(float32, count=100000, op=sum) #0"},
  };
  for (const mp::Path& t : mp::paths()) {
    for (const auto& c : cases) {
      CAPTURE(mp::name(t));
      CAPTURE(std::string(c.name));
      mp::TempDir dir;
      std::string spawn_error;
      run_faulty(
          3, t,
          [&](Comm& comm) {
            const auto t0 = Clock::now();
            try {
              if (comm.rank() == 1)
                c.call(comm);
              else {
                std::vector<float> v(10);
                comm.all_reduce(v);
              }
              mp::TempDir::write(dir.file("rank" + std::to_string(comm.rank())), "ok 0");
            } catch (const ddp::Error& e) {
              report(dir, comm.rank(), e, mp::ms_since(t0));
              // Poisoned: the next call fails at once with aborted, naming the first failure.
              const auto t1 = Clock::now();
              try {
                comm.barrier();
              } catch (const ddp::Error& again) {
                mp::TempDir::write(dir.file("next" + std::to_string(comm.rank())),
                                   std::string(ddp::to_string(again.code())) + " " +
                                       std::to_string(mp::ms_since(t1)));
              }
            }
          },
          {}, &spawn_error);
      CHECK(spawn_error.empty());
      for (int r = 0; r < 3; ++r) {
        const Outcome o = read_outcome(dir, r);
        CAPTURE(r);
        CAPTURE(o.message);
        CHECK(o.code == "mismatch");
        CHECK(o.ms < 1000);
        CHECK(o.message.find("mismatched collectives") != std::string::npos);
        CHECK(o.message.find("all_reduce(float32, count=10, op=sum) #0") != std::string::npos);
        CHECK(o.message.find(c.theirs) != std::string::npos);
        std::istringstream next(mp::TempDir::read(dir.file("next" + std::to_string(r))));
        std::string code;
        long long ms = -1;
        next >> code >> ms;
        CHECK(code == "aborted");
        CHECK(ms < 10);
      }
    }
  }
}

namespace {
/// The 32-bit digest the shared-memory transport once compared instead of the fingerprints
/// (fields spread by odd multipliers, then mixed): kept here only to find calls it confused.
std::uint32_t old_digest(std::uint64_t seq, std::uint64_t count) {
  const std::uint64_t small =
      std::uint64_t{0xffffffffu} |
      std::uint64_t{static_cast<std::uint8_t>(ddp::detail::Coll::all_reduce)} << 32 |
      std::uint64_t{static_cast<std::uint8_t>(ddp::DType::float32)} << 40 | std::uint64_t{1} << 56;
  std::uint64_t x =
      seq * 0x9e3779b97f4a7c15ull ^ count * 0xc2b2ae3d27d4eb4full ^ small * 0x165667b19e3779f9ull;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  return static_cast<std::uint32_t>(x >> 32) | 1u;
}
}  // namespace

TEST_CASE("calls whose fingerprints collide under a 32-bit digest still fail as mismatched (shm)") {
  // The first sequence number with two all_reduce(float32, sum) counts under 4096 that share a
  // digest: a check that compares digests lets them pass, and the ranks part with different data.
  std::uint64_t seq = 0, a = 0, b = 0;
  for (; b == 0; ++seq) {
    std::unordered_map<std::uint32_t, std::uint64_t> first;
    for (std::uint64_t n = 1; n < 4096 && b == 0; ++n) {
      auto [it, fresh] = first.emplace(old_digest(seq, n), n);
      if (!fresh) a = it->second, b = n;
    }
    if (b != 0) break;
  }
  CAPTURE(seq);
  CAPTURE(a);
  CAPTURE(b);
  REQUIRE(old_digest(seq, a) == old_digest(seq, b));
  mp::TempDir dir;
  std::string spawn_error;
  run_faulty(
      3, ddp::HostTransport::shm,
      [&](Comm& comm) {
        std::vector<float> warm(1, 1.0f);
        for (std::uint64_t i = 0; i < seq; ++i) comm.all_reduce(warm);
        std::vector<float> v(comm.rank() == 2 ? b : a, 1.0f);
        try {
          comm.all_reduce(v);
          mp::TempDir::write(dir.file("rank" + std::to_string(comm.rank())), "ok 0");
        } catch (const ddp::Error& e) {
          report(dir, comm.rank(), e, 0);
        }
      },
      {}, &spawn_error);
  CHECK(spawn_error.empty());
  for (int r = 0; r < 3; ++r) {
    const Outcome o = read_outcome(dir, r);
    CAPTURE(r);
    CAPTURE(o.message);
    CHECK(o.code == "mismatch");
    CHECK(o.message.find(ddp::detail::concat("count=", a)) != std::string::npos);
    CHECK(o.message.find(ddp::detail::concat("count=", b)) != std::string::npos);
  }
}

TEST_CASE(
    "a peer killed during a loop of 1 MiB all_reduces: survivors raise peer_lost naming it within "
    "2 s") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    std::string spawn_error;
    const auto shm_before = our_shm_entries();
    run_faulty(
        4, t,
        [&](Comm& comm) {
          std::vector<float> v(256 * 1024, 1.0f);
          const auto t0 = Clock::now();
          try {
            for (int i = 0; i < 1000000; ++i) {
              if (comm.rank() == 2 && i == 20) {
                mp::TempDir::write(dir.file("killed"), std::to_string(now_ms()));
                ::raise(SIGKILL);
              }
              comm.all_reduce(v);
            }
          } catch (const ddp::Error& e) {
            report(dir, comm.rank(), e, now_ms());
            return;
          }
          (void)t0;
        },
        {}, &spawn_error);
    CHECK(spawn_error.find("rank 2") != std::string::npos);
    CHECK(spawn_error.find("killed by SIGKILL") != std::string::npos);
    const long long killed_at = std::stoll(mp::TempDir::read(dir.file("killed")));
    for (int r : {0, 1, 3}) {
      const Outcome o = read_outcome(dir, r);
      CAPTURE(r);
      CAPTURE(o.message);
      CHECK(o.code == "peer_lost");
      CHECK(o.message.find("rank 2") != std::string::npos);
      CHECK(o.ms - killed_at < 2000);
      // As fields too: rank 2 lost; found here (-1) or reported by another survivor.
      CHECK(std::find(o.lost.begin(), o.lost.end(), 2) != o.lost.end());
      CHECK(o.origin != 2);
    }
    CHECK(lasting_new_shm_entries(shm_before).empty());
  }
}

TEST_CASE("a stalled peer: the others time out after the timeout, naming it") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = std::chrono::milliseconds(1000);
    run_faulty(
        3, t,
        [&](Comm& comm) {
          if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          const auto t0 = Clock::now();
          std::vector<float> v(1000);
          try {
            comm.all_reduce(v);
          } catch (const ddp::Error& e) {
            report(dir, comm.rank(), e, mp::ms_since(t0));
          }
        },
        o);
    for (int r : {0, 2}) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(r);
      CAPTURE(out.message);
      CHECK(out.code == "timeout");
      CHECK(out.ms >= 500);
      CHECK(out.ms <= 2000);
      CHECK(out.message.find("rank 1") != std::string::npos);
    }
  }
}

TEST_CASE("a frozen peer (SIGSTOP): the others time out between timeout/2 and timeout + 1 s") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = std::chrono::milliseconds(2000);
    std::string spawn_error;
    run_faulty(
        3, t,
        [&](Comm& comm) {
          std::vector<float> v(1000, 1.0f);
          for (int i = 0; i < 10; ++i) comm.all_reduce(v);
          if (comm.rank() == 1) {
            mp::TempDir::write(dir.file("pid"), std::to_string(::getpid()));
            ::raise(SIGSTOP);  // frozen, not dead: its sockets and shared memory stay open
            return;
          }
          const auto t0 = Clock::now();
          try {
            comm.all_reduce(v);
          } catch (const ddp::Error& e) {
            report(dir, comm.rank(), e, mp::ms_since(t0));
          }
          if (comm.rank() == 0) {  // thaw it (the parent waits for every rank)
            // Not before rank 2 has timed out too: killing rank 1 closes its sockets, and a
            // rank 2 still waiting would see peer_lost instead of its own timeout.
            const auto deadline = Clock::now() + std::chrono::seconds(10);
            while (!std::filesystem::exists(dir.file("rank2")) && Clock::now() < deadline)
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            const pid_t frozen = static_cast<pid_t>(std::stoll(mp::TempDir::read(dir.file("pid"))));
            ::kill(frozen, SIGKILL);
          }
        },
        o, &spawn_error);
    for (int r : {0, 2}) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(r);
      CAPTURE(out.message);
      CHECK(out.code == "timeout");
      CHECK(out.ms >= 1000);  // timeout / 2
      CHECK(out.ms <= 3000);  // timeout + 1 s
      CHECK(out.message.find("rank 1") != std::string::npos);
    }
  }
}

TEST_CASE("verify_collectives: off, collectives still work, ranks that disagree fail at init") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    ddp::Options off;
    off.verify_collectives = false;
    mp::run(
        3, t,
        [](Comm& comm) {
          std::vector<float> v(100000, static_cast<float>(comm.rank() + 1));
          comm.all_reduce(v);
          MP_EXPECT(v[0] == 6.0f && v[99999] == 6.0f, v[0]);
          std::vector<int> w(7, comm.rank() == 1 ? 42 : 0);
          comm.broadcast(w, 1);
          MP_EXPECT(w[6] == 42, w[6]);
        },
        off);
    mp::TempDir dir;
    init_outcomes(2, dir, [&](ddp::Environment& env) {
      ddp::Options o;
      o.transport = t.transport;
      t.enter(env.rank, env.world_size);
      o.timeout = std::chrono::seconds(5);
      o.verify_collectives = env.rank == 0;
      return o;
    });
    for (int r : {0, 1}) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(out.message);
      CHECK(out.code == "mismatch");
      CHECK(out.message.find("disagree on Options::verify_collectives (DDP_VERIFY_COLLECTIVES)") !=
            std::string::npos);
      CHECK(out.message.find("has on") != std::string::npos);
      CHECK(out.message.find("has off") != std::string::npos);
    }
  }
}

TEST_CASE("ranks that skip a collective are all named") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = std::chrono::milliseconds(700);
    run_faulty(
        4, t,
        [&](Comm& comm) {
          if (comm.rank() == 1 || comm.rank() == 3) {  // alive, but skipping the collective
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            return;
          }
          std::vector<float> v(10);
          try {
            comm.all_reduce(v);
          } catch (const ddp::Error& e) {
            report(dir, comm.rank(), e, 0);
          }
        },
        o);
    for (int r : {0, 2}) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(out.message);
      CHECK(out.code == "timeout");
      if (t.hosts > 1)  // each host's rank waits for the rank of its own host first
        CHECK(out.message.find("rank " + std::to_string(r + 1) + " (shm") != std::string::npos);
      else
        CHECK(out.message.find("ranks 1, 3") != std::string::npos);
    }
  }
}

TEST_CASE("a rank that finishes early is reported as finished within a second, and nobody stalls") {
  for (const mp::Path& t : mp::paths()) {
    for (const int early : {0, 2}) {  // the store's host, and another
      CAPTURE(mp::name(t));
      CAPTURE(early);
      mp::TempDir dir;
      ddp::Options o;
      o.timeout = std::chrono::seconds(20);  // a wait for the early rank would take this long
      const auto start = Clock::now();
      run_faulty(
          3, t,
          [&](Comm& comm) {
            std::vector<float> v(1000, 1.0f);
            const int steps = comm.rank() == early ? 2 : 3;
            const auto t0 = Clock::now();
            try {
              for (int i = 0; i < steps; ++i) {
                comm.all_reduce(v);
              }
              mp::TempDir::write(dir.file("rank" + std::to_string(comm.rank())), "ok 0");
            } catch (const ddp::Error& e) {
              report(dir, comm.rank(), e, mp::ms_since(t0));
            }
          },
          o);
      // The store's host no longer waits for ranks that had to fail after it left.
      CHECK(mp::ms_since(start) < 8000);
      CHECK(read_outcome(dir, early).code == "ok");
      for (int r = 0; r < 3; ++r) {
        if (r == early) continue;
        const Outcome out = read_outcome(dir, r);
        CAPTURE(out.message);
        CHECK(out.code == "peer_lost");
        CHECK(out.ms < 1000);
        CHECK(out.message.find("all_reduce(float32, count=1000, op=sum) #2") != std::string::npos);
        CHECK(out.message.find("rank " + std::to_string(early) + " finished") != std::string::npos);
        CHECK(out.message.find("after 2 operations") != std::string::npos);
        CHECK(out.message.find("ddp::Join") != std::string::npos);
        CHECK(out.message.find("died") == std::string::npos);
      }
    }
  }
}

TEST_CASE(
    "a rank whose program leaves by an exception (a call its checks refused) is reported as such, "
    "not as finished") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = std::chrono::seconds(20);
    std::string spawn_error;
    run_faulty(
        3, t,
        [&](Comm& comm) {
          std::vector<float> v(1000, 1.0f);
          const auto t0 = Clock::now();
          comm.all_reduce(v);
          comm.all_reduce(v);
          if (comm.rank() == 2) comm.broadcast(v, 7);  // refused: no rank 7; nothing catches it
          try {
            comm.all_reduce(v);
            mp::TempDir::write(dir.file("rank" + std::to_string(comm.rank())), "ok 0");
          } catch (const ddp::Error& e) {
            report(dir, comm.rank(), e, mp::ms_since(t0));
          }
        },
        o, &spawn_error);
    CHECK(spawn_error.find("rank 2") != std::string::npos);
    for (int r = 0; r < 2; ++r) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(out.message);
      CHECK(out.code == "peer_lost");
      CHECK(out.message.find("rank 2 left after 2 operations while an exception unwound its "
                             "program") != std::string::npos);
      CHECK(out.message.find("finished") == std::string::npos);
    }
  }
}

TEST_CASE("a rank that leaves does not disturb the others' sends and receives") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    run_faulty(3, t, [&](Comm& comm) {
      std::vector<float> v(100000, 1.0f);
      comm.all_reduce(v);
      if (comm.rank() == 2) return;  // leaves (its process exits) while 0 and 1 go on
      try {
        for (int i = 0; i < 4; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(60));  // past the exit checks
          if (comm.rank() == 0)
            comm.send(v, 1);
          else
            comm.recv(v, 0);
        }
        mp::TempDir::write(dir.file("rank" + std::to_string(comm.rank())), "ok 0");
      } catch (const ddp::Error& e) {
        report(dir, comm.rank(), e, 0);
      }
    });
    for (int r : {0, 1}) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(out.message);
      CHECK(out.code == "ok");
    }
  }
}

TEST_CASE("over tcp, a send no rank received is named by the next collective, and vice versa") {
  // A pair's messages and collectives share one stream: the headers say which is which.
  for (const bool sender_first : {true, false}) {
    CAPTURE(sender_first);
    mp::TempDir dir;
    run_faulty(2, ddp::HostTransport::tcp, [&](Comm& comm) {
      const int r = comm.rank();
      std::vector<float> v(16, 1001.0f), g(16, static_cast<float>(r + 1));
      try {
        if (sender_first) {
          if (r == 1) comm.send(v, 0);  // nobody receives it
          comm.all_reduce(g);
        } else if (r == 0) {
          comm.recv(v, 1);  // rank 1 sends nothing: it calls a collective
        } else {
          comm.all_reduce(g);
        }
        mp::TempDir::write(dir.file("rank" + std::to_string(r)), "ok 0");
      } catch (const ddp::Error& e) {
        report(dir, r, e, 0);
      }
    });
    const Outcome out = read_outcome(dir, 0);
    CAPTURE(out.message);
    CHECK(out.code == "mismatch");
    CHECK(out.message.find(sender_first
                               ? "rank 1 sent this rank a message that no recv took (send(tag 0, "
                                 "float32, count=16) #0) before this collective"
                               : "got no message from rank 1 but the start of a collective, "
                                 "all_reduce(float32, count=16") != std::string::npos);
    // (The sender's all_reduce may complete: rank 0's data reached it before rank 0 failed.)
    if (!sender_first) CHECK(read_outcome(dir, 1).code != "ok");
  }
}

TEST_CASE("uneven sizes that disagree fail on every rank, naming the pair, before data moves") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    run_faulty(3, t, [&](Comm& comm) {
      // Rank 2 expects 2 elements from rank 1, which sends it 1.
      const int r = comm.rank();
      std::vector<std::size_t> in_counts{1, 1, 1}, out_counts{1, 1, 1};
      if (r == 2) out_counts = {1, 2, 1};
      std::vector<float> in(3, 1.0f), out(r == 2 ? 4 : 3);
      try {
        comm.all_to_all(in, out, in_counts, out_counts);
        mp::TempDir::write(dir.file("rank" + std::to_string(r)), "ok 0");
      } catch (const ddp::Error& e) {
        report(dir, r, e, 0);
      }
    });
    for (int r = 0; r < 3; ++r) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(out.message);
      CHECK(out.code == "mismatch");
      CHECK(out.message.find("rank " + std::to_string(r) +
                             ": all_to_all(float32, counts per rank)") != std::string::npos);
      CHECK(out.message.find("rank 1 sends 1 elements to rank 2, which expects 2 from it") !=
            std::string::npos);
    }
  }
}

TEST_CASE("monitored_barrier: a rank that died is named at once, not at the timeout") {
  for (const int dead : {1, 0}) {
    CAPTURE(dead);
    mp::TempDir dir;
    run_faulty(3, ddp::HostTransport::shm, [&](Comm& comm) {
      const int r = comm.rank();
      comm.monitored_barrier(std::chrono::seconds(20), true);
      if (r == dead) ::_exit(0);  // dies without a word
      const long long start = now_ms();
      try {
        comm.monitored_barrier(std::chrono::seconds(20), true);
        mp::TempDir::write(dir.file("rank" + std::to_string(r)), "ok 0");
      } catch (const ddp::Error& e) {
        report(dir, r, e, now_ms() - start);
      }
    });
    for (int r = 0; r < 3; ++r) {
      if (r == dead) continue;
      const Outcome out = read_outcome(dir, r);
      CAPTURE(out.message);
      CHECK(out.code == "peer_lost");
      CHECK(out.message.find("rank " + std::to_string(dead) + " left (its process exited") !=
            std::string::npos);
      CHECK(out.ms < 5000);
      CHECK(out.lost == std::vector<int>{dead});
      // rank 0 finds a dead rank itself; the others learn it from rank 0's verdict, unless rank
      // 0 is the one that died
      CHECK(out.origin == (r == 0 || dead == 0 ? -1 : 0));
    }
  }
}

TEST_CASE("monitored_barrier names the ranks that did not arrive, on every rank") {
  for (const bool all : {true, false}) {
    CAPTURE(all);
    mp::TempDir dir;
    run_faulty(4, ddp::HostTransport::shm, [&](Comm& comm) {
      const int r = comm.rank();
      comm.monitored_barrier(std::chrono::seconds(20), all);  // all arrive: passes
      if (r >= 2) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      try {
        comm.monitored_barrier(std::chrono::milliseconds(500), all);
        mp::TempDir::write(dir.file("rank" + std::to_string(r)), "ok 0");
      } catch (const ddp::Error& e) {
        report(dir, r, e, 0);
      }
    });
    const std::string who =
        all ? "ranks 2, 3 did not arrive within 500 ms" : "rank 2 did not arrive within 500 ms";
    for (int r = 0; r < 4; ++r) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(out.message);
      CHECK(out.code == "timeout");
      CHECK(out.message.find("rank " + std::to_string(r) + ": monitored_barrier #1: ") !=
            std::string::npos);
      CHECK(out.message.find(who) != std::string::npos);
      if (!all) CHECK(out.message.find("1 more did not either") != std::string::npos);
      if (r != 0) CHECK(out.message.find("failed because rank 0 reported") != std::string::npos);
      CHECK(out.origin == (r == 0 ? -1 : 0));
      CHECK(out.lost == std::vector<int>{2, 3});  // every one late, named or not
    }
  }
}
