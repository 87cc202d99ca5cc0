// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::TcpStoreConnection: a connection to ddp's own store server (store/server.hpp) over
/// TCP, speaking the protocol of store/protocol.hpp: the mutual HMAC handshake when a token is
/// set, then one request frame and one reply frame per call (a wait's reply comes when it is
/// answered or timed out by the server), and the lease's signs of life between them.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/store/connection.hpp"
#include "ddp/store/protocol.hpp"

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// A connection to a StoreServer (see the file comment).
class TcpStoreConnection final : public StoreConnection {
 public:
  /// Connects to host:port, retrying until options.timeout (the server may start later).
  TcpStoreConnection(std::string host, int port, StoreOptions o);
  ~TcpStoreConnection() override { stop_heartbeat(); }

  DDP_INLINE void set(const StoreCall& c, const std::string& key, std::string_view value) override;

  DDP_INLINE std::string get(const StoreCall& c, const std::string& key,
                             std::chrono::milliseconds timeout, const std::string& stop) override;

  DDP_INLINE bool wait(const StoreCall& c, std::span<const std::string> keys,
                       std::chrono::milliseconds timeout, const std::string& stop,
                       bool report_timeout) override;

  DDP_INLINE std::int64_t add(const StoreCall& c, const std::string& key,
                              std::int64_t delta) override;

  DDP_INLINE std::string compare_set(const StoreCall& c, const std::string& key,
                                     std::string_view expected, std::string_view desired) override;

  DDP_INLINE bool erase(const StoreCall& c, const std::string& key) override;

  DDP_INLINE bool check(const StoreCall& c, std::span<const std::string> keys) override;

  DDP_INLINE void set_on_close(const StoreCall& c,
                               std::span<const std::pair<std::string, std::string>> keys) override;

  DDP_INLINE void lease(const StoreCall& c, std::chrono::milliseconds ttl,
                        std::span<const LeaseRecord> on_expire) override;

  [[nodiscard]] DDP_INLINE bool lost() override;
  [[nodiscard]] std::string where() const override { return host_port(host_, port_); }
  [[nodiscard]] const std::string& host() const noexcept override { return host_; }
  [[nodiscard]] int port() const noexcept override { return port_; }
  [[nodiscard]] DDP_INLINE std::string local_address() override;

 protected:
  /// One sign of life, whole or not at all: it never blocks behind a full socket buffer (the
  /// server is then not reading: a sign of life changes nothing), and a frame begun is ended,
  /// so the stream stays whole.
  DDP_INLINE void keepalive() override;

 private:
  using Op = store_proto::Op;
  using Status = store_proto::Status;

  void ensure();

  /// Connects, and retries a few times when the server closes the connection during the
  /// handshake (it closes the oldest unauthenticated connections when strangers flood it).
  void connect();

  void connect_once();

  static std::string header(Op op);

  /// Sends a request and returns the reply's body. `timed_out`, when given, is set instead of
  /// throwing when the server answers that the wait timed out; `stop` names the watched key.
  std::string call(const StoreCall& c, std::string& req, std::chrono::milliseconds timeout,
                   bool* timed_out = nullptr, std::string_view stop = {});

  std::string host_;
  int port_;
  std::mutex write_mutex_;  // one frame written at a time (a call's, or a sign of life), and fd_
  Fd fd_;
  std::uint64_t next_request_ = 1;
  std::string dead_;  // why the store is known gone: no call waits on it again
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/tcp_client.ipp"
#endif
