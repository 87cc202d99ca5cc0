// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The rendezvous store's client: ddp::Store, a connection shared by its copies (calls
/// serialized), with prefixed views, watched stop keys and a timeout on every call. It talks to
/// ddp's own StoreServer (store/tcp_client.hpp: it authenticates the server as the server
/// authenticates it, ddp/store.hpp) or to an etcd cluster (store/etcd.hpp).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/store/connection.hpp"
#include "ddp/store/protocol.hpp"
#include "ddp/store/tcp_client.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// A client of a rendezvous store. Copies share one connection (calls are serialized);
/// prefixed() gives a view whose keys live under a prefix. Thread-safe.
class Store {
 public:
  /// Connects to ddp's store server at host:port, retrying until options.timeout (the server may
  /// start later).
  Store(std::string host, int port, StoreOptions options = {});
  /// A store over a connection made elsewhere (an etcd cluster: detail::connect_etcd).
  explicit Store(std::shared_ptr<detail::StoreConnection> c);

  /// A view of the same store whose keys are prefixed with `prefix`.
  [[nodiscard]] Store prefixed(std::string_view prefix) const;

  /// A view whose get() and wait() also end as soon as `key` (under this view's prefix) exists:
  /// they then throw the ddp::Error that `key` holds (see stop_value()), or Errc::aborted with its
  /// text. A rank that fails during a rendezvous sets such a key, so its peers fail at once
  /// with its reason instead of waiting out their timeout.
  [[nodiscard]] Store watching(std::string_view key) const;

  /// A view whose calls all end by `deadline` (their timeouts are shortened to fit; an expired
  /// deadline makes waits time out at once): the steps of a rendezvous share one timeout.
  /// Clock::time_point::max() lifts it.
  [[nodiscard]] Store with_deadline(detail::Clock::time_point deadline) const;
  /// The deadline of this view (see with_deadline()); Clock::time_point::max() when none.
  [[nodiscard]] detail::Clock::time_point deadline() const noexcept { return deadline_; }

  /// The same view without the watched key (see watching()).
  [[nodiscard]] Store unwatched() const;

  /// A view whose calls fail at once (Errc::timeout) instead of waiting while another thread's
  /// call holds the connection.
  [[nodiscard]] Store soft() const;

  /// The value for a watched key (see watching()) that makes the waiters throw `code` with
  /// `message`.
  [[nodiscard]] static std::string stop_value(Errc code, std::string_view message);
  /// The same for `e`, keeping its origin rank and lost ranks (Error::origin_rank()).
  [[nodiscard]] static std::string stop_value(const Error& e) { return detail::encode_stop(e); }

  /// Whether a call has found the store gone (closed or unresponsive): every later call fails at
  /// once instead of reconnecting.
  [[nodiscard]] bool lost() const { return conn_->lost(); }
  /// The prefix this view puts before every key ("" for the root view).
  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }
  /// The default timeout of every call (StoreOptions::timeout).
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return conn_->options.timeout;
  }
  /// The server's host, as given to the constructor (etcd: the first endpoint's).
  [[nodiscard]] const std::string& host() const noexcept { return conn_->host(); }
  /// The server's port (etcd: the first endpoint's).
  [[nodiscard]] int port() const noexcept { return conn_->port(); }
  /// Where the store is, for messages: "host:port", or the etcd cluster's endpoints.
  [[nodiscard]] std::string where() const { return conn_->where(); }
  /// The local address of the connection to the store (the interface that reaches it).
  [[nodiscard]] std::string local_address() const { return conn_->local_address(); }

  /// Sets `key` (under this view's prefix) to `value`, waking those waiting for it.
  void set(std::string_view key, std::string_view value) {
    conn_->set(call("set", key), full(key), value);
  }

  /// The value of key, waiting up to the store's timeout for it to appear.
  [[nodiscard]] std::string get(std::string_view key) { return get(key, conn_->options.timeout); }
  /// The value of key, waiting up to `timeout` for it to appear (then Errc::timeout).
  [[nodiscard]] std::string get(std::string_view key, std::chrono::milliseconds timeout) {
    return conn_->get(call("get", key), full(key), capped(timeout), stop_);
  }

  /// Waits until every key exists; Errc::timeout names the ones still missing.
  void wait(std::span<const std::string> keys) { wait(keys, conn_->options.timeout); }
  /// Waits up to `timeout` until every key exists; Errc::timeout names the ones still missing.
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    (void)wait_for(keys, timeout, false);
  }

  /// Adds delta to the integer at key (absent counts as 0) and returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta) {
    return conn_->add(call("add", key), full(key), delta);
  }

  /// torch semantics: sets key to desired if it holds expected (or is absent and expected is
  /// empty); returns the value it holds afterwards.
  std::string compare_set(std::string_view key, std::string_view expected,
                          std::string_view desired) {
    return conn_->compare_set(call("compare_set", key), full(key), expected, desired);
  }

  /// Removes key; returns whether it existed.
  bool erase(std::string_view key) { return conn_->erase(call("erase", key), full(key)); }

  /// When this process's connection to the store closes before clear_on_close() (it died, was
  /// killed, or exited), the store sets each key of `keys` (under this view's prefix) that does
  /// not exist to its value: a dead man's switch, with which a rendezvous learns at once of a rank
  /// that died. One set per connection; a later call replaces it. (etcd: when the connection's
  /// lease runs out, applied by another process of the job.)
  void set_on_close(std::span<const std::pair<std::string, std::string>> keys);
  /// Cancels set_on_close().
  void clear_on_close() { set_on_close({}); }

  /// A lease on this connection (shared by every view of it): a thread of this process sends a
  /// sign of life every ttl / 5; when none reaches the store for `ttl` (the process is stopped,
  /// hung or cut off), the store acts as if the connection closed (the set_on_close() records)
  /// and applies `on_expire` (keys under this view's prefix), and the connection stays open, so
  /// that a process that wakes can still read why it was left out. A later call replaces it (and
  /// re-arms an expired one); a `ttl` of 0 ends it.
  void lease(std::chrono::milliseconds ttl, std::span<const LeaseRecord> on_expire = {});

  /// Runs `tick` on the lease's thread after each sign of life (every ttl / 5), with a view of
  /// this store whose calls never wait for another thread's call (soft()); returns a number for
  /// remove_tick(). A tick must not remove itself.
  std::uint64_t add_tick(std::function<void(Store&)> tick);
  /// Removes a tick; once it returns, that tick does not run (any more).
  void remove_tick(std::uint64_t id) { conn_->remove_tick(id); }

  /// Whether every key exists, without waiting.
  [[nodiscard]] bool check(std::span<const std::string> keys);

  /// The keys of `keys` that are missing from the store after waiting up to `timeout`; empty when
  /// all appeared. Unlike wait(), reports instead of throwing.
  /// A watched key that appears meanwhile throws its error, whatever its code (Errc::timeout
  /// included: a rank that timed out elsewhere), never mistaken for this wait's own timeout.
  [[nodiscard]] std::vector<std::string> missing_after(std::span<const std::string> keys,
                                                       std::chrono::milliseconds timeout);

 private:
  [[nodiscard]] std::string full(std::string_view key) const;

  [[nodiscard]] detail::StoreCall call(std::string_view what, std::string_view key) const {
    return {what, prefix_, key, deadline_, soft_};
  }

  /// wait(); with `report_timeout`, returns false at the timeout instead of throwing it.
  bool wait_for(std::span<const std::string> keys, std::chrono::milliseconds timeout,
                bool report_timeout);

  /// `timeout`, shortened to end by this view's deadline.
  [[nodiscard]] std::chrono::milliseconds capped(std::chrono::milliseconds timeout) const;

  std::shared_ptr<detail::StoreConnection> conn_;
  std::string prefix_;
  std::string stop_;   // full key that ends get/wait early (watching())
  bool soft_ = false;  // soft(): a call never waits for another thread's
  detail::Clock::time_point deadline_ = detail::Clock::time_point::max();  // with_deadline()
};

namespace detail {
/// The value at `key` in `s`, "" when absent, without waiting.
DDP_INLINE std::string peek_key(Store& s, const std::string& key);
}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/client.ipp"
#endif
