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

/// all_reduce of a buffer of at most t.small_bytes(): one round gathers every rank's whole
/// buffer and every rank reduces all of them.
DDP_INLINE void all_reduce_small(Transport& t, const Buf& b, ReduceFn fn, const Fingerprint* fp);

/// reduce over `t`: the reduction lands in the buffer of t's rank `root` only.
DDP_INLINE void reduce_on(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, int root,
                          const Fingerprint* fp);

/// broadcast over `t` from t's rank `root`.
DDP_INLINE void broadcast_on(Transport& t, const Buf& b, int root, const Fingerprint* fp);

/// all_reduce of float32 values that travel and are reduced as `k`'s wire type (float16 or
/// bfloat16): each rank rounds its values to the wire type as it offers them (into the
/// shared-memory slot), the owner of a chunk reduces the wire values in float, in rank order,
/// and rounds the result once, and every rank writes the rounded result back as float32. The
/// result is bitwise that of converting, all_reduce on the wire type, and converting back, in
/// the passes over memory of a plain all_reduce, with half its bytes moved.
DDP_INLINE void all_reduce_as_on(Transport& t, RoundScratch& s, const Buf& b, const WireKernels& k,
                                 std::size_t ws, const Fingerprint& fp);

/// scatter over `t`: block r of root's `in` into rank r's `out`.
DDP_INLINE void scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out, int root,
                           const Fingerprint& fp);

/// reduce_scatter over `t`: block r of the reduction of every rank's `in` into rank r's `out`.
DDP_INLINE void reduce_scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                                  ReduceFn fn, const Fingerprint& fp);

/// all_to_all over `t`: block j of `in` to rank j, stored as its block r of `out`.
DDP_INLINE void all_to_all_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                              const Fingerprint& fp);

/// all_gather (root < 0) or gather to t's rank `root` over `t`: every rank's `in`, in rank
/// order, into `out`.
DDP_INLINE void gather_on(Transport& t, const Buf& in, const Buf& out, int root,
                          const Fingerprint& fp);

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

#if DDP_BODIES
#include "ddp/backend/host/impl/flat.ipp"
#endif
