// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The one reader of environment variables (the launchers' RANK, WORLD_SIZE, ... and ddp's own
/// DDP_*): EnvReader over an injectable lookup (getenv by default; tests and programs that keep
/// their configuration elsewhere pass their own), with one set of rules for each kind of value.
/// A malformed value is Errc::invalid_argument naming the variable and what it must be.
///
/// Who reads what: Environment::detect (the launcher's variables), Options::with_env (DDP_TIMEOUT,
/// DDP_TOKEN, DDP_HOST_TRANSPORT, DDP_SEGMENT_BYTES, DDP_SHM_SINGLE_COPY, DDP_VERIFY_COLLECTIVES,
/// DDP_TRACE_ENTRIES, DDP_TRACE_DUMP), Communicator::init (DDP_STORE_HOSTED, DDP_RESTART_COUNT: set
/// by launchers that host the store; TORCHELASTIC_ERROR_FILE, comm/error_file.hpp), ddp::spawn
/// and ddprun (what they pass to their workers).

#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

DDP_BEGIN_NAMESPACE
namespace detail {

/// A variable's value, or nullptr when it is unset.
using EnvLookup = std::function<const char*(const char*)>;

/// The process environment (getenv).
[[nodiscard]] DDP_INLINE const char* process_env(const char* name);

class EnvReader {
 public:
  /// Reads the process environment.
  EnvReader();
  explicit EnvReader(EnvLookup lookup);

  /// Set and not empty.
  [[nodiscard]] bool has(const char* name) const;
  [[nodiscard]] std::optional<std::string> str(const char* name) const;
  /// The value, or `fallback` when unset (an empty value is returned as it is).
  [[nodiscard]] std::string get(const char* name, std::string_view fallback = {}) const;

  /// A launcher's integer in [min, max]; anything else is an error that names the variable.
  [[nodiscard]] std::optional<int> integer(const char* name, int min, int max) const;

  /// A whole number in [min, max], or nullopt when unset or empty. Anything else (a sign, a
  /// unit, a number out of range) names the variable and `what` it must be.
  [[nodiscard]] std::optional<std::uint64_t> whole_number(const char* name, std::uint64_t min,
                                                          std::uint64_t max,
                                                          std::string_view what) const;

  /// A yes/no setting: 1, true, on, yes or 0, false, off, no (any case); nullopt when unset or
  /// empty. Anything else names the variable.
  [[nodiscard]] std::optional<bool> flag(const char* name) const;

  /// Seconds as a decimal number (30, 0.5) in [0.001, 2147483]; nullopt when unset or empty.
  [[nodiscard]] std::optional<std::chrono::milliseconds> seconds(const char* name) const;

 private:
  EnvLookup lookup_;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/env.ipp"
#endif
