// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The shared-memory segment of the shm transport (ShmTransport, backend/host/shm.hpp): how it
/// is laid out (ShmLayout), the header and the per-rank control blocks in it, and how it is
/// created without a name and mapped by every rank (ShmSegment).

#include "ddp/backend/collective.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/detail/wait.hpp"
#include "ddp/error.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>

DDP_BEGIN_NAMESPACE
namespace detail {

struct ShmLayout {
  static constexpr std::uint64_t magic = 0x3430306d68737064ull;  // "dpshm004"
  static constexpr std::size_t header_bytes = 4096;
  static constexpr std::size_t ctl_bytes = 256;
  static constexpr std::size_t channel_ctl_bytes = 128;

  int world = 1;
  std::size_t slot_bytes = 0;
  std::size_t channel_bytes = 0;

  [[nodiscard]] static std::size_t align_up(std::size_t v, std::size_t a) {
    return (v + a - 1) / a * a;
  }
  [[nodiscard]] std::size_t ctl_offset() const { return header_bytes; }
  [[nodiscard]] std::size_t slots_offset() const;
  [[nodiscard]] std::size_t slot_offset(int rank, unsigned parity) const;
  [[nodiscard]] std::size_t channels_offset() const;
  [[nodiscard]] std::size_t channel_offset(int src, int dst) const;
  [[nodiscard]] std::size_t total() const;
};

struct ShmHeader {
  std::uint64_t magic;
  std::uint64_t cookie;
  std::uint32_t world;
  std::uint32_t reserved;
  std::uint64_t slot_bytes;
  std::uint64_t channel_bytes;
  std::uint64_t total;
  alignas(64) WakeWord wake;
  alignas(64) std::atomic<std::uint32_t> abort_state;  // 0 none, 1 being written, 2 set
  std::int32_t abort_rank;
  std::int32_t abort_code;
  char abort_message[2048];
  std::int32_t abort_lost_count;  // the ranks the failure found lost (the first 64)
  std::int32_t abort_lost[64];
};
static_assert(sizeof(ShmHeader) <= ShmLayout::header_bytes);

/// One rank's control block. Peers spin on `word`: the low 16 bits are the round number (modulo
/// 2^16; ranks are never more than one round apart, so wrapping is harmless), the high 48 bits
/// the round's detail::fingerprint_code (0: no fingerprint). One store publishes both, so checking
/// that all ranks called the same collective costs no extra cache-line transfer in the common
/// case; the full fingerprints (or, for a round without one, a marker no fingerprint equals) lie
/// on a line of their own, written by the owner only, read by a peer only when the codes cannot
/// decide: a code is wide, the codes differ, or the peer has already moved to the next round.
///
/// `left` is set (never cleared) when the rank's transport is destroyed (its communicator was,
/// or its process is leaving): a peer that still waits for it fails at once instead of waiting
/// for its process to exit.
struct ShmCtl {
  alignas(64) std::atomic<std::uint64_t> word;
  alignas(64) Fingerprint fp[2];
  alignas(64) std::atomic<std::uint32_t> left;
};
static_assert(sizeof(ShmCtl) == 192);
static_assert(sizeof(ShmCtl) <= ShmLayout::ctl_bytes);

struct ShmChannelCtl {
  alignas(64) std::atomic<std::uint64_t> head;  // bytes written so far
  alignas(64) std::atomic<std::uint64_t> tail;  // bytes consumed so far
};
static_assert(sizeof(ShmChannelCtl) <= ShmLayout::channel_ctl_bytes);

/// A mapped shared-memory segment that never has a name: rank 0 creates it as an unnamed file
/// in /dev/shm (O_TMPFILE; memfd_create where /dev/shm cannot), the other ranks open it through
/// rank 0's descriptor (/proc/<pid>/fd/<n>) while rank 0 holds it. No kill at any moment can
/// leave anything behind in /dev/shm; the memory goes when the last rank unmaps it.
class ShmSegment {
 public:
  ShmSegment() = default;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment() {
    if (base_ != nullptr) ::munmap(base_, size_);
  }

  /// Bytes of the segment that are touched once at creation, so the first collectives do not
  /// pay first-touch page faults; beyond this pages are faulted in lazily, where they are used.
  static constexpr std::size_t prefault_bytes = std::size_t{64} << 20;

  /// Creates a segment of `size` bytes and reserves its memory up front, so that a /dev/shm too
  /// small for it is an error here rather than a SIGBUS at first use. Returns false, with the
  /// reason in `why` (naming /dev/shm, its free space and the bytes needed), when the space is
  /// not there; throws for other failures.
  [[nodiscard]] bool create(std::size_t size, std::string& why);

  /// Where another process of the same host opens this segment while the creator holds it.
  [[nodiscard]] std::string path() const { return concat("/proc/", ::getpid(), "/fd/", fd_.get()); }

  /// Maps the segment of exactly `size` bytes that another process published at `path`.
  void open(const std::string& path, std::size_t size);

  /// The creator lets go of its descriptor once every rank has mapped the segment.
  void close_descriptor() noexcept { fd_.reset(); }

  [[nodiscard]] std::byte* base() const noexcept;

 private:
  static std::string mib(std::size_t bytes);

  /// Free bytes for a new segment: in /dev/shm, or of memory (MemAvailable) for a memfd.
  static std::size_t free_bytes(bool dev_shm);

  void map(int fd, std::size_t size);

  void* base_ = nullptr;
  std::size_t size_ = 0;
  Fd fd_;  // the creator's, until every rank has mapped the segment
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/shm_segment.ipp"
#endif
