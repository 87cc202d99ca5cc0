// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The rendezvous store's client: ddp::Store, a connection to a StoreServer shared by its copies
/// (calls serialized), with prefixed views, watched stop keys and a timeout on every call. It
/// authenticates the server as the server authenticates it (ddp/store.hpp).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/fork.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/store/protocol.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
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

/// A client of a StoreServer. Copies share one connection (calls are serialized); prefixed()
/// gives a view whose keys live under a prefix. Thread-safe.
class Store {
 public:
  /// Connects to host:port, retrying until options.timeout (the server may start later).
  Store(std::string host, int port, StoreOptions options = {})
      : conn_(std::make_shared<Connection>(std::move(host), port, std::move(options))) {
    conn_->self = conn_;
    std::lock_guard lock(conn_->mutex);
    conn_->connect();
  }

  /// A view of the same store whose keys are prefixed with `prefix`.
  [[nodiscard]] Store prefixed(std::string_view prefix) const {
    Store s(*this);
    s.prefix_ += prefix;
    return s;
  }

  /// A view whose get() and wait() also end as soon as `key` (under this view's prefix) exists:
  /// they then throw the ddp::Error that `key` holds (see stop_value()), or Errc::aborted with its
  /// text. A rank that fails during a rendezvous sets such a key, so its peers fail at once
  /// with its reason instead of waiting out their timeout.
  [[nodiscard]] Store watching(std::string_view key) const {
    Store s(*this);
    s.stop_ = full(key);
    return s;
  }

  /// A view whose calls all end by `deadline` (their timeouts are shortened to fit; an expired
  /// deadline makes waits time out at once): the steps of a rendezvous share one timeout.
  /// Clock::time_point::max() lifts it.
  [[nodiscard]] Store with_deadline(detail::Clock::time_point deadline) const {
    Store s(*this);
    s.deadline_ = deadline;
    return s;
  }
  /// The deadline of this view (see with_deadline()); Clock::time_point::max() when none.
  [[nodiscard]] detail::Clock::time_point deadline() const noexcept { return deadline_; }

  /// The same view without the watched key (see watching()).
  [[nodiscard]] Store unwatched() const {
    Store s(*this);
    s.stop_.clear();
    return s;
  }

  /// The value for a watched key (see watching()) that makes the waiters throw `code` with
  /// `message`.
  [[nodiscard]] static std::string stop_value(Errc code, std::string_view message) {
    std::string v;
    detail::ByteWriter w(v);
    w.put(static_cast<std::int32_t>(code));
    w.str(message);
    return v;
  }

  /// Whether a call has found the store gone (closed or unresponsive): every later call fails at
  /// once instead of reconnecting.
  [[nodiscard]] bool lost() const {
    std::lock_guard lock(conn_->mutex);
    return !conn_->dead.empty();
  }
  /// The prefix this view puts before every key ("" for the root view).
  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }
  /// The default timeout of every call (StoreOptions::timeout).
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return conn_->options.timeout;
  }
  /// The server's host, as given to the constructor.
  [[nodiscard]] const std::string& host() const noexcept { return conn_->host; }
  /// The server's port.
  [[nodiscard]] int port() const noexcept { return conn_->port; }
  /// The local address of the connection to the store (the interface that reaches it).
  [[nodiscard]] std::string local_address() const {
    std::lock_guard lock(conn_->mutex);
    conn_->ensure();
    return detail::local_address(conn_->fd.get());
  }

  /// Sets `key` (under this view's prefix) to `value`, waking those waiting for it.
  void set(std::string_view key, std::string_view value) {
    std::string req = header(Op::set);
    detail::ByteWriter w(req);
    w.str(full(key));
    w.str(value);
    (void)call(req, "set", key, conn_->options.timeout);
  }

  /// The value of key, waiting up to the store's timeout for it to appear.
  [[nodiscard]] std::string get(std::string_view key) { return get(key, conn_->options.timeout); }
  /// The value of key, waiting up to `timeout` for it to appear (then Errc::timeout).
  [[nodiscard]] std::string get(std::string_view key, std::chrono::milliseconds timeout) {
    timeout = capped(timeout);
    std::string req = header(Op::get);
    detail::ByteWriter w(req);
    w.str(full(key));
    w.put(static_cast<std::uint64_t>(timeout.count()));
    w.str(stop_);
    auto body = call(req, "get", key, timeout);
    detail::ByteReader r(body, "store reply");
    return r.str(body.size());
  }

  /// Waits until every key exists; Errc::timeout names the ones still missing.
  void wait(std::span<const std::string> keys) { wait(keys, conn_->options.timeout); }
  /// Waits up to `timeout` until every key exists; Errc::timeout names the ones still missing.
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    (void)wait_for(keys, timeout, false);
  }

  /// Adds delta to the integer at key (absent counts as 0) and returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta) {
    std::string req = header(Op::add);
    detail::ByteWriter w(req);
    w.str(full(key));
    w.put(delta);
    auto body = call(req, "add", key, conn_->options.timeout);
    detail::ByteReader r(body, "store reply");
    return r.get<std::int64_t>();
  }

  /// torch semantics: sets key to desired if it holds expected (or is absent and expected is
  /// empty); returns the value it holds afterwards.
  std::string compare_set(std::string_view key, std::string_view expected,
                          std::string_view desired) {
    std::string req = header(Op::compare_set);
    detail::ByteWriter w(req);
    w.str(full(key));
    w.str(expected);
    w.str(desired);
    auto body = call(req, "compare_set", key, conn_->options.timeout);
    detail::ByteReader r(body, "store reply");
    return r.str(body.size());
  }

  /// Removes key; returns whether it existed.
  bool erase(std::string_view key) {
    std::string req = header(Op::erase);
    detail::ByteWriter w(req);
    w.str(full(key));
    auto body = call(req, "erase", key, conn_->options.timeout);
    detail::ByteReader r(body, "store reply");
    return r.get<std::uint8_t>() != 0;
  }

  /// When this process's connection to the store closes before clear_on_close() (it died, was
  /// killed, or exited), the server sets each key of `keys` (under this view's prefix) that does
  /// not exist to its value: a dead man's switch, with which a rendezvous learns at once of a rank
  /// that died. One set per connection; a later call replaces it.
  void set_on_close(std::span<const std::pair<std::string, std::string>> keys) {
    std::string req = header(Op::on_close);
    detail::ByteWriter w(req);
    w.put(static_cast<std::uint32_t>(keys.size()));
    for (const auto& [k, v] : keys) {
      w.str(full(k));
      w.str(v);
    }
    (void)call(req, "set_on_close", keys.empty() ? std::string_view{} : keys.front().first,
               conn_->options.timeout);
  }
  /// Cancels set_on_close().
  void clear_on_close() { set_on_close({}); }

  /// A lease on this connection (shared by every view of it): a thread of this process sends a
  /// sign of life every ttl / 5; when none reaches the server for `ttl` (the process is stopped,
  /// hung or cut off), the server acts as if the connection closed (the set_on_close() records)
  /// and applies `on_expire`, and the connection stays open, so that a process that wakes can
  /// still read why it was left out. A later call replaces it (and re-arms an expired one); a
  /// `ttl` of 0 ends it.
  void lease(std::chrono::milliseconds ttl, std::span<const LeaseRecord> on_expire = {}) {
    std::string req = header(Op::lease);
    detail::ByteWriter w(req);
    w.put(static_cast<std::uint64_t>(std::max<std::int64_t>(0, ttl.count())));
    w.put(static_cast<std::uint32_t>(on_expire.size()));
    for (const LeaseRecord& r : on_expire) {
      w.put(static_cast<std::uint8_t>(r.is_add ? 1 : 0));
      w.str(full(r.key));
      w.str(r.value);
      w.put(r.add);
    }
    (void)call(req, "lease", on_expire.empty() ? std::string_view{} : on_expire.front().key,
               conn_->options.timeout);
    conn_->start_heartbeat(ttl);
  }

  /// Runs `tick` on the lease's thread after each sign of life (every ttl / 5), with a view of
  /// this store whose calls never wait for another thread's call (soft()); returns a number for
  /// remove_tick(). A tick must not remove itself.
  std::uint64_t add_tick(std::function<void(Store&)> tick) {
    std::lock_guard lock(conn_->tick_mutex);
    conn_->ticks.emplace(++conn_->next_tick, std::move(tick));
    return conn_->next_tick;
  }
  /// Removes a tick; once it returns, that tick does not run (any more).
  void remove_tick(std::uint64_t id) {
    std::lock_guard lock(conn_->tick_mutex);
    conn_->ticks.erase(id);
  }
  /// A view whose calls fail at once (Errc::timeout) instead of waiting while another thread's
  /// call holds the connection.
  [[nodiscard]] Store soft() const {
    Store s(*this);
    s.soft_ = true;
    return s;
  }

  /// Whether every key exists, without waiting.
  [[nodiscard]] bool check(std::span<const std::string> keys) {
    std::string req = header(Op::check);
    detail::ByteWriter w(req);
    w.put(static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) w.str(full(k));
    auto body = call(req, "check", {}, conn_->options.timeout);
    detail::ByteReader r(body, "store reply");
    return r.get<std::uint8_t>() != 0;
  }

  /// The keys of `keys` that are missing from the store after waiting up to `timeout`; empty when
  /// all appeared. Unlike wait(), reports instead of throwing.
  /// A watched key that appears meanwhile throws its error, whatever its code (Errc::timeout
  /// included: a rank that timed out elsewhere), never mistaken for this wait's own timeout.
  [[nodiscard]] std::vector<std::string> missing_after(std::span<const std::string> keys,
                                                       std::chrono::milliseconds timeout) {
    if (wait_for(keys, timeout, true)) return {};
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!check(std::span<const std::string>(&k, 1))) missing.push_back(k);
    }
    return missing;
  }

 private:
  using Op = detail::store_proto::Op;
  using Status = detail::store_proto::Status;

  /// The lease's thread and what it shares with it (Store::lease). The thread holds this and a
  /// weak reference to its connection: it never keeps the connection alive between beats.
  struct Beat {
    std::mutex mutex;
    std::condition_variable wake;
    std::chrono::milliseconds period{0};
    bool stop = false;
  };

  struct Connection {
    Connection(std::string h, int p, StoreOptions o)
        : host(std::move(h)), port(p), options(std::move(o)) {}
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;
    ~Connection() {
      if (!heartbeat.joinable()) return;
      {
        std::lock_guard lock(beat->mutex);
        beat->stop = true;
      }
      beat->wake.notify_all();
      // A fork() child's copy has no such thread; the thread itself may drop the last view.
      if (detail::fork_generation() != made_in || heartbeat.get_id() == std::this_thread::get_id())
        heartbeat.detach();
      else
        heartbeat.join();
    }
    std::string host;
    int port;
    StoreOptions options;
    std::mutex mutex;        // one call at a time
    std::mutex write_mutex;  // one frame written at a time (a call's, or a sign of life), and fd
    detail::Fd fd;
    std::uint64_t next_request = 1;
    std::string dead;  // why the store is known gone: no call waits on it again
    std::weak_ptr<Connection> self;
    // The lease: its thread, and the ticks it runs after each sign of life.
    std::shared_ptr<Beat> beat = std::make_shared<Beat>();
    std::thread heartbeat;
    std::uint64_t made_in = detail::fork_generation();
    std::mutex tick_mutex;
    std::map<std::uint64_t, std::function<void(Store&)>> ticks;
    std::uint64_t next_tick = 0;

    void start_heartbeat(std::chrono::milliseconds ttl) {
      {
        std::lock_guard lock(beat->mutex);
        beat->period = ttl / 5;
      }
      beat->wake.notify_all();
      if (heartbeat.joinable() || ttl.count() <= 0) return;
      heartbeat = std::thread([b = beat, w = self] { beating(b, w); });
    }

    /// The lease's thread: a sign of life, then the ticks, every period, while the connection
    /// lives (reached through `w` only while it works).
    static void beating(const std::shared_ptr<Beat>& b, const std::weak_ptr<Connection>& w) {
      for (;;) {
        {
          std::unique_lock lock(b->mutex);
          if (b->period.count() <= 0)
            b->wake.wait(lock, [&] { return b->stop || b->period.count() > 0; });
          if (b->stop || b->wake.wait_for(lock, b->period, [&] { return b->stop; })) return;
        }
        std::shared_ptr<Connection> me = w.lock();
        if (!me) return;
        me->keepalive();
        me->run_ticks(me);
      }  // `me` dropped last: should it hold the last reference, ~Connection detaches this thread
    }

    /// One sign of life, whole or not at all: it never blocks behind a full socket buffer (the
    /// server is then not reading: a sign of life changes nothing), and a frame begun is ended,
    /// so the stream stays whole.
    void keepalive() {
      std::lock_guard lock(write_mutex);
      if (!fd) return;
      char frame[13] = {9, 0, 0, 0, static_cast<char>(detail::store_proto::Op::keepalive)};
      std::size_t sent = 0;
      while (sent < sizeof frame) {
        const ssize_t n = ::send(fd.get(), frame + sent, sizeof frame - sent,
                                 MSG_NOSIGNAL | (sent == 0 ? MSG_DONTWAIT : 0));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;  // full (nothing sent), or broken: the next call finds out
        sent += static_cast<std::size_t>(n);
      }
    }

    void run_ticks(const std::shared_ptr<Connection>& me) {
      Store soft_view(me);
      soft_view.soft_ = true;
      std::lock_guard lock(tick_mutex);
      for (auto& [id, tick] : ticks) {
        try {
          tick(soft_view);
        } catch (...) {  // a tick's failure is its own business; the next tick tries again
        }
      }
    }

    void ensure() {
      if (!dead.empty()) {
        detail::fail(Errc::peer_lost, "the rendezvous store at ", detail::host_port(host, port),
                     " is gone (", dead, "); not waiting for it again");
      }
      if (!fd) connect();
    }

    /// Connects, and retries a few times when the server closes the connection during the
    /// handshake (it closes the oldest unauthenticated connections when strangers flood it).
    void connect() {
      for (int attempt = 1;; ++attempt) {
        try {
          connect_once();
          return;
        } catch (const Error& e) {
          if (e.code() != Errc::peer_lost || attempt >= 8) throw;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10 << std::min(attempt, 6)));
      }
    }

    void connect_once() {
      namespace sp = detail::store_proto;
      const auto deadline = detail::Deadline::after(options.timeout);
      const std::string where = detail::host_port(host, port);
      fd = detail::connect_tcp(host, port, deadline, "the rendezvous store");
      std::string frame;
      const auto io = [&](detail::IoResult r, std::string_view step) {
        if (r == detail::IoResult::ok) return;
        fd.reset();
        if (r == detail::IoResult::timeout) {
          detail::fail(Errc::timeout, "rendezvous store at ", where, ": no ", step,
                       " before the timeout: the process there accepted the connection but did "
                       "not answer (a store whose process is stopped or overloaded, or another "
                       "program: check MASTER_ADDR/MASTER_PORT)");
        }
        detail::fail(Errc::peer_lost, "rendezvous store at ", where,
                     " closed the connection during the ", step,
                     "; is something else listening on that port?");
      };
      try {
        io(sp::recv_frame(fd.get(), frame, sp::handshake_frame_limit, deadline, "store hello"),
           "hello");
      } catch (const Error& e) {
        if (e.code() != Errc::protocol) throw;
        fd.reset();
        detail::fail(Errc::protocol, "rendezvous store at ", where, " is not a ddp store (",
                     e.what(), "); check MASTER_ADDR/MASTER_PORT: another program listens there");
      }
      detail::ByteReader r(frame, "store hello");
      if (r.get<std::uint32_t>() != sp::magic) {
        fd.reset();
        detail::fail(Errc::protocol, where, " is not a ddp rendezvous store (bad magic)");
      }
      const auto v = r.get<std::uint16_t>();
      const bool auth_required = r.get<std::uint8_t>() != 0;
      sp::Nonce server_nonce{};
      r.raw(server_nonce.data(), server_nonce.size());
      if (v != sp::version) {
        fd.reset();
        detail::fail(Errc::protocol, "rendezvous store at ", where, " speaks protocol ", v,
                     ", this client ", sp::version);
      }
      if (!options.token.empty() && !auth_required) {
        fd.reset();
        detail::fail(
            Errc::unauthorized, "rendezvous store at ", where,
            " does not require a token but this process has one (DDP_TOKEN): refusing to talk "
            "to a store that cannot prove it knows the token");
      }
      sp::Nonce client_nonce{};
      detail::random_bytes(client_nonce.data(), client_nonce.size());
      const auto mac = options.token.empty() ? detail::Digest{}
                                             : detail::hmac_sha256(options.token, sp::client_label,
                                                                   sp::as_view(server_nonce),
                                                                   sp::as_view(client_nonce));
      std::string auth;
      detail::ByteWriter w(auth);
      w.put(sp::magic);
      w.put(sp::version);
      w.raw(client_nonce.data(), client_nonce.size());
      w.raw(mac.data(), mac.size());
      w.put(static_cast<std::int32_t>(options.refusal_rank));
      w.str(std::string_view(options.refusal_key).substr(0, sp::refusal_key_limit));
      io(sp::send_frame(fd.get(), auth, deadline), "handshake");
      io(sp::recv_frame(fd.get(), frame, sp::handshake_frame_limit, deadline,
                        "store handshake reply"),
         "handshake reply");
      detail::ByteReader rr(frame, "store handshake reply");
      const auto status = rr.get<sp::HandshakeStatus>();
      if (status == sp::HandshakeStatus::unauthorized) {
        fd.reset();
        detail::fail(Errc::unauthorized, "rendezvous store at ", where, " refused this process: ",
                     options.token.empty()
                         ? "it requires a token; set DDP_TOKEN to the job's secret"
                         : "wrong token; every rank must have the same DDP_TOKEN");
      }
      if (status != sp::HandshakeStatus::ok) {
        fd.reset();
        detail::fail(Errc::protocol, "rendezvous store at ", where,
                     " refused the handshake (version)");
      }
      detail::Digest proof{};
      rr.raw(proof.data(), proof.size());
      if (!options.token.empty()) {
        const auto expected = detail::hmac_sha256(
            options.token, sp::server_label, sp::as_view(client_nonce), sp::as_view(server_nonce));
        if (!detail::constant_time_equal(expected, proof)) {
          fd.reset();
          detail::fail(Errc::unauthorized, "rendezvous store at ", where,
                       " could not prove it knows DDP_TOKEN: refusing to use it");
        }
      }
    }
  };

  explicit Store(std::shared_ptr<Connection> c) : conn_(std::move(c)) {}

  [[nodiscard]] std::string full(std::string_view key) const { return prefix_ + std::string(key); }

  /// wait(); with `report_timeout`, returns false at the timeout instead of throwing it.
  bool wait_for(std::span<const std::string> keys, std::chrono::milliseconds timeout,
                bool report_timeout) {
    timeout = capped(timeout);
    std::string req = header(Op::wait);
    detail::ByteWriter w(req);
    w.put(static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) w.str(full(k));
    w.put(static_cast<std::uint64_t>(timeout.count()));
    w.str(stop_);
    bool timed_out = false;
    (void)call(req, "wait", keys.empty() ? std::string_view{} : std::string_view(keys.front()),
               timeout, report_timeout ? &timed_out : nullptr);
    return !timed_out;
  }

  /// `timeout`, shortened to end by this view's deadline.
  [[nodiscard]] std::chrono::milliseconds capped(std::chrono::milliseconds timeout) const {
    if (deadline_ == detail::Clock::time_point::max()) return timeout;
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline_ - detail::Clock::now());
    return std::clamp(left, std::chrono::milliseconds(0), timeout);
  }

  std::string header(Op op) {
    std::string req;
    detail::ByteWriter w(req);
    w.put(op);
    w.put(std::uint64_t{0});  // request id, filled in by call()
    return req;
  }

  /// Sends a request and returns the reply's body. `timed_out`, when given, is set instead of
  /// throwing when the server answers that the wait timed out.
  std::string call(std::string& req, std::string_view what, std::string_view key,
                   std::chrono::milliseconds timeout, bool* timed_out = nullptr) {
    namespace sp = detail::store_proto;
    std::unique_lock lock(conn_->mutex, std::defer_lock);
    if (!soft_)
      lock.lock();
    else if (!lock.try_lock())
      detail::fail(Errc::timeout, "store ", what, ": the connection is busy with another call");
    conn_->ensure();
    const std::uint64_t id = conn_->next_request++;
    for (std::size_t i = 0; i < 8; ++i) req[1 + i] = static_cast<char>((id >> (8 * i)) & 0xffu);
    // The server answers waits itself at their deadline; allow it some slack before giving up on
    // the connection (within a view's deadline, half a second: a rendezvous has one timeout).
    auto deadline = detail::Deadline::after(timeout + std::chrono::seconds(5));
    if (deadline_ != detail::Clock::time_point::max())
      deadline.at = std::min(deadline.at, deadline_ + std::chrono::milliseconds(500));
    const std::string where = detail::host_port(conn_->host, conn_->port);
    const auto lost = [&](detail::IoResult r) {
      {
        std::lock_guard w(conn_->write_mutex);
        conn_->fd.reset();
      }
      if (r == detail::IoResult::timeout) {
        conn_->dead = "it did not answer a call before the timeout";
        detail::fail(Errc::timeout, "store ", what, "(\"", prefix_, key, "\"): the store at ",
                     where, " did not answer before the timeout");
      }
      conn_->dead = "it closed the connection";
      detail::fail(Errc::peer_lost, "store ", what, "(\"", prefix_, key, "\"): the store at ",
                   where, " closed the connection (did rank 0 or the launcher exit?)");
    };
    detail::IoResult sent;
    {
      std::lock_guard w(conn_->write_mutex);
      sent = sp::send_frame(conn_->fd.get(), req, deadline);
    }
    if (sent != detail::IoResult::ok) lost(sent);
    std::string frame;
    for (;;) {
      if (auto r = sp::recv_frame(conn_->fd.get(), frame, sp::frame_limit(conn_->options), deadline,
                                  "store reply");
          r != detail::IoResult::ok) {
        lost(r);
      }
      detail::ByteReader r(frame, "store reply");
      const auto status = r.get<Status>();
      const auto reply_id = r.get<std::uint64_t>();
      if (reply_id != id) continue;  // a reply to a request abandoned earlier
      std::string body(r.view(r.left()));
      if (status == Status::ok) return body;
      if (status == Status::stopped) {
        detail::ByteReader br(body, "store stop reply");
        const std::string value = br.str(body.size());
        detail::ByteReader vr(value, "stop value");
        if (value.size() >= 8) {
          const auto code = vr.get<std::int32_t>();
          if (code >= 1 && code <= static_cast<std::int32_t>(Errc::unsupported)) {
            const std::string message = vr.str(value.size());
            detail::fail(static_cast<Errc>(code), message);
          }
        }
        detail::fail(Errc::aborted, "store ", what, "(\"", prefix_, key, "\"): stopped by \"",
                     stop_, "\": ", value);
      }
      if (status == Status::timeout && timed_out != nullptr) {
        *timed_out = true;
        return {};
      }
      if (status == Status::timeout) {
        detail::ByteReader br(body, "store timeout reply");
        const auto n = br.get<std::uint32_t>();
        std::string missing;
        for (std::uint32_t i = 0; i < n && i < 16; ++i) {
          missing += (i ? ", \"" : "\"") + br.str(body.size()) + "\"";
        }
        if (n > 16) missing += detail::concat(" and ", n - 16, " more");
        detail::fail(Errc::timeout, "store ", what, ": timed out after ", timeout.count(),
                     " ms waiting for ", missing);
      }
      detail::ByteReader br(body, "store error reply");
      detail::fail(Errc::protocol, "store ", what, "(\"", prefix_, key,
                   "\") failed: ", br.view(br.left()));
    }
  }

  std::shared_ptr<Connection> conn_;
  std::string prefix_;
  std::string stop_;   // full key that ends get/wait early (watching())
  bool soft_ = false;  // soft(): a call never waits for another thread's
  detail::Clock::time_point deadline_ = detail::Clock::time_point::max();  // with_deadline()
};

DDP_END_NAMESPACE
