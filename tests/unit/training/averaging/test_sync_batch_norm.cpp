// sync_batch_stats: the statistics of the whole batch from every rank's sums, across real
// processes.
#include <ddp/training/averaging/sync_batch_norm.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "multiprocess.hpp"

TEST_CASE("training: sync_batch_stats equals the statistics of the whole batch") {
  // Rank r holds samples r*10 .. r*10 + r*3 - 1 of 2 channels (rank 0 holds none); channel 1 is
  // channel 0 times -2 plus 1000 (a large mean, a small spread).
  mp::each_world(
      [](mp::Comm& comm) {
        const auto value = [](int ch, int x) { return ch == 0 ? x * 0.5 : 1000.0 - x; };
        const int mine = comm.rank() * 3;
        std::vector<double> sum(2), sq(2);
        for (int k = 0; k < mine; ++k) {
          for (int ch = 0; ch < 2; ++ch) {
            const double v = value(ch, comm.rank() * 10 + k);
            sum[static_cast<std::size_t>(ch)] += v;
            sq[static_cast<std::size_t>(ch)] += v * v;
          }
        }
        const auto s = ddp::sync_batch_stats(comm, sum, sq, static_cast<std::uint64_t>(mine));
        // The reference, from every sample in one place (two-pass).
        std::vector<double> all[2];
        for (int r = 0; r < comm.size(); ++r)
          for (int k = 0; k < r * 3; ++k)
            for (int ch = 0; ch < 2; ++ch) all[ch].push_back(value(ch, r * 10 + k));
        MP_EXPECT(s.count == all[0].size(), "count " << s.count);
        for (int ch = 0; ch < 2; ++ch) {
          const auto& xs = all[ch];
          double mean = 0, m2 = 0;
          for (double x : xs) mean += x;
          mean = xs.empty() ? 0 : mean / static_cast<double>(xs.size());
          for (double x : xs) m2 += (x - mean) * (x - mean);
          const double var = xs.empty() ? 0 : m2 / static_cast<double>(xs.size());
          const double unbiased = xs.size() > 1 ? m2 / static_cast<double>(xs.size() - 1) : var;
          const auto c = static_cast<std::size_t>(ch);
          MP_EXPECT(std::abs(s.mean[c] - mean) <= 1e-12 * (1 + std::abs(mean)), "mean " << ch);
          MP_EXPECT(std::abs(s.var[c] - var) <= 1e-9 * (1 + var),
                    "var " << ch << ": " << s.var[c] << " vs " << var);
          MP_EXPECT(std::abs(s.unbiased_var[c] - unbiased) <= 1e-9 * (1 + unbiased),
                    "unbiased var " << ch);
        }
      },
      {1, 2, 3, 4});
}

TEST_CASE("training: sync_batch_stats with no samples anywhere, and mismatched inputs") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    const std::vector<float> zero(3, 0.0f);
    const auto s = ddp::sync_batch_stats(comm, zero, zero, 0);
    MP_EXPECT(s.count == 0 && s.mean == std::vector<double>(3, 0.0) &&
                  s.var == std::vector<double>(3, 0.0),
              "empty statistics");
    const std::vector<float> two(2, 1.0f);
    try {
      (void)ddp::sync_batch_stats(comm, zero, two, 1);
      MP_EXPECT(false, "no error for 3 sums and 2 sums of squares");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
      MP_EXPECT(std::string(e.what()).find("3 sums but 2 sums of squares") != std::string::npos,
                e.what());
    }
  });
}
