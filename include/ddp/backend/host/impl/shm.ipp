// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/shm.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE ShmTransport::ShmTransport(int rank, int size, std::chrono::milliseconds timeout,
                                      ShmLayout layout, std::unique_ptr<ShmSegment> segment,
                                      const std::vector<int>& pids, int machine_ranks)
    : Transport(rank, size, timeout),
      layout_(layout),
      segment_(std::move(segment)),
      ptrs_(static_cast<std::size_t>(size)),
      seen_(static_cast<std::size_t>(size)),
      pids_(pids) {
  header_ = reinterpret_cast<ShmHeader*>(segment_->base());
  for (int j = 0; j < size; ++j) {
    if (j != rank) watch_.add(j, pids[static_cast<std::size_t>(j)]);
  }
  oversubscribed_ = std::max(size, machine_ranks) > usable_cpus();
  tick_ = round_of(ctl(rank)->word.load());
}

DDP_INLINE ShmTransport::~ShmTransport() {
  ctl(rank_)->left.store(1, std::memory_order_seq_cst);
  header_->wake.epoch.fetch_add(1);
  futex_wake_all(&header_->wake.epoch);
}

DDP_INLINE void ShmTransport::format(std::byte* base, const ShmLayout& layout,
                                     std::uint64_t cookie) {
  auto* h = new (base) ShmHeader{};
  h->magic = ShmLayout::magic;
  h->cookie = cookie;
  h->world = static_cast<std::uint32_t>(layout.world);
  h->slot_bytes = layout.slot_bytes;
  h->channel_bytes = layout.channel_bytes;
  h->total = layout.total();
  for (int j = 0; j < layout.world; ++j)
    new (base + layout.ctl_offset() + static_cast<std::size_t>(j) * ShmLayout::ctl_bytes) ShmCtl{};
  for (int s = 0; s < layout.world; ++s) {
    for (int d = 0; d < layout.world; ++d) new (base + layout.channel_offset(s, d)) ShmChannelCtl{};
  }
}

DDP_INLINE void ShmTransport::verify(const std::byte* base, const ShmLayout& layout,
                                     std::uint64_t cookie) {
  const auto* h = reinterpret_cast<const ShmHeader*>(base);
  if (h->magic != ShmLayout::magic || h->cookie != cookie ||
      h->world != static_cast<std::uint32_t>(layout.world) || h->slot_bytes != layout.slot_bytes ||
      h->total != layout.total()) {
    fail(Errc::protocol,
         "the shared memory segment does not belong to this communicator (cookie or layout "
         "differ)");
  }
}

DDP_INLINE std::size_t ShmTransport::small_bytes() const noexcept {
  return std::min<std::size_t>(layout_.slot_bytes, 16384);
}

DDP_INLINE std::span<const std::byte* const> ShmTransport::round(std::span<const Piece> offer,
                                                                 Want want, const Fingerprint* fp) {
  check_abort(fp);
  const std::uint64_t t = ++tick_;
  const unsigned parity = static_cast<unsigned>(t & 1u);
  std::byte* my_slot = slot(rank_, parity);
  // Copy only what peers want, each byte once.
  wanted_.clear();
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    const Range r = want(rank_, j);
    if (r.len != 0) wanted_.push_back(r);
  }
  std::sort(wanted_.begin(), wanted_.end(),
            [](const Range& a, const Range& b) { return a.off < b.off; });
  std::size_t copied_to = 0;
  for (const Range& r : wanted_) {
    std::size_t from = std::max(r.off, copied_to);
    const std::size_t to = r.off + r.len;
    if (to > layout_.slot_bytes)
      fail(Errc::invalid_argument, "internal error: offer exceeds the shared memory slot");
    std::size_t base = 0;
    for (const Piece& p : offer) {  // copy [from, to) out of the pieces
      const std::size_t lo = std::max(from, base), hi = std::min(to, base + p.len);
      // Skip bytes already in place (staged in the slot by the caller).
      if (lo < hi && my_slot + lo != p.data + (lo - base))
        std::memcpy(my_slot + lo, p.data + (lo - base), hi - lo);
      base += p.len;
    }
    copied_to = std::max(copied_to, to);
  }
  ShmCtl* mine = ctl(rank_);
  std::uint64_t code = 0;
  if (verify_fingerprints) {
    if (fp != nullptr) {
      mine->fp[parity] = *fp;
      code = fingerprint_code(*fp, checked_seq_, checked_any_);
      checked_seq_ = fp->seq;
      checked_any_ = true;
    } else {
      mine->fp[parity] = no_fingerprint();
    }
  }
  mine->word.store(code << 16 | (t & 0xffffu), std::memory_order_seq_cst);
  header_->wake.notify();

  wait([&] { return all_reached(t); }, fp, [&] { return behind(t); }, "");

  if (code != 0) {
    for (int j = 0; j < size_; ++j) {
      const std::uint64_t w = seen_[static_cast<std::size_t>(j)];
      // Equal codes that are not wide, of this very round, mean equal fingerprints (see
      // fingerprint_code; a rank with a fingerprint where its peer had none fails below, so
      // both ranks' previous checked rounds were the same round, with equal fingerprints).
      if (j == rank_ || (code != fingerprint_wide && w == (code << 16 | (t & 0xffffu)))) continue;
      // A code is wide, the codes differ, or the peer was already in round t + 1 (it cannot
      // pass t + 1 before this rank publishes t + 1): its round-t fingerprint, or the marker of
      // a round without one, is in fp[parity] either way.
      const Fingerprint theirs = ctl(j)->fp[parity];
      if (!(theirs == *fp)) {
        const std::string msg = mismatch_message(*fp, j, theirs);
        publish_abort(Errc::mismatch, msg);
        fail(Errc::mismatch, msg);
      }
    }
  }
  for (int j = 0; j < size_; ++j) {
    const Range r = want(j, rank_);
    if (r.len == 0)
      ptrs_[static_cast<std::size_t>(j)] = nullptr;
    else if (j == rank_)
      ptrs_[static_cast<std::size_t>(j)] = SelfTransport::locate(offer, r);
    else
      ptrs_[static_cast<std::size_t>(j)] = slot(j, parity) + r.off;
  }
  return ptrs_;
}

DDP_INLINE std::byte* ShmTransport::stage(std::size_t bytes) {
  if (bytes > layout_.slot_bytes) return nullptr;
  return slot(rank_, static_cast<unsigned>((tick_ + 1) & 1u));
}

DDP_INLINE std::uint64_t ShmTransport::probe_address() const noexcept {
  return reinterpret_cast<std::uintptr_t>(&probe_);
}

DDP_INLINE bool ShmTransport::probe_single_copy(int j, std::uint64_t addr) const {
  std::uint64_t word = 0;
  iovec local{&word, sizeof word};
  iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(addr)), sizeof word};
  return ::process_vm_readv(pids_[static_cast<std::size_t>(j)], &local, 1, &remote, 1, 0) ==
             static_cast<ssize_t>(sizeof word) &&
         word == probe_value;
}

DDP_INLINE void ShmTransport::copy_from(int j, std::uint64_t addr, std::byte* dst, std::size_t len,
                                        const Fingerprint* fp) {
  if (len == 0) return;
  iovec local{dst, len};
  iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(addr)), len};
  const ssize_t got =
      ::process_vm_readv(pids_[static_cast<std::size_t>(j)], &local, 1, &remote, 1, 0);
  if (got == static_cast<ssize_t>(len)) return;
  const int err = got < 0 ? errno : 0;
  check_abort(fp);  // the peer left with an error (its buffer may be gone): report that
  const char* why = err == ESRCH    ? "its process is gone"
                    : err == EFAULT ? "its buffer is gone: it left the collective"
                    : err == EPERM  ? "the kernel no longer lets this process read it"
                                    : "it died or left the collective";
  const std::string msg = concat(
      "rank ", global(rank_), ": ", describe(fp, nullptr), ": copying ", len, " bytes out of rank ",
      global(j), "'s memory failed (", err != 0 ? std::strerror(err) : "short copy", "): ", why,
      "; the job cannot continue with this communicator (the ranks still alive can go on "
      "with shrink())");
  const Errc code = err == EPERM ? Errc::system : Errc::peer_lost;
  std::vector<int> lost;
  if (code == Errc::peer_lost) lost.push_back(global(j));
  publish_abort(code, concat("copying out of rank ", global(j), "'s memory failed: ", why), lost);
  fail_from(-1, std::move(lost), code, msg);
}

DDP_INLINE void ShmTransport::send(const Buf& buf, int peer, int tag, std::uint64_t seq) {
  check_abort(nullptr);
  const P2PHeader h{seq, buf.count, tag, P2PHeader::p2p, buf.dtype, {}};
  channel_write(peer, &h, sizeof h, "send", buf, tag);
  channel_write(peer, buf.data, buf.bytes(), "send", buf, tag);
}

DDP_INLINE void ShmTransport::recv(const Buf& buf, int peer, int tag, std::uint64_t seq) {
  check_abort(nullptr);
  P2PHeader h{};
  channel_read(peer, &h, sizeof h, "recv", buf, tag);
  if (const std::string msg = p2p_mismatch(buf, peer, tag, seq, h); !msg.empty()) {
    publish_abort(Errc::mismatch, msg);
    fail(Errc::mismatch, msg);
  }
  channel_read(peer, buf.data, buf.bytes(), "recv", buf, tag);
}

DDP_INLINE void ShmTransport::abort(Errc code, const std::string& why) {
  set_local_abort(code);
  publish_abort(code, why);
}

DDP_INLINE void ShmTransport::abort_with(const Error& e) {
  set_local_abort(e.code());
  publish_abort(e);
}

DDP_INLINE ShmCtl* ShmTransport::ctl(int r) const {
  return reinterpret_cast<ShmCtl*>(segment_->base() + layout_.ctl_offset() +
                                   static_cast<std::size_t>(r) * ShmLayout::ctl_bytes);
}

DDP_INLINE ShmChannelCtl* ShmTransport::channel(int src, int dst) const {
  return reinterpret_cast<ShmChannelCtl*>(segment_->base() + layout_.channel_offset(src, dst));
}

DDP_INLINE std::byte* ShmTransport::channel_data(int src, int dst) const {
  return segment_->base() + layout_.channel_offset(src, dst) + ShmLayout::channel_ctl_bytes;
}

DDP_INLINE std::uint16_t ShmTransport::round_of(std::uint64_t word) noexcept {
  return static_cast<std::uint16_t>(word);
}

DDP_INLINE bool ShmTransport::reached(std::uint64_t word, std::uint64_t t) noexcept {
  return static_cast<std::int16_t>(
             static_cast<std::uint16_t>(round_of(word) - static_cast<std::uint16_t>(t))) >= 0;
}

DDP_INLINE Fingerprint ShmTransport::no_fingerprint() noexcept {
  Fingerprint f;
  f.coll = static_cast<Coll>(0);
  return f;
}

DDP_INLINE bool ShmTransport::reached(int j, std::uint64_t t) const {
  return reached(ctl(j)->word.load(std::memory_order_acquire), t);
}

DDP_INLINE bool ShmTransport::all_reached(std::uint64_t t) {
  for (int j = 0; j < size_; ++j) {
    const std::uint64_t w = ctl(j)->word.load(std::memory_order_acquire);
    if (!reached(w, t)) return false;
    seen_[static_cast<std::size_t>(j)] = w;
  }
  return true;
}

DDP_INLINE std::vector<int> ShmTransport::behind(std::uint64_t t) const {
  std::vector<int> who;
  for (int j = 0; j < size_; ++j) {
    if (!reached(j, t)) who.push_back(j);
  }
  return who;
}

DDP_INLINE std::string ShmTransport::ranks_text(const std::vector<int>& ranks) const {
  std::string who;
  for (int j : ranks) who += concat(who.empty() ? "" : ", ", global(j));
  return concat(ranks.size() == 1 ? "rank " : "ranks ", who);
}

DDP_INLINE bool ShmTransport::has_left(int j) const {
  return ctl(j)->left.load(std::memory_order_acquire) != 0;
}

DDP_INLINE void ShmTransport::departed(int j, const Fingerprint* fp, const char* what) {
  try {
    fail_if_left({j}, std::chrono::milliseconds(300), fp, what);
  } catch (const Error& e) {
    publish_abort(e);
    throw;
  }
  const std::string msg =
      concat("rank ", global(rank_), ": ", describe(fp, what), ": rank ", global(j),
             " left this communicator (destroyed it) while this rank waited for it; the ranks "
             "ran different numbers of collectives (for uneven inputs see ddp::Join)");
  publish_abort(Errc::peer_lost, msg);
  fail(Errc::peer_lost, msg);
}

DDP_INLINE void ShmTransport::publish_abort(Errc code, std::string_view why,
                                            const std::vector<int>& lost, int reporter) {
  std::uint32_t expected = 0;
  if (header_->abort_state.compare_exchange_strong(expected, 1)) {
    header_->abort_rank = reporter >= 0 ? reporter : global(rank_);
    header_->abort_code = static_cast<int>(code);
    const std::size_t n = std::min(why.size(), sizeof header_->abort_message - 1);
    std::memcpy(header_->abort_message, why.data(), n);
    header_->abort_message[n] = '\0';
    const std::size_t k = std::min(lost.size(), std::size(header_->abort_lost));
    std::copy_n(lost.begin(), k, header_->abort_lost);
    header_->abort_lost_count = static_cast<std::int32_t>(k);
    header_->abort_state.store(2, std::memory_order_seq_cst);
  }
  header_->wake.epoch.fetch_add(1);
  futex_wake_all(&header_->wake.epoch);
}

DDP_INLINE void ShmTransport::publish_abort(const Error& e) {
  // The words after the context ("rank R: ..."): the peers put the reporter's name in front.
  publish_abort(e.code(), e.origin_message(), e.lost_ranks(), e.origin_rank());
}

DDP_INLINE void ShmTransport::check_abort(const Fingerprint* fp) const {
  check_local_abort(fp);
  if (header_->abort_state.load(std::memory_order_acquire) == 2) {
    Left left;
    left.rank = header_->abort_rank;
    left.code = static_cast<Errc>(header_->abort_code);
    left.message = header_->abort_message;
    constexpr auto most = static_cast<std::int32_t>(std::size(ShmHeader{}.abort_lost));
    const auto k = static_cast<std::size_t>(std::clamp(header_->abort_lost_count, 0, most));
    left.lost.assign(header_->abort_lost, header_->abort_lost + k);
    fail_reported(left, fp, nullptr);
  }
}

DDP_INLINE void ShmTransport::channel_write(int peer, const void* data, std::size_t n,
                                            const char* what, const Buf& buf, int tag) {
  ShmChannelCtl* ch = channel(rank_, peer);
  std::byte* ring = channel_data(rank_, peer);
  const std::size_t cap = layout_.channel_bytes;
  const auto* p = static_cast<const std::byte*>(data);
  std::uint64_t head = ch->head.load(std::memory_order_relaxed);
  const auto awaited = [peer] { return std::vector<int>{peer}; };
  const std::string op = concat(what, "(to rank ", peer, ", tag ", tag, ", ", to_string(buf.dtype),
                                ", count=", buf.count, ")");
  while (n > 0) {
    wait([&] { return head - ch->tail.load(std::memory_order_acquire) < cap; }, nullptr, awaited,
         " to receive", op.c_str());
    const std::uint64_t free_bytes = cap - (head - ch->tail.load(std::memory_order_acquire));
    const std::size_t at = static_cast<std::size_t>(head % cap);
    const std::size_t k =
        std::min<std::size_t>({n, static_cast<std::size_t>(free_bytes), cap - at});
    std::memcpy(ring + at, p, k);
    p += k;
    n -= k;
    head += k;
    ch->head.store(head, std::memory_order_seq_cst);
    header_->wake.notify();
  }
}

DDP_INLINE void ShmTransport::channel_read(int peer, void* data, std::size_t n, const char* what,
                                           const Buf& buf, int tag) {
  ShmChannelCtl* ch = channel(peer, rank_);
  const std::byte* ring = channel_data(peer, rank_);
  const std::size_t cap = layout_.channel_bytes;
  auto* p = static_cast<std::byte*>(data);
  std::uint64_t tail = ch->tail.load(std::memory_order_relaxed);
  const auto awaited = [peer] { return std::vector<int>{peer}; };
  const std::string op = concat(what, "(from rank ", peer, ", tag ", tag, ", ",
                                to_string(buf.dtype), ", count=", buf.count, ")");
  while (n > 0) {
    wait([&] { return ch->head.load(std::memory_order_acquire) > tail; }, nullptr, awaited,
         " to send", op.c_str());
    const std::uint64_t avail = ch->head.load(std::memory_order_acquire) - tail;
    const std::size_t at = static_cast<std::size_t>(tail % cap);
    const std::size_t k = std::min<std::size_t>({n, static_cast<std::size_t>(avail), cap - at});
    std::memcpy(p, ring + at, k);
    p += k;
    n -= k;
    tail += k;
    ch->tail.store(tail, std::memory_order_seq_cst);
    header_->wake.notify();
  }
}

}  // namespace detail
DDP_END_NAMESPACE
