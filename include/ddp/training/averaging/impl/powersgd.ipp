// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/training/averaging/powersgd.hpp>'s non-template functions. That header
// includes this file at its bottom, and nothing else does: in the header-only mode in every unit,
// in the separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE NormalSequence::NormalSequence(std::uint64_t seed) : s_(seed) {}

DDP_INLINE float NormalSequence::next() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  const double u1 = (static_cast<double>(bits() >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(bits() >> 11) * 0x1.0p-53;
  const double r = std::sqrt(-2.0 * std::log(u1)), t = 6.283185307179586 * u2;
  spare_ = static_cast<float>(r * std::sin(t));
  has_spare_ = true;
  return static_cast<float>(r * std::cos(t));
}

DDP_INLINE std::uint64_t NormalSequence::bits() {
  std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

DDP_INLINE void orthogonalize(float* a, std::size_t r, std::size_t n, float epsilon) {
  const auto dot = [n](const float* x, const float* y) {
    double s = 0;
    for (std::size_t k = 0; k < n; ++k) s += double{x[k]} * y[k];
    return s;
  };
  for (std::size_t i = 0; i < r; ++i) {
    float* row = a + i * n;
    const double before = std::sqrt(dot(row, row));
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t j = 0; j < i; ++j) {
        const auto f = static_cast<float>(dot(a + j * n, row));
        for (std::size_t k = 0; k < n; ++k) row[k] -= f * a[j * n + k];
      }
    }
    const double after = std::sqrt(dot(row, row));
    const float scale = after > 1e-5 * before && after + epsilon > 0
                            ? static_cast<float>(1.0 / (after + epsilon))
                            : 0.0f;
    for (std::size_t k = 0; k < n; ++k) row[k] *= scale;
  }
}

DDP_INLINE void times(const float* m, const float* qt, float* pt, std::size_t n, std::size_t c,
                      std::size_t r) {
  std::vector<float> acc(r * 8);
  for (std::size_t i = 0; i < n; ++i) {
    const float* row = m + i * c;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::size_t j = 0;
    for (; j + 8 <= c; j += 8)  // eight partial sums: vectorizes without reassociation
      for (std::size_t k = 0; k < r; ++k)
        for (std::size_t l = 0; l < 8; ++l) acc[k * 8 + l] += row[j + l] * qt[k * c + j + l];
    for (std::size_t k = 0; k < r; ++k) {
      const float* a = &acc[k * 8];
      float sum = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
      for (std::size_t t = 0; t < c - j; ++t) sum += row[j + t] * qt[k * c + j + t];
      pt[k * n + i] = sum;
    }
  }
}

DDP_INLINE void times_transposed(const float* m, const float* pt, float* qt, std::size_t n,
                                 std::size_t c, std::size_t r) {
  std::fill(qt, qt + r * c, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    const float* row = m + i * c;
    for (std::size_t j0 = 0; j0 < c; j0 += powersgd_chunk) {
      const std::size_t j1 = std::min(c, j0 + powersgd_chunk);
      for (std::size_t k = 0; k < r; ++k) {
        const float f = pt[k * n + i];
        float* q = qt + k * c;
        for (std::size_t j = j0; j < j1; ++j) q[j] += f * row[j];
      }
    }
  }
}

DDP_INLINE void outer(const float* pt, const float* qt, float* m, float* err, std::size_t n,
                      std::size_t c, std::size_t r) {
  float out[powersgd_chunk];
  for (std::size_t i = 0; i < n; ++i) {
    float* row = m + i * c;
    for (std::size_t j0 = 0; j0 < c; j0 += powersgd_chunk) {
      const std::size_t len = std::min(c - j0, powersgd_chunk);
      std::fill(out, out + len, 0.0f);
      for (std::size_t k = 0; k < r; ++k) {
        const float f = pt[k * n + i];
        const float* q = qt + k * c + j0;
        for (std::size_t j = 0; j < len; ++j) out[j] += f * q[j];
      }
      if (err != nullptr)
        for (std::size_t j = 0; j < len; ++j) err[i * c + j0 + j] = row[j0 + j] - out[j];
      std::copy(out, out + len, row + j0);
    }
  }
}
}  // namespace detail
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE

DDP_INLINE PowerSGDHook::PowerSGDHook(PowerSGDOptions o) : s_(std::make_shared<State>()) {
  if (o.rank == 0) detail::fail(Errc::invalid_argument, "PowerSGDHook: rank must be at least 1");
  if (!(o.min_compression_rate >= 0))
    detail::fail(Errc::invalid_argument, "PowerSGDHook: min_compression_rate must not be negative");
  s_->o = o;
}

DDP_INLINE PowerSGDStats PowerSGDHook::stats() const {
  std::lock_guard lock(s_->mutex);
  return s_->stats;
}

DDP_END_NAMESPACE
