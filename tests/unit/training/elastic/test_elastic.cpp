// ddp::Elastic across real processes: the README's loop on one object. Ranks are killed mid-epoch
// (rank 0 included, two in a run), a restarted process rejoins; every sample of every epoch is
// trained on exactly once (a count tracked with the model, so a step rolled back is counted
// once), and the processes that finish end bitwise equal.
#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/elastic/elastic.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "failure_helpers.hpp"
#include "multiprocess.hpp"

namespace elastic_tests {
using namespace std::chrono_literals;
namespace {

struct Param {
  std::vector<float> value, grad;
};
struct Net {
  std::vector<Param> params;
  Net() {
    params.push_back({std::vector<float>(40, 0.5f), std::vector<float>(40)});
    params.push_back({std::vector<float>(7, -0.25f), std::vector<float>(7)});
  }
  std::vector<Param>& parameters() { return params; }
};

constexpr std::size_t samples = 103;
constexpr int epochs = 3;

/// Where a process dies: world rank `rank` at step `step` of epoch `epoch` of its first life.
struct Kill {
  int rank, epoch;
  std::size_t step;
};

/// Where a process dies outside a step: world rank `rank` (in its first life), the `nth` time
/// (from 1) it reaches `phase`: "reset" (its on_reset), "commit" (its on_commit; nth is the
/// commit), "transfer" (a state transfer, start() being the first), or "shrink.<p>" (phase p of
/// the agreement, alive/decided/connected/ready, in its first shrink).
struct PhaseKill {
  int rank;
  const char* phase;
  int nth;
};

/// The phase kill of this process, for the hooks (plain function pointers).
const char* hook_phase = nullptr;
int hook_nth = 0, hook_seen = 0, hook_rank = -1;
const mp::TempDir* hook_dir = nullptr;

void die_here(int rank, const mp::TempDir& dir) {
  mp::TempDir::write(dir.file("died" + std::to_string(rank)), "");
  std::_Exit(9);
}

void phase_hook(const char* phase) {
  if (hook_phase == nullptr) return;
  const std::string want = hook_phase;
  const std::string got = want.starts_with("shrink.") ? std::string("shrink.") + phase : phase;
  if (got == want && ++hook_seen == hook_nth) die_here(hook_rank, *hook_dir);
}

/// One process of the job: the README's loop. `rejoin`: restarted by its launcher.
void train(ddp::Environment env, const std::vector<Kill>& kills, const mp::TempDir& dir,
           const ddp::Options& o, std::chrono::milliseconds step_time,
           const std::vector<PhaseKill>& phase_kills = {}) {
  int resets = 0;
  const auto dies_at = [&](const char* phase, int nth) {
    if (env.rejoin) return;
    for (const PhaseKill& k : phase_kills)
      if (k.rank == env.rank && std::string(k.phase) == phase && k.nth == nth)
        die_here(k.rank, dir);
  };
  for (const PhaseKill& k : phase_kills) {
    if (env.rejoin || k.rank != env.rank) continue;
    const std::string phase = k.phase;
    if (phase == "transfer" || phase.starts_with("shrink.")) {
      hook_phase = k.phase;
      hook_nth = k.nth;
      hook_rank = k.rank;
      hook_dir = &dir;
      if (phase == "transfer")
        ddp::detail::state_phase_hook() = phase_hook;
      else
        ddp::detail::shrink_phase_hook() = phase_hook;
    }
  }
  using Host = ddp::backend::Host;
  Net net;
  ddp::DistributedSampler sampler(samples, env.world_size, env.rank,
                                  {.shuffle = true, .seed = 3, .exact = true});
  std::vector<float> count(samples, 0.0f);  // times each sample was trained on this epoch
  ddp::Elastic<Host> job(env, o, {.shrink = {.wait_for_ranks = 20s}});
  job.track_model("net", net).track("count", count).track_sampler("sampler", sampler);
  std::optional<ddp::GradientAverager<Net, Host>> avg;
  job.on_reset([&](ddp::Communicator<Host>& comm) {
    dies_at("reset", ++resets);
    avg.emplace(comm, net);  // collective: a rank dead before it fails the others in it
  });
  std::uint64_t reported = 0;
  job.on_commit([&](ddp::Communicator<Host>& comm, std::uint64_t n) {
    // Each commit once, in order (a newcomer's first is the job's next; one a loss interrupted
    // is reported again after the recovery).
    MP_EXPECT(reported == 0 || n == reported + 1 || n == reported,
              "commit " << n << " reported after " << reported);
    reported = std::max(reported, n);
    dies_at("commit", static_cast<int>(n));
    std::vector<float> v(2, 1.0f);  // a collective, as a checkpoint written here would make
    comm.all_reduce(v);
  });
  job.run_epochs(
      sampler, epochs, 8,
      [&](ddp::Communicator<Host>& comm, const ddp::ElasticBatch& b) {
        for (const Kill& k : kills)
          if (!env.rejoin && k.rank == env.rank && k.epoch == b.epoch && k.step == b.step) {
            mp::TempDir::write(dir.file("died" + std::to_string(env.rank)), "");
            std::_Exit(9);
          }
        std::this_thread::sleep_for(step_time);
        std::vector<float> seen(samples, 0.0f);
        for (const std::size_t i : b.indices) {
          seen[i] += 1.0f;
          for (auto& p : net.params)
            for (std::size_t j = 0; j < p.grad.size(); ++j)
              p.grad[j] += std::sin(0.01f * static_cast<float>(i * 31 + j)) /
                           static_cast<float>(b.local_batch);
        }
        comm.all_reduce(seen);
        for (std::size_t i = 0; i < samples; ++i) count[i] += seen[i];
        avg->average();
        for (auto& p : net.params)
          for (std::size_t j = 0; j < p.value.size(); ++j) {
            p.value[j] -= 0.1f * p.grad[j];
            p.grad[j] = 0;
          }
      },
      [&](ddp::Communicator<Host>&, int epoch) {
        for (std::size_t i = 0; i < samples; ++i)
          MP_EXPECT(count[i] == 1.0f, "epoch " << epoch << ": sample " << i << " trained on "
                                               << count[i] << " times");
        std::fill(count.begin(), count.end(), 0.0f);
      });
  std::string bytes;
  for (const auto& p : net.params)
    bytes.append(reinterpret_cast<const char*>(p.value.data()), p.value.size() * sizeof(float));
  mp::TempDir::write(dir.file("net" + std::to_string(env.rank)), bytes);
  mp::TempDir::write(dir.file("end" + std::to_string(env.rank)),
                     std::to_string(job.comm().size()) + " " + std::to_string(job.epoch()) + " " +
                         std::to_string(job.recoveries()));
}

/// `members` processes start the job; `late` more start later as restarted ones (DDP_REJOIN),
/// claiming the world ranks given.
void run_job(int members, const std::vector<int>& late, const std::vector<Kill>& kills,
             const mp::TempDir& dir, ddp::HostTransport transport,
             std::chrono::milliseconds step_time = 0ms,
             const std::vector<PhaseKill>& phase_kills = {}) {
  ddp::Options o;
  o.timeout = 30s;
  o.transport = transport;
  o.segment_bytes = mp::test_segment;
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  try {
    ddp::spawn(
        members + static_cast<int>(late.size()),
        [&](ddp::Environment env) {
          if (env.rank >= members) {  // restarted once the process of its rank died
            env.rank = late[static_cast<std::size_t>(env.rank - members)];
            env.rejoin = true;
            while (!mp::TempDir::exists(dir.file("died" + std::to_string(env.rank))))
              std::this_thread::sleep_for(10ms);
          }
          env.world_size = members;
          env.local_world_size = std::min(env.local_world_size, members);
          train(env, kills, dir, o, step_time, phase_kills);
        },
        so);
  } catch (const ddp::Error&) {  // the killed ones
  }
}

}  // namespace

TEST_CASE(
    "Elastic: ranks killed mid-epoch (rank 0 among them), the others go on: every sample once per "
    "epoch, survivors bitwise equal") {
  for (const auto transport : {ddp::HostTransport::shm, ddp::HostTransport::tcp}) {
    CAPTURE(static_cast<int>(transport));
    mp::TempDir dir;
    run_job(4, {}, {{2, 0, 3}, {0, 1, 2}}, dir, transport);
    const std::string want = mp::TempDir::read(dir.file("net1"));
    REQUIRE(!want.empty());
    CHECK(mp::TempDir::read(dir.file("net3")) == want);
    CHECK(mp::TempDir::read(dir.file("end1")) == "2 3 2");
    CHECK(mp::TempDir::read(dir.file("end3")) == "2 3 2");
    CHECK(!mp::TempDir::exists(dir.file("net0")));
    CHECK(!mp::TempDir::exists(dir.file("net2")));
  }
}

TEST_CASE(
    "Elastic: a second loss during a recovery (in on_reset, on_commit, the agreement, the state "
    "transfer) costs one more recovery, never the job") {
  struct Case {
    const char* what;
    std::vector<Kill> kills;
    std::vector<PhaseKill> phase_kills;
    std::vector<int> survivors;
  };
  const std::vector<Case> cases{
      // Rank 2 lost in a step; rank 3 then dies in its on_reset of that recovery (its second).
      {"on_reset", {{2, 0, 3}}, {{3, "reset", 2}}, {0, 1}},
      // Rank 1 dies in on_commit of commit 5 (a collective there), the commit made everywhere.
      {"on_commit", {}, {{1, "commit", 5}}, {0, 2, 3}},
      // Rank 2 lost in a step; rank 3 dies in the survivors' agreement, once it is decided.
      {"the agreement", {{2, 1, 1}}, {{3, "shrink.decided", 1}}, {0, 1}},
      // Rank 2 lost in a step; rank 0, the lowest member, dies as it sends the restored state
      // (its second transfer: start() was the first).
      {"the state transfer", {{2, 0, 4}}, {{0, "transfer", 2}}, {1, 3}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    mp::TempDir dir;
    run_job(4, {}, c.kills, dir, ddp::HostTransport::shm, 0ms, c.phase_kills);
    const std::string want = mp::TempDir::read(dir.file("net" + std::to_string(c.survivors[0])));
    REQUIRE(!want.empty());
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const bool survives =
          std::find(c.survivors.begin(), c.survivors.end(), r) != c.survivors.end();
      CHECK(mp::TempDir::exists(dir.file("net" + std::to_string(r))) == survives);
      if (!survives) continue;
      CHECK(mp::TempDir::read(dir.file("net" + std::to_string(r))) == want);
      const std::string end = mp::TempDir::read(dir.file("end" + std::to_string(r)));
      CHECK(end.rfind(std::to_string(c.survivors.size()) + " 3 ", 0) == 0);  // size, epochs
    }
  }
}

TEST_CASE(
    "Elastic: a member lost while a newcomer enters (in the grown job's on_reset): the newcomer "
    "and the others recover together") {
  // World rank 1 dies at step 2 of epoch 0 and is restarted; rank 2 dies in its on_reset of the
  // growth that admits it (its third: the start, the recovery, the growth).
  mp::TempDir dir;
  run_job(3, {1}, {{1, 0, 2}}, dir, ddp::HostTransport::shm, 30ms, {{2, "reset", 3}});
  const std::string want = mp::TempDir::read(dir.file("net0"));
  REQUIRE(!want.empty());
  CHECK(mp::TempDir::read(dir.file("net1")) == want);  // the restarted process
  CHECK(!mp::TempDir::exists(dir.file("net2")));
  CHECK(mp::TempDir::read(dir.file("end0")).rfind("2 3 ", 0) == 0);
  CHECK(mp::TempDir::read(dir.file("end1")).rfind("2 3 ", 0) == 0);
}

TEST_CASE(
    "Elastic: a killed rank's restarted process rejoins the running job with the live state: "
    "every sample once per epoch, all bitwise equal") {
  mp::TempDir dir;
  run_job(3, {1}, {{1, 0, 2}}, dir, ddp::HostTransport::shm, 30ms);
  const std::string want = mp::TempDir::read(dir.file("net0"));
  REQUIRE(!want.empty());
  // World rank 1 wrote once: its restarted process (the first was killed).
  CHECK(mp::TempDir::read(dir.file("net1")) == want);
  CHECK(mp::TempDir::read(dir.file("net2")) == want);
  CHECK(mp::TempDir::read(dir.file("end0")) == "3 3 1");
  CHECK(mp::TempDir::read(dir.file("end1")) == "3 3 0");
}

TEST_CASE(
    "Elastic: a step that fails with a recoverable code every time, no rank lost, is rethrown, "
    "not recovered from forever") {
  mp::TempDir dir;
  std::string spawn_error;
  ddp::Options o;
  o.timeout = 20s;
  run_faulty(
      3, ddp::HostTransport::shm,
      [&](Comm& comm) {
        const int me = comm.rank();
        ddp::Elastic<ddp::backend::Host> job(ddp::Environment::detect(), {.group = "again"});
        std::uint64_t done = 0;
        job.track_object("done", done);
        try {
          job.run(20, [&](Comm& c, std::uint64_t step) {
            if (me == 1 && step == 3)
              ddp::detail::fail(ddp::Errc::timeout, "the step's own timeout");  // every time
            std::vector<float> v(4, 1.0f);
            c.all_reduce(v);
            done = step + 1;
          });
          mp::TempDir::write(dir.file("r" + std::to_string(me)), "finished");
        } catch (const ddp::Error& e) {
          mp::TempDir::write(dir.file("r" + std::to_string(me)),
                             std::to_string(job.recoveries()) + " " + e.what());
        }
      },
      o, &spawn_error);
  for (int r = 0; r < 3; ++r) {
    const std::string got = mp::TempDir::read(dir.file("r" + std::to_string(r)));
    CHECK_MESSAGE(got.find("it is not a lost rank, so it is rethrown") != std::string::npos, got);
    CHECK_MESSAGE(got.rfind("2 ", 0) == 0, got);  // one retry, then rethrown
  }
  CHECK(mp::TempDir::read(dir.file("r1")).find("the step's own timeout") != std::string::npos);
}

TEST_CASE(
    "Elastic: a rank left out (stopped past the others' wait) ends when it wakes: exit status 75 "
    "and one line saying why, or the error rethrown when exit_when_left_out is false") {
  for (const bool exits : {true, false}) {
    CAPTURE(exits);
    mp::TempDir dir;
    std::string spawn_error;
    ddp::Options o;
    o.timeout = 2s;
    run_faulty(
        3, ddp::HostTransport::shm,
        [&](Comm& comm) {
          const int me = comm.rank();
          const auto pids = comm.all_gather_object(static_cast<long>(::getpid()));
          ddp::ElasticOptions eo;
          eo.shrink.wait_for_ranks = 1s;
          eo.exit_when_left_out = exits;
          ddp::Elastic<ddp::backend::Host> job(ddp::Environment::detect(),
                                               {.timeout = 2s, .group = "left"}, eo);
          std::uint64_t done = 0;
          job.track_object("done", done);
          job.on_reset([&](Comm& c) {  // after the recovery: the stopped rank wakes
            if (c.size() == 2 && c.rank() == 0) ::kill(static_cast<pid_t>(pids[2]), SIGCONT);
          });
          if (me == 2) {  // its stderr to a file, to read its last words
            const int fd = ::open(dir.file("stderr2").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
            ::dup2(fd, 2);
            ::close(fd);
          }
          try {
            job.run(30, [&](Comm& c, std::uint64_t step) {
              if (me == 2 && step == 3) ::raise(SIGSTOP);
              std::vector<float> v(4, 1.0f);
              c.all_reduce(v);
              done = step + 1;
              std::this_thread::sleep_for(20ms);
            });
            mp::TempDir::write(dir.file("r" + std::to_string(me)),
                               std::to_string(job.comm().size()) + " " + std::to_string(done));
          } catch (const ddp::Error& e) {
            mp::TempDir::write(dir.file("r" + std::to_string(me)),
                               std::string(ddp::to_string(e.code())) + " " + e.what());
          }
        },
        o, &spawn_error);
    CHECK(mp::TempDir::read(dir.file("r0")) == "2 30");
    CHECK(mp::TempDir::read(dir.file("r1")) == "2 30");
    const std::string words = mp::TempDir::read(dir.file("stderr2"));
    if (exits) {
      CHECK_MESSAGE(spawn_error.find("exited with status 75") != std::string::npos, spawn_error);
      CHECK(!mp::TempDir::exists(dir.file("r2")));
      CHECK_MESSAGE(words.rfind("ddp: world rank 2 was left out of the job and ends (exit status "
                                "75): ",
                                0) == 0,
                    words);
      CHECK_MESSAGE(words.find("can never act on this communicator again") != std::string::npos,
                    words);
      CHECK_MESSAGE(std::count(words.begin(), words.end(), '\n') == 1, words);
    } else {
      CHECK_MESSAGE(spawn_error.empty(), spawn_error);
      const std::string r2 = mp::TempDir::read(dir.file("r2"));
      CHECK_MESSAGE(r2.rfind("aborted ", 0) == 0, r2);
      CHECK_MESSAGE(r2.find("can never act on this communicator again") != std::string::npos, r2);
      CHECK_MESSAGE(words.empty(), words);
    }
  }
}

TEST_CASE("Elastic: what cannot work is refused, saying what to do") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    (void)comm;
    ddp::Environment env = ddp::Environment::detect();
    ddp::Elastic<ddp::backend::Host> job(env, {.group = "elastic"});
    ddp::DistributedSampler untracked(10, 2, env.rank);
    const auto says = [](auto&& f, const char* what) {
      try {
        f();
        MP_EXPECT(false, "accepted: " << what);
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::invalid_argument &&
                      std::string(e.what()).find(what) != std::string::npos,
                  e.what());
      }
    };
    says([&] { job.run_epochs(untracked, 1, 4, [](auto&, const ddp::ElasticBatch&) {}); },
         "the sampler is not tracked");
    int x = 0;
    (void)job.comm();
    says([&] { job.track_object("x", x); }, "the communicator is made already");
  });
}

}  // namespace elastic_tests
