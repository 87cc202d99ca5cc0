// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Waiting for another process: spin briefly (a peer on another core answers in well under a
/// microsecond), then sleep on a futex in shared memory, so that 4 ranks on 2 cores do not burn
/// the core the awaited rank needs. Posters wake sleepers only when there are any (a Dekker-style
/// handshake on `sleepers`), so the fast path costs no system call.
///
/// Also here: watching peer processes for death with pidfds (a dead peer makes its waiters fail
/// with Errc::peer_lost in milliseconds, not at the timeout).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"

#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void cpu_relax() noexcept;

static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));

/// FUTEX_WAIT on a word in (possibly shared) memory for at most `ns` nanoseconds.
DDP_INLINE void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long ns);

DDP_INLINE void futex_wake_all(std::atomic<std::uint32_t>* word);

/// The sleeping half of the handshake; lives in shared memory.
struct WakeWord {
  std::atomic<std::uint32_t> epoch{0};
  std::atomic<std::uint32_t> sleepers{0};

  /// Call after publishing progress (with a seq_cst store).
  void notify() noexcept;

  /// Sleeps until notified (or for at most `ns`) unless `ready()` holds after registering.
  template <class Ready>
  void sleep_unless(Ready&& ready, long ns) noexcept {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    const std::uint32_t e = epoch.load(std::memory_order_seq_cst);
    if (!ready()) futex_wait(&epoch, e, ns);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
};

/// Number of CPUs this process may run on.
[[nodiscard]] DDP_INLINE int usable_cpus();

/// Watches processes for exit. pidfds become readable when a process exits (a zombie counts as
/// exited); without pidfd_open (Linux < 5.3) falls back to kill(pid, 0).
class ProcessWatch {
 public:
  ProcessWatch() = default;
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;
  ~ProcessWatch() {
    for (auto& w : watched_) {
      if (w.fd >= 0) ::close(w.fd);
    }
  }

  void add(int rank, int pid);

  /// Stops watching `rank` (it left: its exit is expected).
  void forget(int rank);

  /// The rank of an exited process, or -1.
  [[nodiscard]] int first_dead() const;

 private:
  struct Watched {
    int rank;
    int pid;
    int fd;
  };
  std::vector<Watched> watched_;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/wait.ipp"
#endif
