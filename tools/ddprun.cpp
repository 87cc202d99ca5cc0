// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// ddprun: starts a program's worker processes on this node, like torchrun.
//
//   ddprun --nproc-per-node 4 ./train --epochs 3
//   ddprun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 2 ./train   (node 0)
//   ddprun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --nproc-per-node 2 ./train   (node 1)
//
// The agent on node 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT; every agent connects
// to it to register its node, to learn the first rank of its workers, to tell the others when one
// of its workers failed, and to agree on restarts. Each worker gets RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT, DDP_RESTART_COUNT (and
// TORCHELASTIC_RESTART_COUNT), DDP_LAUNCHER=ddprun and DDP_STORE_HOSTED=1.
//
// Failure policy: the first worker to exit non-zero or by a signal is the root cause. The agent
// stops the other workers (SIGTERM to each worker's process group, SIGKILL after --grace), tells
// the other nodes, which stop theirs, prints "rank 2 (local_rank 2, pid N) was killed by SIGKILL
// (signal 9) after 12.3 s", and exits with that worker's status (128 + the signal for a signal),
// unless --max-restarts allows another attempt of the whole group. SIGINT, SIGTERM and SIGHUP
// sent to ddprun are forwarded to every worker; a second one kills them at once.

#include <ddp/ddp.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Config {
  std::string nproc = "1";
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  int max_restarts = 0;
  std::string log_dir;
  bool no_prefix = false;
  double grace = 5;
  double join_timeout = 300;
  std::vector<std::string> command;
};

[[noreturn]] void die(int code, const std::string& msg) {
  fmt::print(stderr, "ddprun: {}\n", msg);
  std::exit(code);
}

// ---- signals: a self-pipe, so the event loop sees them --------------------------------------

int g_signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const auto b = static_cast<unsigned char>(sig);
  (void)!::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

void install_signal_handlers() {
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) die(1, "pipe2 failed");
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

// ---- how many workers ------------------------------------------------------------------------

int visible_cuda_devices() {
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"); v != nullptr) {
    // CUDA stops at the first invalid entry; an empty list hides every device.
    int n = 0;
    std::string s(v);
    std::size_t at = 0;
    while (at < s.size()) {
      const std::size_t comma = std::min(s.find(',', at), s.size());
      const std::string item = s.substr(at, comma - at);
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

int resolve_nproc(const std::string& spec) {
  if (spec == "gpu" || spec == "auto") {
    const int n = visible_cuda_devices();
    if (n > 0) return n;
    if (spec == "gpu")
      die(2,
          "--nproc-per-node gpu: no CUDA device is visible (CUDA_VISIBLE_DEVICES, "
          "/proc/driver/nvidia/gpus); give a number instead");
    return ddp::detail::usable_cpus();
  }
  if (spec == "cpu") return ddp::detail::usable_cpus();
  int n = 0;
  const auto [end, ec] = std::from_chars(spec.data(), spec.data() + spec.size(), n);
  if (ec != std::errc{} || end != spec.data() + spec.size() || n < 1 || n > 4096)
    die(2, fmt::format("--nproc-per-node: expected a number from 1 to 4096, gpu, cpu or auto; "
                       "got \"{}\"",
                       spec));
  return n;
}

// ---- output: whole lines, prefixed with the rank ---------------------------------------------

struct Stream {
  ddp::detail::Fd fd;
  int out = 1;  // where the lines go: 1 (stdout) or 2 (stderr)
  std::string pending;
};

void write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return;  // our own output is gone (a closed pipe): nothing to report it to
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

// ---- workers ---------------------------------------------------------------------------------

/// A failed attempt, as published in the store: which node, the exit status, whether another
/// attempt may follow (not after an interrupt), and what happened.
struct Failure {
  int node = -1;
  int code = 0;
  bool restartable = true;
  std::string what;
  bool by_signal = false;    // a crash or a kill, rather than an exit
  std::int64_t when_ns = 0;  // wall clock, comparable between nodes

  // Which of two failures is the root cause: a worker that crashed or was killed comes before
  // one that exited with an error (typically "peer lost" after the crash), then the earlier.
  [[nodiscard]] bool before(const Failure& o) const {
    if (by_signal != o.by_signal) return by_signal;
    return when_ns < o.when_ns;
  }
};

std::int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Worker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Clock::time_point started;
  double seconds = 0;  // run time, when it ended
  Stream streams[2];
  ddp::detail::Fd log;
  std::string prefix;
};

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe(const Worker& w) {
  return fmt::format("rank {} (local_rank {}, pid {}) {} after {:.1f} s", w.rank, w.local_rank,
                     w.pid, ddp::detail::describe_status(w.status), w.seconds);
}

void mkdirs(const std::string& path) {
  std::string at;
  for (std::size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!at.empty() && ::mkdir(at.c_str(), 0755) != 0 && errno != EEXIST)
        die(1, fmt::format("cannot create {}: {}", at, std::strerror(errno)));
    }
    if (i < path.size()) at += path[i];
  }
}

class Agent {
 public:
  Agent(Config cfg, int nproc) : cfg_(std::move(cfg)), nproc_(nproc) {}

  int run() {
    install_signal_handlers();
    ddp::StoreOptions so;
    so.token = ddp::detail::env_or_empty("DDP_TOKEN");
    so.timeout = std::chrono::milliseconds(static_cast<long>(cfg_.join_timeout * 1000));
    int port = cfg_.standalone ? 0 : cfg_.master_port;
    if (cfg_.node_rank == 0) {
      try {
        server_.emplace(cfg_.master_addr, port, so);
      } catch (const ddp::Error& e) {
        die(1, fmt::format("cannot host the rendezvous store: {}{}", e.what(),
                           e.code() == ddp::Errc::address_in_use
                               ? " (another job may use it: pick another --master-port, or "
                                 "--standalone for a free one)"
                               : ""));
      }
      port = server_->port();
    }
    port_ = port;
    try {
      store_.emplace(ddp::Store(cfg_.master_addr, port, so).prefixed("ddprun/"));
      join();
    } catch (const ddp::Error& e) {
      die(1, fmt::format("node {}: rendezvous failed: {}", cfg_.node_rank, e.what()));
    }
    int code = 0;
    for (int attempt = 0;; ++attempt) {
      const Failure f = run_attempt(attempt);
      code = f.code;
      if (code == 0 || !f.restartable || interrupted_ != 0 || attempt >= cfg_.max_restarts) break;
      fmt::print(stderr, "ddprun: restarting the workers (restart {} of {})\n", attempt + 1,
                 cfg_.max_restarts);
    }
    finish();
    return code;
  }

 private:
  // Registers this node and learns where its ranks start.
  void join() {
    const std::string me = fmt::format("{}|{}", nproc_, ::getpid());
    const std::string key = fmt::format("node/{}", cfg_.node_rank);
    if (const std::string got = store_->compare_set(key, "", me); got != me)
      die(2, fmt::format("node rank {} is already taken by another ddprun (each node needs its "
                         "own --node-rank from 0 to {})",
                         cfg_.node_rank, cfg_.nnodes - 1));
    std::vector<std::string> keys;
    for (int i = 0; i < cfg_.nnodes; ++i) keys.push_back(fmt::format("node/{}", i));
    const auto join_ms = std::chrono::milliseconds(static_cast<long>(cfg_.join_timeout * 1000));
    if (auto missing = store_->missing_after(keys, join_ms); !missing.empty()) {
      std::string who;
      for (const auto& k : missing) who += (who.empty() ? "" : ", ") + k.substr(5);
      die(1, fmt::format("{}/{} nodes joined within {:.0f} s; missing node{} {} (start ddprun on "
                         "every node with the same --nnodes, --master-addr and --master-port)",
                         cfg_.nnodes - static_cast<int>(missing.size()), cfg_.nnodes,
                         cfg_.join_timeout, missing.size() == 1 ? "" : "s", who));
    }
    for (int i = 0; i < cfg_.nnodes; ++i) {
      const std::string v = store_->get(keys[static_cast<std::size_t>(i)]);
      const int n = std::atoi(v.c_str());
      if (i < cfg_.node_rank) base_rank_ += n;
      world_ += n;
    }
  }

  // Tells node 0 this agent is done with the store, and node 0 waits for all of them.
  void finish() {
    try {
      store_->add("exited", 1);
      if (server_) {
        const auto until = Clock::now() + 10s;
        while (store_->add("exited", 0) < cfg_.nnodes && Clock::now() < until)
          std::this_thread::sleep_for(20ms);
      }
    } catch (const ddp::Error&) {  // node 0 is gone already: nothing left to coordinate
    }
  }

  std::vector<std::string> worker_env(const Worker& w, int attempt) const {
    std::vector<std::string> env;
    static constexpr const char* ours[] = {
        "RANK",         "WORLD_SIZE",        "LOCAL_RANK",       "LOCAL_WORLD_SIZE",
        "NODE_RANK",    "GROUP_RANK",        "MASTER_ADDR",      "MASTER_PORT",
        "DDP_LAUNCHER", "DDP_RESTART_COUNT", "DDP_STORE_HOSTED", "TORCHELASTIC_RESTART_COUNT"};
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view kv(*e);
      const auto name = kv.substr(0, kv.find('='));
      if (std::none_of(std::begin(ours), std::end(ours), [&](const char* o) { return name == o; }))
        env.emplace_back(kv);
    }
    env.push_back(fmt::format("RANK={}", w.rank));
    env.push_back(fmt::format("WORLD_SIZE={}", world_));
    env.push_back(fmt::format("LOCAL_RANK={}", w.local_rank));
    env.push_back(fmt::format("LOCAL_WORLD_SIZE={}", nproc_));
    env.push_back(fmt::format("NODE_RANK={}", cfg_.node_rank));
    env.push_back(fmt::format("GROUP_RANK={}", cfg_.node_rank));
    env.push_back(fmt::format("MASTER_ADDR={}", cfg_.master_addr));
    env.push_back(fmt::format("MASTER_PORT={}", port_));
    env.push_back("DDP_LAUNCHER=ddprun");
    env.push_back("DDP_STORE_HOSTED=1");
    env.push_back(fmt::format("DDP_RESTART_COUNT={}", attempt));
    env.push_back(fmt::format("TORCHELASTIC_RESTART_COUNT={}", attempt));
    if (std::getenv("OMP_NUM_THREADS") == nullptr && nproc_ > 1)
      env.emplace_back("OMP_NUM_THREADS=1");
    return env;
  }

  void start(Worker& w, int attempt) {
    const bool piped = !cfg_.no_prefix || !cfg_.log_dir.empty();
    int out[2][2] = {{-1, -1}, {-1, -1}};
    if (piped) {
      for (auto& p : out)
        if (::pipe2(p, O_CLOEXEC) != 0) die(1, "pipe2 failed");
    }
    int exec_err[2];
    if (::pipe2(exec_err, O_CLOEXEC) != 0) die(1, "pipe2 failed");
    // Everything the child needs is prepared here: after fork() in a process with threads (the
    // store server) only async-signal-safe calls are allowed.
    const auto env = worker_env(w, attempt);
    std::vector<char*> envp, argv;
    for (const auto& kv : env) envp.push_back(const_cast<char*>(kv.c_str()));
    envp.push_back(nullptr);
    for (const auto& a : cfg_.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) die(1, fmt::format("fork failed: {}", std::strerror(errno)));
    if (pid == 0) {
      ::setpgid(0, 0);  // its own process group: stopping it stops whatever it started
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive ddprun
      if (::getppid() != parent) ::_exit(127);
      struct sigaction sa {};
      sa.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::sigaction(sig, &sa, nullptr);
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
    ::close(exec_err[1]);
    int e = 0;
    ssize_t n;
    do n = ::read(exec_err[0], &e, sizeof e);
    while (n < 0 && errno == EINTR);
    ::close(exec_err[0]);
    w.pid = pid;
    w.running = true;
    w.started = Clock::now();
    w.prefix = cfg_.no_prefix ? "" : fmt::format("[r{}] ", w.rank);
    if (piped) {
      for (int s = 0; s < 2; ++s) {
        ::close(out[s][1]);
        w.streams[s].fd.reset(out[s][0]);
        w.streams[s].out = s + 1;
        w.streams[s].pending.clear();
      }
    }
    if (!cfg_.log_dir.empty()) {
      const std::string dir = fmt::format("{}/attempt_{}", cfg_.log_dir, attempt);
      mkdirs(dir);
      const std::string path = fmt::format("{}/rank_{}.log", dir, w.rank);
      w.log.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      if (!w.log) die(1, fmt::format("cannot write {}: {}", path, std::strerror(errno)));
    }
    if (n == static_cast<ssize_t>(sizeof e)) {
      fmt::print(stderr, "ddprun: cannot run \"{}\": {}\n", cfg_.command.front(), std::strerror(e));
    }
  }

  void emit(Worker& w, Stream& s, std::string_view line) {
    std::string text = w.prefix;
    text.append(line);
    text.push_back('\n');
    write_all(s.out, text.data(), text.size());  // one line, one write: lines never interleave
    if (w.log) write_all(w.log.get(), text.data() + w.prefix.size(), text.size() - w.prefix.size());
  }

  // Reads what is there; returns false at end of file.
  bool pump(Worker& w, Stream& s) {
    char buf[65536];
    const ssize_t n = ::read(s.fd.get(), buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (n <= 0) {
      if (!s.pending.empty()) emit(w, s, s.pending);  // a last line without its newline
      s.pending.clear();
      s.fd.reset();
      return false;
    }
    s.pending.append(buf, static_cast<std::size_t>(n));
    std::size_t from = 0;
    for (std::size_t nl; (nl = s.pending.find('\n', from)) != std::string::npos; from = nl + 1)
      emit(w, s, std::string_view(s.pending).substr(from, nl - from));
    s.pending.erase(0, from);
    if (s.pending.size() >= (1u << 20)) {  // a megabyte without a newline: pass it on as a line
      emit(w, s, s.pending);
      s.pending.clear();
    }
    return true;
  }

  void signal_workers(int sig) {
    for (auto& w : workers_)
      if (w.running) ::kill(-w.pid, sig);
  }

  void stop_workers(Clock::time_point now) {
    if (stopping_) return;
    stopping_ = true;
    signal_workers(SIGTERM);
    kill_at_ = now + std::chrono::milliseconds(static_cast<long>(cfg_.grace * 1000));
  }

  // Publishes this node's failure to the others (the first one published wins).
  void publish_failure(int attempt, const Failure& f) {
    try {
      store_->set(fmt::format("attempt/{}/failure/{}", attempt, cfg_.node_rank),
                  fmt::format("{}|{}|{}|{}|{}", f.code, f.restartable ? 1 : 0, f.by_signal ? 1 : 0,
                              f.when_ns, f.what));
      store_->set(fmt::format("attempt/{}/failed", attempt), "1");
    } catch (const ddp::Error&) {
    }
  }

  // Whether any node published a failure for this attempt.
  bool any_failure(int attempt) {
    const std::vector<std::string> keys{fmt::format("attempt/{}/failed", attempt)};
    return store_->check(keys);
  }

  // The root cause among the failures the nodes published for this attempt, if any.
  std::optional<Failure> published_failure(int attempt) {
    std::optional<Failure> best;
    for (int node = 0; node < cfg_.nnodes; ++node) {
      const std::string key = fmt::format("attempt/{}/failure/{}", attempt, node);
      const std::vector<std::string> keys{key};
      if (!store_->check(keys)) continue;
      const std::string v = store_->get(key);
      std::vector<std::string> f;
      std::size_t at = 0;
      for (int i = 0; i < 4; ++i) {
        const std::size_t bar = v.find('|', at);
        if (bar == std::string::npos) break;
        f.push_back(v.substr(at, bar - at));
        at = bar + 1;
      }
      if (f.size() != 4) continue;
      Failure x{node,        std::atoi(f[0].c_str()), f[1] == "1", v.substr(at),
                f[2] == "1", std::atoll(f[3].c_str())};
      if (!best || x.before(*best)) best = x;
    }
    return best;
  }

  void reap(Clock::time_point now, int attempt) {
    std::optional<Failure> first;  // the root cause among the workers reaped in this pass
    int first_worker = -1;
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
      if (!ok && root_cause_ < 0 && !stopping_) {
        const Failure f{cfg_.node_rank, exit_code_of(w.status), true,
                        describe(w),    WIFSIGNALED(w.status),  wall_ns()};
        if (!first || f.before(*first)) {
          first = f;
          first_worker = w.local_rank;
        }
      }
    }
    if (first) {
      root_cause_ = first_worker;
      fmt::print(stderr, "ddprun: {}; stopping the other workers\n", first->what);
      publish_failure(attempt, *first);
      stop_workers(now);
    }
  }

  Failure run_attempt(int attempt) {
    workers_.clear();
    workers_.resize(static_cast<std::size_t>(nproc_));
    root_cause_ = -1;
    stopping_ = false;
    kill_at_ = Clock::time_point::max();
    std::optional<Failure> remote;
    for (int i = 0; i < nproc_; ++i) {
      Worker& w = workers_[static_cast<std::size_t>(i)];
      w.rank = base_rank_ + i;
      w.local_rank = i;
      start(w, attempt);
    }
    auto next_store_check = Clock::now();
    for (;;) {
      const auto now = Clock::now();
      reap(now, attempt);
      const bool any_running =
          std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
      const bool any_open = std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) {
        return w.streams[0].fd || w.streams[1].fd;
      });
      if (!any_running && (!any_open || now >= drain_until_)) break;
      if (!any_running && drain_until_ == Clock::time_point::max())
        drain_until_ = now + 500ms;  // output still in flight, or a leftover holds the pipe
      if (now >= kill_at_) {
        signal_workers(SIGKILL);
        kill_at_ = Clock::time_point::max();
      }
      if (cfg_.nnodes > 1 && !remote && root_cause_ < 0 && now >= next_store_check) {
        next_store_check = now + 100ms;
        try {
          if (any_failure(attempt)) remote = published_failure(attempt);
        } catch (const ddp::Error& e) {
          remote =
              Failure{-1, 1, false, fmt::format("the rendezvous store is gone ({})", e.what())};
        }
        if (remote && any_running) {
          fmt::print(stderr, "ddprun: node {}: stopping the workers here: {}\n", cfg_.node_rank,
                     remote->node >= 0 ? fmt::format("node {}: {}", remote->node, remote->what)
                                       : remote->what);
          stop_workers(now);
        }
      }
      std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
      std::vector<std::pair<Worker*, Stream*>> owners{{nullptr, nullptr}};
      for (auto& w : workers_) {
        for (auto& s : w.streams) {
          if (!s.fd) continue;
          fds.push_back({s.fd.get(), POLLIN, 0});
          owners.emplace_back(&w, &s);
        }
      }
      const int ready = ::poll(fds.data(), fds.size(), 50);
      if (ready <= 0) continue;
      if (fds[0].revents & POLLIN) {
        unsigned char sigs[64];
        const ssize_t n = ::read(g_signal_pipe[0], sigs, sizeof sigs);
        for (ssize_t i = 0; i < n; ++i) on_signal_received(sigs[i], attempt);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
          pump(*owners[i].first, *owners[i].second);
      }
    }
    drain_until_ = Clock::time_point::max();
    return conclude(attempt, remote);
  }

  void on_signal_received(int sig, int attempt) {
    if (sig == SIGCHLD) return;  // reaped at the top of the loop
    if (interrupted_ != 0) {     // the second one: no more grace
      fmt::print(stderr, "ddprun: {} again: killing the workers\n", ::sigabbrev_np(sig));
      signal_workers(SIGKILL);
      return;
    }
    interrupted_ = sig;
    fmt::print(stderr, "ddprun: received SIG{}: passing it on to the workers\n",
               ::sigabbrev_np(sig));
    signal_workers(sig);
    stopping_ = true;
    kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<long>(cfg_.grace * 1000));
    publish_failure(attempt, Failure{cfg_.node_rank, 128 + sig, false,
                                     fmt::format("ddprun on node {} received SIG{}", cfg_.node_rank,
                                                 ::sigabbrev_np(sig)),
                                     true, wall_ns()});
  }

  // Every agent's view of the attempt: code 0 when every worker of every node succeeded, else
  // the root cause's exit status, and whether a restart may follow.
  Failure conclude(int attempt, std::optional<Failure> remote) {
    std::optional<Failure> local;
    if (root_cause_ >= 0) {
      const Worker& w = workers_[static_cast<std::size_t>(root_cause_)];
      local = Failure{cfg_.node_rank, exit_code_of(w.status), true, describe(w)};
    }
    if (interrupted_ != 0)
      local = Failure{cfg_.node_rank, 128 + interrupted_, false,
                      fmt::format("interrupted by SIG{}", ::sigabbrev_np(interrupted_))};
    if (cfg_.nnodes > 1) {
      // Wait until every node's workers have ended; then all agents read the same verdict.
      try {
        const std::string key = fmt::format("attempt/{}/ended", attempt);
        store_->add(key, 1);
        if (interrupted_ != 0) return *local;
        const auto until =
            Clock::now() + std::chrono::milliseconds(static_cast<long>(cfg_.join_timeout * 1000));
        while (store_->add(key, 0) < cfg_.nnodes) {
          if (Clock::now() >= until) {
            return Failure{cfg_.node_rank, 1, false,
                           "the other nodes' workers did not end in time (is a ddprun gone?)"};
          }
          std::this_thread::sleep_for(50ms);
        }
        remote = published_failure(attempt);
      } catch (const ddp::Error& e) {
        if (!local)
          remote = Failure{-1, 1, false, fmt::format("lost the rendezvous store: {}", e.what())};
      }
    }
    // With several nodes, the published root cause (the same for every agent) decides.
    Failure verdict{};
    if (remote) {
      verdict = *remote;
      if (local) verdict.restartable = verdict.restartable && local->restartable;
      if (cfg_.nnodes > 1 && verdict.node >= 0)
        verdict.what = fmt::format("node {}: {}", verdict.node, verdict.what);
    } else if (local) {
      verdict = *local;
    }
    if (verdict.code != 0 && interrupted_ == 0)
      fmt::print(stderr, "ddprun: attempt {} failed; root cause: {}\n", attempt + 1, verdict.what);
    return verdict;
  }

  Config cfg_;
  int nproc_;
  int port_ = 0;
  int base_rank_ = 0;
  int world_ = 0;
  std::optional<ddp::StoreServer> server_;
  std::optional<ddp::Store> store_;
  std::vector<Worker> workers_;
  int root_cause_ = -1;
  bool stopping_ = false;
  int interrupted_ = 0;
  Clock::time_point kill_at_ = Clock::time_point::max();
  Clock::time_point drain_until_ = Clock::time_point::max();
};

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"ddprun: launch the worker processes of a ddp (or torch.distributed) program"};
  // Both spellings: --nproc-per-node and torchrun's --nproc_per_node.
  app.add_option("--nproc-per-node,--nproc_per_node", cfg.nproc,
                 "workers on this node: a number, gpu (visible CUDA devices), cpu (usable CPUs) "
                 "or auto (gpu when there are GPUs, else cpu)")
      ->capture_default_str();
  app.add_option("--nnodes", cfg.nnodes, "number of nodes")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", cfg.node_rank, "this node's rank, 0 to nnodes-1")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", cfg.master_addr,
                 "address of node 0, where the rendezvous store listens")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", cfg.master_port, "port of the rendezvous store")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str();
  app.add_flag("--standalone", cfg.standalone,
               "a single node on 127.0.0.1 with a free port (no --master-* needed)");
  app.add_option("--max-restarts,--max_restarts", cfg.max_restarts,
                 "restart the whole group up to this many times after a failure")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-dir,--log_dir", cfg.log_dir,
                 "also write each worker's output to DIR/attempt_K/rank_R.log");
  app.add_flag("--no-prefix,--no_prefix", cfg.no_prefix, "do not prefix output lines with [rR]");
  app.add_option("--grace", cfg.grace, "seconds between SIGTERM and SIGKILL when stopping workers")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--join-timeout,--join_timeout", cfg.join_timeout,
                 "seconds to wait for every node to join, and for the others to finish")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.prefix_command();  // everything from the program on belongs to it
  app.footer(
      "Output lines are prefixed with [rRANK] and never interleave. Exit status: 0, or the "
      "status of the first worker that failed (128 + N for signal N).");
  CLI11_PARSE(app, argc, argv);
  cfg.command = app.remaining();
  if (!cfg.command.empty() && cfg.command.front() == "--") cfg.command.erase(cfg.command.begin());
  if (cfg.command.empty()) die(2, "no program given: ddprun [OPTIONS] program [args...]");
  if (cfg.command.front().starts_with("-"))
    die(2, fmt::format("unknown option {} (see ddprun --help)", cfg.command.front()));

  if (cfg.node_rank >= cfg.nnodes)
    die(2,
        fmt::format("--node-rank {} is out of range: --nnodes is {}", cfg.node_rank, cfg.nnodes));
  if (cfg.standalone) {
    if (cfg.nnodes != 1) die(2, "--standalone runs a single node; drop --nnodes");
    cfg.master_addr = "127.0.0.1";
  }
  const int nproc = resolve_nproc(cfg.nproc);
  return Agent(std::move(cfg), nproc).run();
}
