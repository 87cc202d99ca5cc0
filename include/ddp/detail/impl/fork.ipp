// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/fork.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::atomic<std::uint64_t>& fork_counter() noexcept {
  static std::atomic<std::uint64_t> n{0};
  return n;
}

DDP_INLINE std::uint64_t fork_generation() noexcept {
  static const bool registered = [] {
    (void)::pthread_atfork(nullptr, nullptr,
                           [] { fork_counter().fetch_add(1, std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  return fork_counter().load(std::memory_order_relaxed);
}

}  // namespace detail
DDP_END_NAMESPACE
