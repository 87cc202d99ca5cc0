// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The object codec behind gather_object, all_gather_object and broadcast_object: a typed,
/// length-prefixed binary encoding. Decoding never executes anything from the wire (unlike
/// pickle), checks a type tag, and refuses truncated input, counts the input could not hold and
/// nesting deeper than 64 with Errc::invalid_argument, before allocating.
///
/// Built in: trivially copyable types, std::string, std::vector, std::pair, std::optional (and
/// any nesting of those). For your own type, specialize ddp::codec:
///
///   template <> struct ddp::codec<Sample> {
///     static void encode(ddp::Encoder& e, const Sample& s) { e.put(s.id); e.put(s.label); }
///     static Sample decode(ddp::Decoder& d) {
///       Sample s;
///       s.id = d.get<int>();
///       s.label = d.get<std::string>();
///       return s;
///     }
///   };

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// How values of T are encoded: a static encode(Encoder&, const T&) and a static
/// T decode(Decoder&). Specialize it for your own types (see the file comment).
template <class T>
struct codec;

class Encoder;
class Decoder;

/// A type ddp can encode: built in, or with a ddp::codec<T> specialization.
template <class T>
concept Encodable = requires(Encoder& e, Decoder& d, const T& v) {
  codec<T>::encode(e, v);
  { codec<T>::decode(d) } -> std::same_as<T>;
};

/// Appends encoded values to a string; what a codec's encode() writes with.
class Encoder {
 public:
  /// Appends to `out` (which must outlive the encoder).
  explicit Encoder(std::string& out);
  /// Appends `value` with codec<T>.
  template <class T>
  void put(const T& value) {
    codec<T>::encode(*this, value);
  }
  /// Appends `n` raw bytes.
  void bytes(const void* data, std::size_t n) { out_.append(static_cast<const char*>(data), n); }
  /// Appends an element count (8 bytes), read back by Decoder::count.
  void count(std::size_t n);

 private:
  std::string& out_;
};

/// Reads values back from `n` bytes, checking every length against the input left.
class Decoder {
 public:
  static constexpr int max_depth = 64;  ///< Deepest nesting of get() calls accepted.

  /// Reads from `data`, `n` bytes (which must outlive the decoder).
  Decoder(const void* data, std::size_t n);

  /// The next value, read with codec<T>; Errc::invalid_argument past max_depth nesting.
  template <class T>
  [[nodiscard]] T get() {
    if (++depth_ > max_depth)
      detail::fail(Errc::invalid_argument, "object decode: nesting deeper than ", max_depth);
    T v = codec<T>::decode(*this);
    --depth_;
    return v;
  }
  /// Copies the next `n` bytes to `out`; Errc::invalid_argument if fewer are left.
  void bytes(void* out, std::size_t n);
  /// A count of elements that each take at least `min_bytes` of the remaining input.
  [[nodiscard]] std::size_t count(std::size_t min_bytes);
  /// The number of bytes not yet read.
  [[nodiscard]] std::size_t left() const noexcept { return left_; }

 private:
  const std::byte* p_;
  std::size_t left_;
  int depth_ = 0;
};

namespace detail {
template <class T>
inline constexpr bool is_optional_v = false;
template <class T>
inline constexpr bool is_optional_v<std::optional<T>> = true;

/// Sent as their bytes: trivially copyable types, except those whose bytes can be invalid
/// (bool, std::optional), which have checking codecs. A trivially copyable struct with a bool
/// or closed-enum member should get its own codec.
template <class T>
concept RawEncodable =
    std::is_trivially_copyable_v<T> && !std::is_same_v<T, bool> && !is_optional_v<T>;

/// Fewest bytes one encoded T takes (bounds counts read from the wire).
template <class T>
constexpr std::size_t min_encoded_bytes() {
  if constexpr (RawEncodable<T>)
    return sizeof(T);
  else
    return 1;
}
}  // namespace detail

/// Trivially copyable types (bool and std::optional excepted): sent as their bytes.
template <class T>
  requires detail::RawEncodable<T>
struct codec<T> {
  /// Appends the bytes of `v`.
  static void encode(Encoder& e, const T& v) { e.bytes(&v, sizeof v); }
  /// Reads sizeof(T) bytes.
  static T decode(Decoder& d) {
    T v;
    d.bytes(&v, sizeof v);
    return v;
  }
};

/// bool: one byte, 0 or 1; any other byte is refused.
template <>
struct codec<bool> {
  /// Appends 1 or 0.
  static void encode(Encoder& e, const bool& v) {
    const std::uint8_t b = v ? 1 : 0;
    e.bytes(&b, 1);
  }
  /// Reads one byte; Errc::invalid_argument unless it is 0 or 1.
  static bool decode(Decoder& d) {
    std::uint8_t b = 0;
    d.bytes(&b, 1);
    if (b > 1) detail::fail(Errc::invalid_argument, "object decode: bad bool ", int{b});
    return b == 1;
  }
};

/// std::string: its length, then its bytes.
template <>
struct codec<std::string> {
  /// Appends the length and the characters.
  static void encode(Encoder& e, const std::string& s) {
    e.count(s.size());
    e.bytes(s.data(), s.size());
  }
  /// Reads a length (checked against the input left), then the characters.
  static std::string decode(Decoder& d) {
    std::string s(d.count(1), '\0');
    d.bytes(s.data(), s.size());
    return s;
  }
};

/// std::vector: its size, then its elements (in one block when they are raw bytes).
template <class T>
struct codec<std::vector<T>> {
  /// Appends the size and every element.
  static void encode(Encoder& e, const std::vector<T>& v) {
    e.count(v.size());
    if constexpr (detail::RawEncodable<T>) {
      e.bytes(v.data(), v.size() * sizeof(T));
    } else {
      for (const auto& x : v) e.put<T>(x);
    }
  }
  /// Reads a size (checked against the input left), then that many elements.
  static std::vector<T> decode(Decoder& d) {
    const std::size_t n = d.count(detail::min_encoded_bytes<T>());
    std::vector<T> v;
    if constexpr (detail::RawEncodable<T>) {
      v.resize(n);
      d.bytes(v.data(), n * sizeof(T));
    } else {
      v.reserve(n);
      for (std::size_t i = 0; i < n; ++i) v.push_back(d.get<T>());
    }
    return v;
  }
};

/// std::pair that is not trivially copyable: first, then second.
template <class A, class B>
  requires(!detail::RawEncodable<std::pair<A, B>>)
struct codec<std::pair<A, B>> {
  /// Appends first, then second.
  static void encode(Encoder& e, const std::pair<A, B>& p) {
    e.put<A>(p.first);
    e.put<B>(p.second);
  }
  /// Reads first, then second.
  static std::pair<A, B> decode(Decoder& d) {
    A a = d.get<A>();
    B b = d.get<B>();
    return {std::move(a), std::move(b)};
  }
};

/// std::optional: a flag byte (0 or 1), then the value if there is one.
template <class T>
struct codec<std::optional<T>> {
  /// Appends the flag, then the value if there is one.
  static void encode(Encoder& e, const std::optional<T>& o) {
    e.put<std::uint8_t>(o.has_value() ? 1 : 0);
    if (o) e.put<T>(*o);
  }
  /// Reads the flag (Errc::invalid_argument unless 0 or 1), then the value if it is 1.
  static std::optional<T> decode(Decoder& d) {
    const auto has = d.get<std::uint8_t>();
    if (has > 1)
      detail::fail(Errc::invalid_argument, "object decode: bad optional flag ", int{has});
    if (has == 0) return std::nullopt;
    return d.get<T>();
  }
};

namespace detail {

/// FNV-1a of the compiler's spelling of T: the same on every rank of one program.
template <class T>
std::uint64_t type_tag() {
  // Read here, not inside a lambda: there it would name the lambda (clang), not type_tag<T>.
  const std::string_view name = __PRETTY_FUNCTION__;
  static const std::uint64_t tag = [name] {
    std::uint64_t h = 1469598103934665603ull;
    for (char c : name) {
      h ^= static_cast<std::uint8_t>(c);
      h *= 1099511628211ull;
    }
    return h;
  }();
  return tag;
}

/// The complete message for one object: type tag, then the encoding.
template <Encodable T>
std::string encode_object(const T& value) {
  std::string out;
  Encoder e(out);
  e.put<std::uint64_t>(type_tag<T>());
  e.put<T>(value);
  return out;
}

template <Encodable T>
T decode_object(const void* data, std::size_t n) {
  Decoder d(data, n);
  if (d.get<std::uint64_t>() != type_tag<T>()) {
    fail(Errc::invalid_argument,
         "object decode: the bytes encode a different type (type tag mismatch): every rank must "
         "pass the same type");
  }
  T v = d.get<T>();
  if (d.left() != 0) fail(Errc::invalid_argument, "object decode: ", d.left(), " trailing bytes");
  return v;
}

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/codec.ipp"
#endif
