// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::LaunchAgent, one node's agent of ddp::launch: its state and its parts. The parts are
/// defined in rooms of their own: meeting the other agents (rendezvous.hpp), the workers
/// (workers.hpp), the outcome of an attempt (outcome.hpp); tools/launch/launch.hpp puts
/// them together.

#include "options.hpp"

DDP_BEGIN_NAMESPACE
namespace detail {

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

  int run();

 private:
  template <class... A>
  void say(const A&... a) const {
    const std::string line = concat(o_.name, ": ", a..., '\n');
    write_fully(2, line.data(), line.size());
  }

  // Where the logs and the workers' error files go: log_dir, or (for logs that -r/-t asked for
  // without one) a new directory that stays; error files alone go to one removed at the end.
  void prepare_dirs();

  /// The wait before restart `failed_in_a_row` of a row of failed attempts (1, 2, ...).
  [[nodiscard]] std::chrono::milliseconds restart_delay(int failed_in_a_row) const {
    auto d = o_.restart_backoff;
    for (int i = 1; i < failed_in_a_row && d < o_.restart_backoff_max; ++i) d *= 2;
    return std::min(d, o_.restart_backoff_max);
  }

  // Waits `delay` before `attempt` starts, or less: a signal ends the wait (run_attempt() then
  // starts no worker and concludes the attempt as interrupted).
  void wait_before_restart(std::chrono::milliseconds delay, int attempt);

  [[nodiscard]] static std::string temp_dir(const char* prefix);

  static void remove_tree(const std::string& path);

  [[nodiscard]] std::string error_file(const Worker& w, int attempt) const {
    return concat(error_dir_, "/attempt_", attempt, "/rank_", w.rank, ".error.json");
  }

  // What a worker's failure is reported as: how it ended, and the message it left in its error
  // file (a Python worker's @record, or any program that writes torchrun's format), if any.
  [[nodiscard]] std::string failure_text(const Worker& w, int attempt) const;

  // With TORCHELASTIC_ERROR_FILE set for ddprun itself (a scheduler asks, as torchelastic
  // does), the root cause in torchrun's format.
  void write_own_error_file(const LaunchFailure& f) const;

  // A port for the workers' MASTER_PORT, free now on master_addr and below the ephemeral range
  // (so that a peer's connect can never be given it as its own source port): the program's
  // rank 0 binds it (torch.distributed's TCPStore, ddp with its own store); ddprun's store stays
  // on --master-port and reaches ddp workers as DDP_STORE_PORT.
  [[nodiscard]] int pick_worker_port() const;

  struct RendezvousInterrupted {
    int sig;
  };

  /// Whether this agent decides for the job (hosts the store; with etcd: node 0).
  [[nodiscard]] bool leader() const {
    return server_ != nullptr || (!o_.store_url.empty() && o_.node_rank == 0);
  }

  /// The etcd cluster, reached within join_timeout: tried for a second at a time, so that
  /// SIGINT, SIGTERM or SIGHUP ends the wait at once (RendezvousInterrupted).
  Store connect_etcd_interruptibly(StoreOptions so);

  /// The etcd namespace of this job's run (--rdzv-id).
  [[nodiscard]] std::string etcd_namespace() const { return concat("ddprun-", o_.run_id); }

  // Registers this node and learns where its ranks start.
  void register_node();

  /// --nnodes MIN:MAX without --on-failure shrink or rejoin: torchrun's elastic way, where any
  /// change of membership restarts every worker.
  [[nodiscard]] bool elastic_restart() const {
    return o_.min_nodes > 0 && !o_.shrink_on_failure && !o_.rejoin_on_failure;
  }

  /// Sets this node's place from a round's members (node ranks); whether it is among them.
  bool take_members(const std::vector<int>& members);

  /// The nodes here now: claimed, their agents alive.
  [[nodiscard]] std::vector<int> nodes_present();

  /// The members of round `attempt` (torchrun's re-rendezvous): decided by the lowest node
  /// present (one compare-and-set: every agent reads the same), at least MIN of them.
  void next_round(int attempt);

  /// A node that came after the start (torchrun's way): asks for a round, and joins the first
  /// one that has it.
  void await_round_with_me();

  void read_worker_address();

  // Ends the wait for the nodes on a signal (SIGINT, SIGTERM, SIGHUP): 128 + N.
  void check_join_signals();

  // --nnodes MIN:MAX. Node 0 (the store's host) starts the job with the nodes there once MIN
  // are and no other came within last_call (or MAX are): "members". A node not among them is
  // late: its workers take the ranks after the job's and join it (DDP_REJOIN=1).
  void register_node_elastic();

  // Tells node 0 this agent is done with the store; node 0 waits for all of them.
  void finish();

  /// prefix_template with its macros replaced for worker `w`.
  [[nodiscard]] std::string line_prefix(const Worker& w) const;

  [[nodiscard]] std::vector<std::string> worker_env(const Worker& w, int attempt) const;

  void start(Worker& w, int attempt);

  // A worker's log file cannot be written (`doing` it failed with `error`): said once, and from
  // here on its output goes to the console only, the streams that went to the log only included
  // (unless --local-ranks-filter keeps it off the console); run() makes the exit status say so.
  void log_failed(Worker& w, std::string_view doing, int error);

  // Forwards a piece of a stream's output: a line with its newline, a megabyte without one, or
  // what was left at its end. The log file gets it as it is; the console as a line of its own
  // with the prefix, in one write, so that lines never mix.
  void emit(Worker& w, Stream& s, std::string_view piece);

  // Forwards what can be read now, as whole lines.
  void pump(Worker& w, Stream& s);

  // The end of a stream: its last line without a newline is forwarded, unless the other stream
  // writes to the same log and is still open: then it waits for that one's end, so that a line
  // of the other stream is never glued to it in the log.
  void end_stream(Worker& w, Stream& s);

  // A worker about to be restarted: what its pipes still hold is forwarded, then they close.
  void drain(Worker& w);

  // The end of an attempt: what the workers left unfinished (a last line, or the output of what
  // they started and that still holds their pipes) is forwarded, and the log files are closed,
  // where a write the file system deferred can still fail.
  void close_logs();

  void signal_workers(int sig) {
    for (auto& w : workers_)
      if (w.running) ::kill(-w.pid, sig);
  }

  void stop_workers(Clock::time_point now);

  [[nodiscard]] static std::int64_t wall_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  /// "rank 1 (local_rank 1, pid 42)".
  [[nodiscard]] static std::string name(const Worker& w) {
    return concat("rank ", w.rank, " (local_rank ", w.local_rank, ", pid ", w.pid, ")");
  }
  [[nodiscard]] static std::string describe(const Worker& w) {
    return concat(name(w), " ", describe_status(w.status), " after ", fixed1(w.seconds), " s");
  }

  void publish_failure(int attempt, const LaunchFailure& f);

  [[nodiscard]] bool any_failure(int attempt);

  // The root cause among the failures the nodes published for this attempt, if any.
  [[nodiscard]] std::optional<LaunchFailure> published_failure(int attempt);

  void reap(Clock::time_point now, int attempt);

  /// --on-failure shrink or rejoin: the workers of this node that the job left out (their
  /// heartbeat stopped, or the others' shrink() excluded them: "ddp/<attempt>/left/<rank>" in the
  /// store) are ended (SIGKILL: a stopped process too); they could never act again, and a
  /// stopped one would hold the launcher open. Reaped, they count as lost (shrink) or are
  /// restarted to rejoin (rejoin).
  void end_left_out(int attempt);
  /// Forgets a left-out record of world rank `rank` (before a worker of that rank starts).
  void forget_left_out(int attempt, int rank);

  /// --on-failure rejoin: the job's workers (every node's) that ended for good this attempt,
  /// finished or lost, are counted in the store, so that a failed worker is restarted to rejoin
  /// only while some other worker still runs.
  void count_ended(int attempt);
  /// How many workers of the job, other than the `pending` ones that failed just now, still run
  /// (every node's, from the store; this node's alone when the store is gone).
  [[nodiscard]] int others_running(int attempt, int pending);

  /// Whether a worker reaped while its group is being stopped for an error exit died of a signal
  /// that ddprun did not send (it sends SIGTERM, then SIGKILL after the grace period).
  [[nodiscard]] bool crashed_while_stopping(const Worker& w) const {
    return !root_by_signal_ && interrupted_ == 0 && stop_.kill_pending() && WIFSIGNALED(w.status) &&
           WTERMSIG(w.status) != SIGTERM;
  }

  void on_signal(int sig, int attempt);

  LaunchFailure run_attempt(int attempt);

  // Every agent's view of the attempt: code 0 when every worker of every node succeeded, else
  // the root cause's exit status, and whether a restart may follow.
  LaunchFailure conclude(int attempt, std::optional<LaunchFailure> remote);

  /// Whether every node of the attempt (torchrun's way: the round's members; with etcd: every
  /// node that joined) has ended `attempt_key` or is gone (its agent died).
  [[nodiscard]] bool others_ended_or_gone(const std::string& attempt_key);

  /// With DDP_TRACE_DUMP set to a directory, the flight recorders the workers of this attempt
  /// wrote there (on a timeout), compared: who fell behind, and where.
  void report_traces(std::int64_t since) const;

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
  std::unique_ptr<Store> store_;       // the agents' keys ("ddprun/...")
  std::unique_ptr<Store> root_store_;  // the same store, unprefixed: the workers' keys
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
  GracefulStop stop_;                 // SIGTERM, then SIGKILL to the workers after the grace
  std::int64_t attempt_started_ = 0;  // seconds since the epoch
};

}  // namespace detail
DDP_END_NAMESPACE
