// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/data/partition.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <numeric>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE SplitMix64::SplitMix64(std::uint64_t seed) noexcept : state_(seed) {}

DDP_INLINE std::uint64_t SplitMix64::next() noexcept {
  std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

DDP_INLINE std::uint64_t SplitMix64::below(std::uint64_t bound) noexcept {
  u128 m = static_cast<u128>(next()) * bound;
  auto low = static_cast<std::uint64_t>(m);
  if (low < bound) {
    const std::uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      m = static_cast<u128>(next()) * bound;
      low = static_cast<std::uint64_t>(m);
    }
  }
  return static_cast<std::uint64_t>(m >> 64);
}

DDP_INLINE std::vector<std::size_t> permutation(std::size_t n, std::uint64_t seed) {
  std::vector<std::size_t> p(n);
  std::iota(p.begin(), p.end(), std::size_t{0});
  SplitMix64 rng(seed);
  for (std::size_t i = n; i > 1; --i) {
    const auto j = static_cast<std::size_t>(rng.below(i));
    std::swap(p[i - 1], p[j]);
  }
  return p;
}
}  // namespace detail
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE

DDP_INLINE DistributedSampler::DistributedSampler(std::size_t dataset_size, int num_replicas,
                                                  int rank, SamplerOptions options)
    : n_(dataset_size), replicas_(num_replicas), rank_(rank), o_(options) {
  if (num_replicas < 1)
    detail::fail(Errc::invalid_argument, "DistributedSampler: num_replicas is ", num_replicas,
                 "; need at least 1");
  if (rank < 0 || rank >= num_replicas)
    detail::fail(Errc::invalid_argument, "DistributedSampler: rank ", rank, " is out of range [0, ",
                 num_replicas, ")");
  if (o_.exact && o_.drop_last)
    detail::fail(Errc::invalid_argument,
                 "DistributedSampler: exact and drop_last exclude each other");
}

DDP_INLINE void DistributedSampler::set_epoch(std::uint64_t epoch) noexcept {
  epoch_ = epoch;
  offset_ = 0;
  earlier_.clear();
}

DDP_INLINE std::vector<std::size_t> DistributedSampler::indices() const {
  std::vector<std::size_t> order;
  if (o_.shuffle) {
    order = detail::permutation(n_, o_.seed + epoch_);
  } else {
    order.resize(n_);
    std::iota(order.begin(), order.end(), std::size_t{0});
  }
  fit(order, first_replicas());
  for (std::size_t i = 0; i + 1 < earlier_.size(); i += 2) {
    // Every rank took `taken` of its positions r, r + R, ...: together, the first taken * R
    // (a rank whose exact-mode shard was shorter took all of it). The rest goes on.
    const std::size_t gone = std::min<std::size_t>(
        order.size(), static_cast<std::size_t>(earlier_[i] * earlier_[i + 1]));
    order.erase(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(gone));
    fit(order, i + 2 < earlier_.size() ? static_cast<std::size_t>(earlier_[i + 2])
                                       : static_cast<std::size_t>(replicas_));
  }
  std::vector<std::size_t> mine;
  mine.reserve(size());
  for (std::size_t i = static_cast<std::size_t>(rank_); i < order.size();
       i += static_cast<std::size_t>(replicas_)) {
    mine.push_back(order[i]);
  }
  mine.erase(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(
                                              std::min<std::uint64_t>(offset_, mine.size())));
  return mine;
}

DDP_INLINE void DistributedSampler::advance(std::size_t consumed) {
  if (consumed > size() - std::min<std::size_t>(size(), offset_))
    detail::fail(Errc::invalid_argument, "DistributedSampler::advance: ", offset_, " + ", consumed,
                 " samples of a shard of ", size());
  offset_ += consumed;
}

DDP_INLINE SamplerState DistributedSampler::state(std::size_t consumed) const {
  return SamplerState{
      epoch_, offset_ + consumed, o_.seed, n_, static_cast<std::uint64_t>(replicas_), earlier_};
}

DDP_INLINE void DistributedSampler::restore(const SamplerState& s) {
  if (s.dataset_size != n_ || s.seed != o_.seed ||
      s.num_replicas != static_cast<std::uint64_t>(replicas_)) {
    detail::fail(Errc::invalid_argument, "DistributedSampler::restore: the state is of a run with ",
                 s.dataset_size, " samples, seed ", s.seed, " and ", s.num_replicas,
                 " ranks; this sampler has ", n_, ", ", o_.seed, " and ", replicas_,
                 s.num_replicas != static_cast<std::uint64_t>(replicas_)
                     ? " (to go on over another number of ranks mid-epoch, restore with the "
                       "old number and call repartition())"
                     : "");
  }
  // Each earlier part: 1 to 2^31 - 1 ranks, each having taken at most the dataset.
  bool damaged = s.earlier.size() % 2 != 0;
  for (std::size_t i = 0; i + 1 < s.earlier.size() && !damaged; i += 2)
    damaged = s.earlier[i] == 0 || s.earlier[i] > 0x7fffffffu || s.earlier[i + 1] > n_;
  if (damaged)
    detail::fail(Errc::invalid_argument,
                 "DistributedSampler::restore: a damaged state (its earlier world sizes "
                 "cannot be those of an epoch of ",
                 n_, " samples)");
  const std::vector<std::uint64_t> saved = earlier_;
  earlier_ = s.earlier;
  if (s.offset > size()) {
    earlier_ = saved;
    detail::fail(Errc::invalid_argument, "DistributedSampler::restore: offset ", s.offset,
                 " is past the ", size(), " samples of the shard");
  }
  epoch_ = s.epoch;
  offset_ = s.offset;
}

DDP_INLINE void DistributedSampler::repartition(int num_replicas, int rank, std::size_t consumed) {
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas)
    detail::fail(Errc::invalid_argument, "DistributedSampler::repartition: rank ", rank, " of ",
                 num_replicas, " ranks");
  if (consumed > size() - std::min<std::size_t>(size(), offset_))
    detail::fail(Errc::invalid_argument, "DistributedSampler::repartition: ", offset_, " + ",
                 consumed, " samples consumed of a shard of ", size());
  earlier_.insert(earlier_.end(), {static_cast<std::uint64_t>(replicas_), offset_ + consumed});
  replicas_ = num_replicas;
  rank_ = rank;
  offset_ = 0;
}

DDP_INLINE std::size_t DistributedSampler::first_replicas() const noexcept {
  return static_cast<std::size_t>(earlier_.empty() ? static_cast<std::uint64_t>(replicas_)
                                                   : earlier_[0]);
}

DDP_INLINE void DistributedSampler::fit(std::vector<std::size_t>& order, std::size_t r) const {
  if (o_.exact || order.empty()) return;
  const std::size_t base = order.size();
  const std::size_t total = o_.drop_last ? base / r * r : (base + r - 1) / r * r;
  for (std::size_t i = 0; order.size() < total; ++i) order.push_back(order[i % base]);
  order.resize(total);
}

DDP_INLINE std::size_t DistributedSampler::order_length() const noexcept {
  const auto fitted = [&](std::size_t len, std::size_t r) {
    if (o_.exact || len == 0) return len;
    return o_.drop_last ? len / r * r : (len + r - 1) / r * r;
  };
  std::size_t len = fitted(n_, first_replicas());
  for (std::size_t i = 0; i + 1 < earlier_.size(); i += 2) {
    len -= std::min<std::size_t>(len, static_cast<std::size_t>(earlier_[i] * earlier_[i + 1]));
    len = fitted(len, i + 2 < earlier_.size() ? static_cast<std::size_t>(earlier_[i + 2])
                                              : static_cast<std::size_t>(replicas_));
  }
  return len;
}

DDP_INLINE std::size_t DistributedSampler::shard_size(int rank, std::size_t len) const noexcept {
  const auto r = static_cast<std::size_t>(replicas_);
  return len / r + (static_cast<std::size_t>(rank) < len % r ? 1 : 0);
}

DDP_END_NAMESPACE
