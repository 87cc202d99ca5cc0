// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::StoreConnection: what a ddp::Store talks to, one per connection and shared by the
/// Store's views. Two kinds: ddp's own store server (store/tcp_client.hpp) and an etcd cluster
/// (store/etcd.hpp). The operations take full keys; what every kind shares lives here: one call
/// at a time (soft calls never wait for another thread's), the lease's thread (a sign of life
/// every ttl / 5, then the ticks), and the errors a stop key and a timeout raise.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/fork.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/store/protocol.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// What a Store call is, for its messages and its limits.
struct StoreCall {
  std::string_view what;    ///< "set", "get", ...
  std::string_view prefix;  ///< the view's prefix
  std::string_view key;     ///< the first key as the caller gave it ("" for none)
  Clock::time_point deadline = Clock::time_point::max();  ///< the view's (with_deadline)
  bool soft = false;  ///< never wait for another thread's call (Errc::timeout instead)
};

/// The error a watched key's value holds (Store::stop_value, detail::decode_stop): its code,
/// message, origin and lost ranks; otherwise Errc::aborted quoting it.
[[noreturn]] DDP_INLINE void fail_stopped(const StoreCall& c, std::string_view stop,
                                          const std::string& value);

/// A wait's timeout, naming the keys still missing (at most 16).
[[noreturn]] DDP_INLINE void fail_missing(const StoreCall& c, std::chrono::milliseconds timeout,
                                          const std::vector<std::string>& missing);

/// One connection to a store (see the file comment). Thread-safe.
class StoreConnection {
 public:
  explicit StoreConnection(StoreOptions o);
  StoreConnection(const StoreConnection&) = delete;
  StoreConnection& operator=(const StoreConnection&) = delete;
  virtual ~StoreConnection() { stop_heartbeat(); }

  StoreOptions options;
  /// Set by the Store that made it: the lease's thread reaches the connection only through it.
  std::weak_ptr<StoreConnection> self;

  // ---- the operations (full keys); each throws ddp::Error naming the call ----
  virtual void set(const StoreCall& c, const std::string& key, std::string_view value) = 0;
  /// The value of `key`, waiting up to `timeout`; a `stop` key that appears first throws its
  /// error (fail_stopped), the timeout Errc::timeout.
  virtual std::string get(const StoreCall& c, const std::string& key,
                          std::chrono::milliseconds timeout, const std::string& stop) = 0;
  /// Waits up to `timeout` for every key (`stop` as in get); false at the timeout when
  /// `report_timeout`, else Errc::timeout naming the keys missing.
  virtual bool wait(const StoreCall& c, std::span<const std::string> keys,
                    std::chrono::milliseconds timeout, const std::string& stop,
                    bool report_timeout) = 0;
  virtual std::int64_t add(const StoreCall& c, const std::string& key, std::int64_t delta) = 0;
  virtual std::string compare_set(const StoreCall& c, const std::string& key,
                                  std::string_view expected, std::string_view desired) = 0;
  virtual bool erase(const StoreCall& c, const std::string& key) = 0;
  virtual bool check(const StoreCall& c, std::span<const std::string> keys) = 0;
  virtual void set_on_close(const StoreCall& c,
                            std::span<const std::pair<std::string, std::string>> keys) = 0;
  /// The lease (Store::lease); the caller starts the heartbeat after it.
  virtual void lease(const StoreCall& c, std::chrono::milliseconds ttl,
                     std::span<const LeaseRecord> on_expire) = 0;
  /// Whether a call found the store gone: every later call fails at once.
  [[nodiscard]] virtual bool lost() = 0;
  /// Where the store is, for messages ("host:port", or the etcd endpoints).
  [[nodiscard]] virtual std::string where() const = 0;
  [[nodiscard]] virtual const std::string& host() const noexcept = 0;
  [[nodiscard]] virtual int port() const noexcept = 0;
  /// The local address of the connection (the interface that reaches the store).
  [[nodiscard]] virtual std::string local_address() = 0;
  /// Called once a Store holds it (`self` set).
  virtual void adopted() {}

  // ---- the lease's thread ----
  /// Starts (or re-times) the thread that signs every ttl / 5 and then runs the ticks.
  void start_heartbeat(std::chrono::milliseconds ttl);
  /// `tick` runs on the lease's thread after each sign of life; returns its number.
  std::uint64_t add_tick(std::function<void()> tick);
  /// Once it returns, tick `id` does not run (any more).
  void remove_tick(std::uint64_t id);

 protected:
  std::mutex mutex_;  // one call at a time

  /// The call mutex, taken (or, for a soft call, tried: Errc::timeout when another thread's
  /// call holds it).
  std::unique_lock<std::mutex> lock_for(const StoreCall& c);

  /// One sign of life (from the lease's thread; it must never wait for a call).
  virtual void keepalive() = 0;
  /// Work of the lease's thread after each sign of life, before the ticks.
  virtual void on_beat() {}

  /// Ends the lease's thread (a derived class calls it first in its destructor: the thread may
  /// be signing through it).
  void stop_heartbeat() noexcept;

 private:
  /// What the lease's thread shares with its connection: it holds this and a weak reference,
  /// never keeping the connection alive between beats.
  struct Beat {
    std::mutex mutex;
    std::condition_variable wake;
    std::chrono::milliseconds period{0};
    bool stop = false;
  };

  static void beating(const std::shared_ptr<Beat>& b, const std::weak_ptr<StoreConnection>& w);

  std::shared_ptr<Beat> beat_ = std::make_shared<Beat>();
  std::thread heartbeat_;
  std::uint64_t made_in_ = fork_generation();
  std::mutex tick_mutex_;
  std::map<std::uint64_t, std::function<void()>> ticks_;
  std::uint64_t next_tick_ = 0;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/connection.ipp"
#endif
