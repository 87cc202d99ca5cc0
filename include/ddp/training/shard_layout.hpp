// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ShardLayout: how one rank's shard of some arrays is laid out (the arrays' sizes and the pieces
/// it holds), and its encoding in a sharded checkpoint section's companion ("ddp.sharded.<name>").

#include "ddp/config.hpp"
#include "ddp/error.hpp"

#include <algorithm>
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

#if DDP_BODIES
DDP_INLINE std::size_t ShardLayout::elements() const noexcept {
  std::size_t n = 0;
  for (const ShardRange& r : ranges) n += r.size;
  return n;
}

DDP_INLINE ShardLayout ShardLayout::even(std::vector<std::size_t> sizes, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world)
    detail::fail(Errc::invalid_argument, "ShardLayout::even: rank ", rank, " of ", world, " ranks");
  ShardLayout out;
  const auto p = static_cast<std::size_t>(world), r = static_cast<std::size_t>(rank);
  for (std::size_t a = 0; a < sizes.size(); ++a) {
    const std::size_t n = sizes[a], base = n / p, extra = n % p;
    const std::size_t size = base + (r < extra ? 1 : 0);
    if (size != 0) out.ranges.push_back({a, r * base + std::min(r, extra), size});
  }
  out.sizes = std::move(sizes);
  return out;
}
#endif  // DDP_BODIES

namespace detail {
/// The companion section of sharded section `name`: its element size and layout.
inline std::string layout_section(std::string_view name) { return concat("ddp.sharded.", name); }
/// A layout and its element size as words: bytes, array count, sizes, then (array, offset, size)
/// per piece.
DDP_INLINE std::vector<std::uint64_t> layout_words(std::size_t element_bytes, const ShardLayout& l);
#if DDP_BODIES
DDP_INLINE std::vector<std::uint64_t> layout_words(std::size_t element_bytes,
                                                   const ShardLayout& l) {
  std::vector<std::uint64_t> w{element_bytes, l.sizes.size()};
  w.insert(w.end(), l.sizes.begin(), l.sizes.end());
  for (const ShardRange& r : l.ranges) w.insert(w.end(), {r.array, r.offset, r.size});
  return w;
}
#endif  // DDP_BODIES
/// Errc::invalid_argument (`what`: where it came from) unless `l`'s pieces lie within its arrays.
DDP_INLINE void check_layout(const ShardLayout& l, std::string_view what);
#if DDP_BODIES
DDP_INLINE void check_layout(const ShardLayout& l, std::string_view what) {
  for (const ShardRange& r : l.ranges) {
    if (r.array >= l.sizes.size() || r.offset > l.sizes[r.array] ||
        r.size > l.sizes[r.array] - r.offset)
      fail(Errc::invalid_argument, what, ": the piece [", r.offset, ", ", r.offset + r.size,
           ") of array ", r.array, " lies outside the ", l.sizes.size(), " arrays' sizes");
  }
}
#endif  // DDP_BODIES
/// layout_words back: the element size and the layout; Errc::protocol when malformed.
DDP_INLINE std::pair<std::size_t, ShardLayout> layout_of_words(const std::vector<std::uint64_t>& w,
                                                               std::string_view what);
#if DDP_BODIES
DDP_INLINE std::pair<std::size_t, ShardLayout> layout_of_words(const std::vector<std::uint64_t>& w,
                                                               std::string_view what) {
  const auto bad = [&] {
    fail(Errc::protocol, what, ": the layout of a sharded section is damaged");
  };
  if (w.size() < 2 || w[0] == 0 || w[1] > w.size() - 2 || (w.size() - 2 - w[1]) % 3 != 0) bad();
  ShardLayout l;
  const auto arrays = static_cast<std::size_t>(w[1]);
  l.sizes.assign(w.begin() + 2, w.begin() + 2 + static_cast<std::ptrdiff_t>(arrays));
  for (std::size_t i = 2 + arrays; i < w.size(); i += 3)
    l.ranges.push_back({w[i], w[i + 1], w[i + 2]});
  try {
    check_layout(l, what);
  } catch (const Error&) {
    bad();
  }
  return {static_cast<std::size_t>(w[0]), std::move(l)};
}
#endif  // DDP_BODIES
}  // namespace detail

DDP_END_NAMESPACE
