// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/spawn.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

DDP_BEGIN_NAMESPACE

DDP_INLINE void spawn(int nprocs, const std::function<void(Environment)>& fn,
                      const SpawnOptions& options) {
  if (nprocs < 1)
    detail::fail(Errc::invalid_argument, "spawn: nprocs must be at least 1, got ", nprocs);
  std::fflush(nullptr);
  // Bind before forking: the port is known to every child, and no thread exists yet.
  detail::Fd listener = detail::listen_tcp(options.master_addr, options.master_port);
  const int port = detail::local_port(listener.get());

  struct Child {
    pid_t pid = -1;
    detail::Fd error_pipe;
    std::string error;
    int status = 0;
    bool done = false;
    std::string left_out;  // why the job left it out, when spawn ended it for that
  };
  std::vector<Child> children(static_cast<std::size_t>(nprocs));
  for (int r = 0; r < nprocs; ++r) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) detail::fail_errno(errno, "spawn: pipe2");
    // A worker never outlives the parent (killed, say): no orphans spinning in a collective.
    const pid_t pid = detail::fork_worker(false);
    if (pid == 0) {
      ::close(fds[0]);
      listener.reset();
      for (int k = 0; k < r; ++k) children[static_cast<std::size_t>(k)].error_pipe.reset();
      Environment env;
      env.rank = r;
      env.world_size = nprocs;
      env.local_rank = r;
      env.local_world_size = nprocs;
      env.node_rank = 0;
      env.master_addr = options.master_addr;
      env.master_port = port;
      env.launcher = "spawn";
      for (const std::string& kv :
           detail::worker_variables({r, nprocs, r, nprocs, 0, options.master_addr, port})) {
        const std::size_t eq = kv.find('=');
        ::setenv(kv.substr(0, eq).c_str(), kv.c_str() + eq + 1, 1);
      }
      for (const auto& kv : options.env) ::putenv(const_cast<char*>(kv.c_str()));
      int code = 0;
      std::string message;
      try {
        fn(env);
      } catch (const std::exception& e) {
        message = e.what();
        code = 1;
      } catch (...) {
        message = "a non-standard exception";
        code = 1;
      }
      // Less than a pipe's capacity: the parent reads it only after this process has exited.
      if (message.size() > 16384) message.resize(16384);
      if (code != 0) (void)!::write(fds[1], message.data(), message.size());
      std::fflush(nullptr);
      ::_exit(code);  // no atexit handlers or static destructors of the parent's copy
    }
    ::close(fds[1]);
    children[static_cast<std::size_t>(r)].pid = pid;
    children[static_cast<std::size_t>(r)].error_pipe.reset(fds[0]);
  }

  StoreOptions so;
  so.token = detail::EnvReader().get("DDP_TOKEN");
  for (const auto& kv : options.env)  // the workers' token, when the options give them one
    if (kv.rfind("DDP_TOKEN=", 0) == 0) so.token = kv.substr(10);
  StoreServer server(std::move(listener), options.master_addr, so);

  const auto read_error = [](Child& c) {
    char buf[4096];
    for (;;) {
      const ssize_t n = ::read(c.error_pipe.get(), buf, sizeof buf);
      if (n > 0 && c.error.size() < 65536)
        c.error.append(buf, static_cast<std::size_t>(n));
      else if (n < 0 && errno == EINTR)
        continue;
      else
        break;
    }
  };
  // Without stop_on_failure the others go on when a worker is lost; a worker the job left out
  // alive (stopped or hung past the heartbeat, or too slow for the others' shrink) can never act
  // again and would keep spawn waiting: its record in the store ("ddp/<restart>/left/<rank>",
  // as ddprun reads it) ends it.
  std::optional<Store> records;
  if (!options.stop_on_failure && options.end_left_out)
    records.emplace(options.master_addr, server.port(), so);
  const std::string left =
      detail::concat("ddp/", detail::EnvReader().get("DDP_RESTART_COUNT", "0"), "/left/");
  auto next_check = std::chrono::steady_clock::now();
  const auto end_left_out = [&] {
    for (int r = 0; r < nprocs; ++r) {
      Child& c = children[static_cast<std::size_t>(r)];
      const std::string key[] = {detail::concat(left, r)};
      if (c.done || !c.left_out.empty() || !records->check(key)) continue;
      c.left_out = records->get(key[0]);
      if (c.left_out.empty()) c.left_out = "the others went on without it";
      ::kill(c.pid, SIGKILL);
    }
  };
  int first_failed = -1;
  int remaining = nprocs;
  detail::GracefulStop stop;
  const auto dump_delay = detail::trace_dump_grace();  // time to write flight recorders
  while (remaining > 0) {
    bool reaped = false;
    for (int r = 0; r < nprocs; ++r) {  // only our own children: never reap someone else's
      Child& c = children[static_cast<std::size_t>(r)];
      if (c.done) continue;
      int status = 0;
      const pid_t pid = ::waitpid(c.pid, &status, WNOHANG);
      if (pid == 0 || (pid < 0 && errno == EINTR)) continue;
      c.done = true;
      c.status = pid < 0 ? 0 : status;
      --remaining;
      reaped = true;
      read_error(c);
      const bool ok = pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && first_failed < 0) {
        first_failed = r;
        if (options.stop_on_failure)
          stop.begin(detail::GracefulStop::Clock::now(), dump_delay, options.grace);
      }
    }
    while (const int sig = stop.due(detail::GracefulStop::Clock::now())) {
      for (const auto& c : children) {
        if (!c.done) ::kill(c.pid, sig);
      }
    }
    if (records && remaining > 0 && std::chrono::steady_clock::now() >= next_check) {
      next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
      end_left_out();
    }
    if (!reaped && remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (first_failed >= 0) {
    const Child& c = children[static_cast<std::size_t>(first_failed)];
    if (!c.left_out.empty())
      detail::fail(Errc::aborted, "spawn: rank ", first_failed, " (pid ", c.pid,
                   ") was left out of the job (", c.left_out,
                   ") and ended, as it could never act again");
    if (!c.error.empty()) {
      detail::fail(Errc::aborted, "spawn: rank ", first_failed, " (pid ", c.pid,
                   ") failed: ", c.error);
    }
    detail::fail(Errc::aborted, "spawn: rank ", first_failed, " (pid ", c.pid, ") ",
                 detail::describe_status(c.status));
  }
}

DDP_END_NAMESPACE
