// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/observe/timeline.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cerrno>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE Timeline& Timeline::get() {
  static Timeline t;
  return t;
}

DDP_INLINE void Timeline::open(const std::string& dir, int rank) {
  std::lock_guard lock(mutex_);
  if (file_ != nullptr || dir.empty()) return;
  for (std::size_t at = dir.find('/', 1); at != std::string::npos; at = dir.find('/', at + 1))
    (void)::mkdir(dir.substr(0, at).c_str(), 0777);
  (void)::mkdir(dir.c_str(), 0777);
  // A new file, created exclusively (never through a link, never over another file: a name
  // taken, by an earlier process of the same pid or a planted link, gets a suffix).
  std::string path;
  int fd = -1;
  for (int n = 0; fd < 0 && n < 100; ++n) {
    path = concat(dir, "/ddp-timeline-rank", rank, "-", ::getpid(), n == 0 ? "" : concat("-", n),
                  ".json");
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC,
                0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    const int err = errno;
    fail(Errc::system, "rank ", rank, ": the timeline (DDP_TIMELINE) cannot be written to ", path,
         ": ", std::strerror(err), "; name a writable directory, or unset DDP_TIMELINE");
  }
  file_ = ::fdopen(fd, "w");
  if (file_ == nullptr) {
    ::close(fd);
    fail(Errc::system, "rank ", rank, ": the timeline cannot be written to ", path);
  }
  rank_ = rank;
  owner_ = ::getpid();
  out_ = concat("{\"displayTimeUnit\":\"ms\",\"otherData\":{\"ddp_rank\":", rank,
                ",\"ddp_pid\":", ::getpid(), "},\"traceEvents\":[\n",
                "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", rank,
                ",\"args\":{\"name\":\"rank ", rank, "\"}},\n",
                "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":", rank,
                ",\"args\":{\"sort_index\":", rank, "}},\n",
                "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", rank,
                ",\"tid\":0,\"args\":{\"name\":\"steps\"}},\n",
                "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", rank,
                ",\"tid\":1,\"args\":{\"name\":\"buckets\"}},\n",
                "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", rank,
                ",\"tid\":1000,\"args\":{\"name\":\"background\"}}");
  on_.store(true, std::memory_order_relaxed);
}

DDP_INLINE void Timeline::align(std::int64_t offset_ns, std::int64_t zero_ns,
                                std::string_view run) {
  std::lock_guard lock(mutex_);
  if (aligned_ || file_ == nullptr) return;
  offset_ns_ = offset_ns;
  zero_ns_ = zero_ns;
  aligned_ = true;
  out_ += concat(",\n{\"name\":\"ddp_clock\",\"ph\":\"M\",\"pid\":", rank_,
                 ",\"args\":{\"offset_ns\":", offset_ns, ",\"run\":", json_quoted(run), "}}");
  flush_pending_locked();
  write_locked();
}

DDP_INLINE int Timeline::lane_of(std::string_view group, std::string_view backend) {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < lanes_.size(); ++i)
    if (lanes_[i] == group) return static_cast<int>(Lane::collectives) + static_cast<int>(i);
  lanes_.emplace_back(group);
  const int lane = static_cast<int>(Lane::collectives) + static_cast<int>(lanes_.size()) - 1;
  if (file_ != nullptr)
    out_ += concat(",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", rank_, ",\"tid\":", lane,
                   ",\"args\":{\"name\":",
                   json_quoted(concat("collectives: ", group, " (", backend, ")")), "}}");
  return lane;
}

DDP_INLINE void Timeline::span(int lane, std::string_view name, std::string_view cat,
                               std::int64_t start_ns, std::int64_t end_ns, std::string_view args) {
  std::lock_guard lock(mutex_);
  if (file_ == nullptr) return;
  if (!aligned_) {
    if (pending_.size() < 100000)
      pending_.push_back(
          {lane, std::string(name), std::string(cat), std::string(args), start_ns, end_ns});
    return;
  }
  format_locked(lane, name, cat, start_ns, end_ns, args);
}

DDP_INLINE void Timeline::format_locked(int lane, std::string_view name, std::string_view cat,
                                        std::int64_t start_ns, std::int64_t end_ns,
                                        std::string_view args) {
  // Appended in place, without temporaries: this runs once per collective.
  const auto quoted = [this](std::string_view text) {
    out_ += '"';
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      if (c == '"' || c == '\\') {
        out_ += '\\';
        out_ += static_cast<char>(c);
      } else if (c < 0x20) {
        out_ += ' ';
      } else if (c < 0x80) {
        out_ += static_cast<char>(c);
      } else {  // UTF-8 kept whole; any other byte becomes '?', so that the file stays JSON
        const std::size_t n = c >= 0xc2 && c <= 0xdf   ? 2
                              : c >= 0xe0 && c <= 0xef ? 3
                              : c >= 0xf0 && c <= 0xf4 ? 4
                                                       : 0;
        bool whole = n != 0 && i + n <= text.size();
        for (std::size_t k = 1; whole && k < n; ++k)
          whole = (static_cast<unsigned char>(text[i + k]) & 0xc0) == 0x80;
        if (whole) {
          out_.append(text.substr(i, n));
          i += n - 1;
        } else {
          out_ += '?';
        }
      }
    }
    out_ += '"';
  };
  out_ += ",\n{\"name\":";
  quoted(name);
  out_ += ",\"cat\":";
  quoted(cat);
  const std::int64_t start = start_ns + offset_ns_ - zero_ns_;
  const std::int64_t dur = end_ns > start_ns ? end_ns - start_ns : 0;
  char fixed[160];
  const int n = std::snprintf(
      fixed, sizeof fixed,
      ",\"ph\":\"X\",\"ts\":%s%lld.%03lld,\"dur\":%lld.%03lld,\"pid\":%d,\"tid\":%d",
      start < 0 ? "-" : "", static_cast<long long>((start < 0 ? -start : start) / 1000),
      static_cast<long long>((start < 0 ? -start : start) % 1000),
      static_cast<long long>(dur / 1000), static_cast<long long>(dur % 1000), rank_, lane);
  out_.append(fixed, static_cast<std::size_t>(std::max(n, 0)));
  if (!args.empty()) {
    out_ += ",\"args\":{";
    out_ += args;
    out_ += '}';
  }
  out_ += '}';
  // Written every 64 KiB, and at least every second: a process killed loses at most its last
  // second.
  if (out_.size() > (std::size_t{1} << 16) || end_ns - last_write_ns_ > 1000000000) write_locked();
}

DDP_INLINE void Timeline::flush_pending_locked() {
  for (const Pending& p : pending_)
    format_locked(p.lane, p.name, p.cat, p.start_ns, p.end_ns, p.args);
  pending_.clear();
}

DDP_INLINE void Timeline::write_locked() {
  if (file_ == nullptr) return;
  if (owner_ != ::getpid()) {  // a fork() child's copy: the file and what is buffered are the
    out_.clear();              // parent's
    return;
  }
  // The document is complete after every write: the closing brackets follow the events, and the
  // next write starts over them.
  static constexpr std::string_view tail = "\n]}\n";
  last_write_ns_ = now_ns();
  out_ += tail;
  const bool ok = std::fwrite(out_.data(), 1, out_.size(), file_) == out_.size() &&
                  std::fflush(file_) == 0 &&
                  std::fseek(file_, -static_cast<long>(tail.size()), SEEK_CUR) == 0;
  out_.clear();
  if (!ok) {  // a full disk: the timeline stops, the program goes on
    std::fprintf(stderr, "[ddp] rank %d: the timeline stopped: %s\n", rank_, std::strerror(errno));
    std::fclose(file_);
    file_ = nullptr;
    on_.store(false, std::memory_order_relaxed);
  }
}

DDP_INLINE void Timeline::flush() {
  std::lock_guard lock(mutex_);
  write_locked();
}

DDP_INLINE void Timeline::close() {
  std::lock_guard lock(mutex_);
  if (file_ == nullptr) return;
  if (!aligned_) {  // a rank that never aligned: its own clock
    aligned_ = true;
    flush_pending_locked();
  }
  write_locked();
  on_.store(false, std::memory_order_relaxed);
  if (file_ != nullptr && owner_ == ::getpid()) std::fclose(file_);
  file_ = nullptr;
}

}  // namespace detail
DDP_END_NAMESPACE
