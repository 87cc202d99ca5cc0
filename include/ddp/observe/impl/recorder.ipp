// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/observe/recorder.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::chrono::milliseconds trace_dump_grace() {
  return !EnvReader().has("DDP_TRACE_DUMP") ? std::chrono::milliseconds(0)
                                            : std::chrono::milliseconds(1000);
}

DDP_INLINE void FlightRecorder::resize(std::size_t capacity) {
  // Slots for a power of two at least `capacity`: a slot is found with a mask, not a division
  // (a 64-bit division costs more than the rest of recording an operation).
  std::size_t slots = capacity != 0 ? 1 : 0;
  while (slots < capacity) slots <<= 1;
  slots_ = slots != 0 ? std::make_unique<Slot[]>(slots) : nullptr;
  mask_ = slots - 1;
  capacity_ = capacity;
  next_.store(0, std::memory_order_relaxed);
}

DDP_INLINE std::uint64_t FlightRecorder::issue(const char* op, std::size_t bytes, State state) {
  const std::uint64_t seq = next_.fetch_add(1, std::memory_order_relaxed);
  if (capacity_ == 0) return seq;
  Slot& s = slots_[seq & mask_];
  // A seqlock without fences (ThreadSanitizer does not model them): the fields are release
  // stores after the odd version, so a reader that sees any of them sees the version change.
  s.version.store(2 * seq + 1, std::memory_order_relaxed);  // odd: being written
  s.op.store(op, std::memory_order_release);
  s.bytes.store(bytes, std::memory_order_release);
  s.state.store(state, std::memory_order_release);
  const std::int64_t now = coarse_now_ns();
  s.issued_ns.store(now, std::memory_order_release);
  s.started_ns.store(state == State::running ? now : 0, std::memory_order_release);
  s.ended_ns.store(0, std::memory_order_release);
  s.version.store(2 * seq + 2, std::memory_order_release);
  return seq;
}

DDP_INLINE void FlightRecorder::update(std::uint64_t seq, State state) {
  if (capacity_ == 0) return;
  Slot& s = slots_[seq & mask_];
  if (s.version.load(std::memory_order_relaxed) != 2 * seq + 2) return;
  (state == State::running ? s.started_ns : s.ended_ns)
      .store(coarse_now_ns(), std::memory_order_release);
  s.state.store(state, std::memory_order_release);
}

DDP_INLINE std::vector<TraceRecord> FlightRecorder::recent() const {
  std::vector<TraceRecord> out;
  const std::uint64_t next = next_.load(std::memory_order_acquire);
  const std::uint64_t n = std::min<std::uint64_t>(next, capacity_);
  out.reserve(static_cast<std::size_t>(n));
  for (std::uint64_t seq = next - n; seq < next; ++seq) {
    const Slot& s = slots_[seq & mask_];
    const std::uint64_t v = s.version.load(std::memory_order_acquire);
    if (v != 2 * seq + 2) continue;  // being written, or already overwritten
    TraceRecord r;
    r.seq = seq;
    r.op = s.op.load(std::memory_order_acquire);
    r.bytes = s.bytes.load(std::memory_order_acquire);
    r.state = s.state.load(std::memory_order_acquire);
    const auto at = [](const std::atomic<std::int64_t>& ns) {
      return std::chrono::steady_clock::time_point(
          std::chrono::nanoseconds(ns.load(std::memory_order_acquire)));
    };
    r.issued = at(s.issued_ns);
    r.started = at(s.started_ns);
    r.ended = at(s.ended_ns);
    if (s.version.load(std::memory_order_relaxed) == v) out.push_back(r);
  }
  return out;
}

DDP_INLINE std::uint64_t FlightRecorder::issued() const {
  return next_.load(std::memory_order_acquire);
}

DDP_INLINE std::int64_t FlightRecorder::coarse_now_ns() noexcept {
  timespec ts{};
  if (::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  return std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

DDP_INLINE std::string format_trace(const std::vector<TraceRecord>& records, std::uint64_t issued,
                                    int rank, int size, std::string_view group,
                                    std::string_view why) {
  const auto now = std::chrono::steady_clock::now();
  std::string out = concat("ddp flight recorder: rank ", rank, " of ", size, ", group \"", group,
                           "\", the last ", records.size(), " of ", issued, " operations");
  if (!why.empty()) out += concat(", dumped because: ", why);
  // The op column fits the longest name (all_reduce_coalesced, 20 characters).
  // ran: from the start to the end (or to now while it runs; "-" while queued), at the coarse
  // clock's resolution (a few ms).
  out += "\n       seq  op                           bytes  state    age (ms)  ran (ms)\n";
  using std::chrono::milliseconds;
  for (const auto& r : records) {
    const auto age = std::chrono::duration_cast<milliseconds>(now - r.issued).count();
    const bool started = r.started.time_since_epoch().count() != 0;
    const bool ended = r.ended.time_since_epoch().count() != 0;
    const auto ran =
        std::chrono::duration_cast<milliseconds>((ended ? r.ended : now) - r.started).count();
    char line[192];
    std::snprintf(line, sizeof line, "%10llu  %-22s %12llu  %-7s %9lld  %8s\n",
                  static_cast<unsigned long long>(r.seq), r.op,
                  static_cast<unsigned long long>(r.bytes), to_string(r.state),
                  static_cast<long long>(age), started ? concat(ran).c_str() : "-");
    out += line;
  }
  return out;
}

DDP_INLINE void dump_trace(const std::string& where, const std::string& text,
                           std::string_view group, int rank) noexcept {
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
    // The directory is made if missing (and its parents), as `mkdir -p` would.
    for (std::size_t at = where.find('/', 1); at != std::string::npos; at = where.find('/', at + 1))
      (void)::mkdir(where.substr(0, at).c_str(), 0777);
    (void)::mkdir(where.c_str(), 0777);
    const std::string path = concat(where, "/ddp-trace-", name, "-rank", rank, ".txt");
    // Never through a link, never waiting on a FIFO someone put there (O_NONBLOCK: opening one
    // without a reader fails at once), never anything but a regular file.
    const int fd = ::open(path.c_str(),
                          O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    const char* why = fd < 0 ? std::strerror(errno) : nullptr;
    struct stat st {};
    std::FILE* f = nullptr;
    if (fd >= 0 && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) f = ::fdopen(fd, "w");
    if (f == nullptr && fd >= 0) {
      ::close(fd);
      why = "something other than a regular file is there";
    }
    if (f != nullptr) {
      std::fwrite(text.data(), 1, text.size(), f);
      std::fclose(f);
      std::fprintf(stderr, "[ddp] rank %d: flight recorder written to %s\n", rank, path.c_str());
    } else {
      // Not lost: the dump goes to stderr instead, after the reason.
      std::fprintf(stderr,
                   "[ddp] rank %d: cannot write the flight recorder to %s: %s; here it is\n", rank,
                   path.c_str(), why);
      std::fwrite(text.data(), 1, text.size(), stderr);
    }
  } catch (...) {
  }
}

}  // namespace detail
DDP_END_NAMESPACE
