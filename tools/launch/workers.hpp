// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// LaunchAgent's workers: each one's environment (torchrun's variables and ddp's), fork and exec
/// through the guardian, the output pumped line by line to the console and the logs with its
/// prefix, and stopping them (SIGTERM, then SIGKILL after the grace).

#include "agent.hpp"

DDP_BEGIN_NAMESPACE
namespace detail {

inline std::string LaunchAgent::line_prefix(const Worker& w) const {
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

inline std::vector<std::string> LaunchAgent::worker_env(const Worker& w, int attempt) const {
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
                                         "DDP_OUTPUT_PREFIXED",
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
  // MASTER_PORT is the program's (torch.distributed's rank 0 hosts its store there); ddp's
  // workers use ddprun's own store, on DDP_STORE_PORT, or the etcd cluster (DDP_STORE).
  for (std::string& kv :
       worker_variables({w.rank, world_, w.local_rank, o_.nproc_per_node, o_.node_rank,
                         o_.store_url.empty() ? o_.master_addr : worker_addr_, worker_port_}))
    env.push_back(std::move(kv));
  // What torchrun also sets, for programs that read it: one role spanning the job.
  env.push_back(concat("GROUP_WORLD_SIZE=", round_members_.empty()
                                                ? o_.nnodes
                                                : static_cast<int>(round_members_.size())));
  env.push_back("ROLE_NAME=" + o_.role);
  env.push_back(concat("ROLE_RANK=", w.rank));
  env.push_back(concat("ROLE_WORLD_SIZE=", world_));
  if (o_.store_url.empty())
    env.push_back(concat("DDP_STORE_PORT=", port_));
  else
    env.push_back(concat("DDP_STORE=", o_.store_url, "/", etcd_namespace()));
  env.push_back("DDP_LAUNCHER=" + o_.name);
  // Every line of the worker's starts with "[rRANK] ": ddp::Logger then adds no prefix of its own
  // (a rank changed since, by shrink or grow, it still says).
  if (o_.prefix_output && o_.prefix_template.empty()) env.push_back("DDP_OUTPUT_PREFIXED=1");
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

inline void LaunchAgent::start(Worker& w, int attempt) {
  forget_left_out(attempt, w.rank);  // a record of an earlier process of this rank
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
  // Its own group (stopping it stops what it started), never outliving the launcher.
  const pid_t pid = fork_worker(true);
  if (pid == 0) {
    if (piped) {
      ::dup2(out[0][1], 1);
      ::dup2(out[1][1], 2);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    const int e = errno;
    (void)!::write(exec_err[1], &e, sizeof e);
    ::_exit(127);
  }
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

inline void LaunchAgent::log_failed(Worker& w, std::string_view doing, int error) {
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

inline void LaunchAgent::emit(Worker& w, Stream& s, std::string_view piece) {
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

inline void LaunchAgent::pump(Worker& w, Stream& s) {
  char buf[65536];
  const ssize_t n = ::read(s.fd.get(), buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {
    end_stream(w, s);
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

inline void LaunchAgent::end_stream(Worker& w, Stream& s) {
  s.fd.reset();
  Stream& other = w.streams[&s == &w.streams[0] ? 1 : 0];
  if (other.fd && s.log && other.log && w.log) return;
  for (Stream* t : {&s, &other}) {
    if (!t->fd && !t->pending.empty()) emit(w, *t, t->pending);  // a last line without newline
    if (!t->fd) t->pending.clear();
  }
}

inline void LaunchAgent::drain(Worker& w) {
  for (auto& s : w.streams) {
    for (int i = 0; s.fd && i < 4096; ++i) {
      pollfd p{s.fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) break;
      pump(w, s);
    }
  }
  for (auto& s : w.streams) {
    if (!s.pending.empty()) emit(w, s, s.pending);
    s.pending.clear();
    s.fd.reset();
  }
  if (w.log) w.log.reset();
}

inline void LaunchAgent::close_logs() {
  for (auto& w : workers_) {
    for (auto& s : w.streams) {
      if (!s.pending.empty()) emit(w, s, s.pending);
      s.pending.clear();
    }
    if (w.log && ::close(w.log.release()) != 0 && errno != EINTR) log_failed(w, "closing", errno);
  }
}

inline void LaunchAgent::stop_workers(Clock::time_point now) {
  if (stopping_) return;
  stopping_ = true;
  // Time to write flight recorders, then SIGTERM; at once without.
  stop_.begin(now, trace_dump_grace(), o_.grace);
  while (const int sig = stop_.due(now)) {
    signal_workers(sig);
    if (sig == SIGTERM) break;  // SIGKILL after the grace, not now
  }
}

}  // namespace detail
DDP_END_NAMESPACE
