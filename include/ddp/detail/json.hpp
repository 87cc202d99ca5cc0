// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// A small JSON reader (what etcd's HTTP gateway answers: objects, arrays, strings, numbers,
/// booleans, null; depth and size bounded, every malformed input an Errc::protocol) and base64,
/// in which that gateway carries keys and values.

#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// `bytes` in standard base64 (with padding).
[[nodiscard]] DDP_INLINE std::string base64_encode(std::string_view bytes);

/// The bytes of base64 `text` (padding optional); Errc::protocol when it is not base64.
[[nodiscard]] DDP_INLINE std::string base64_decode(std::string_view text);

/// A JSON value. Numbers are kept as their text (etcd writes 64-bit integers as strings and as
/// numbers).
struct Json {
  enum class Type { null, boolean, number, string, array, object };
  Type type = Type::null;
  bool boolean = false;
  std::string text;                ///< a string's value, or a number's text
  std::vector<Json> items;         ///< an array's items, an object's members' values
  std::vector<std::string> names;  ///< an object's members' names (items[i] is names[i]'s)

  /// The member `key` of an object, or nullptr.
  [[nodiscard]] const Json* find(std::string_view key) const;
  /// The string or number member `key` ("" when absent).
  [[nodiscard]] std::string get(std::string_view key) const;
  /// The integer (a number or a string of digits) member `key`; `otherwise` when absent.
  [[nodiscard]] std::int64_t integer(std::string_view key, std::int64_t otherwise = 0) const;
};

/// Parses one JSON document (at most `max_depth` deep); Errc::protocol when malformed.
[[nodiscard]] DDP_INLINE Json parse_json(std::string_view s, int max_depth = 64);

/// `text` as a JSON string literal.
[[nodiscard]] DDP_INLINE std::string json_quoted(std::string_view text);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/json.ipp"
#endif
