// ddp::PowerSGDHook across real processes: gradients of low rank come back exactly (the power
// iteration finds them), vectors and matrices not worth compressing are averaged as they are,
// the first start_iter steps are plain all_reduces, error feedback makes the applied updates
// track the true averages over steps, a ddp::Join's finished ranks keep in step, and the
// elements sent are counted.
#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/averaging/join.hpp>
#include <ddp/training/averaging/powersgd.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace powersgd_tests {

namespace {

struct Param {
  std::vector<float> value, grad;
  std::size_t r = 0;
  [[nodiscard]] std::size_t rows() const { return r; }
};

// A 40 x 30 matrix (compressed), a vector of 30 (as it is) and a 3 x 3 matrix (too small to
// gain: as it is).
struct Net {
  std::vector<Param> params;
  Net() {
    params.push_back({std::vector<float>(1200), std::vector<float>(1200), 40});
    params.push_back({std::vector<float>(30), std::vector<float>(30), 0});
    params.push_back({std::vector<float>(9), std::vector<float>(9), 3});
  }
  std::vector<Param>& parameters() { return params; }
};

float u(std::size_t i) { return std::cos(0.3f * static_cast<float>(i)) + 0.5f; }
float v(int r, std::size_t j) {
  return std::sin(0.7f * static_cast<float>(j) + static_cast<float>(r));
}
float w(int r, std::size_t k) {
  return 0.1f * static_cast<float>(r + 1) * static_cast<float>(k % 5);
}

// Rank r's gradients: u v_r^T (rank 1; their average u v̄^T is rank 1 too), and other values.
void fill_low_rank(Net& m, int r) {
  for (std::size_t i = 0; i < 40; ++i)
    for (std::size_t j = 0; j < 30; ++j) m.params[0].grad[i * 30 + j] = u(i) * v(r, j);
  for (std::size_t k = 0; k < 30; ++k) m.params[1].grad[k] = w(r, k);
  for (std::size_t k = 0; k < 9; ++k) m.params[2].grad[k] = w(r, k + 3);
}

// A full-rank gradient, the same on every step.
float full(int r, std::size_t i, std::size_t j) {
  return std::sin(0.9f * static_cast<float>(i * 31 + j * 17) + static_cast<float>(r));
}

}  // namespace

TEST_CASE("PowerSGD: low-rank gradients exact, vectors and small matrices as they are, counted") {
  mp::each_world(
      [](mp::Comm& comm) {
        const int p = comm.size();
        Net net;
        ddp::GradientAverager avg(comm, net);
        ddp::PowerSGDHook psgd({.rank = 2, .start_iter = 0, .error_feedback = false});
        avg.register_comm_hook(psgd);
        fill_low_rank(net, comm.rank());
        avg.average();
        for (std::size_t i = 0; i < 40; ++i)
          for (std::size_t j = 0; j < 30; ++j) {
            float want = 0;
            for (int r = 0; r < p; ++r) want += u(i) * v(r, j);
            want /= static_cast<float>(p);
            const float got = net.params[0].grad[i * 30 + j];
            MP_EXPECT(std::abs(got - want) <= 1e-4f * (1 + std::abs(want)),
                      "matrix [" << i << "][" << j << "]: " << got << " vs " << want);
          }
        for (std::size_t k = 0; k < 30; ++k) {
          float want = 0;
          for (int r = 0; r < p; ++r) want += w(r, k);
          MP_EXPECT(std::abs(net.params[1].grad[k] - want / static_cast<float>(p)) <= 1e-6f,
                    "vector [" << k << "]");
        }
        const auto st = psgd.stats();
        // P (40 x 2) and Q (30 x 2) instead of 1200; the vector and the 3 x 3 as they are.
        MP_EXPECT(st.sent == 40 * 2 + 30 * 2 + 30 + 9, "sent " << st.sent);
        MP_EXPECT(st.uncompressed == 1200 + 30 + 9, "uncompressed " << st.uncompressed);
        MP_EXPECT(st.steps == 1, "steps " << st.steps);
      },
      {1, 2, 3, 4});
}

TEST_CASE(
    "PowerSGD: plain all_reduce before start_iter, and with error feedback the updates track "
    "the averages") {
  mp::each_world(
      [](mp::Comm& comm) {
        const int p = comm.size();
        Net net;
        ddp::GradientAverager avg(comm, net);
        ddp::PowerSGDHook psgd({.rank = 1, .start_iter = 2});
        avg.register_comm_hook(psgd);
        std::vector<double> want(1200), applied(1200);
        for (std::size_t i = 0; i < 40; ++i)
          for (std::size_t j = 0; j < 30; ++j) {
            for (int r = 0; r < p; ++r) want[i * 30 + j] += full(r, i, j);
            want[i * 30 + j] /= p;
          }
        double approx_error_first = 0;
        const int steps = 60;
        for (int s = 0; s < steps; ++s) {
          for (std::size_t i = 0; i < 40; ++i)
            for (std::size_t j = 0; j < 30; ++j)
              net.params[0].grad[i * 30 + j] = full(comm.rank(), i, j);
          avg.average();
          double diff = 0, norm = 0;
          for (std::size_t k = 0; k < 1200; ++k) {
            diff += std::pow(net.params[0].grad[k] - want[k], 2);
            norm += want[k] * want[k];
            applied[k] += net.params[0].grad[k];
          }
          if (s < 2) MP_EXPECT(diff <= 1e-8 * norm, "step " << s << " was not a plain all_reduce");
          if (s == 2) approx_error_first = std::sqrt(diff / norm);
        }
        // One step's rank-1 approximation of a full-rank matrix is far off; with error feedback
        // what was left out is sent later, so the sum of the updates approaches the true sum.
        double diff = 0, norm = 0;
        for (std::size_t k = 0; k < 1200; ++k) {
          diff += std::pow(applied[k] - steps * want[k], 2);
          norm += std::pow(steps * want[k], 2);
        }
        const double tracked = std::sqrt(diff / norm);
        MP_EXPECT(approx_error_first > 0.3, "rank 1 of a full-rank matrix: " << approx_error_first);
        MP_EXPECT(tracked < 0.25 * approx_error_first, "accumulated relative error "
                                                           << tracked << " vs one step's "
                                                           << approx_error_first);
      },
      {1, 2, 3});
}

TEST_CASE(
    "PowerSGD: one non-finite gradient resets the bucket's error and warm start, and the next "
    "steps are finite again") {
  mp::each_world(
      [](mp::Comm& comm) {
        Net net;
        ddp::GradientAverager avg(comm, net);
        ddp::PowerSGDHook psgd({.rank = 2, .start_iter = 1});
        avg.register_comm_hook(psgd);
        for (int s = 0; s < 8; ++s) {
          for (std::size_t i = 0; i < 40; ++i)
            for (std::size_t j = 0; j < 30; ++j)
              net.params[0].grad[i * 30 + j] = full(comm.rank(), i, j);
          for (std::size_t k = 0; k < 30; ++k) net.params[1].grad[k] = w(comm.rank(), k);
          for (std::size_t k = 0; k < 9; ++k) net.params[2].grad[k] = w(comm.rank(), k + 3);
          // Step 3: an overflow on the last rank (a loss-scaling step skips it).
          if (s == 3 && comm.rank() == comm.size() - 1) {
            net.params[0].grad[17] = std::numeric_limits<float>::infinity();
            net.params[1].grad[2] = std::numeric_limits<float>::quiet_NaN();
          }
          avg.average();
          const bool nonfinite = avg.found_nonfinite();
          MP_EXPECT(nonfinite == (s == 3), "step " << s << ": non-finite " << nonfinite);
        }
        MP_EXPECT(psgd.stats().resets == 1, "resets " << psgd.stats().resets);
      },
      {1, 2, 3});
}

TEST_CASE("PowerSGD in a ddp::Join: finished ranks issue the same collectives, sums stay exact") {
  mp::each_world(
      [](mp::Comm& comm) {
        const int me = comm.rank(), p = comm.size();
        Net net;
        ddp::GradientAverager avg(comm, net);
        avg.register_comm_hook(
            ddp::PowerSGDHook({.rank = 2, .start_iter = 1, .error_feedback = false}));
        ddp::Join join(comm, {&avg});
        for (int s = 0; s < 2 + me; ++s) {
          const int active = join.step();
          fill_low_rank(net, me);
          avg.average();
          for (std::size_t k = 0; k < 1200; k += 13) {
            float want = 0;
            for (int r = 0; r < p; ++r)
              if (2 + r > s) want += u(k / 30) * v(r, k % 30);
            want /= static_cast<float>(active);
            MP_EXPECT(
                std::abs(net.params[0].grad[k] - want) <= 1e-4f * (1 + std::abs(want)),
                "step " << s << " [" << k << "]: " << net.params[0].grad[k] << " vs " << want);
          }
        }
        join.finish();
      },
      {2, 3, 4});
}

TEST_CASE("PowerSGD: bad options are refused") {
  CHECK_THROWS_WITH_AS(ddp::PowerSGDHook({.rank = 0}), doctest::Contains("rank must be at least 1"),
                       ddp::Error);
}

}  // namespace powersgd_tests
