// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/dispatch.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void premultiply(const Buf& h, double factor, int rank, const char* what) {
  if (h.count == 0) return;
  if (h.device.is_cuda())
    fail(Errc::unsupported, "rank ", rank, ": ", what, "(", to_string(h.dtype),
         ", op premul_sum): the buffer is on ", to_string(h.device),
         " and this backend moves it itself; ddp's headers carry no GPU kernels to multiply it "
         "(backend::Nccl applies the factor itself): multiply on the device and use sum");
  scale_fn(h.dtype)(h.data, h.count, factor);
}

}  // namespace detail
DDP_END_NAMESPACE
