// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/backend.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string machine_identity() {
  char boot[64] = {};
  std::size_t len = 0;
  if (const int fd = ::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC); fd >= 0) {
    const ssize_t n = ::read(fd, boot, sizeof boot - 1);
    ::close(fd);
    len = n > 0 ? static_cast<std::size_t>(n) : 0;
  } else {
    fail_if_out_of_fds(errno, "cannot read this machine's boot id");
  }
  while (len > 0 && (boot[len - 1] == '\n' || boot[len - 1] == '\r')) --len;
  return std::string(boot, len);
}

DDP_INLINE std::string host_identity() {
  if (const char* forced = std::getenv("DDP_HOST_ID"); forced != nullptr && *forced != '\0') {
    const std::size_t n = std::strlen(forced);
    if (n > 1024)
      fail(Errc::invalid_argument, "DDP_HOST_ID is ", n,
           " characters long; at most 1024 (any string, the same on the ranks of one host)");
    return std::string("DDP_HOST_ID=") + forced;
  }
  char name[256] = {};
  (void)::gethostname(name, sizeof name - 1);
  std::string id = name;
  id += "|";
  id += machine_identity();
  for (const char* ns : {"/proc/self/ns/mnt", "/proc/self/ns/pid", "/proc/self/ns/net"}) {
    char link[128] = {};
    const ssize_t n = ::readlink(ns, link, sizeof link - 1);
    id += '|';
    id.append(link, n > 0 ? static_cast<std::size_t>(n) : 0);
  }
  return id;
}

}  // namespace detail
DDP_END_NAMESPACE
