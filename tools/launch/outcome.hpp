// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// LaunchAgent's outcome of an attempt: reaping the workers, publishing and agreeing on the
/// failure with the other agents (the root cause), signals to the launcher, restarts with their
/// delay, the error files, the trace dumps, and the attempt loop.

#include "agent.hpp"

DDP_BEGIN_NAMESPACE
namespace detail {

inline void LaunchAgent::prepare_dirs() {
  log_dir_ = o_.log_dir;
  const bool logs_asked = !o_.redirects.empty() || !o_.tee.empty();
  if (log_dir_.empty() && logs_asked) {
    log_dir_ = temp_dir("ddprun-logs-");
    say("worker logs in ", log_dir_);
  }
  error_dir_ = log_dir_;
  if (error_dir_.empty()) error_dir_ = scratch_dir_ = temp_dir("ddprun-errors-");
}

inline void LaunchAgent::wait_before_restart(std::chrono::milliseconds delay, int attempt) {
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

inline std::string LaunchAgent::temp_dir(const char* prefix) {
  const std::string base = EnvReader().get("TMPDIR");
  std::string path = concat(base.empty() ? "/tmp" : base, "/", prefix, "XXXXXX");
  if (::mkdtemp(path.data()) == nullptr) fail_errno(errno, "cannot create ", path);
  return path;
}

inline void LaunchAgent::remove_tree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, FTW*) {
        (void)::remove(p);
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

inline std::string LaunchAgent::failure_text(const Worker& w, int attempt) const {
  std::string text = describe(w);
  std::string msg = error_file_message(read_small_file(error_file(w, attempt)));
  if (const auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  if (msg.size() > 400) msg = msg.substr(0, 400) + "...";
  if (!msg.empty()) text += concat(": ", msg);
  return text;
}

inline void LaunchAgent::write_own_error_file(const LaunchFailure& f) const {
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

inline void LaunchAgent::publish_failure(int attempt, const LaunchFailure& f) {
  try {
    store_->set(concat("attempt/", attempt, "/failure/", o_.node_rank), f.encode());
    store_->set(concat("attempt/", attempt, "/failed"), "1");
  } catch (const Error&) {  // the store is gone: the other agents notice that themselves
  }
}

inline bool LaunchAgent::any_failure(int attempt) {
  const std::vector<std::string> keys{concat("attempt/", attempt, "/failed")};
  return store_->check(keys);
}

inline std::optional<LaunchFailure> LaunchAgent::published_failure(int attempt) {
  std::optional<LaunchFailure> best;
  for (int node = 0; node < o_.nnodes; ++node) {
    const std::vector<std::string> keys{concat("attempt/", attempt, "/failure/", node)};
    if (!store_->check(keys)) continue;
    const auto f = LaunchFailure::decode(node, store_->get(keys[0]));
    if (f && (!best || f->before(*best))) best = f;
  }
  return best;
}

inline void LaunchAgent::reap(Clock::time_point now, int attempt) {
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
      const bool others =
          std::any_of(workers_.begin(), workers_.end(), [](const Worker& o) { return o.running; });
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

inline void LaunchAgent::end_left_out(int attempt) {
  if (!root_store_) return;
  for (auto& w : workers_) {
    if (!w.running) continue;
    const std::string key = concat("ddp/", attempt, "/left/", w.rank);
    const std::string k[] = {key};
    try {
      if (!root_store_->check(k)) continue;
      const std::string why = root_store_->get(key);
      (void)root_store_->erase(key);
      say(name(w), " was left out of the job (", why, "): ending it, as it can never act again");
    } catch (const Error&) {  // the store is gone: the attempt ends on its own
      return;
    }
    ::kill(-w.pid, SIGKILL);  // its process group; a stopped process too
  }
}

inline void LaunchAgent::forget_left_out(int attempt, int rank) {
  if (!root_store_ || !(o_.shrink_on_failure || o_.rejoin_on_failure)) return;
  try {
    (void)root_store_->erase(concat("ddp/", attempt, "/left/", rank));
  } catch (const Error&) {  // the store is gone: the worker fails to start on its own
  }
}

inline void LaunchAgent::count_ended(int attempt) {
  if (!o_.rejoin_on_failure) return;
  try {
    (void)store_->add(concat("attempt/", attempt, "/workers_ended"), 1);
  } catch (const Error&) {  // the store is gone: others_running() falls back to this node
  }
}

inline int LaunchAgent::others_running(int attempt, int pending) {
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

inline void LaunchAgent::on_signal(int sig, int attempt) {
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
  stop_.begin_sent(Clock::now(), o_.grace);
  publish_failure(attempt, LaunchFailure{o_.node_rank, 128 + sig, false,
                                         concat(o_.name, " on node ", o_.node_rank, " received ",
                                                signal_name(sig)),
                                         true, wall_ns()});
}

inline LaunchFailure LaunchAgent::run_attempt(int attempt) {
  attempt_started_ = static_cast<std::int64_t>(std::time(nullptr));
  workers_.clear();
  workers_.resize(static_cast<std::size_t>(o_.nproc_per_node));
  root_cause_ = -1;
  root_by_signal_ = false;
  stopping_ = false;
  stop_.reset();
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
  auto next_left_check = Clock::now();
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
    while (const int sig = stop_.due(now)) signal_workers(sig);
    if ((o_.shrink_on_failure || o_.rejoin_on_failure) && running && root_cause_ < 0 &&
        !stopping_ && now >= next_left_check) {
      next_left_check = now + std::chrono::milliseconds(200);
      end_left_out(attempt);
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
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) pump(*owners[i].first, *owners[i].second);
    }
  }
  close_logs();
  return conclude(attempt, remote);
}

inline LaunchFailure LaunchAgent::conclude(int attempt, std::optional<LaunchFailure> remote) {
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

inline bool LaunchAgent::others_ended_or_gone(const std::string& attempt_key) {
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

inline void LaunchAgent::report_traces(std::int64_t since) const {
  const std::string dir = EnvReader().get("DDP_TRACE_DUMP");
  if (dir.empty() || dir == "stderr" || dir == "-") return;
  const std::vector<TraceDump> dumps = read_trace_dumps(dir, since);
  if (dumps.empty()) return;
  std::string text = diagnose_traces(dumps);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  say("flight recorders in ", dir, " (ddp-trace ", dir, "):\n", text);
}

}  // namespace detail
DDP_END_NAMESPACE
