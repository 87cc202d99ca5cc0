// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The collectives of uneven sizes (all_to_all with split sizes; all_gather, gather and scatter
/// with a count per rank), as every backend checks them: each rank says what it believes of the
/// exchange (an UnevenPlan: the elements it sends to each rank and expects from each), the
/// ranks share their plans, and every rank checks every pair the same way, so that counts that
/// disagree fail on every rank with Errc::mismatch naming the pair, before any data moves.

#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// What one rank believes of an uneven exchange among p ranks: sends[j], the elements it sends
/// to rank j, and recvs[j], those it expects from rank j. row() is what it shares.
struct UnevenPlan {
  std::vector<std::uint64_t> sends, recvs;

  [[nodiscard]] std::vector<std::uint64_t> row() const;

  /// all_to_all: in_counts[j] to rank j, out_counts[j] from it.
  static UnevenPlan all_to_all(std::span<const std::size_t> in_counts,
                               std::span<const std::size_t> out_counts) {
    return {{in_counts.begin(), in_counts.end()}, {out_counts.begin(), out_counts.end()}};
  }
  /// all_gather (root < 0) or gather: `in_count` elements to every rank (the root); the root
  /// (every rank) expects counts[j] from rank j.
  static UnevenPlan gather(int p, int rank, std::size_t in_count,
                           std::span<const std::size_t> counts, int root);
  /// scatter: the root sends counts[j] to rank j; every rank expects `out_count` from the root.
  static UnevenPlan scatter(int p, int rank, std::size_t out_count,
                            std::span<const std::size_t> counts, int root);
};

/// Every rank's row (rows[r * 2p ...], as UnevenPlan::row) checked pair by pair: returns
/// sends[src * p + dst]; fails with Errc::mismatch naming the first pair that disagrees.
/// `global(j)`: the communicator's number of rank j; `what`: the call, for the message.
template <class Global>
[[nodiscard]] std::vector<std::uint64_t> agreed_sizes(std::span<const std::uint64_t> rows,
                                                      std::size_t p, int rank,
                                                      std::string_view what, const Global& global) {
  std::vector<std::uint64_t> sends(p * p);
  for (std::size_t src = 0; src < p; ++src) {
    for (std::size_t dst = 0; dst < p; ++dst) {
      const std::uint64_t s = rows[src * 2 * p + dst], r = rows[dst * 2 * p + p + src];
      if (s != r) {
        fail(Errc::mismatch, "rank ", global(rank), ": ", what,
             ": the ranks disagree on the sizes: rank ", global(static_cast<int>(src)), " sends ",
             s, " elements to rank ", global(static_cast<int>(dst)), ", which expects ", r,
             " from it; the counts every rank passes must match the other ranks' (each rank "
             "fails with this message)");
      }
      sends[src * p + dst] = s;
    }
  }
  return sends;
}

/// Offsets of consecutive blocks of the given sizes.
[[nodiscard]] DDP_INLINE std::vector<std::size_t> block_offsets(
    std::span<const std::size_t> counts);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/impl/uneven.ipp"
#endif
