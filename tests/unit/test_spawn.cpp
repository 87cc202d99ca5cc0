// ddp::spawn when a rank fails: the rank named with its message or signal, a long message, workers
// that never outlive their parent, and no /dev/shm entry left behind.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <ddp/communicator.hpp>
#include <ddp/spawn.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

TEST_CASE("spawn names a failing rank and carries its message") {
  const auto shm_before = our_shm_entries();
  try {
    ddp::spawn(3, [](ddp::Environment env) {
      if (env.rank == 1) throw std::runtime_error("bad batch");
      std::this_thread::sleep_for(std::chrono::seconds(30));  // stopped by spawn
    });
    FAIL("spawn did not throw");
  } catch (const ddp::Error& e) {
    CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
    CHECK(std::string(e.what()).find("bad batch") != std::string::npos);
  }
  try {
    ddp::spawn(2, [](ddp::Environment env) {
      if (env.rank == 0) ::raise(SIGSEGV);
    });
    FAIL("spawn did not throw");
  } catch (const ddp::Error& e) {
    CHECK(std::string(e.what()).find("rank 0") != std::string::npos);
    CHECK(std::string(e.what()).find("killed by SIGSEGV") != std::string::npos);
  }
  CHECK(lasting_new_shm_entries(shm_before).empty());
}

TEST_CASE(
    "spawn without stop_on_failure ends a worker the job left out (stopped past the heartbeat), "
    "and returns once the others are done") {
  // Rank 1 stops itself; its heartbeat (1 s) runs out and the store records it left out; spawn
  // ends it and fails naming it once ranks 0 and 2 finished. Before, spawn waited for ever.
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  const auto start = std::chrono::steady_clock::now();
  try {
    ddp::spawn(
        3,
        [](ddp::Environment env) {
          ddp::Options o;
          o.heartbeat = std::chrono::seconds(1);
          o.timeout = std::chrono::seconds(20);
          auto comm = ddp::Communicator<ddp::backend::Host>::init(env, o);
          if (env.rank == 1) ::raise(SIGSTOP);
          std::this_thread::sleep_for(std::chrono::seconds(2));
        },
        so);
    FAIL("spawn did not fail");
  } catch (const ddp::Error& e) {
    const std::string w = e.what();
    CHECK_MESSAGE(w.find("spawn: rank 1 (pid ") == 0, w);
    CHECK_MESSAGE(
        w.find(") was left out of the job (its heartbeat stopped) and ended") != std::string::npos,
        w);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(15));
}

TEST_CASE("spawn: a long message comes back whole, and workers never outlive the parent") {
  // A message larger than a pipe's buffer must not block the child (the parent reads it only
  // after the child exited); it is cut at 16 KiB.
  try {
    ddp::spawn(1, [](ddp::Environment) { throw std::runtime_error(std::string(200000, 'm')); });
    FAIL("spawn did not throw");
  } catch (const ddp::Error& e) {
    const std::string what = e.what();
    CHECK(what.find(std::string(16384, 'm')) != std::string::npos);
    CHECK(what.find(std::string(16385, 'm')) == std::string::npos);
  }

  mp::TempDir dir;
  const pid_t parent = ::fork();
  REQUIRE(parent >= 0);
  if (parent == 0) {
    try {
      ddp::spawn(2, [&](ddp::Environment env) {
        mp::TempDir::write(dir.file("pid" + std::to_string(env.rank)), std::to_string(::getpid()));
        std::this_thread::sleep_for(std::chrono::seconds(60));
      });
    } catch (...) {
    }
    ::_exit(0);
  }
  std::vector<pid_t> workers;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (workers.size() < 2 && std::chrono::steady_clock::now() < until) {
    workers.clear();
    for (int r = 0; r < 2; ++r) {
      const std::string s = mp::TempDir::read(dir.file("pid" + std::to_string(r)));
      if (!s.empty()) workers.push_back(static_cast<pid_t>(std::stoi(s)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(workers.size() == 2);
  ::kill(parent, SIGKILL);  // cannot be caught: the workers must go by themselves
  int status = 0;
  ::waitpid(parent, &status, 0);
  const auto gone = [](pid_t pid) {  // not running (init reaps orphans; a zombie counts as gone)
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close = all.rfind(')');
    return all.empty() || (close != std::string::npos && all.substr(close + 2, 1) == "Z");
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!(gone(workers[0]) && gone(workers[1])) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(gone(workers[0]));
  CHECK(gone(workers[1]));
}

TEST_CASE("spawn: a DDP_TOKEN given in SpawnOptions::env is the token of spawn's store too") {
  ::unsetenv("DDP_TOKEN");
  ddp::SpawnOptions so;
  so.env = {"DDP_TOKEN=from-the-options"};
  ddp::spawn(
      2,
      [](ddp::Environment env) {
        auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
        std::vector<float> x{1.0f};
        comm.all_reduce(x);
        if (x[0] != 2.0f)
          throw std::runtime_error("all_reduce over 2 gave " + std::to_string(x[0]));
      },
      so);
}
