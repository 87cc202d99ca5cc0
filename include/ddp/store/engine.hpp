// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::StoreEngine: the rendezvous store's protocol and data, free of I/O: the handshake,
/// the limits, the operations, and waits answered or timed out by the server. StoreServer
/// (store/server.hpp) feeds it the bytes of its connections. See ddp/store.hpp for what makes the
/// store safe to expose.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/store/protocol.hpp"
#include "ddp/store/refusals.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {

/// The store server's protocol and data, free of I/O ("sans-IO"): StoreServer feeds it the bytes
/// each connection sends and writes out what it queues; the frame-parser fuzzer
/// (tests/fuzz/fuzz_store.cpp) drives it directly. Single-threaded.
class StoreEngine {
 public:
  struct Session {
    std::string peer;
    bool authed = false;
    store_proto::Nonce nonce{};
    Clock::time_point accepted;
    std::string in;             // bytes of the frame being read (length prefix included)
    std::size_t frame_len = 0;  // 0 while the prefix is incomplete
    std::string out;            // output not yet sent
    std::size_t out_sent = 0;
    bool close_after_write = false;  // close once `out` is sent
    bool closed = false;             // close now; pending output is discarded
    std::vector<std::pair<std::string, std::string>> on_close;  // set (if absent) when it closes
    // A lease (Op::lease): when nothing arrives for `lease`, on_close and on_expire apply.
    std::chrono::milliseconds lease{0};
    Clock::time_point heard{};  // when the last bytes arrived
    bool expired = false;
    std::vector<LeaseRecord> on_expire;
  };

  /// Output a connection may have pending before the server stops reading its requests (a
  /// client that pipelines requests and never reads the replies cannot make the server buffer
  /// more than this plus one reply).
  static constexpr std::size_t backlog_limit = std::size_t{1} << 20;

  /// `options.log` must be set.
  explicit StoreEngine(StoreOptions options);

  [[nodiscard]] const StoreOptions& options() const noexcept { return options_; }
  [[nodiscard]] std::uint64_t refused() const noexcept { return refusals_.count(); }
  [[nodiscard]] std::map<std::uint64_t, Session>& sessions() noexcept { return sessions_; }
  [[nodiscard]] Session* session(std::uint64_t id);
  [[nodiscard]] std::size_t keys() const noexcept { return data_.size(); }

  /// A new connection from `peer`: queues the server's hello and returns the session's id, or
  /// 0 (logged) when the server already has max_connections authenticated clients. Connections
  /// that have not authenticated share a small budget (max_pending_handshakes): a new one closes
  /// the oldest of them rather than be refused, so a flood of idle connections cannot keep a
  /// real rank from connecting (it authenticates within one round trip).
  std::uint64_t open(std::string peer, Clock::time_point now);

  /// Whether the server should read more from a session: open, not refused, and its pending
  /// output under backlog_limit.
  [[nodiscard]] static bool readable(const Session& s) noexcept {
    return !s.closed && !s.close_after_write && s.out.size() - s.out_sent < backlog_limit;
  }

  /// The bytes up to the end of the frame being read (or of its length prefix): the server reads
  /// no further, so it can stop between requests when a client's backlog is full.
  [[nodiscard]] static std::size_t wanted(const Session& s) noexcept {
    return s.frame_len != 0 ? s.frame_len + 4 - s.in.size() : 4 - s.in.size();
  }

  /// Consumes bytes a connection sent, any amount, frame by frame. Only the current frame is
  /// buffered and only as far as it has arrived, so memory follows the bytes actually sent, never
  /// a length someone claims. A malformed frame closes the session (logged).
  void receive(std::uint64_t id, std::string_view bytes, Clock::time_point now);

  /// The peer closed (EOF, reset or broken pipe). A connection that never sent a byte of a
  /// handshake is stray traffic and is logged.
  void peer_closed(std::uint64_t id);

  /// Answers the waits whose deadline passed (Status::timeout with the missing keys) and drops
  /// the connections that did not finish the handshake in time.
  void expire(Clock::time_point now);

  /// The earliest of `limit`, the waits' deadlines and the handshake deadlines.
  [[nodiscard]] Clock::time_point next_deadline(Clock::time_point limit) const;

  /// Forgets the closed sessions and their waits.
  void reap();

  /// Marks every session closed (the server stops).
  void close_all();

 private:
  using Op = store_proto::Op;
  using Status = store_proto::Status;

  struct Waiter {
    std::uint64_t conn;
    std::uint64_t request;
    std::vector<std::string> keys;
    Clock::time_point deadline;
    bool is_get;
    std::string stop;  // answer Status::stopped as soon as this key exists (empty: none)
  };

  /// Counts and logs a refusal that has no session (e.g. the server ran out of descriptors).
 public:
  void note_refusal(std::string_view why) { refuse("a client", why); }

 private:
  /// Counts and logs a refusal (store/refusals.hpp: rate-limited).
  void refuse(const std::string& peer, std::string_view why) {
    refusals_.refuse(options_, peer, why);
  }

  /// Closes the connection that has waited longest without authenticating.
  void evict_oldest_pending();

  /// A client whose token was wrong said which rendezvous it meant to join: its ranks fail at
  /// once, told why (the key is set only when absent, to the server's own message).
  void publish_refusal(const std::string& peer, std::int32_t rank, const std::string& key);

  void drop(Session& s, std::string_view why);

  static void queue_frame(Session& s, std::string_view payload);

 public:
  /// Empties a buffer, giving its memory back when it held a large frame.
  static void release(std::string& buf);

 private:
  /// Checks a complete length prefix before a byte of the frame is buffered.
  bool read_length(Session& s);

  void handshake(Session& s, std::string_view frame);

  /// Queues a reply: status, request id, `body`, then `value` as a string when given (written
  /// straight into the output: a large value is not copied twice).
  static void reply(Session& s, std::uint64_t request, Status status, std::string_view body = {},
                    const std::string* value = nullptr);

  void handle(std::uint64_t id, Session& s, std::string_view frame, Clock::time_point now);

  /// A session's on_close records, once (then forgotten: a key erased since must not come back
  /// when a connection that expired closes later). Returns whether a key was set.
  bool apply_on_close(Session& s);

  /// One lease record: set the key when absent, or add to its counter.
  bool apply(const LeaseRecord& r);

  bool store_value(const std::string& k, std::string v);

  /// Replies to a get/wait if its stop key or all its keys are present; returns whether it did.
  bool try_answer(Session& s, const Waiter& wt);

  void wake_waiters();

  StoreOptions options_;
  RefusalLog refusals_;
  std::map<std::uint64_t, Session> sessions_;
  std::uint64_t next_id_ = 1;
  std::vector<Waiter> waiters_;
  std::unordered_map<std::string, std::string> data_;
  std::size_t total_bytes_ = 0;
};

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/engine.ipp"
#endif
