// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The flight recorder: every communicator keeps its most recent operations (op, sequence
/// number, bytes, state, when it was issued, started and ended) in a ring of Options::trace_entries
/// records, readable at any time with Communicator::recent() / trace(), and written out when an
/// operation times out (Options::trace_dump, $DDP_TRACE_DUMP). Comparing the ranks' records shows
/// which rank fell behind and where; the timeout message itself already names the ranks that did
/// not arrive. Reading dumps back and comparing a job's ranks is the tools' part
/// (tools/trace_diagnose.hpp: the `ddp-trace` tool prints it for a directory of dumps).

#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE

/// One operation in a communicator's flight recorder.
struct TraceRecord {
  /// Where the operation is: waiting behind others, running, finished, or failed.
  enum class State : std::uint8_t { queued, running, done, failed };
  std::uint64_t seq = 0;        ///< operations issued on this communicator before this one
  const char* op = "";          ///< "all_reduce", "broadcast", ...
  std::size_t bytes = 0;        ///< bytes of this rank's buffer(s)
  State state = State::queued;  ///< where it was when the record was read
  std::chrono::steady_clock::time_point issued{};  ///< when it was called (or queued)
  /// When it started running (the epoch while it has not).
  std::chrono::steady_clock::time_point started{};
  /// When it finished or failed (the epoch while it has not).
  std::chrono::steady_clock::time_point ended{};
};

/// The state's name: "queued", "running", "done" or "failed".
[[nodiscard]] constexpr const char* to_string(TraceRecord::State s) noexcept {
  switch (s) {
    case TraceRecord::State::queued: return "queued";
    case TraceRecord::State::running: return "running";
    case TraceRecord::State::done: return "done";
    case TraceRecord::State::failed: return "failed";
  }
  return "?";
}

namespace detail {

/// How long a launcher (ddprun, spawn) lets the other workers run after one failed before it
/// stops them: a second when they write flight recorders ($DDP_TRACE_DUMP), in which they fail on
/// their own (peers of a failed rank do within milliseconds) and write them; else no time.
[[nodiscard]] DDP_INLINE std::chrono::milliseconds trace_dump_grace();

/// A fixed ring of TraceRecords that costs no lock: issuing an operation is one atomic
/// increment and a few plain stores, updating its state one store, so the flight recorder stays
/// on in production. Operations are recorded by the thread that issues them and updated by the
/// one that runs them; any thread may read (a record being written at that moment is skipped).
/// Times come from the coarse monotonic clock (a memory read; a few ms resolution, enough for
/// ages in ms).
class FlightRecorder {
 public:
  using State = TraceRecord::State;

  /// Sets the capacity and forgets every record; not concurrent with the other members.
  void resize(std::size_t capacity);

  /// Records a new operation and returns its sequence number.
  std::uint64_t issue(const char* op, std::size_t bytes, State state);

  /// Moves operation `seq` to `state` (unless the ring has overwritten it since).
  void update(std::uint64_t seq, State state);

  /// The records still held, oldest first.
  [[nodiscard]] std::vector<TraceRecord> recent() const;

  /// Operations issued so far.
  [[nodiscard]] std::uint64_t issued() const;

 private:
  struct Slot {
    std::atomic<std::uint64_t> version{0};  // 2 seq + 2 when record `seq` is complete
    std::atomic<const char*> op{""};
    std::atomic<std::size_t> bytes{0};
    std::atomic<State> state{State::queued};
    std::atomic<std::int64_t> issued_ns{0};
    std::atomic<std::int64_t> started_ns{0};
    std::atomic<std::int64_t> ended_ns{0};
  };

  /// steady_clock's clock (CLOCK_MONOTONIC), read at its coarse resolution.
  static std::int64_t coarse_now_ns() noexcept;

  std::unique_ptr<Slot[]> slots_;
  std::size_t mask_ = 0;
  std::size_t capacity_ = 0;  // records kept (recent() returns at most this many)
  std::atomic<std::uint64_t> next_{0};
};

/// The recorder's contents as text: a header line, then one line per record, oldest first.
[[nodiscard]] DDP_INLINE std::string format_trace(const std::vector<TraceRecord>& records,
                                                  std::uint64_t issued, int rank, int size,
                                                  std::string_view group, std::string_view why);

/// Writes a dump where Options::trace_dump (or $DDP_TRACE_DUMP) says: "stderr", or a directory
/// that receives ddp-trace-<group>-rank<r>.txt. Never throws (it runs while an error propagates).
DDP_INLINE void dump_trace(const std::string& where, const std::string& text,
                           std::string_view group, int rank) noexcept;

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/observe/impl/recorder.ipp"
#endif
