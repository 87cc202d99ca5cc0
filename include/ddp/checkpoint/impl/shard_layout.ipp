// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/checkpoint/shard_layout.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>

DDP_BEGIN_NAMESPACE

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
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::vector<std::uint64_t> layout_words(std::size_t element_bytes,
                                                   const ShardLayout& l) {
  std::vector<std::uint64_t> w{element_bytes, l.sizes.size()};
  w.insert(w.end(), l.sizes.begin(), l.sizes.end());
  for (const ShardRange& r : l.ranges) w.insert(w.end(), {r.array, r.offset, r.size});
  return w;
}

DDP_INLINE void check_layout(const ShardLayout& l, std::string_view what) {
  for (const ShardRange& r : l.ranges) {
    if (r.array >= l.sizes.size() || r.offset > l.sizes[r.array] ||
        r.size > l.sizes[r.array] - r.offset)
      fail(Errc::invalid_argument, what, ": the piece [", r.offset, ", ", r.offset + r.size,
           ") of array ", r.array, " lies outside the ", l.sizes.size(), " arrays' sizes");
  }
}

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

}  // namespace detail
DDP_END_NAMESPACE
