// The shared-memory transport when things fail, across real processes: single copy forbidden on
// one rank or configured differently, a rank killed while the transport is set up, rank 0 killed
// while it sets up a large segment, and runs with a random rank killed, which must leave no
// /dev/shm entry behind.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {
/// Makes process_vm_readv fail with EPERM in this process from now on (a seccomp filter, as a
/// container runtime installs one): what a rank sees where the kernel forbids single copy.
void forbid_process_vm_readv() {
  sock_filter code[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, static_cast<__u32>(offsetof(seccomp_data, nr))),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<__u32>(SYS_process_vm_readv), 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(std::size(code)), code};
  MP_EXPECT(::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, std::strerror(errno));
  MP_EXPECT(::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0, std::strerror(errno));
}
}  // namespace

TEST_CASE("shm single copy: one rank that may not read the others turns it off for all") {
  // Rank 1 of 3 cannot read its peers' memory: every rank finds out at init and uses the slot
  // path; the results are right, and nobody fails.
  for (int blocked : {0, 1}) {
    CAPTURE(blocked);
    ddp::spawn(3, [&](ddp::Environment env) {
      if (env.rank == 1 && blocked == 1) forbid_process_vm_readv();
      ddp::Options o;
      o.transport = ddp::HostTransport::shm;
      o.timeout = std::chrono::seconds(20);
      auto comm = Comm::init(env, o);
      const std::size_t want = blocked == 1 ? ddp::Options::never : 64 * 1024u;
      MP_EXPECT(comm.backend().single_copy_bytes() == want, comm.backend().single_copy_bytes());
      std::vector<float> v(1 << 20, static_cast<float>(comm.rank() + 1));
      comm.all_reduce(v);
      MP_EXPECT(v.front() == 6.0f && v.back() == 6.0f, v.front() << " " << v.back());
    });
  }
}

TEST_CASE("a rank killed while the shm transport is set up: the others fail at once naming it") {
  // Rank 2 kills itself a few milliseconds into init: mostly while the ranks of the host map
  // the segment or probe each other's memory, where the others watch its process; a kill before
  // it joined the rendezvous is only found at the timeout (its pid is not known yet).
  int fast = 0;
  for (int delay_ms = 2; delay_ms <= 7; ++delay_ms) {
    CAPTURE(delay_ms);
    mp::TempDir dir;
    ddp::SpawnOptions so;
    so.stop_on_failure = false;
    so.end_left_out = false;  // fault tests wake the ranks they fence
    try {
      ddp::spawn(
          3,
          [&](ddp::Environment env) {
            if (env.rank == 2) {
              std::thread([delay_ms] {
                std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
                ::raise(SIGKILL);
              }).detach();
            }
            ddp::Options o;
            o.transport = ddp::HostTransport::shm;
            o.timeout = std::chrono::seconds(4);
            const long long t0 = now_ms();
            try {
              auto comm = Comm::init(env, o);
              std::vector<float> v(1 << 18, 1.0f);
              for (;;) comm.all_reduce(v);  // until rank 2's death reaches this rank
            } catch (const ddp::Error& e) {
              report(dir, env.rank, e, now_ms() - t0);
            }
          },
          so);
    } catch (const ddp::Error&) {
    }
    for (int r : {0, 1}) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(r);
      CAPTURE(out.message);
      CHECK(out.message.find("rank 2") != std::string::npos);
      if (out.code == "peer_lost") {
        CHECK(out.ms < 2000);
        // Its pid watched during the set-up, or its connection to the store seen to close.
        fast += out.message.find("Communicator::init: rank 2 died") != std::string::npos ||
                out.message.find(
                    "the rendezvous failed on rank 2: its process closed its "
                    "connection to the store") != std::string::npos;
      } else {
        CHECK(out.code == "timeout");
      }
    }
  }
  CHECK(fast > 0);
}

TEST_CASE("shm single copy: ranks that disagree fail at init, or on counts with checks off") {
  mp::TempDir dir;
  init_outcomes(2, dir, [](ddp::Environment& env) {
    ddp::Options o;
    o.transport = ddp::HostTransport::shm;
    o.timeout = std::chrono::seconds(5);
    o.shm_single_copy_bytes = env.rank == 0 ? 0 : ddp::Options::never;
    return o;
  });
  for (int r : {0, 1}) {
    const Outcome out = read_outcome(dir, r);
    CAPTURE(out.message);
    CHECK(out.code == "mismatch");
    CHECK(out.message.find("disagree on single copy (Options::shm_single_copy_bytes, "
                           "DDP_SHM_SINGLE_COPY)") != std::string::npos);
    CHECK(out.message.find("has the default") != std::string::npos);
    CHECK(out.message.find("has off") != std::string::npos);
  }
  // Without fingerprint checks, a rank that reduces fewer bytes than its peer must not let the
  // peer copy past the end of its buffer: both fail with mismatch, naming both counts.
  mp::TempDir dir2;
  ddp::Options off;
  off.verify_collectives = false;
  off.timeout = std::chrono::seconds(10);
  run_faulty(
      2, ddp::HostTransport::shm,
      [&](Comm& comm) {
        std::vector<float> v(comm.rank() == 0 ? 100000 : 100001, 1.0f);
        try {
          comm.all_reduce(v);
          mp::TempDir::write(dir2.file("rank" + std::to_string(comm.rank())), "ok 0");
        } catch (const ddp::Error& e) {
          report(dir2, comm.rank(), e, 0);
        }
      },
      off);
  for (int r : {0, 1}) {
    const Outcome out = read_outcome(dir2, r);
    CAPTURE(r);
    CAPTURE(out.message);
    CHECK(out.code == "mismatch");
    CHECK(out.message.find("400000") != std::string::npos);
    CHECK(out.message.find("400004") != std::string::npos);
  }
}

TEST_CASE("rank 0 killed while setting up a large shared-memory segment leaves nothing behind") {
  const std::size_t names_before = our_shm_entries().size();
  std::mt19937 rng(7);
  for (int run = 0; run < 3; ++run) {
    CAPTURE(run);
    const int port = mp::free_port();
    std::vector<pid_t> ranks;
    for (int r = 0; r < 4; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        const ddp::Environment env = mp::local_env(r, 4, port);
        ddp::Options o;
        o.transport = ddp::HostTransport::shm;
        o.segment_bytes = std::size_t{256} << 20;
        o.timeout = std::chrono::seconds(20);
        try {
          auto comm = Comm::init(env, o);
          std::vector<float> x(1 << 20, 1.0f);
          for (int i = 0; i < 100; ++i) comm.all_reduce(x);
        } catch (const ddp::Error&) {
        }
        ::_exit(0);
      }
      ranks.push_back(pid);
    }
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(100, 600)(rng)));
    ::kill(ranks[0], SIGKILL);
    const auto t0 = std::chrono::steady_clock::now();
    for (pid_t p : ranks) ::waitpid(p, nullptr, 0);
    CHECK(mp::ms_since(t0) < 15000);
  }
  CHECK(our_shm_entries().size() == names_before);
}

TEST_CASE("100 runs with a random rank SIGKILLed leave no /dev/shm entry and no process") {
  std::mt19937 rng(20261122);  // fixed: a failure reproduces
  const auto shm_before = our_shm_entries();
  for (int run = 0; run < 100; ++run) {
    const int victim = static_cast<int>(rng() % 4);
    const int at = static_cast<int>(rng() % 8);  // 0: before the first collective
    CAPTURE(run);
    std::string spawn_error;
    ddp::Options o;
    o.timeout = std::chrono::seconds(10);
    run_faulty(
        4, ddp::HostTransport::shm,
        [&](Comm& comm) {
          std::vector<float> v(64 * 1024, 1.0f);
          try {
            for (int i = 0; i < 1000; ++i) {
              if (comm.rank() == victim && i == at) ::raise(SIGKILL);
              comm.all_reduce(v);
            }
          } catch (const ddp::Error&) {
          }
        },
        o, &spawn_error);
    CHECK(spawn_error.find("rank " + std::to_string(victim)) != std::string::npos);
  }
  CHECK(lasting_new_shm_entries(shm_before).empty());
  // spawn reaps every worker before it returns: this process has no children left.
  const std::string children =
      mp::TempDir::read("/proc/self/task/" + std::to_string(::getpid()) + "/children");
  CHECK(children.find_first_not_of(" \n") == std::string::npos);
}
