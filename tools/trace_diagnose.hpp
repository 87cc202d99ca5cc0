// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Reading flight-recorder dumps back and comparing them, for the tools (ddp-trace, ddprun after
/// a failed attempt) and their tests: TraceDump, parse_trace() (the text format_trace() writes),
/// read_trace_file(), read_trace_dumps() (a directory of them) and diagnose_traces(), which says
/// which rank fell behind and where. The recorder itself is ddp/observe/recorder.hpp. Like every
/// tool header, it includes nothing of ddp but <ddp/ddp.hpp>.

#include <ddp/ddp.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE

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

DDP_END_NAMESPACE
