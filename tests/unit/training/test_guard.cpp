// ZeroFirstGuard across real processes: rank 0 goes first, and when it throws the others do not
// hang.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"

#include <ddp/training/guard.hpp>

#include <stdexcept>
#include <string>
#include <thread>

TEST_CASE("ZeroFirstGuard: rank 0 goes first, if it throws, the others do not hang") {
  for (auto scope : {ddp::GuardScope::local, ddp::GuardScope::global}) {
    mp::TempDir dir;
    mp::run(3, ddp::HostTransport::shm, [&](Comm& comm) {
      {
        ddp::ZeroFirstGuard guard(comm, scope);
        if (comm.rank() == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(150));
          mp::TempDir::write(dir.file("cache"), "built");
        } else {
          MP_EXPECT(mp::TempDir::read(dir.file("cache")) == "built",
                    "rank " << comm.rank() << " entered before rank 0 finished");
        }
      }
      comm.barrier();
    });
  }
  mp::TempDir dir;
  run_faulty(3, ddp::HostTransport::shm, [&](Comm& comm) {
    try {
      ddp::ZeroFirstGuard guard(comm);
      if (comm.rank() == 0) throw std::runtime_error("dataset download failed");
      mp::TempDir::write(dir.file("entered" + std::to_string(comm.rank())), "yes");
    } catch (const ddp::Error& e) {
      report(dir, comm.rank(), e, 0);
    } catch (const std::runtime_error& e) {
      mp::TempDir::write(dir.file("rank0"), std::string("user 0 ") + e.what());
    }
  });
  CHECK(read_outcome(dir, 0).code == "user");
  for (int r : {1, 2}) {
    const Outcome out = read_outcome(dir, r);
    CAPTURE(out.message);
    CHECK(out.code == "aborted");
    CHECK(out.message.find("rank 0 of the group threw inside the guarded block") !=
          std::string::npos);
    CHECK(mp::TempDir::read(dir.file("entered" + std::to_string(r))).empty());
  }
}
