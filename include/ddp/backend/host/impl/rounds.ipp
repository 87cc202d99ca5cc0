// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/rounds.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::byte* RoundScratch::at_least(std::vector<std::byte>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

DDP_INLINE std::pair<std::size_t, std::size_t> split_range(std::size_t m, int parts, int j,
                                                           std::size_t elem) {
  const std::size_t align = std::max<std::size_t>(1, 64 / elem);
  const auto bound = [&](int k) -> std::size_t {
    if (k >= parts) return m;
    const std::size_t b = m * static_cast<std::size_t>(k) / static_cast<std::size_t>(parts);
    return b / align * align;
  };
  return {bound(j), bound(j + 1)};
}

DDP_INLINE void copy_if_distinct(std::byte* dst, const std::byte* src, std::size_t n) {
  if (n != 0 && dst != src) std::memcpy(dst, src, n);
}

DDP_INLINE std::size_t segment_elements(const Transport& t, std::size_t es) {
  return std::max<std::size_t>(static_cast<std::size_t>(t.size()), t.max_offer() / es);
}

DDP_INLINE Range chunk_bytes(std::size_t m, int p, int j, std::size_t es) {
  const auto [lo, hi] = split_range(m, p, j, es);
  return Range{lo * es, (hi - lo) * es};
}

DDP_INLINE void empty_round(Transport& t, const Fingerprint* fp) {
  (void)t.round(
      {}, [](int, int) { return Range{}; }, fp);
}

}  // namespace detail
DDP_END_NAMESPACE
