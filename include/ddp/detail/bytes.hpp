// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Little-endian byte writing and bounds-checked reading, for everything ddp puts on a wire.
/// A reader never reads past its input and never allocates more than the input could hold.

#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

template <class T, bool = std::is_enum_v<T>>
struct wire_integer {
  using type = std::make_unsigned_t<T>;
};
template <class T>
struct wire_integer<T, true> {
  using type = std::make_unsigned_t<std::underlying_type_t<T>>;
};

class ByteWriter {
 public:
  explicit ByteWriter(std::string& out);

  template <class T>
    requires std::is_integral_v<T> || std::is_enum_v<T>
  void put(T value) {
    using U = typename wire_integer<T>::type;
    auto u = static_cast<U>(value);
    for (std::size_t i = 0; i < sizeof(U); ++i) {
      out_.push_back(static_cast<char>(static_cast<std::uint8_t>(u & 0xffu)));
      if constexpr (sizeof(U) > 1) u = static_cast<U>(u >> 8);
    }
  }
  void raw(const void* data, std::size_t n) { out_.append(static_cast<const char*>(data), n); }
  void str(std::string_view s);

 private:
  std::string& out_;
};

#if DDP_BODIES
DDP_INLINE ByteWriter::ByteWriter(std::string& out) : out_(out) {}

DDP_INLINE void ByteWriter::str(std::string_view s) {
  put(static_cast<std::uint32_t>(s.size()));
  raw(s.data(), s.size());
}
#endif  // DDP_BODIES

class ByteReader {
 public:
  ByteReader(const void* data, std::size_t n, std::string_view what);
  explicit ByteReader(std::string_view s, std::string_view what = "message");

  template <class T>
    requires std::is_integral_v<T> || std::is_enum_v<T>
  [[nodiscard]] T get() {
    using U = typename wire_integer<T>::type;
    need(sizeof(U));
    U u = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i)
      u = static_cast<U>(u | (static_cast<U>(p_[i]) << (8 * i)));
    p_ += sizeof(U);
    left_ -= sizeof(U);
    return static_cast<T>(u);
  }
  void raw(void* out, std::size_t n);
  [[nodiscard]] std::string_view view(std::size_t n);
  /// A length-prefixed string no longer than max_len.
  [[nodiscard]] std::string str(std::size_t max_len);
  [[nodiscard]] std::size_t left() const noexcept { return left_; }
  void expect_end() const {
    if (left_ != 0) fail(Errc::protocol, what_, ": ", left_, " unexpected trailing bytes");
  }

 private:
  void need(std::size_t n) const;
  const std::uint8_t* p_;
  std::size_t left_;
  std::string_view what_;
};

#if DDP_BODIES
DDP_INLINE ByteReader::ByteReader(const void* data, std::size_t n, std::string_view what)
    : p_(static_cast<const std::uint8_t*>(data)), left_(n), what_(what) {}

DDP_INLINE ByteReader::ByteReader(std::string_view s, std::string_view what)
    : ByteReader(s.data(), s.size(), what) {}

DDP_INLINE void ByteReader::raw(void* out, std::size_t n) {
  need(n);
  if (n != 0) std::memcpy(out, p_, n);
  p_ += n;
  left_ -= n;
}

DDP_INLINE std::string_view ByteReader::view(std::size_t n) {
  need(n);
  std::string_view v(reinterpret_cast<const char*>(p_), n);
  p_ += n;
  left_ -= n;
  return v;
}

DDP_INLINE std::string ByteReader::str(std::size_t max_len) {
  const auto n = get<std::uint32_t>();
  if (n > max_len) {
    fail(Errc::protocol, what_, ": a string of ", n, " bytes exceeds the limit of ", max_len);
  }
  return std::string(view(n));
}

DDP_INLINE void ByteReader::need(std::size_t n) const {
  if (n > left_) {
    fail(Errc::protocol, what_, " is truncated: needs ", n, " more bytes, has ", left_);
  }
}
#endif  // DDP_BODIES

/// "0, 2, 3" of ranks, and back.
DDP_INLINE std::string ranks_text(const std::vector<int>& ranks);
#if DDP_BODIES
DDP_INLINE std::string ranks_text(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += concat(out.empty() ? "" : ", ", r);
  return out;
}
#endif  // DDP_BODIES
DDP_INLINE std::vector<int> parse_ranks(std::string_view text);
#if DDP_BODIES
DDP_INLINE std::vector<int> parse_ranks(std::string_view text) {
  std::vector<int> out;
  int v = -1;
  for (const char c : text) {
    if (c >= '0' && c <= '9') {
      v = (v < 0 ? 0 : v * 10) + (c - '0');
    } else if (v >= 0) {
      out.push_back(v);
      v = -1;
    }
  }
  if (v >= 0) out.push_back(v);
  return out;
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
