// Communicator::shrink across real processes: the survivors of a killed rank (any rank, rank 0
// included) form a communicator of themselves on shm, tcp and two hosts; a second rank dying at
// each phase of the agreement; a stopped rank left out and fenced when it wakes; the store lost
// with rank 0's process. Survivors report to files; the parent checks.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

namespace membership_tests {
using namespace std::chrono_literals;
namespace {

// Each survivor writes "<epoch> <size> <previous ranks...> | <sum>" after a working all_reduce.
void report_members(const mp::TempDir& dir, int old_rank, Comm& next) {
  std::vector<double> v{
      static_cast<double>(next.previous_ranks()[static_cast<std::size_t>(next.rank())])};
  next.all_reduce(v);
  std::string line = std::to_string(next.epoch()) + " " + std::to_string(next.size());
  for (int r : next.previous_ranks()) line += " " + std::to_string(r);
  line += " | " + std::to_string(static_cast<long long>(v[0]));
  mp::TempDir::write(dir.file("rank" + std::to_string(old_rank)), line);
}

std::string expected_line(std::uint64_t epoch, const std::vector<int>& members) {
  std::string line = std::to_string(epoch) + " " + std::to_string(members.size());
  for (int r : members) line += " " + std::to_string(r);
  return line + " | " + std::to_string(std::accumulate(members.begin(), members.end(), 0));
}

// Rank 2 stops itself; continued once the others have gone on without it, its all_reduce and
// its shrink() must fail with Errc::aborted (its message holding each of `says`), its buffer
// untouched. Then it reports "fenced".
void stop_and_expect_fenced(const mp::TempDir& dir, Comm& comm,
                            const std::vector<std::string>& says) {
  ::raise(SIGSTOP);
  std::vector<float> mine(100, 5.0f);
  try {
    comm.all_reduce(mine);
    MP_EXPECT(false, "a fenced rank's all_reduce succeeded");
  } catch (const ddp::Error& e) {
    const std::string m = e.what();
    MP_EXPECT(e.code() == ddp::Errc::aborted && m.find("rank 2: all_reduce") == 0, m);
    for (const std::string& word : says) MP_EXPECT(m.find(word) != std::string::npos, m);
  }
  for (float x : mine) MP_EXPECT(x == 5.0f, "the fenced rank's buffer changed");
  try {
    (void)comm.shrink({.wait_for_ranks = 1s});
    MP_EXPECT(false, "a fenced rank shrank");
  } catch (const ddp::Error& e) {
    MP_EXPECT(e.code() == ddp::Errc::aborted &&
                  std::string(e.what()).find("excluded") != std::string::npos,
              e.what());
  }
  mp::TempDir::write(dir.file("rank2"), "fenced");
}

}  // namespace

TEST_CASE("shrink: the survivors of any killed rank go on, ranks renumbered, on every path") {
  for (const mp::Path& path : mp::paths()) {
    for (int dead = 0; dead < 4; ++dead) {
      CAPTURE(mp::name(path));
      CAPTURE(dead);
      mp::TempDir dir;
      std::string spawn_error;
      ddp::Options o;
      o.timeout = 20s;
      run_faulty(
          4, path,
          [&](Comm& comm) {
            std::vector<float> v(1000, 1.0f);
            comm.all_reduce(v);
            if (comm.rank() == dead) std::_Exit(3);
            const long long t0 = now_ms();
            try {
              for (int i = 0; i < 100; ++i) comm.all_reduce(v);
              MP_EXPECT(false, "all_reduce went on without rank " << dead);
            } catch (const ddp::Error& e) {
              MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted,
                        e.what());
            }
            Comm next = comm.shrink({.wait_for_ranks = 10s});
            MP_EXPECT(next.size() == 3 && next.epoch() == 1, next.size() << " " << next.epoch());
            report_members(dir, comm.rank(), next);
            mp::TempDir::write(dir.file("ms" + std::to_string(comm.rank())),
                               std::to_string(now_ms() - t0));
            // The old communicator fails every call now, naming why.
            try {
              comm.all_reduce(v);
              MP_EXPECT(false, "the old communicator still works");
            } catch (const ddp::Error& e) {
              MP_EXPECT(e.code() == ddp::Errc::aborted, e.what());
            }
          },
          o, &spawn_error);
      CHECK_MESSAGE(spawn_error.find("rank " + std::to_string(dead)) != std::string::npos,
                    spawn_error);
      std::vector<int> members;
      for (int r = 0; r < 4; ++r)
        if (r != dead) members.push_back(r);
      for (int r : members) {
        CHECK(mp::TempDir::read(dir.file("rank" + std::to_string(r))) == expected_line(1, members));
        MESSAGE("rank " << r << ": failure seen to shrunk communicator's first all_reduce in "
                        << mp::TempDir::read(dir.file("ms" + std::to_string(r))) << " ms");
      }
    }
  }
}

TEST_CASE("shrink: a second rank dying at each phase of the agreement costs a round, no split") {
  for (const char* phase : {"alive", "decided", "connected", "ready"}) {
    for (const mp::Path& path :
         {mp::Path(ddp::HostTransport::shm), mp::Path(ddp::HostTransport::tcp)}) {
      CAPTURE(phase);
      CAPTURE(mp::name(path));
      mp::TempDir dir;
      std::string spawn_error;
      ddp::Options o;
      o.timeout = 20s;
      run_faulty(
          4, path,
          [&](Comm& comm) {
            std::vector<float> v(10, 1.0f);
            comm.all_reduce(v);
            if (comm.rank() == 3) std::_Exit(3);
            if (comm.rank() == 2) {
              static const char* at = nullptr;
              at = phase;
              ddp::detail::shrink_phase_hook() = [](const char* p) {
                if (std::string(p) == at) std::_Exit(4);
              };
            }
            try {
              comm.all_reduce(v);
            } catch (const ddp::Error&) {
            }
            // A member that died after saying it was ready joins a formed communicator, whose
            // first collective then fails: one more shrink.
            Comm next = comm.shrink({.wait_for_ranks = 10s});
            for (int attempt = 0; attempt < 2; ++attempt) {
              try {
                std::vector<float> w(10, 1.0f);
                next.all_reduce(w);
                break;
              } catch (const ddp::Error& e) {
                MP_EXPECT(attempt == 0 && std::string(phase) == "ready", e.what());
                next = next.shrink({.wait_for_ranks = 10s});
              }
            }
            report_members(dir, comm.rank(), next);
          },
          o, &spawn_error);
      for (int r : {0, 1}) {
        const std::string line = mp::TempDir::read(dir.file("rank" + std::to_string(r)));
        CHECK_MESSAGE((line == expected_line(1, {0, 1}) || line == expected_line(2, {0, 1})), line);
      }
    }
  }
}

TEST_CASE("shrink: a stopped rank is left out, and fenced when it wakes") {
  for (const mp::Path& path :
       {mp::Path(ddp::HostTransport::shm), mp::Path(ddp::HostTransport::tcp)}) {
    CAPTURE(mp::name(path));
    mp::TempDir dir;
    std::string spawn_error;
    ddp::Options o;
    o.timeout = 2s;
    run_faulty(
        3, path,
        [&](Comm& comm) {
          const auto pids = comm.all_gather_object(static_cast<long>(::getpid()));
          std::vector<float> v(100, 1.0f);
          comm.all_reduce(v);
          if (comm.rank() == 2) {  // continued by rank 0 once the others went on without it
            stop_and_expect_fenced(dir, comm,
                                   {"this rank was excluded", "membership epoch 1 of ranks 0, 1"});
            return;
          }
          try {
            comm.all_reduce(v);
            MP_EXPECT(false, "all_reduce went on without rank 2");
          } catch (const ddp::Error& e) {
            MP_EXPECT(e.code() == ddp::Errc::timeout || e.code() == ddp::Errc::aborted, e.what());
          }
          Comm next = comm.shrink({.wait_for_ranks = 2s});
          if (next.rank() == 0) ::kill(static_cast<pid_t>(pids[2]), SIGCONT);
          // The survivors go on while the fenced rank wakes and tries its old communicator.
          for (int i = 0; i < 20; ++i) {
            std::vector<float> w(100, static_cast<float>(next.rank() + 1));
            next.all_reduce(w);
            MP_EXPECT(w[0] == 3.0f, "survivors' all_reduce " << w[0]);
            std::this_thread::sleep_for(50ms);
          }
          report_members(dir, comm.rank(), next);
        },
        o, &spawn_error);
    CHECK_MESSAGE(spawn_error.empty(), spawn_error);
    CHECK(mp::TempDir::read(dir.file("rank0")) == expected_line(1, {0, 1}));
    CHECK(mp::TempDir::read(dir.file("rank1")) == expected_line(1, {0, 1}));
    CHECK(mp::TempDir::read(dir.file("rank2")) == "fenced");
  }
}

TEST_CASE(
    "heartbeat: a stopped rank is noticed within the heartbeat, not the timeout: shrink() does not "
    "wait for it, and it is fenced when it wakes") {
  for (const mp::Path& path :
       {mp::Path(ddp::HostTransport::shm), mp::Path(ddp::HostTransport::tcp)}) {
    CAPTURE(mp::name(path));
    mp::TempDir dir;
    std::string spawn_error;
    ddp::Options o;
    o.timeout = 60s;  // a stopped rank would cost two of these without the heartbeat
    o.heartbeat = 1s;
    run_faulty(
        3, path,
        [&](Comm& comm) {
          const auto pids = comm.all_gather_object(static_cast<long>(::getpid()));
          std::vector<float> v(100, 1.0f);
          comm.all_reduce(v);
          if (comm.rank() == 2) {  // continued by rank 0 once the others went on without it
            stop_and_expect_fenced(dir, comm, {"no sign of life"});
            return;
          }
          const long long t0 = now_ms();
          try {
            comm.all_reduce(v);  // rank 2 is stopped: noticed through the heartbeat
            MP_EXPECT(false, "all_reduce went on without rank 2");
          } catch (const ddp::Error& e) {
            MP_EXPECT(e.code() == ddp::Errc::peer_lost, e.what());
            MP_EXPECT(std::string(e.what()).find("rank 2 (world rank 2) stopped answering") !=
                          std::string::npos,
                      e.what());
            MP_EXPECT(e.lost_ranks() == std::vector<int>{2}, e.what());
          }
          Comm next = comm.shrink();  // the default wait: the timeout, not spent on rank 2
          const long long paused = now_ms() - t0;
          MP_EXPECT(paused < 20000, "the survivors paused " << paused << " ms");
          mp::TempDir::write(dir.file("ms" + std::to_string(comm.rank())), std::to_string(paused));
          if (next.rank() == 0) ::kill(static_cast<pid_t>(pids[2]), SIGCONT);
          for (int i = 0; i < 20; ++i) {
            std::vector<float> w(100, static_cast<float>(next.rank() + 1));
            next.all_reduce(w);
            MP_EXPECT(w[0] == 3.0f, "survivors' all_reduce " << w[0]);
            std::this_thread::sleep_for(50ms);
          }
          report_members(dir, comm.rank(), next);
        },
        o, &spawn_error);
    CHECK_MESSAGE(spawn_error.empty(), spawn_error);
    CHECK(mp::TempDir::read(dir.file("rank0")) == expected_line(1, {0, 1}));
    CHECK(mp::TempDir::read(dir.file("rank1")) == expected_line(1, {0, 1}));
    CHECK(mp::TempDir::read(dir.file("rank2")) == "fenced");
    MESSAGE("pause with a 1 s heartbeat: " << mp::TempDir::read(dir.file("ms0")) << " ms");
  }
}

TEST_CASE("heartbeat: ranks that disagree on it, or one too short, are refused at init, named") {
  mp::TempDir dir;
  init_outcomes(2, dir, [&](ddp::Environment& env) {
    ddp::Options o;
    o.timeout = 5s;
    o.heartbeat = env.rank == 0 ? 2s : 3s;
    return o;
  });
  for (int r : {0, 1}) {
    const Outcome out = read_outcome(dir, r);
    CAPTURE(out.message);
    CHECK(out.code == "mismatch");
    CHECK(out.message.find("disagree on Options::heartbeat (DDP_HEARTBEAT)") != std::string::npos);
    CHECK(out.message.find("2000 ms") != std::string::npos);
    CHECK(out.message.find("3000 ms") != std::string::npos);
  }
  mp::TempDir too_short;
  init_outcomes(2, too_short, [&](ddp::Environment& env) {
    ddp::Options o;
    o.timeout = 5s;
    o.heartbeat = env.rank == 1 ? std::chrono::milliseconds(-1) : std::chrono::milliseconds(3);
    return o;
  });
  for (int r : {0, 1}) {  // each refuses its own (or learns of the other's first)
    const Outcome out = read_outcome(too_short, r);
    CAPTURE(out.message);
    CHECK(out.code == "invalid_argument");
    CHECK(out.message.find(" ms; give 0 (no heartbeat) or at least 100 ms") != std::string::npos);
  }
}

TEST_CASE("shrink: with the store in rank 0's process, losing rank 0 is named, not waited out") {
  mp::TempDir dir;
  const int port = mp::free_port();
  (void)mp::spawn_all(3, [&](ddp::Environment launched) {
    ::unsetenv("DDP_STORE_HOSTED");  // rank 0 hosts the store, as under a plain launcher
    ddp::Options o;
    o.timeout = 10s;
    auto comm = Comm::init(mp::local_env(launched.rank, 3, port), o);
    std::vector<float> v(10, 1.0f);
    comm.all_reduce(v);
    if (comm.rank() == 0) std::_Exit(3);
    const long long t0 = now_ms();
    try {
      comm.all_reduce(v);
    } catch (const ddp::Error&) {
    }
    try {
      (void)comm.shrink({.wait_for_ranks = 5s});
      MP_EXPECT(false, "shrank without a store");
    } catch (const ddp::Error& e) {
      report(dir, comm.rank(), e, now_ms() - t0);
    }
  });
  for (int r : {1, 2}) {
    const Outcome o = read_outcome(dir, r);
    CHECK_MESSAGE(o.code == "peer_lost", o.code << o.message);
    CHECK_MESSAGE(o.message.find("shrink: the rendezvous store at 127.0.0.1:" +
                                 std::to_string(port) + " is gone") != std::string::npos,
                  o.message);
    CHECK_MESSAGE(o.message.find("ddprun or ddp::spawn") != std::string::npos, o.message);
    CHECK(o.ms < 5000);
  }
}

TEST_CASE(
    "shrink: with the store in rank 0's process, the survivors of rank 1, then of the last rank, "
    "go on: the store outlives the communicator that started it") {
  // A job started by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no launcher's store):
  // `comm = comm.shrink()` destroys the communicator whose rank 0 started the store, while the
  // new one still uses it.
  for (const mp::Path& path :
       {mp::Path(ddp::HostTransport::shm), mp::Path(ddp::HostTransport::tcp)}) {
    CAPTURE(mp::name(path));
    mp::TempDir dir;
    const int port = mp::free_port();
    (void)mp::spawn_all(4, [&](ddp::Environment launched) {
      ::unsetenv("DDP_STORE_HOSTED");  // rank 0 hosts the store, as in a job started by hand
      path.enter(launched.rank, 4);
      ddp::Options o;
      o.timeout = 20s;
      o.transport = path.transport;
      auto comm = Comm::init(mp::local_env(launched.rank, 4, port), o);
      const int first = comm.rank();
      std::vector<float> v(1000, 1.0f);
      comm.all_reduce(v);
      if (first == 1) std::_Exit(3);
      for (int loss = 0; loss < 2; ++loss) {
        try {
          for (;;) comm.all_reduce(v);
        } catch (const ddp::Error& e) {
          MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted, e.what());
          comm = comm.shrink({.wait_for_ranks = 10s});  // the old communicator is destroyed
        }
        for (int i = 0; i < 10; ++i) {
          std::vector<float> w(100, 1.0f);
          comm.all_reduce(w);
          MP_EXPECT(w[0] == static_cast<float>(comm.size()), w[0]);
        }
        if (loss == 0 && comm.rank() == comm.size() - 1) std::_Exit(3);  // the last rank
      }
      mp::TempDir::write(dir.file("rank" + std::to_string(first)),
                         std::to_string(comm.epoch()) + " " + std::to_string(comm.size()));
    });
    CHECK(mp::TempDir::read(dir.file("rank0")) == "2 2");
    CHECK(mp::TempDir::read(dir.file("rank2")) == "2 2");
  }
}

TEST_CASE("shrink: a split() communicator whose member died shrinks at once") {
  mp::TempDir dir;
  std::string spawn_error;
  ddp::Options o;
  o.timeout = 20s;
  run_faulty(
      4, ddp::HostTransport::shm,
      [&](Comm& comm) {
        Comm half = comm.split(comm.rank() % 2, comm.rank());  // {0, 2} and {1, 3}
        std::vector<float> v(10, 1.0f);
        half.all_reduce(v);
        if (comm.rank() == 2) std::_Exit(3);
        if (comm.rank() != 0) return;
        try {
          for (;;) half.all_reduce(v);
        } catch (const ddp::Error&) {
        }
        const long long t0 = now_ms();
        Comm alone = half.shrink({.wait_for_ranks = 10s});
        MP_EXPECT(alone.size() == 1, alone.size());
        mp::TempDir::write(dir.file("ms"), std::to_string(now_ms() - t0));
      },
      o, &spawn_error);
  const std::string ms = mp::TempDir::read(dir.file("ms"));
  CHECK_MESSAGE(!ms.empty(), spawn_error);
  if (!ms.empty()) CHECK(std::stoll(ms) < 5000);  // not the 10 s wait for a rank that died
}

TEST_CASE("shrink: bad requests are refused") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    mp::expect_refused(comm, "excluding itself", "ShrinkOptions::exclude names this rank",
                       [&] { (void)comm.shrink({.exclude = {comm.rank()}}); });
    mp::expect_refused(comm, "excluding no rank", "exclude names rank 7, not a rank",
                       [&] { (void)comm.shrink({.exclude = {7}}); });
    mp::expect_refused(comm, "a negative wait", "wait_for_ranks is -5000 ms",
                       [&] { (void)comm.shrink({.wait_for_ranks = -5s}); });
    // Nobody lost: the members form epoch 1 of the same ranks; the old one is replaced, and a
    // second shrink() of it is refused (the new one shrinks instead).
    Comm next = comm.shrink({.wait_for_ranks = 5s});
    MP_EXPECT(next.size() == 2 && next.epoch() == 1, next.size());
    try {
      (void)comm.shrink();
      MP_EXPECT(false, "a replaced communicator shrank again");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::aborted &&
                    std::string(e.what()).find("already replaced by membership epoch 1") !=
                        std::string::npos,
                e.what());
    }
    Comm third = next.shrink({.wait_for_ranks = 5s});
    MP_EXPECT(third.epoch() == 2, third.epoch());
  });
  mp::run(1, ddp::HostTransport::shm, [](Comm& comm) {  // under a launcher: its store
    Comm same = comm.shrink();
    MP_EXPECT(same.size() == 1 && same.epoch() == 1, "a world of one shrinks to itself");
  });
  mp::run(1, ddp::HostTransport::shm, [](Comm&) {  // without a launcher: no store to agree in
    ::unsetenv("DDP_STORE_HOSTED");
    Comm alone = Comm::init(ddp::Environment{});
    try {
      (void)alone.shrink();
      MP_EXPECT(false, "a world of one without a store shrank");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::unsupported &&
                    std::string(e.what()).find("no rendezvous store") != std::string::npos,
                e.what());
    }
  });
}

}  // namespace membership_tests
