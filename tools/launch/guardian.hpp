// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The launcher's guardian: a small process, forked before any thread exists, that outlives the
/// launcher by a moment and removes everything the workers started, however the launcher ends
/// (SIGKILL included, when no code of the launcher runs any more). Workers get
/// PR_SET_PDEATHSIG, but that reaches only the workers themselves: what they started (a shell's
/// `cmd &`, a daemon that called setsid()) would be reparented to init and run on.
///
/// The launcher tells the guardian, through a pipe, each worker's process group, and puts a tag
/// (DDPRUN_JOB_<random>=1, a name of its own so nested launchers' tags add up) into every
/// worker's environment, which the workers' descendants inherit.
/// When the pipe closes (the launcher is gone, for whatever reason) the guardian kills every
/// worker process group, then every process of this user whose environment carries the tag,
/// repeating until none is left (a process may fork while being swept). What escapes: a process
/// that both left its process group (setsid) and cleared its environment (env -i). It uses only
/// async-signal-safe calls, so it works even if the launcher had threads when it forked.
///
/// Used only by the launcher agent (agent.hpp); like it, it includes nothing of ddp but
/// <ddp/ddp.hpp>.

#include <ddp/ddp.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The prefix of the environment entry that marks a launcher's workers and what they start.
inline constexpr std::string_view launch_tag_prefix = "DDPRUN_JOB_";

/// Finds an entry equal to `tag` in a NUL-separated environment block read piece by piece (an
/// environment may be far larger than any buffer): feed() each piece in order.
struct EnvironScan {
  const char* tag;
  std::size_t tag_len;
  std::size_t pos = 0;  // bytes of the current entry that matched the tag
  bool mismatch = false;
  bool found = false;

  void feed(const char* p, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n && !found; ++i) {
      if (p[i] == '\0') {
        found = !mismatch && pos == tag_len;
        pos = 0;
        mismatch = false;
      } else if (!mismatch && pos < tag_len && p[i] == tag[pos]) {
        ++pos;
      } else {
        mismatch = true;
      }
    }
  }
};

/// SIGKILLs every process (other than this one) whose environment holds `tag`; returns how many.
/// Async-signal-safe: no allocation, no stdio.
inline int kill_tagged(const char* tag, std::size_t tag_len) {
  const int proc = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (proc < 0) return 0;
  const pid_t self = ::getpid();
  int killed = 0;
  alignas(8) char dents[8192];
  char env[16384];
  for (;;) {
    const long n = ::syscall(SYS_getdents64, proc, dents, sizeof dents);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      // struct linux_dirent64: u64 ino, s64 off, u16 reclen, u8 type, char name[]
      std::uint16_t reclen = 0;
      std::memcpy(&reclen, dents + off + 16, sizeof reclen);
      const char* name = dents + off + 19;
      off += reclen;
      pid_t pid = 0;
      bool numeric = *name != '\0';
      for (const char* c = name; *c != '\0'; ++c) {
        if (*c < '0' || *c > '9') {
          numeric = false;
          break;
        }
        pid = pid * 10 + (*c - '0');
      }
      if (!numeric || pid == self) continue;
      char path[64] = "/proc/";
      std::size_t len = 6;
      char digits[16];
      int nd = 0;
      for (pid_t p = pid; p > 0; p /= 10) digits[nd++] = static_cast<char>('0' + p % 10);
      while (nd > 0) path[len++] = digits[--nd];
      std::memcpy(path + len, "/environ", 9);
      const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;  // gone, or another user's
      EnvironScan scan{tag, tag_len};
      for (;;) {
        const ssize_t r = ::read(fd, env, sizeof env);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        scan.feed(env, static_cast<std::size_t>(r));
        if (scan.found) break;
      }
      ::close(fd);
      if (scan.found && ::kill(pid, SIGKILL) == 0) ++killed;
    }
  }
  ::close(proc);
  return killed;
}

/// The guardian's life (in the forked child): collect process groups from `pipe_fd` until it
/// closes, then sweep (see the file comment) and exit.
[[noreturn]] inline void guardian_main(int pipe_fd, const char* tag, std::size_t tag_len) {
  (void)::setsid();  // out of the launcher's process group: a signal to that group spares it
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2, SIGTSTP})
    ::sigaction(sig, &ign, nullptr);
  for (int fd = 0; fd < 1024; ++fd) {
    if (fd != pipe_fd) ::close(fd);
  }
  pid_t groups[4096];
  std::size_t n = 0;
  for (;;) {
    pid_t g = 0;
    const ssize_t r = ::read(pipe_fd, &g, sizeof g);
    if (r < 0 && errno == EINTR) continue;
    if (r != static_cast<ssize_t>(sizeof g)) break;  // the launcher is gone
    if (g > 1 && n < sizeof groups / sizeof groups[0]) groups[n++] = g;
  }
  for (std::size_t i = 0; i < n; ++i) ::kill(-groups[i], SIGKILL);
  for (int pass = 0; pass < 50; ++pass) {
    if (kill_tagged(tag, tag_len) == 0) break;
    const timespec pause{0, 20 * 1000 * 1000};
    ::nanosleep(&pause, nullptr);
  }
  ::_exit(0);
}

/// Owns the guardian process (see the file comment). Create it before any thread starts.
class LaunchGuardian {
 public:
  /// Forks the guardian; `tag` is the "DDPRUN_JOB_<random>=1" entry every worker gets.
  explicit LaunchGuardian(std::string tag) : tag_(std::move(tag)) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) fail_errno(errno, "pipe2 (launcher guardian)");
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(p[0]);
      ::close(p[1]);
      fail_errno(errno, "fork (launcher guardian)");
    }
    if (pid == 0) {
      ::close(p[1]);
      guardian_main(p[0], tag_.c_str(), tag_.size());
    }
    ::close(p[0]);
    pid_ = pid;
    write_fd_ = p[1];
  }
  LaunchGuardian(const LaunchGuardian&) = delete;
  LaunchGuardian& operator=(const LaunchGuardian&) = delete;

  /// Closes the pipe: the guardian sweeps, and this waits for it (at most ~2 s), so nothing the
  /// workers started is left when the launcher returns.
  ~LaunchGuardian() {
    ::close(write_fd_);
    for (int i = 0; i < 200; ++i) {
      const pid_t r = ::waitpid(pid_, nullptr, WNOHANG);
      if (r == pid_ || (r < 0 && errno != EINTR)) return;
      const timespec pause{0, 10 * 1000 * 1000};
      ::nanosleep(&pause, nullptr);
    }
  }

  [[nodiscard]] const std::string& tag() const noexcept { return tag_; }
  [[nodiscard]] pid_t pid() const noexcept { return pid_; }

  /// Tells the guardian about a worker's process group.
  void watch(pid_t group) const noexcept {
    ssize_t r;
    do r = ::write(write_fd_, &group, sizeof group);
    while (r < 0 && errno == EINTR);
  }

 private:
  std::string tag_;
  pid_t pid_ = -1;
  int write_fd_ = -1;
};

}  // namespace detail
DDP_END_NAMESPACE
