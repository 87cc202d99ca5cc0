// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// StoreServer: the rendezvous store's server, one thread that serves detail::StoreEngine
/// (store/engine.hpp) over TCP with poll(). See ddp/store.hpp for what makes the store safe to
/// expose.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/store/engine.hpp"
#include "ddp/store/protocol.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// The store server. Runs one thread that serves every client with poll(); stops and joins in
/// its destructor. The protocol lives in detail::StoreEngine; this class only moves bytes.
class StoreServer {
 public:
  /// Listens on host:port (port 0 picks a free one, see port()). Throws Errc::address_in_use
  /// when the port is taken.
  StoreServer(const std::string& host, int port, StoreOptions options = {});

  /// Serves on a socket that is already listening (a launcher binds it before it forks, so the
  /// port is known and no thread exists at fork time).
  StoreServer(detail::Fd listener, const std::string& host, StoreOptions options = {});

  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  ~StoreServer() { stop(); }

  /// The port the server listens on (the one picked when 0 was asked for).
  [[nodiscard]] int port() const noexcept { return port_; }
  /// The host the server was given to listen on.
  [[nodiscard]] const std::string& host() const noexcept { return host_; }

  /// Stops serving (idempotent). Connected clients see the connection close.
  void stop();

  /// Connections refused so far (bad handshake, wrong token, oversized frames, stray traffic).
  [[nodiscard]] std::uint64_t refused() const noexcept { return engine_.refused(); }

 private:
  using Clock = detail::Clock;
  using Session = detail::StoreEngine::Session;

  /// The options as served: the log defaults to stderr, and the connection budgets fit the
  /// process's descriptor limit (raised to its hard limit first). The server shares that limit
  /// with the rank that hosts it, which needs descriptors of its own (its sockets to the other
  /// ranks, shared memory): connections that have not authenticated get at most an eighth of it,
  /// all connections at most three quarters, so strangers can never starve the rank.
  static StoreOptions prepared(StoreOptions o);

  void run();

  void accept_all();

  /// accept() failed for lack of descriptors: the reserve descriptor is given up for a moment to
  /// accept and close one waiting connection (its client learns at once instead of hanging), the
  /// listener is left alone for 100 ms, and the condition is logged (rate-limited).
  void out_of_descriptors(int err);

  void on_readable(std::uint64_t id);

  /// Sends what the engine queued, as far as the sockets take it; closes what should be closed.
  void flush_all();

  detail::StoreEngine engine_;
  std::string host_;
  detail::Fd listener_;
  detail::Fd wake_read_, wake_write_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::map<std::uint64_t, detail::Fd> fds_;
  detail::Fd reserve_fd_;  // given up to accept-and-close when descriptors run out
  Clock::time_point accept_pause_until_{};
  std::thread thread_;
};

#if DDP_BODIES
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
#endif  // DDP_BODIES

DDP_END_NAMESPACE
