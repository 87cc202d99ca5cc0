// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/process.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <sys/wait.h>

#include <cerrno>
#include <cstdio>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::vector<std::string> worker_variables(const WorkerPlace& p) {
  return {concat("RANK=", p.rank),
          concat("WORLD_SIZE=", p.world_size),
          concat("LOCAL_RANK=", p.local_rank),
          concat("LOCAL_WORLD_SIZE=", p.local_world_size),
          concat("NODE_RANK=", p.node_rank),
          concat("GROUP_RANK=", p.node_rank),
          concat("MASTER_ADDR=", p.master_addr),
          concat("MASTER_PORT=", p.master_port),
          "DDP_STORE_HOSTED=1"};
}

DDP_INLINE pid_t fork_worker(bool own_group) {
  std::fflush(nullptr);  // nothing buffered is written twice
  sigset_t all, previous;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &previous);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (own_group) ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (const int sig :
         {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE, SIGSEGV, SIGABRT, SIGFPE, SIGILL, SIGBUS})
      ::sigaction(sig, &dfl, nullptr);
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    return 0;
  }
  const int err = errno;
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  if (pid < 0) fail_errno(err, "fork");
  if (own_group) ::setpgid(pid, pid);  // also here: whichever of the two runs first
  return pid;
}

DDP_INLINE std::string describe_status(int status) {
  if (WIFEXITED(status)) return concat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::sigabbrev_np(sig);
    return concat("was killed by SIG", name != nullptr ? name : "?", " (signal ", sig, ")");
  }
  return "stopped";
}

}  // namespace detail
DDP_END_NAMESPACE
