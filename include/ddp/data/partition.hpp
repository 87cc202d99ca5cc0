// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Splitting a dataset between ranks.
///
///  * DataPartitioner<Dataset> (the DataPartitioner of PyTorch's distributed tutorial): shuffles
///  the indices once with a seed
///    and cuts them into parts of the given fractions; `use(i)` is a view of part i.
///  * DistributedSampler (torch.utils.data.DistributedSampler): per epoch, a shuffled order of the
///    whole dataset (seed + epoch), padded by wrapping around to a multiple of the number of ranks
///    (or cut with drop_last); rank r takes positions r, r + R, r + 2R, ... Beyond torch: an exact
///    mode for evaluation (every sample exactly once, no padding: shards differ by at most one, and
///    exact_mean() weighs the per-rank results), state()/restore() to resume mid-epoch, and
///    repartition() to go on over another number of ranks mid-epoch (after shrink()).
///
/// Shuffles never use std::shuffle or std::uniform_int_distribution, whose results differ between
/// standard libraries: the generator (SplitMix64), the bounded draw (Lemire's multiply-shift with
/// rejection) and the shuffle (Fisher-Yates from the top) are specified here, so every rank, every
/// compiler and every run computes the same permutation from the same seed.

#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/process_group.hpp"

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// A dataset: a size and indexed access (a std::vector, a span, your own class).
template <class D>
concept Dataset = requires(const D& d, std::size_t i) {
  { d.size() } -> std::convertible_to<std::size_t>;
  d[i];
};

namespace detail {

__extension__ typedef unsigned __int128 u128;  // GCC and Clang; __extension__: no -Wpedantic

/// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit state advanced by the golden-ratio increment and
/// mixed by two xor-shift-multiply rounds.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) noexcept;

  std::uint64_t next() noexcept;

  /// Uniform in [0, bound), bound > 0: Lemire's multiply-shift with rejection (unbiased).
  std::uint64_t below(std::uint64_t bound) noexcept;

 private:
  std::uint64_t state_;
};

/// 0, 1, ..., n-1 in the order a Fisher-Yates shuffle (from the top) with SplitMix64(seed) gives.
[[nodiscard]] DDP_INLINE std::vector<std::size_t> permutation(std::size_t n, std::uint64_t seed);

}  // namespace detail

/// A view of part of a dataset: size(), operator[], begin()/end(). It shares the index list with
/// its DataPartitioner (so it may outlive it) and refers to the dataset, which must outlive it.
template <Dataset D>
class Partition {
 public:
  /// The `count` elements of `data` whose indices are order[first .. first + count); made by
  /// DataPartitioner::use.
  Partition(const D& data, std::shared_ptr<const std::vector<std::size_t>> order, std::size_t first,
            std::size_t count)
      : data_(&data), order_(std::move(order)), first_(first), count_(count) {}

  /// The number of elements in this part.
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  /// Whether the part has no elements.
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  /// The dataset's element at this part's position i (no bounds check, like operator[] of vector).
  [[nodiscard]] decltype(auto) operator[](std::size_t i) const {
    return (*data_)[(*order_)[first_ + i]];
  }
  /// The element at position i; Errc::invalid_argument when i is out of range.
  [[nodiscard]] decltype(auto) at(std::size_t i) const {
    if (i >= count_)
      detail::fail(Errc::invalid_argument, "Partition::at: position ", i,
                   " is out of range (the part has ", count_, " elements)");
    return (*this)[i];
  }
  /// The dataset indices of this part, in order.
  [[nodiscard]] std::span<const std::size_t> indices() const noexcept {
    return std::span<const std::size_t>(*order_).subspan(first_, count_);
  }

  /// A forward iterator over the part's elements, in the part's order.
  class iterator {
   public:
    using iterator_category = std::forward_iterator_tag;  ///< A forward iterator.
    using difference_type = std::ptrdiff_t;               ///< Distance between positions.
    /// The dataset's element type.
    using value_type = std::remove_cvref_t<decltype(std::declval<const D&>()[std::size_t{}])>;
    /// A singular iterator (not attached to a part).
    iterator() = default;
    /// Position `i` of part `*p`.
    iterator(const Partition* p, std::size_t i) : p_(p), i_(i) {}
    /// The element at this position, as the dataset's operator[] returns it.
    decltype(auto) operator*() const { return (*p_)[i_]; }
    /// Moves to the next position.
    iterator& operator++() {
      ++i_;
      return *this;
    }
    /// Moves to the next position, returning the previous one.
    iterator operator++(int) {
      iterator t = *this;
      ++i_;
      return t;
    }
    /// Same position (iterators of the same part).
    friend bool operator==(const iterator& a, const iterator& b) { return a.i_ == b.i_; }

   private:
    const Partition* p_ = nullptr;
    std::size_t i_ = 0;
  };
  /// The first element.
  [[nodiscard]] iterator begin() const { return iterator(this, 0); }
  /// Past the last element.
  [[nodiscard]] iterator end() const { return iterator(this, count_); }

 private:
  const D* data_;
  std::shared_ptr<const std::vector<std::size_t>> order_;
  std::size_t first_, count_;
};

/// The DataPartitioner of PyTorch's "Writing Distributed Applications" tutorial: the dataset's
/// indices shuffled once by `seed`, then cut into consecutive parts of floor(fraction * size)
/// elements each. The same on every rank.
template <Dataset D>
class DataPartitioner {
 public:
  /// Parts of the given fractions (each in (0, 1], summing to at most 1).
  DataPartitioner(const D& data, std::vector<double> fractions, std::uint64_t seed = 1234)
      : data_(&data) {
    if (fractions.empty())
      detail::fail(Errc::invalid_argument, "DataPartitioner: no fractions given");
    double total = 0;
    for (std::size_t i = 0; i < fractions.size(); ++i) {
      const double f = fractions[i];
      if (!(f > 0 && f <= 1))
        detail::fail(Errc::invalid_argument, "DataPartitioner: fraction ", i, " is ", f,
                     "; each must be in (0, 1]");
      total += f;
    }
    if (total > 1 + 1e-9)
      detail::fail(Errc::invalid_argument, "DataPartitioner: the fractions sum to ", total,
                   ", more than 1");
    const std::size_t n = data.size();
    order_ = std::make_shared<const std::vector<std::size_t>>(detail::permutation(n, seed));
    std::size_t at = 0;
    for (const double f : fractions) {
      const auto len =
          std::min(n - at, static_cast<std::size_t>(std::floor(f * static_cast<double>(n))));
      parts_.emplace_back(at, len);
      at += len;
    }
  }

  /// Parts of the given fractions, written in braces: `DataPartitioner(data, {0.8, 0.2})`.
  DataPartitioner(const D& data, std::initializer_list<double> fractions, std::uint64_t seed = 1234)
      : DataPartitioner(data, std::vector<double>(fractions), seed) {}

  /// `parts` equal parts (one per rank): floor(size / parts) elements each.
  DataPartitioner(const D& data, int parts, std::uint64_t seed = 1234)
      : DataPartitioner(data, equal(parts), seed) {}

  /// A temporary dataset would dangle: keep the dataset alive and pass it by name.
  DataPartitioner(const D&& data, std::vector<double>, std::uint64_t = 1234) = delete;
  DataPartitioner(const D&& data, std::initializer_list<double>, std::uint64_t = 1234) = delete;
  DataPartitioner(const D&& data, int, std::uint64_t = 1234) = delete;

  /// The number of parts.
  [[nodiscard]] std::size_t parts() const noexcept { return parts_.size(); }

  /// A view of part i; Errc::invalid_argument when there is no such part.
  [[nodiscard]] Partition<D> use(std::size_t i) const {
    if (i >= parts_.size())
      detail::fail(Errc::invalid_argument, "DataPartitioner::use(", i, "): there are ",
                   parts_.size(), " parts");
    return Partition<D>(*data_, order_, parts_[i].first, parts_[i].second);
  }
  /// A view of part i (e.g. the rank); Errc::invalid_argument when i is negative or too large.
  [[nodiscard]] Partition<D> use(int i) const {
    if (i < 0) detail::fail(Errc::invalid_argument, "DataPartitioner::use(", i, "): negative");
    return use(static_cast<std::size_t>(i));
  }

 private:
  static std::vector<double> equal(int parts) {
    if (parts < 1)
      detail::fail(Errc::invalid_argument, "DataPartitioner: ", parts, " parts; need at least 1");
    return std::vector<double>(static_cast<std::size_t>(parts), 1.0 / parts);
  }

  const D* data_;
  std::shared_ptr<const std::vector<std::size_t>> order_;
  std::vector<std::pair<std::size_t, std::size_t>> parts_;  // (first, count)
};

/// How a DistributedSampler orders and splits the dataset (torch's constructor arguments).
struct SamplerOptions {
  /// A new order each epoch (seed + epoch); off: 0, 1, 2, ...
  bool shuffle = true;
  /// The shuffle's seed; must be the same on every rank.
  std::uint64_t seed = 0;
  /// Cut the tail instead of padding, so every rank gets floor(size / ranks) distinct samples.
  bool drop_last = false;
  /// For evaluation: every sample exactly once over all ranks, no padding and no cut (shards
  /// differ by at most one; weigh per-rank results with exact_mean()). Excludes drop_last.
  bool exact = false;
};

/// Where a sampler is in an epoch, to resume a run (store it with the checkpoint).
struct SamplerState {
  /// The epoch in progress (set_epoch).
  std::uint64_t epoch = 0;
  /// Samples of this rank's shard already consumed in that epoch.
  std::uint64_t offset = 0;
  /// SamplerOptions::seed, checked on restore.
  std::uint64_t seed = 0;
  /// The dataset size, checked on restore.
  std::uint64_t dataset_size = 0;
  /// The number of ranks, checked on restore.
  std::uint64_t num_replicas = 0;
  /// When the epoch changed world size (DistributedSampler::repartition): each earlier part's
  /// number of ranks and the samples per rank it took, oldest first (ranks, taken, ranks, ...).
  std::vector<std::uint64_t> earlier{};
};

/// torch.utils.data.DistributedSampler's semantics (see the file comment).
class DistributedSampler {
 public:
  /// Rank `rank`'s sampler of `dataset_size` samples over `num_replicas` ranks;
  /// Errc::invalid_argument for a bad rank or count, or for exact together with drop_last.
  DistributedSampler(std::size_t dataset_size, int num_replicas, int rank,
                     SamplerOptions options = {});

  /// Starts an epoch: its order is shuffled with seed + epoch. Resets a restored offset (and
  /// the earlier world sizes of repartition()).
  void set_epoch(std::uint64_t epoch) noexcept;
  /// The current epoch (0 until set_epoch).
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// Samples per rank in an epoch (for this rank: in exact mode, ranks differ by at most one;
  /// after repartition(), in what is left of the epoch).
  [[nodiscard]] std::size_t size() const noexcept { return shard_size(rank_, order_length()); }
  /// Samples over all ranks in an epoch (padded or cut; after repartition(), of what is left).
  [[nodiscard]] std::size_t total_size() const noexcept { return order_length(); }

  /// This rank's dataset indices for the current epoch, from the restored offset on.
  [[nodiscard]] std::vector<std::size_t> indices() const;

  /// Moves this rank's place in the epoch `consumed` samples on (indices() then starts there):
  /// what a training loop calls after each batch, so that state() is where it is.
  void advance(std::size_t consumed);
  /// How it orders and splits (the constructor's options).
  [[nodiscard]] const SamplerOptions& options() const noexcept { return o_; }
  /// The dataset size it was made for.
  [[nodiscard]] std::size_t dataset_size() const noexcept { return n_; }

  /// The state to resume from after `consumed` more samples of this epoch's indices().
  [[nodiscard]] SamplerState state(std::size_t consumed = 0) const;

  /// Continues where state() left off: the same epoch, minus what was consumed. The dataset size,
  /// seed and number of ranks must be those of the saved run (Errc::invalid_argument otherwise);
  /// a state saved after repartition() carries the epoch's earlier world sizes.
  void restore(const SamplerState& s);

  /// Goes on with the current epoch over `num_replicas` ranks, this sampler being rank `rank`'s,
  /// after every rank of the old world consumed `consumed` more samples of indices() (the same
  /// number: the ranks step together; a rank whose exact-mode shard was shorter consumed all of
  /// it). The samples no rank of the old world has taken are dealt out over the new ranks as
  /// set_epoch deals an epoch (padded by wrapping around, cut with drop_last, exact: not at all),
  /// so that with `exact` every sample of the epoch is seen exactly once however often the world
  /// changes. Every new rank calls it with the same arguments but its rank (a rank that joins
  /// restores the state a member had before the call, then calls it). Local: no communication.
  void repartition(int num_replicas, int rank, std::size_t consumed = 0);

 private:
  [[nodiscard]] std::size_t first_replicas() const noexcept;
  /// An order of `order.size()` samples made ready for `r` ranks: padded by wrapping around to a
  /// multiple of r, or cut to one (drop_last), or left (exact).
  void fit(std::vector<std::size_t>& order, std::size_t r) const;
  /// The length of the current part's order (fit() of what earlier parts left), computed.
  [[nodiscard]] std::size_t order_length() const noexcept;
  [[nodiscard]] std::size_t shard_size(int rank, std::size_t len) const noexcept;

  std::size_t n_;
  int replicas_;
  int rank_;
  SamplerOptions o_;
  std::uint64_t epoch_ = 0;
  std::uint64_t offset_ = 0;
  std::vector<std::uint64_t> earlier_;
};

/// The mean over all ranks of a per-sample quantity, each rank contributing the sum over its
/// samples and their count (exact-mode shards differ in size, so averaging the per-rank means
/// would be biased). Collective: every rank of `comm` calls it. 0 when there are no samples.
template <ProcessGroup Comm>
[[nodiscard]] double exact_mean(Comm& comm, double local_sum, std::size_t local_count) {
  std::vector<double> v{local_sum, static_cast<double>(local_count)};
  comm.all_reduce_host(std::span<double>(v));
  return v[1] > 0 ? v[0] / v[1] : 0.0;
}

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/data/impl/partition.ipp"
#endif
