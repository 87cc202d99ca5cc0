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

#include <cstdarg>
#include <cstddef>
#include <cstdio>
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

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/observe/impl/logging.ipp"
#endif
