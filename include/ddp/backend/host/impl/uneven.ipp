// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/uneven.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::vector<std::uint64_t> agree_on_sizes(Transport& t, const UnevenPlan& mine,
                                                     const Fingerprint& fp) {
  const auto p = static_cast<std::size_t>(t.size());
  std::vector<std::uint64_t> row = mine.row(), all(2 * p * p);
  const Buf in{reinterpret_cast<std::byte*>(row.data()), row.size(), DType::uint64};
  const Buf out{reinterpret_cast<std::byte*>(all.data()), all.size(), DType::uint64};
  gather_on(t, in, out, -1, fp);
  return agreed_sizes(all, p, t.rank(), to_string(fp), [&](int j) { return t.global(j); });
}

DDP_INLINE void all_to_all_v_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                                std::span<const std::size_t> in_counts,
                                std::span<const std::size_t> out_counts, const Fingerprint& fp) {
  const auto c = agree_on_sizes(t, UnevenPlan::all_to_all(in_counts, out_counts), fp);
  const auto send_at = block_offsets(in_counts), recv_at = block_offsets(out_counts);
  move_uneven(
      t, s, in, out, c, false, [&](int j) { return send_at[static_cast<std::size_t>(j)]; },
      [&](int j) { return recv_at[static_cast<std::size_t>(j)]; });
}

DDP_INLINE void gather_v_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                            std::span<const std::size_t> counts, int root, const Fingerprint& fp) {
  const auto p = static_cast<std::size_t>(t.size());
  const bool receives = root < 0 || root == t.rank();
  const auto c =
      agree_on_sizes(t, UnevenPlan::gather(t.size(), t.rank(), in.count, counts, root), fp);
  std::vector<std::size_t> recv_at(p, 0);
  if (receives) recv_at = block_offsets(counts);
  move_uneven(
      t, s, in, out, c, root < 0, [](int) { return std::size_t{0}; },
      [&](int j) { return recv_at[static_cast<std::size_t>(j)]; });
}

DDP_INLINE void scatter_v_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                             std::span<const std::size_t> counts, int root, const Fingerprint& fp) {
  const auto p = static_cast<std::size_t>(t.size());
  const auto c =
      agree_on_sizes(t, UnevenPlan::scatter(t.size(), t.rank(), out.count, counts, root), fp);
  std::vector<std::size_t> send_at(p, 0);
  if (t.rank() == root) send_at = block_offsets(counts);
  move_uneven(
      t, s, in, out, c, false, [&](int j) { return send_at[static_cast<std::size_t>(j)]; },
      [](int) { return std::size_t{0}; });
}

}  // namespace detail
DDP_END_NAMESPACE
