// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The flight recorder: every communicator keeps its most recent operations (op, sequence
/// number, bytes, state) in a ring of Options::trace_entries records, readable at any time with
/// Communicator::recent() / trace(), and written out when an operation times out
/// (Options::trace_dump, $DDP_TRACE_DUMP). Comparing the ranks' records shows which rank fell
/// behind and where; the timeout message itself already names the ranks that did not arrive.
/// Reading dumps back and comparing a job's ranks is the tools' part (tools/trace_diagnose.hpp:
/// the `ddp-trace` tool prints it for a directory of dumps).

#include "ddp/config.hpp"
#include "ddp/detail/string.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE

/// One operation in a communicator's flight recorder.
struct TraceRecord {
  enum class State : std::uint8_t { queued, running, done, failed };
  std::uint64_t seq = 0;  ///< operations issued on this communicator before this one
  const char* op = "";    ///< "all_reduce", "broadcast", ...
  std::size_t bytes = 0;  ///< bytes of this rank's buffer(s)
  State state = State::queued;
  std::chrono::steady_clock::time_point issued{};  ///< when it was called (or queued)
};

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
[[nodiscard]] inline std::chrono::milliseconds trace_dump_grace() {
  return env_or_empty("DDP_TRACE_DUMP").empty() ? std::chrono::milliseconds(0)
                                                : std::chrono::milliseconds(1000);
}

/// Options::trace_entries, unless $DDP_TRACE_ENTRIES says otherwise.
[[nodiscard]] inline std::size_t trace_capacity(const Options& o) {
  const auto n = env_unsigned("DDP_TRACE_ENTRIES", 0, 1000000,
                              "a number of records in [0, 1000000] (0 turns the flight recorder "
                              "off)");
  return n ? static_cast<std::size_t>(*n) : o.trace_entries;
}

/// A fixed ring of TraceRecords. Thread-safe: operations are recorded by the thread that issues
/// them and updated by the one that runs them; any thread may read.
class FlightRecorder {
 public:
  using State = TraceRecord::State;

  void resize(std::size_t capacity) {
    std::lock_guard lock(mutex_);
    ring_.assign(capacity, TraceRecord{});
    next_ = 0;
  }

  /// Records a new operation and returns its sequence number.
  std::uint64_t issue(const char* op, std::size_t bytes, State state) {
    std::lock_guard lock(mutex_);
    if (!ring_.empty()) {
      ring_[next_ % ring_.size()] =
          TraceRecord{next_, op, bytes, state, std::chrono::steady_clock::now()};
    }
    return next_++;
  }

  /// Moves operation `seq` to `state` (unless the ring has overwritten it since).
  void update(std::uint64_t seq, State state) {
    std::lock_guard lock(mutex_);
    if (ring_.empty()) return;
    auto& r = ring_[seq % ring_.size()];
    if (r.seq == seq) r.state = state;
  }

  /// The records still held, oldest first.
  [[nodiscard]] std::vector<TraceRecord> recent() const {
    std::lock_guard lock(mutex_);
    std::vector<TraceRecord> out;
    const std::uint64_t n = std::min<std::uint64_t>(next_, ring_.size());
    out.reserve(static_cast<std::size_t>(n));
    for (std::uint64_t s = next_ - n; s < next_; ++s) out.push_back(ring_[s % ring_.size()]);
    return out;
  }

  /// Operations issued so far.
  [[nodiscard]] std::uint64_t issued() const {
    std::lock_guard lock(mutex_);
    return next_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<TraceRecord> ring_;
  std::uint64_t next_ = 0;
};

/// The recorder's contents as text: a header line, then one line per record, oldest first.
[[nodiscard]] inline std::string format_trace(const std::vector<TraceRecord>& records,
                                              std::uint64_t issued, int rank, int size,
                                              std::string_view group, std::string_view why) {
  const auto now = std::chrono::steady_clock::now();
  std::string out = concat("ddp flight recorder: rank ", rank, " of ", size, ", group \"", group,
                           "\", the last ", records.size(), " of ", issued, " operations");
  if (!why.empty()) out += concat(", dumped because: ", why);
  out += "\n       seq  op                     bytes  state    age (ms)\n";
  for (const auto& r : records) {
    const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(now - r.issued).count();
    char line[160];
    std::snprintf(line, sizeof line, "%10llu  %-16s %12llu  %-7s %9lld\n",
                  static_cast<unsigned long long>(r.seq), r.op,
                  static_cast<unsigned long long>(r.bytes), to_string(r.state),
                  static_cast<long long>(age));
    out += line;
  }
  return out;
}

/// Writes a dump where Options::trace_dump (or $DDP_TRACE_DUMP) says: "stderr", or a directory
/// that receives ddp-trace-<group>-rank<r>.txt. Never throws (it runs while an error propagates).
inline void dump_trace(const std::string& where, const std::string& text, std::string_view group,
                       int rank) noexcept {
  try {
    if (where == "stderr" || where == "-") {
      std::fwrite(text.data(), 1, text.size(), stderr);
      return;
    }
    std::string name(group);
    for (char& ch : name) {
      const bool plain = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                         (ch >= '0' && ch <= '9') || ch == '-' || ch == '_' || ch == '.';
      if (!plain) ch = '_';
    }
    const std::string path = concat(where, "/ddp-trace-", name, "-rank", rank, ".txt");
    if (std::FILE* f = std::fopen(path.c_str(), "w")) {
      std::fwrite(text.data(), 1, text.size(), f);
      std::fclose(f);
      std::fprintf(stderr, "[ddp] rank %d: flight recorder written to %s\n", rank, path.c_str());
    } else {
      std::fprintf(stderr, "[ddp] rank %d: cannot write the flight recorder to %s\n", rank,
                   path.c_str());
    }
  } catch (...) {
  }
}

}  // namespace detail
DDP_END_NAMESPACE
