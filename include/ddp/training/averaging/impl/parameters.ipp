// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/training/averaging/parameters.hpp>'s non-template functions. That header
// includes this file at its bottom, and nothing else does: in the header-only mode in every unit,
// in the separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cstring>

#if !DDP_HAS_CUDA  // host memory only: the copies of ddp/cuda.hpp without their CUDA half
DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void copy_bytes(void* dst, const void* src, std::size_t n, bool, void*) {
  if (n != 0) std::memcpy(dst, src, n);
}

DDP_INLINE void zero_bytes(void* dst, std::size_t n, bool, void*) {
  if (n != 0) std::memset(dst, 0, n);
}

}  // namespace detail
DDP_END_NAMESPACE
#endif
