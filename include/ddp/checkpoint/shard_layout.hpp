// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ShardLayout: how one rank's shard of some arrays is laid out (the arrays' sizes and the pieces
/// it holds), and its encoding in a sharded checkpoint section's companion ("ddp.sharded.<name>").

#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Elements [offset, offset + size) of array number `array`: one piece of a rank's shard.
struct ShardRange {
  std::size_t array = 0;   ///< Which array (a parameter's index, for ShardedAverager).
  std::size_t offset = 0;  ///< The piece's first element within the array.
  std::size_t size = 0;    ///< Its element count.
  /// Equal when all three are.
  friend bool operator==(const ShardRange&, const ShardRange&) = default;
};

/// How one rank's shard of some arrays is laid out: every array's element count, and the pieces
/// this rank holds, in the order its values are stored. A sharded section of a checkpoint records
/// it (Checkpoint::put_sharded), so that load_sharded_checkpoint can cut the arrays again for
/// another world size. ShardedAverager::layout() is its shard's.
struct ShardLayout {
  std::vector<std::size_t> sizes;  ///< Element count of array 0, 1, ...
  std::vector<ShardRange> ranges;  ///< This rank's pieces, in the order of its values.

  /// Elements held: the pieces' sizes added up.
  [[nodiscard]] std::size_t elements() const noexcept;
  /// Rank `rank` of `world`'s share when each array is cut into `world` contiguous blocks, the
  /// first size % world of them one element longer (a block may be empty): the layout
  /// load_sharded_checkpoint gives a section on a world size other than the one that saved it.
  [[nodiscard]] static ShardLayout even(std::vector<std::size_t> sizes, int rank, int world);
  /// Equal when the sizes and the pieces (in order) are.
  friend bool operator==(const ShardLayout&, const ShardLayout&) = default;
};

namespace detail {
/// The companion section of sharded section `name`: its element size and layout.
inline std::string layout_section(std::string_view name) { return concat("ddp.sharded.", name); }
/// A layout and its element size as words: bytes, array count, sizes, then (array, offset, size)
/// per piece.
DDP_INLINE std::vector<std::uint64_t> layout_words(std::size_t element_bytes, const ShardLayout& l);
/// Errc::invalid_argument (`what`: where it came from) unless `l`'s pieces lie within its arrays.
DDP_INLINE void check_layout(const ShardLayout& l, std::string_view what);
/// layout_words back: the element size and the layout; Errc::protocol when malformed.
DDP_INLINE std::pair<std::size_t, ShardLayout> layout_of_words(const std::vector<std::uint64_t>& w,
                                                               std::string_view what);
}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/checkpoint/impl/shard_layout.ipp"
#endif
