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
#include <utility>
#include <vector>

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

}  // namespace detail

/// The std::error_category of ddp::Errc, for code that works with std::error_code.
[[nodiscard]] DDP_INLINE const std::error_category& error_category() noexcept;

/// The std::error_code of an Errc in error_category(); found by ADL for `std::error_code ec = e;`.
[[nodiscard]] inline std::error_code make_error_code(Errc code) noexcept {
  return {static_cast<int>(code), error_category()};
}

/// The one exception type of ddp. `what()` is the full message; `code()` tells what happened;
/// `origin_rank()` and `lost_ranks()` say, where ddp knows them, on which rank the failure started
/// and which ranks were found lost: a program reads them instead of parsing the message.
class Error : public std::runtime_error {
 public:
  /// An error with the given code; `message` becomes what().
  Error(Errc code, const std::string& message);
  /// An error with the given code; `message` becomes what().
  Error(Errc code, const char* message);
  /// An error that started on rank `origin_rank` (-1: not known), which reported
  /// `origin_message`: what() is `context` followed by it. `lost_ranks`: the ranks found lost.
  Error(Errc code, std::string_view context, int origin_rank, std::string_view origin_message,
        std::vector<int> lost_ranks = {});

  /// What went wrong.
  [[nodiscard]] Errc code() const noexcept { return code_; }
  /// code() as a std::error_code in ddp::error_category().
  [[nodiscard]] std::error_code error_code() const noexcept { return make_error_code(code_); }
  /// The rank (of the communicator) that found this failure and reported it first, when it is
  /// another rank: the "rank N" of "failed because rank N reported" (a collective, rendezvous or
  /// monitored_barrier verdict that failed there first, relayed through shared memory, the
  /// transport or the store). -1 when this process found it.
  [[nodiscard]] int origin_rank() const noexcept { return origin_; }
  /// The words of the rank that found the failure: what() without the context this rank added.
  [[nodiscard]] DDP_INLINE std::string_view origin_message() const noexcept;
  /// The ranks (of the communicator) found lost: dead, their connection closed, silent past the
  /// heartbeat, missing at a monitored_barrier. Empty when none was, or none is known.
  [[nodiscard]] const std::vector<int>& lost_ranks() const noexcept { return lost_; }

 private:
  Errc code_;
  int origin_ = -1;
  std::size_t origin_at_ = 0;
  std::vector<int> lost_;
};

namespace detail {

/// Builds a ddp::Error from message parts and throws it (or aborts without exceptions).
template <class... Args>
[[noreturn]] void fail(Errc code, const Args&... parts) {
  DDP_THROW(Error(code, concat(parts...)));
}

/// Throws an error that started on rank `origin` (-1: not known) and found `lost` lost; the
/// message is made of `parts`.
template <class... Args>
[[noreturn]] void fail_from(int origin, std::vector<int> lost, Errc code, const Args&... parts) {
  DDP_THROW(Error(code, std::string_view{}, origin, concat(parts...), std::move(lost)));
}

/// Throws `cause` again with `context` (message parts) before its message: its code, origin
/// and lost ranks kept.
template <class... Args>
[[noreturn]] void fail_within(const Error& cause, const Args&... context) {
  const std::string before = concat(context...);
  const std::string_view whole = cause.what();
  const std::size_t at = whole.size() - cause.origin_message().size();
  DDP_THROW(Error(cause.code(), before + std::string(whole.substr(0, at)), cause.origin_rank(),
                  cause.origin_message(), cause.lost_ranks()));
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

#if DDP_BODIES
#include "ddp/impl/error.ipp"
#endif
