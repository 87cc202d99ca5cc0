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

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/owner.ipp"
#endif
