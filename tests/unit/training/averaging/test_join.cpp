// Join across real processes: uneven inputs finish, averaged over the ranks that trained each
// step; a step without join.step() is refused.
#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/averaging/join.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace join_tests {

namespace {
/// A parameter: its values and its gradient.
struct Param {
  std::vector<float> value, grad;
};
/// A model of three parameters: one large enough to be averaged in place (a bucket of its own),
/// two packed into a bucket.
struct JoinModel {
  std::vector<Param> params;
  JoinModel() {
    for (std::size_t n : {std::size_t{70000}, std::size_t{10}, std::size_t{1000}})
      params.push_back({std::vector<float>(n, 0.5f), std::vector<float>(n)});
  }
  std::vector<Param>& parameters() { return params; }
};
/// Rank r's gradient element k at step s: quarters, so that sums are exact in any order (the
/// order itself is tested elsewhere) and in bfloat16.
float join_grad(int r, int s, std::size_t k) {
  return 0.25f * static_cast<float>((k * 7 + static_cast<std::size_t>(s + r)) % 13) *
         (r == 2 ? -1.0f : 1.0f);
}
/// Steps per rank: up to 3x apart.
int join_steps(int r) { return std::array<int, 4>{6, 18, 12, 9}[static_cast<std::size_t>(r)]; }

/// A user's own per-step collective, shadowed by finished ranks: the samples of each step.
struct SampleCounter : ddp::Joinable {
  mp::Comm* comm;
  double total = 0;
  explicit SampleCounter(mp::Comm& c) : comm(&c) {}
  void add(double samples) {
    double v = samples;
    comm->all_reduce_host(std::span<double>(&v, 1), ddp::ReduceOp::sum);
    total += v;
  }
  void join_step(int) override { add(0); }
};
}  // namespace

TEST_CASE("training: Join: uneven inputs finish, averaged over the ranks that trained each step") {
  for (ddp::Compression compression : {ddp::Compression::none, ddp::Compression::bfloat16}) {
    CAPTURE(static_cast<int>(compression));
    mp::each_world(
        [&](mp::Comm& comm) {
          const int me = comm.rank(), p = comm.size();
          JoinModel model;
          ddp::GradientAverager avg(comm, model, {.compression = compression});
          SampleCounter samples(comm);
          ddp::Join join(comm, {&avg, &samples});
          for (int s = 0; s < join_steps(me); ++s) {
            const int active = join.step();
            int want_active = 0;
            for (int j = 0; j < p; ++j) want_active += join_steps(j) > s;
            MP_EXPECT(active == want_active, "step " << s << ": " << active << " active");
            for (auto& prm : model.params)
              for (std::size_t k = 0; k < prm.grad.size(); ++k) prm.grad[k] = join_grad(me, s, k);
            avg.average();
            samples.add(32);
            for (auto& prm : model.params)
              for (std::size_t k = 0; k < prm.value.size(); ++k) prm.value[k] -= 0.5f * prm.grad[k];
            for (std::size_t i = 0; i < model.params.size(); ++i) {
              const auto& g = model.params[i].grad;
              for (std::size_t k = 0; k < g.size(); ++k) {
                float sum = 0;
                bool first = true;
                for (int j = 0; j < p; ++j) {  // rank order, finished ranks add nothing
                  if (join_steps(j) <= s) continue;
                  sum = first ? join_grad(j, s, k) : sum + join_grad(j, s, k);
                  first = false;
                }
                const float want = sum / static_cast<float>(active);
                if (compression == ddp::Compression::none) {
                  MP_EXPECT(std::memcmp(&g[k], &want, sizeof want) == 0,
                            "step " << s << " parameter " << i << "[" << k << "]: " << g[k]
                                    << " != " << want);
                } else {
                  MP_EXPECT(std::abs(g[k] - want) <= 0.02f * std::max(1.0f, std::abs(want)),
                            "step " << s << " parameter " << i << "[" << k << "]: " << g[k]
                                    << " vs " << want);
                }
              }
            }
          }
          join.finish();
          int longest = 0;
          double all_samples = 0;
          for (int j = 0; j < p; ++j) {
            longest = std::max(longest, join_steps(j));
            all_samples += 32.0 * join_steps(j);
          }
          MP_EXPECT(join.steps() == static_cast<std::size_t>(join_steps(me)), join.steps());
          MP_EXPECT(join.shadowed() == static_cast<std::size_t>(longest - join_steps(me)),
                    join.shadowed());
          MP_EXPECT(samples.total == all_samples, samples.total << " != " << all_samples);
          // Every rank now holds the parameters of the rank that trained longest (rank 1).
          MP_EXPECT(join.last() == (p == 1 ? 0 : 1), join.last());
          std::string mine;
          for (const auto& prm : model.params)
            mine.append(reinterpret_cast<const char*>(prm.value.data()),
                        prm.value.size() * sizeof(float));
          for (const auto& other : comm.all_gather_object(mine))
            MP_EXPECT(other == mine, "ranks ended with different parameters");
          // Out of the Join, the averager averages over every rank again.
          for (auto& prm : model.params)
            std::fill(prm.grad.begin(), prm.grad.end(), static_cast<float>(me));
          avg.average();
          MP_EXPECT(model.params[0].grad[5] ==
                        static_cast<float>(p * (p - 1) / 2) / static_cast<float>(p),
                    model.params[0].grad[5]);
        },
        {1, 2, 3, 4});
  }
}

TEST_CASE("training: Join: a step without join.step() is refused, the destructor finishes") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    JoinModel model;
    ddp::GradientAverager avg(comm, model);
    {
      ddp::Join join(comm, {&avg});
      try {
        avg.average();
        MP_EXPECT(false, "a step without join.step() was taken");
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::invalid_argument &&
                      std::string(e.what()).find("call join.step()") != std::string::npos,
                  e.what());
      }
      for (int s = 0; s < (comm.rank() == 0 ? 1 : 3); ++s) {
        (void)join.step();
        avg.average();
      }
    }  // ~Join finishes
    avg.average();
    try {
      ddp::Join join(comm, {nullptr});
      MP_EXPECT(false, "a null Joinable was taken");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
    }
  });
}

}  // namespace join_tests
