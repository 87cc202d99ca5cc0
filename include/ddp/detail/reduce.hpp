// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Reduction kernels. Every element is reduced over the ranks' contributions in rank order
/// 0, 1, ..., P-1, whichever rank computes it and whatever the message size, so the result is
/// bitwise the same on every rank and in every run. half and bfloat16 accumulate in float and
/// are rounded once; integer sums and products wrap (two's complement) instead of overflowing
/// into undefined behaviour; avg divides the sum by P.

#include "ddp/config.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

DDP_BEGIN_NAMESPACE
namespace detail {

template <class T>
struct Accum {
  using type = T;
};
template <>
struct Accum<half> {
  using type = float;
};
template <>
struct Accum<bfloat16> {
  using type = float;
};

template <class T>
inline T load_elem(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <ReduceOp Op, class A>
inline A combine(A a, A b) {
  if constexpr (Op == ReduceOp::sum || Op == ReduceOp::avg) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  } else if constexpr (Op == ReduceOp::prod) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      using W =
          std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;  // no int promotion
      return static_cast<A>(
          static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
    } else {
      return a * b;
    }
  } else if constexpr (Op == ReduceOp::min) {
    return b < a ? b : a;
  } else {
    return a < b ? b : a;
  }
}

/// dst[i] = src[0][i] op src[1][i] op ... op src[n-1][i] for i in [0, count), and the same into
/// dst2 when it is not null (one pass writing both: the all-reduce writes its result to the user's
/// buffer and to the slot peers read it from). dst may alias a source exactly (in place), but
/// must not partially overlap one; dst2 must not overlap anything.
template <class T, ReduceOp Op>
void reduce_kernel(std::byte* dst, std::byte* dst2, const std::byte* const* src, int n,
                   std::size_t count) {
  using A = typename Accum<T>::type;
  auto* d = reinterpret_cast<T*>(dst);
  auto* d2 = reinterpret_cast<T*>(dst2);
  if constexpr (std::is_same_v<A, T> && Op != ReduceOp::avg) {
    if (n == 2) {  // the common case, one fused pass
      const auto* a = reinterpret_cast<const T*>(src[0]);
      const auto* b = reinterpret_cast<const T*>(src[1]);
      if (d2 == nullptr) {
        for (std::size_t i = 0; i < count; ++i) d[i] = combine<Op, A>(a[i], b[i]);
      } else {
        for (std::size_t i = 0; i < count; ++i) {
          const T v = combine<Op, A>(a[i], b[i]);
          d[i] = v;
          d2[i] = v;
        }
      }
      return;
    }
  }
  constexpr std::size_t block = 1024;
  A acc[block];
  for (std::size_t base = 0; base < count; base += block) {
    const std::size_t m = std::min(block, count - base);
    {
      const auto* s = reinterpret_cast<const T*>(src[0]) + base;
      if (n > 1) {
        const auto* s1 = reinterpret_cast<const T*>(src[1]) + base;
        for (std::size_t i = 0; i < m; ++i)
          acc[i] = combine<Op, A>(static_cast<A>(s[i]), static_cast<A>(s1[i]));
      } else {
        for (std::size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(s[i]);
      }
    }
    for (int k = 2; k < n; ++k) {
      const auto* s = reinterpret_cast<const T*>(src[k]) + base;
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine<Op, A>(acc[i], static_cast<A>(s[i]));
    }
    if constexpr (Op == ReduceOp::avg) {
      const A ranks = static_cast<A>(n);
      for (std::size_t i = 0; i < m; ++i) acc[i] = acc[i] / ranks;
    }
    for (std::size_t i = 0; i < m; ++i) d[base + i] = static_cast<T>(acc[i]);
    if (d2 != nullptr) {
      for (std::size_t i = 0; i < m; ++i) d2[base + i] = d[base + i];
    }
  }
}

using ReduceFn = void (*)(std::byte*, std::byte*, const std::byte* const*, int, std::size_t);

template <class T>
constexpr ReduceFn reduce_fn_for(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return &reduce_kernel<T, ReduceOp::sum>;
    case ReduceOp::prod: return &reduce_kernel<T, ReduceOp::prod>;
    case ReduceOp::max: return &reduce_kernel<T, ReduceOp::max>;
    case ReduceOp::min: return &reduce_kernel<T, ReduceOp::min>;
    case ReduceOp::avg:
      if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, half> ||
                    std::is_same_v<T, bfloat16>) {
        return &reduce_kernel<T, ReduceOp::avg>;
      } else {
        return nullptr;
      }
  }
  return nullptr;
}

/// The kernel for (dtype, op), or nullptr when the pair is not supported.
[[nodiscard]] inline ReduceFn reduce_fn(DType t, ReduceOp op) {
  switch (t) {
    case DType::int8: return reduce_fn_for<std::int8_t>(op);
    case DType::uint8: return reduce_fn_for<std::uint8_t>(op);
    case DType::int32: return reduce_fn_for<std::int32_t>(op);
    case DType::uint32: return reduce_fn_for<std::uint32_t>(op);
    case DType::int64: return reduce_fn_for<std::int64_t>(op);
    case DType::uint64: return reduce_fn_for<std::uint64_t>(op);
    case DType::float16: return reduce_fn_for<half>(op);
    case DType::float32: return reduce_fn_for<float>(op);
    case DType::float64: return reduce_fn_for<double>(op);
    case DType::bfloat16: return reduce_fn_for<bfloat16>(op);
  }
  return nullptr;
}

}  // namespace detail
DDP_END_NAMESPACE
