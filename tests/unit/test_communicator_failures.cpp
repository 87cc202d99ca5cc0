// The communicator under misuse and failure, across real processes: a communicator used after
// fork(), DDP_VERIFY_COLLECTIVES's words, element counts whose byte size overflows, errors in a
// collective's later rounds, a rank out of file descriptors in init, and 100 cycles of failure and
// a new communicator. (Cases that need processes started by hand or ddprun are in
// tests/launch/test_outsider.py.)
#include "multiprocess.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using mp::Comm;

/// A tensor whose view claims any number of elements over a small real buffer.
struct Liar {
  float* data;
  std::size_t claimed;
};

}  // namespace

template <>
struct ddp::tensor_traits<Liar> {
  static ddp::TensorView<float> view(Liar& t) { return {t.data, t.claimed, ddp::Device::cpu()}; }
};

TEST_CASE("a communicator used by a fork() child fails there and leaves the parent's job intact") {
  for (auto t : {ddp::HostTransport::shm, ddp::HostTransport::tcp}) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    mp::run(2, t, [&](Comm& comm) {
      if (comm.rank() == 0) {
        const pid_t child = ::fork();
        if (child == 0) {
          std::vector<int> v{100, 100};
          std::string outcome = "no error";
          try {
            comm.all_reduce(v);
          } catch (const ddp::Error& e) {
            outcome = std::string(ddp::to_string(e.code())) + " " + e.what();
          }
          mp::TempDir::write(dir.file("child"), outcome);
          ::_exit(0);
        }
        ::waitpid(child, nullptr, 0);
      }
      std::vector<int> v{comm.rank() + 1, 103};
      comm.all_reduce(v);
      MP_EXPECT(v[0] == 3 && v[1] == 206, v[0] << ", " << v[1]);
    });
    const std::string child = mp::TempDir::read(dir.file("child"));
    CAPTURE(child);
    CHECK(child.rfind("invalid_argument ", 0) == 0);
    CHECK(child.find("all_reduce: this communicator was created by process") != std::string::npos);
    CHECK(child.find("fork()") != std::string::npos);
  }
}

TEST_CASE("DDP_VERIFY_COLLECTIVES takes yes/no words and refuses anything else") {
  ::setenv("DDP_VERIFY_COLLECTIVES", "false", 1);
  CHECK_FALSE(ddp::Options::from_env().verify_collectives);
  ::setenv("DDP_VERIFY_COLLECTIVES", "On", 1);
  CHECK(ddp::Options::from_env().verify_collectives);
  ::setenv("DDP_VERIFY_COLLECTIVES", "maybe", 1);
  try {
    (void)ddp::Options::from_env();
    FAIL_CHECK("DDP_VERIFY_COLLECTIVES=maybe was accepted");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    CHECK(std::string(e.what()).find("DDP_VERIFY_COLLECTIVES=\"maybe\"") != std::string::npos);
  }
  ::unsetenv("DDP_VERIFY_COLLECTIVES");
}

TEST_CASE("element counts whose byte size overflows are refused before anything is touched") {
  CHECK(ddp::detail::is_product(12, 3, 4));
  CHECK_FALSE(ddp::detail::is_product(12, 3, 5));
  // 2^62 * 8 wraps to 0 in 64 bits; the check must not be fooled.
  CHECK_FALSE(ddp::detail::is_product(0, std::size_t{1} << 62, 8));
  CHECK(ddp::detail::product_text(std::size_t{1} << 62, 8).find("overflows") != std::string::npos);
  for (auto t : {ddp::HostTransport::shm, ddp::HostTransport::tcp}) {
    CAPTURE(mp::name(t));
    mp::run(2, t, [&](Comm& comm) {
      std::vector<float> small(4, 1.0f);
      const auto expect_refused = [&](auto&& call, const char* what) {
        try {
          call();
        } catch (const ddp::Error& e) {
          const std::string m = e.what();
          MP_EXPECT(e.code() == ddp::Errc::invalid_argument, what << ": " << m);
          MP_EXPECT(m.find("rank " + std::to_string(comm.rank())) != std::string::npos, m);
          MP_EXPECT(m.find(what) != std::string::npos, m);
          return;
        }
        MP_EXPECT(false, what << " was accepted");
      };
      Liar huge{small.data(), std::numeric_limits<std::size_t>::max() / 4 + 2};  // 4 bytes
      expect_refused([&] { comm.all_reduce(huge); }, "all_reduce");
      expect_refused([&] { comm.broadcast(huge, 0); }, "broadcast");
      Liar half{small.data(), std::numeric_limits<std::size_t>::max() / 2 + 2};  // x 2 wraps
      Liar four{small.data(), 4};
      expect_refused([&] { comm.all_gather(half, four); }, "all_gather");
      expect_refused([&] { comm.reduce_scatter(four, half); }, "reduce_scatter");
      // The communicator is still usable: nothing was sent.
      comm.all_reduce(small);
      MP_EXPECT(small[0] == 2.0f, small[0]);
    });
  }
}

TEST_CASE("errors in a collective's later rounds name the collective, not 'operation'") {
  mp::TempDir dir;
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  ddp::spawn(
      3,
      [&](ddp::Environment env) {
        ddp::Options o;
        o.transport = ddp::HostTransport::tcp;
        o.segment_bytes = 4096;  // many rounds per collective
        o.timeout = std::chrono::seconds(20);
        auto comm = Comm::init(env, o);
        std::vector<float> v(1 << 20, 1.0f);  // hundreds of rounds per all_reduce
        comm.all_reduce(v);
        if (comm.rank() == 2) {  // dies in the middle of a collective
          std::thread([] {
            std::this_thread::sleep_for(std::chrono::milliseconds(30));
            ::_exit(0);
          }).detach();
        }
        try {
          for (;;) comm.all_reduce(v);
        } catch (const ddp::Error& e) {
          mp::TempDir::write(dir.file("rank" + std::to_string(comm.rank())), e.what());
        }
      },
      so);
  for (int r : {0, 1}) {
    const std::string m = mp::TempDir::read(dir.file("rank" + std::to_string(r)));
    CAPTURE(m);
    CHECK(m.find("all_reduce") != std::string::npos);
    CHECK(m.find("operation:") == std::string::npos);
  }
}

namespace {
/// Lowers this process's descriptor limit (soft and hard: nothing can raise it again) to 64 and
/// fills the table, then frees `free` descriptors: the next `free` opens succeed, the one after
/// fails with EMFILE.
/// Returns the descriptors it opened (closed again to report the outcome).
std::vector<int> leave_free_descriptors(int free) {
  rlimit lim{64, 64};
  ::setrlimit(RLIMIT_NOFILE, &lim);
  std::vector<int> filled;
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) filled.push_back(fd);
  for (int i = 0; i < free && !filled.empty(); ++i) {
    ::close(filled.back());
    filled.pop_back();
  }
  return filled;
}
}  // namespace

TEST_CASE("a rank out of file descriptors anywhere in init: every rank fails at once, named") {
  if (MP_SANITIZED) {  // their runtimes open descriptors of their own (at exit, on reports)
    MESSAGE("skipped under a sanitizer: it counts the process's descriptors exactly");
    return;
  }
  // The victim has 0, 1, 2, ... descriptors free when init starts, until init succeeds twice:
  // every point of the rendezvous and the transport's set-up runs out in turn. With none free it
  // cannot even reach the store: it fails at once, and the others time out naming it as missing.
  for (const ddp::HostTransport t : {ddp::HostTransport::tcp, ddp::HostTransport::shm}) {
    for (const int victim : {0, 1, 3}) {
      int successes = 0;
      for (int free = 0; free <= 24 && successes < 2; ++free) {
        CAPTURE(t == ddp::HostTransport::tcp ? "tcp" : "shm");
        CAPTURE(victim);
        CAPTURE(free);
        mp::TempDir dir;
        (void)mp::spawn_all(4, [&](ddp::Environment env) {
          ddp::Options o;
          o.transport = t;
          o.timeout = std::chrono::seconds(3);
          std::vector<int> filled;
          if (env.rank == victim) filled = leave_free_descriptors(free);
          const auto t0 = std::chrono::steady_clock::now();
          std::string outcome;
          try {
            auto comm = Comm::init(env, o);
            std::vector<float> x(1000, 1.0f);
            comm.all_reduce(x);
            outcome = "ok";
          } catch (const ddp::Error& e) {
            outcome = std::string(ddp::to_string(e.code())) + " " + e.what();
          }
          for (const int fd : filled) ::close(fd);
          mp::TempDir::write(dir.file("rank" + std::to_string(env.rank)),
                             std::to_string(mp::ms_since(t0)) + " " + outcome);
        });
        int ok = 0;
        for (int r = 0; r < 4; ++r) {
          std::istringstream in(mp::TempDir::read(dir.file("rank" + std::to_string(r))));
          long long ms = -1;
          std::string code, message;
          in >> ms >> code;
          std::getline(in, message);
          CAPTURE(r);
          CAPTURE(code);
          CAPTURE(message);
          if (code == "ok") {
            ++ok;
            continue;
          }
          CHECK(ms >= 0);
          if (free == 0 && r != victim) {  // it never joined
            CHECK(code == "timeout");
            CHECK(message.find("missing rank " + std::to_string(victim)) != std::string::npos);
            continue;
          }
          CHECK(ms < 1500);  // at once, not at the 3 s timeout
          CHECK(message.find("EMFILE") != std::string::npos);
          CHECK(message.find("limit") != std::string::npos);
          CHECK(message.find("rank " + std::to_string(victim)) != std::string::npos);
        }
        CHECK((ok == 0 || ok == 4));
        if (ok == 4) ++successes;
      }
      CHECK(successes > 0);  // enough descriptors: it works
    }
  }
}

namespace {

/// Open file descriptors of this process.
std::size_t open_fds() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

/// Resident set size in KiB (VmRSS).
long long rss_kib() {
  std::istringstream in(mp::TempDir::read("/proc/self/status"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

}  // namespace

TEST_CASE(
    "recover and repeat: 100 cycles of failure and a new communicator leak no file "
    "descriptors and less than 10 MiB") {
  // The store outlives the communicators, as under ddprun (which hosts it): here rank 0's first
  // communicator hosts it (a server made in the parent before fork() could leave a child with a
  // lock its thread held). Each cycle makes a new communicator under a new group name on that
  // store, breaks it with a mismatched collective, and the next one must work.
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    ddp::spawn(3, [&](ddp::Environment env) {
      t.enter(env.rank, env.world_size);
      ddp::Options base_options;
      base_options.transport = t.transport;
      base_options.group = "base";
      const auto base = Comm::init(env, base_options);  // rank 0 hosts the store
      std::size_t fds_after_first = 0;
      long long rss_after_first = 0;
      for (int cycle = 0; cycle <= 100; ++cycle) {
        ddp::Options o;
        o.transport = t.transport;
        o.segment_bytes = mp::test_segment;
        o.external_store = true;
        o.timeout = std::chrono::seconds(20);
        o.group = "cycle-" + std::to_string(cycle);
        auto comm = Comm::init(env, o);
        std::vector<float> v(1000, static_cast<float>(comm.rank() + cycle));
        comm.all_reduce(v);
        MP_EXPECT(v[999] == static_cast<float>(3 + 3 * cycle), "cycle " << cycle << ": " << v[999]);
        std::vector<float> bad(comm.rank() == 0 ? 8 : 9);
        try {
          comm.all_reduce(bad);
          MP_EXPECT(false, "cycle " << cycle << ": a mismatched all_reduce succeeded");
        } catch (const ddp::Error& e) {
          MP_EXPECT(e.code() == ddp::Errc::mismatch, "cycle " << cycle << ": " << e.what());
        }
        if (cycle == 0) continue;  // the first cycle warms up (lazy allocations, libc arenas)
        if (cycle == 1) {
          fds_after_first = open_fds();
          rss_after_first = rss_kib();
        }
        if (cycle == 100) {
          // This cycle's communicator is still open, as the first one was when measured.
          mp::TempDir::write(dir.file("rank" + std::to_string(env.rank)),
                             std::to_string(open_fds()) + " " + std::to_string(fds_after_first) +
                                 " " + std::to_string(rss_kib() - rss_after_first));
        }
      }
    });
    for (int r = 0; r < 3; ++r) {
      std::istringstream in(mp::TempDir::read(dir.file("rank" + std::to_string(r))));
      std::size_t fds = 0, baseline = 0;
      long long growth = 0;
      in >> fds >> baseline >> growth;
      CAPTURE(r);
      CHECK(fds == baseline);
#if !MP_SANITIZED
      CHECK(growth < 10 * 1024);
#endif
      MESSAGE("rank " << r << ": " << fds << " fds, RSS growth " << growth
                      << " KiB over 99 cycles");
    }
  }
}
