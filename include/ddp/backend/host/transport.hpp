// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The interface between the Host backend's algorithms and its transports (shared memory, TCP).
///
/// A collective is a sequence of *rounds*. In a round every rank offers some bytes (a list of
/// pieces, concatenated), and every rank reads parts of other ranks' offers: want(src, dst) is
/// the byte range of src's offer that dst reads, and every rank can compute it for every pair.
/// round() returns, for each rank j, a pointer to want(j, me) within j's offer — straight into
/// j's shared-memory slot, or into a scratch buffer the TCP transport received it into. The
/// pointers stay valid until the next round. The first round of each collective carries the
/// collective's fingerprint, which every transport compares across all ranks before any data is
/// used, so ranks that call different collectives fail together with Errc::mismatch.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// A non-owning reference to a callable (no allocation, unlike std::function).
template <class Sig>
class FunctionRef;
template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> &&
             std::is_invocable_r_v<R, F&, Args...>)
  FunctionRef(F&& f)
  noexcept  // NOLINT(google-explicit-constructor)
      : obj_(const_cast<void*>(static_cast<const void*>(&f))), call_([](void* o, Args... a) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(a...);
        }) {}
  R operator()(Args... a) const { return call_(obj_, a...); }

 private:
  void* obj_;
  R (*call_)(void*, Args...);
};

/// One part of a rank's offer.
struct Piece {
  const std::byte* data = nullptr;
  std::size_t len = 0;
};

using Want = FunctionRef<Range(int src, int dst)>;

/// The header that precedes every point-to-point message (both transports). `kind` sits where a
/// collective's Fingerprint has its `coll`, and holds a value no Coll has: over TCP, where a
/// pair's collectives and messages share one stream, a send that no receive took is named as
/// such by the next collective's fingerprint check, and a collective met by a receive too.
struct P2PHeader {
  static constexpr std::uint8_t p2p = 0xEE;  ///< `kind` of a point-to-point message
  std::uint64_t seq;
  std::uint64_t count;
  std::int32_t tag;
  std::uint8_t kind;  ///< p2p
  DType dtype;
  std::uint8_t pad[2];
};
static_assert(sizeof(P2PHeader) == sizeof(Fingerprint) &&
              offsetof(P2PHeader, kind) == offsetof(Fingerprint, coll));

/// The first failure of a transport, kept so that every later call fails the same way.
struct Poison {
  Errc code{};
  std::string message;
};

class Transport {
 public:
  Transport(int rank, int size, std::chrono::milliseconds timeout);
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  virtual ~Transport() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// The communicator's rank of this transport's rank j, for messages: a transport may connect
  /// a group of the communicator's ranks (the hierarchical all_reduce's, see backend/host.hpp),
  /// numbered 0..size()-1 within the group. Empty: the numbers are the communicator's.
  std::vector<int> global_ranks;
  [[nodiscard]] int global(int j) const;

  /// Extra time the waits of the next rounds allow beyond timeout(): the hierarchical
  /// all_reduce's later phases wait for an earlier phase's failure (which comes at the timeout)
  /// to reach them, instead of timing out at the same moment and naming the wrong rank.
  std::chrono::milliseconds slack{0};

  /// Why ranks left, where they record it (the hierarchical all_reduce, through the store): given
  /// the communicator's ranks whose connections closed or that a round still waits for at its
  /// timeout, and how long to wait for a record, the first rank that recorded one with its
  /// error; nothing when none did (a rank that died records nothing).
  struct Left {
    int rank = -1;
    Errc code{};
    std::string message;
    /// Where the failure it recorded started, when another rank's (its record relays that
    /// rank's): the rank and its own words; and the ranks that failure found lost.
    int origin = -1;
    std::string origin_message;
    std::vector<int> lost;
    /// It finished: destroyed its communicator without a failure, after `operations` calls.
    bool finished = false;
    std::uint64_t operations = 0;
  };
  std::function<std::optional<Left>(const std::vector<int>&, std::chrono::milliseconds)> why_left;

  /// Name for messages: "shm" or "tcp".
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  /// The most bytes one rank may offer in one round.
  [[nodiscard]] virtual std::size_t max_offer() const noexcept = 0;
  /// Below this many bytes, all_reduce gathers whole buffers in one round (latency path).
  [[nodiscard]] virtual std::size_t small_bytes() const noexcept = 0;

  /// Whether rounds compare fingerprints (Options::verify_collectives; the same on every rank).
  /// Without it `fp` still names the collective in messages.
  bool verify_fingerprints = true;

  /// The collective in progress (set by the backend as each one starts), so that a failure in
  /// any of its rounds, not only the first, names it and its sequence number.
  Fingerprint current{};
  bool has_current = false;

  /// What failed, for messages: the round's fingerprint, else `what` (point-to-point), else the
  /// collective in progress.
  [[nodiscard]] std::string describe(const Fingerprint* fp, const char* what) const;

  /// One round (see the file comment). `fp` is non-null on a collective's first round.
  virtual std::span<const std::byte* const> round(std::span<const Piece> offer, Want want,
                                                  const Fingerprint* fp) = 0;

  /// Memory that may hold part of the next round's offer, so that data can be produced in place
  /// instead of copied there (the shared-memory slot of the next round); nullptr when the
  /// transport has none or `bytes` does not fit. Valid until the next round.
  [[nodiscard]] virtual std::byte* stage(std::size_t /*bytes*/) { return nullptr; }

  /// Single copy: the smallest all_reduce, in bytes, that copies straight out of the peers'
  /// memory with copy_from instead of through rounds (the same on every rank); none by default.
  [[nodiscard]] DDP_INLINE virtual std::size_t single_copy_from() const noexcept;
  /// Copies `len` bytes at address `addr` of rank j's process into `dst` (single copy). Fails
  /// with Errc::peer_lost (or the error the peer left with) when rank j's memory is gone.
  DDP_INLINE virtual void copy_from(int j, std::uint64_t /*addr*/, std::byte* /*dst*/,
                                    std::size_t /*len*/, const Fingerprint* fp);

  /// Point-to-point, matched in order per pair; the receiver checks tag, dtype and count.
  virtual void send(const Buf& buf, int peer, int tag, std::uint64_t seq) = 0;
  virtual void recv(const Buf& buf, int peer, int tag, std::uint64_t seq) = 0;

  /// Makes every current and future wait of this process (and, where the transport can, of its
  /// peers) fail with `code`. Safe to call from any thread.
  virtual void abort(Errc code, const std::string& why) = 0;
  /// abort() for a failure `e` this rank found or learned of: where the transport tells its
  /// peers, they learn e's words, the rank that found it and the ranks it found lost.
  virtual void abort_with(const Error& e) { abort(e.code(), e.what()); }

 protected:
  /// "rank R: <what>: mismatched collectives: this rank called X but rank P called Y; ..."
  [[nodiscard]] std::string mismatch_message(const Fingerprint& mine, int peer,
                                             const Fingerprint& theirs) const;

  /// What recv expects from `peer`, as in messages: "recv(from rank 1, tag 7, float32, count=3)".
  [[nodiscard]] static std::string recv_description(const Buf& buf, int peer, int tag);

  /// Empty when the header is the send that matches this recv, else the error message.
  [[nodiscard]] std::string p2p_mismatch(const Buf& buf, int peer, int tag, std::uint64_t seq,
                                         const P2PHeader& h) const;

  /// Fails with the error a rank among `ranks` (this transport's numbers) recorded when it left
  /// (why_left), waiting up to `grace` for one; returns when none did.
  void fail_if_left(const std::vector<int>& ranks, std::chrono::milliseconds grace,
                    const Fingerprint* fp, const char* what) const;

  /// Fails with the failure `left` recorded, naming the rank it started on (the first one in a
  /// chain of relays: Left::origin) and quoting that rank's words.
  [[noreturn]] void fail_reported(const Left& left, const Fingerprint* fp, const char* what) const;

  /// Records abort() on this rank.
  void set_local_abort(Errc code) noexcept { local_abort_code_.store(static_cast<int>(code)); }

  /// Throws if abort() was called on this rank.
  void check_local_abort(const Fingerprint* fp) const;

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;

 private:
  std::atomic<int> local_abort_code_{0};
};

/// The transport of a world of one: every round returns the rank's own offer.
class SelfTransport final : public Transport {
 public:
  explicit SelfTransport(std::chrono::milliseconds timeout);
  [[nodiscard]] std::string_view name() const noexcept override { return "self"; }
  [[nodiscard]] DDP_INLINE std::size_t max_offer() const noexcept override;
  [[nodiscard]] DDP_INLINE std::size_t small_bytes() const noexcept override;

  DDP_INLINE std::span<const std::byte* const> round(std::span<const Piece> offer, Want want,
                                                     const Fingerprint*) override;
  void send(const Buf&, int, int, std::uint64_t) override {
    fail(Errc::invalid_argument, "rank 0: send: a world of one has no peer to send to");
  }
  void recv(const Buf&, int, int, std::uint64_t) override {
    fail(Errc::invalid_argument, "rank 0: recv: a world of one has no peer to receive from");
  }
  void abort(Errc, const std::string&) override {}

  /// Where byte `r.off` of the concatenated pieces lives (the range must lie in one piece).
  static const std::byte* locate(std::span<const Piece> offer, Range r);

 private:
  const std::byte* ptr_ = nullptr;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/transport.ipp"
#endif
