// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Metrics: named scalars that every rank records during an epoch (a loss, counts of correct
/// answers, a step time), reduced across ranks in one collective: sums, weighted means, minima and
/// maxima, the same bits on every rank.
///
///     ddp::Metrics m;
///     m.mean("loss", batch_loss, batch_size);    // weighted: per-sample, not per-rank
///     m.sum("correct", correct).sum("seen", batch_size);
///     m.max("step_ms", ms);
///     const auto r = m.reduce(comm);             // collective: every rank calls it
///     if (comm.rank() == 0) std::puts(r.format().c_str());   // "loss 0.3412  correct 8923 ..."
///
/// reduce() is one all_reduce of a rank-by-metric table (each rank fills its own row, zeros
/// elsewhere), after which every rank combines the rows in rank order 0..P-1: sums and means
/// are those ddp's own all_reduce would give (bitwise on backend::Host), and a mean is the sum of
/// value × weight over every rank's records divided by the sum of the weights (as exact_mean:
/// ranks with more samples weigh more). Every rank must record the same names, kinds and order;
/// reduce() compares them (a digest in each row) and fails with Errc::mismatch on every rank,
/// naming the first rank that differs, instead of mixing up values. It costs 8 × P × (names + 1)
/// bytes: meant for a handful of metrics per epoch or per log line, not per-element tensors.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/process_group.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// How a metric combines across records and ranks.
enum class MetricKind : std::uint8_t {
  sum,   ///< the total
  mean,  ///< Σ value × weight / Σ weight over every record of every rank
  min,   ///< the smallest value
  max,   ///< the largest value
};

/// Reduced metrics: the same names, in the order they were first recorded, with their values.
class MetricValues {
 public:
  /// One reduced metric.
  struct Entry {
    std::string name;  ///< as recorded
    MetricKind kind;   ///< how it combined
    double value;      ///< the reduced value (NaN when no rank recorded one)
    double weight;     ///< mean: Σ weight over all ranks; sum, min, max: records over all ranks
  };

  /// The value named `name`; Errc::invalid_argument naming it when there is none.
  [[nodiscard]] double operator[](std::string_view name) const { return entry(name).value; }
  /// The entry named `name` (value, kind, weight); Errc::invalid_argument when there is none.
  [[nodiscard]] const Entry& entry(std::string_view name) const;
  /// Whether a metric named `name` was reduced.
  [[nodiscard]] bool contains(std::string_view name) const noexcept;
  /// Every entry, in recording order.
  [[nodiscard]] const std::vector<Entry>& entries() const noexcept { return entries_; }
  /// The number of metrics.
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// Whether there are none.
  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }

  /// "loss 0.3412  correct 8923  step_ms 41.2": each value with `digits` significant digits
  /// (%g), in recording order, two spaces apart.
  [[nodiscard]] std::string format(int digits = 4) const;

 private:
  friend class Metrics;
  [[nodiscard]] std::string names() const;
  std::vector<Entry> entries_;
};

/// Named scalars recorded on each rank and reduced across ranks in one collective (see the file
/// comment). Recording is local and cheap; a name keeps the kind it was first recorded with.
class Metrics {
 public:
  /// Adds `value` to the sum named `name`.
  Metrics& sum(std::string_view name, double value);
  /// Records `value` as the mean of `weight` samples (a batch's mean loss and its size): the
  /// reduced mean weighs every sample of every rank alike. weight 0 records nothing.
  Metrics& mean(std::string_view name, double value, double weight = 1.0);
  /// Keeps the smallest value recorded as `name`.
  Metrics& min(std::string_view name, double value);
  /// Keeps the largest value recorded as `name`.
  Metrics& max(std::string_view name, double value);

  /// This rank's own values (not reduced), for per-rank logs.
  [[nodiscard]] MetricValues local() const;

  /// Collective: every rank of `comm` calls it, having recorded the same names with the same
  /// kinds in the same order (Errc::mismatch on every rank otherwise). Returns the reduced
  /// values, the same on every rank; the records stay (clear() starts afresh). A metric no rank
  /// recorded a value for (a mean of weight 0 everywhere, a min with no record) is NaN.
  template <ProcessGroup Comm>
  [[nodiscard]] MetricValues reduce(Comm& comm) const {
    const std::size_t p = static_cast<std::size_t>(comm.size());
    const std::size_t me = static_cast<std::size_t>(comm.rank());
    const std::size_t k = slots_.size();
    const std::size_t row = 2 * k + 1;  // digest, then (a, b) per metric
    std::vector<double> table(p * row, 0.0);
    double* mine = table.data() + me * row;
    mine[0] = static_cast<double>(digest() >> 11);  // 53 bits: exact in a double
    for (std::size_t i = 0; i < k; ++i) {
      mine[1 + 2 * i] = slots_[i].a;
      mine[2 + 2 * i] = slots_[i].b;
    }
    comm.all_reduce_host(std::span<double>(table), ReduceOp::sum);
    for (std::size_t j = 0; j < p; ++j) {
      if (table[j * row] != mine[0]) {
        detail::fail(Errc::mismatch, "rank ", me, ": Metrics::reduce: rank ", j,
                     " recorded other metrics than this rank (", describe(),
                     "); every rank must record the same names, with the same kinds, in the "
                     "same order (record a weight-0 mean or skip the name on every rank)");
      }
    }
    MetricValues out;
    for (std::size_t i = 0; i < k; ++i) {
      const MetricKind kind = slots_[i].kind;
      double a = 0, b = 0;
      bool any = false;
      for (std::size_t j = 0; j < p; ++j) {  // rank order: the same bits on every rank
        const double ra = table[j * row + 1 + 2 * i], rb = table[j * row + 2 + 2 * i];
        if (kind == MetricKind::sum || kind == MetricKind::mean) {
          a = j == 0 ? ra : a + ra;
          b = j == 0 ? rb : b + rb;
        } else if (rb > 0) {
          a = !any ? ra : kind == MetricKind::min ? std::min(a, ra) : std::max(a, ra);
          b += rb;
          any = true;
        }
      }
      if ((kind == MetricKind::min || kind == MetricKind::max) && !any)
        a = std::numeric_limits<double>::quiet_NaN();
      out.entries_.push_back({slots_[i].name, kind, value_of(kind, a, b), b});
    }
    return out;
  }

  /// Forgets every record and name (e.g. at the start of an epoch).
  void clear() noexcept { slots_.clear(); }
  /// Forgets the records but keeps the names, kinds and order.
  void reset() noexcept {
    for (Slot& s : slots_) s.a = s.b = 0;
  }
  /// The number of names recorded.
  [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }

 private:
  struct Slot {
    std::string name;
    MetricKind kind;
    double a = 0;  // sum: total; mean: Σ value × weight; min/max: the extreme so far
    double b = 0;  // mean: Σ weight; otherwise the number of records
  };

  Slot& slot(std::string_view name, MetricKind kind);

  static double value_of(MetricKind kind, double a, double b);

  static std::string_view to_string(MetricKind k) noexcept;

  /// FNV-1a over the names and kinds, in order.
  [[nodiscard]] std::uint64_t digest() const noexcept;

  [[nodiscard]] std::string describe() const;

  std::vector<Slot> slots_;
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/observe/impl/metrics.ipp"
#endif
