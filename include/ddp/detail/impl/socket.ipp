// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/socket.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE Deadline Deadline::after(std::chrono::milliseconds d) {
  // Saturate: "5 years" must not overflow the clock.
  const auto now = Clock::now();
  const auto max_wait = Clock::time_point::max() - now;
  if (d >= std::chrono::duration_cast<std::chrono::milliseconds>(max_wait)) {
    return {Clock::time_point::max()};
  }
  return {now + d};
}

DDP_INLINE int Deadline::poll_ms(int cap) const {
  const auto left = at - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<long long>(ms, cap));
}

DDP_INLINE Fd::Fd(int fd) noexcept : fd_(fd) {}

DDP_INLINE Fd::Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}

DDP_INLINE Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(std::exchange(o.fd_, -1));
  return *this;
}

DDP_INLINE int Fd::release() noexcept { return std::exchange(fd_, -1); }

DDP_INLINE void Fd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

DDP_INLINE void set_nonblocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0) fail_errno(errno, "fcntl(F_GETFL)");
  if (::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK)) < 0) {
    fail_errno(errno, "fcntl(F_SETFL)");
  }
}

DDP_INLINE void raise_fd_limit() noexcept {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= lim.rlim_max) return;
  lim.rlim_cur = lim.rlim_max;
  (void)::setrlimit(RLIMIT_NOFILE, &lim);
}

DDP_INLINE void fail_if_out_of_fds(int err, std::string_view doing) {
  if (err != EMFILE && err != ENFILE) return;
  if (err == ENFILE)
    fail(Errc::system, doing,
         ": the system is out of file descriptors (ENFILE: the kernel's fs.file-max is reached); "
         "close programs or raise fs.file-max");
  rlimit lim{};
  (void)::getrlimit(RLIMIT_NOFILE, &lim);
  const auto limit_text = [](rlim_t v) {
    return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v);
  };
  fail(Errc::system, doing, ": out of file descriptors (EMFILE: this process has ",
       limit_text(lim.rlim_cur), " open, its limit; hard limit ", limit_text(lim.rlim_max),
       "); raise the limit (ulimit -n, or LimitNOFILE in a service) or open fewer files");
}

DDP_INLINE void set_nodelay(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

DDP_INLINE std::string host_port(std::string_view host, int port) {
  if (host.find(':') != std::string_view::npos) return concat('[', host, "]:", port);
  return concat(host, ':', port);
}

DDP_INLINE std::pair<std::string, int> numeric_name(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {};
  char serv[NI_MAXSERV] = {};
  if (::getnameinfo(sa, len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return {"?", 0};
  }
  return {host, std::atoi(serv)};
}

DDP_INLINE AddrInfo::AddrInfo(const std::string& host, int port, bool passive,
                              std::string_view check) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_ADDRCONFIG | (passive ? AI_PASSIVE : 0);
  if (host.empty()) hints.ai_flags |= AI_PASSIVE;
  const std::string service = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list_);
  if (rc != 0) {
    fail(Errc::invalid_argument, "cannot resolve \"", host, "\": ", ::gai_strerror(rc), "; check ",
         check);
  }
}

DDP_INLINE Fd listen_tcp(const std::string& host, int port, int backlog) {
  const AddrInfo ai(host, port, /*passive=*/true);
  int last_errno = 0;
  for (const addrinfo* a = ai.begin(); a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!fd) {
      last_errno = errno;
      fail_if_out_of_fds(last_errno, concat("cannot listen on ", host_port(host, port)));
      continue;
    }
    int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      last_errno = errno;
      if (last_errno == EADDRINUSE) {
        fail(Errc::address_in_use, "address ", host_port(host, port),
             " is in use: another job (or a previous run that has not exited) holds it; choose "
             "another MASTER_PORT or use ddprun --standalone");
      }
      continue;
    }
    if (::listen(fd.get(), backlog) != 0) {
      last_errno = errno;
      continue;
    }
    return fd;
  }
  fail_errno(last_errno, "cannot listen on ", host_port(host, port));
}

DDP_INLINE int local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0)
    fail_errno(errno, "getsockname");
  return numeric_name(reinterpret_cast<sockaddr*>(&ss), len).second;
}

DDP_INLINE std::string local_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0)
    fail_errno(errno, "getsockname");
  return numeric_name(reinterpret_cast<sockaddr*>(&ss), len).first;
}

DDP_INLINE std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  auto [h, p] = numeric_name(reinterpret_cast<sockaddr*>(&ss), len);
  return host_port(h, p);
}

DDP_INLINE bool connected_to_itself(int fd) {
  sockaddr_storage local{}, peer{};
  socklen_t local_len = sizeof local, peer_len = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0)
    return false;
  return local_len == peer_len && std::memcmp(&local, &peer, local_len) == 0;
}

DDP_INLINE Fd connect_tcp(const std::string& host, int port, Deadline deadline,
                          std::string_view what, const std::function<void()>& check_stop,
                          int* failed_errno) {
  int last_errno = 0;
  auto backoff = std::chrono::milliseconds(5);
  for (;;) {
    const AddrInfo ai(host, port, /*passive=*/false,
                      what.find("etcd") != std::string_view::npos
                          ? "DDP_STORE (or ddprun's --rdzv-endpoint)"
                          : "MASTER_ADDR");
    for (const addrinfo* a = ai.begin(); a != nullptr; a = a->ai_next) {
      Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd) {
        last_errno = errno;
        fail_if_out_of_fds(last_errno,
                           concat("cannot connect to ", what, " at ", host_port(host, port)));
        continue;
      }
      set_nonblocking(fd.get(), true);
      int rc = ::connect(fd.get(), a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{fd.get(), POLLOUT, 0};
        do {
          rc = ::poll(&p, 1, deadline.poll_ms(1000));
        } while ((rc < 0 && errno == EINTR) || (rc == 0 && !deadline.expired()));
        if (rc == 1) {
          int err = 0;
          socklen_t len = sizeof err;
          (void)::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          rc = err == 0 ? 0 : -1;
          errno = err;
        } else {
          rc = -1;
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0 && connected_to_itself(fd.get())) {
        rc = -1;
        errno = ECONNREFUSED;
      }
      if (rc == 0) {
        set_nonblocking(fd.get(), false);
        set_nodelay(fd.get());
        return fd;
      }
      last_errno = errno;
    }
    if (deadline.expired()) {
      if (failed_errno != nullptr) *failed_errno = last_errno;
      fail(Errc::timeout, "cannot connect to ", what, " at ", host_port(host, port), ": ",
           std::strerror(last_errno), " until the timeout; check that it is running and that ",
           what.find("etcd") != std::string_view::npos
               ? "DDP_STORE (or ddprun's --rdzv-endpoint) names its client URLs"
               : "MASTER_ADDR/MASTER_PORT are right");
    }
    if (check_stop) check_stop();
    std::this_thread::sleep_for(std::min(backoff, std::chrono::milliseconds(deadline.poll_ms())));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

DDP_INLINE IoResult send_all(int fd, const void* data, std::size_t n, Deadline deadline) {
  const auto* p = static_cast<const std::byte*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<std::size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      const int rc = ::poll(&pfd, 1, deadline.poll_ms(1000));
      if (rc == 0 && deadline.expired()) return IoResult::timeout;
      if (rc > 0 && (pfd.revents & (POLLERR | POLLHUP)) != 0 && (pfd.revents & POLLOUT) == 0) {
        return IoResult::closed;
      }
      continue;
    }
    return IoResult::closed;  // EPIPE, ECONNRESET, ...
  }
  return IoResult::ok;
}

DDP_INLINE IoResult recv_all(int fd, void* data, std::size_t n, Deadline deadline) {
  auto* p = static_cast<std::byte*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) return IoResult::closed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd pfd{fd, POLLIN, 0};
      const int rc = ::poll(&pfd, 1, deadline.poll_ms(1000));
      if (rc == 0 && deadline.expired()) return IoResult::timeout;
      continue;
    }
    return IoResult::closed;
  }
  return IoResult::ok;
}

}  // namespace detail
DDP_END_NAMESPACE
