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
#if DDP_BODIES
DDP_INLINE std::atomic<std::uint64_t>& fork_counter() noexcept {
  static std::atomic<std::uint64_t> n{0};
  return n;
}
#endif  // DDP_BODIES

/// How many fork()s separate this process from the first process that called this function:
/// equal values mean "the same process". The first call registers the fork handler.
[[nodiscard]] DDP_INLINE std::uint64_t fork_generation() noexcept;
#if DDP_BODIES
DDP_INLINE std::uint64_t fork_generation() noexcept {
  static const bool registered = [] {
    (void)::pthread_atfork(nullptr, nullptr,
                           [] { fork_counter().fetch_add(1, std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  return fork_counter().load(std::memory_order_relaxed);
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
