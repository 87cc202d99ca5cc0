// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// all_reduce by single copy, where every rank can read the others' memory (the shm transport
/// with Transport::copy_from), the path chooser that picks it or the slot path per message size,
/// and all_reduce_on: the one entry of a flat all_reduce (small, single copy or segments).

#include "ddp/backend/collective.hpp"
#include "ddp/backend/host/flat.hpp"
#include "ddp/backend/host/rounds.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/backend/reduce.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Which path an all_reduce on shared memory takes when Options::shm_single_copy_bytes is
/// automatic (rank 0 decides; the others follow what it says in the first round): both give
/// the same bits, but which is faster depends on the size and flips with the machine's state
/// (bench/README.md, "Shared memory at mid sizes"). Per power-of-two size class, each path is
/// tried a few times in turn, then the faster by its recent times runs, and the other is
/// retried every 64th call, so that a change is noticed.
class PathChooser {
 public:
  /// Whether the next all_reduce of `bytes` goes by single copy.
  [[nodiscard]] bool single(std::size_t bytes);
  /// How long an all_reduce of `bytes` took by that path.
  void record(std::size_t bytes, bool single, double seconds);

 private:
  struct Class {
    double seconds[2] = {0, 0};  // recent time of the slot path, of single copy
    std::uint32_t runs[2] = {0, 0};
    std::uint64_t calls = 0;
  };
  Class& at(std::size_t bytes);
  static constexpr std::uint32_t tries = 3;
  static constexpr std::uint64_t retry_every = 64;
  std::array<Class, 64> classes_{};
};

#if DDP_BODIES
DDP_INLINE bool PathChooser::single(std::size_t bytes) {
  Class& c = at(bytes);
  ++c.calls;
  if (c.runs[0] < tries || c.runs[1] < tries) return c.runs[1] < c.runs[0];
  const bool faster = c.seconds[1] < c.seconds[0];
  return c.calls % retry_every == 0 ? !faster : faster;
}

DDP_INLINE void PathChooser::record(std::size_t bytes, bool single, double seconds) {
  Class& c = at(bytes);
  double& avg = c.seconds[single ? 1 : 0];
  avg = c.runs[single ? 1 : 0]++ == 0 ? seconds : (avg + seconds) / 2;
}

DDP_INLINE auto PathChooser::at(std::size_t bytes) -> Class& {
  return classes_[static_cast<std::size_t>(std::bit_width(bytes | 1)) - 1];
}
#endif  // DDP_BODIES

/// The single-copy all_reduce's state: whether rank 0 times the two paths, and what it learnt.
class SingleCopy {
 public:
  /// Options::shm_single_copy_bytes automatic: rank 0 times both paths and picks per size.
  bool choose_path = false;

  /// all_reduce by single copy: ranks exchange where their buffers lie (the round that compares
  /// fingerprints) and which path rank 0 chose (single copy unless choosing is automatic, see
  /// PathChooser: then reduce_segments may run instead), then, segment by segment, rank j copies
  /// chunk j of every peer's buffer straight out of that peer, reduces it into its own in rank
  /// order, and, once every chunk is reduced (a round), copies the peers' reduced chunks
  /// straight into its buffer; a last round keeps every buffer alive until no peer reads it.
  /// Each rank receives N bytes, written once: no copy through shared memory. The same
  /// combination order as reduce_segments, so the same bits.
  void all_reduce(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, const Fingerprint* fp);

 private:
  /// Where a rank's buffer lies in its process.
  struct Where {
    std::uint64_t addr, bytes;
    std::uint64_t single;  // rank 0's: 1 single copy, 0 the slot path
  };
  std::vector<Where> where_;
  PathChooser chooser_;
};

#if DDP_BODIES
DDP_INLINE void SingleCopy::all_reduce(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn,
                                       const Fingerprint* fp) {
  const std::size_t es = b.elem();
  const int p = t.size(), me = t.rank();
  const bool timed = me == 0 && choose_path;
  const auto t0 =
      timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const bool single = me != 0 || !choose_path || chooser_.single(b.bytes());
  const Where mine{reinterpret_cast<std::uintptr_t>(b.data), b.bytes(), single ? 1u : 0u};
  const Piece pc{reinterpret_cast<const std::byte*>(&mine), sizeof mine};
  auto got = t.round(
      {&pc, 1},
      [](int, int) {
        return Range{0, sizeof(Where)};
      },
      fp);
  where_.resize(static_cast<std::size_t>(p));
  for (int j = 0; j < p; ++j) {
    Where& w = where_[static_cast<std::size_t>(j)];
    std::memcpy(&w, got[static_cast<std::size_t>(j)], sizeof(Where));
    if (w.bytes != mine.bytes) {
      const std::string msg =
          concat("rank ", t.global(me), ": ", t.describe(fp, nullptr), ": rank ", t.global(j),
                 " reduces ", w.bytes, " bytes but this rank ", mine.bytes,
                 "; every rank must pass the same count and dtype");
      t.abort(Errc::mismatch, msg);
      fail(Errc::mismatch, msg);
    }
  }
  const auto done = [&](bool by_single_copy) {
    if (timed) {
      chooser_.record(b.bytes(), by_single_copy,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  };
  if (where_[0].single == 0) {  // rank 0 chose the slot path (fingerprints already compared)
    reduce_segments(t, s, b, fn, -1, nullptr);
    done(false);
    return;
  }
  const std::size_t seg = segment_elements(t, es);
  s.ptrs.resize(static_cast<std::size_t>(p));
  for (std::size_t s0 = 0; s0 < b.count;) {
    const std::size_t m = std::min(seg, b.count - s0);
    std::byte* base = b.at(s0);
    const auto chunk = [&](int j) { return chunk_bytes(m, p, j, es); };
    const Range r = chunk(me);
    std::byte* scratch = RoundScratch::at_least(s.bytes, r.len * static_cast<std::size_t>(p));
    for (int j = 0; j < p; ++j) {
      const auto ju = static_cast<std::size_t>(j);
      if (j == me) {
        s.ptrs[ju] = base + r.off;
        continue;
      }
      std::byte* dst = scratch + r.len * ju;
      t.copy_from(j, where_[ju].addr + s0 * es + r.off, dst, r.len, fp);
      s.ptrs[ju] = dst;
    }
    fn(base + r.off, nullptr, s.ptrs.data(), p, r.len / es);
    empty_round(t, nullptr);
    for (int j = 0; j < p; ++j) {
      const Range c = chunk(j);
      if (j != me)
        t.copy_from(j, where_[static_cast<std::size_t>(j)].addr + s0 * es + c.off, base + c.off,
                    c.len, fp);
    }
    s0 += m;
  }
  empty_round(t, nullptr);
  done(true);
}
#endif  // DDP_BODIES

/// all_reduce over transport `t` (the whole communicator, or one of the hierarchical path's
/// groups): one round that gathers whole buffers when small, single copy where the transport
/// offers it for this size (`single`, when not null), else reduce_segments.
DDP_INLINE void all_reduce_on(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn,
                              const Fingerprint* fp, SingleCopy* single);
#if DDP_BODIES
DDP_INLINE void all_reduce_on(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn,
                              const Fingerprint* fp, SingleCopy* single) {
  if (b.bytes() <= t.small_bytes()) {
    all_reduce_small(t, b, fn, fp);
    return;
  }
  if (single != nullptr && b.bytes() >= t.single_copy_from()) {
    single->all_reduce(t, s, b, fn, fp);
    return;
  }
  reduce_segments(t, s, b, fn, -1, fp);
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
