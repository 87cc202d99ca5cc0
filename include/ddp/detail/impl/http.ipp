// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/http.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE HttpClient::HttpClient(std::string host, int port)
    : host_(std::move(host)), port_(port) {}

DDP_INLINE HttpReply HttpClient::post(std::string_view path, std::string_view body,
                                      Deadline deadline, std::size_t limit) {
  const std::string request = concat(
      "POST ", path, " HTTP/1.1\r\nHost: ", host_port(host_, port_),
      "\r\nContent-Type: application/json\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  for (int attempt = 0;; ++attempt) {
    const bool reused = static_cast<bool>(fd_);
    unreachable_ = false;
    if (!fd_) {  // a member that refuses is tried again later, after the others
      Deadline connect = Deadline::after(std::chrono::milliseconds(300));
      connect.at = std::min(connect.at, deadline.at);
      int failed = 0;
      try {
        fd_ = connect_tcp(host_, port_, connect, "the etcd server", {}, &failed);
      } catch (const Error& e) {  // refused, or a name that does not resolve (invalid_argument)
        unreachable_ = failed == ECONNREFUSED || e.code() == Errc::invalid_argument;
        throw;
      }
    }
    in_.clear();
    if (send_all(fd_.get(), request.data(), request.size(), deadline) == IoResult::ok) {
      HttpReply r;
      const IoResult got = read_reply(r, deadline, limit);
      if (got == IoResult::ok) return r;
      fd_.reset();
      if (got == IoResult::timeout)
        fail(Errc::timeout, "the etcd server at ", host_port(host_, port_),
             " did not answer before the timeout");
      if (reused && attempt == 0 && in_.empty()) continue;  // closed while idle: once more
    } else {
      fd_.reset();
      if (reused && attempt == 0) continue;
    }
    fail(Errc::peer_lost, "the etcd server at ", host_port(host_, port_), " closed the connection");
  }
}

DDP_INLINE std::size_t HttpClient::number(std::string_view text, int base) const {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\r')) text.remove_suffix(1);
  std::size_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v, base);
  if (ec != std::errc{} || text.empty() || (end != text.data() + text.size() && *end != ';'))
    fail(Errc::protocol, "the etcd server at ", host_port(host_, port_), " sent a bad length \"",
         text.substr(0, 40), "\"");
  return v;
}

DDP_INLINE IoResult HttpClient::more(Deadline deadline) {
  char buf[16384];
  for (;;) {
    const ssize_t n = ::recv(fd_.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
      in_.append(buf, static_cast<std::size_t>(n));
      return IoResult::ok;
    }
    if (n == 0) return IoResult::closed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return IoResult::closed;
    pollfd p{fd_.get(), POLLIN, 0};
    const int rc = ::poll(&p, 1, deadline.poll_ms(1000));
    if (rc == 0 && deadline.expired()) return IoResult::timeout;
  }
}

DDP_INLINE IoResult HttpClient::need(std::size_t at, std::size_t n, Deadline deadline) {
  while (in_.size() < at + n)
    if (const IoResult r = more(deadline); r != IoResult::ok) return r;
  return IoResult::ok;
}

DDP_INLINE IoResult HttpClient::line(std::size_t at, std::size_t& end, Deadline deadline,
                                     std::size_t limit) {
  for (;;) {
    end = in_.find("\r\n", at);
    if (end != std::string::npos) return IoResult::ok;
    if (in_.size() > at + limit)
      fail(Errc::protocol, "the etcd server at ", host_port(host_, port_),
           " sent a line longer than ", limit, " bytes");
    if (const IoResult r = more(deadline); r != IoResult::ok) return r;
  }
}

DDP_INLINE IoResult HttpClient::read_reply(HttpReply& r, Deadline deadline, std::size_t limit) {
  std::size_t end = 0;
  if (const IoResult x = line(0, end, deadline, 8192); x != IoResult::ok) return x;
  const std::string_view status(in_.data(), end);
  if (!status.starts_with("HTTP/1.") || status.size() < 12 || status[9] < '1' || status[9] > '5' ||
      status[10] < '0' || status[10] > '9' || status[11] < '0' || status[11] > '9') {
    std::string shown;
    for (const char c : status.substr(0, 80)) shown += c >= 32 && c < 127 ? c : '?';
    fail(Errc::protocol, host_port(host_, port_), " is not an HTTP server (it answered \"", shown,
         "\"): is it etcd's client URL?");
  }
  r.status = (status[9] - '0') * 100 + (status[10] - '0') * 10 + (status[11] - '0');
  std::size_t length = std::string::npos;
  bool chunked = false, close_after = false;
  std::size_t at = end + 2;
  for (;;) {  // the headers
    if (const IoResult x = line(at, end, deadline, 8192); x != IoResult::ok) return x;
    if (end == at) break;
    std::string h(in_.data() + at, end - at);
    for (char& c : h) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    if (h.starts_with("content-length:")) length = number(h.substr(15), 10);
    if (h.starts_with("transfer-encoding:") && h.find("chunked") != std::string::npos)
      chunked = true;
    if (h.starts_with("connection:") && h.find("close") != std::string::npos) close_after = true;
    at = end + 2;
  }
  at = end + 2;
  if (!chunked) {
    if (length == std::string::npos || length > limit)
      fail(Errc::protocol, "the etcd server at ", host_port(host_, port_),
           " sent a reply without a usable length");
    if (const IoResult x = need(at, length, deadline); x != IoResult::ok) return x;
    r.body.assign(in_, at, length);
  } else {
    for (;;) {
      if (const IoResult x = line(at, end, deadline, 64); x != IoResult::ok) return x;
      const std::size_t n = number(in_.substr(at, end - at), 16);
      at = end + 2;
      if (r.body.size() + n > limit)
        fail(Errc::protocol, "the etcd server at ", host_port(host_, port_), " sent a reply over ",
             limit, " bytes");
      if (const IoResult x = need(at, n + 2, deadline); x != IoResult::ok) return x;
      r.body.append(in_, at, n);
      at += n + 2;
      if (n == 0) break;
    }
  }
  if (close_after) fd_.reset();
  return IoResult::ok;
}

}  // namespace detail
DDP_END_NAMESPACE
