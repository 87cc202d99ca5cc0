// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/env.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <charconv>
#include <cstdlib>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE const char* process_env(const char* name) { return std::getenv(name); }

DDP_INLINE EnvReader::EnvReader() : lookup_(&process_env) {}

DDP_INLINE EnvReader::EnvReader(EnvLookup lookup) : lookup_(std::move(lookup)) {}

DDP_INLINE bool EnvReader::has(const char* name) const {
  const char* v = lookup_(name);
  return v != nullptr && *v != '\0';
}

DDP_INLINE std::optional<std::string> EnvReader::str(const char* name) const {
  const char* v = lookup_(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

DDP_INLINE std::string EnvReader::get(const char* name, std::string_view fallback) const {
  const char* v = lookup_(name);
  return v != nullptr ? std::string(v) : std::string(fallback);
}

DDP_INLINE std::optional<int> EnvReader::integer(const char* name, int min, int max) const {
  const auto v = str(name);
  if (!v) return std::nullopt;
  const std::string_view text(*v);
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size()) {
    fail(Errc::invalid_argument, "environment variable ", name, "=\"", text,
         "\" is not an integer; check what your launcher exported");
  }
  if (value < min || value > max) {
    fail(Errc::invalid_argument, "environment variable ", name, "=", value, " is out of range [",
         min, ", ", max, "]");
  }
  return value;
}

DDP_INLINE std::optional<std::uint64_t> EnvReader::whole_number(const char* name, std::uint64_t min,
                                                                std::uint64_t max,
                                                                std::string_view what) const {
  const auto v = str(name);
  if (!v) return std::nullopt;
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
  if (ec != std::errc{} || end != v->data() + v->size() || n < min || n > max)
    fail(Errc::invalid_argument, name, "=\"", *v, "\" must be ", what);
  return n;
}

DDP_INLINE std::optional<bool> EnvReader::flag(const char* name) const {
  const auto v = str(name);
  if (!v) return std::nullopt;
  std::string w = *v;
  for (char& c : w) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (w == "1" || w == "true" || w == "on" || w == "yes") return true;
  if (w == "0" || w == "false" || w == "off" || w == "no") return false;
  fail(Errc::invalid_argument, name, "=\"", *v,
       "\" is not a yes/no setting: use 1 or 0 (also true/false, on/off, yes/no)");
}

DDP_INLINE std::optional<std::chrono::milliseconds> EnvReader::seconds(const char* name) const {
  const auto v = str(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const double s = std::strtod(v->c_str(), &end);
  const bool decimal = v->find_first_not_of("0123456789.eE+-") == std::string::npos;
  if (!decimal || end == v->c_str() || *end != '\0' || !(s >= 0.001) || s > 2147483.0) {
    fail(Errc::invalid_argument, name, "=\"", *v,
         "\" is not a timeout: give seconds, at least 0.001 and at most 2147483 (e.g. 300)");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000.0 + 0.5));
}

}  // namespace detail
DDP_END_NAMESPACE
