// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Message building without iostreams or {fmt}: detail::concat("rank ", 3, ": ", what).

#include "ddp/config.hpp"

#include <charconv>
#include <concepts>
#include <string>
#include <string_view>
#include <type_traits>

DDP_BEGIN_NAMESPACE
namespace detail {

template <class T>
inline void append_to(std::string& out, const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    out += value ? "true" : "false";
  } else if constexpr (std::is_same_v<T, char>) {
    out += value;
  } else if constexpr (std::is_arithmetic_v<T>) {
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value);
    if (ec == std::errc{}) out.append(buf, end);
  } else if constexpr (std::is_enum_v<T>) {
    append_to(out, static_cast<std::underlying_type_t<T>>(value));
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(value);
  } else {
    // Types with a to_string(value) found by ADL (ddp's enums, Device, ...).
    out += to_string(value);
  }
}

/// Concatenates strings, characters, numbers and ddp enums into one std::string.
template <class... Args>
[[nodiscard]] std::string concat(const Args&... args) {
  std::string out;
  (append_to(out, args), ...);
  return out;
}

}  // namespace detail
DDP_END_NAMESPACE
