// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/server.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_map>

DDP_BEGIN_NAMESPACE

DDP_INLINE StoreServer::StoreServer(const std::string& host, int port, StoreOptions options)
    : StoreServer(detail::listen_tcp(host, port), host, std::move(options)) {}

DDP_INLINE StoreServer::StoreServer(detail::Fd listener, const std::string& host,
                                    StoreOptions options)
    : engine_(prepared(std::move(options))), host_(host), listener_(std::move(listener)) {
  reserve_fd_ = detail::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  port_ = detail::local_port(listener_.get());
  detail::set_nonblocking(listener_.get(), true);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) detail::fail_errno(errno, "pipe2");
  wake_read_.reset(pipe_fds[0]);
  wake_write_.reset(pipe_fds[1]);
  thread_ = std::thread([this] { run(); });
}

DDP_INLINE void StoreServer::stop() {
  if (stopping_.exchange(true)) return;
  const char c = 'x';
  (void)!::write(wake_write_.get(), &c, 1);
  if (thread_.joinable()) thread_.join();
}

DDP_INLINE StoreOptions StoreServer::prepared(StoreOptions o) {
  detail::raise_fd_limit();
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    const auto n = static_cast<std::size_t>(lim.rlim_cur);
    o.max_pending_handshakes = std::clamp<std::size_t>(n / 8, 1, o.max_pending_handshakes);
    o.max_connections = std::clamp<std::size_t>(n * 3 / 4, 2, o.max_connections);
  }
  if (!o.log) {
    o.log = [](std::string_view m) {
      std::fprintf(stderr, "[ddp store] %.*s\n", static_cast<int>(m.size()), m.data());
    };
  }
  return o;
}

DDP_INLINE void StoreServer::run() {
  std::vector<pollfd> fds;
  std::vector<std::uint64_t> ids;
  while (!stopping_.load()) {
    fds.clear();
    ids.clear();
    fds.push_back({wake_read_.get(), POLLIN, 0});
    // Out of file descriptors: the listener stays readable, so it is left out of the poll for
    // a moment instead of being polled in a busy loop.
    const bool accepting = Clock::now() >= accept_pause_until_;
    fds.push_back({listener_.get(), accepting ? short{POLLIN} : short{0}, 0});
    for (auto& [id, s] : engine_.sessions()) {
      // A refused client is not read any more (its reply is sent, then it is closed), nor is
      // one whose replies pile up unread.
      short ev = detail::StoreEngine::readable(s) ? short{POLLIN} : short{0};
      if (s.out_sent < s.out.size()) ev = static_cast<short>(ev | POLLOUT);
      fds.push_back({fds_.at(id).get(), ev, 0});
      ids.push_back(id);
    }
    auto next = engine_.next_deadline(Clock::now() + std::chrono::seconds(1));
    if (!accepting) next = std::min(next, accept_pause_until_);
    const int rc = ::poll(fds.data(), fds.size(), detail::Deadline{next}.poll_ms(1000));
    if (rc < 0 && errno != EINTR) {
      engine_.options().log(
          detail::concat("poll failed: ", std::strerror(errno), "; the store stops serving"));
      break;
    }
    if (rc > 0) {
      if ((fds[1].revents & POLLIN) != 0) accept_all();
      for (std::size_t i = 2; i < fds.size(); ++i) {
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0) on_readable(ids[i - 2]);
      }
    }
    engine_.expire(Clock::now());
    flush_all();
    engine_.reap();
    std::erase_if(fds_, [&](const auto& kv) { return engine_.session(kv.first) == nullptr; });
  }
  // Stopped: close every connection now, so clients learn at once instead of at their timeout.
  engine_.close_all();
  engine_.reap();
  fds_.clear();
  listener_.reset();
}

DDP_INLINE void StoreServer::accept_all() {
  for (;;) {
    detail::Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        out_of_descriptors(errno);
      }
      return;  // EAGAIN: try again on the next poll
    }
    const auto id = engine_.open(detail::peer_name(fd.get()), Clock::now());
    if (id == 0) continue;  // refused: the socket closes here
    detail::set_nodelay(fd.get());
    fds_.emplace(id, std::move(fd));
  }
}

DDP_INLINE void StoreServer::out_of_descriptors(int err) {
  engine_.note_refusal(detail::concat("out of file descriptors (", std::strerror(err),
                                      "): a connection was closed unserved; raise ulimit -n"));
  if (reserve_fd_) {
    reserve_fd_.reset();
    detail::Fd drop(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    drop.reset();
    reserve_fd_ = detail::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  }
  accept_pause_until_ = Clock::now() + std::chrono::milliseconds(100);
}

DDP_INLINE void StoreServer::on_readable(std::uint64_t id) {
  char buf[64 * 1024];
  // A bounded number of reads per wake-up, so one busy connection cannot starve the others.
  for (int rounds = 0; rounds < 64; ++rounds) {
    Session* s = engine_.session(id);
    if (s == nullptr) return;
    // Refused or backlogged: flush_all sends (or finds the peer gone) before reading resumes.
    if (!detail::StoreEngine::readable(*s)) return;
    const std::size_t want = std::min(sizeof buf, detail::StoreEngine::wanted(*s));
    const ssize_t n = ::recv(fds_.at(id).get(), buf, want, MSG_DONTWAIT);
    if (n == 0) return engine_.peer_closed(id);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) engine_.peer_closed(id);
      return;
    }
    engine_.receive(id, {buf, static_cast<std::size_t>(n)}, Clock::now());
  }
}

DDP_INLINE void StoreServer::flush_all() {
  for (auto& [id, s] : engine_.sessions()) {
    const int fd = fds_.at(id).get();
    while (!s.closed && s.out_sent < s.out.size()) {
      const ssize_t n = ::send(fd, s.out.data() + s.out_sent, s.out.size() - s.out_sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        s.out_sent += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        engine_.peer_closed(id);
      }
    }
    if (s.out_sent == s.out.size()) {
      detail::StoreEngine::release(s.out);
      s.out_sent = 0;
      if (s.close_after_write) s.closed = true;
    }
  }
}

DDP_END_NAMESPACE
