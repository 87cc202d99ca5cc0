// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// A minimal HTTP/1.1 client for JSON requests to one server (etcd's gateway): POST on a kept
/// connection, the reply's status and body (Content-Length or chunked), every step bounded by a
/// deadline, replies capped in size. Plain HTTP only.

#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"

#include <poll.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

DDP_BEGIN_NAMESPACE
namespace detail {

/// An HTTP reply.
struct HttpReply {
  int status = 0;
  std::string body;
};

/// One server's kept connection (not thread-safe: the caller serializes).
class HttpClient {
 public:
  HttpClient(std::string host, int port);

  [[nodiscard]] const std::string& host() const noexcept { return host_; }
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] int descriptor() const noexcept { return fd_.get(); }

  /// POSTs `body` (JSON) to `path`; the reply, or Errc::peer_lost / Errc::timeout (the
  /// connection then closed) when the server cannot be reached or does not answer by
  /// `deadline`. A kept connection the server closed meanwhile is opened again once.
  HttpReply post(std::string_view path, std::string_view body, Deadline deadline,
                 std::size_t limit = std::size_t{64} << 20);

  /// Whether the last post() failed because nothing accepts connections at the address (the
  /// connection refused) or its name does not resolve: no server there, rather than a slow one.
  [[nodiscard]] bool unreachable() const noexcept { return unreachable_; }

 private:
  /// The number `text` (base 10 or 16, spaces around); Errc::protocol when it is none.
  [[nodiscard]] std::size_t number(std::string_view text, int base) const;

  /// Reads at least one more byte into in_.
  IoResult more(Deadline deadline);

  /// Reads until in_ holds `n` bytes from `at`.
  IoResult need(std::size_t at, std::size_t n, Deadline deadline);

  /// Reads until in_ holds "\r\n" at or after `at`; its position in `end`.
  IoResult line(std::size_t at, std::size_t& end, Deadline deadline, std::size_t limit);

  IoResult read_reply(HttpReply& r, Deadline deadline, std::size_t limit);

  std::string host_;
  int port_;
  Fd fd_;
  std::string in_;
  bool unreachable_ = false;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/http.ipp"
#endif
