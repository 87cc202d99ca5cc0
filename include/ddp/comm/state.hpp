// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What a communicator holds besides its backend, and the rules around it that do not depend on
/// the backend (compiled once, not per Communicator<Backend>), one concern per part: its store
/// connections and the leaving protocol (membership/job_store.hpp), what it knows of its membership
/// (membership/watch.hpp), the poison that makes every call after a failure fail at once
/// (comm/poison.hpp), the process that made it (comm/owner.hpp); here the executor, the flight
/// recorder, CUDA staging, and the rules that join the parts (run_poisoning, leaving).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/comm/error_file.hpp"
#include "ddp/comm/owner.hpp"
#include "ddp/comm/poison.hpp"
#include "ddp/comm/staging.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/membership/job_store.hpp"
#include "ddp/membership/monitored_barrier.hpp"
#include "ddp/membership/watch.hpp"
#include "ddp/observe/recorder.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"
#include "ddp/work.hpp"
#if DDP_HAS_CUDA
#include "ddp/comm/cuda_staging.hpp"
#endif

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

struct CommState : MembershipWatch, CommPoison, OwnerProcess {
  // Defined with the bodies: constructing and destroying the members is code of its own.
  CommState();
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;
  ~CommState();

  FlightRecorder recorder;
  std::unique_ptr<Executor> executor = std::make_unique<Executor>();
  std::uint64_t splits = 0;
  std::uint64_t monitored_barriers = 0;
  int timeline_lane = 2;  // this group's track in the timeline (detail::Timeline::lane_of)
#if DDP_HAS_CUDA
  std::unique_ptr<CudaStaging> staging;  // made on first use

  CudaStaging& cuda_staging() {
    if (!staging)
      staging = std::make_unique<CudaStaging>(options.timeout, options.cuda_staging_bytes);
    return *staging;
  }
#endif

  void configure(const Options& o);

  /// A fork() child's copy: the parent owns the store, the shared memory and the peers, and
  /// this process has none of the threads. Touch nothing; keep it reachable (never destroyed).
  void abandon() noexcept;

  /// Leaving (JobStore::announce_leaving): with this communicator's first failure; while an
  /// exception unwinds the program (a call its checks refused, an error of its own), saying so;
  /// else with the number of operations it ran.
  void announce_leaving() {
    std::optional<Error> why = failure();
    if (!why && std::uncaught_exceptions() > 0)
      why = Error(Errc::peer_lost,
                  concat("rank ", world_rank_in_group, " left after ", recorder.issued(),
                         " operations while an exception unwound its program (a call that its "
                         "checks refused, or an error of the program's own: see its output)"));
    JobStore::announce_leaving(why, recorder.issued());
  }
  /// Leaving, last step (JobStore::wait_for_the_others).
  void wait_for_the_others(bool connected) {
    JobStore::wait_for_the_others(connected, poisoned.load(std::memory_order_acquire));
  }

  /// Creating the backend failed on `rank` with `e`: tell the other ranks, which are waiting on
  /// the store for it, so that they fail at once with its reason instead of at their timeout.
  /// A failure relayed from another rank gets this rank's name in front instead.
  void relay_failure(int rank, const Error& e);

  /// Communicator::monitored_barrier over the store (membership/monitored_barrier.hpp).
  void monitored_barrier(int rank, int size, std::chrono::milliseconds timeout,
                         bool wait_all_ranks);

  /// Runs body() unless the communicator is poisoned (then fails at once), and poisons it
  /// when body fails. A failure on a communicator that the other ranks replaced without this
  /// one (shrink) says so instead: this rank is fenced.
  template <class F>
  void run_poisoning(int rank, const char* name, const F& body) {
    check_poisoned(rank, name);
    try {
      body();
    } catch (const Error& e) {
      if (std::string why = excluded(rank, name); !why.empty()) {
        poison_with(why, Errc::aborted);
        fail(Errc::aborted, why);
      }
      if (poisoned.load(std::memory_order_acquire)) {
        // Another thread aborted the communicator meanwhile (abort(), a peer that stopped
        // answering): its reason is the failure's.
        std::lock_guard lock(poison_mutex);
        std::string_view why = poison;
        if (const std::string own = concat("rank ", rank, ": "); why.starts_with(own))
          why.remove_prefix(own.size());
        fail_from(poison_origin, poison_lost, poison_code, "rank ", rank, ": ", name, ": ", why);
      }
      poison_with(e);
      throw;
    } catch (...) {
      poison_with("an operation threw a non-ddp exception", Errc::aborted);
      throw;
    }
  }

  /// Before each call: a rank that was stopped or away for half the timeout or more may have
  /// been left out by the others' shrink() meanwhile (they waited a timeout for it first). Then
  /// its next call asks the store before acting, and fails (Errc::aborted) when the others
  /// formed a communicator without it or are forming one: so a fenced rank never completes a
  /// collective, even one whose peers' data still sits in its sockets. One clock read per call.
  void check_membership_after_gap(int rank, const char* name);
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/state.ipp"
#endif
