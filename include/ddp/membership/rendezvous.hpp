// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The first steps of every communicator's rendezvous, before the backend connects:
///  * each rank claims its rank number in the store (compare-and-set), so a second process
///    started with the same RANK is refused at once and told who holds it;
///  * each rank publishes the job as it sees it (world size, backend, library version,
///    fingerprint check) and checks every other rank's record against its own, so ranks that
///    were started differently fail together with Errc::mismatch instead of running with
///    different views of the job (and different results).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/store/client.hpp"
#include "ddp/version.hpp"

#include <fcntl.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Fails with Errc::mismatch unless every rank's `values[j]` equals this rank's, naming the ranks
/// that differ and their values: "rank 0: the ranks disagree on WHAT: this rank has A, rank 1 has
/// B; FIX".
DDP_INLINE void require_agreement(int rank, std::string_view what, std::string_view fix,
                                  const std::vector<std::string>& values);

/// The rendezvous timeout, naming the ranks whose `prefix<j>` key never appeared, and what every
/// rank must have been given alike to meet in `where` (the store: "etcd H:P,... (namespace N)",
/// or ddp's own at "H:P").
[[noreturn]] DDP_INLINE void fail_missing_ranks(int rank, int size,
                                                std::chrono::milliseconds timeout,
                                                const std::vector<std::string>& missing,
                                                std::size_t prefix_len, const std::string& where);

/// Waits up to `timeout` for `prefix<j>` of every rank j and returns their values; a timeout
/// names the ranks that are missing.
[[nodiscard]] DDP_INLINE std::vector<std::string> gather_records(Store& store,
                                                                 std::string_view prefix, int rank,
                                                                 int size,
                                                                 std::chrono::milliseconds timeout);

/// What a rank believes about its job; every rank must believe the same.
struct JobView {
  int world_size = 1;
  std::string backend;
  bool verify_collectives = true;
  std::int64_t heartbeat_ms = 0;  ///< Options::heartbeat (0: none)
  bool timeline = false;          ///< Options::timeline is set (init() aligns the clocks)
};

/// Who this process is, as another process would be told ("pid 123 on host node7").
[[nodiscard]] DDP_INLINE std::string process_label();

/// Process `pid`'s start time (clock ticks after boot, /proc/PID/stat field 22); "" when it is
/// gone or has ended (a zombie its parent has not reaped yet).
[[nodiscard]] DDP_INLINE std::string process_start(int pid);

/// This process as another process on the same machine can find it: host name, boot id and pid
/// namespace, then pid and start time ("host|boot|pidns pid start").
[[nodiscard]] DDP_INLINE std::string process_identity();

/// Whether the process `identity` (process_identity()) ran on this machine, in this pid
/// namespace, and has ended: certain evidence of a death, without waiting for a lease.
[[nodiscard]] DDP_INLINE bool ended_here(std::string_view identity);

/// Claims `rank` in the store: fails with Errc::invalid_argument, naming the process that holds
/// it, when another process claimed it first. Returns normally once the rank is this process's.
DDP_INLINE void claim_rank(Store& store, int rank, std::string_view group);

/// Publishes this rank's view of the job and checks it against every rank's (see the file
/// comment). Errc::mismatch names the ranks that differ and both values. `widest` is set to the
/// largest world size any rank claimed (before a mismatch is thrown): the store's host waits for
/// that many ranks to read the failure before it stops serving.
DDP_INLINE void agree_on_job(Store& store, int rank, const JobView& job,
                             std::chrono::milliseconds timeout, int& widest);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/membership/impl/rendezvous.ipp"
#endif
