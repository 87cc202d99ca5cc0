// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Error and ddp::Errc: every failure in ddp is reported as one exception type whose code
/// says what happened and whose message names the rank, the operation and what to do; and
/// detail::concat, which builds those messages without iostreams or {fmt}:
/// detail::concat("rank ", 3, ": ", what).

#include "ddp/config.hpp"

#include <charconv>
#include <concepts>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
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

/// What went wrong. The values are stable: they may be logged, compared and sent between ranks.
enum class Errc : int {
  invalid_argument = 1,  ///< bad input, rejected before anything was sent
  timeout = 2,           ///< a wait exceeded Options::timeout (a peer stopped or is slow)
  peer_lost = 3,         ///< a peer process died or its connection closed
  mismatch = 4,          ///< ranks called different collectives (op, dtype, count or root differ)
  backend = 5,           ///< CUDA, NCCL or MPI reported an error
  aborted = 6,           ///< the communicator was aborted or poisoned by an earlier failure
  system = 7,            ///< an operating-system call failed (errno in the message)
  protocol = 8,          ///< malformed, oversized or unexpected data arrived from the wire
  unauthorized = 9,      ///< the rendezvous token was wrong or missing
  address_in_use = 10,   ///< the rendezvous address/port is taken by another process
  unsupported = 11,      ///< the operation is not available in this build or on this backend
};

/// The enumerator's name, e.g. "peer_lost".
[[nodiscard]] constexpr std::string_view to_string(Errc code) noexcept {
  switch (code) {
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::timeout: return "timeout";
    case Errc::peer_lost: return "peer_lost";
    case Errc::mismatch: return "mismatch";
    case Errc::backend: return "backend";
    case Errc::aborted: return "aborted";
    case Errc::system: return "system";
    case Errc::protocol: return "protocol";
    case Errc::unauthorized: return "unauthorized";
    case Errc::address_in_use: return "address_in_use";
    case Errc::unsupported: return "unsupported";
  }
  return "unknown";
}

namespace detail {
class ErrcCategory final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "ddp"; }
  [[nodiscard]] DDP_INLINE std::string message(int value) const override;
};

#if DDP_BODIES
DDP_INLINE std::string ErrcCategory::message(int value) const {
  return std::string(to_string(static_cast<Errc>(value)));
}
#endif  // DDP_BODIES

}  // namespace detail

/// The std::error_category of ddp::Errc, for code that works with std::error_code.
[[nodiscard]] DDP_INLINE const std::error_category& error_category() noexcept;
#if DDP_BODIES
DDP_INLINE const std::error_category& error_category() noexcept {
  static const detail::ErrcCategory category;
  return category;
}
#endif  // DDP_BODIES

/// The std::error_code of an Errc in error_category(); found by ADL for `std::error_code ec = e;`.
[[nodiscard]] inline std::error_code make_error_code(Errc code) noexcept {
  return {static_cast<int>(code), error_category()};
}

/// The one exception type of ddp. `what()` is the full message; `code()` tells what happened.
class Error : public std::runtime_error {
 public:
  /// An error with the given code; `message` becomes what().
  Error(Errc code, const std::string& message);
  /// An error with the given code; `message` becomes what().
  Error(Errc code, const char* message);

  /// What went wrong.
  [[nodiscard]] Errc code() const noexcept { return code_; }
  /// code() as a std::error_code in ddp::error_category().
  [[nodiscard]] std::error_code error_code() const noexcept { return make_error_code(code_); }

 private:
  Errc code_;
};

#if DDP_BODIES
DDP_INLINE Error::Error(Errc code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

DDP_INLINE Error::Error(Errc code, const char* message)
    : std::runtime_error(message), code_(code) {}
#endif  // DDP_BODIES

namespace detail {

/// Builds a ddp::Error from message parts and throws it (or aborts without exceptions).
template <class... Args>
[[noreturn]] void fail(Errc code, const Args&... parts) {
  DDP_THROW(Error(code, concat(parts...)));
}

/// Throws Errc::system for a failed OS call: "<what>: <strerror(err)> (errno <err>)".
template <class... Args>
[[noreturn]] void fail_errno(int err, const Args&... parts) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf; handle both variants.
  auto text = [&]() -> const char* {
    auto r = ::strerror_r(err, buf, sizeof buf);
    if constexpr (std::is_same_v<decltype(r), int>) {
      return r == 0 ? buf : "unknown error";
    } else {
      return r;
    }
  }();
  DDP_THROW(Error(Errc::system, concat(parts..., ": ", text, " (errno ", err, ")")));
}

}  // namespace detail

DDP_END_NAMESPACE

template <>
struct std::is_error_code_enum<ddp::Errc> : std::true_type {};
