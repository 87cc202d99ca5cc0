// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The launcher's options (ddp::LaunchOptions, ddprun's command line as a struct), the small
/// helpers its agent uses (signals, files, output streams, error files) and LaunchFailure, a
/// failed attempt as the agents publish it. Part of ddp::launch (tools/launch/launch.hpp); only the
/// tools use it, and it includes nothing of ddp but <ddp/ddp.hpp>, so it builds against include/
/// and against the single header alike.

#include <ddp/ddp.hpp>

#include "../trace_diagnose.hpp"
#include "guardian.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

extern "C" char** environ;  // NOLINT: POSIX

DDP_BEGIN_NAMESPACE

/// What a launcher does on one node (tools/ddprun is its command line; see README "Launching").
struct LaunchOptions {
  /// Workers on this node.
  int nproc_per_node = 1;
  int nnodes = 1;
  /// --nnodes MIN:MAX: the job starts once min_nodes nodes (and every other node that arrives
  /// within last_call) are there; a node that comes later, up to nnodes, adds its workers to the
  /// running job (DDP_REJOIN=1: Communicator::enter). 0: a fixed count (nnodes).
  int min_nodes = 0;
  std::chrono::milliseconds last_call{1000};
  /// This node's index; node 0 hosts the rendezvous store. -1: given on arrival, as torchrun's
  /// c10d rendezvous does: the launcher that can listen at master_addr:master_port hosts the
  /// store and is node 0, the others are numbered 1, 2, ... in the order they join.
  int node_rank = 0;
  /// Where node 0's store listens (it binds this address only) and the workers connect.
  std::string master_addr = "127.0.0.1";
  /// --rdzv-backend etcd: the etcd cluster ("etcd://HOST:PORT,...") in which the agents meet and
  /// the workers keep their store (DDP_STORE), so that no node hosts it: losing any node, node 0
  /// included, is like losing any other. "": node 0's own store.
  std::string store_url;
  /// 0 picks a free port (a single node only: the other nodes could not know it).
  int master_port = 29500;
  /// How the command line named the store's address and port, for messages.
  std::string endpoint_flags = "--master-addr and --master-port";
  std::string port_flag = "--master-port";
  /// Restart the whole group (every node) up to this many times after a failure.
  int max_restarts = 0;
  /// What a worker's failure does to the others: false (torchrun's way) stops them all, and the
  /// attempt fails; true lets them go on without it (they form a smaller communicator with
  /// Communicator::shrink), and the attempt succeeds when the workers that remain do.
  bool shrink_on_failure = false;
  /// --on-failure rejoin: a failed worker is restarted alone, as its rank with DDP_REJOIN=N, to
  /// join the running job (Communicator::enter); each worker at most max_restarts times, then as
  /// shrink.
  bool rejoin_on_failure = false;
  /// The wait before a restart: restart_backoff after the first failed attempt, doubled after
  /// each further one in a row, at most restart_backoff_max. An attempt that ran at least
  /// restart_backoff_reset begins a new row (its restart waits restart_backoff again). Zero
  /// restarts at once. SIGINT, SIGTERM and SIGHUP end the wait, and the launch, at once.
  std::chrono::milliseconds restart_backoff{100};
  std::chrono::milliseconds restart_backoff_max{std::chrono::seconds(5)};
  std::chrono::milliseconds restart_backoff_reset{std::chrono::seconds(30)};
  /// When not empty, each worker's output is also written to DIR/attempt_K/rank_R.log (both
  /// streams, unless `redirects` or `tee` say which), byte for byte as the worker wrote it, and
  /// its error file (TORCHELASTIC_ERROR_FILE) is DIR/attempt_K/rank_R.error.json. A log that
  /// cannot be written (ENOSPC, EIO, ...) is named on stderr once; that worker's output goes on
  /// to the console (the streams that went to the log only included), and launch() returns 1 at
  /// the end if it would otherwise return 0.
  std::string log_dir;
  /// torchrun's -r/--redirects and -t/--tee: which streams of which local ranks go to the log
  /// file only (redirects) or to the console and the log file (tee): "0" none, "1" stdout, "2"
  /// stderr, "3" both, for every local rank, or "LOCAL_RANK:N,..." per local rank. Either one
  /// set: the other streams go to the console only, and without log_dir the logs go to a new
  /// directory under $TMPDIR (printed). Neither set: both streams to the console, and to the log
  /// file when log_dir is set.
  std::string redirects;
  std::string tee;
  /// When not empty, only these local ranks' output is shown on the console (all of it is still
  /// written to the log files): torchrun's --local-ranks-filter.
  std::vector<int> local_ranks_filter;
  /// Prefix each output line with "[rR] ", or with `prefix_template` when it is not empty.
  bool prefix_output = true;
  /// torchrun's --log-line-prefix-template: ${role_name}, ${local_rank}, ${rank} and
  /// ${hostname} are replaced; anything else is kept as written.
  std::string prefix_template;
  /// The workers' ROLE_NAME (torchrun's --role) and TORCHELASTIC_RUN_ID (--rdzv-id).
  std::string role = "default";
  std::string run_id = "none";
  /// Between SIGTERM and SIGKILL when stopping workers.
  std::chrono::milliseconds grace{std::chrono::seconds(5)};
  /// How long to wait for every node to join (and, after a failure, for the others to stop).
  std::chrono::milliseconds join_timeout{std::chrono::minutes(5)};
  /// The program and its arguments (looked up in PATH).
  std::vector<std::string> command;
  /// Starts every message launch() prints on stderr.
  std::string name = "ddprun";
};

/// Number of CUDA devices this process may use, without loading CUDA: CUDA_VISIBLE_DEVICES when
/// set (up to its first invalid entry, as CUDA reads it), else the GPUs the NVIDIA driver lists.
[[nodiscard]] inline int visible_cuda_devices() {
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"); v != nullptr) {
    int n = 0;
    const std::string_view s(v);
    for (std::size_t at = 0; at < s.size();) {
      const std::size_t comma = std::min(s.find(',', at), s.size());
      const std::string_view item = s.substr(at, comma - at);
      if (item.empty() || item == "-1") break;
      ++n;
      at = comma + 1;
    }
    return n;
  }
  int n = 0;
  if (DIR* d = ::opendir("/proc/driver/nvidia/gpus"); d != nullptr) {
    while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

namespace detail {

inline std::string fixed1(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, 1);
  return std::string(buf, r.ptr);
}

inline std::string signal_name(int sig) {
  const char* n = ::sigabbrev_np(sig);
  return concat("SIG", n != nullptr ? n : "?");
}

/// Writes all of [p, p + n) to `fd`: 0, or the errno of the write that failed.
[[nodiscard]] inline int write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    if (k == 0) return EIO;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return 0;
}

/// write_all() to the console: when that output is gone (a closed pipe), there is nothing left
/// to report it to.
inline void write_fully(int fd, const char* p, std::size_t n) { (void)write_all(fd, p, n); }

/// Seconds as "0.1", "3.2", "5": the shortest text that reads back as the same value.
inline std::string seconds_text(std::chrono::milliseconds t) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, static_cast<double>(t.count()) / 1000);
  return std::string(buf, r.ptr);
}

inline void make_dirs(const std::string& path) {
  std::string at;
  for (std::size_t i = 0; i <= path.size(); ++i) {
    if ((i == path.size() || path[i] == '/') && !at.empty() && ::mkdir(at.c_str(), 0755) != 0 &&
        errno != EEXIST) {
      fail_errno(errno, "cannot create ", at);
    }
    if (i < path.size()) at += path[i];
  }
}

/// The exit status a launcher reports for a worker's wait status (128 + N for signal N).
inline int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

inline int launch_signal_pipe[2] = {-1, -1};

inline void launch_on_signal(int sig) {
  const int saved = errno;
  const auto b = static_cast<unsigned char>(sig);
  (void)!::write(launch_signal_pipe[1], &b, 1);
  errno = saved;
}

/// torchrun's stream spec ("0".."3", or "LOCAL_RANK:N,..."): the streams (bit 0 stdout, bit 1
/// stderr) it names for each of `n` local ranks. Throws Errc::invalid_argument naming `flag`.
inline std::vector<int> parse_stream_spec(const std::string& spec, int n, const char* flag) {
  std::vector<int> mask(static_cast<std::size_t>(n), 0);
  if (spec.empty()) return mask;
  const auto number = [&](std::string_view t, int lo, int hi) {
    int v = -1;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (ec != std::errc{} || end != t.data() + t.size() || v < lo || v > hi)
      fail(Errc::invalid_argument, flag,
           ": expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
           "or LOCAL_RANK:N,... with local ranks 0 to ",
           n - 1, "; got \"", spec, "\"");
    return v;
  };
  if (spec.find(':') == std::string::npos) {
    std::fill(mask.begin(), mask.end(), number(spec, 0, 3));
    return mask;
  }
  for (std::size_t at = 0; at <= spec.size();) {
    const std::size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string_view item = std::string_view(spec).substr(at, comma - at);
    const std::size_t colon = item.find(':');
    if (colon == std::string_view::npos) number("", 0, -1);  // fails with the message
    mask[static_cast<std::size_t>(number(item.substr(0, colon), 0, n - 1))] =
        number(item.substr(colon + 1), 0, 3);
    at = comma + 1;
  }
  return mask;
}

/// The text of a torchrun error file ({"message": {"message": TEXT, ...}} or {"message": TEXT}),
/// or "" when `json` has none: what a Python worker's @record wrote, for the failure report.
inline std::string error_file_message(std::string_view json) {
  // The string value after the last "message" key before the first string value that is not
  // an object: enough for the two shapes torch writes, without a JSON library.
  std::size_t at = 0;
  for (int depth = 0; depth < 2; ++depth) {
    const std::size_t key = json.find("\"message\"", at);
    if (key == std::string_view::npos) return {};
    at = json.find_first_not_of(" \t\r\n", key + 9);
    if (at == std::string_view::npos || json[at] != ':') return {};
    at = json.find_first_not_of(" \t\r\n", at + 1);
    if (at == std::string_view::npos) return {};
    if (json[at] == '"') break;
    if (json[at] != '{') return {};
  }
  if (at >= json.size() || json[at] != '"') return {};
  std::string out;
  for (std::size_t i = at + 1; i < json.size(); ++i) {
    const char c = json[i];
    if (c == '"') return out;
    if (c != '\\' || i + 1 >= json.size()) {
      out.push_back(c);
      continue;
    }
    const char e = json[++i];
    switch (e) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case 'b':
      case 'f': break;
      case 'u':
        i += 4;
        out.push_back('?');
        break;  // non-ASCII: not needed for a report line
      default: out.push_back(e); break;
    }
  }
  return {};  // unterminated: not a message
}

/// Up to `limit` bytes of a file ("" when it cannot be read). O_NONBLOCK: a FIFO put where a
/// file was expected is read as empty, never waited on.
inline std::string read_small_file(const std::string& path, std::size_t limit = 1 << 20) {
  const Fd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (!fd) return {};
  std::string text(limit, '\0');
  std::size_t n = 0;
  while (n < limit) {
    const ssize_t k = ::read(fd.get(), text.data() + n, limit - n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    n += static_cast<std::size_t>(k);
  }
  text.resize(n);
  return text;
}

/// A failed attempt as agents publish it: which node, the exit status, whether another attempt
/// may follow (not after an interrupt), what happened, and what decides the root cause.
struct LaunchFailure {
  int node = -1;
  int code = 0;
  bool restartable = true;
  std::string what;
  bool by_signal = false;    ///< a crash or a kill, rather than an exit
  std::int64_t when_ns = 0;  ///< wall clock, comparable between nodes

  /// The root cause of two: a worker that crashed or was killed comes before one that exited
  /// with an error (typically "peer lost", after the crash); then the earlier.
  [[nodiscard]] bool before(const LaunchFailure& o) const {
    if (by_signal != o.by_signal) return by_signal;
    return when_ns < o.when_ns;
  }

  [[nodiscard]] std::string encode() const {
    return concat(code, '|', restartable ? 1 : 0, '|', by_signal ? 1 : 0, '|', when_ns, '|', what);
  }
  [[nodiscard]] static std::optional<LaunchFailure> decode(int node, const std::string& v) {
    std::string f[4];
    std::size_t at = 0;
    for (auto& field : f) {
      const std::size_t bar = v.find('|', at);
      if (bar == std::string::npos) return std::nullopt;
      field = v.substr(at, bar - at);
      at = bar + 1;
    }
    return LaunchFailure{node,        std::atoi(f[0].c_str()), f[1] == "1", v.substr(at),
                         f[2] == "1", std::atoll(f[3].c_str())};
  }
};

}  // namespace detail
DDP_END_NAMESPACE
