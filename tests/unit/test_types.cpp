#include <ddp/types.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <complex>
#include <cstdint>
#include <ios>
#include <limits>
#include <set>
#include <string_view>
#include <vector>

namespace {

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
float float_of(std::uint32_t b) { return std::bit_cast<float>(b); }

// Independent reference for binary16: its value from the IEEE formula, in double.
double half_value(std::uint16_t h) {
  const int sign = (h >> 15) != 0 ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(double(mantissa), -24);
  if (exponent == 31) {
    return mantissa == 0 ? sign * std::numeric_limits<double>::infinity()
                         : std::numeric_limits<double>::quiet_NaN();
  }
  return sign * std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
}

// Reference rounding of a finite float to binary16: the nearest of all 63,488 finite values
// (found by binary search over the sorted positive ones), ties to the even bit pattern, and
// overflow to infinity at or beyond 65504 + half an ulp (65520).
std::uint16_t reference_half(float f) {
  static const std::vector<double> positive = [] {
    std::vector<double> v;
    for (std::uint32_t h = 0; h < 0x7c00; ++h) v.push_back(half_value(std::uint16_t(h)));
    return v;
  }();
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (a >= 65520.0) return sign | 0x7c00;
  const auto it = std::lower_bound(positive.begin(), positive.end(), a);
  std::uint32_t hi = std::uint32_t(it - positive.begin());  // first value >= a
  if (hi == 0 || positive[hi] == a) return std::uint16_t(sign | hi);
  if (hi == positive.size()) return std::uint16_t(sign | (hi - 1));  // between 65504 and 65520
  const std::uint32_t lo = hi - 1;
  const double below = a - positive[lo], above = positive[hi] - a;
  const std::uint32_t pick = below < above ? lo : above < below ? hi : ((lo & 1) == 0 ? lo : hi);
  return std::uint16_t(sign | pick);
}

// Reference rounding of a finite float to bfloat16: pick the nearer of the two neighbours
// (truncation and the next bf16 magnitude; 0x7f80 stands for 2^128), ties to even.
std::uint16_t reference_bfloat16(float f) {
  const std::uint32_t x = bits_of(f);
  const std::uint32_t sign = x & 0x80000000u;
  const std::uint32_t lo = (x & 0x7fffffffu) & 0xffff0000u;
  const std::uint32_t hi = lo + 0x10000u;
  const double a = std::fabs(double(f));
  const double vlo = double(float_of(lo));
  const double vhi = hi == 0x7f800000u ? std::ldexp(1.0, 128) : double(float_of(hi));
  const double below = a - vlo, above = vhi - a;
  const std::uint32_t pick = below < above   ? lo
                             : above < below ? hi
                                             : (((lo >> 16) & 1) == 0 ? lo : hi);
  return std::uint16_t((sign | pick) >> 16);
}

// Inputs that stress rounding: a stride through all 2^32 patterns, plus every half's exact value,
// its midpoints to both neighbours and one float ulp either side of each midpoint.
std::vector<float> rounding_inputs() {
  std::vector<float> in;
  for (std::uint64_t b = 0; b < (1ull << 32); b += 4093) in.push_back(float_of(std::uint32_t(b)));
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const double v = half_value(std::uint16_t(h));
    const double next = h + 1 < 0x7c00 ? half_value(std::uint16_t(h + 1)) : 65536.0;
    const auto mid = float((v + next) / 2);  // exact: half midpoints are representable in float
    for (float f : {float(v), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      in.push_back(f);
      in.push_back(-f);
    }
  }
  return in;
}

}  // namespace

TEST_CASE("half: every bit pattern converts to its exact IEEE value") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = ddp::half::from_bits(std::uint16_t(b));
    const double expected = half_value(std::uint16_t(b));
    const float got = float(h);
    if (std::isnan(expected)) {
      REQUIRE(std::isnan(got));
      REQUIRE(std::signbit(got) == ((b & 0x8000) != 0));
    } else {
      REQUIRE(double(got) == expected);
      REQUIRE(std::signbit(got) == ((b & 0x8000) != 0));  // -0 stays -0
    }
  }
}

TEST_CASE("half: float -> half -> float round-trips every finite and infinite half") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = ddp::half::from_bits(std::uint16_t(b));
    const bool is_nan = (b & 0x7c00) == 0x7c00 && (b & 0x3ff) != 0;
    const ddp::half back{float(h)};
    if (is_nan) {
      REQUIRE(std::isnan(float(back)));
      REQUIRE((back.bits() & 0x0200) != 0);             // quieted
      REQUIRE((back.bits() & 0x8000) == (b & 0x8000));  // sign kept
    } else {
      REQUIRE(back.bits() == b);
    }
  }
}

TEST_CASE("half: rounding from float is round-to-nearest-even, with overflow and underflow") {
  for (float f : rounding_inputs()) {
    if (std::isnan(f)) {
      CHECK(std::isnan(float(ddp::half(f))));
      continue;
    }
    const std::uint16_t expected =
        std::isinf(f) ? std::uint16_t(std::signbit(f) ? 0xfc00 : 0x7c00) : reference_half(f);
    const std::uint16_t got = ddp::half(f).bits();
    if (got != expected) {
      FAIL_CHECK("half(" << f << " = 0x" << std::hex << bits_of(f) << ") gave 0x" << got
                         << ", expected 0x" << expected);
    }
#if defined(__FLT16_MANT_DIG__) && !defined(__clang__)
    // The compiler's own conversion (x86-64 gcc: _Float16) agrees too.
    const auto native = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    if (got != native) FAIL_CHECK("half(" << f << ") disagrees with _Float16");
#endif
  }
  // Named cases.
  CHECK(ddp::half(65504.0f).bits() == 0x7bff);
  CHECK(ddp::half(65519.99f).bits() == 0x7bff);
  CHECK(ddp::half(65520.0f).bits() == 0x7c00);  // ties to even: overflows
  CHECK(ddp::half(1e9f).bits() == 0x7c00);
  CHECK(ddp::half(-1e9f).bits() == 0xfc00);
  CHECK(ddp::half(std::ldexp(1.0f, -24)).bits() == 0x0001);  // smallest subnormal
  CHECK(ddp::half(std::ldexp(1.0f, -25)).bits() == 0x0000);  // tie rounds to even (zero)
  CHECK(ddp::half(std::ldexp(1.5f, -25)).bits() == 0x0001);
  CHECK(ddp::half(-0.0f).bits() == 0x8000);
  CHECK(ddp::half(1.0f + std::ldexp(1.0f, -11)).bits() == 0x3c00);      // tie to even (down)
  CHECK(ddp::half(1.0f + 3 * std::ldexp(1.0f, -11)).bits() == 0x3c02);  // tie to even (up)
}

TEST_CASE("bfloat16: conversions, rounding, NaN and infinity") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto v = ddp::bfloat16::from_bits(std::uint16_t(b));
    const float f = float(v);
    REQUIRE(bits_of(f) == (b << 16));  // widening is exact
    const bool is_nan = (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0;
    const ddp::bfloat16 back(f);
    if (is_nan) {
      REQUIRE(std::isnan(float(back)));
      REQUIRE((back.bits() & 0x8000) == (b & 0x8000));
    } else {
      REQUIRE(back.bits() == b);
    }
  }
  for (float f : rounding_inputs()) {
    if (std::isnan(f)) {
      const auto r = ddp::bfloat16(f).bits();
      CHECK(((r & 0x7f80) == 0x7f80 && (r & 0x7f) != 0));  // never turns into infinity
      continue;
    }
    const std::uint16_t expected =
        std::isinf(f) ? std::uint16_t(bits_of(f) >> 16) : reference_bfloat16(f);
    const std::uint16_t got = ddp::bfloat16(f).bits();
    if (got != expected)
      FAIL_CHECK("bfloat16(" << f << ") gave " << got << ", expected " << expected);
  }
  // NaN whose payload lives only in the low 16 bits must stay NaN (naive truncation gives inf).
  CHECK(std::isnan(float(ddp::bfloat16(float_of(0x7f800001u)))));
  CHECK(ddp::bfloat16(std::numeric_limits<float>::max()).bits() == 0x7f80);  // rounds to inf
  CHECK(ddp::bfloat16(1.0f + std::ldexp(1.0f, -8)).bits() == 0x3f80);        // tie to even
  CHECK(ddp::bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)).bits() == 0x3f82);
}

TEST_CASE("half and bfloat16 arithmetic, comparison and limits") {
  using ddp::bfloat16;
  using ddp::half;
  CHECK(float(half(1.5f) + half(2.25f)) == 3.75f);
  CHECK(float(half(3.0f) * half(-2.0f)) == -6.0f);
  CHECK(float(half(1.0f) / half(4.0f)) == 0.25f);
  CHECK(float(-half(2.0f)) == -2.0f);
  half acc(0.0f);
  for (int i = 0; i < 10; ++i) acc += half(0.5f);
  CHECK(float(acc) == 5.0f);
  CHECK(half(1.0f) < half(2.0f));
  CHECK(half(2.0f) == half(2.0f));
  const half nan = std::numeric_limits<half>::quiet_NaN();
  CHECK_FALSE(nan == nan);
  CHECK(half(1.0f) + 0.5f == 1.5f);  // mixed arithmetic happens in float
  CHECK(float(std::numeric_limits<half>::max()) == 65504.0f);
  CHECK(float(std::numeric_limits<half>::min()) == std::ldexp(1.0f, -14));
  CHECK(float(std::numeric_limits<half>::denorm_min()) == std::ldexp(1.0f, -24));
  CHECK(float(std::numeric_limits<half>::epsilon()) == std::ldexp(1.0f, -10));
  CHECK(float(std::numeric_limits<half>::lowest()) == -65504.0f);
  CHECK(std::isinf(float(std::numeric_limits<half>::infinity())));
  CHECK(std::isnan(float(std::numeric_limits<half>::signaling_NaN())));
  CHECK(float(bfloat16(1.5f) + bfloat16(2.5f)) == 4.0f);
  CHECK(float(std::numeric_limits<bfloat16>::epsilon()) == std::ldexp(1.0f, -7));
  CHECK(float(std::numeric_limits<bfloat16>::min()) == std::numeric_limits<float>::min());
  CHECK(float(std::numeric_limits<bfloat16>::max()) == float_of(0x7f7f0000u));
  CHECK(std::isnan(float(std::numeric_limits<bfloat16>::quiet_NaN())));
  CHECK(std::isnan(float(std::numeric_limits<bfloat16>::signaling_NaN())));
  static_assert(float(half(0.5f)) == 0.5f, "conversions are constexpr");
  static_assert(bfloat16(2.0f).bits() == 0x4000);
}

TEST_CASE("DType: element sizes, names, floating-point flag, mapping from C++ types") {
  static_assert(ddp::dtype_of<std::int8_t> == ddp::DType::int8);
  static_assert(ddp::dtype_of<std::uint8_t> == ddp::DType::uint8);
  static_assert(ddp::dtype_of<std::int32_t> == ddp::DType::int32);
  static_assert(ddp::dtype_of<std::uint32_t> == ddp::DType::uint32);
  static_assert(ddp::dtype_of<std::int64_t> == ddp::DType::int64);
  static_assert(ddp::dtype_of<long long> == ddp::DType::int64);
  static_assert(ddp::dtype_of<unsigned long long> == ddp::DType::uint64);
  static_assert(ddp::dtype_of<const float> == ddp::DType::float32);
  static_assert(ddp::dtype_of<double> == ddp::DType::float64);
  static_assert(ddp::dtype_of<ddp::half> == ddp::DType::float16);
  static_assert(ddp::dtype_of<ddp::bfloat16> == ddp::DType::bfloat16);
  static_assert(ddp::dtype_of<bool> == ddp::DType::boolean &&
                ddp::size_of(ddp::DType::boolean) == 1);
  static_assert(!ddp::Scalar<char> && !ddp::Scalar<char8_t>);
  static_assert(ddp::dtype_of<short> == ddp::DType::int16);
  static_assert(ddp::dtype_of<std::uint16_t> == ddp::DType::uint16);
  static_assert(!ddp::Scalar<long double> && !ddp::Scalar<void*> && !ddp::Scalar<char16_t>);
  static_assert(!ddp::Scalar<wchar_t> && !ddp::Scalar<std::complex<float>>);

  std::set<std::string_view> names;
  for (int i = 0; i < ddp::dtype_count; ++i) {
    const auto t = static_cast<ddp::DType>(i);
    CHECK(ddp::is_valid(t));
    names.insert(ddp::to_string(t));
    CHECK((ddp::size_of(t) == 1 || ddp::size_of(t) == 2 || ddp::size_of(t) == 4 ||
           ddp::size_of(t) == 8));
  }
  CHECK(names.size() == std::size_t(ddp::dtype_count));
  CHECK_FALSE(ddp::is_valid(static_cast<ddp::DType>(ddp::dtype_count)));
  CHECK(ddp::to_string(static_cast<ddp::DType>(200)) == "invalid");
  CHECK(ddp::to_string(ddp::DType::boolean) == "bool");
  CHECK_FALSE(ddp::is_floating_point(ddp::DType::boolean));
  CHECK(ddp::size_of(ddp::DType::bfloat16) == 2);
  CHECK(ddp::size_of(ddp::DType::float64) == 8);
  CHECK(ddp::is_floating_point(ddp::DType::float16));
  CHECK_FALSE(ddp::is_floating_point(ddp::DType::int64));
}

TEST_CASE("ReduceOp names and which dtype/op pairs are defined") {
  CHECK(ddp::to_string(ddp::ReduceOp::avg) == "avg");
  CHECK(ddp::to_string(ddp::ReduceOp::prod) == "prod");
  CHECK(ddp::is_supported(ddp::ReduceOp::avg, ddp::DType::bfloat16));
  CHECK_FALSE(ddp::is_supported(ddp::ReduceOp::avg, ddp::DType::int32));
  CHECK(ddp::is_supported(ddp::ReduceOp::max, ddp::DType::uint8));
  CHECK_FALSE(
      ddp::is_supported(static_cast<ddp::ReduceOp>(ddp::reduce_op_count), ddp::DType::float32));
  // Bitwise on integers and bool only; premul_sum on floating point only; avg not on bool.
  for (const auto op : {ddp::ReduceOp::band, ddp::ReduceOp::bor, ddp::ReduceOp::bxor}) {
    CHECK(ddp::is_supported(op, ddp::DType::int64));
    CHECK(ddp::is_supported(op, ddp::DType::boolean));
    CHECK_FALSE(ddp::is_supported(op, ddp::DType::float32));
    CHECK_FALSE(ddp::is_supported(op, ddp::DType::bfloat16));
  }
  CHECK(ddp::is_supported(ddp::ReduceOp::premul_sum, ddp::DType::float16));
  CHECK_FALSE(ddp::is_supported(ddp::ReduceOp::premul_sum, ddp::DType::int32));
  CHECK_FALSE(ddp::is_supported(ddp::ReduceOp::avg, ddp::DType::boolean));
  CHECK(ddp::to_string(ddp::ReduceOp::premul_sum) == "premul_sum");
  CHECK(ddp::to_string(ddp::ReduceOp::bxor) == "bxor");
  constexpr ddp::Reduction r = ddp::premul_sum(0.5);
  static_assert(r.op == ddp::ReduceOp::premul_sum && r.factor == 0.5);
  constexpr ddp::Reduction plain = ddp::ReduceOp::max;  // implicit, as the collectives take it
  static_assert(plain.op == ddp::ReduceOp::max && plain.factor == 1.0);
  CHECK_FALSE(ddp::is_supported(ddp::ReduceOp::sum, static_cast<ddp::DType>(77)));
  // Numbering matches ncclRedOp_t (ncclSum=0, ncclProd=1, ncclMax=2, ncclMin=3, ncclAvg=4).
  static_assert(static_cast<int>(ddp::ReduceOp::max) == 2 &&
                static_cast<int>(ddp::ReduceOp::avg) == 4);
}

TEST_CASE("Device") {
  constexpr auto cpu = ddp::Device::cpu();
  constexpr auto gpu = ddp::Device::cuda(3);
  static_assert(cpu.is_cpu() && !cpu.is_cuda() && gpu.is_cuda());
  CHECK(ddp::to_string(cpu) == "cpu");
  CHECK(ddp::to_string(gpu) == "cuda:3");
  CHECK(gpu == ddp::Device{ddp::DeviceKind::cuda, 3});
  CHECK(gpu != ddp::Device::cuda(0));
  CHECK(ddp::Device{} == cpu);
}
