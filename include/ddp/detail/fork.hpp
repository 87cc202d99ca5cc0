// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Fork detection: a counter that pthread_atfork bumps in every child, so an object can tell in
/// one relaxed load whether it is still in the process that made it (getpid() is a system call).

#include "ddp/config.hpp"

#include <pthread.h>

#include <atomic>
#include <cstdint>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::atomic<std::uint64_t>& fork_counter() noexcept;

/// How many fork()s separate this process from the first process that called this function:
/// equal values mean "the same process". The first call registers the fork handler.
[[nodiscard]] DDP_INLINE std::uint64_t fork_generation() noexcept;

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/fork.ipp"
#endif
