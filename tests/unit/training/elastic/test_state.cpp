// ddp::TrainingState across real processes: a rank killed at each phase of a step (before
// averaging, inside a bucket's all_reduce, between the all_reduce and the update, before the
// commit; and with another survivor ahead of the rest), rank 0 included, on shm, tcp and two
// hosts: the survivors shrink, restore the newest commit and train on; their parameters end
// bitwise equal to each other's, and equal to a run that changed world size at the restored step.
#include <ddp/data/partition.hpp>
#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/elastic/state.hpp>

#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "failure_helpers.hpp"
#include "multiprocess.hpp"

namespace state_tests {
using namespace std::chrono_literals;
namespace {

struct Param {
  std::vector<float> value, grad;
};
struct Net {
  std::vector<Param> params;
  Net() {
    for (std::size_t n : {300u, 7u, 2000u}) {
      Param p{std::vector<float>(n), std::vector<float>(n)};
      for (std::size_t k = 0; k < n; ++k) p.value[k] = 0.01f * static_cast<float>(k % 17);
      params.push_back(std::move(p));
    }
  }
  std::vector<Param>& parameters() { return params; }
};

// The gradient of sample s: depends on the parameters and the sample only (not on the rank).
void backward(Net& m, const std::vector<std::size_t>& samples) {
  for (auto& p : m.params) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
  for (std::size_t s : samples) {
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      auto& p = m.params[i];
      for (std::size_t k = 0; k < p.value.size(); ++k) {
        const float target = std::sin(0.01f * static_cast<float>(k + 31 * s + 7 * i));
        p.grad[k] += (p.value[k] - target) / static_cast<float>(samples.size());
      }
    }
  }
}

std::string bytes_of(const Net& m) {
  std::string s;
  for (const auto& p : m.params)
    s.append(reinterpret_cast<const char*>(p.value.data()), p.value.size() * sizeof(float));
  return s;
}

constexpr int steps = 12, batch = 2;  // per rank
constexpr std::size_t samples = 120;

// Trains `steps` steps with a TrainingState; rank `victim` dies at `phase` of step `at`. The
// survivors shrink, restore and go on. Each survivor writes its parameters and the samples it
// trained on (the sampler repartitioned after the change).
int current_step = 0;  // the victim's step, for its comm hook

void train(Comm& comm, const mp::TempDir& dir, int victim, const std::string& phase, int at) {
  Net net;
  ddp::GradientAverager avg(comm, net, {.bucket_bytes = 1024});
  const int old_rank = comm.rank();
  const bool dies = old_rank == victim;
  if (phase == "all_reduce" && dies) {
    avg.register_comm_hook([at](auto& c, auto& bucket) {
      ddp::Work w = ddp::allreduce_hook(c, bucket);
      if (current_step == at && bucket.index == 0) std::_Exit(5);  // a bucket under way
      return w;
    });
  }
  ddp::DistributedSampler sampler(samples, comm.size(), comm.rank(),
                                  {.seed = 3, .drop_last = true});
  int step = 0, done = 0;  // done: the steps completed, as committed
  ddp::TrainingState state;
  state.track_model("net", net).track_object("done", done).track_sampler("sampler", sampler);
  state.start(comm);
  for (;;) {
    try {
      for (; step < steps; ++step) {
        current_step = step;
        if (dies && step == at && (phase == "forward" || phase == "torn")) std::_Exit(5);
        // A survivor that got ahead of the others before the failure (it applied part of an
        // update, as a rank does whose all_reduce completed where another's did not):
        // restore() must bring it back to the commit.
        if (phase == "torn" && step == at && old_rank == (victim + 1) % 4 && comm.epoch() == 0)
          for (auto& p : net.params) p.value[0] += 1.0f;
        const auto mine = sampler.indices();
        const std::vector<std::size_t> b(mine.begin(), mine.begin() + batch);
        backward(net, b);
        avg.average();
        if (dies && step == at && phase == "update") std::_Exit(5);
        for (auto& p : net.params)
          for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] -= 0.1f * p.grad[k];
        sampler.advance(batch);
        done = step + 1;
        if (dies && step == at && phase == "commit") std::_Exit(5);
        state.commit(comm);
      }
      break;
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted, e.what());
      comm = comm.shrink({.wait_for_ranks = 10s});
      const std::uint64_t restored = state.restore(comm);  // net, done, sampler: newest commit
      MP_EXPECT(restored == static_cast<std::uint64_t>(done), restored << " vs done " << done);
      step = done;
      mp::TempDir::write(dir.file("restored" + std::to_string(old_rank)), std::to_string(step));
    }
  }
  mp::TempDir::write(dir.file("net" + std::to_string(old_rank)), bytes_of(net));
  mp::TempDir::write(dir.file("step" + std::to_string(old_rank)), std::to_string(step));
}

// The same training in one process: steps [0, at) over `before` ranks, the rest over `after`
// (the rest of the epoch dealt again), each step's gradient the mean of the ranks' batch
// gradients.
std::string reference(int at, int before = 4, int after = 3) {
  Net net;
  const ddp::SamplerOptions o{.seed = 3, .drop_last = true};
  std::vector<ddp::DistributedSampler> world;
  for (int r = 0; r < before; ++r) world.emplace_back(samples, before, r, o);
  for (int step = 0; step < steps; ++step) {
    if (step == at && after != before) {
      const ddp::DistributedSampler any = world[0];
      world.clear();
      for (int r = 0; r < after; ++r) {
        world.push_back(any);
        world.back().repartition(after, r);
      }
    }
    std::vector<std::vector<float>> sum;
    for (auto& s : world) {
      const auto mine = s.indices();
      backward(net, std::vector<std::size_t>(mine.begin(), mine.begin() + batch));
      s.restore(s.state(batch));
      if (sum.empty())
        for (auto& p : net.params) sum.emplace_back(p.grad.size(), 0.0f);
      for (std::size_t i = 0; i < sum.size(); ++i)
        for (std::size_t k = 0; k < sum[i].size(); ++k) sum[i][k] += net.params[i].grad[k];
    }
    for (std::size_t i = 0; i < sum.size(); ++i)
      for (std::size_t k = 0; k < sum[i].size(); ++k)
        net.params[i].value[k] -= 0.1f * sum[i][k] / static_cast<float>(world.size());
  }
  return bytes_of(net);
}

double worst_difference(const std::string& a, const std::string& b) {
  double worst = a.size() == b.size() ? 0 : 1e9;
  for (std::size_t k = 0; k + 4 <= std::min(a.size(), b.size()); k += 4) {
    float x, y;
    std::memcpy(&x, a.data() + k, 4);
    std::memcpy(&y, b.data() + k, 4);
    worst = std::max(worst, std::abs(static_cast<double>(x) - y) /
                                std::max(1e-3, std::abs(static_cast<double>(y))));
  }
  return worst;
}

}  // namespace

TEST_CASE(
    "training state: a rank lost at any phase of a step, the survivors go on from one commit") {
  for (const mp::Path& path : mp::paths()) {
    for (const char* phase : {"forward", "all_reduce", "update", "commit", "torn"}) {
      for (int victim : {0, 2}) {
        CAPTURE(mp::name(path));
        CAPTURE(phase);
        CAPTURE(victim);
        mp::TempDir dir;
        std::string spawn_error;
        ddp::Options o;
        o.timeout = 20s;
        run_faulty(
            4, path, [&](Comm& comm) { train(comm, dir, victim, phase, 5); }, o, &spawn_error);
        CHECK_MESSAGE(spawn_error.find("rank " + std::to_string(victim)) != std::string::npos,
                      spawn_error);
        std::string first;
        for (int r = 0; r < 4; ++r) {
          if (r == victim) continue;
          const std::string net = mp::TempDir::read(dir.file("net" + std::to_string(r)));
          CHECK(mp::TempDir::read(dir.file("step" + std::to_string(r))) == std::to_string(steps));
          if (first.empty()) first = net;
          CHECK_MESSAGE(net == first, "rank " << r << "'s parameters differ from the others'");
        }
        CHECK(first.size() == (300 + 7 + 2000) * sizeof(float));
        // No step lost, applied twice or half: the run equals one that changed world size at
        // the restored step.
        const int restored = std::stoi(
            "0" + mp::TempDir::read(dir.file(std::string("restored") + (victim == 0 ? "1" : "0"))));
        MESSAGE("restored at step " << restored);
        const double worst = worst_difference(first, reference(restored));
        CHECK_MESSAGE(worst < 1e-4, "largest relative difference from the reference " << worst);
      }
    }
  }
}

TEST_CASE("training state: what the members track must agree, checked on every member") {
  const auto refused = [](mp::Comm& comm, const std::string& needle, auto&& call) {
    try {
      call();
      MP_EXPECT(false, "accepted: " << needle);
    } catch (const ddp::Error& e) {
      const std::string m = e.what();
      MP_EXPECT(m.find(needle) != std::string::npos, m);
      MP_EXPECT(m.find("rank " + std::to_string(comm.rank())) == 0, m);
    }
  };
  mp::run(2, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    // Another name, another object type, another dataset size: every member refuses.
    std::vector<float> w(8, 1.0f);
    ddp::TrainingState names;
    names.track(comm.rank() == 0 ? "weights" : "bias", w);
    refused(comm, "piece 0 is \"bias\" on rank 1 but \"weights\" on rank 0",
            [&] { names.start(comm); });
    long number = 3;
    std::string text = "x";
    ddp::TrainingState types;
    if (comm.rank() == 0)
      types.track_object("x", number);
    else
      types.track_object("x", text);
    refused(comm, "\"x\" is an object of another type on rank 1", [&] { types.start(comm); });
    ddp::DistributedSampler sampler(comm.rank() == 0 ? 100 : 50, 2, comm.rank());
    ddp::TrainingState samplers;
    samplers.track_sampler("s", sampler);
    refused(comm, "a sampler of another dataset size", [&] { samplers.start(comm); });
    // A name tracked twice, whatever the kind.
    ddp::TrainingState twice;
    twice.track_object("n", number);
    try {
      twice.track("n", w);
      MP_EXPECT(false, "tracked twice");
    } catch (const ddp::Error& e) {
      MP_EXPECT(std::string(e.what()).find("\"n\" is tracked twice") != std::string::npos,
                e.what());
    }
    // A tensor that grew since the commit: refused before anything is copied.
    ddp::TrainingState grown;
    grown.track("w", w);
    grown.start(comm);
    (void)grown.commit(comm);
    w.assign(100000, 3.0f);
    refused(comm, "\"w\" holds 400000 bytes on rank 0 but 32 were committed",
            [&] { (void)grown.restore(comm); });
    // A commit on one rank only does not pair with the other's own all_reduce of two values.
    w.assign(8, 1.0f);
    ddp::TrainingState one;
    one.track("w", w);
    one.start(comm);
    try {
      if (comm.rank() == 0) {
        (void)one.commit(comm);
      } else {
        std::vector<double> two{1.0, 2.0};
        comm.all_reduce_host(std::span<double>(two), ddp::ReduceOp::max);
      }
      MP_EXPECT(false, "a commit paired with another collective");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
    }
  });
}

namespace {

// 3 members train with a TrainingState; a newcomer (world rank 3) joins after step 4 (rank 0
// waits for its request there) and receives the state. `scenario`: "join" (all 4 go on),
// "newcomer_dies" (it dies before receiving the state), "source_dies" (rank 0, which sends
// the state, dies once the grown communicator is formed). Every process that ends writes its
// parameters and where the membership changed.
void grow_training(Comm& comm, bool newcomer, const mp::TempDir& dir, const std::string& scenario,
                   int world_rank) {
  Net net;
  ddp::DistributedSampler sampler(samples, comm.size(), comm.rank(),
                                  {.seed = 3, .drop_last = true});
  int step = 0, done = 0;
  ddp::TrainingState state;
  state.track_model("net", net).track_object("done", done).track_sampler("sampler", sampler);
  std::optional<ddp::GradientAverager<Net, ddp::backend::Host>> avg;
  const ddp::BucketOptions ao{.bucket_bytes = 1024};
  bool fresh = true;
  if (!newcomer) state.start(comm);
  for (;;) {
    try {
      if (fresh) {
        if (newcomer && scenario == "newcomer_dies") std::_Exit(6);
        if (newcomer) state.restore(comm);
        avg.emplace(comm, net, ao);
        step = done;
        fresh = false;
      }
      for (; step < steps; ++step) {
        if (!newcomer && comm.epoch() == 0 && step == 4 && comm.rank() == 0) {
          mp::TempDir::write(dir.file("step4"), "");
          while (comm.waiting_to_enter() == 0) std::this_thread::sleep_for(5ms);
          std::this_thread::sleep_for(60ms);  // past the commit's look-up interval
        }
        const auto mine = sampler.indices();
        backward(net, std::vector<std::size_t>(mine.begin(), mine.begin() + batch));
        avg->average();
        for (auto& p : net.params)
          for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] -= 0.1f * p.grad[k];
        sampler.advance(batch);
        done = step + 1;
        state.commit(comm);
        if (state.entering() == 0) continue;
        if (scenario == "source_dies" && comm.rank() == 0 && comm.epoch() == 0) {
          ddp::GrowOptions g;
          g.ticket = state.ticket();
          Comm grown = comm.grow(g);
          std::_Exit(7);  // before it sends the state
        }
        if (state.grow(comm)) {
          mp::TempDir::write(dir.file("grew_at"), std::to_string(done));
          avg.emplace(comm, net, ao);
        }
      }
      break;
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted, e.what());
      comm = comm.shrink({.wait_for_ranks = 10s});
      state.restore(comm);
      avg.emplace(comm, net, ao);
      step = done;
      fresh = false;
    }
  }
  mp::TempDir::write(dir.file("net" + std::to_string(world_rank)), bytes_of(net));
  mp::TempDir::write(dir.file("size" + std::to_string(world_rank)), std::to_string(comm.size()));
}

}  // namespace

TEST_CASE(
    "training state: a newcomer joins at a step boundary and receives the live state, killed "
    "during the transfer, or its sender killed, the others go on") {
  for (const char* scenario : {"join", "newcomer_dies", "source_dies"}) {
    for (const mp::Path& path : mp::paths()) {
      CAPTURE(scenario);
      CAPTURE(mp::name(path));
      mp::TempDir dir;
      ddp::Options o;
      o.timeout = 20s;
      o.transport = path.transport;
      o.segment_bytes = mp::test_segment;
      ddp::SpawnOptions so;
      so.stop_on_failure = false;
      so.end_left_out = false;  // fault tests wake the ranks they fence
      std::string spawn_error;
      try {
        ddp::spawn(
            4,
            [&](ddp::Environment env) {
              path.enter(env.rank, 4);
              if (env.rank == 3) {
                while (!mp::TempDir::exists(dir.file("step4"))) std::this_thread::sleep_for(5ms);
                Net net;  // the same tracked state as the members', for the ticket
                ddp::DistributedSampler sampler(samples, 1, 0);
                int done = 0;
                ddp::TrainingState t;
                t.track_model("net", net)
                    .track_object("done", done)
                    .track_sampler("sampler", sampler);
                auto comm = Comm::enter(env, o, {.ticket = t.ticket()});
                grow_training(comm, true, dir, scenario, 3);
                return;
              }
              env.world_size = 3;
              env.local_world_size = std::min(env.local_world_size, 3);
              auto comm = Comm::init(env, o);
              grow_training(comm, false, dir, scenario, env.rank);
            },
            so);
      } catch (const ddp::Error& e) {
        spawn_error = e.what();
      }
      const std::string s(scenario);
      const std::vector<int> ends = s == "join"            ? std::vector<int>{0, 1, 2, 3}
                                    : s == "newcomer_dies" ? std::vector<int>{0, 1, 2}
                                                           : std::vector<int>{1, 2, 3};
      CHECK_MESSAGE(spawn_error.empty() == (s == "join"), spawn_error);
      std::string first;
      for (int r : ends) {
        const std::string net = mp::TempDir::read(dir.file("net" + std::to_string(r)));
        CHECK(mp::TempDir::read(dir.file("size" + std::to_string(r))) ==
              std::to_string(ends.size()));
        if (first.empty()) first = net;
        CHECK_MESSAGE(net == first, "process " << r << "'s parameters differ from the others'");
      }
      // As a run that had 3 ranks up to the growth and 4 after it (or 3 throughout).
      const int at = s == "join" ? std::stoi("0" + mp::TempDir::read(dir.file("grew_at"))) : 0;
      if (s == "join") CHECK(at == 5);
      const double worst = worst_difference(first, reference(at, 3, s == "join" ? 4 : 3));
      CHECK_MESSAGE(worst < 1e-4, "largest relative difference from the reference " << worst);
    }
  }
}

}  // namespace state_tests
