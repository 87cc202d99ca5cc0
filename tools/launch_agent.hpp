// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::launch: the launcher core behind tools/ddprun, one node's agent (detail::LaunchAgent):
/// it hosts or joins the rendezvous store, starts the workers with their environment, forwards
/// their output line by line, watches them and the other nodes, agrees with the other agents on
/// restarts and on the root cause of a failure, and stops everything on a failure or a signal.
/// Only the tools use it; it includes nothing of ddp but <ddp/ddp.hpp>, so it builds against
/// include/ and against the single header alike.

#include <ddp/ddp.hpp>

#include "guardian.hpp"
#include "trace_diagnose.hpp"

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
  /// running job (DDP_REJOIN=1: Communicator::join). 0: a fixed count (nnodes).
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
  /// join the running job (Communicator::join); each worker at most max_restarts times, then as
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

/// One node's agent: starts the workers, forwards their output, watches them and the other
/// nodes, and agrees with the other agents on restarts and on the root cause.
class LaunchAgent {
  using Clock = std::chrono::steady_clock;

  struct Stream {
    Fd fd;
    int out = 1;  // where its lines go on the console: 1 (stdout) or 2 (stderr)
    bool console = true;
    bool log = false;     // also (or only) to the worker's log file
    std::string pending;  // read, not yet forwarded: the start of a line
  };
  struct Worker {
    int rank = 0;
    int local_rank = 0;
    pid_t pid = -1;
    bool running = false;
    int status = 0;
    Clock::time_point started;
    double seconds = 0;  // how long it ran
    Stream streams[2];
    bool shown = true;  // on the console (--local-ranks-filter)
    Fd log;
    std::string log_path;
    std::string prefix;
    int rejoins = 0;  // --on-failure rejoin: restarts of this worker alone
  };

 public:
  explicit LaunchAgent(LaunchOptions o) : o_(std::move(o)) {
    if (o_.nproc_per_node < 1)
      fail(Errc::invalid_argument, "launch: nproc_per_node must be at least 1, got ",
           o_.nproc_per_node);
    if (o_.node_rank == -1 && o_.nnodes == 1) o_.node_rank = 0;
    if (o_.nnodes < 1 || o_.node_rank < -1 || o_.node_rank >= o_.nnodes)
      fail(Errc::invalid_argument, "launch: node rank ", o_.node_rank, " is out of range (",
           o_.nnodes, " node", o_.nnodes == 1 ? "" : "s", ")");
    if (o_.master_port == 0 && o_.nnodes > 1)
      fail(Errc::invalid_argument,
           "launch: a free port (master_port 0) works for a single node only; give the port");
    if (o_.command.empty()) fail(Errc::invalid_argument, "launch: no program given");
    redirect_ = parse_stream_spec(o_.redirects, o_.nproc_per_node, "--redirects");
    tee_ = parse_stream_spec(o_.tee, o_.nproc_per_node, "--tee");
    for (const int r : o_.local_ranks_filter) {
      if (r < 0 || r >= o_.nproc_per_node)
        fail(Errc::invalid_argument, "--local-ranks-filter: local rank ", r,
             " does not exist (local ranks are 0 to ", o_.nproc_per_node - 1, ")");
    }
    own_error_file_ = EnvReader().get("TORCHELASTIC_ERROR_FILE");
  }

  LaunchAgent(const LaunchAgent&) = delete;
  LaunchAgent& operator=(const LaunchAgent&) = delete;
  ~LaunchAgent() {
    if (!scratch_dir_.empty()) remove_tree(scratch_dir_);
  }

  int run() {
    struct sigaction sa {};
    sa.sa_handler = launch_on_signal;
    ::sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    struct sigaction previous[4]{};
    const int sigs[4] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
    // First, while no thread exists: the guardian that removes whatever the workers started
    // however this process ends (guardian.hpp).
    guardian_ = std::make_unique<LaunchGuardian>(
        concat(launch_tag_prefix, random_value<std::uint64_t>(), "=1"));
    if (::pipe2(launch_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) fail_errno(errno, "pipe2");
    for (int i = 0; i < 4; ++i) ::sigaction(sigs[i], &sa, &previous[i]);
    struct Restore {
      const int* sigs;
      struct sigaction* previous;
      ~Restore() {
        for (int i = 0; i < 4; ++i) ::sigaction(sigs[i], &previous[i], nullptr);
        ::close(launch_signal_pipe[0]);
        ::close(launch_signal_pipe[1]);
        launch_signal_pipe[0] = launch_signal_pipe[1] = -1;
      }
    } restore{sigs, previous};

    StoreOptions so;
    so.token = EnvReader().get("DDP_TOKEN");
    so.timeout = o_.join_timeout;
    port_ = o_.master_port;
    if (!o_.store_url.empty()) {  // etcd: nobody hosts; nodes are numbered as they come
      so.lease_ttl = std::chrono::seconds(5);
      try {
        store_ = std::make_unique<Store>(connect_etcd_interruptibly(so).prefixed("ddprun/"));
      } catch (const RendezvousInterrupted& i) {
        return 128 + i.sig;
      }
    } else if (o_.node_rank ==
               -1) {  // the launcher that can listen there is node 0; the others are clients
      try {
        server_ = std::make_unique<StoreServer>(o_.master_addr, port_, so);
        o_.node_rank = 0;
      } catch (const Error& e) {  // in use (node 0 is there) or not an address of this machine
        if (e.code() != Errc::address_in_use && e.code() != Errc::system) throw;
      }
    } else if (o_.node_rank == 0) {
      try {
        server_ = std::make_unique<StoreServer>(o_.master_addr, port_, so);
      } catch (const Error& e) {
        if (e.code() != Errc::address_in_use) throw;
        std::string why = e.what();  // its advice names the variable; ours names the flags
        if (const auto k = why.find("; choose another MASTER_PORT"); k != std::string::npos)
          why.resize(k);
        fail(Errc::address_in_use, "cannot host the rendezvous store: ", why,
             o_.nnodes > 1
                 ? concat("; if another node's launcher runs here with the same node rank (0 "
                          "unless --node-rank says otherwise), give each node its own "
                          "--node-rank or use --rdzv-backend c10d (nodes numbered as they "
                          "join); else pick another ",
                          o_.port_flag)
                 : concat("; pick another ", o_.port_flag, ", or --standalone for a free one"));
      }
      port_ = server_->port();
    }
    if (!store_)
      store_ = std::make_unique<Store>(Store(o_.master_addr, port_, so).prefixed("ddprun/"));
    if (o_.node_rank == -1 && o_.min_nodes > 0) {
      // --nnodes MIN:MAX: the lowest node rank free, also one a node that lost its workers left.
      const std::string me = concat(o_.nproc_per_node, '|', ::getpid());
      for (int k = o_.store_url.empty() ? 1 : 0; k < o_.nnodes && o_.node_rank == -1; ++k)
        if (store_->compare_set(concat("node/", k), "", me) == me) o_.node_rank = k;
      if (o_.node_rank == -1)
        fail(Errc::invalid_argument, "the job at ", host_port(o_.master_addr, port_),
             " already has its maximum of ", o_.nnodes, " nodes (--nnodes ", o_.min_nodes, ":",
             o_.nnodes, "); a node rank is freed when a node's workers are all lost");
      claimed_ = true;
    } else if (o_.node_rank == -1) {
      // Node 0 hosts the store and does not count itself; with etcd every node counts.
      const std::int64_t n = store_->add("arrived", 1) - (o_.store_url.empty() ? 0 : 1);
      if (n >= o_.nnodes)
        fail(Errc::invalid_argument, "more launchers than --nnodes ", o_.nnodes,
             " joined the rendezvous at ", store_->where(),
             o_.store_url.empty() ? " (is another job using it?)"
                                  : " (is another job using this --rdzv-id? give each job a new "
                                    "one)");
      o_.node_rank = static_cast<int>(n);
    }
    try {
      register_node();
    } catch (const RendezvousInterrupted& i) {
      return 128 + i.sig;
    }
    prepare_dirs();
    LaunchFailure f;
    int failed_in_a_row = 0;
    std::chrono::milliseconds delay{0};
    for (int attempt = first_attempt_;; ++attempt) {
      if (delay.count() > 0) wait_before_restart(delay, attempt);
      if (elastic_restart() && attempt > first_attempt_ && interrupted_ == 0) {
        try {
          next_round(attempt);
        } catch (const RendezvousInterrupted& i) {
          return 128 + i.sig;
        }
      }
      const auto began = Clock::now();
      f = run_attempt(attempt);
      if (membership_changed_ && interrupted_ == 0 && f.code == 0) {  // torchrun's way
        membership_changed_ = false;
        say("a node is waiting to join: restarting every worker with it (a membership change, "
            "not counted in --max-restarts)");
        delay = std::chrono::milliseconds(0);
        continue;
      }
      if (f.code == 0 && restarts_ > 0)
        say("every worker succeeded after ", restarts_, restarts_ == 1 ? " restart" : " restarts");
      if (f.code == 0 || !f.restartable || interrupted_ != 0 || restarts_ >= o_.max_restarts) break;
      ++restarts_;
      failed_in_a_row = Clock::now() - began >= o_.restart_backoff_reset ? 1 : failed_in_a_row + 1;
      delay = restart_delay(failed_in_a_row);
      say("restarting the workers",
          delay.count() > 0 ? concat(" in ", seconds_text(delay), " s") : std::string(),
          " (restart ", restarts_, " of ", o_.max_restarts, ")");
    }
    if (!lost_logs_.empty()) {
      std::string which;
      for (const auto& l : lost_logs_) which += concat(which.empty() ? "" : ", ", l);
      const std::string lost =
          lost_logs_.size() == 1 ? std::string("a log") : concat(lost_logs_.size(), " logs");
      if (f.code == 0) {
        f = LaunchFailure{
            o_.node_rank, 1, false,
            concat("every worker succeeded, but ", lost, " could not be written in full: ", which)};
        say(f.what, "; exit status 1");
      } else {
        say("also, ", lost, " could not be written in full: ", which);
      }
    }
    if (f.code != 0) write_own_error_file(f);
    finish();
    return f.code;
  }

 private:
  template <class... A>
  void say(const A&... a) const {
    const std::string line = concat(o_.name, ": ", a..., '\n');
    write_fully(2, line.data(), line.size());
  }

  // Where the logs and the workers' error files go: log_dir, or (for logs that -r/-t asked for
  // without one) a new directory that stays; error files alone go to one removed at the end.
  void prepare_dirs() {
    log_dir_ = o_.log_dir;
    const bool logs_asked = !o_.redirects.empty() || !o_.tee.empty();
    if (log_dir_.empty() && logs_asked) {
      log_dir_ = temp_dir("ddprun-logs-");
      say("worker logs in ", log_dir_);
    }
    error_dir_ = log_dir_;
    if (error_dir_.empty()) error_dir_ = scratch_dir_ = temp_dir("ddprun-errors-");
  }

  /// The wait before restart `failed_in_a_row` of a row of failed attempts (1, 2, ...).
  [[nodiscard]] std::chrono::milliseconds restart_delay(int failed_in_a_row) const {
    auto d = o_.restart_backoff;
    for (int i = 1; i < failed_in_a_row && d < o_.restart_backoff_max; ++i) d *= 2;
    return std::min(d, o_.restart_backoff_max);
  }

  // Waits `delay` before `attempt` starts, or less: a signal ends the wait (run_attempt() then
  // starts no worker and concludes the attempt as interrupted).
  void wait_before_restart(std::chrono::milliseconds delay, int attempt) {
    const auto until = Clock::now() + delay;
    waiting_to_restart_ = true;
    for (auto now = Clock::now(); interrupted_ == 0 && now < until; now = Clock::now()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now).count();
      pollfd p{launch_signal_pipe[0], POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000))) <= 0) continue;
      unsigned char sigs[64];
      const ssize_t n = ::read(launch_signal_pipe[0], sigs, sizeof sigs);
      for (ssize_t i = 0; i < n; ++i) on_signal(sigs[i], attempt);
    }
    waiting_to_restart_ = false;
  }

  [[nodiscard]] static std::string temp_dir(const char* prefix) {
    const std::string base = EnvReader().get("TMPDIR");
    std::string path = concat(base.empty() ? "/tmp" : base, "/", prefix, "XXXXXX");
    if (::mkdtemp(path.data()) == nullptr) fail_errno(errno, "cannot create ", path);
    return path;
  }

  static void remove_tree(const std::string& path) {
    ::nftw(
        path.c_str(),
        [](const char* p, const struct stat*, int, FTW*) {
          (void)::remove(p);
          return 0;
        },
        16, FTW_DEPTH | FTW_PHYS);
  }

  [[nodiscard]] std::string error_file(const Worker& w, int attempt) const {
    return concat(error_dir_, "/attempt_", attempt, "/rank_", w.rank, ".error.json");
  }

  // What a worker's failure is reported as: how it ended, and the message it left in its error
  // file (a Python worker's @record, or any program that writes torchrun's format), if any.
  [[nodiscard]] std::string failure_text(const Worker& w, int attempt) const {
    std::string text = describe(w);
    std::string msg = error_file_message(read_small_file(error_file(w, attempt)));
    if (const auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    if (msg.size() > 400) msg = msg.substr(0, 400) + "...";
    if (!msg.empty()) text += concat(": ", msg);
    return text;
  }

  // With TORCHELASTIC_ERROR_FILE set for ddprun itself (a scheduler asks, as torchelastic
  // does), the root cause in torchrun's format.
  void write_own_error_file(const LaunchFailure& f) const {
    if (own_error_file_.empty()) return;
    const std::string json = concat(
        "{\"message\": {\"message\": ", json_quoted(concat(o_.name, ": ", f.what)),
        ", \"errorCode\": ", f.code, ", \"extraInfo\": {\"py_callstack\": \"\", \"timestamp\": \"",
        static_cast<long long>(std::time(nullptr)), "\"}}}\n");
    // Never through a link, never waiting on a FIFO (one without a reader fails at once).
    const Fd fd(::open(own_error_file_.c_str(),
                       O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644));
    if (!fd) {
      say("cannot write TORCHELASTIC_ERROR_FILE ", own_error_file_, ": ", std::strerror(errno));
      return;
    }
    write_fully(fd.get(), json.data(), json.size());
  }

  // A port for the workers' MASTER_PORT, free now on master_addr and below the ephemeral range
  // (so that a peer's connect can never be given it as its own source port): the program's
  // rank 0 binds it (torch.distributed's TCPStore, ddp with its own store); ddprun's store stays
  // on --master-port and reaches ddp workers as DDP_STORE_PORT.
  [[nodiscard]] int pick_worker_port() const {
    std::uint64_t x = random_value<std::uint64_t>();
    for (int i = 0; i < 64; ++i) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      const int port = 15000 + static_cast<int>((x >> 33) % 17000);
      try {
        const Fd fd = listen_tcp(worker_addr_.empty() ? o_.master_addr : worker_addr_, port, 1);
        return port;
      } catch (const Error&) {
      }
    }
    const Fd fd = listen_tcp(worker_addr_.empty() ? o_.master_addr : worker_addr_, 0, 1);
    return local_port(fd.get());
  }

  struct RendezvousInterrupted {
    int sig;
  };

  /// Whether this agent decides for the job (hosts the store; with etcd: node 0).
  [[nodiscard]] bool leader() const {
    return server_ != nullptr || (!o_.store_url.empty() && o_.node_rank == 0);
  }

  /// The etcd cluster, reached within join_timeout: tried for a second at a time, so that
  /// SIGINT, SIGTERM or SIGHUP ends the wait at once (RendezvousInterrupted).
  Store connect_etcd_interruptibly(StoreOptions so) {
    const auto until = Clock::now() + o_.join_timeout;
    for (;;) {
      check_join_signals();
      StoreOptions probe = so;
      probe.timeout = std::min<std::chrono::milliseconds>(
          std::chrono::seconds(1),
          std::max(std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()),
                   std::chrono::milliseconds(1)));
      try {
        (void)Store(connect_etcd(o_.store_url, "--rdzv-endpoint", etcd_namespace(), probe));
        return Store(connect_etcd(o_.store_url, "--rdzv-endpoint", etcd_namespace(), so));
      } catch (const Error& e) {
        if (e.code() != Errc::timeout && e.code() != Errc::peer_lost) throw;
        if (Clock::now() >= until)
          fail(Errc::timeout, "the etcd cluster at ", o_.store_url.substr(7),
               " did not answer within ",
               fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s (", e.what(),
               "); is a majority of its members up, and --rdzv-endpoint right?");
      }
    }
  }

  /// The etcd namespace of this job's run (--rdzv-id).
  [[nodiscard]] std::string etcd_namespace() const { return concat("ddprun-", o_.run_id); }

  // Registers this node and learns where its ranks start.
  void register_node() {
    if (!server_) {
      // Should this agent die, the others stop waiting for it (the store applies this record).
      const std::pair<std::string, std::string> gone[] = {
          {concat("agent_gone/", o_.node_rank), ""}};
      store_->set_on_close(gone);
    }
    if (!o_.store_url.empty()) worker_addr_ = store_->local_address();  // reaches the cluster
    if (leader()) {
      worker_port_ = pick_worker_port();
      store_->set("worker_port", std::to_string(worker_port_));
      store_->set("worker_addr", worker_addr_);
    }
    const std::string me = concat(o_.nproc_per_node, '|', ::getpid());
    // --nnodes MIN:MAX: a node that claims its rank once the job started is late (a node that
    // left freed that rank: its workers join as newcomers).
    const std::string started[] = {"members"};
    replacing_ = o_.min_nodes > 0 && store_->check(started);
    const bool taken =
        !claimed_ && store_->compare_set(concat("node/", o_.node_rank), "", me) != me;
    if (taken && !o_.store_url.empty())
      fail(Errc::invalid_argument, "node rank ", o_.node_rank, " is already taken in ",
           store_->where(),
           ": another launcher of this job has it, or a run that used this --rdzv-id before (its "
           "keys vanish a minute after it ended): give each node its own --node-rank (or none), "
           "and each job a new --rdzv-id");
    if (taken)
      fail(Errc::invalid_argument, "node rank ", o_.node_rank,
           " is already taken by another launcher (each node needs its own --node-rank from 0 "
           "to ",
           o_.nnodes - 1,
           o_.min_nodes > 0 ? "; with --nnodes MIN:MAX a node frees its rank when its workers "
                              "are all lost, and --rdzv-backend c10d takes a free one)"
                            : ")");
    (void)store_->add("agents", 1);
    if (o_.min_nodes > 0) {
      register_node_elastic();
      return;
    }
    std::vector<std::string> keys;
    for (int i = 0; i < o_.nnodes; ++i) keys.push_back(concat("node/", i));
    // In slices, so that SIGINT, SIGTERM or SIGHUP ends the wait at once (128 + N).
    const auto join_until = Clock::now() + o_.join_timeout;
    std::vector<std::string> missing = keys;
    while (!missing.empty() && Clock::now() < join_until) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(join_until - Clock::now());
      missing = store_->missing_after(keys, std::min(left, std::chrono::milliseconds(200)));
      check_join_signals();
    }
    if (!missing.empty()) {
      std::string who;
      for (const auto& k : missing) who += concat(who.empty() ? "" : ", ", k.substr(5));
      fail(Errc::timeout, o_.nnodes - static_cast<int>(missing.size()), "/", o_.nnodes,
           " nodes joined within ", fixed1(static_cast<double>(o_.join_timeout.count()) / 1000),
           " s; missing node", missing.size() == 1 ? " " : "s ", who, " (start ", o_.name,
           " on every node with the same --nnodes, ", o_.endpoint_flags, ")");
    }
    for (int i = 0; i < o_.nnodes; ++i) {
      const int n = std::atoi(store_->get(keys[static_cast<std::size_t>(i)]).c_str());
      if (i < o_.node_rank) base_rank_ += n;
      world_ += n;
    }
    read_worker_address();
  }

  /// --nnodes MIN:MAX without --on-failure shrink or rejoin: torchrun's elastic way, where any
  /// change of membership restarts every worker.
  [[nodiscard]] bool elastic_restart() const {
    return o_.min_nodes > 0 && !o_.shrink_on_failure && !o_.rejoin_on_failure;
  }

  /// Sets this node's place from a round's members (node ranks); whether it is among them.
  bool take_members(const std::vector<int>& members) {
    base_rank_ = world_ = 0;
    round_members_ = members;
    bool in = false;
    for (int i : members) {
      const int n = std::atoi(store_->get(concat("node/", i)).c_str());
      if (i < o_.node_rank) base_rank_ += n;
      if (i == o_.node_rank) in = true;
      world_ += n;
    }
    return in;
  }

  /// The nodes here now: claimed, their agents alive.
  [[nodiscard]] std::vector<int> nodes_present() {
    std::vector<int> out;
    for (int i = 0; i < o_.nnodes; ++i) {
      const std::string claim[] = {concat("node/", i)}, gone[] = {concat("agent_gone/", i)};
      if (store_->check(claim) && !store_->check(gone)) out.push_back(i);
    }
    return out;
  }

  /// The members of round `attempt` (torchrun's re-rendezvous): decided by the lowest node
  /// present (one compare-and-set: every agent reads the same), at least MIN of them.
  void next_round(int attempt) {
    const std::string key = concat("members/", attempt);
    const auto until = Clock::now() + o_.join_timeout;
    for (;;) {
      check_join_signals();
      const std::string k[] = {key};
      if (store_->check(k)) break;
      const std::vector<int> here = nodes_present();
      if (!here.empty() && here.front() == o_.node_rank &&
          static_cast<int>(here.size()) >= o_.min_nodes) {
        std::string list;
        for (int i : here) list += concat(list.empty() ? "" : ",", i);
        (void)store_->compare_set(key, "", list);
        store_->set("round", std::to_string(attempt));
        break;
      }
      if (Clock::now() >= until)
        fail(Errc::timeout, "fewer than ", o_.min_nodes, " nodes (--nnodes ", o_.min_nodes, ":",
             o_.nnodes, ") were there to restart the workers within ",
             fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s");
      (void)store_->missing_after(std::vector<std::string>{key}, std::chrono::milliseconds(100));
    }
    waiting_seen_ = store_->add("waiting", 0);
    if (!take_members(detail::parse_ranks(store_->get(key))))
      fail(Errc::invalid_argument, "node ", o_.node_rank, " was left out of the job's round ",
           attempt, " (more than --nnodes ", o_.nnodes, " nodes?)");
  }

  /// A node that came after the start (torchrun's way): asks for a round, and joins the first
  /// one that has it.
  void await_round_with_me() {
    (void)store_->add("waiting", 1);
    const auto until = Clock::now() + o_.join_timeout;
    for (int seen = std::atoi(detail::peek_key(*store_, "round").c_str());;) {
      check_join_signals();
      for (int a = seen + 1;; ++a) {
        const std::string k[] = {concat("members/", a)};
        if (!store_->check(k)) break;
        seen = a;
        if (take_members(detail::parse_ranks(store_->get(k[0])))) {
          first_attempt_ = a;
          waiting_seen_ = store_->add("waiting", 0);
          return;
        }
      }
      if (Clock::now() >= until)
        fail(Errc::timeout, "node ", o_.node_rank, " was not taken into the running job within ",
             fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  void read_worker_address() {
    if (leader()) return;
    worker_port_ = std::atoi(store_->get("worker_port").c_str());
    if (!o_.store_url.empty()) worker_addr_ = store_->get("worker_addr");
  }

  // Ends the wait for the nodes on a signal (SIGINT, SIGTERM, SIGHUP): 128 + N.
  void check_join_signals() {
    unsigned char sigs[64];
    const ssize_t n = ::read(launch_signal_pipe[0], sigs, sizeof sigs);  // non-blocking
    for (ssize_t i = 0; i < n; ++i) {
      if (sigs[i] == SIGCHLD) continue;
      say("received ", signal_name(sigs[i]), " while waiting for the nodes to join: stopping");
      throw RendezvousInterrupted{sigs[i]};
    }
  }

  // --nnodes MIN:MAX. Node 0 (the store's host) starts the job with the nodes there once MIN
  // are and no other came within last_call (or MAX are): "members". A node not among them is
  // late: its workers take the ranks after the job's and join it (DDP_REJOIN=1).
  void register_node_elastic() {
    const auto join_until = Clock::now() + o_.join_timeout;
    const std::string members_key[] = {"members"};
    if (leader()) {
      std::vector<int> there;
      auto settled = Clock::time_point::max();
      for (;;) {
        check_join_signals();
        std::vector<int> now;
        for (int i = 0; i < o_.nnodes; ++i) {
          const std::string k[] = {concat("node/", i)};
          if (store_->check(k)) now.push_back(i);
        }
        if (now.size() != there.size()) settled = Clock::now() + o_.last_call;
        there = now;
        const int n = static_cast<int>(there.size());
        if (n >= o_.nnodes || (n >= o_.min_nodes && Clock::now() >= settled)) break;
        if (Clock::now() >= join_until)
          fail(Errc::timeout, n, "/", o_.min_nodes, " nodes (at least) joined within ",
               fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s (start ", o_.name,
               " on every node with the same --nnodes, ", o_.endpoint_flags, ")");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      std::string list;
      for (int i : there) list += concat(list.empty() ? "" : ",", i);
      (void)store_->compare_set("members", "", list);
    }
    while (!store_->check(members_key)) {
      check_join_signals();
      if (Clock::now() >= join_until)
        fail(Errc::timeout, "node 0 did not start the job within ",
             fixed1(static_cast<double>(o_.join_timeout.count()) / 1000), " s (start ", o_.name,
             " on node 0 with the same --nnodes, ", o_.endpoint_flags, ")");
      (void)store_->missing_after(std::vector<std::string>{"members"},
                                  std::chrono::milliseconds(200));
    }
    const std::vector<int> members = detail::parse_ranks(store_->get("members"));
    const bool in = take_members(members);
    waiting_seen_ = store_->add("waiting", 0);
    if ((!in || replacing_) && elastic_restart()) {
      // torchrun's way: every worker restarts with the new node at the next round.
      say("node ", o_.node_rank,
          " came after the job started: the running workers are restarted with this node's (a "
          "membership change)");
      await_round_with_me();
      read_worker_address();
      return;
    }
    if (!in || replacing_) {  // late: ranks after every rank given so far
      late_ = true;
      base_rank_ = world_ + static_cast<int>(store_->add("late_ranks", o_.nproc_per_node)) -
                   o_.nproc_per_node;
      world_ = base_rank_ + o_.nproc_per_node;
      say("node ", o_.node_rank, " came after the job started: its workers (ranks ", base_rank_,
          " to ", world_ - 1, ") join the running job");
    }
    read_worker_address();
  }

  // Tells node 0 this agent is done with the store; node 0 waits for all of them.
  void finish() {
    try {
      store_->add("exited", 1);
      if (server_) {
        const auto until = Clock::now() + std::chrono::seconds(10);
        while (store_->add("exited", 0) < store_->add("agents", 0) && Clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const Error&) {  // node 0 is gone already: nothing left to coordinate
    }
  }

  /// prefix_template with its macros replaced for worker `w`.
  [[nodiscard]] std::string line_prefix(const Worker& w) const {
    char host[256] = {};
    (void)::gethostname(host, sizeof host - 1);
    const std::pair<std::string_view, std::string> macros[] = {
        {"${role_name}", o_.role},
        {"${local_rank}", std::to_string(w.local_rank)},
        {"${rank}", std::to_string(w.rank)},
        {"${hostname}", host}};
    std::string out;
    for (std::size_t i = 0; i < o_.prefix_template.size();) {
      bool replaced = false;
      for (const auto& [name, value] : macros) {
        if (std::string_view(o_.prefix_template).substr(i).starts_with(name)) {
          out += value;
          i += name.size();
          replaced = true;
          break;
        }
      }
      if (!replaced) out += o_.prefix_template[i++];
    }
    return out;
  }

  [[nodiscard]] std::vector<std::string> worker_env(const Worker& w, int attempt) const {
    static constexpr const char* ours[] = {"RANK",
                                           "WORLD_SIZE",
                                           "LOCAL_RANK",
                                           "LOCAL_WORLD_SIZE",
                                           "NODE_RANK",
                                           "GROUP_RANK",
                                           "GROUP_WORLD_SIZE",
                                           "ROLE_NAME",
                                           "ROLE_RANK",
                                           "ROLE_WORLD_SIZE",
                                           "MASTER_ADDR",
                                           "MASTER_PORT",
                                           "DDP_LAUNCHER",
                                           "DDP_RESTART_COUNT",
                                           "DDP_REJOIN",
                                           "DDP_STORE_HOSTED",
                                           "DDP_STORE_PORT",
                                           "DDP_STORE",
                                           "TORCHELASTIC_ERROR_FILE",
                                           "TORCHELASTIC_USE_AGENT_STORE",
                                           "TORCHELASTIC_RESTART_COUNT",
                                           "TORCHELASTIC_MAX_RESTARTS",
                                           "TORCHELASTIC_RUN_ID"};
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view kv(*e);
      const auto name = kv.substr(0, kv.find('='));
      if (std::none_of(std::begin(ours), std::end(ours), [&](const char* o) { return name == o; }))
        env.emplace_back(kv);
    }
    env.push_back(concat("RANK=", w.rank));
    env.push_back(concat("WORLD_SIZE=", world_));
    env.push_back(concat("LOCAL_RANK=", w.local_rank));
    env.push_back(concat("LOCAL_WORLD_SIZE=", o_.nproc_per_node));
    env.push_back(concat("NODE_RANK=", o_.node_rank));
    env.push_back(concat("GROUP_RANK=", o_.node_rank));
    // What torchrun also sets, for programs that read it: one role spanning the job.
    env.push_back(concat("GROUP_WORLD_SIZE=", round_members_.empty()
                                                  ? o_.nnodes
                                                  : static_cast<int>(round_members_.size())));
    env.push_back("ROLE_NAME=" + o_.role);
    env.push_back(concat("ROLE_RANK=", w.rank));
    env.push_back(concat("ROLE_WORLD_SIZE=", world_));
    // MASTER_PORT is the program's (torch.distributed's rank 0 hosts its store there); ddp's
    // workers use ddprun's own store, on DDP_STORE_PORT, or the etcd cluster (DDP_STORE).
    if (o_.store_url.empty()) {
      env.push_back(concat("MASTER_ADDR=", o_.master_addr));
      env.push_back(concat("DDP_STORE_PORT=", port_));
    } else {
      env.push_back(concat("MASTER_ADDR=", worker_addr_));  // node 0's
      env.push_back(concat("DDP_STORE=", o_.store_url, "/", etcd_namespace()));
    }
    env.push_back(concat("MASTER_PORT=", worker_port_));
    env.push_back("DDP_LAUNCHER=" + o_.name);
    env.push_back("DDP_STORE_HOSTED=1");
    env.push_back(concat("TORCHELASTIC_ERROR_FILE=", error_file(w, attempt)));
    env.push_back(concat("DDP_RESTART_COUNT=", attempt));
    if (w.rejoins > 0 || late_) env.push_back(concat("DDP_REJOIN=", std::max(w.rejoins, 1)));
    env.push_back(concat("TORCHELASTIC_RESTART_COUNT=", restarts_));  // as torchrun counts
    env.push_back(concat("TORCHELASTIC_MAX_RESTARTS=", o_.max_restarts));
    env.push_back("TORCHELASTIC_RUN_ID=" + o_.run_id);
    if (guardian_) env.push_back(guardian_->tag());
    if (std::getenv("OMP_NUM_THREADS") == nullptr && o_.nproc_per_node > 1)
      env.emplace_back("OMP_NUM_THREADS=1");
    return env;
  }

  void start(Worker& w, int attempt) {
    make_dirs(concat(error_dir_, "/attempt_", attempt));
    ::unlink(error_file(w, attempt).c_str());  // a file left by an earlier launch is not news
    const bool custom = !o_.redirects.empty() || !o_.tee.empty();
    const bool shown = o_.local_ranks_filter.empty() ||
                       std::find(o_.local_ranks_filter.begin(), o_.local_ranks_filter.end(),
                                 w.local_rank) != o_.local_ranks_filter.end();
    for (int s = 0; s < 2; ++s) {
      const auto lr = static_cast<std::size_t>(w.local_rank);
      const bool redirected = custom && (redirect_[lr] & (1 << s)) != 0;
      const bool teed = custom && (tee_[lr] & (1 << s)) != 0;
      w.streams[s].log = custom ? redirected || teed : !log_dir_.empty();
      w.streams[s].console = shown && !redirected;
    }
    w.shown = shown;
    const bool piped = o_.prefix_output || !log_dir_.empty() || !shown || custom;
    int out[2][2] = {{-1, -1}, {-1, -1}};
    if (piped) {
      for (auto& p : out)
        if (::pipe2(p, O_CLOEXEC) != 0) fail_errno(errno, "pipe2");
    }
    int exec_err[2];
    if (::pipe2(exec_err, O_CLOEXEC) != 0) fail_errno(errno, "pipe2");
    // Everything the child needs is prepared here: after fork() in a process with threads (the
    // store server's) only async-signal-safe calls are allowed.
    const auto env = worker_env(w, attempt);
    std::vector<char*> envp, argv;
    for (const auto& kv : env) envp.push_back(const_cast<char*>(kv.c_str()));
    envp.push_back(nullptr);
    for (const auto& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) fail_errno(errno, "fork");
    if (pid == 0) {
      ::setpgid(0, 0);                     // its own group: stopping it stops what it started
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
      if (::getppid() != parent) ::_exit(127);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
      if (piped) {
        ::dup2(out[0][1], 1);
        ::dup2(out[1][1], 2);
      }
      ::execvpe(argv[0], argv.data(), envp.data());
      const int e = errno;
      (void)!::write(exec_err[1], &e, sizeof e);
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    if (guardian_) guardian_->watch(pid);
    ::close(exec_err[1]);
    int e = 0;
    ssize_t n;
    do n = ::read(exec_err[0], &e, sizeof e);
    while (n < 0 && errno == EINTR);
    ::close(exec_err[0]);
    w.pid = pid;
    w.running = true;
    w.started = Clock::now();
    w.prefix = !o_.prefix_output            ? std::string()
               : o_.prefix_template.empty() ? concat("[r", w.rank, "] ")
                                            : line_prefix(w);
    if (piped) {
      for (int s = 0; s < 2; ++s) {
        ::close(out[s][1]);
        w.streams[s].fd.reset(out[s][0]);
        w.streams[s].out = s + 1;
      }
    }
    if (w.streams[0].log || w.streams[1].log) {
      const std::string dir = concat(log_dir_, "/attempt_", attempt);
      make_dirs(dir);
      w.log_path = concat(dir, "/rank_", w.rank, ".log");
      // Never through a link, never waiting on a FIFO (one without a reader fails at once).
      const int keep = w.rejoins > 0 ? O_APPEND : O_TRUNC;  // a restarted worker's log goes on
      w.log.reset(::open(w.log_path.c_str(),
                         O_WRONLY | O_CREAT | keep | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644));
      if (w.log) set_nonblocking(w.log.get(), false);
      if (!w.log) log_failed(w, "opening", errno);
    }
    if (n == static_cast<ssize_t>(sizeof e) && !said_cannot_run_) {  // once, not per worker
      said_cannot_run_ = true;
      say("cannot run \"", o_.command.front(), "\": ", std::strerror(e));
    }
  }

  // A worker's log file cannot be written (`doing` it failed with `error`): said once, and from
  // here on its output goes to the console only, the streams that went to the log only included
  // (unless --local-ranks-filter keeps it off the console); run() makes the exit status say so.
  void log_failed(Worker& w, std::string_view doing, int error) {
    w.log.reset();
    for (auto& s : w.streams) {
      s.console = s.console || (s.log && w.shown);
      s.log = false;
    }
    lost_logs_.push_back(
        concat("rank ", w.rank, "'s log ", w.log_path, " (", std::strerror(error), ")"));
    std::string_view next = "its output from here on goes to the console only";
    if (doing == "closing")
      next = "it may lack the end of the output";
    else if (!w.shown)
      next = "its output from here on is not kept (--local-ranks-filter leaves it off the console)";
    say(doing, " rank ", w.rank, "'s log ", w.log_path, " failed: ", std::strerror(error), "; ",
        next);
  }

  // Forwards a piece of a stream's output: a line with its newline, a megabyte without one, or
  // what was left at its end. The log file gets it as it is; the console as a line of its own
  // with the prefix, in one write, so that lines never mix.
  void emit(Worker& w, Stream& s, std::string_view piece) {
    if (s.log && w.log) {
      if (const int e = write_all(w.log.get(), piece.data(), piece.size()); e != 0)
        log_failed(w, "writing", e);  // the console gets this piece too
    }
    if (s.console) {
      std::string text = w.prefix;
      text.append(piece);
      if (text.back() != '\n') text.push_back('\n');
      write_fully(s.out, text.data(), text.size());
    }
  }

  // Forwards what can be read now, as whole lines.
  void pump(Worker& w, Stream& s) {
    char buf[65536];
    const ssize_t n = ::read(s.fd.get(), buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      if (!s.pending.empty()) emit(w, s, s.pending);  // a last line without its newline
      s.pending.clear();
      s.fd.reset();
      return;
    }
    s.pending.append(buf, static_cast<std::size_t>(n));
    std::size_t from = 0;
    for (std::size_t nl; (nl = s.pending.find('\n', from)) != std::string::npos; from = nl + 1)
      emit(w, s, std::string_view(s.pending).substr(from, nl + 1 - from));
    s.pending.erase(0, from);
    if (s.pending.size() >= (std::size_t{1} << 20)) {  // a megabyte without a newline
      emit(w, s, s.pending);
      s.pending.clear();
    }
  }

  // A worker about to be restarted: what its pipes still hold is forwarded, then they close.
  void drain(Worker& w) {
    for (auto& s : w.streams) {
      for (int i = 0; s.fd && i < 4096; ++i) {
        pollfd p{s.fd.get(), POLLIN, 0};
        if (::poll(&p, 1, 0) <= 0) break;
        pump(w, s);
      }
      if (!s.pending.empty()) emit(w, s, s.pending);
      s.pending.clear();
      s.fd.reset();
    }
    if (w.log) w.log.reset();
  }

  // The end of an attempt: what the workers left unfinished (a last line, or the output of what
  // they started and that still holds their pipes) is forwarded, and the log files are closed,
  // where a write the file system deferred can still fail.
  void close_logs() {
    for (auto& w : workers_) {
      for (auto& s : w.streams) {
        if (!s.pending.empty()) emit(w, s, s.pending);
        s.pending.clear();
      }
      if (w.log && ::close(w.log.release()) != 0 && errno != EINTR) log_failed(w, "closing", errno);
    }
  }

  void signal_workers(int sig) {
    for (auto& w : workers_)
      if (w.running) ::kill(-w.pid, sig);
  }

  void stop_workers(Clock::time_point now) {
    if (stopping_) return;
    stopping_ = true;
    const auto delay = trace_dump_grace();  // time to write flight recorders, then SIGTERM
    term_at_ = now + delay;
    if (delay.count() == 0) {
      signal_workers(SIGTERM);
      term_at_ = Clock::time_point::max();
    }
    kill_at_ = now + delay + o_.grace;
  }

  [[nodiscard]] static std::int64_t wall_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  [[nodiscard]] static std::string describe(const Worker& w) {
    return concat("rank ", w.rank, " (local_rank ", w.local_rank, ", pid ", w.pid, ") ",
                  describe_status(w.status), " after ", fixed1(w.seconds), " s");
  }

  void publish_failure(int attempt, const LaunchFailure& f) {
    try {
      store_->set(concat("attempt/", attempt, "/failure/", o_.node_rank), f.encode());
      store_->set(concat("attempt/", attempt, "/failed"), "1");
    } catch (const Error&) {  // the store is gone: the other agents notice that themselves
    }
  }

  [[nodiscard]] bool any_failure(int attempt) {
    const std::vector<std::string> keys{concat("attempt/", attempt, "/failed")};
    return store_->check(keys);
  }

  // The root cause among the failures the nodes published for this attempt, if any.
  [[nodiscard]] std::optional<LaunchFailure> published_failure(int attempt) {
    std::optional<LaunchFailure> best;
    for (int node = 0; node < o_.nnodes; ++node) {
      const std::vector<std::string> keys{concat("attempt/", attempt, "/failure/", node)};
      if (!store_->check(keys)) continue;
      const auto f = LaunchFailure::decode(node, store_->get(keys[0]));
      if (f && (!best || f->before(*best))) best = f;
    }
    return best;
  }

  void reap(Clock::time_point now, int attempt) {
    std::optional<LaunchFailure> first;  // the root cause among the workers reaped now
    int first_worker = -1;
    std::vector<std::pair<LaunchFailure, int>> failed;  // all of them, for shrink and rejoin
    for (auto& w : workers_) {
      if (!w.running) continue;
      int status = 0;
      const pid_t r = ::waitpid(w.pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      w.running = false;
      w.status = r < 0 ? 0 : status;
      w.seconds = std::chrono::duration<double>(now - w.started).count();
      ::kill(-w.pid, SIGKILL);  // whatever it left behind in its process group
      const bool ok = WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0;
      if (ok) count_ended(attempt);
      if (!ok && (root_cause_ < 0 ? !stopping_ : crashed_while_stopping(w))) {
        const LaunchFailure f{o_.node_rank,
                              exit_code_of(w.status),
                              true,
                              failure_text(w, attempt),
                              WIFSIGNALED(w.status),
                              wall_ns()};
        failed.emplace_back(f, w.local_rank);
        if (!first || f.before(*first)) {
          first = f;
          first_worker = w.local_rank;
        }
      }
    }
    if (!first) return;
    if (elastic_restart() && root_cause_ < 0 && !stopping_) {
      // A worker that failed because another node stopped its own for a waiting node: that is
      // the membership change, not a failure.
      try {
        if (store_->add("waiting", 0) > waiting_seen_) {
          membership_changed_ = true;
          stop_workers(now);
          return;
        }
      } catch (const Error&) {  // the store is gone: a failure as any other
      }
    }
    if ((o_.shrink_on_failure || o_.rejoin_on_failure) && root_cause_ < 0 && !stopping_) {
      // The others go on without it (Communicator::shrink), or it is restarted alone to rejoin
      // them; only when none is left is the attempt a failure, the first loss its root cause.
      int pending = static_cast<int>(failed.size());  // failed now, not yet restarted
      for (const auto& [f, local] : failed) {
        Worker& w = workers_[static_cast<std::size_t>(local)];
        const bool job_left = o_.rejoin_on_failure && others_running(attempt, pending) > 0;
        if (o_.rejoin_on_failure && w.rejoins < o_.max_restarts && !job_left) {
          say(f.what,
              "; not restarting it: every other worker of the job has ended, so there is "
              "no running job to rejoin");
        } else if (o_.rejoin_on_failure && w.rejoins < o_.max_restarts) {
          --pending;
          ++w.rejoins;
          say(f.what, "; restarting it alone to rejoin the job (--on-failure rejoin, restart ",
              w.rejoins, " of ", o_.max_restarts, ")");
          drain(w);
          start(w, attempt);
          continue;
        }
        const bool others = std::any_of(workers_.begin(), workers_.end(),
                                        [](const Worker& o) { return o.running; });
        if (!o_.rejoin_on_failure || w.rejoins >= o_.max_restarts)
          say(f.what,
              others ? "; the other workers go on without it (--on-failure "
                     : "; no worker of this node is left (--on-failure ",
              o_.rejoin_on_failure ? "rejoin: no restart left)" : "shrink)");
        lost_.push_back(f);
        lost_ranks_.push_back(w.rank);
        --pending;
        count_ended(attempt);
      }
      return;
    }
    if (root_cause_ >= 0) {
      // A worker killed or crashed just after a peer of it exited with an error (the peer saw
      // the connection close before this one was reaped): the kill is the root cause.
      say(first->what, "; that is the root cause, not rank ",
          workers_[static_cast<std::size_t>(root_cause_)].rank);
    } else {
      say(first->what, "; stopping the other workers");
    }
    root_cause_ = first_worker;
    root_by_signal_ = first->by_signal;
    publish_failure(attempt, *first);
    stop_workers(now);
  }

  /// --on-failure rejoin: the job's workers (every node's) that ended for good this attempt,
  /// finished or lost, are counted in the store, so that a failed worker is restarted to rejoin
  /// only while some other worker still runs.
  void count_ended(int attempt) {
    if (!o_.rejoin_on_failure) return;
    try {
      (void)store_->add(concat("attempt/", attempt, "/workers_ended"), 1);
    } catch (const Error&) {  // the store is gone: others_running() falls back to this node
    }
  }
  /// How many workers of the job, other than the `pending` ones that failed just now, still run
  /// (every node's, from the store; this node's alone when the store is gone).
  [[nodiscard]] int others_running(int attempt, int pending) {
    const int here = static_cast<int>(
        std::count_if(workers_.begin(), workers_.end(), [](const Worker& o) { return o.running; }));
    try {
      const auto all = store_->add(concat("attempt/", attempt, "/workers"), 0);
      const auto ended = store_->add(concat("attempt/", attempt, "/workers_ended"), 0);
      return std::max(here, static_cast<int>(all - ended) - pending);
    } catch (const Error&) {
      return here;
    }
  }

  /// Whether a worker reaped while its group is being stopped for an error exit died of a signal
  /// that ddprun did not send (it sends SIGTERM, then SIGKILL after the grace period).
  [[nodiscard]] bool crashed_while_stopping(const Worker& w) const {
    return !root_by_signal_ && interrupted_ == 0 && kill_at_ != Clock::time_point::max() &&
           WIFSIGNALED(w.status) && WTERMSIG(w.status) != SIGTERM;
  }

  void on_signal(int sig, int attempt) {
    if (sig == SIGCHLD) return;  // reaped at the top of the loop
    if (interrupted_ != 0) {     // the second one: no more grace
      say(signal_name(sig), " again: killing the workers");
      signal_workers(SIGKILL);
      return;
    }
    interrupted_ = sig;
    if (waiting_to_restart_)
      say("received ", signal_name(sig), " while waiting to restart: not restarting");
    else
      say("received ", signal_name(sig), ": passing it on to the workers");
    signal_workers(sig);
    stopping_ = true;
    term_at_ = Clock::time_point::max();
    kill_at_ = Clock::now() + o_.grace;
    publish_failure(attempt, LaunchFailure{o_.node_rank, 128 + sig, false,
                                           concat(o_.name, " on node ", o_.node_rank, " received ",
                                                  signal_name(sig)),
                                           true, wall_ns()});
  }

  LaunchFailure run_attempt(int attempt) {
    attempt_started_ = static_cast<std::int64_t>(std::time(nullptr));
    workers_.clear();
    workers_.resize(static_cast<std::size_t>(o_.nproc_per_node));
    root_cause_ = -1;
    root_by_signal_ = false;
    stopping_ = false;
    term_at_ = Clock::time_point::max();
    kill_at_ = Clock::time_point::max();
    auto drain_until = Clock::time_point::max();
    std::optional<LaunchFailure> remote;
    if (o_.rejoin_on_failure) {
      try {
        (void)store_->add(concat("attempt/", attempt, "/workers"), o_.nproc_per_node);
      } catch (const Error&) {  // the store is gone: the attempt fails on its own
      }
    }
    for (int i = 0; i < o_.nproc_per_node; ++i) {
      Worker& w = workers_[static_cast<std::size_t>(i)];
      w.rank = base_rank_ + i;
      w.local_rank = i;
      if (interrupted_ == 0) start(w, attempt);  // else interrupted while waiting to restart
    }
    auto next_store_check = Clock::now();
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, Stream*>> owners;
    for (;;) {
      const auto now = Clock::now();
      reap(now, attempt);
      const bool running =
          std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
      const bool open = std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) {
        return w.streams[0].fd || w.streams[1].fd;
      });
      if (!running && (!open || now >= drain_until)) break;
      if (!running && drain_until == Clock::time_point::max())
        drain_until = now + std::chrono::milliseconds(500);  // output in flight, or a leftover
      if (now >= term_at_) {
        signal_workers(SIGTERM);
        term_at_ = Clock::time_point::max();
      }
      if (now >= kill_at_) {
        signal_workers(SIGKILL);
        kill_at_ = Clock::time_point::max();
      }
      if (o_.nnodes > 1 && !remote && root_cause_ < 0 && now >= next_store_check) {
        next_store_check = now + std::chrono::milliseconds(100);
        try {
          if (elastic_restart() && !membership_changed_ && running &&
              store_->add("waiting", 0) > waiting_seen_) {
            membership_changed_ = true;  // a node waits: stop here, restart with it
            stop_workers(now);
          }
          if (any_failure(attempt)) remote = published_failure(attempt);
        } catch (const Error& e) {
          remote =
              LaunchFailure{-1, 1, false, concat("the rendezvous store is gone (", e.what(), ")")};
        }
        if (remote && running) {
          say("node ", o_.node_rank, ": stopping the workers here: ",
              remote->node >= 0 ? concat("node ", remote->node, ": ", remote->what) : remote->what);
          stop_workers(now);
        }
      }
      fds.assign(1, pollfd{launch_signal_pipe[0], POLLIN, 0});
      owners.assign(1, {nullptr, nullptr});
      for (auto& w : workers_) {
        for (auto& s : w.streams) {
          if (!s.fd) continue;
          fds.push_back({s.fd.get(), POLLIN, 0});
          owners.emplace_back(&w, &s);
        }
      }
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        unsigned char sigs[64];
        const ssize_t n = ::read(launch_signal_pipe[0], sigs, sizeof sigs);
        for (ssize_t i = 0; i < n; ++i) on_signal(sigs[i], attempt);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
          pump(*owners[i].first, *owners[i].second);
      }
    }
    close_logs();
    return conclude(attempt, remote);
  }

  // Every agent's view of the attempt: code 0 when every worker of every node succeeded, else
  // the root cause's exit status, and whether a restart may follow.
  LaunchFailure conclude(int attempt, std::optional<LaunchFailure> remote) {
    std::optional<LaunchFailure> local;
    if (root_cause_ >= 0) {
      const Worker& w = workers_[static_cast<std::size_t>(root_cause_)];
      local = LaunchFailure{o_.node_rank, exit_code_of(w.status), true, failure_text(w, attempt)};
    } else if (!lost_.empty()) {
      std::string ranks;
      for (int r : lost_ranks_) ranks += concat(ranks.empty() ? "" : ", ", r);
      const bool some_finished = std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) {
        return WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0;
      });
      if (some_finished)
        say("the workers that remained finished; lost during the run: rank",
            lost_ranks_.size() == 1 ? " " : "s ", ranks);
      else
        local = lost_.front();
      if (!some_finished && o_.min_nodes > 0 && interrupted_ == 0 && o_.node_rank != 0) {
        // --nnodes MIN:MAX: the job goes on without this node; it leaves now and frees its
        // node rank for a replacement (node 0 hosts the store: it stays).
        try {
          store_->add(concat("attempt/", attempt, "/ended"), 1);
          (void)store_->erase(concat("node/", o_.node_rank));
          say("node ", o_.node_rank, " lost all its workers (rank",
              lost_ranks_.size() == 1 ? " " : "s ", ranks,
              "); the job goes on without it, and its node rank is free for another node");
        } catch (const Error&) {  // the store is gone: the job is over anyway
        }
        lost_.clear();
        lost_ranks_.clear();
        local->restartable = false;  // the others go on: no group restart from here
        return *local;
      }
    }
    lost_.clear();
    lost_ranks_.clear();
    if (interrupted_ != 0)
      local = LaunchFailure{o_.node_rank, 128 + interrupted_, false,
                            concat("interrupted by ", signal_name(interrupted_))};
    if (o_.nnodes > 1) {
      // Wait until every node's workers have ended; then all agents read the same verdict.
      try {
        const std::string key = concat("attempt/", attempt, "/ended");
        store_->add(key, 1);
        store_->set(concat(key, "/", o_.node_rank), "");
        if (interrupted_ != 0) return *local;
        const auto until = Clock::now() + o_.join_timeout;
        // Every agent that joined (with --nnodes MIN:MAX, as many as came, not MAX; torchrun's
        // way: the round's members), an agent that died not waited for.
        while ((elastic_restart() || store_->add(key, 0) < store_->add("agents", 0)) &&
               !others_ended_or_gone(key)) {
          if (Clock::now() >= until)
            return LaunchFailure{o_.node_rank, 1, false,
                                 "the other nodes' workers did not end in time (is a launcher "
                                 "gone?)"};
          unsigned char sigs[64];
          const ssize_t n = ::read(launch_signal_pipe[0], sigs, sizeof sigs);  // non-blocking
          for (ssize_t i = 0; i < n; ++i)
            if (sigs[i] != SIGCHLD)
              return LaunchFailure{o_.node_rank, 128 + sigs[i], false,
                                   concat("interrupted by ", signal_name(sigs[i]),
                                          " while waiting for the other nodes' workers to end")};
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        remote = published_failure(attempt);
      } catch (const Error& e) {
        if (!local)
          remote = LaunchFailure{-1, 1, false, concat("lost the rendezvous store: ", e.what())};
      }
    }
    if (membership_changed_ && !remote && !local) return LaunchFailure{};
    // With several nodes the published root cause, the same for every agent, decides.
    LaunchFailure verdict{};
    if (remote) {
      verdict = *remote;
      if (local) verdict.restartable = verdict.restartable && local->restartable;
      if (o_.nnodes > 1 && verdict.node >= 0)
        verdict.what = concat("node ", verdict.node, ": ", verdict.what);
    } else if (local) {
      verdict = *local;
    }
    if (verdict.code != 0 && interrupted_ == 0) {
      say("attempt ", attempt + 1, " failed; root cause: ", verdict.what);
      report_traces(attempt_started_);
    }
    return verdict;
  }

  /// Whether every node of the attempt (torchrun's way: the round's members; with etcd: every
  /// node that joined) has ended `attempt_key` or is gone (its agent died).
  [[nodiscard]] bool others_ended_or_gone(const std::string& attempt_key) {
    if (o_.store_url.empty() && !elastic_restart()) return false;
    for (int i = 0; i < o_.nnodes; ++i) {
      if (elastic_restart() &&
          std::find(round_members_.begin(), round_members_.end(), i) == round_members_.end())
        continue;
      const std::string joined[] = {concat("node/", i)}, ended[] = {concat(attempt_key, "/", i)},
                        gone[] = {concat("agent_gone/", i)};
      if (store_->check(joined) && !store_->check(ended) && !store_->check(gone)) return false;
    }
    return true;
  }

  /// With DDP_TRACE_DUMP set to a directory, the flight recorders the workers of this attempt
  /// wrote there (on a timeout), compared: who fell behind, and where.
  void report_traces(std::int64_t since) const {
    const std::string dir = EnvReader().get("DDP_TRACE_DUMP");
    if (dir.empty() || dir == "stderr" || dir == "-") return;
    const std::vector<TraceDump> dumps = read_trace_dumps(dir, since);
    if (dumps.empty()) return;
    std::string text = diagnose_traces(dumps);
    if (!text.empty() && text.back() == '\n') text.pop_back();
    say("flight recorders in ", dir, " (ddp-trace ", dir, "):\n", text);
  }

  std::unique_ptr<LaunchGuardian> guardian_;  // destroyed last: sweeps after everything else
  LaunchOptions o_;
  std::vector<int> redirect_, tee_;  // per local rank: streams to the log only / to both
  std::string log_dir_;              // o_.log_dir, or a directory made for -r/-t
  std::string error_dir_;            // where the workers' TORCHELASTIC_ERROR_FILEs go
  std::string scratch_dir_;          // error_dir_ when made only for them: removed at the end
  std::string own_error_file_;       // ddprun's own TORCHELASTIC_ERROR_FILE
  int port_ = 0;                     // ddprun's store
  int worker_port_ = 0;              // the workers' MASTER_PORT
  std::string worker_addr_;          // etcd: the workers' MASTER_ADDR (node 0's address)
  int base_rank_ = 0;
  int world_ = 0;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<Store> store_;
  std::vector<Worker> workers_;
  bool late_ = false;                   // --nnodes MIN:MAX: this node came after the start
  int first_attempt_ = 0;               // torchrun's way: the round a late node came in at
  int restarts_ = 0;                    // restarts after failures (--max-restarts)
  bool membership_changed_ = false;     // torchrun's way: a node waits to join this round
  std::int64_t waiting_seen_ = 0;       // the nodes that had asked to join when it began
  std::vector<int> round_members_;      // the node ranks of this round
  bool claimed_ = false;                // --nnodes MIN:MAX, c10d: the node rank was claimed
  bool replacing_ = false;              // --nnodes MIN:MAX: it claimed a rank after the start
  std::vector<std::string> lost_logs_;  // "rank R's log PATH (error)", for the end
  std::vector<LaunchFailure> lost_;     // --on-failure shrink: the workers lost this attempt
  std::vector<int> lost_ranks_;
  bool said_cannot_run_ = false;  // "cannot run PROGRAM" is said once, not per worker
  int root_cause_ = -1;
  bool root_by_signal_ = false;  // the root cause died of a signal (nothing can come before it)
  bool stopping_ = false;
  int interrupted_ = 0;
  bool waiting_to_restart_ = false;
  Clock::time_point term_at_ = Clock::time_point::max();  // SIGTERM then (a stop was delayed)
  Clock::time_point kill_at_ = Clock::time_point::max();
  std::int64_t attempt_started_ = 0;  // seconds since the epoch
};

}  // namespace detail

/// Runs `options.command` as `nproc_per_node` workers on this node, as one node of a job of
/// `nnodes`, and returns the status a launcher should exit with: 0 when every worker of every node
/// succeeded, else the root cause's exit status (128 + N for signal N). Node 0 hosts the
/// rendezvous store. While it runs, SIGINT, SIGTERM and SIGHUP are forwarded to the workers (a
/// second one kills them) and SIGCHLD is handled; the previous handlers are restored afterwards.
/// Throws ddp::Error for bad options and when the nodes cannot meet (Errc::invalid_argument,
/// Errc::timeout, Errc::address_in_use, ...).
inline int launch(const LaunchOptions& options) { return detail::LaunchAgent(options).run(); }

DDP_END_NAMESPACE
