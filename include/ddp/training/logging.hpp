// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Output for training programs: ddp::Logger prints on rank 0 only (or on every rank, each line
/// prefixed with its rank), a whole line per write(2) so that ranks sharing a terminal or a log
/// file never interleave within a line; ddp::Progress draws an epoch's progress bar with the
/// samples per second of the whole job: redrawn in place on a terminal, a line at every quarter
/// (or as asked) in a log file, where carriage returns would pile up.
///
///     ddp::Logger log(comm.rank());                         // rank 0 prints
///     ddp::Progress bar(log, "epoch 1/5", sampler.num_samples(), comm.size());
///     for (...) { ...; bar.update(seen, {{"loss", running_loss}}); }
///     bar.finish();
///     log.print("epoch %d: %s", epoch + 1, metrics.reduce(comm).format().c_str());
///
/// Why in the library rather than in each example: every data-parallel program needs rank
/// gating, whole-line writes and a terminal-or-log decision, and gets them subtly wrong on its own
/// (a bar redrawn into a log file, ranks' half lines mixed); what is drawn stays a few lines here.

#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

DDP_BEGIN_NAMESPACE

/// Where and on which ranks a Logger prints.
struct LoggerOptions {
  /// Every rank prints, each line prefixed "[rN] " (else rank 0 only, without a prefix). Under
  /// ddprun, which prefixes every line with the rank the process started as, a Logger adds
  /// nothing, or "(now rN) " once shrink() or grow() gave the process another rank.
  bool every_rank = false;
  /// The file descriptor lines go to (stdout by default; 2 for stderr).
  int fd = 1;
};

/// Prints whole lines on rank 0 (see the file comment). Copyable; no state but the options.
class Logger {
 public:
  /// A logger for rank `rank` (rank 0 prints unless `o` says every rank does).
  explicit Logger(int rank, LoggerOptions o = {});

  /// Whether this rank prints.
  [[nodiscard]] bool enabled() const noexcept { return o_.every_rank || rank_ == 0; }
  /// Whether the output is a terminal (where Progress redraws in place).
  [[nodiscard]] bool terminal() const noexcept { return ::isatty(o_.fd) == 1; }

  /// printf-style; a newline is added. One write(2) per line.
#if defined(__GNUC__)
  __attribute__((format(printf, 2, 3)))
#endif
  void
  print(const char* format, ...) const {
    if (!enabled()) return;
    va_list args;
    va_start(args, format);
    std::string line = vformat(format, args);
    va_end(args);
    line += '\n';
    write_all(line);
  }

  /// Writes `text` as it is (with the rank prefix when every rank prints), in one write(2).
  void write(std::string_view text) const;

 private:
  static std::string vformat(const char* format, va_list args);

  void write_all(std::string text) const;

  int rank_;
  LoggerOptions o_;
  int started_as_ = -1;  // the RANK ddprun's "[rRANK] " prefix names (-1: no such prefix)
};

#if DDP_BODIES
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
#endif  // DDP_BODIES

/// An epoch's progress bar (see the file comment): `total` samples on this rank, `world` ranks
/// (samples per second are the whole job's: this rank's rate times world, ranks being in step).
class Progress {
 public:
  /// A named value shown after the rate, e.g. {"loss", 0.4123}.
  using Value = std::pair<std::string_view, double>;

  /// A bar labelled `label` (e.g. "epoch 1/5") for `total` samples of this rank, `world` ranks
  /// in step; in a log (not a terminal) a line at each 1/lines_in_logs of the total.
  Progress(const Logger& log, std::string label, std::size_t total, int world = 1,
           int lines_in_logs = 4);
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() {
    if (!finished_) finish();
  }

  /// `done` of the total samples are processed; redraws when it is time (a terminal: at most 10
  /// times a second; a log: at each 1/lines_in_logs of the total).
  void update(std::size_t done, std::initializer_list<Value> values = {});

  /// The final line (100% or wherever it stopped), ending the redrawn one on a terminal.
  void finish(std::initializer_list<Value> values = {});

 private:
  void draw(std::chrono::steady_clock::time_point now, std::initializer_list<Value> values,
            bool last);

  Logger log_;
  std::string label_;
  std::size_t total_;
  int world_;
  bool terminal_;
  int lines_;
  int logged_ = 0;
  std::size_t done_ = 0;
  bool finished_ = false;
  std::chrono::steady_clock::time_point t0_, last_draw_;
};

#if DDP_BODIES
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
#endif  // DDP_BODIES

DDP_END_NAMESPACE
