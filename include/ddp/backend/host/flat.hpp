// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The Host backend's algorithms over one transport (the whole communicator, or one group of the
/// hierarchical path), as functions of the Transport contract, so that they run the same on
/// shared memory, TCP and, in the unit tests, an in-process transport:
///  * all_reduce of a small buffer: every rank offers its whole buffer and reduces all of them;
///  * all_reduce (and reduce) of a large buffer, in segments sized for the cache: a
///    reduce-scatter in which rank j reduces chunk j of every rank's segment, then a gather of
///    the reduced chunks; every rank's core is busy and each input byte is read once;
///  * broadcast, gather, scatter, all_gather, reduce_scatter and all_to_all in segments.
/// Every element is reduced in rank order 0..P-1 in every path, so results are bitwise identical
/// on every rank, in every run, for every message size and on every transport.

#include "ddp/backend/collective.hpp"
#include "ddp/backend/host/rounds.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/backend/reduce.hpp"
#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The large-message path of all_reduce (root < 0) and reduce: in segments, a reduce-scatter
/// (rank j reduces chunk j of every rank's segment, in rank order) then a gather of the reduced
/// chunks to every rank or to root. The result is written, in the same pass, to the user's
/// buffer and to the slot of the next round when the transport offers one; ranks other than
/// the root of a reduce leave their buffers untouched.
DDP_INLINE void reduce_segments(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, int root,
                                const Fingerprint* fp);
#if DDP_BODIES
DDP_INLINE void reduce_segments(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, int root,
                                const Fingerprint* fp) {
  const std::size_t es = b.elem();
  const int p = t.size(), me = t.rank();
  const bool keeps = root < 0 || me == root;
  const std::size_t seg = segment_elements(t, es);
  bool first = true;
  for (std::size_t s0 = 0; s0 < b.count;) {
    const std::size_t m = std::min(seg, b.count - s0);
    std::byte* base = b.at(s0);
    const auto chunk = [&](int j) { return chunk_bytes(m, p, j, es); };
    const Piece pc{base, m * es};
    auto ptrs = t.round(
        {&pc, 1}, [&](int, int dst) { return chunk(dst); }, first ? fp : nullptr);
    first = false;
    const Range mine = chunk(me);
    std::byte* staged = t.stage(mine.len);
    std::byte* out = base + mine.off;
    if (!keeps) {  // reduce only into the slot (or scratch): this rank's buffer stays as it was
      out = staged != nullptr ? staged : RoundScratch::at_least(s.bytes, mine.len);
      staged = nullptr;
    }
    fn(out, staged, ptrs.data(), p, mine.len / es);
    const Piece result{staged != nullptr ? staged : out, mine.len};
    auto got = t.round(
        {&result, 1},
        [&](int src, int dst) {
          return root < 0 || dst == root ? Range{0, chunk(src).len} : Range{};
        },
        nullptr);
    if (keeps) {
      for (int j = 0; j < p; ++j) {
        const Range r = chunk(j);
        if (j != me && r.len != 0)
          std::memcpy(base + r.off, got[static_cast<std::size_t>(j)], r.len);
      }
    }
    s0 += m;
  }
}
#endif  // DDP_BODIES

/// all_reduce of a buffer of at most t.small_bytes(): one round gathers every rank's whole
/// buffer and every rank reduces all of them.
DDP_INLINE void all_reduce_small(Transport& t, const Buf& b, ReduceFn fn, const Fingerprint* fp);
#if DDP_BODIES
DDP_INLINE void all_reduce_small(Transport& t, const Buf& b, ReduceFn fn, const Fingerprint* fp) {
  const Piece pc{b.data, b.bytes()};
  auto ptrs = t.round(
      {&pc, 1},
      [&](int, int) {
        return Range{0, b.bytes()};
      },
      fp);
  fn(b.data, nullptr, ptrs.data(), t.size(), b.count);
}
#endif  // DDP_BODIES

/// reduce over `t`: the reduction lands in the buffer of t's rank `root` only.
DDP_INLINE void reduce_on(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, int root,
                          const Fingerprint* fp);
#if DDP_BODIES
DDP_INLINE void reduce_on(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, int root,
                          const Fingerprint* fp) {
  if (b.bytes() <= t.small_bytes()) {
    const Piece pc{b.data, b.bytes()};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int dst) {
          return dst == root ? Range{0, b.bytes()} : Range{};
        },
        fp);
    if (t.rank() == root) fn(b.data, nullptr, ptrs.data(), t.size(), b.count);
    return;
  }
  reduce_segments(t, s, b, fn, root, fp);
}
#endif  // DDP_BODIES

/// broadcast over `t` from t's rank `root`.
DDP_INLINE void broadcast_on(Transport& t, const Buf& b, int root, const Fingerprint* fp);
#if DDP_BODIES
DDP_INLINE void broadcast_on(Transport& t, const Buf& b, int root, const Fingerprint* fp) {
  const std::size_t es = b.elem();
  const bool is_root = t.rank() == root;
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / es);
  for_each_segment(b.count, seg, [&](std::size_t s0, std::size_t m, bool first) {
    const Piece pc{b.at(s0), is_root ? m * es : 0};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int src, int dst) {
          return src == root && dst != root ? Range{0, m * es} : Range{};
        },
        first ? fp : nullptr);
    if (!is_root && m != 0) std::memcpy(b.at(s0), ptrs[static_cast<std::size_t>(root)], m * es);
  });
}
#endif  // DDP_BODIES

/// all_reduce of float32 values that travel and are reduced as `k`'s wire type (float16 or
/// bfloat16): each rank rounds its values to the wire type as it offers them (into the
/// shared-memory slot), the owner of a chunk reduces the wire values in float, in rank order,
/// and rounds the result once, and every rank writes the rounded result back as float32. The
/// result is bitwise that of converting, all_reduce on the wire type, and converting back, in
/// the passes over memory of a plain all_reduce, with half its bytes moved.
DDP_INLINE void all_reduce_as_on(Transport& t, RoundScratch& s, const Buf& b, const WireKernels& k,
                                 std::size_t ws, const Fingerprint& fp);
#if DDP_BODIES
DDP_INLINE void all_reduce_as_on(Transport& t, RoundScratch& s, const Buf& b, const WireKernels& k,
                                 std::size_t ws, const Fingerprint& fp) {
  const int p = t.size(), me = t.rank();
  // Memory for this rank's encoded offer: the next round's slot where the transport has one.
  const auto encoded = [&](std::size_t bytes, std::vector<std::byte>& own) {
    std::byte* at = t.stage(bytes);
    return at != nullptr ? at : RoundScratch::at_least(own, bytes);
  };
  if (b.count * ws <= t.small_bytes()) {  // one round; every rank reduces everything
    std::byte* enc = encoded(b.count * ws, s.bytes);
    k.encode(enc, b.data, b.count);
    const Piece pc{enc, b.count * ws};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int) {
          return Range{0, b.count * ws};
        },
        &fp);
    k.reduce(b.data, nullptr, ptrs.data(), p, b.count);
    return;
  }
  const std::size_t seg = std::max<std::size_t>(static_cast<std::size_t>(p), t.max_offer() / ws);
  bool first = true;
  for (std::size_t s0 = 0; s0 < b.count;) {
    const std::size_t m = std::min(seg, b.count - s0);
    const auto chunk = [&](int j) {  // in elements
      const auto [lo, hi] = split_range(m, p, j, ws);
      return Range{lo, hi - lo};
    };
    std::byte* enc = encoded(m * ws, s.bytes);
    k.encode(enc, b.at(s0), m);
    const Piece pc{enc, m * ws};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int dst) {
          const Range c = chunk(dst);
          return Range{c.off * ws, c.len * ws};
        },
        first ? &fp : nullptr);
    first = false;
    const Range mine = chunk(me);
    std::byte* result = encoded(mine.len * ws, s.wire);
    k.reduce(b.at(s0 + mine.off), result, ptrs.data(), p, mine.len);
    const Piece out{result, mine.len * ws};
    auto got = t.round(
        {&out, 1},
        [&](int src, int) {
          return Range{0, chunk(src).len * ws};
        },
        nullptr);
    for (int j = 0; j < p; ++j) {
      const Range c = chunk(j);
      if (j != me && c.len != 0)
        k.decode(b.at(s0 + c.off), got[static_cast<std::size_t>(j)], c.len);
    }
    s0 += m;
  }
}
#endif  // DDP_BODIES

/// scatter over `t`: block r of root's `in` into rank r's `out`.
DDP_INLINE void scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out, int root,
                           const Fingerprint& fp);
#if DDP_BODIES
DDP_INLINE void scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out, int root,
                           const Fingerprint& fp) {
  const std::size_t es = out.elem(), n = out.count;
  const auto p = static_cast<std::size_t>(t.size());
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / (es * p));
  for_each_segment(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
    s.pieces.clear();
    if (t.rank() == root) {
      for (std::size_t j = 0; j < p; ++j) s.pieces.push_back({in.at(j * n + s0), m * es});
    }
    auto ptrs = t.round(
        s.pieces,
        [&](int src, int dst) {
          return src == root ? Range{static_cast<std::size_t>(dst) * m * es, m * es} : Range{};
        },
        first ? &fp : nullptr);
    copy_if_distinct(out.at(s0), ptrs[static_cast<std::size_t>(root)], m * es);
  });
}
#endif  // DDP_BODIES

/// reduce_scatter over `t`: block r of the reduction of every rank's `in` into rank r's `out`.
DDP_INLINE void reduce_scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                                  ReduceFn fn, const Fingerprint& fp);
#if DDP_BODIES
DDP_INLINE void reduce_scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                                  ReduceFn fn, const Fingerprint& fp) {
  exchange_blocks(t, s, in, out.count, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
    fn(out.at(s0), nullptr, ptrs.data(), t.size(), m);
  });
}
#endif  // DDP_BODIES

/// all_to_all over `t`: block j of `in` to rank j, stored as its block r of `out`.
DDP_INLINE void all_to_all_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                              const Fingerprint& fp);
#if DDP_BODIES
DDP_INLINE void all_to_all_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                              const Fingerprint& fp) {
  const std::size_t n = in.count / static_cast<std::size_t>(t.size());
  exchange_blocks(t, s, in, n, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
    for (std::size_t j = 0; j < static_cast<std::size_t>(t.size()); ++j)
      copy_if_distinct(out.at(j * n + s0), ptrs[j], m * in.elem());
  });
}
#endif  // DDP_BODIES

/// all_gather (root < 0) or gather to t's rank `root` over `t`: every rank's `in`, in rank
/// order, into `out`.
DDP_INLINE void gather_on(Transport& t, const Buf& in, const Buf& out, int root,
                          const Fingerprint& fp);
#if DDP_BODIES
DDP_INLINE void gather_on(Transport& t, const Buf& in, const Buf& out, int root,
                          const Fingerprint& fp) {
  const std::size_t es = in.elem(), n = in.count;
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / es);
  for_each_segment(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
    const Piece pc{in.at(s0), m * es};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int dst) {
          return root < 0 || dst == root ? Range{0, m * es} : Range{};
        },
        first ? &fp : nullptr);
    if (root >= 0 && t.rank() != root) return;
    for (std::size_t j = 0; j < static_cast<std::size_t>(t.size()); ++j)
      copy_if_distinct(out.at(j * n + s0), ptrs[j], m * es);
  });
}
#endif  // DDP_BODIES

/// Rank j of `t` ends with the reduction, over t's ranks in their order, of part(j) of every
/// rank's `b` (a Range in elements), in place in its own `b`; the rest of `b` is only read.
template <class Part>
void reduce_scatter_parts(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn,
                          const Part& part, const Fingerprint* fp) {
  const int q = t.size(), me = t.rank();
  const std::size_t es = b.elem();
  const std::size_t seg =
      std::max<std::size_t>(1, t.max_offer() / (es * static_cast<std::size_t>(q)));
  std::size_t longest = 0;
  for (int j = 0; j < q; ++j) longest = std::max(longest, part(j).len);
  s.ranges.resize(static_cast<std::size_t>(q));
  for_each_segment(longest, seg, [&](std::size_t s0, std::size_t, bool first) {
    s.pieces.clear();
    std::size_t at = 0;
    for (int j = 0; j < q; ++j) {
      const Range pj = part(j);
      const std::size_t n = pj.len > s0 ? std::min(seg, pj.len - s0) : 0;
      s.pieces.push_back({n != 0 ? b.at(pj.off + s0) : b.data, n * es});
      s.ranges[static_cast<std::size_t>(j)] = Range{at, n * es};
      at += n * es;
    }
    auto ptrs = t.round(
        s.pieces, [&](int, int dst) { return s.ranges[static_cast<std::size_t>(dst)]; },
        first ? fp : nullptr);
    const std::size_t n = s.ranges[static_cast<std::size_t>(me)].len / es;
    if (n != 0) fn(b.at(part(me).off + s0), nullptr, ptrs.data(), q, n);
  });
}

/// Every rank of `t` ends with every rank j's part(j) of `b` (its own part is offered).
template <class Part>
void all_gather_parts(Transport& t, const Buf& b, const Part& part) {
  const int q = t.size(), me = t.rank();
  const std::size_t es = b.elem();
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / es);
  std::size_t longest = 0;
  for (int j = 0; j < q; ++j) longest = std::max(longest, part(j).len);
  const auto len = [&](int j, std::size_t s0) {
    const std::size_t l = part(j).len;
    return l > s0 ? std::min(seg, l - s0) : std::size_t{0};
  };
  for_each_segment(longest, seg, [&](std::size_t s0, std::size_t, bool) {
    const std::size_t n = len(me, s0);
    const Piece pc{n != 0 ? b.at(part(me).off + s0) : b.data, n * es};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int src, int) {
          return Range{0, len(src, s0) * es};
        },
        nullptr);
    for (int j = 0; j < q; ++j) {
      const std::size_t k = len(j, s0);
      if (j != me && k != 0)
        std::memcpy(b.at(part(j).off + s0), ptrs[static_cast<std::size_t>(j)], k * es);
    }
  });
}

}  // namespace detail
DDP_END_NAMESPACE
