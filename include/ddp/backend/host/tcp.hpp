// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The TCP transport of the Host backend (ranks on several hosts, or DDP_HOST_TRANSPORT=tcp).
///
/// A full mesh of connections, made at start-up: every rank listens on the interface that
/// reaches the store, publishes its address there, connects to lower ranks and accepts higher
/// ones; a connection must present the communicator's session key (a random value shared through
/// the store, which DDP_TOKEN protects) or it is dropped. A round sends, to each peer at once,
/// the part of this rank's offer it wants and receives what this rank wants, progressing every
/// socket with poll() until done, the timeout, or a failure. The first round of a collective
/// starts each message with the sender's fingerprint, checked before any data is used.

#include "ddp/backend/host/transport.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/detail/wait.hpp"
#include "ddp/error.hpp"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

class TcpTransport final : public Transport {
 public:
  static constexpr std::uint32_t hello_magic = 0x50434444;  // "DDCP"
  using SessionKey = std::array<std::uint8_t, 16>;

  /// `local_ranks`: how many ranks run on this machine (more than its cores: busy waits yield).
  TcpTransport(int rank, int size, std::chrono::milliseconds timeout, std::vector<Fd> peers,
               std::size_t segment_bytes, int local_ranks);

  /// Builds the mesh: connect to ranks below, accept ranks above (see the file comment).
  /// `reach_window` (BackendInit::reach_window): when not 0, the ranks below are connected to
  /// at once, and those not reached within it fail the mesh with Errc::peer_lost, listed in
  /// the error's lost_ranks().
  [[nodiscard]] static std::vector<Fd> connect_mesh(
      int rank, int size, Fd& listener, const std::vector<std::pair<std::string, int>>& addrs,
      const SessionKey& key, Deadline deadline, const std::function<void()>& check_stop = {},
      std::chrono::milliseconds reach_window = {});

  [[nodiscard]] std::string_view name() const noexcept override { return "tcp"; }
  [[nodiscard]] std::size_t max_offer() const noexcept override { return segment_; }
  [[nodiscard]] DDP_INLINE std::size_t small_bytes() const noexcept override;

  DDP_INLINE std::span<const std::byte* const> round(std::span<const Piece> offer, Want want,
                                                     const Fingerprint* fp) override;

  DDP_INLINE void send(const Buf& buf, int peer, int tag, std::uint64_t seq) override;

  DDP_INLINE void recv(const Buf& buf, int peer, int tag, std::uint64_t seq) override;

  DDP_INLINE void abort(Errc code, const std::string&) override;

 private:
  struct Seg {
    std::byte* p;
    std::size_t n;
  };
  /// Points iov_ at the unfinished segments from (i, off) on; returns how many it filled.
  std::size_t gather(const std::vector<Seg>& segs, std::size_t i, std::size_t off);

  /// Moves (i, off) forward by n bytes over segs, past any empty segments.
  static void advance(const std::vector<Seg>& segs, std::size_t& i, std::size_t& off,
                      std::size_t n);

  struct Xfer {
    std::vector<Seg> out, in;
    std::size_t out_i = 0, out_off = 0, in_i = 0, in_off = 0;
    bool header_in = false;
    void clear();
    [[nodiscard]] bool out_done() const { return out_i == out.size(); }
    [[nodiscard]] bool in_done() const { return in_i == in.size(); }
  };
  /// Connects to every rank below `rank` at once and introduces itself, until `window`:
  /// the connections, empty where the rank could not be reached. Another rank's failure does
  /// not cut it short, so that every rank reports every peer it cannot reach.
  static std::vector<Fd> connect_below(int rank,
                                       const std::vector<std::pair<std::string, int>>& addrs,
                                       const SessionKey& key, Deadline window);

  /// Shuts every connection down, so that peers blocked on this rank fail at once.
  void poison() {
    for (auto& fd : peers_) {
      if (fd) ::shutdown(fd.get(), SHUT_RDWR);
    }
  }

  void check_abort(const Fingerprint* fp) const { check_local_abort(fp); }

  /// The connection to `peer` failed. A mismatch explains more than a lost peer (the peer may
  /// have left because it saw the mismatch first), so during a collective's first round this
  /// rank collects the fingerprints still on their way, from every peer, for a short while, and
  /// reports a mismatch if one shows. The other connections stay open: every survivor sees a
  /// dead peer itself (full mesh), and closing them would make the survivors blame this rank.
  /// A survivor that failed first may have exited already, so every connection found closed is
  /// named: the rank that died is among them.
  [[noreturn]] void lost(int peer, const Fingerprint* fp, const char* what);

  /// Moves what the socket takes (out) or has (in) of peer j's outstanding bytes, without
  /// waiting; the header and payload go in one system call.
  void pump(int j, bool out, const Fingerprint* fp, const char* what);

  /// One non-blocking pass over every unfinished transfer; true when all are done.
  bool pump_all(const Fingerprint* fp, const char* what);

  /// Moves this round's bytes. Sockets are tried at once (they usually take the data without a
  /// wait), then polled without sleeping for a few tens of microseconds (a peer on another core
  /// answers within that: sleeping in poll() and being woken costs more than the whole round),
  /// then waited for with poll() until done, the timeout, or a failure. With more ranks on this
  /// host than cores the awaited rank may need this very core, so the busy phase yields it.
  void progress(const Fingerprint* fp, const char* what);

  /// Reads the outstanding fingerprints of this round (only those) until all are in or the
  /// deadline passes; throws Errc::mismatch if one differs from ours.
  void collect_headers(const Fingerprint& mine, Deadline deadline);

  void check_header(int peer, const Fingerprint& mine);

  /// Finishes sending this round's fingerprint to every peer (best effort, briefly), so that each
  /// of them sees the mismatch too instead of waiting for a header that never comes. The
  /// connections stay open: closing them would turn the peers' mismatch into peer_lost.
  void flush_headers();

  bool oversubscribed_;
  std::size_t segment_;
  std::vector<Fd> peers_;
  std::vector<const std::byte*> ptrs_;
  std::vector<Xfer> xfers_;
  std::vector<Fingerprint> headers_in_;
  std::array<iovec, 16> iov_{};
  std::vector<std::byte> scratch_;
  P2PHeader p2p_header_{};
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/tcp.ipp"
#endif
