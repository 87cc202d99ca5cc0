// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The Host backend's round primitives, over the Transport contract (transport.hpp): how a
/// buffer is cut into segments that fit a round, how a segment is split among the ranks
/// (cache-line-aligned chunks), and the scratch memory the algorithms reuse between calls. The
/// algorithms built on them are flat.hpp (one transport), single_copy.hpp and hierarchy.hpp.

#include "ddp/backend/collective.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/config.hpp"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Memory the algorithms reuse from call to call (first touch of fresh memory is slow): one per
/// communicator, used by one collective at a time.
struct RoundScratch {
  std::vector<Piece> pieces;
  std::vector<Range> ranges;
  std::vector<std::byte> bytes;
  std::vector<std::byte> wire;  ///< all_reduce_as's encoded results without a staging slot (TCP)
  std::vector<const std::byte*> ptrs;

  /// At least `n` bytes of `v`.
  static std::byte* at_least(std::vector<std::byte>& v, std::size_t n);
};

/// Element range [lo, hi) of part j when m elements are split into `parts` cache-line-aligned
/// parts (the last takes the remainder; parts may be empty).
[[nodiscard]] DDP_INLINE std::pair<std::size_t, std::size_t> split_range(std::size_t m, int parts,
                                                                         int j, std::size_t elem);

/// Calls f(start, count, first) for each segment of at most `seg` elements; at least once, so
/// that an empty collective still synchronizes and checks fingerprints.
template <class F>
void for_each_segment(std::size_t n, std::size_t seg, F&& f) {
  std::size_t s0 = 0;
  bool first = true;
  do {
    const std::size_t m = std::min(seg, n - s0);
    f(s0, m, first);
    first = false;
    s0 += m;
  } while (s0 < n);
}

DDP_INLINE void copy_if_distinct(std::byte* dst, const std::byte* src, std::size_t n);

/// Elements per segment of the large-message paths: a slot's worth (at least one per rank).
[[nodiscard]] DDP_INLINE std::size_t segment_elements(const Transport& t, std::size_t es);

/// Chunk j of a segment of m elements split among p ranks, in bytes from the segment's start.
[[nodiscard]] DDP_INLINE Range chunk_bytes(std::size_t m, int p, int j, std::size_t es);

/// A round in which no rank offers anything: every rank has reached it (and, with `fp`, called
/// the same collective).
DDP_INLINE void empty_round(Transport& t, const Fingerprint* fp);

/// `in` holds one block of n elements per rank; in segments, rank j receives segment part of
/// block j from every rank, and use(start, count, ptrs) consumes it (ptrs[r]: rank r's part).
template <class Use>
void exchange_blocks(Transport& t, RoundScratch& s, const Buf& in, std::size_t n,
                     const Fingerprint& fp, Use&& use) {
  const std::size_t es = in.elem();
  const auto p = static_cast<std::size_t>(t.size());
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / (es * p));
  for_each_segment(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
    s.pieces.clear();
    for (std::size_t j = 0; j < p; ++j) s.pieces.push_back({in.at(j * n + s0), m * es});
    auto ptrs = t.round(
        s.pieces,
        [&](int, int dst) {
          return Range{static_cast<std::size_t>(dst) * m * es, m * es};
        },
        first ? &fp : nullptr);
    use(s0, m, ptrs);
  });
}

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/rounds.ipp"
#endif
