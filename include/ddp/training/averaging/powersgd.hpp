// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// PowerSGD (Vogels et al., 2019), as torch's powerSGD_hook defines it: a comm hook that sends a
/// rank-r approximation of each gradient matrix instead of the matrix.
///
///     ddp::PowerSGDHook powersgd({.rank = 4, .start_iter = 100});
///     avg.register_comm_hook(powersgd);          // copies share one state
///     ...
///     powersgd.stats();                          // elements sent vs. uncompressed
///
/// Per bucket, once `start_iter` steps have gone by with a plain all_reduce: the error kept from
/// the previous step is added to the gradients (error feedback); each gradient of a parameter
/// whose rows the model gives (BucketPiece::rows, torch: size(0) of a tensor of 2+ dimensions)
/// and that compresses by at least `min_compression_rate` is seen as an n x m matrix M, the
/// rest (vectors, small or square-ish matrices: the per-tensor fallback) is all_reduced as it
/// is, in one buffer. For the matrices: P = M Q (Q: the previous step's, warm start, else random
/// and orthogonalized, the same on every rank), all_reduce(P), orthogonalize P, Q = M^T P,
/// all_reduce(Q), M ~ P Q^T. The error, what this rank's gradient lost, is kept for the next
/// step. So per matrix (n + m) r elements travel instead of n m.
///
/// A step whose result holds an inf or a NaN (a loss-scaling step that overflowed) would leave
/// them in the error and the warm-start Q, and every later step would be non-finite too: the
/// bucket's error and Q are reset instead (the next step starts afresh, as the first compressed
/// step does), counted in PowerSGDStats::resets. The result is the same on every rank, so every
/// rank resets alike.
///
/// Host memory only (there are no GPU kernels in ddp's headers): a bucket on a CUDA device is
/// refused with Errc::unsupported. The hook computes and communicates when its bucket is ready,
/// in the thread that completes it (its two all_reduces are small). In a ddp::Join, a finished
/// rank's calls (bucket.shadow, zeros) issue the same collectives and leave the state alone.

#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/averaging/comm_hooks.hpp"
#include "ddp/types.hpp"
#include "ddp/work.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

DDP_BEGIN_NAMESPACE

/// PowerSGD's settings (torch's PowerSGDState).
struct PowerSGDOptions {
  /// The rank r of the approximation (matrix_approximation_rank).
  std::size_t rank = 1;
  /// Steps run with a plain all_reduce first (start_powerSGD_iter).
  std::size_t start_iter = 1000;
  /// A matrix n x m is compressed only when n m > (n + m) r times this.
  double min_compression_rate = 2;
  /// Keeps what compression lost and adds it to the next step's gradients.
  bool error_feedback = true;
  /// Starts each step's power iteration from the previous step's Q.
  bool warm_start = true;
  /// Added to each column's norm when orthogonalizing (0: none; a zero column stays zero).
  float orthogonalization_epsilon = 0;
  /// Seed of the random initial Q (the same on every rank).
  std::uint64_t seed = 0;
};

/// What a PowerSGDHook has sent: elements of its all_reduces, and what plain all_reduces of the
/// same buckets would have sent.
struct PowerSGDStats {
  std::uint64_t steps = 0;            ///< Steps seen (last buckets).
  std::uint64_t sent = 0;             ///< Elements all_reduced, every step.
  std::uint64_t uncompressed = 0;     ///< Elements of the buckets, every step.
  std::uint64_t compressed_sent = 0;  ///< Of `sent`, in the compressed steps only.
  std::uint64_t compressed_full = 0;  ///< Of `uncompressed`, in the compressed steps only.
  /// Buckets whose error feedback and warm-start Q were reset after a non-finite result.
  std::uint64_t resets = 0;
};

namespace detail {

/// A reproducible standard normal sequence (splitmix64 and Box-Muller).
class NormalSequence {
 public:
  explicit NormalSequence(std::uint64_t seed);
  float next();

 private:
  std::uint64_t bits();
  std::uint64_t s_;
  float spare_ = 0;
  bool has_spare_ = false;
};

// The factors are kept transposed, one row per column of P (r x n) and of Q (r x c), so that
// every loop below runs over contiguous memory.

/// Gram-Schmidt on the r rows (of n) of `a`, in place: each row made orthogonal to the ones
/// before it (twice: once is not enough in floating point when rows are nearly dependent) and
/// normalized (`epsilon` added to the norm). A row that is (numerically) in the span of the
/// ones before it becomes zero: normalizing the rounding noise left of it would add a direction
/// the data does not have.
DDP_INLINE void orthogonalize(float* a, std::size_t r, std::size_t n, float epsilon);

// Each kernel reads the big matrix m once (it is the gradient: megabytes), in chunks of its
// rows that stay in the first-level cache while the r factors are applied to them.
inline constexpr std::size_t powersgd_chunk = 256;

/// pt (r x n) = (m q)^T for m (n x c, row-major) and qt = q^T (r x c).
DDP_INLINE void times(const float* m, const float* qt, float* pt, std::size_t n, std::size_t c,
                      std::size_t r);

/// qt (r x c) = (m^T p)^T for m (n x c) and pt = p^T (r x n).
DDP_INLINE void times_transposed(const float* m, const float* pt, float* qt, std::size_t n,
                                 std::size_t c, std::size_t r);

/// m (n x c) = p q^T for pt = p^T (r x n) and qt = q^T (r x c); with `err`, err = what m held
/// minus what it holds now (error feedback), in the same pass.
DDP_INLINE void outer(const float* pt, const float* qt, float* m, float* err, std::size_t n,
                      std::size_t c, std::size_t r);

}  // namespace detail

/// The PowerSGD comm hook for float32 gradients (see the file comment). Copies share one state:
/// register a copy and keep this one to read stats().
class PowerSGDHook {
 public:
  /// A hook with its own state (checked: rank >= 1, min_compression_rate >= 0).
  explicit PowerSGDHook(PowerSGDOptions o = {});

  /// What has been sent so far.
  [[nodiscard]] PowerSGDStats stats() const;
  /// The settings it was made with.
  [[nodiscard]] const PowerSGDOptions& options() const noexcept { return s_->o; }

  /// Reduces `b` (see the file comment); returns a finished Work.
  template <class Comm>
  Work operator()(Comm& comm, GradBucket<float>& b) const {
    State& s = *s_;
    std::lock_guard lock(s.mutex);  // one bucket at a time: they share the state
    if (b.buffer.device.is_cuda())
      detail::fail(Errc::unsupported, "rank ", comm.rank(), ": PowerSGDHook: bucket ", b.index,
                   " is on ", to_string(b.buffer.device),
                   "; PowerSGD runs on host buckets only (ddp's headers carry no GPU kernels)");
    const std::size_t n_all = b.buffer.size;
    const bool compress = s.iter >= s.o.start_iter;
    s.stats.uncompressed += n_all;
    if (compress) s.stats.compressed_full += n_all;
    if (b.last) {
      ++s.iter;  // finished ranks too: every rank switches at the same step
      ++s.stats.steps;
    }
    if (!compress) {
      s.stats.sent += n_all;
      comm.all_reduce(b.buffer, b.op);
      return {};
    }
    if (s.buckets.size() <= b.index) s.buckets.resize(b.index + 1);
    Bucket& mem = s.buckets[b.index];
    float* g = b.buffer.data;
    const bool feedback = s.o.error_feedback && !b.shadow;
    if (feedback) {
      if (mem.error.size() != n_all) mem.error.assign(n_all, 0.0f);
      for (std::size_t i = 0; i < n_all; ++i) g[i] += mem.error[i];
    }
    // Which pieces are matrices worth compressing; the rest goes as it is, in one buffer.
    struct Mat {
      float* m;
      std::size_t n, c, r, p_at, q_at;
    };
    std::vector<Mat> mats;
    std::vector<float> plain;
    std::vector<bool> is_matrix;
    std::size_t p_len = 0, q_len = 0;
    for (const BucketPiece& pc : b.pieces) {
      const std::size_t n = pc.rows, c = n != 0 ? pc.size / n : 0;
      const std::size_t r = std::min({s.o.rank, n, c});
      const bool matrix =
          pc.offset == 0 && n >= 2 && c >= 2 && n * c == pc.size &&
          static_cast<double>(n * c) > static_cast<double>((n + c) * r) * s.o.min_compression_rate;
      is_matrix.push_back(matrix);
      if (matrix) {
        mats.push_back({g + pc.at, n, c, r, p_len, q_len});
        p_len += n * r;
        q_len += c * r;
      } else {
        plain.insert(plain.end(), g + pc.at, g + pc.at + pc.size);
      }
    }
    s.stats.sent += plain.size() + p_len + q_len;
    s.stats.compressed_sent += plain.size() + p_len + q_len;
    if (!plain.empty()) {
      comm.all_reduce(plain, b.op);
      std::size_t at = 0;
      for (std::size_t k = 0; k < b.pieces.size(); ++k) {
        if (is_matrix[k]) continue;
        float* x = g + b.pieces[k].at;
        if (feedback)  // what this rank's input lost
          for (std::size_t j = 0; j < b.pieces[k].size; ++j)
            mem.error[b.pieces[k].at + j] = x[j] - plain[at + j];
        std::memcpy(x, plain.data() + at, b.pieces[k].size * sizeof(float));
        at += b.pieces[k].size;
      }
    }
    if (!mats.empty()) {
      // Q: the previous step's (warm start) or random, orthogonalized, the same everywhere.
      if (!s.o.warm_start || mem.q.size() != q_len) {
        mem.q.resize(q_len);
        detail::NormalSequence rng(s.o.seed * 0x100000001b3ull + b.index * 7919 + s.iter);
        for (float& x : mem.q) x = rng.next();
        for (const Mat& m : mats) detail::orthogonalize(mem.q.data() + m.q_at, m.r, m.c, 0);
      }
      std::vector<float> p(p_len), q(mem.q);
      for (const Mat& m : mats)
        detail::times(m.m, q.data() + m.q_at, p.data() + m.p_at, m.n, m.c, m.r);
      comm.all_reduce(p, ReduceOp::sum);  // orthogonalized next: no need to average
      for (const Mat& m : mats)
        detail::orthogonalize(p.data() + m.p_at, m.r, m.n, s.o.orthogonalization_epsilon);
      for (const Mat& m : mats)
        detail::times_transposed(m.m, p.data() + m.p_at, q.data() + m.q_at, m.n, m.c, m.r);
      comm.all_reduce(q, ReduceOp::sum);
      if (b.op == ReduceOp::avg) {
        const float inv = 1.0f / static_cast<float>(comm.size());
        for (float& x : q) x *= inv;
      }
      for (const Mat& m : mats)  // and what this rank's input lost, kept for the next step
        detail::outer(p.data() + m.p_at, q.data() + m.q_at, m.m,
                      feedback ? mem.error.data() + (m.m - g) : nullptr, m.n, m.c, m.r);
      if (!b.shadow) mem.q = std::move(q);
    }
    // An inf or NaN in the result (the same on every rank) would stay in the error and in Q
    // and poison every later step: start this bucket afresh instead.
    if (!std::all_of(g, g + n_all, [](float x) { return std::isfinite(x); })) {
      if (!b.shadow) {
        std::fill(mem.error.begin(), mem.error.end(), 0.0f);
        mem.q.clear();
      }
      ++s.stats.resets;
    }
    return {};
  }

 private:
  struct Bucket {
    std::vector<float> error, q;
  };
  struct State {
    PowerSGDOptions o;
    std::size_t iter = 0;
    std::vector<Bucket> buckets;  // by bucket index
    PowerSGDStats stats;
    std::mutex mutex;
  };
  std::shared_ptr<State> s_;
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/training/averaging/impl/powersgd.ipp"
#endif
