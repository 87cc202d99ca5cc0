// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// SyncBatchNorm statistics (torch.nn.SyncBatchNorm's): each rank has per-channel sums and sums
/// of squares over its part of the batch; one all_reduce (in double, in a fixed rank order, so
/// every rank gets bitwise the same result) gives the mean and variance over the whole global
/// batch. Ranks with no samples contribute nothing and still get the global statistics.

#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/process_group.hpp"

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <type_traits>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Per-channel statistics over every rank's samples.
struct BatchStats {
  /// Mean of each channel over all ranks' samples.
  std::vector<double> mean;
  /// Biased (population) variance: what batch normalization divides by.
  std::vector<double> var;
  /// Unbiased variance (count - 1 in the denominator): what running_var is updated with; equals
  /// var when count < 2.
  std::vector<double> unbiased_var;
  /// Samples over all ranks.
  std::uint64_t count = 0;
};

/// Collective: every rank of `comm` calls it with the same number of channels. `sum[c]` and
/// `sqsum[c]` are this rank's sum and sum of squares of channel c over its `count` samples
/// (count may be 0). Errc::invalid_argument when sum and sqsum differ in length; when no rank has
/// a sample the statistics are 0.
template <ProcessGroup Comm, class T>
[[nodiscard]] BatchStats sync_batch_stats(Comm& comm, std::span<const T> sum,
                                          std::span<const T> sqsum, std::uint64_t count) {
  if (sum.size() != sqsum.size())
    detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": sync_batch_stats: ", sum.size(),
                 " sums but ", sqsum.size(), " sums of squares; give one of each per channel");
  const std::size_t c = sum.size();
  std::vector<double> v(2 * c + 1);
  for (std::size_t i = 0; i < c; ++i) {
    v[i] = static_cast<double>(sum[i]);
    v[c + i] = static_cast<double>(sqsum[i]);
  }
  v[2 * c] = static_cast<double>(count);
  comm.all_reduce_host(std::span<double>(v));  // exact for counts below 2^53; any backend
  BatchStats s;
  s.count = static_cast<std::uint64_t>(v[2 * c]);
  s.mean.assign(c, 0.0);
  s.var.assign(c, 0.0);
  s.unbiased_var.assign(c, 0.0);
  if (s.count == 0) return s;
  const double n = v[2 * c];
  for (std::size_t i = 0; i < c; ++i) {
    const double mean = v[i] / n;
    double var = v[c + i] / n - mean * mean;
    if (var < 0) var = 0;  // rounding when the variance is tiny next to the mean
    s.mean[i] = mean;
    s.var[i] = var;
    s.unbiased_var[i] = s.count > 1 ? var * n / (n - 1) : var;
  }
  return s;
}

/// Any contiguous ranges of float or double (std::vector, std::array, spans).
template <class Comm, class R>
[[nodiscard]] BatchStats sync_batch_stats(Comm& comm, const R& sum, const R& sqsum,
                                          std::uint64_t count) requires requires {
  std::span(sum);
}
{
  using T = std::remove_cvref_t<decltype(*std::data(sum))>;
  return sync_batch_stats(comm, std::span<const T>(std::data(sum), std::size(sum)),
                          std::span<const T>(std::data(sqsum), std::size(sqsum)), count);
}

DDP_END_NAMESPACE
