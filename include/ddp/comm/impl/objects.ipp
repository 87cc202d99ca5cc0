// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/objects.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void check_object_size(std::int64_t n, int rank, const char* what, int from) {
  if (n < 0 || n > max_object_bytes) {
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": rank ", from,
         "'s object encodes to ", n, " bytes, beyond the limit of ", max_object_bytes);
  }
}

}  // namespace detail
DDP_END_NAMESPACE
