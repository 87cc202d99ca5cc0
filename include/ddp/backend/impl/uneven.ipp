// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/uneven.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::vector<std::uint64_t> UnevenPlan::row() const {
  std::vector<std::uint64_t> r(sends);
  r.insert(r.end(), recvs.begin(), recvs.end());
  return r;
}

DDP_INLINE UnevenPlan UnevenPlan::gather(int p, int rank, std::size_t in_count,
                                         std::span<const std::size_t> counts, int root) {
  UnevenPlan plan{std::vector<std::uint64_t>(static_cast<std::size_t>(p)),
                  std::vector<std::uint64_t>(static_cast<std::size_t>(p))};
  for (int j = 0; j < p; ++j) {
    if (root < 0 || j == root) plan.sends[static_cast<std::size_t>(j)] = in_count;
    if (root < 0 || rank == root)
      plan.recvs[static_cast<std::size_t>(j)] = counts[static_cast<std::size_t>(j)];
  }
  return plan;
}

DDP_INLINE UnevenPlan UnevenPlan::scatter(int p, int rank, std::size_t out_count,
                                          std::span<const std::size_t> counts, int root) {
  UnevenPlan plan{std::vector<std::uint64_t>(static_cast<std::size_t>(p)),
                  std::vector<std::uint64_t>(static_cast<std::size_t>(p))};
  plan.recvs[static_cast<std::size_t>(root)] = out_count;
  if (rank == root) plan.sends.assign(counts.begin(), counts.end());
  return plan;
}

DDP_INLINE std::vector<std::size_t> block_offsets(std::span<const std::size_t> counts) {
  std::vector<std::size_t> at(counts.size());
  std::size_t sum = 0;
  for (std::size_t j = 0; j < counts.size(); ++j) {
    at[j] = sum;
    sum += counts[j];
  }
  return at;
}

}  // namespace detail
DDP_END_NAMESPACE
