// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The shared-memory transport of the Host backend (all ranks on one host).
///
/// One shared-memory segment per communicator, created by rank 0 without a name (see ShmSegment)
/// and opened by the others through rank 0's descriptor, so a crash at any moment leaves nothing
/// in /dev/shm. It holds:
///  * a header: the abort word (the first failure, so peers fail fast) and the futex wake word;
///  * per rank a control block: on its own cache line the round word (the round number and the
///    exact short form of the collective's fingerprint, detail::fingerprint_code), on another the
///    two full fingerprints (indexed by round parity), which peers read only when the short forms
///    cannot decide;
///  * per rank two data slots (double buffering by tick parity);
///  * per ordered pair a ring buffer for send/recv.
///
/// A round: copy the bytes peers want into my slot[tick % 2], publish the round word, wait until
/// every peer's round reaches mine, compare fingerprints, hand out pointers into peers' slots.
/// Double buffering needs no extra waits: a peer can only overwrite slot[t % 2] in round t + 2,
/// which it cannot start before I publish round t + 1, which I do only after I am done reading
/// round t.

#include "ddp/backend/host/shm_segment.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/socket.hpp"
#include "ddp/detail/wait.hpp"
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

class ShmTransport final : public Transport {
 public:
  /// `segment` is mapped and initialized; `pids[j]` is rank j's process id; `machine_ranks`: the
  /// ranks running on this machine, this transport's or not (more than its cores: waits yield).
  ShmTransport(int rank, int size, std::chrono::milliseconds timeout, ShmLayout layout,
               std::unique_ptr<ShmSegment> segment, const std::vector<int>& pids,
               int machine_ranks = 0);
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  /// Marks this rank gone (ShmCtl::left) and wakes the peers: one still waiting for it fails at
  /// once, with the reason its communicator recorded (CommState::announce_leaving).
  DDP_INLINE ~ShmTransport() override;

  /// Initializes a freshly created segment (rank 0 only, before anyone else maps it).
  static void format(std::byte* base, const ShmLayout& layout, std::uint64_t cookie);

  /// Checks a segment opened by a non-creator.
  static void verify(const std::byte* base, const ShmLayout& layout, std::uint64_t cookie);

  [[nodiscard]] std::string_view name() const noexcept override { return "shm"; }
  [[nodiscard]] std::size_t max_offer() const noexcept override { return layout_.slot_bytes; }
  [[nodiscard]] DDP_INLINE std::size_t small_bytes() const noexcept override;

  DDP_INLINE std::span<const std::byte* const> round(std::span<const Piece> offer, Want want,
                                                     const Fingerprint* fp) override;

  /// My slot for the next round: free, since every peer has finished reading the round that used
  /// it last (they published the current round, which they only do after that).
  DDP_INLINE std::byte* stage(std::size_t bytes) override;

  /// Single copy. Where this process's probe word lies, for peers' probe_single_copy().
  [[nodiscard]] std::uint64_t probe_address() const noexcept;
  /// Whether this process may read peer j's memory (process_vm_readv: the kernel allows it
  /// between processes of one user unless Yama's ptrace_scope, a seccomp filter or a missing
  /// capability forbids it), tried on the probe word at `addr` in j.
  [[nodiscard]] bool probe_single_copy(int j, std::uint64_t addr) const;
  /// From now on, all_reduce of at least `bytes` goes by single copy (every rank alike).
  void use_single_copy(std::size_t bytes) noexcept { single_copy_from_ = bytes; }
  [[nodiscard]] std::size_t single_copy_from() const noexcept override { return single_copy_from_; }

  DDP_INLINE void copy_from(int j, std::uint64_t addr, std::byte* dst, std::size_t len,
                            const Fingerprint* fp) override;

  DDP_INLINE void send(const Buf& buf, int peer, int tag, std::uint64_t seq) override;

  DDP_INLINE void recv(const Buf& buf, int peer, int tag, std::uint64_t seq) override;

  DDP_INLINE void abort(Errc code, const std::string& why) override;
  DDP_INLINE void abort_with(const Error& e) override;

 private:
  [[nodiscard]] ShmCtl* ctl(int r) const;
  [[nodiscard]] std::byte* slot(int r, unsigned parity) const {
    return segment_->base() + layout_.slot_offset(r, parity);
  }
  [[nodiscard]] ShmChannelCtl* channel(int src, int dst) const;
  [[nodiscard]] std::byte* channel_data(int src, int dst) const;

  [[nodiscard]] static std::uint16_t round_of(std::uint64_t word) noexcept;
  /// Whether a round word is of round t or later (modulo 2^16: a peer is at most one round ahead).
  [[nodiscard]] static bool reached(std::uint64_t word, std::uint64_t t) noexcept;
  /// What fp[parity] holds for a round without a fingerprint: no collective's fingerprint (its
  /// coll is not a collective), so a peer that has one in that round fails with a mismatch.
  [[nodiscard]] static Fingerprint no_fingerprint() noexcept;
  [[nodiscard]] bool reached(int j, std::uint64_t t) const;
  /// Whether every rank has published round t; if so, their words are in seen_.
  [[nodiscard]] bool all_reached(std::uint64_t t);

  /// The ranks that have not published round t.
  [[nodiscard]] std::vector<int> behind(std::uint64_t t) const;

  /// "rank 2" or "ranks 1, 3" (the communicator's numbers).
  [[nodiscard]] std::string ranks_text(const std::vector<int>& ranks) const;

  [[nodiscard]] bool has_left(int j) const;

  /// Rank j's transport is gone (ShmCtl::left) while this rank waits for it: fails with why it
  /// left, from its record in the store (it finished, or failed), and tells the other ranks.
  [[noreturn]] void departed(int j, const Fingerprint* fp, const char* what);

  /// First failure wins; later ones keep the first message. `lost`: the ranks it found lost;
  /// `reporter`: the rank that found it, when another (this rank relays its failure).
  void publish_abort(Errc code, std::string_view why, const std::vector<int>& lost = {},
                     int reporter = -1);
  /// The same for `e`: relayed as its origin rank's words when another rank found it.
  void publish_abort(const Error& e);

  /// Throws if this communicator was aborted here or by a peer.
  void check_abort(const Fingerprint* fp) const;

  /// Spins, then sleeps, until ready(); fails on abort, on a dead peer and at the timeout.
  /// `awaited()`: the ranks this wait depends on (this transport's numbers); `doing` what they
  /// are awaited for, after their names in messages (" to send").
  template <class Ready, class Awaited>
  void wait(Ready&& ready, const Fingerprint* fp, Awaited&& awaited, const char* doing,
            const char* what = nullptr) {
    if (ready()) return;
    // Spin first, unless there are more ranks than cores: then the awaited rank may be waiting
    // for this very core, so yield it at once (even a short spin of pause instructions costs
    // more than the whole round).
    if (!oversubscribed_) {
      const auto spin_until = Clock::now() + std::chrono::microseconds(50);
      do {
        for (int i = 0; i < 64; ++i) {
          cpu_relax();
          if (ready()) return;
        }
      } while (Clock::now() < spin_until);
    }
    const auto deadline = Deadline::after(timeout_ + slack);
    // Dead peers and the deadline are checked every 20 ms (a poll(2) of the peers' pidfds each
    // time; not on every call, which would cost more than a small round).
    auto next_check = Clock::now() + std::chrono::milliseconds(20);
    // More ranks than cores: the rank we wait for needs this core. Hand it over with
    // sched_yield for a while (cheap for the poster: nobody sleeps, so no futex wake-up), and
    // only then sleep.
    const auto yield_until = Clock::now() + std::chrono::milliseconds(2);
    for (;;) {
      // Ready first: a round every rank completed is not undone by a failure a peer published
      // afterwards, in its next collective (this rank meets that failure in its own next one).
      if (ready()) return;
      check_abort(fp);
      const auto now = Clock::now();
      if (now >= next_check) {
        const std::vector<int> waited_for = awaited();
        for (int j : waited_for) {
          if (has_left(j)) departed(j, fp, what);
        }
        if (const int dead = watch_.first_dead(); dead >= 0 && has_left(dead)) {
          watch_.forget(dead);  // it left first: its exit is no failure of waits without it
        } else if (dead >= 0) {
          const std::string msg =
              concat("rank ", global(rank_), ": ", describe(fp, what), ": rank ", global(dead),
                     " died (its process exited); the job cannot continue with this communicator "
                     "(the ranks still alive can go on with shrink())");
          publish_abort(Errc::peer_lost,
                        concat("rank ", global(dead), " died (its process exited)"),
                        {global(dead)});
          fail_from(-1, {global(dead)}, Errc::peer_lost, msg);
        }
        if (now >= deadline.at) {
          const std::string who = concat(ranks_text(waited_for), doing);
          const std::string msg = concat(
              "rank ", global(rank_), ": ", describe(fp, what), ": timed out after ",
              (timeout_ + slack).count(), " ms waiting for ", who,
              " (shm transport); that rank is stopped, slow, or did not call this collective");
          publish_abort(Errc::timeout, concat("timed out waiting for ", who));
          fail(Errc::timeout, msg);
        }
        next_check = now + std::chrono::milliseconds(20);
      }
      if (oversubscribed_ && now < yield_until) {
        ::sched_yield();
        continue;
      }
      header_->wake.sleep_unless(ready, 5'000'000);
    }
  }

  void channel_write(int peer, const void* data, std::size_t n, const char* what, const Buf& buf,
                     int tag);

  void channel_read(int peer, void* data, std::size_t n, const char* what, const Buf& buf, int tag);

  ShmLayout layout_;
  std::unique_ptr<ShmSegment> segment_;
  ShmHeader* header_ = nullptr;
  ProcessWatch watch_;
  bool oversubscribed_ = false;
  std::uint64_t tick_ = 0;
  std::uint64_t checked_seq_ = 0;  // the sequence number of this rank's last checked round
  bool checked_any_ = false;       // whether there was one (the first checked round is wide)
  std::vector<Range> wanted_;
  std::vector<const std::byte*> ptrs_;
  std::vector<std::uint64_t> seen_;  // the round words all_reached last saw
  std::vector<int> pids_;
  std::size_t single_copy_from_ = ~std::size_t{0};
  static constexpr std::uint64_t probe_value = 0x65626f7270706464ull;  // "ddpprobe"
  std::uint64_t probe_ = probe_value;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/shm.ipp"
#endif
