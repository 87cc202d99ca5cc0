// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::OwnerProcess: the process that made a communicator, and the fork() check of every
/// call (a child shares its parent's peers' shared memory and sockets).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/fork.hpp"
#include "ddp/error.hpp"

#include <unistd.h>

#include <cstdint>

DDP_BEGIN_NAMESPACE
namespace detail {

struct OwnerProcess {
  std::uint64_t fork_generation = detail::fork_generation();  // made in this process
  int pid = static_cast<int>(::getpid());

  /// Whether this is a fork() child's copy.
  [[nodiscard]] bool inherited() const noexcept {
    return detail::fork_generation() != fork_generation;
  }

  /// The fork() check of every call: a child shares its parent's peers' shared memory and
  /// sockets, and using them would corrupt the parent's job.
  void check_process(int rank, const char* what) const;
};

#if DDP_BODIES
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
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
