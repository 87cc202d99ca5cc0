// ddp::Work when things fail, across real processes: a communicator destroyed with async work
// outstanding, Work::wait rethrowing an async failure, abort() from another thread.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <ddp/work.hpp>

#include <sstream>
#include <string>
#include <thread>
#include <vector>

TEST_CASE("a communicator destroyed with async work outstanding finishes it, then leaves") {
  for (const mp::Path& t : {mp::Path(ddp::HostTransport::shm), mp::Path(ddp::HostTransport::tcp)}) {
    CAPTURE(mp::name(t));
    ddp::Options o;
    o.transport = t.transport;
    o.timeout = std::chrono::seconds(3);
    mp::TempDir dir;
    // Both ranks drop their Works and destroy the communicator at once; rank 1 comes late, so
    // rank 0's operations are still waiting for it when its destructor runs.
    ddp::spawn(2, [&](ddp::Environment env) {
      std::vector<float> big(1 << 20, static_cast<float>(env.rank + 1));
      std::vector<double> small(3, 1.0);
      {
        auto comm = Comm::init(env, o);
        if (env.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        (void)comm.all_reduce_async(big);
        (void)comm.all_reduce_async(small, ddp::ReduceOp::max);
        (void)comm.barrier_async();
      }
      MP_EXPECT(big.front() == 3.0f && big.back() == 3.0f, "big: " << big.front());
      MP_EXPECT(small[0] == 1.0 && small[2] == 1.0, "small: " << small[0]);
      mp::TempDir::write(dir.file("rank" + std::to_string(env.rank)), "done");
    });
    CHECK(mp::TempDir::read(dir.file("rank0")) == "done");
    CHECK(mp::TempDir::read(dir.file("rank1")) == "done");
    // Work that the other rank never matches fails by name, within the timeout, and the
    // destructor returns then; the other rank leaves without an error.
    const std::string spawn_error = mp::spawn_all(2, [&](ddp::Environment env) {
      std::vector<float> v(1000, 1.0f);
      ddp::Work w;
      const auto t0 = Clock::now();
      {
        auto comm = Comm::init(env, o);
        if (env.rank == 0) w = comm.all_reduce_async(v);
      }
      const long long ms = mp::ms_since(t0);
      std::string outcome = "ok";
      try {
        w.wait();
      } catch (const ddp::Error& e) {
        outcome = std::string(ddp::to_string(e.code())) + " " + e.what();
      }
      mp::TempDir::write(dir.file("unmatched" + std::to_string(env.rank)),
                         std::to_string(ms) + " " + outcome);
    });
    CHECK(spawn_error.empty());
    const std::string r0 = mp::TempDir::read(dir.file("unmatched0"));
    CAPTURE(r0);
    std::istringstream in(r0);
    long long ms = -1;
    std::string code;
    in >> ms >> code;
    CHECK((code == "peer_lost" || code == "timeout"));
    CHECK(r0.find("all_reduce") != std::string::npos);
    CHECK(ms < 6000);
    CHECK(mp::TempDir::read(dir.file("unmatched1")).find(" ok") != std::string::npos);
  }
}

TEST_CASE(
    "Work::wait rethrows an async failure, and abort() from another thread unblocks a waiting "
    "rank") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = std::chrono::seconds(4);
    run_faulty(
        2, t,
        [&](Comm& comm) {
          if (comm.rank() == 1) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // never joins in time
            return;
          }
          std::vector<float> v(100);
          auto work = comm.all_reduce_async(v);
          const auto t0 = Clock::now();
          std::thread watchdog([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            comm.abort("watchdog");
          });
          try {
            work.wait();
          } catch (const ddp::Error& e) {
            report(dir, 0, e, mp::ms_since(t0));
          }
          watchdog.join();
          mp::TempDir::write(dir.file("test"),
                             work.test() && work.failed() ? "done-failed" : "not");
        },
        o);
    const Outcome out = read_outcome(dir, 0);
    CAPTURE(out.message);
    CHECK(out.code == "aborted");
    CHECK(out.ms < 1000);  // timeout / 4
    CHECK(mp::TempDir::read(dir.file("test")) == "done-failed");
  }
}
