// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Reduction kernels. Every element is reduced over the ranks' contributions in rank order
/// 0, 1, ..., P-1, whichever rank computes it and whatever the message size, so the result is
/// bitwise the same on every rank and in every run. half and bfloat16 accumulate in float and
/// are rounded once; integer sums and products wrap (two's complement) instead of overflowing
/// into undefined behaviour; avg divides the sum by P; band, bor and bxor are bitwise on
/// integers; bool reduces as 0/1 bytes (sum and max: or, prod and min: and, bxor: xor).
/// premul_sum is a sum here: the communicator has multiplied each rank's input already
/// (scale_fn), so the kernels carry no factor.

#include "ddp/config.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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
  } else if constexpr (Op == ReduceOp::band) {
    return static_cast<A>(a & b);
  } else if constexpr (Op == ReduceOp::bor) {
    return static_cast<A>(a | b);
  } else if constexpr (Op == ReduceOp::bxor) {
    return static_cast<A>(a ^ b);
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
  if (n == 2) {  // the common case, one fused pass (the same operations as the general path)
    const auto* a = reinterpret_cast<const T*>(src[0]);
    const auto* b = reinterpret_cast<const T*>(src[1]);
    const auto value = [a, b](std::size_t i) {
      A v = combine<Op, A>(static_cast<A>(a[i]), static_cast<A>(b[i]));
      if constexpr (Op == ReduceOp::avg) v = v / static_cast<A>(2);
      return static_cast<T>(v);
    };
    if (d2 == nullptr) {
      for (std::size_t i = 0; i < count; ++i) d[i] = value(i);
      return;
    }
    if constexpr (std::is_same_v<A, T>) {
      for (std::size_t i = 0; i < count; ++i) {
        const T v = value(i);
        d[i] = v;
        d2[i] = v;
      }
      return;
    }
    // half and bfloat16: two stores of the class type keep the loop scalar, so write dst in
    // steps and copy each step to dst2 while it is still in L1.
    constexpr std::size_t step = 4096;
    for (std::size_t base = 0; base < count; base += step) {
      const std::size_t end = std::min(count, base + step);
      for (std::size_t i = base; i < end; ++i) d[i] = value(i);
      std::memcpy(d2 + base, d + base, (end - base) * sizeof(T));
    }
    return;
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
  constexpr bool integer = std::is_integral_v<T>;
  switch (op) {
    case ReduceOp::sum: return &reduce_kernel<T, ReduceOp::sum>;
    case ReduceOp::prod: return &reduce_kernel<T, ReduceOp::prod>;
    case ReduceOp::max: return &reduce_kernel<T, ReduceOp::max>;
    case ReduceOp::min: return &reduce_kernel<T, ReduceOp::min>;
    case ReduceOp::avg:
      if constexpr (!integer) return &reduce_kernel<T, ReduceOp::avg>;
      break;
    case ReduceOp::band:
      if constexpr (integer) return &reduce_kernel<T, ReduceOp::band>;
      break;
    case ReduceOp::bor:
      if constexpr (integer) return &reduce_kernel<T, ReduceOp::bor>;
      break;
    case ReduceOp::bxor:
      if constexpr (integer) return &reduce_kernel<T, ReduceOp::bxor>;
      break;
    case ReduceOp::premul_sum:  // the communicator has scaled the inputs (scale_fn): a sum
      if constexpr (!integer) return &reduce_kernel<T, ReduceOp::sum>;
      break;
  }
  return nullptr;
}

/// The kernel for (dtype, op), or nullptr when the pair is not supported.
[[nodiscard]] DDP_INLINE ReduceFn reduce_fn(DType t, ReduceOp op);

/// premul_sum's first step: data[i] *= factor in place, in the accumulator's precision (float
/// for half and bfloat16), rounded once to the element type.
using ScaleFn = void (*)(std::byte*, std::size_t, double);

template <class T>
void scale_kernel(std::byte* data, std::size_t count, double factor) {
  using A = typename Accum<T>::type;
  auto* d = reinterpret_cast<T*>(data);
  const auto by = static_cast<A>(factor);
  for (std::size_t i = 0; i < count; ++i) d[i] = static_cast<T>(static_cast<A>(d[i]) * by);
}

/// The scale kernel for a floating-point dtype, else nullptr.
[[nodiscard]] DDP_INLINE ScaleFn scale_fn(DType t);

/// data[i] /= n in place, in the accumulator's precision (as avg does after its sum): the last
/// step of an avg whose sum was taken in parts (the hierarchical all_reduce).
using DivideFn = void (*)(std::byte*, std::size_t, int);

template <class T>
void divide_kernel(std::byte* data, std::size_t count, int n) {
  using A = typename Accum<T>::type;
  auto* d = reinterpret_cast<T*>(data);
  const A by = static_cast<A>(n);
  for (std::size_t i = 0; i < count; ++i) d[i] = static_cast<T>(static_cast<A>(d[i]) / by);
}

/// The divide kernel for a dtype that avg supports (floating point), else nullptr.
[[nodiscard]] DDP_INLINE DivideFn divide_fn(DType t);

// ---- compressed all-reduce: float32 values that travel and are reduced as W (half, bfloat16) --

/// dst[i] = W(src[i]): float32 to the wire type, rounded to nearest even.
template <class W>
void encode_kernel(std::byte* dst, const std::byte* src, std::size_t count) {
  auto* d = reinterpret_cast<W*>(dst);
  const auto* s = reinterpret_cast<const float*>(src);
  for (std::size_t i = 0; i < count; ++i) d[i] = W(s[i]);
}

/// dst[i] = float(src[i]): the wire type back to float32 (exact).
template <class W>
void decode_kernel(std::byte* dst, const std::byte* src, std::size_t count) {
  auto* d = reinterpret_cast<float*>(dst);
  const auto* s = reinterpret_cast<const W*>(src);
  for (std::size_t i = 0; i < count; ++i) d[i] = static_cast<float>(s[i]);
}

/// reduce_kernel<W, Op> over W-typed sources (the same operations, so the same bits), with the
/// rounded result written decoded to `dst` (float32) and, when `wire` is not null, as W there.
template <class W, ReduceOp Op>
void reduce_decode_kernel(std::byte* dst, std::byte* wire, const std::byte* const* src, int n,
                          std::size_t count) {
  // In steps, each decoded while in L1: a loop storing both W and float stays scalar.
  constexpr std::size_t step = 2048;
  W block[step];
  std::vector<const std::byte*> shifted(static_cast<std::size_t>(n));
  for (std::size_t base = 0; base < count; base += step) {
    const std::size_t m = std::min(step, count - base);
    W* w = wire != nullptr ? reinterpret_cast<W*>(wire) + base : block;
    for (int k = 0; k < n; ++k) shifted[static_cast<std::size_t>(k)] = src[k] + base * sizeof(W);
    reduce_kernel<W, Op>(reinterpret_cast<std::byte*>(w), nullptr, shifted.data(), n, m);
    decode_kernel<W>(dst + base * sizeof(float), reinterpret_cast<const std::byte*>(w), m);
  }
}

/// The kernels of an all-reduce whose float32 values travel as `wire`.
struct WireKernels {
  void (*encode)(std::byte*, const std::byte*, std::size_t) = nullptr;
  void (*decode)(std::byte*, const std::byte*, std::size_t) = nullptr;
  ReduceFn reduce = nullptr;  // (float32 dst, wire dst or null, wire sources, n, count)
};

template <class W>
WireKernels wire_kernels_for(ReduceOp op) {
  WireKernels k{&encode_kernel<W>, &decode_kernel<W>, nullptr};
  switch (op) {
    case ReduceOp::sum: k.reduce = &reduce_decode_kernel<W, ReduceOp::sum>; break;
    case ReduceOp::prod: k.reduce = &reduce_decode_kernel<W, ReduceOp::prod>; break;
    case ReduceOp::max: k.reduce = &reduce_decode_kernel<W, ReduceOp::max>; break;
    case ReduceOp::min: k.reduce = &reduce_decode_kernel<W, ReduceOp::min>; break;
    case ReduceOp::avg: k.reduce = &reduce_decode_kernel<W, ReduceOp::avg>; break;
    case ReduceOp::premul_sum:  // the float32 values were scaled first
      k.reduce = &reduce_decode_kernel<W, ReduceOp::sum>;
      break;
    default: break;  // bitwise: not defined on floating point
  }
  return k;
}

/// Kernels for float32 values carried as `wire` (float16 or bfloat16); reduce is null otherwise.
[[nodiscard]] DDP_INLINE WireKernels wire_kernels(DType wire, ReduceOp op);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/impl/reduce.ipp"
#endif
