// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/single_copy.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <bit>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

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

}  // namespace detail
DDP_END_NAMESPACE
