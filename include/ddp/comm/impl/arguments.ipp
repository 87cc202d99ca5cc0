// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/arguments.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::vector<std::size_t> joined_counts(std::span<const std::size_t> a,
                                                  std::span<const std::size_t> b, Caller caller) {
  check_entries(a, caller, "all_to_all", "in_counts");
  check_entries(b, caller, "all_to_all", "out_counts");
  std::vector<std::size_t> v(a.begin(), a.end());
  v.insert(v.end(), b.begin(), b.end());
  return v;
}

}  // namespace detail
DDP_END_NAMESPACE
