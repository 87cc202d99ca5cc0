// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/observe/logging.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <cerrno>
#include <cstdlib>

DDP_BEGIN_NAMESPACE

DDP_INLINE Logger::Logger(int rank, LoggerOptions o) : rank_(rank), o_(o) {
  const char* prefixed = std::getenv("DDP_OUTPUT_PREFIXED");
  const char* started = std::getenv("RANK");
  if (prefixed == nullptr || std::string_view(prefixed) != "1" || started == nullptr) return;
  char* end = nullptr;
  const long r = std::strtol(started, &end, 10);
  if (end != started && *end == '\0' && r >= 0 && r <= std::numeric_limits<int>::max())
    started_as_ = static_cast<int>(r);
}

DDP_INLINE void Logger::write(std::string_view text) const {
  if (enabled()) write_all(std::string(text));
}

DDP_INLINE std::string Logger::vformat(const char* format, va_list args) {
  va_list again;
  va_copy(again, args);
  char small[256];
  const int n = std::vsnprintf(small, sizeof small, format, args);
  std::string out;
  if (n < 0) {
    out = format;  // a malformed format: print it as it is rather than nothing
  } else if (static_cast<std::size_t>(n) < sizeof small) {
    out.assign(small, static_cast<std::size_t>(n));
  } else {
    out.resize(static_cast<std::size_t>(n) + 1);
    std::vsnprintf(out.data(), out.size(), format, again);
    out.resize(static_cast<std::size_t>(n));
  }
  va_end(again);
  return out;
}

DDP_INLINE void Logger::write_all(std::string text) const {
  if (o_.every_rank) {
    // A prefix after the carriage return of a redrawn line, else at the start. Under ddprun,
    // whose "[rRANK] " starts every line already, only a rank changed since (shrink, grow).
    const std::string prefix = started_as_ < 0        ? "[r" + std::to_string(rank_) + "] "
                               : started_as_ != rank_ ? "(now r" + std::to_string(rank_) + ") "
                                                      : std::string();
    text.insert(!text.empty() && text[0] == '\r' ? 1 : 0, prefix);
  }
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(o_.fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // output closed or full: logging never fails the training
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

DDP_INLINE Progress::Progress(const Logger& log, std::string label, std::size_t total, int world,
                              int lines_in_logs)
    : log_(log),
      label_(std::move(label)),
      total_(total),
      world_(std::max(world, 1)),
      terminal_(log.enabled() && log.terminal()),
      lines_(std::max(lines_in_logs, 1)),
      t0_(std::chrono::steady_clock::now()),
      last_draw_(t0_) {}

DDP_INLINE void Progress::update(std::size_t done, std::initializer_list<Value> values) {
  done_ = std::min(done, total_);
  if (!log_.enabled()) return;
  const auto now = std::chrono::steady_clock::now();
  if (terminal_) {
    if (now - last_draw_ < std::chrono::milliseconds(100) && done_ < total_) return;
  } else {
    const std::size_t next =
        total_ * static_cast<std::size_t>(logged_ + 1) / static_cast<std::size_t>(lines_);
    if (done_ < next || logged_ >= lines_) return;
    while (logged_ < lines_ && done_ >= total_ * static_cast<std::size_t>(logged_ + 1) /
                                            static_cast<std::size_t>(lines_))
      ++logged_;
  }
  last_draw_ = now;
  draw(now, values, false);
}

DDP_INLINE void Progress::finish(std::initializer_list<Value> values) {
  finished_ = true;
  if (!log_.enabled()) return;
  if (!terminal_ && logged_ >= lines_) return;  // the last quarter's line is already out
  draw(std::chrono::steady_clock::now(), values, true);
}

DDP_INLINE void Progress::draw(std::chrono::steady_clock::time_point now,
                               std::initializer_list<Value> values, bool last) {
  const double secs = std::chrono::duration<double>(now - t0_).count();
  const int pct = total_ == 0 ? 100 : static_cast<int>(100 * done_ / total_);
  char head[160];
  std::snprintf(head, sizeof head, "%s%s [%-20s] %3d%%  %.0f samples/s", terminal_ ? "\r" : "",
                label_.c_str(), std::string(static_cast<std::size_t>(pct / 5), '#').c_str(), pct,
                static_cast<double>(done_) * world_ / std::max(secs, 1e-9));
  std::string line = head;
  for (const auto& [name, v] : values) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "  %.*s %.4g", static_cast<int>(name.size()), name.data(), v);
    line += buf;
  }
  if (!terminal_ || last) line += '\n';
  log_.write(line);
}

DDP_END_NAMESPACE
