// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The rendezvous store's wire protocol, shared by its server (ddp/store/server.hpp) and its
/// client (ddp/store/client.hpp): StoreOptions (limits, timeout, token), and in
/// detail::store_proto the hello/handshake constants, the operations and reply statuses, and
/// length-prefixed frames (send_frame, recv_frame) capped at a limit the receiver sets.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Limits and security settings of a store server and its clients.
struct StoreOptions {
  /// How long get/wait/connect may take before Errc::timeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// Shared secret; empty disables authentication. Communicator::init passes DDP_TOKEN.
  std::string token;
  std::size_t max_key_bytes = 4096;
  std::size_t max_value_bytes = std::size_t{64} << 20;
  std::size_t max_keys = std::size_t{1} << 20;
  std::size_t max_total_bytes = std::size_t{1} << 30;
  std::size_t max_connections = 4096;
  /// Connections that have not finished the handshake, at most: past this the oldest of them is
  /// closed to make room, so idle or slow strangers can never lock a real rank out.
  std::size_t max_pending_handshakes = 64;
  /// A connection that has not finished the handshake by then is dropped (slow or stray clients;
  /// a real client sends its handshake as soon as the hello arrives).
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(3)};
  /// Client: a key (the full key, prefix included) that the server sets, when it refuses this
  /// client's token, to a stop value (Store::stop_value, Errc::unauthorized) naming the refusal
  /// and `refusal_rank`: a rendezvous that watches that key fails at once on every rank instead
  /// of waiting for a rank that can never join. Empty: none. The server sets it only when absent,
  /// to a message of its own making.
  std::string refusal_key;
  /// Client: the rank this process claims, for the refusal's message (-1: none).
  int refusal_rank = -1;
  /// Client of an etcd store: the lease of this process (its heartbeat), made when it connects.
  std::chrono::milliseconds lease_ttl{std::chrono::seconds(5)};
  /// Refusals logged per 10 s at most; the rest are counted in one summary line.
  std::size_t log_burst = 20;
  /// Where the server reports refused connections and malformed traffic; default: stderr.
  /// Never receives the token.
  std::function<void(std::string_view)> log;
  /// Client of an etcd store that has not reached any member yet: how long endpoints that all
  /// refuse connections (nothing listens there) or do not resolve are tried again, for a
  /// cluster still starting, before the connection fails saying so, instead of at `timeout`.
  /// Callers give a quarter of their timeout, at most 10 s (unreachable_window_for).
  std::chrono::milliseconds unreachable_window{std::chrono::seconds(10)};
  /// Since when those endpoints have been tried (default: when it connects); a caller that
  /// retries connections of its own passes its first try's time.
  std::chrono::steady_clock::time_point tried_since{};
};

/// StoreOptions::unreachable_window for a caller whose own timeout is `timeout`: a quarter of it,
/// at most 10 s.
[[nodiscard]] inline std::chrono::milliseconds unreachable_window_for(
    std::chrono::milliseconds timeout) noexcept {
  return std::min<std::chrono::milliseconds>(timeout / 4, std::chrono::seconds(10));
}

/// What the server does to a key when a lease expires (Store::lease): sets it when absent, or
/// adds to the integer it holds.
struct LeaseRecord {
  std::string key;
  std::string value;     ///< set: the value to set
  std::int64_t add = 0;  ///< add: the delta (used when `is_add`)
  bool is_add = false;
};

namespace detail::store_proto {

inline constexpr std::uint32_t magic = 0x53504444;  // "DDPS"
inline constexpr std::uint16_t version = 4;
inline constexpr std::size_t nonce_bytes = 16;
inline constexpr std::size_t handshake_frame_limit = 512;
/// The longest StoreOptions::refusal_key a handshake carries.
inline constexpr std::size_t refusal_key_limit = 256;
inline constexpr std::string_view client_label = "ddp-store-client-v1";
inline constexpr std::string_view server_label = "ddp-store-server-v1";

enum class Op : std::uint8_t {
  set = 1,
  get = 2,
  wait = 3,
  add = 4,
  compare_set = 5,
  erase = 6,
  check = 7,
  /// When this connection closes (the client's process died), set a key that is absent to a
  /// value; an empty key cancels.
  on_close = 8,
  /// A lease on this connection: when nothing arrives on it for that long (the process stopped,
  /// hung or was cut off), the server acts as if it closed (its on_close records) and also
  /// applies the lease's own records (LeaseRecord). 0 ms: no lease.
  lease = 9,
  /// A sign of life for the lease; no reply.
  keepalive = 10
};
/// stopped: a get/wait ended because its stop key appeared (the body holds that key's value).
enum class Status : std::uint8_t { ok = 0, timeout = 1, error = 2, stopped = 3 };
enum class HandshakeStatus : std::uint8_t { ok = 0, unauthorized = 1, bad_version = 2 };

using Nonce = std::array<std::uint8_t, nonce_bytes>;

inline std::string_view as_view(const Nonce& n) {
  return {reinterpret_cast<const char*>(n.data()), n.size()};
}
inline std::string_view as_view(const Digest& d) {
  return {reinterpret_cast<const char*>(d.data()), d.size()};
}

/// Largest frame a peer may send once authenticated.
inline std::size_t frame_limit(const StoreOptions& o) {
  return o.max_value_bytes * 2 + o.max_key_bytes + 64;
}

/// Sends one length-prefixed frame.
DDP_INLINE IoResult send_frame(int fd, std::string_view payload, Deadline d);

/// Receives one frame of at most `limit` bytes.
DDP_INLINE IoResult recv_frame(int fd, std::string& out, std::size_t limit, Deadline d,
                               std::string_view what);

}  // namespace detail::store_proto

namespace detail {

/// A stop value (Store::stop_value): the error's code and message, then where it started
/// (origin rank, the offset of its own words in the message) and the ranks it lost.
DDP_INLINE std::string encode_stop(const Error& e);
/// The ddp::Error a stop value holds; nothing when the value is not one.
DDP_INLINE std::optional<Error> decode_stop(std::string_view value);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/protocol.ipp"
#endif
