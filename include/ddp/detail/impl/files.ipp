// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/files.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cstdio>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string parent_dir(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

DDP_INLINE std::string base_name(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

DDP_INLINE const char* file_kind(mode_t m) noexcept {
  if (S_ISREG(m)) return nullptr;
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  return "not a regular file";
}

DDP_INLINE const char* non_regular(const std::string& path) noexcept {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    return nullptr;  // nothing there (or unreachable: the
                     // open or rename that follows says why)
  return file_kind(st.st_mode);
}

DDP_INLINE int sync_dir(const std::string& dir) noexcept {
  const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
  if (d < 0) return 0;  // e.g. no read permission on the directory: nothing to flush through
  const int rc = ::fsync(d);
  const int err = rc == 0 ? 0 : errno;
  ::close(d);
  return err == EINVAL || err == EROFS || err == EBADF ? 0 : err;
}

DDP_INLINE std::vector<std::string> suffixes(const std::string& stem) {
  const std::string dir = parent_dir(stem);
  const std::string prefix = base_name(stem) + ".";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr)
    fail(Errc::system, "cannot read the directory ", dir, ": ", std::strerror(errno));
  std::vector<std::string> out;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) continue;
    struct stat st {};
    const std::string full = concat(dir, "/", name);
    if (::lstat(full.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    out.emplace_back(name.substr(prefix.size()));
  }
  ::closedir(d);
  return out;
}

DDP_INLINE bool process_gone(long pid) noexcept {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* paren =
      std::strrchr(buf, ')');  // "<pid> (<name>) <state> ...": the name may hold ')'
  return paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

DDP_INLINE void remove_abandoned(const std::string& family) noexcept {
  const std::string dir = parent_dir(family);
  const std::string prefix = base_name(family) + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  const int dfd = ::dirfd(d);
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) continue;
    std::string_view rest = name.substr(prefix.size());
    const std::size_t dot = rest.find('.');
    const std::string_view pid_text = rest.substr(0, dot);
    if (pid_text.empty() || pid_text.size() > 9 ||
        pid_text.find_first_not_of("0123456789") != std::string_view::npos)
      continue;
    long pid = 0;
    for (const char c : pid_text) pid = pid * 10 + (c - '0');
    if (pid <= 0 || !process_gone(pid)) continue;  // its process still runs: not abandoned
    const int fd = ::openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    const bool ours = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid();
    if (ours && ::flock(fd, LOCK_EX | LOCK_NB) == 0) (void)::unlinkat(dfd, e->d_name, 0);
    ::close(fd);
  }
  ::closedir(d);
}

DDP_INLINE StagedFile::StagedFile(const std::string& family, std::string what)
    : what_(std::move(what)) {
  for (int attempt = 0;; ++attempt) {
    const auto r = random_value<std::uint64_t>();
    char hex[17];
    for (int i = 0; i < 16; ++i) hex[i] = "0123456789abcdef"[(r >> (4 * i)) & 15];
    hex[16] = '\0';
    name_ = concat(family, ".tmp.", ::getpid(), ".", hex);
    fd_ = ::open(name_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ >= 0) break;
    if (errno != EEXIST || attempt == 16) {
      const int err = errno;
      name_.clear();
      errno = err;
      io_fail("cannot create a file next to ", family);
    }
  }
  (void)::flock(fd_, LOCK_EX | LOCK_NB);  // new and exclusive: nobody else holds it
}

DDP_INLINE StagedFile::StagedFile(StagedFile&& o) noexcept
    : what_(std::move(o.what_)), name_(std::exchange(o.name_, {})), fd_(std::exchange(o.fd_, -1)) {}

DDP_INLINE void StagedFile::write(std::string_view bytes) {
  const char* p = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      failed(n < 0 ? errno : ENOSPC, "cannot write ", bytes.size(), " bytes to ", name_);
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
  if (::fsync(fd_) != 0) failed(errno, "cannot flush ", name_, " to disk");
}

DDP_INLINE void StagedFile::commit(const std::string& to) {
  if (const char* kind = non_regular(to)) {
    discard();
    fail(Errc::invalid_argument, what_, ": ", to, " is ", kind,
         ", not a regular file: refusing to replace it; remove it, or choose another path");
  }
  // close() reports what the file system could not write back (NFS does so there).
  if (::close(std::exchange(fd_, -1)) != 0 && errno != EINTR)
    failed(errno, "cannot write ", name_, " (close)");
  if (::rename(name_.c_str(), to.c_str()) != 0) failed(errno, "cannot rename ", name_, " to ", to);
  name_.clear();
  if (const int err = sync_dir(parent_dir(to)); err != 0) {
    errno = err;
    io_fail("cannot flush the directory of ", to, " to disk");
  }
}

DDP_INLINE std::string StagedFile::release() noexcept {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  return std::exchange(name_, {});
}

DDP_INLINE void StagedFile::discard() noexcept {
  if (!name_.empty()) ::unlink(name_.c_str());
  name_.clear();
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
}

}  // namespace detail
DDP_END_NAMESPACE
