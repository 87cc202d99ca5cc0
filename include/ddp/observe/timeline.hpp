// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The timeline: with Options::timeline (or $DDP_TIMELINE) naming a directory, every process
/// writes what its communicators did, when and for how long, as Chrome trace-event JSON
/// (`<dir>/ddp-timeline-rank<R>-<pid>.json`) that Perfetto (ui.perfetto.dev) and chrome://tracing
/// open: one process per rank, one track for the program's steps (GradientAverager's step and
/// its wait for the buckets, checkpoint saves, shrink and grow, the program's own
/// ddp::TimelineSpan), one for the buckets' comm hooks, one per communicator group for its
/// collectives (start, duration, bytes, queueing, the bucket that issued it). Times are on rank
/// 0's clock: init() measures each rank's offset over a few barriers. Off, recording costs one
/// relaxed atomic load per operation. Where CUDA is on, the same spans are NVTX ranges, so that
/// Nsight Systems shows them beside the kernels. `ddp-trace DIR` merges the ranks' files and
/// draws a step of every rank as SVG.

#include "ddp/config.hpp"
#include "ddp/detail/json.hpp"
#include "ddp/detail/lean_std.hpp"

#if DDP_HAS_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The tracks of a rank's timeline (Chrome's thread ids); collectives get one per group from
/// Lane::collectives on; background: work of the library's own threads (AsyncSaver's writes).
enum class Lane : int { steps = 0, buckets = 1, collectives = 2, background = 1000 };

/// The process's timeline writer (see the file comment). Thread-safe.
class Timeline {
 public:
  /// The process's one timeline.
  static Timeline& get();

  /// Whether spans are being recorded (one relaxed load).
  [[nodiscard]] bool on() const noexcept { return on_.load(std::memory_order_relaxed); }

  /// Starts writing to `dir` as world rank `rank` (made if missing); the first call wins, later
  /// ones (split groups, shrink, grow) only register. Errc::system when the file cannot be made.
  void open(const std::string& dir, int rank);

  /// Rank 0's clock minus this process's (nanoseconds), and the file's zero. Spans recorded
  /// before are shifted when written. `run` names the job's run, the same on every rank of it
  /// (ddp-trace keeps runs apart); the file is written out at once.
  void align(std::int64_t offset_ns, std::int64_t zero_ns, std::string_view run);

  /// Pauses (false) or resumes (true) recording into the open file (a benchmark's paired
  /// rounds: the timeline's cost, on against off, in one process).
  void set_recording(bool on) {
    std::lock_guard lock(mutex_);
    on_.store(on && file_ != nullptr, std::memory_order_relaxed);
  }

  /// Whether align() was called.
  [[nodiscard]] bool aligned() {
    std::lock_guard lock(mutex_);
    return aligned_;
  }

  /// The track of a communicator group ("default" for init()'s) on `backend`, named in the
  /// file once.
  int lane_of(std::string_view group, std::string_view backend);

  /// One finished span: `name` on track `lane` from `start_ns` to `end_ns` (now_ns() times),
  /// with `args` a JSON object's members ("\"bytes\":4096") or empty.
  void span(int lane, std::string_view name, std::string_view cat, std::int64_t start_ns,
            std::int64_t end_ns, std::string_view args = {});

  /// Writes what is buffered (the file is then a complete JSON document). Every communicator's
  /// destructor calls it.
  void flush();

  /// flush(), and no more spans: at the process's exit (static destruction).
  void close();

  /// The steady clock in nanoseconds (the spans' clock).
  [[nodiscard]] static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  /// The label of the bucket whose hook runs on this thread (-1: none): the collectives it
  /// issues carry it.
  static int& bucket_label() noexcept {
    thread_local int label = -1;
    return label;
  }

  Timeline() = default;
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  ~Timeline() { close(); }

 private:
  void write_locked();
  void format_locked(int lane, std::string_view name, std::string_view cat, std::int64_t start_ns,
                     std::int64_t end_ns, std::string_view args);
  void flush_pending_locked();

  std::atomic<bool> on_{false};
  std::mutex mutex_;
  std::FILE* file_ = nullptr;
  pid_t owner_ = 0;  // the process that opened the file (a fork() child writes nothing)
  int rank_ = 0;
  bool aligned_ = false;
  std::int64_t offset_ns_ = 0, zero_ns_ = 0, last_write_ns_ = 0;
  std::vector<std::string> lanes_;  // group names, from Lane::collectives on
  struct Pending {
    int lane;
    std::string name, cat, args;
    std::int64_t start_ns, end_ns;
  };
  std::vector<Pending> pending_;  // recorded before align()
  std::string out_;               // formatted, not yet written
};

/// A span from its construction to its destruction on `lane` (an NVTX range too, where CUDA is
/// on); nothing when the timeline is off.
class TimelineScope {
 public:
  TimelineScope(int lane, const char* name, const char* cat) noexcept : lane_(lane) {
    if (!Timeline::get().on()) return;
    name_ = name;
    cat_ = cat;
    start_ = Timeline::now_ns();
#if DDP_HAS_CUDA
    nvtx_ = nvtxRangeStartA(name);
#endif
  }
  TimelineScope(Lane lane, const char* name, const char* cat) noexcept
      : TimelineScope(static_cast<int>(lane), name, cat) {}
  TimelineScope(const TimelineScope&) = delete;
  TimelineScope& operator=(const TimelineScope&) = delete;
  ~TimelineScope() {
    if (name_ == nullptr) return;
#if DDP_HAS_CUDA
    nvtxRangeEnd(nvtx_);
#endif
    try {
      Timeline::get().span(lane_, label_.empty() ? std::string_view(name_) : label_, cat_, start_,
                           Timeline::now_ns(), std::string_view(args_, args_len_));
    } catch (...) {  // a timeline never fails the operation it records
    }
  }
  /// Whether this span records (the timeline was on when it began).
  [[nodiscard]] bool on() const noexcept { return name_ != nullptr; }
  /// The span's name instead of the one it was made with.
  void label(std::string text) { label_ = std::move(text); }
  /// Adds `"key":value` to the span's args (`value` is JSON: a number, or json_quoted text).
  void arg(std::string_view key, std::string_view value) {
    // A fixed buffer: no allocation per operation (what does not fit is left out).
    if (args_len_ + key.size() + value.size() + 4 > sizeof args_) return;
    if (args_len_ != 0) args_[args_len_++] = ',';
    args_[args_len_++] = '"';
    for (const char c : key) args_[args_len_++] = c;
    args_[args_len_++] = '"';
    args_[args_len_++] = ':';
    for (const char c : value) args_[args_len_++] = c;
  }
  /// Adds `"key":number`.
  void arg(std::string_view key, std::int64_t number) {
    char text[24];
    const int n = std::snprintf(text, sizeof text, "%lld", static_cast<long long>(number));
    arg(key, std::string_view(text, static_cast<std::size_t>(std::max(n, 0))));
  }
  /// When the span began (now_ns()).
  [[nodiscard]] std::int64_t start() const noexcept { return start_; }

 private:
  int lane_;
  const char* name_ = nullptr;
  const char* cat_ = "";
  std::int64_t start_ = 0;
  std::string label_;
  char args_[192];
  std::size_t args_len_ = 0;
#if DDP_HAS_CUDA
  nvtxRangeId_t nvtx_ = 0;
#endif
};

/// A bucket's comm hook on the buckets track ("bucket K", its bytes); while it lives, the
/// collectives this thread issues carry the bucket's number (Timeline::bucket_label).
class BucketSpan {
 public:
  BucketSpan(std::size_t bucket, std::size_t bytes)
      : scope_(Lane::buckets, "bucket", "bucket"), previous_(Timeline::bucket_label()) {
    if (!scope_.on()) return;
    scope_.label(concat("bucket ", bucket));
    scope_.arg("bucket", concat(bucket));
    scope_.arg("bytes", concat(bytes));
    Timeline::bucket_label() = static_cast<int>(bucket);
  }
  BucketSpan(const BucketSpan&) = delete;
  BucketSpan& operator=(const BucketSpan&) = delete;
  ~BucketSpan() { Timeline::bucket_label() = previous_; }

 private:
  TimelineScope scope_;
  int previous_;
};

/// A training loop's steps, for the timeline: when the last one ended (when the averager was
/// made, before the first), and how many there were.
struct StepClock {
  std::int64_t last_end_ns = Timeline::get().on() ? Timeline::now_ns() : 0;
  std::uint64_t steps = 0;
};

/// GradientAverager::synchronize() on the steps track ("synchronize": the wait for the
/// buckets) and, when it returns, the step it ends ("step N": since the previous one's end;
/// both end at the same instant).
class StepSpan {
 public:
  explicit StepSpan(StepClock& clock) : clock_(clock) {
    if (!Timeline::get().on()) return;
    start_ = Timeline::now_ns();
#if DDP_HAS_CUDA
    nvtx_ = nvtxRangeStartA("synchronize");
#endif
  }
  StepSpan(const StepSpan&) = delete;
  StepSpan& operator=(const StepSpan&) = delete;
  ~StepSpan() {
    if (start_ == 0) return;
#if DDP_HAS_CUDA
    nvtxRangeEnd(nvtx_);
#endif
    const std::int64_t end = Timeline::now_ns();
    const std::int64_t begin = clock_.last_end_ns != 0 ? clock_.last_end_ns : start_;
    try {
      Timeline& t = Timeline::get();
      t.span(static_cast<int>(Lane::steps), "synchronize", "step", start_, end);
      t.span(static_cast<int>(Lane::steps), concat("step ", clock_.steps), "step", begin, end,
             concat("\"step\":", clock_.steps));
    } catch (...) {
    }
    clock_.last_end_ns = end;
    ++clock_.steps;
  }

 private:
  StepClock& clock_;
  std::int64_t start_ = 0;
#if DDP_HAS_CUDA
  nvtxRangeId_t nvtx_ = 0;
#endif
};

}  // namespace detail

/// A span of the program's own on its rank's "steps" track of the timeline (Options::timeline,
/// $DDP_TIMELINE): `ddp::TimelineSpan span("forward");` from here to the end of the scope
/// (an NVTX range too, where CUDA is on). Nothing is recorded, and nothing allocated, when the
/// timeline is off.
class TimelineSpan {
 public:
  /// Starts the span `name`.
  explicit TimelineSpan(std::string_view name) : scope_(detail::Lane::steps, "span", "user") {
    if (scope_.on()) scope_.label(std::string(name));
  }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;
  ~TimelineSpan() = default;

 private:
  detail::TimelineScope scope_;
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/observe/impl/timeline.ipp"
#endif
