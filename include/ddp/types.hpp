// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Scalar types and the small enums every layer shares: ddp::half, ddp::bfloat16, DType,
/// ReduceOp, Device.

#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

DDP_BEGIN_NAMESPACE

namespace detail {

// IEEE 754 binary32 <-> binary16 with round-to-nearest-even, gradual underflow, overflow to
// infinity and NaN kept NaN (quieted, sign and top payload bits kept). Pure integer code, so the
// result does not depend on the FPU rounding mode or on compiler flags such as -ffast-math.
[[nodiscard]] constexpr std::uint16_t float_to_half_bits(float value) noexcept {
  const auto x = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint32_t>((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7fffffffu;
  std::uint32_t out;
  if (abs >= 0x7f800000u) {  // infinity or NaN
    out = abs > 0x7f800000u ? 0x7e00u | ((abs >> 13) & 0x3ffu) : 0x7c00u;
  } else if (abs >= 0x477ff000u) {  // >= 65520: beyond the largest half plus half an ulp
    out = 0x7c00u;
  } else if (abs >= 0x38800000u) {  // normal half: rebias the exponent, round 23 -> 10 bits
    const std::uint32_t rebiased = abs - 0x38000000u;
    out = rebiased >> 13;
    const std::uint32_t rest = rebiased & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (out & 1u) != 0)) ++out;  // carry may bump exponent
  } else if (abs > 0x33000000u) {              // subnormal half: units of 2^-24
    const std::uint32_t exponent = abs >> 23;  // 102..112
    const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14..24
    out = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (out & 1u) != 0)) ++out;
  } else {  // |value| <= 2^-25 rounds to (signed) zero
    out = 0;
  }
  return static_cast<std::uint16_t>(sign | out);
}

[[nodiscard]] constexpr float half_bits_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t mantissa = bits & 0x3ffu;
  std::uint32_t out;
  if (exponent == 0x1fu) {
    out = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    out = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    out = sign;
  } else {  // subnormal: value = mantissa * 2^-24, renormalize for binary32
    const auto top = static_cast<std::uint32_t>(std::bit_width(mantissa) - 1);  // 0..9
    mantissa = (mantissa << (23u - top)) & 0x7fffffu;
    out = sign | ((top + 103u) << 23) | mantissa;
  }
  return std::bit_cast<float>(out);
}

[[nodiscard]] constexpr std::uint16_t float_to_bfloat16_bits(float value) noexcept {
  // Branch-free, so that loops over arrays vectorize; the high half is taken with an arithmetic
  // shift, which vectorizes to one pack instruction (a logical one needs several shuffles).
  const auto x = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);  // to nearest even
  const std::uint32_t quiet = x | 0x00400000u;                   // NaN stays NaN
  const std::uint32_t v = (x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
  return static_cast<std::uint16_t>(static_cast<std::int16_t>(static_cast<std::int32_t>(v) >> 16));
}

[[nodiscard]] constexpr float bfloat16_bits_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

/// Arithmetic and comparison shared by half and bfloat16: computed in float, rounded back.
template <class Derived>
struct Float16Ops {
  friend constexpr Derived operator+(Derived a, Derived b) noexcept {
    return Derived(float(a) + float(b));
  }
  friend constexpr Derived operator-(Derived a, Derived b) noexcept {
    return Derived(float(a) - float(b));
  }
  friend constexpr Derived operator*(Derived a, Derived b) noexcept {
    return Derived(float(a) * float(b));
  }
  friend constexpr Derived operator/(Derived a, Derived b) noexcept {
    return Derived(float(a) / float(b));
  }
  friend constexpr Derived operator-(Derived a) noexcept {
    return Derived::from_bits(static_cast<std::uint16_t>(a.bits() ^ 0x8000u));
  }
  friend constexpr Derived operator+(Derived a) noexcept { return a; }
  friend constexpr Derived& operator+=(Derived& a, Derived b) noexcept { return a = a + b; }
  friend constexpr Derived& operator-=(Derived& a, Derived b) noexcept { return a = a - b; }
  friend constexpr Derived& operator*=(Derived& a, Derived b) noexcept { return a = a * b; }
  friend constexpr Derived& operator/=(Derived& a, Derived b) noexcept { return a = a / b; }
  friend constexpr bool operator==(Derived a, Derived b) noexcept { return float(a) == float(b); }
  friend constexpr bool operator<(Derived a, Derived b) noexcept { return float(a) < float(b); }
  friend constexpr bool operator>(Derived a, Derived b) noexcept { return float(a) > float(b); }
  friend constexpr bool operator<=(Derived a, Derived b) noexcept { return float(a) <= float(b); }
  friend constexpr bool operator>=(Derived a, Derived b) noexcept { return float(a) >= float(b); }
};

}  // namespace detail

/// IEEE 754 binary16. Converts from arithmetic types explicitly (a narrowing you can see) and to
/// float implicitly; arithmetic between two halves is done in float and rounded once.
class half : public detail::Float16Ops<half> {
 public:
  /// Positive zero.
  half() = default;
  /// `value` converted to float, then rounded to the nearest half (ties to even).
  template <class T>
    requires std::is_arithmetic_v<T>
  constexpr explicit half(T value) noexcept
      : bits_(detail::float_to_half_bits(static_cast<float>(value))) {}
  /// The exact float value (every half is representable as a float).
  constexpr operator float() const noexcept { return detail::half_bits_to_float(bits_); }

  /// The half whose binary16 encoding is `bits`.
  [[nodiscard]] static constexpr half from_bits(std::uint16_t bits) noexcept {
    half h;
    h.bits_ = bits;
    return h;
  }
  /// The binary16 encoding: sign, 5 exponent bits, 10 mantissa bits.
  [[nodiscard]] constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_ = 0;
};

/// bfloat16 (the top half of an IEEE binary32): same range as float, 8 bits of precision.
class bfloat16 : public detail::Float16Ops<bfloat16> {
 public:
  /// Positive zero.
  bfloat16() = default;
  /// `value` converted to float, then rounded to the nearest bfloat16 (ties to even).
  template <class T>
    requires std::is_arithmetic_v<T>
  constexpr explicit bfloat16(T value) noexcept
      : bits_(detail::float_to_bfloat16_bits(static_cast<float>(value))) {}
  /// The exact float value (the encoding padded with 16 zero bits).
  constexpr operator float() const noexcept { return detail::bfloat16_bits_to_float(bits_); }

  /// The bfloat16 whose encoding is `bits` (the top 16 bits of a binary32).
  [[nodiscard]] static constexpr bfloat16 from_bits(std::uint16_t bits) noexcept {
    bfloat16 h;
    h.bits_ = bits;
    return h;
  }
  /// The encoding: sign, 8 exponent bits, 7 mantissa bits.
  [[nodiscard]] constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_ = 0;
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// Element types a collective can carry. The numbering is stable (it is sent on the wire) and
/// matches ncclDataType_t's set of types, plus the 16-bit integers (which NCCL moves but cannot
/// reduce) and bool (one byte holding 0 or 1, as torch.bool; NCCL moves it as uint8).
enum class DType : std::uint8_t {
  int8 = 0,
  uint8 = 1,
  int32 = 2,
  uint32 = 3,
  int64 = 4,
  uint64 = 5,
  float16 = 6,
  float32 = 7,
  float64 = 8,
  bfloat16 = 9,
  int16 = 10,
  uint16 = 11,
  boolean = 12,  ///< bool; to_string says "bool"
};

/// The number of DType enumerators (one past the largest value).
inline constexpr int dtype_count = 13;

/// The enumerator's name, e.g. "float32"; "invalid" for a value that is not one.
[[nodiscard]] constexpr std::string_view to_string(DType t) noexcept {
  switch (t) {
    case DType::int8: return "int8";
    case DType::uint8: return "uint8";
    case DType::int32: return "int32";
    case DType::uint32: return "uint32";
    case DType::int64: return "int64";
    case DType::uint64: return "uint64";
    case DType::float16: return "float16";
    case DType::float32: return "float32";
    case DType::float64: return "float64";
    case DType::bfloat16: return "bfloat16";
    case DType::int16: return "int16";
    case DType::uint16: return "uint16";
    case DType::boolean: return "bool";
  }
  return "invalid";
}

/// Bytes per element.
[[nodiscard]] constexpr std::size_t size_of(DType t) noexcept {
  switch (t) {
    case DType::int8:
    case DType::uint8:
    case DType::boolean: return 1;
    case DType::int16:
    case DType::uint16:
    case DType::float16:
    case DType::bfloat16: return 2;
    case DType::int32:
    case DType::uint32:
    case DType::float32: return 4;
    case DType::int64:
    case DType::uint64:
    case DType::float64: return 8;
  }
  return 0;
}

/// True for float16, bfloat16, float32 and float64.
[[nodiscard]] constexpr bool is_floating_point(DType t) noexcept {
  return t == DType::float16 || t == DType::bfloat16 || t == DType::float32 || t == DType::float64;
}

/// True for the enumerators above; false for a value decoded from untrusted bytes that is not one.
[[nodiscard]] constexpr bool is_valid(DType t) noexcept {
  return static_cast<unsigned>(t) < static_cast<unsigned>(dtype_count);
}

namespace detail {
template <class T>
struct dtype_of_impl {};
template <class T>
  requires(std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char> &&
           !std::is_same_v<T, wchar_t> && !std::is_same_v<T, char8_t> &&
           !std::is_same_v<T, char16_t> && !std::is_same_v<T, char32_t> &&
           (sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8))
struct dtype_of_impl<T> {
  static constexpr DType value =
      sizeof(T) == 1   ? (std::is_signed_v<T> ? DType::int8 : DType::uint8)
      : sizeof(T) == 2 ? (std::is_signed_v<T> ? DType::int16 : DType::uint16)
      : sizeof(T) == 4 ? (std::is_signed_v<T> ? DType::int32 : DType::uint32)
                       : (std::is_signed_v<T> ? DType::int64 : DType::uint64);
};
template <>
struct dtype_of_impl<bool> {
  static constexpr DType value = DType::boolean;
};
template <>
struct dtype_of_impl<float> {
  static constexpr DType value = DType::float32;
};
template <>
struct dtype_of_impl<double> {
  static constexpr DType value = DType::float64;
};
template <>
struct dtype_of_impl<half> {
  static constexpr DType value = DType::float16;
};
template <>
struct dtype_of_impl<bfloat16> {
  static constexpr DType value = DType::bfloat16;
};
}  // namespace detail

/// A type that collectives can carry: the fixed-width integers of 8, 16, 32 and 64 bits (signed
/// char and unsigned char included, plain char and the character types excluded), bool, half,
/// bfloat16, float and double.
template <class T>
concept Scalar = requires {
  detail::dtype_of_impl<std::remove_cv_t<T>>::value;
};

/// The DType of a Scalar type: dtype_of<float> == DType::float32.
template <Scalar T>
inline constexpr DType dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

/// Reduction operators, as in torch.distributed.ReduceOp. Stable numbering: sum to avg are 1:1
/// with ncclRedOp_t; band, bor and bxor are bitwise (integers and bool); premul_sum multiplies each
/// rank's input by a factor before the sum (ddp::premul_sum makes one).
enum class ReduceOp : std::uint8_t {
  sum = 0,
  prod = 1,
  max = 2,
  min = 3,
  avg = 4,
  band = 5,
  bor = 6,
  bxor = 7,
  premul_sum = 8,
};

/// The number of ReduceOp enumerators (one past the largest value).
inline constexpr int reduce_op_count = 9;

/// The enumerator's name, e.g. "sum"; "invalid" for a value that is not one.
[[nodiscard]] constexpr std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::prod: return "prod";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::avg: return "avg";
    case ReduceOp::band: return "band";
    case ReduceOp::bor: return "bor";
    case ReduceOp::bxor: return "bxor";
    case ReduceOp::premul_sum: return "premul_sum";
  }
  return "invalid";
}

/// True for the enumerators above; false for a value decoded from untrusted bytes that is not one.
[[nodiscard]] constexpr bool is_valid(ReduceOp op) noexcept {
  return static_cast<unsigned>(op) < static_cast<unsigned>(reduce_op_count);
}

/// Whether `op` is defined on `dtype`. avg and premul_sum are defined on floating-point types
/// only (an integer mean would have to choose a rounding); band, bor and bxor on integers and
/// bool only; sum, prod, max and min on every type. On bool, sum and max are a logical or, prod
/// and min a logical and (the result stays 0 or 1).
[[nodiscard]] constexpr bool is_supported(ReduceOp op, DType dtype) noexcept {
  if (!is_valid(op) || !is_valid(dtype)) return false;
  switch (op) {
    case ReduceOp::avg:
    case ReduceOp::premul_sum: return is_floating_point(dtype);
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor: return !is_floating_point(dtype);
    default: return true;
  }
}

namespace detail {
/// bool's operator as one on its 0/1 bytes: or (sum, max, bor), and (prod, min, band), xor.
[[nodiscard]] constexpr ReduceOp bool_as_byte(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::max:
    case ReduceOp::bor: return ReduceOp::max;
    case ReduceOp::prod:
    case ReduceOp::min:
    case ReduceOp::band: return ReduceOp::min;
    case ReduceOp::bxor: return ReduceOp::bxor;
    default: return op;  // avg, premul_sum: not defined on bool
  }
}
}  // namespace detail

/// A reduction as the collectives take it: a ReduceOp, and premul_sum's factor. Made implicitly
/// from a ReduceOp (`comm.all_reduce(buf, ReduceOp::max)`), or by ddp::premul_sum.
struct Reduction {
  ReduceOp op = ReduceOp::sum;  ///< The operator.
  /// premul_sum: what each rank's input is multiplied by (in the element type's precision, float
  /// for half and bfloat16) before the sum: finite, and within float's range unless the elements
  /// are double; ignored by the other operators.
  double factor = 1.0;

  /// ReduceOp::sum.
  constexpr Reduction() noexcept = default;
  /// `o`. A bare ReduceOp::premul_sum has no factor (NaN), and the collectives refuse it: its
  /// factor comes with ddp::premul_sum(f).
  constexpr Reduction(ReduceOp o) noexcept  // NOLINT(google-explicit-constructor)
      : op(o), factor(o == ReduceOp::premul_sum ? std::numeric_limits<double>::quiet_NaN() : 1.0) {}
  /// `o` with premul_sum's `f`.
  constexpr Reduction(ReduceOp o, double f) noexcept : op(o), factor(f) {}
};

/// torch's `_make_nccl_premul_sum(factor)`: sums every rank's input multiplied by `factor` first
/// (a gradient average with the division before the sum, where the sum could overflow float16).
[[nodiscard]] constexpr Reduction premul_sum(double factor) noexcept {
  return {ReduceOp::premul_sum, factor};
}

/// Where a buffer lives.
enum class DeviceKind : std::uint8_t { cpu = 0, cuda = 1 };

/// "cpu" or "cuda"; "invalid" for a value that is not one.
[[nodiscard]] constexpr std::string_view to_string(DeviceKind k) noexcept {
  return k == DeviceKind::cpu ? "cpu" : k == DeviceKind::cuda ? "cuda" : "invalid";
}

/// A device: the host, or CUDA device `index`.
struct Device {
  DeviceKind kind = DeviceKind::cpu;  ///< The host or a CUDA device.
  int index = 0;                      ///< The CUDA device ordinal; 0 for the host.

  /// The host.
  [[nodiscard]] static constexpr Device cpu() noexcept { return {DeviceKind::cpu, 0}; }
  /// CUDA device `index`.
  [[nodiscard]] static constexpr Device cuda(int index = 0) noexcept {
    return {DeviceKind::cuda, index};
  }
  /// Whether this is the host.
  [[nodiscard]] constexpr bool is_cpu() const noexcept { return kind == DeviceKind::cpu; }
  /// Whether this is a CUDA device.
  [[nodiscard]] constexpr bool is_cuda() const noexcept { return kind == DeviceKind::cuda; }

  /// Same kind and same index.
  friend constexpr bool operator==(const Device&, const Device&) = default;
};

/// "cpu" or "cuda:N", as torch prints devices.
[[nodiscard]] DDP_INLINE std::string to_string(const Device& d);

DDP_END_NAMESPACE

namespace ddp::detail {
/// What half and bfloat16 share in std::numeric_limits.
struct SmallFloatLimits {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr bool is_bounded = true;
  static constexpr bool is_modulo = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr int radix = 2;
};
}  // namespace ddp::detail

namespace std {

/// std::numeric_limits for ddp::half: the IEEE 754 binary16 format.
template <>
class numeric_limits<ddp::half> : public ddp::detail::SmallFloatLimits {
 public:
  /// The standard members, with the values of binary16 (11-bit significand, exponents -14..15).
  ///@{
  static constexpr bool is_iec559 = true;
  static constexpr int digits = 11;
  static constexpr int digits10 = 3;
  static constexpr int max_digits10 = 5;
  static constexpr int min_exponent = -13;
  static constexpr int min_exponent10 = -4;
  static constexpr int max_exponent = 16;
  static constexpr int max_exponent10 = 4;
  static constexpr ddp::half min() noexcept { return ddp::half::from_bits(0x0400); }
  static constexpr ddp::half lowest() noexcept { return ddp::half::from_bits(0xfbff); }
  static constexpr ddp::half max() noexcept { return ddp::half::from_bits(0x7bff); }
  static constexpr ddp::half epsilon() noexcept { return ddp::half::from_bits(0x1400); }
  static constexpr ddp::half round_error() noexcept { return ddp::half::from_bits(0x3800); }
  static constexpr ddp::half infinity() noexcept { return ddp::half::from_bits(0x7c00); }
  static constexpr ddp::half quiet_NaN() noexcept { return ddp::half::from_bits(0x7e00); }
  static constexpr ddp::half signaling_NaN() noexcept { return ddp::half::from_bits(0x7d00); }
  static constexpr ddp::half denorm_min() noexcept { return ddp::half::from_bits(0x0001); }
  ///@}
};

/// std::numeric_limits for ddp::bfloat16: float's exponent range with an 8-bit significand.
template <>
class numeric_limits<ddp::bfloat16> : public ddp::detail::SmallFloatLimits {
 public:
  /// The standard members, with the values of bfloat16 (8-bit significand, float's exponents).
  ///@{
  static constexpr bool is_iec559 = false;
  static constexpr int digits = 8;
  static constexpr int digits10 = 2;
  static constexpr int max_digits10 = 4;
  static constexpr int min_exponent = -125;
  static constexpr int min_exponent10 = -37;
  static constexpr int max_exponent = 128;
  static constexpr int max_exponent10 = 38;
  static constexpr ddp::bfloat16 min() noexcept { return ddp::bfloat16::from_bits(0x0080); }
  static constexpr ddp::bfloat16 lowest() noexcept { return ddp::bfloat16::from_bits(0xff7f); }
  static constexpr ddp::bfloat16 max() noexcept { return ddp::bfloat16::from_bits(0x7f7f); }
  static constexpr ddp::bfloat16 epsilon() noexcept { return ddp::bfloat16::from_bits(0x3c00); }
  static constexpr ddp::bfloat16 round_error() noexcept { return ddp::bfloat16::from_bits(0x3f00); }
  static constexpr ddp::bfloat16 infinity() noexcept { return ddp::bfloat16::from_bits(0x7f80); }
  static constexpr ddp::bfloat16 quiet_NaN() noexcept { return ddp::bfloat16::from_bits(0x7fc0); }
  static constexpr ddp::bfloat16 signaling_NaN() noexcept {
    return ddp::bfloat16::from_bits(0x7fa0);
  }
  static constexpr ddp::bfloat16 denorm_min() noexcept { return ddp::bfloat16::from_bits(0x0001); }
  ///@}
};

}  // namespace std

#if DDP_BODIES
#include "ddp/impl/types.ipp"
#endif
