// The rendezvous when a rank fails in it, across real processes: a rank that never joins, one
// killed or stopped while the others wait, rank 0 hosting the store (a rank killed, or rank 0
// itself stopped), a rank with a wrong or missing token.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

TEST_CASE("a rank that never joins: the rendezvous names it") {
  mp::TempDir dir;
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  ddp::spawn(
      4,
      [&](ddp::Environment env) {
        if (env.rank == 3) return;
        ddp::Options o;
        o.timeout = std::chrono::milliseconds(800);
        try {
          auto comm = Comm::init(env, o);
        } catch (const ddp::Error& e) {
          report(dir, env.rank, e, 0);
        }
      },
      so);
  for (int r : {0, 1, 2}) {
    const Outcome out = read_outcome(dir, r);
    CAPTURE(out.message);
    CHECK(out.code == "timeout");
    CHECK(out.message.find("3/4 ranks joined in the store at ") != std::string::npos);
    CHECK(out.message.find("; missing rank 3. Check that every rank was started with the same "
                           "MASTER_ADDR, MASTER_PORT and WORLD_SIZE") != std::string::npos);
  }
}

TEST_CASE("a rank killed or stopped during the rendezvous: the others fail within one timeout") {
  // Rank 1 joins 1 s late, so ranks 0 and 2 wait in the rendezvous; rank 2 kills (or stops)
  // itself 0, 500 or 1005 ms in: before it connects or as it joins (as fast as the machine is),
  // surely while it waits (500), or after. A killed rank that had joined the store is reported at
  // once (the store saw its connection close);
  // otherwise, and for a stopped rank, every other rank fails by the one timeout of the whole
  // rendezvous, the store's host (rank 0) included.
  for (const ddp::HostTransport t : {ddp::HostTransport::tcp, ddp::HostTransport::shm}) {
    for (const int sig : {SIGKILL, SIGSTOP}) {
      for (const int delay_ms : {0, 500, 1005}) {
        CAPTURE(t == ddp::HostTransport::tcp ? "tcp" : "shm");
        CAPTURE(sig);
        CAPTURE(delay_ms);
        mp::TempDir dir;
        ddp::Options o;
        o.transport = t;
        o.timeout = std::chrono::seconds(3);
        const auto t0 = Clock::now();
        (void)mp::spawn_all(3, [&](ddp::Environment env) {
          if (env.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
          if (env.rank == 2) {
            mp::TempDir::write(dir.file("victim"), std::to_string(::getpid()));
            std::thread([sig, delay_ms] {
              std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
              ::raise(sig);
            }).detach();
          }
          const auto start = Clock::now();
          try {
            auto comm = Comm::init(env, o);
            mp::TempDir::write(dir.file("rank" + std::to_string(env.rank)), "ok 0");
          } catch (const ddp::Error& e) {
            report(dir, env.rank, e, mp::ms_since(start));
          }
          if (env.rank == 2) std::this_thread::sleep_for(std::chrono::seconds(10));
          if (env.rank == 0) {  // a stopped victim is killed once rank 0 is done
            const std::string pid = mp::TempDir::read(dir.file("victim"));
            if (!pid.empty()) ::kill(std::stoi(pid), SIGKILL);
          }
        });
        CHECK(mp::ms_since(t0) < 8000);
        for (int r : {0, 1}) {
          const Outcome out = read_outcome(dir, r);
          CAPTURE(r);
          CAPTURE(out.message);
          if (r == 0)
            MESSAGE((sig == SIGKILL ? "SIGKILL" : "SIGSTOP")
                    << " at " << delay_ms << " ms: rank 0 " << out.code << " after " << out.ms
                    << " ms");
          if (out.code == "ok") {  // the victim finished its init before its signal (1005 ms)
            CHECK(delay_ms > 500);
            continue;
          }
          CHECK(out.ms < 3000 + 700);  // one timeout (and a moment to read why), at most
          CHECK(out.message.find("rank 2") != std::string::npos);
          if (sig == SIGKILL && delay_ms == 500) {  // it had joined the store: at once
            CHECK(out.code == "peer_lost");
            CHECK(out.ms < 500 + 1500);
          }
        }
      }
    }
  }
}

TEST_CASE("rank 0 hosts the store: a rank killed in the rendezvous, or rank 0 itself stopped") {
  // Ranks forked by hand, so that rank 0 hosts the store (ddp::spawn's parent does otherwise).
  // A killed rank 2 is reported at once by rank 0 too (it does not wait for it to leave); a
  // stopped rank 0 (the store's host) makes the others fail by one timeout (and half a second
  // for the store's last answer), not a timeout per step.
  for (const int victim : {2, 0}) {
    CAPTURE(victim);
    for (const int delay_ms : {1, 5, 500}) {
      CAPTURE(delay_ms);
      const int port = mp::free_port();
      mp::TempDir dir;
      std::vector<pid_t> ranks;
      for (int r = 0; r < 3; ++r) {
        const pid_t pid = ::fork();
        if (pid == 0) {
          if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
          if (r == victim) {
            std::thread([victim, delay_ms] {
              std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
              ::raise(victim == 0 ? SIGSTOP : SIGKILL);
            }).detach();
          }
          ddp::Options o;
          o.timeout = std::chrono::seconds(3);
          const auto t0 = Clock::now();
          try {
            auto comm = Comm::init(mp::local_env(r, 3, port), o);
            mp::TempDir::write(dir.file("rank" + std::to_string(r)), "ok 0");
          } catch (const ddp::Error& e) {
            report(dir, r, e, mp::ms_since(t0));
          }
          ::_exit(0);
        }
        ranks.push_back(pid);
      }
      for (int r = 0; r < 3; ++r) {
        if (r != victim) ::waitpid(ranks[static_cast<std::size_t>(r)], nullptr, 0);
      }
      ::kill(ranks[static_cast<std::size_t>(victim)], SIGKILL);
      ::waitpid(ranks[static_cast<std::size_t>(victim)], nullptr, 0);
      for (int r = 0; r < 3; ++r) {
        if (r == victim) continue;
        const Outcome out = read_outcome(dir, r);
        CAPTURE(r);
        CAPTURE(out.message);
        CHECK(out.code != "ok");
        CHECK(out.ms < 3000 + 1000);           // one timeout, at most
        if (victim == 2 && delay_ms == 500) {  // it had joined the store: at once
          CHECK(out.code == "peer_lost");
          CHECK(out.ms < 500 + 1500);
          CHECK(out.message.find("rank 2") != std::string::npos);
        }
      }
    }
  }
}

TEST_CASE("a rank with a wrong or missing token fails the rendezvous at once, on every rank") {
  for (const char* bad : {"wrong", ""}) {
    CAPTURE(bad);
    const int port = mp::free_port();
    std::vector<pid_t> ranks;
    char tmpl[] = "/tmp/ddp-token-XXXXXX";
    const std::string dir = ::mkdtemp(tmpl);
    for (int r = 0; r < 3; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        const ddp::Environment env = mp::local_env(r, 3, port);
        ddp::Options o;
        o.token = r == 2 ? bad : "the-job-secret";
        o.timeout = std::chrono::seconds(20);
        if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        const auto t0 = std::chrono::steady_clock::now();
        std::string outcome;
        try {
          auto comm = Comm::init(env, o);
          outcome = "ok";
        } catch (const ddp::Error& e) {
          outcome = std::string(ddp::to_string(e.code())) + " " + std::to_string(e.origin_rank()) +
                    " " + e.what();
        }
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
        std::ofstream(dir + "/rank" + std::to_string(r)) << ms << " " << outcome;
        ::_exit(0);
      }
      ranks.push_back(pid);
    }
    for (const pid_t p : ranks) ::waitpid(p, nullptr, 0);
    for (int r = 0; r < 3; ++r) {
      std::ifstream in(dir + "/rank" + std::to_string(r));
      long long ms = -1;
      std::string code, message;
      int origin = -2;
      in >> ms >> code >> origin;
      std::getline(in, message);
      CAPTURE(r);
      CAPTURE(message);
      CHECK(code == "unauthorized");
      CHECK(ms < 5000);  // not the 20 s timeout
      if (r != 2) {
        CHECK(message.find("the rendezvous failed on rank 2: the store refused") !=
              std::string::npos);
        CHECK(origin == 2);  // the failure's rank as a field: nothing parses the message
      } else {
        CHECK(origin == -1);
      }
      CHECK(message.find("DDP_TOKEN") != std::string::npos);
    }
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE(
    "under torchrun, MASTER_PORT + 1 taken: rank 0 hosts on the next free port, all find it") {
  // torchrun's agent picks MASTER_PORT as a free ephemeral port; its neighbour, where ddp's store
  // goes, may be held by anything. Here: a listener that never answers on P + 1, another job's
  // ddp store on P + 2. Rank 0 hosts on P + 3; the others probe and join it, not the other job.
  int base = 0;
  ddp::detail::Fd silent;
  std::unique_ptr<ddp::StoreServer> other;
  for (int tries = 0; tries < 200 && base == 0; ++tries) {
    const int p = 20000 + static_cast<int>(::getpid() * 7 + tries * 131) % 30000;
    try {
      ddp::detail::Fd a = ddp::detail::listen_tcp("127.0.0.1", p + 1);
      auto b = std::make_unique<ddp::StoreServer>("127.0.0.1", p + 2);
      { ddp::detail::Fd c = ddp::detail::listen_tcp("127.0.0.1", p + 3); }
      silent = std::move(a);
      other = std::move(b);
      base = p;
    } catch (const ddp::Error&) {
    }
  }
  REQUIRE(base != 0);
  ddp::Store("127.0.0.1", base + 2).set("ddp/job", "127.0.0.1:1/another-job/0");

  mp::TempDir dir;
  ddp::spawn(3, [&](ddp::Environment env) {
    ::setenv("DDP_STORE_HOSTED", "0", 1);  // rank 0 hosts, as under torchrun (not spawn's store)
    env.launcher = "torchrun";
    env.master_port = base;
    env.store_port = base + 1;
    env.store_ports = 8;
    ddp::Options o;
    o.timeout = std::chrono::seconds(20);
    auto comm = Comm::init(env, o);
    std::vector<int> v{comm.rank() + 1};
    comm.all_reduce(v);
    MP_EXPECT(v[0] == 6, "all_reduce gave " << v[0]);
  });
  // The other job's store was probed, never joined.
  ddp::Store other_client("127.0.0.1", base + 2);
  const std::string claims[] = {"ddp/0/default/claim/0"};
  CHECK_FALSE(other_client.check(claims));

  // With rank 0 absent the others give up at the timeout, naming the ports and DDP_STORE_PORT.
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  ddp::spawn(
      2,
      [&](ddp::Environment env) {
        if (env.rank == 0) return;
        ::setenv("DDP_STORE_HOSTED", "0", 1);
        env.launcher = "torchrun";
        env.master_port = base;
        env.store_port = base + 1;
        env.store_ports = 8;
        ddp::Options o;
        o.timeout = std::chrono::milliseconds(1500);
        const long long start = now_ms();
        try {
          auto comm = Comm::init(env, o);
        } catch (const ddp::Error& e) {
          report(dir, env.rank, e, now_ms() - start);
        }
      },
      so);
  const Outcome out = read_outcome(dir, 1);
  CAPTURE(out.message);
  CHECK(out.code == "timeout");
  CHECK(out.message.find("or the 7 ports after it") != std::string::npos);
  CHECK(out.message.find("DDP_STORE_PORT") != std::string::npos);
  CHECK(out.ms < 5000);
}
