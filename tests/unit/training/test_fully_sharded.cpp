// FullyShardedAverager across real processes: a model whose parameters live sharded, gathered a
// unit at a time, trains bitwise as GradientAverager does; units that differ between ranks, and
// calls out of turn, are refused.
#include <ddp/training/fully_sharded.hpp>
#include <ddp/training/gradient.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace fully_sharded_tests {
namespace {

struct Param {
  std::vector<float> value, grad;
};

// Three units of uneven sizes (a parameter of one element, units smaller and larger than the
// world, blocks that cut parameters apart).
const std::vector<std::vector<std::size_t>> unit_sizes{{37, 1001}, {3, 129, 1}, {5002, 64}};

float initial(std::size_t unit, std::size_t param, std::size_t k) {
  return 0.5f * std::sin(0.3f * static_cast<float>(k) + static_cast<float>(7 * unit + param));
}

// Rank r's gradient at step s of element k of parameter `param` of unit `unit`, given its value.
float gradient(std::size_t unit, std::size_t param, std::size_t k, float value, int rank,
               int step) {
  const float x = static_cast<float>(k) * 0.01f + static_cast<float>(3 * unit + param);
  const float target =
      std::cos(x + 0.7f * static_cast<float>(rank) + 0.3f * static_cast<float>(step));
  return (1.0f + 0.5f * std::sin(x)) * (value - target);
}

// SGD with momentum 0.9, lr 0.05, over slices (value, grad, n) kept in order.
struct Sgd {
  std::vector<std::vector<float>> m;
  template <class Slices>
  void step(Slices&& slices) {
    std::size_t j = 0;
    for (auto&& s : slices) {
      float* v = s.value.data;
      const float* g = s.grad.data;
      if (m.size() <= j) m.emplace_back(s.value.size, 0.0f);
      for (std::size_t k = 0; k < s.value.size; ++k) {
        m[j][k] = 0.9f * m[j][k] + g[k];
        v[k] -= 0.05f * m[j][k];
      }
      ++j;
    }
  }
};

struct WholeParam {
  std::vector<float> value, grad;
};
struct WholeNet {
  std::vector<WholeParam> params;
  WholeNet() {
    for (std::size_t u = 0; u < unit_sizes.size(); ++u)
      for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
        WholeParam p{std::vector<float>(unit_sizes[u][i]), std::vector<float>(unit_sizes[u][i])};
        for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] = initial(u, i, k);
        params.push_back(std::move(p));
      }
  }
  std::vector<WholeParam>& parameters() { return params; }
};

struct Slice {  // a whole parameter as an Sgd slice
  ddp::TensorView<float> value, grad;
};

// Trains 20 SGD-momentum steps both ways; the parameters must end equal: bitwise, or (across
// hosts, where GradientAverager's all_reduce adds each host's sum to the other's while the
// reduce_scatter adds in rank order) within rounding.
void train_against_gradient_averager(mp::Comm& comm, bool bitwise) {
  {
    constexpr int steps = 20;
    // The reference: every parameter whole, averaged by GradientAverager.
    WholeNet whole;
    ddp::GradientAverager avg(comm, whole);
    Sgd whole_opt;
    // Fully sharded: this rank keeps its blocks only, made by the initializer.
    ddp::FullyShardedAverager fsdp(
        comm, unit_sizes,
        [](std::size_t u, std::size_t i, std::size_t offset, std::span<float> values) {
          for (std::size_t k = 0; k < values.size(); ++k) values[k] = initial(u, i, offset + k);
        });
    Sgd opt;
    for (int step = 0; step < steps; ++step) {
      std::size_t first = 0;
      for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
        for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
          auto& p = whole.params[first + i];
          for (std::size_t k = 0; k < p.value.size(); ++k)
            p.grad[k] = gradient(u, i, k, p.value[k], comm.rank(), step);
        }
        first += unit_sizes[u].size();
      }
      avg.average();
      std::vector<Slice> slices;
      for (auto& p : whole.params)
        slices.push_back({{p.value.data(), p.value.size()}, {p.grad.data(), p.grad.size()}});
      whole_opt.step(slices);

      fsdp.prefetch(unit_sizes.size() - 1);
      for (std::size_t u = unit_sizes.size(); u-- > 0;) {  // the backward, last unit first
        const std::span<float> w = fsdp.gather(u);
        if (u > 0) fsdp.prefetch(u - 1);
        const std::span<float> g = fsdp.grad(u);
        std::size_t at = 0;
        for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
          for (std::size_t k = 0; k < unit_sizes[u][i]; ++k)
            g[at + k] += gradient(u, i, k, w[at + k], comm.rank(), step);
          at += unit_sizes[u][i];
        }
        fsdp.release(u);
        fsdp.reduce(u);
      }
      fsdp.synchronize();
      opt.step(fsdp.shard());
    }
    // Every unit gathered: bitwise the reference's parameters, on every rank.
    std::size_t first = 0;
    for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
      const std::span<float> w = fsdp.gather(u);
      std::size_t at = 0;
      for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
        const auto& p = whole.params[first + i].value;
        double worst = 0;
        for (std::size_t k = 0; k < p.size(); ++k)
          worst = std::max(worst, std::abs(static_cast<double>(w[at + k]) - p[k]) /
                                      std::max(1.0, std::abs(static_cast<double>(p[k]))));
        MP_EXPECT(bitwise ? std::memcmp(w.data() + at, p.data(), p.size() * sizeof(float)) == 0
                          : worst <= 1e-5,
                  "unit " << u << " parameter " << i << " differs from GradientAverager's by "
                          << worst << " (relative)");
        at += p.size();
      }
      fsdp.release(u);
      first += unit_sizes[u].size();
    }
    // The shard: about 1/P of the model, its layout covering every element once over the ranks.
    std::size_t total = 0;
    for (const auto& u : unit_sizes)
      for (const std::size_t n : u) total += n;
    const auto p = static_cast<std::size_t>(comm.size());
    MP_EXPECT(fsdp.shard_size() <= total / p + unit_sizes.size(), fsdp.shard_size());
    const std::vector<std::uint64_t> mine{fsdp.layout().elements()};
    std::uint64_t covered = 0;
    for (const auto& n : comm.all_gather_object(mine)) covered += n[0];
    MP_EXPECT(covered == total, covered << " of " << total << " elements in the shards");
  }
}

}  // namespace

TEST_CASE("fully sharded: 20 SGD-momentum steps are bitwise GradientAverager's, worlds 1-4") {
  mp::each_world_on({ddp::HostTransport::shm, ddp::HostTransport::tcp},
                    [](mp::Comm& comm) { train_against_gradient_averager(comm, true); });
  mp::each_world_on({mp::two_hosts},
                    [](mp::Comm& comm) { train_against_gradient_averager(comm, false); });
}

TEST_CASE("fully sharded: units that differ between ranks, and calls out of turn, are refused") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    auto units = unit_sizes;
    if (comm.rank() == 2) units[1][1] = 130;
    try {
      ddp::FullyShardedAverager fsdp(comm, units, nullptr);
      MP_EXPECT(false, "units that differ were accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    std::string(e.what()).find("rank 2's units differ from rank 0's") !=
                        std::string::npos,
                e.what());
    }
    ddp::FullyShardedAverager<ddp::backend::Host> fsdp(comm, unit_sizes, nullptr);
    const auto refused = [](const std::string& needle, auto&& call) {
      mp::expect_invalid(needle, call);
    };
    refused("unit 3 of 3", [&] { (void)fsdp.gather(3); });
    refused("unit 1 is reduced without gradients", [&] { fsdp.reduce(1); });
    (void)fsdp.grad(1);
    fsdp.reduce(1);
    refused("unit 1 is reduced twice", [&] { fsdp.reduce(1); });
    const auto fresh = fsdp.grad(1);  // the reduce waited for, a new backward's zeros
    MP_EXPECT(std::all_of(fresh.begin(), fresh.end(), [](float g) { return g == 0.0f; }),
              "a new backward's gradients are not zero");
    fsdp.synchronize();
    refused("unit 0 has no elements",
            [&] { ddp::FullyShardedAverager<ddp::backend::Host> empty(comm, {{}}, nullptr); });
  });
}

}  // namespace fully_sharded_tests
