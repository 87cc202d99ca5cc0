// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ZeroFirstGuard: the RAII form of torch_distributed_zero_first (the context manager of
/// YOLOv5-style training scripts). Rank 0 runs the guarded block first (downloading or decoding a
/// dataset into a cache, say) while the other ranks wait in the constructor; when rank 0 leaves the
/// block, the others run it (and find the cache). Per host by default (local rank 0 of each host
/// goes first), or for the whole job.
///
/// If rank 0's block throws, the others do not hang: their constructor throws Errc::aborted.
///
///   { ddp::ZeroFirstGuard g(comm); load_or_build_cache(); }

#include "ddp/communicator.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"

#include <cstdint>
#include <exception>
#include <span>

DDP_BEGIN_NAMESPACE

/// Which ranks a ZeroFirstGuard orders: those of each host, or those of the whole job.
enum class GuardScope : std::uint8_t {
  local,   ///< local rank 0 of each host goes first (the cache is per host)
  global,  ///< rank 0 of the job goes first (the cache is on a shared file system)
};

/// Lets rank 0 of the group run a block first, the other ranks after it (see the file comment).
template <CommBackend Backend>
class ZeroFirstGuard {
 public:
  /// Rank 0 of the group (local rank 0 with GuardScope::local) returns at once; the others wait
  /// here until it destroys its guard, and throw Errc::aborted if its block threw. Collective.
  explicit ZeroFirstGuard(Communicator<Backend>& comm, GuardScope scope = GuardScope::local)
      : group_(scope == GuardScope::global ? comm : comm.local_group()),
        uncaught_(std::uncaught_exceptions()) {
    if (group_.rank() != 0) {
      std::int64_t status = 0;
      group_.broadcast_host(std::span<std::int64_t>(&status, 1), 0);
      if (status != ok) {
        detail::fail(Errc::aborted, "rank ", comm.rank(),
                     ": ZeroFirstGuard: rank 0 of the group threw inside the guarded block (its "
                     "own error says why); "
                     "this rank stops here instead of waiting for a result that will not come");
      }
    }
  }

  ZeroFirstGuard(const ZeroFirstGuard&) = delete;
  ZeroFirstGuard& operator=(const ZeroFirstGuard&) = delete;

  /// Rank 0 releases the others, telling them whether its block succeeded. Throws only when no
  /// other exception is in flight.
  ~ZeroFirstGuard() noexcept(false) {
    if (group_.rank() != 0) return;
    const bool failing = std::uncaught_exceptions() > uncaught_;
    std::int64_t status = failing ? failed : ok;
    try {
      group_.broadcast_host(std::span<std::int64_t>(&status, 1), 0);
    } catch (...) {
      if (!failing) throw;
    }
  }

 private:
  static constexpr std::int64_t ok = 1;
  static constexpr std::int64_t failed = 2;
  Communicator<Backend>& group_;
  int uncaught_;
};

DDP_END_NAMESPACE
