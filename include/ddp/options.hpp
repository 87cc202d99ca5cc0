// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Options: how a communicator is made (timeouts, the rendezvous secret, transports).

#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

DDP_BEGIN_NAMESPACE

/// How backend::Host moves bytes.
enum class HostTransport : std::uint8_t {
  automatic,  ///< shared memory when every rank is on this host, TCP otherwise
  shm,        ///< shared memory (every rank must be on this host)
  tcp,        ///< TCP, even on one host (what multi-host runs use)
};

namespace detail {
[[nodiscard]] inline std::string env_or(const char* name, std::string_view fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string(fallback);
}
[[nodiscard]] inline std::string env_or_empty(const char* name) { return env_or(name, ""); }

/// $name as a whole number in [min, max], or nullopt when it is unset or empty. Anything else (a
/// sign, a unit, a number out of range) is Errc::invalid_argument naming the variable and `what`
/// it must be.
[[nodiscard]] inline std::optional<std::uint64_t> env_unsigned(const char* name, std::uint64_t min,
                                                               std::uint64_t max,
                                                               std::string_view what) {
  const std::string v = env_or(name, "");
  if (v.empty()) return std::nullopt;
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc{} || end != v.data() + v.size() || n < min || n > max)
    fail(Errc::invalid_argument, name, "=\"", v, "\" must be ", what);
  return n;
}

/// $name as a yes/no setting: 1, true, on, yes or 0, false, off, no (any case); `fallback` when
/// unset or empty. Anything else is Errc::invalid_argument naming the variable.
[[nodiscard]] inline bool env_flag(const char* name, bool fallback) {
  std::string v = env_or(name, "");
  if (v.empty()) return fallback;
  for (char& c : v) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  fail(Errc::invalid_argument, name, "=\"", env_or(name, ""),
       "\" is not a yes/no setting: use 1 or 0 (also true/false, on/off, yes/no)");
}

/// $DDP_TIMEOUT (seconds, a decimal number such as 30 or 0.5) or `fallback` when unset. Anything
/// else, or a value outside (0, 2147483] seconds, is Errc::invalid_argument naming the variable.
[[nodiscard]] inline std::chrono::milliseconds timeout_from_env(
    std::chrono::milliseconds fallback) {
  const std::string v = env_or("DDP_TIMEOUT", "");
  if (v.empty()) return fallback;
  char* end = nullptr;
  const double seconds = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0' || !(seconds >= 0.001) || seconds > 2147483.0) {
    fail(Errc::invalid_argument, "DDP_TIMEOUT=\"", v,
         "\" is not a timeout: give seconds, at least 0.001 and at most 2147483 (e.g. 300)");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
}
}  // namespace detail

struct Options {
  /// The longest any single wait may take (a collective, the rendezvous, a store call) before
  /// Errc::timeout. A peer that dies is reported sooner (Errc::peer_lost). Default: 5 minutes,
  /// or $DDP_TIMEOUT seconds (a malformed value throws Errc::invalid_argument naming it).
  std::chrono::milliseconds timeout = detail::timeout_from_env(std::chrono::minutes(5));
  /// Rendezvous secret: every rank must present it to the store. Default: $DDP_TOKEN.
  std::string token = detail::env_or("DDP_TOKEN", "");
  /// CUDA device for CUDA backends; -1: the local rank.
  int device = -1;
  /// Name of this communicator in the store; communicators made from the same store (a new one
  /// after a failure, say) need different names.
  std::string group = "default";
  /// backend::Host transport. $DDP_HOST_TRANSPORT (shm or tcp) overrides `automatic`.
  HostTransport transport = HostTransport::automatic;
  /// backend::Host: bytes one rank moves per round (the shared-memory slot size, the TCP
  /// segment). 0: $DDP_SEGMENT_BYTES (4096 to 2^40), else the transport's default (shm 512 KiB,
  /// tcp 4 MiB). Shared-memory slots are capped at 64 MiB. Every rank must use the same value.
  std::size_t segment_bytes = 0;
  /// The rendezvous store runs elsewhere: rank 0 does not start one. Launchers that host the
  /// store (ddprun, ddp::spawn) say so with DDP_STORE_HOSTED=1, which init() also honours.
  bool external_store = false;
  /// CUDA buffers given to a backend that moves host memory only (backend::Host, a backend::Mpi
  /// whose MPI is not CUDA-aware) go through pinned host memory in pieces of this many bytes, so
  /// that copies overlap the collective (ddp built with CUDA: the ddp::cuda target).
  std::size_t cuda_staging_bytes = std::size_t{4} << 20;
  /// backend::Host compares every collective's fingerprint (collective, dtype, count, op, root,
  /// sequence number) across ranks, so that mismatched calls raise Errc::mismatch on every rank
  /// instead of corrupting data or hanging. Every rank must use the same setting. Default: on,
  /// unless $DDP_VERIFY_COLLECTIVES is 0 (or false/off/no; other values than those and 1 are
  /// refused) (what it costs: README, "Diagnostics").
  bool verify_collectives = detail::env_flag("DDP_VERIFY_COLLECTIVES", true);
  /// How many recent operations each communicator remembers (the flight recorder, see
  /// trace.hpp); 0 turns it off. $DDP_TRACE_ENTRIES overrides.
  std::size_t trace_entries = 2000;
  /// Where a communicator writes its flight recorder when an operation times out: "" nowhere,
  /// "stderr", or a directory (one file per rank). Default: $DDP_TRACE_DUMP.
  std::string trace_dump = detail::env_or("DDP_TRACE_DUMP", "");
};

DDP_END_NAMESPACE
