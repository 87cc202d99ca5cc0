// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/wait.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cerrno>
#include <climits>
#include <ctime>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();  // _mm_pause without <immintrin.h> (0.4 s of every compile)
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

DDP_INLINE void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long ns) {
  timespec ts{ns / 1000000000L, ns % 1000000000L};
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts,
                  nullptr, 0);
}

DDP_INLINE void futex_wake_all(std::atomic<std::uint32_t>* word) {
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr,
                  nullptr, 0);
}

DDP_INLINE void WakeWord::notify() noexcept {
  if (sleepers.load(std::memory_order_seq_cst) != 0) {
    epoch.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&epoch);
  }
}

DDP_INLINE int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return CPU_COUNT(&set);
}

DDP_INLINE void ProcessWatch::add(int rank, int pid) {
#ifdef SYS_pidfd_open
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  const int fd = -1;
#endif
  watched_.push_back({rank, pid, fd});
}

DDP_INLINE void ProcessWatch::forget(int rank) {
  for (auto& w : watched_) {
    if (w.rank != rank) continue;
    if (w.fd >= 0) ::close(w.fd);
    w = watched_.back();
    watched_.pop_back();
    return;
  }
}

DDP_INLINE int ProcessWatch::first_dead() const {
  for (const auto& w : watched_) {
    if (w.fd >= 0) {
      pollfd p{w.fd, POLLIN, 0};
      if (::poll(&p, 1, 0) == 1) return w.rank;
    } else if (::kill(w.pid, 0) != 0 && errno == ESRCH) {
      return w.rank;
    }
  }
  return -1;
}

}  // namespace detail
DDP_END_NAMESPACE
