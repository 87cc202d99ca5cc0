// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The flight recorder: every communicator keeps its most recent operations (op, sequence
/// number, bytes, state) in a ring of Options::trace_entries records, readable at any time with
/// Communicator::recent() / trace(), and written out when an operation times out
/// (Options::trace_dump, $DDP_TRACE_DUMP). Comparing the ranks' records shows which rank fell
/// behind and where; the timeout message itself already names the ranks that did not arrive.
/// parse_trace() reads a dump back and diagnose_traces() compares the dumps of a job's ranks
/// (the `ddp-trace` tool prints it for a directory of dumps).

#include "ddp/config.hpp"
#include "ddp/detail/string.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"

#include <dirent.h>
#include <sys/stat.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <sstream>
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

/// A flight-recorder dump read back from its text (what format_trace writes).
struct TraceDump {
  struct Entry {
    std::uint64_t seq = 0;
    std::string op;
    std::size_t bytes = 0;
    TraceRecord::State state = TraceRecord::State::queued;
  };
  int rank = -1;
  int size = 0;
  std::string group;
  std::uint64_t issued = 0;  ///< operations the communicator had issued
  std::string why;           ///< the error that made it dump ("" when dumped on request)
  std::vector<Entry> entries;

  /// The operation this rank is stuck in or failed in: the oldest one not done, or `issued`
  /// (the next one) when all it holds are done.
  [[nodiscard]] std::uint64_t position() const {
    for (const auto& e : entries) {
      if (e.state != TraceRecord::State::done) return e.seq;
    }
    return issued;
  }
  [[nodiscard]] const Entry* entry(std::uint64_t seq) const {
    for (const auto& e : entries) {
      if (e.seq == seq) return &e;
    }
    return nullptr;
  }
};

/// Reads a dump written by Communicator::trace() or on a timeout; `source` names it in errors.
/// Throws Error(Errc::invalid_argument) on text that is not such a dump.
[[nodiscard]] inline TraceDump parse_trace(std::string_view text, std::string_view source = "") {
  const auto bad = [&](std::string_view what) {
    detail::fail(Errc::invalid_argument,
                 source.empty() ? std::string("flight recorder dump") : std::string(source),
                 ": not a ddp flight recorder dump (", what, ")");
  };
  std::istringstream in{std::string(text)};
  std::string head;
  std::getline(in, head);
  constexpr std::string_view prefix = "ddp flight recorder: rank ";
  if (head.rfind(prefix, 0) != 0) bad("the first line does not start with \"ddp flight recorder\"");
  TraceDump d;
  const std::size_t q1 = head.find(", group \""), q2 = head.find("\", the last ");
  if (q1 == std::string::npos || q2 == std::string::npos || q2 < q1) bad("no group");
  d.group = head.substr(q1 + 9, q2 - q1 - 9);
  unsigned long long held = 0, issued = 0;
  if (std::sscanf(head.c_str() + prefix.size(), "%d of %d", &d.rank, &d.size) != 2 ||
      std::sscanf(head.c_str() + q2, "\", the last %llu of %llu operations", &held, &issued) != 2 ||
      d.rank < 0 || d.size <= d.rank) {
    bad("a malformed first line");
  }
  d.issued = issued;
  constexpr std::string_view because = ", dumped because: ";
  if (const auto b = head.find(because, q2); b != std::string::npos)
    d.why = head.substr(b + because.size());
  std::string line;
  std::getline(in, line);  // column titles
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    TraceDump::Entry e;
    std::string state;
    if (!(fields >> e.seq >> e.op >> e.bytes >> state)) bad(detail::concat("line \"", line, "\""));
    if (state == "queued")
      e.state = TraceRecord::State::queued;
    else if (state == "running")
      e.state = TraceRecord::State::running;
    else if (state == "done")
      e.state = TraceRecord::State::done;
    else if (state == "failed")
      e.state = TraceRecord::State::failed;
    else
      bad(detail::concat("state \"", state, "\""));
    d.entries.push_back(std::move(e));
  }
  if (d.entries.size() != held) bad("fewer records than its first line says");
  return d;
}

/// Reads and parses one dump file; Errc::system when it cannot be read, Errc::invalid_argument
/// when it is not a dump.
[[nodiscard]] inline TraceDump read_trace_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) detail::fail_errno(errno, path, ": cannot open the flight recorder dump");
  std::string text;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
  std::fclose(f);
  return parse_trace(text, path);
}

/// The dumps in directory `dir` (its ddp-trace-*.txt files) last written at or after `since`
/// (seconds since the epoch: a launcher passes the start of the attempt, so older dumps do not
/// count), sorted by group and rank. Files that cannot be read or are not dumps are skipped.
[[nodiscard]] inline std::vector<TraceDump> read_trace_dumps(const std::string& dir,
                                                             std::int64_t since = 0) {
  std::vector<TraceDump> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("ddp-trace-", 0) != 0 || name.size() < 4 ||
        name.compare(name.size() - 4, 4, ".txt") != 0)
      continue;
    const std::string path = detail::concat(dir, "/", name);
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_mtime < since) continue;
    try {
      out.push_back(read_trace_file(path));
    } catch (const Error&) {
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const TraceDump& a, const TraceDump& b) {
    return a.group != b.group ? a.group < b.group : a.rank < b.rank;
  });
  return out;
}

/// Compares the dumps of one job's ranks and says, in a few lines, who fell behind and where:
/// per group, each rank's position (the operation it is stuck in), the ranks that are behind
/// the others or left no dump (a rank that never timed out was not waiting in a collective:
/// stopped, busy elsewhere or dead), and ranks that disagree on what an operation was.
[[nodiscard]] inline std::string diagnose_traces(const std::vector<TraceDump>& dumps) {
  using detail::concat;
  std::map<std::string, std::vector<const TraceDump*>> groups;
  for (const auto& d : dumps) groups[d.group].push_back(&d);
  const auto list = [](const std::vector<int>& ranks) {
    std::string s = ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i) s += concat(i ? ", " : "", ranks[i]);
    return s;
  };
  const auto describe = [](const TraceDump& d, std::uint64_t seq) {
    const TraceDump::Entry* e = d.entry(seq);
    if (e == nullptr) return concat("#", seq, seq == d.issued ? " (not called yet)" : "");
    return concat("#", seq, " ", e->op, " (", e->bytes, " B, ", to_string(e->state), ")");
  };
  std::string out;
  for (const auto& [group, ds] : groups) {
    int size = 0;
    std::map<int, const TraceDump*> by_rank;
    for (const TraceDump* d : ds) {
      size = std::max(size, d->size);
      by_rank[d->rank] = d;
    }
    out += concat("group \"", group, "\": dumps from ", by_rank.size(), " of ", size, " ranks\n");
    std::uint64_t front = 0;
    for (const auto& [r, d] : by_rank) front = std::max(front, d->position());
    std::vector<int> behind, silent;
    for (const auto& [r, d] : by_rank) {
      const std::uint64_t at = d->position();
      out += concat("  rank ", r, ": at ", describe(*d, at), ", ", d->issued, " issued\n");
      if (at < front) behind.push_back(r);
    }
    for (int r = 0; r < size; ++r) {
      if (by_rank.count(r) == 0) silent.push_back(r);
    }
    // Ranks at the same operation that recorded different ones.
    std::string disagree;
    const TraceDump::Entry* first = by_rank.begin()->second->entry(front);
    for (const auto& [r, d] : by_rank) {
      const TraceDump::Entry* mine = d->entry(front);
      if (mine != nullptr && first != nullptr && mine->op != first->op) {
        disagree = concat("  ranks disagree on #", front, ": rank ", by_rank.begin()->first,
                          " called ", first->op, ", rank ", r, " called ", mine->op, "\n");
        break;
      }
    }
    out += disagree;
    if (!behind.empty()) {
      out += concat("  behind: ", list(behind), " (the others reached #", front, ")\n");
    }
    if (!silent.empty()) {
      out += concat("  no dump: ", list(silent),
                    " (it did not time out, so it was not waiting in a collective of this "
                    "group: stopped, busy elsewhere, or dead); the others wait in #",
                    front, "\n");
    }
    if (behind.empty() && silent.empty() && disagree.empty()) {
      out += concat("  every rank reached #", front,
                    "; none lags: the operation itself stalled (transport or network)\n");
    }
    std::vector<int> lagging = behind;
    lagging.insert(lagging.end(), silent.begin(), silent.end());
    std::sort(lagging.begin(), lagging.end());
    if (!lagging.empty()) out += concat("  lagging: ", list(lagging), "\n");
  }
  return out;
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
  void resize(std::size_t capacity) {
    slots_ = capacity != 0 ? std::make_unique<Slot[]>(capacity) : nullptr;
    capacity_ = capacity;
    next_.store(0, std::memory_order_relaxed);
  }

  /// Records a new operation and returns its sequence number.
  std::uint64_t issue(const char* op, std::size_t bytes, State state) {
    const std::uint64_t seq = next_.fetch_add(1, std::memory_order_relaxed);
    if (capacity_ == 0) return seq;
    Slot& s = slots_[seq % capacity_];
    s.version.store(2 * seq + 1, std::memory_order_relaxed);  // odd: being written
    std::atomic_thread_fence(std::memory_order_release);
    s.op.store(op, std::memory_order_relaxed);
    s.bytes.store(bytes, std::memory_order_relaxed);
    s.state.store(state, std::memory_order_relaxed);
    s.issued_ns.store(coarse_now_ns(), std::memory_order_relaxed);
    s.version.store(2 * seq + 2, std::memory_order_release);
    return seq;
  }

  /// Moves operation `seq` to `state` (unless the ring has overwritten it since).
  void update(std::uint64_t seq, State state) {
    if (capacity_ == 0) return;
    Slot& s = slots_[seq % capacity_];
    if (s.version.load(std::memory_order_relaxed) == 2 * seq + 2)
      s.state.store(state, std::memory_order_relaxed);
  }

  /// The records still held, oldest first.
  [[nodiscard]] std::vector<TraceRecord> recent() const {
    std::vector<TraceRecord> out;
    const std::uint64_t next = next_.load(std::memory_order_acquire);
    const std::uint64_t n = std::min<std::uint64_t>(next, capacity_);
    out.reserve(static_cast<std::size_t>(n));
    for (std::uint64_t seq = next - n; seq < next; ++seq) {
      const Slot& s = slots_[seq % capacity_];
      const std::uint64_t v = s.version.load(std::memory_order_acquire);
      if (v != 2 * seq + 2) continue;  // being written, or already overwritten
      TraceRecord r;
      r.seq = seq;
      r.op = s.op.load(std::memory_order_relaxed);
      r.bytes = s.bytes.load(std::memory_order_relaxed);
      r.state = s.state.load(std::memory_order_relaxed);
      r.issued = std::chrono::steady_clock::time_point(
          std::chrono::nanoseconds(s.issued_ns.load(std::memory_order_relaxed)));
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.version.load(std::memory_order_relaxed) == v) out.push_back(r);
    }
    return out;
  }

  /// Operations issued so far.
  [[nodiscard]] std::uint64_t issued() const { return next_.load(std::memory_order_acquire); }

 private:
  struct Slot {
    std::atomic<std::uint64_t> version{0};  // 2 seq + 2 when record `seq` is complete
    std::atomic<const char*> op{""};
    std::atomic<std::size_t> bytes{0};
    std::atomic<State> state{State::queued};
    std::atomic<std::int64_t> issued_ns{0};
  };

  /// steady_clock's clock (CLOCK_MONOTONIC), read at its coarse resolution.
  static std::int64_t coarse_now_ns() noexcept {
    timespec ts{};
    if (::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0) {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now().time_since_epoch())
          .count();
    }
    return std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  }

  std::unique_ptr<Slot[]> slots_;
  std::size_t capacity_ = 0;
  std::atomic<std::uint64_t> next_{0};
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
