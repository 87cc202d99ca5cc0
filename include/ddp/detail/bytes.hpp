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

/// "0, 2, 3" of ranks, and back.
DDP_INLINE std::string ranks_text(const std::vector<int>& ranks);
DDP_INLINE std::vector<int> parse_ranks(std::string_view text);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/bytes.ipp"
#endif
