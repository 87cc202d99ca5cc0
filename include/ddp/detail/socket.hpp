// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// POSIX sockets with deadlines: RAII descriptors, listen/connect/accept, and send/receive of
/// whole buffers that never block past a deadline and survive EINTR.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

DDP_BEGIN_NAMESPACE
namespace detail {

using Clock = std::chrono::steady_clock;

/// A point in time after which a wait gives up.
struct Deadline {
  Clock::time_point at;

  [[nodiscard]] static Deadline after(std::chrono::milliseconds d);
  [[nodiscard]] bool expired() const { return Clock::now() >= at; }
  /// Milliseconds left, clamped to [0, cap], rounded up (for poll()).
  [[nodiscard]] int poll_ms(int cap = 1 << 30) const;
};

/// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept;
  Fd(Fd&& o) noexcept;
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  int release() noexcept;
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

DDP_INLINE void set_nonblocking(int fd, bool on);

/// Raises the soft limit on open descriptors to the hard limit (a server holding one descriptor
/// per client runs out at the common default of 1024 long before memory does). Best effort.
DDP_INLINE void raise_fd_limit() noexcept;

/// Fails with Errc::system when `err` says that descriptors ran out (EMFILE: this process's
/// limit, whose values are named; ENFILE: the system's), saying `doing` and what to do; returns
/// for any other errno. Out of descriptors nothing gets better by retrying until a timeout.
DDP_INLINE void fail_if_out_of_fds(int err, std::string_view doing);

DDP_INLINE void set_nodelay(int fd);

/// "host:port", with IPv6 literals in brackets.
[[nodiscard]] DDP_INLINE std::string host_port(std::string_view host, int port);

/// The numeric address and port of a socket address.
[[nodiscard]] DDP_INLINE std::pair<std::string, int> numeric_name(const sockaddr* sa,
                                                                  socklen_t len);

/// Resolves host:port for TCP; throws Errc::invalid_argument when the name does not resolve.
class AddrInfo {
 public:
  /// `check`: what to check when `host` does not resolve, for the message.
  AddrInfo(const std::string& host, int port, bool passive, std::string_view check = "MASTER_ADDR");
  AddrInfo(const AddrInfo&) = delete;
  AddrInfo& operator=(const AddrInfo&) = delete;
  ~AddrInfo() {
    if (list_ != nullptr) ::freeaddrinfo(list_);
  }
  [[nodiscard]] const addrinfo* begin() const { return list_; }

 private:
  addrinfo* list_ = nullptr;
};

/// A listening TCP socket bound to exactly `host` (all interfaces only when host is "0.0.0.0" or
/// "::", which must be asked for). port 0 picks a free port. EADDRINUSE -> Errc::address_in_use.
[[nodiscard]] DDP_INLINE Fd listen_tcp(const std::string& host, int port, int backlog = 1024);

/// The port a bound socket listens on.
[[nodiscard]] DDP_INLINE int local_port(int fd);

/// The local address of a connected socket (the interface that reaches its peer).
[[nodiscard]] DDP_INLINE std::string local_address(int fd);

/// The peer of a connected socket as "addr:port".
[[nodiscard]] DDP_INLINE std::string peer_name(int fd);

/// Whether a connected TCP socket is connected to itself. Connecting on this host to a port in
/// the kernel's ephemeral range while nothing listens there can be given that very port as the
/// source port; TCP's simultaneous open then connects the socket to itself, and a client would
/// read its own requests back as answers (PyTorch's TCPStore hangs this way, now and then).
[[nodiscard]] DDP_INLINE bool connected_to_itself(int fd);

/// Connects to host:port, retrying refused/unreachable attempts until the deadline (the server
/// may not be up yet; a socket connected to itself counts as refused). Returns a blocking socket
/// with TCP_NODELAY. `check_stop`, when given, runs between attempts and throws to give up (the
/// peer is known to have failed).
/// `failed_errno`, when given, is set to the errno of the last attempt when it fails (ECONNREFUSED:
/// nothing listens there).
[[nodiscard]] DDP_INLINE Fd connect_tcp(const std::string& host, int port, Deadline deadline,
                                        std::string_view what,
                                        const std::function<void()>& check_stop = {},
                                        int* failed_errno = nullptr);

enum class IoResult { ok, closed, timeout };

/// Writes all of [data, data+n) before the deadline. Works on blocking and non-blocking sockets.
[[nodiscard]] DDP_INLINE IoResult send_all(int fd, const void* data, std::size_t n,
                                           Deadline deadline);

/// Reads exactly n bytes before the deadline.
[[nodiscard]] DDP_INLINE IoResult recv_all(int fd, void* data, std::size_t n, Deadline deadline);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/socket.ipp"
#endif
