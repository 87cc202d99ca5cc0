// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/owner.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void OwnerProcess::check_process(int rank, const char* what) const {
  if (inherited()) [[unlikely]] {
    fail(Errc::invalid_argument, "rank ", rank, ": ", what,
         ": this communicator was created by process ", pid,
         " and cannot be used by a child it fork()ed (this is process ", ::getpid(),
         "): the child would write into the parent's connections and shared memory. Create a "
         "new communicator in the child (another MASTER_PORT or Options::group), or fork "
         "before init()");
  }
}

}  // namespace detail
DDP_END_NAMESPACE
