// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// StoreServer: the rendezvous store's server, one thread that serves detail::StoreEngine
/// (store/engine.hpp) over TCP with poll(). See ddp/store.hpp for what makes the store safe to
/// expose.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/store/engine.hpp"
#include "ddp/store/protocol.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// The store server. Runs one thread that serves every client with poll(); stops and joins in
/// its destructor. The protocol lives in detail::StoreEngine; this class only moves bytes.
class StoreServer {
 public:
  /// Listens on host:port (port 0 picks a free one, see port()). Throws Errc::address_in_use
  /// when the port is taken.
  StoreServer(const std::string& host, int port, StoreOptions options = {});

  /// Serves on a socket that is already listening (a launcher binds it before it forks, so the
  /// port is known and no thread exists at fork time).
  StoreServer(detail::Fd listener, const std::string& host, StoreOptions options = {});

  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  ~StoreServer() { stop(); }

  /// The port the server listens on (the one picked when 0 was asked for).
  [[nodiscard]] int port() const noexcept { return port_; }
  /// The host the server was given to listen on.
  [[nodiscard]] const std::string& host() const noexcept { return host_; }

  /// Stops serving (idempotent). Connected clients see the connection close.
  void stop();

  /// Connections refused so far (bad handshake, wrong token, oversized frames, stray traffic).
  [[nodiscard]] std::uint64_t refused() const noexcept { return engine_.refused(); }

 private:
  using Clock = detail::Clock;
  using Session = detail::StoreEngine::Session;

  /// The options as served: the log defaults to stderr, and the connection budgets fit the
  /// process's descriptor limit (raised to its hard limit first). The server shares that limit
  /// with the rank that hosts it, which needs descriptors of its own (its sockets to the other
  /// ranks, shared memory): connections that have not authenticated get at most an eighth of it,
  /// all connections at most three quarters, so strangers can never starve the rank.
  static StoreOptions prepared(StoreOptions o);

  void run();

  void accept_all();

  /// accept() failed for lack of descriptors: the reserve descriptor is given up for a moment to
  /// accept and close one waiting connection (its client learns at once instead of hanging), the
  /// listener is left alone for 100 ms, and the condition is logged (rate-limited).
  void out_of_descriptors(int err);

  void on_readable(std::uint64_t id);

  /// Sends what the engine queued, as far as the sockets take it; closes what should be closed.
  void flush_all();

  detail::StoreEngine engine_;
  std::string host_;
  detail::Fd listener_;
  detail::Fd wake_read_, wake_write_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::map<std::uint64_t, detail::Fd> fds_;
  detail::Fd reserve_fd_;  // given up to accept-and-close when descriptors run out
  Clock::time_point accept_pause_until_{};
  std::thread thread_;
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/server.ipp"
#endif
