// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The Host backend's collectives of uneven sizes over rounds (all_to_all with split sizes,
/// all_gather, gather and scatter with a count per rank), on any transport.
///
/// Each starts with a sizes round: every rank offers its plan (backend/uneven.hpp), so that
/// every rank holds the whole matrix and checks it the same way before any data moves. The data
/// then moves in rounds of at most a slot, each rank's offer holding the next chunk of each of its
/// blocks; every rank computes the same number of rounds from the same matrix.

#include "ddp/backend/collective.hpp"
#include "ddp/backend/host/flat.hpp"
#include "ddp/backend/host/rounds.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/backend/uneven.hpp"
#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The sizes round: every rank's plan to every rank (the collective's first round, checked
/// against `fp`); returns the agreed matrix sends[src * p + dst] (agreed_sizes).
[[nodiscard]] DDP_INLINE std::vector<std::uint64_t> agree_on_sizes(Transport& t,
                                                                   const UnevenPlan& mine,
                                                                   const Fingerprint& fp);

/// Moves an agreed uneven exchange: rank src sends C[src][dst] elements of its `in`, from
/// element send_at(dst), to rank dst, which stores them in its `out` from element recv_at(src).
/// `shared`: every rank sends the same elements to every rank (all_gather), offered once.
template <class SendAt, class RecvAt>
void move_uneven(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                 const std::vector<std::uint64_t>& c, bool shared, const SendAt& send_at,
                 const RecvAt& recv_at) {
  const int q = t.size(), me = t.rank();
  const auto p = static_cast<std::size_t>(q);
  const std::size_t es = (in.count != 0 ? in : out).elem();
  const auto count = [&](int src, int dst) {
    return static_cast<std::size_t>(
        c[static_cast<std::size_t>(src) * p + static_cast<std::size_t>(dst)]);
  };
  const std::size_t self = count(me, me);
  if (self != 0) copy_if_distinct(out.at(recv_at(me)), in.at(send_at(me)), self * es);
  // Elements per block and round for each sender: a slot's worth, shared among its blocks.
  std::vector<std::size_t> seg(p);
  std::size_t rounds = 0;
  for (int src = 0; src < q; ++src) {
    std::size_t blocks = 0;
    for (int dst = 0; dst < q; ++dst) {
      if (dst != src && count(src, dst) != 0) ++blocks;
    }
    if (shared) blocks = std::min<std::size_t>(blocks, 1);
    seg[static_cast<std::size_t>(src)] =
        std::max<std::size_t>(1, t.max_offer() / (es * std::max<std::size_t>(1, blocks)));
    for (int dst = 0; dst < q; ++dst) {
      if (dst == src) continue;
      const std::size_t sg = seg[static_cast<std::size_t>(src)];
      rounds = std::max(rounds, (count(src, dst) + sg - 1) / sg);
    }
  }
  std::vector<Range>& at = s.ranges;  // at[src * p + dst]: dst's range of src's offer, in bytes
  at.resize(p * p);
  for (std::size_t k = 0; k < rounds; ++k) {
    const auto len = [&](int src, int dst) -> std::size_t {
      if (src == dst) return 0;
      const std::size_t sg = seg[static_cast<std::size_t>(src)], from = k * sg;
      const std::size_t n = count(src, dst);
      return n > from ? std::min(sg, n - from) : 0;
    };
    for (int src = 0; src < q; ++src) {
      std::size_t off = 0;
      for (int dst = 0; dst < q; ++dst) {
        const std::size_t l = len(src, dst) * es;
        at[static_cast<std::size_t>(src) * p + static_cast<std::size_t>(dst)] = Range{off, l};
        if (!shared) off += l;
      }
    }
    s.pieces.clear();
    for (int dst = 0; dst < q; ++dst) {
      const std::size_t l = len(me, dst);
      if (l == 0) continue;
      s.pieces.push_back({in.at(send_at(dst) + k * seg[static_cast<std::size_t>(me)]), l * es});
      if (shared) break;
    }
    auto ptrs = t.round(
        s.pieces,
        [&](int src, int dst) {
          return at[static_cast<std::size_t>(src) * p + static_cast<std::size_t>(dst)];
        },
        nullptr);
    for (int src = 0; src < q; ++src) {
      const std::size_t l = len(src, me);
      if (l != 0)
        std::memcpy(out.at(recv_at(src) + k * seg[static_cast<std::size_t>(src)]),
                    ptrs[static_cast<std::size_t>(src)], l * es);
    }
  }
}

/// all_to_all with split sizes: in_counts[j] elements of `in` (consecutive blocks) to rank j;
/// out_counts[j] elements from rank j into `out`.
DDP_INLINE void all_to_all_v_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                                std::span<const std::size_t> in_counts,
                                std::span<const std::size_t> out_counts, const Fingerprint& fp);

/// all_gather (root < 0) or gather to `root` with a count per rank: rank j's `in` (counts[j]
/// elements) into `out` at the sum of the counts before j. `counts` is read where `out` is.
DDP_INLINE void gather_v_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                            std::span<const std::size_t> counts, int root, const Fingerprint& fp);

/// scatter with a count per rank: counts[j] elements of root's `in` (consecutive blocks) into
/// rank j's `out`. `counts` is read on the root.
DDP_INLINE void scatter_v_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                             std::span<const std::size_t> counts, int root, const Fingerprint& fp);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/uneven.ipp"
#endif
