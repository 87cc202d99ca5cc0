// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/tcp_client.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <cerrno>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE TcpStoreConnection::TcpStoreConnection(std::string host, int port, StoreOptions o)
    : StoreConnection(std::move(o)), host_(std::move(host)), port_(port) {
  std::lock_guard lock(mutex_);
  connect();
}

DDP_INLINE void TcpStoreConnection::set(const StoreCall& c, const std::string& key,
                                        std::string_view value) {
  std::string req = header(Op::set);
  ByteWriter w(req);
  w.str(key);
  w.str(value);
  (void)call(c, req, options.timeout);
}

DDP_INLINE std::string TcpStoreConnection::get(const StoreCall& c, const std::string& key,
                                               std::chrono::milliseconds timeout,
                                               const std::string& stop) {
  std::string req = header(Op::get);
  ByteWriter w(req);
  w.str(key);
  w.put(static_cast<std::uint64_t>(timeout.count()));
  w.str(stop);
  auto body = call(c, req, timeout, nullptr, stop);
  ByteReader r(body, "store reply");
  return r.str(body.size());
}

DDP_INLINE bool TcpStoreConnection::wait(const StoreCall& c, std::span<const std::string> keys,
                                         std::chrono::milliseconds timeout, const std::string& stop,
                                         bool report_timeout) {
  std::string req = header(Op::wait);
  ByteWriter w(req);
  w.put(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  w.put(static_cast<std::uint64_t>(timeout.count()));
  w.str(stop);
  bool timed_out = false;
  (void)call(c, req, timeout, report_timeout ? &timed_out : nullptr, stop);
  return !timed_out;
}

DDP_INLINE std::int64_t TcpStoreConnection::add(const StoreCall& c, const std::string& key,
                                                std::int64_t delta) {
  std::string req = header(Op::add);
  ByteWriter w(req);
  w.str(key);
  w.put(delta);
  auto body = call(c, req, options.timeout);
  ByteReader r(body, "store reply");
  return r.get<std::int64_t>();
}

DDP_INLINE std::string TcpStoreConnection::compare_set(const StoreCall& c, const std::string& key,
                                                       std::string_view expected,
                                                       std::string_view desired) {
  std::string req = header(Op::compare_set);
  ByteWriter w(req);
  w.str(key);
  w.str(expected);
  w.str(desired);
  auto body = call(c, req, options.timeout);
  ByteReader r(body, "store reply");
  return r.str(body.size());
}

DDP_INLINE bool TcpStoreConnection::erase(const StoreCall& c, const std::string& key) {
  std::string req = header(Op::erase);
  ByteWriter w(req);
  w.str(key);
  auto body = call(c, req, options.timeout);
  ByteReader r(body, "store reply");
  return r.get<std::uint8_t>() != 0;
}

DDP_INLINE bool TcpStoreConnection::check(const StoreCall& c, std::span<const std::string> keys) {
  std::string req = header(Op::check);
  ByteWriter w(req);
  w.put(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  auto body = call(c, req, options.timeout);
  ByteReader r(body, "store reply");
  return r.get<std::uint8_t>() != 0;
}

DDP_INLINE void TcpStoreConnection::set_on_close(
    const StoreCall& c, std::span<const std::pair<std::string, std::string>> keys) {
  std::string req = header(Op::on_close);
  ByteWriter w(req);
  w.put(static_cast<std::uint32_t>(keys.size()));
  for (const auto& [k, v] : keys) {
    w.str(k);
    w.str(v);
  }
  (void)call(c, req, options.timeout);
}

DDP_INLINE void TcpStoreConnection::lease(const StoreCall& c, std::chrono::milliseconds ttl,
                                          std::span<const LeaseRecord> on_expire) {
  std::string req = header(Op::lease);
  ByteWriter w(req);
  w.put(static_cast<std::uint64_t>(std::max<std::int64_t>(0, ttl.count())));
  w.put(static_cast<std::uint32_t>(on_expire.size()));
  for (const LeaseRecord& r : on_expire) {
    w.put(static_cast<std::uint8_t>(r.is_add ? 1 : 0));
    w.str(r.key);
    w.str(r.value);
    w.put(r.add);
  }
  (void)call(c, req, options.timeout);
}

DDP_INLINE bool TcpStoreConnection::lost() {
  std::lock_guard lock(mutex_);
  return !dead_.empty();
}

DDP_INLINE std::string TcpStoreConnection::local_address() {
  std::lock_guard lock(mutex_);
  ensure();
  return detail::local_address(fd_.get());
}

DDP_INLINE void TcpStoreConnection::keepalive() {
  std::lock_guard lock(write_mutex_);
  if (!fd_) return;
  char frame[13] = {9, 0, 0, 0, static_cast<char>(store_proto::Op::keepalive)};
  std::size_t sent = 0;
  while (sent < sizeof frame) {
    const ssize_t n = ::send(fd_.get(), frame + sent, sizeof frame - sent,
                             MSG_NOSIGNAL | (sent == 0 ? MSG_DONTWAIT : 0));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // full (nothing sent), or broken: the next call finds out
    sent += static_cast<std::size_t>(n);
  }
}

DDP_INLINE void TcpStoreConnection::ensure() {
  if (!dead_.empty()) {
    fail(Errc::peer_lost, "the rendezvous store at ", host_port(host_, port_), " is gone (", dead_,
         "); not waiting for it again");
  }
  if (!fd_) connect();
}

DDP_INLINE void TcpStoreConnection::connect() {
  for (int attempt = 1;; ++attempt) {
    try {
      connect_once();
      return;
    } catch (const Error& e) {
      if (e.code() != Errc::peer_lost || attempt >= 8) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10 << std::min(attempt, 6)));
  }
}

DDP_INLINE void TcpStoreConnection::connect_once() {
  std::lock_guard w_lock(write_mutex_);  // the lease's thread may sign on fd_
  namespace sp = store_proto;
  const auto deadline = Deadline::after(options.timeout);
  const std::string where = host_port(host_, port_);
  fd_ = connect_tcp(host_, port_, deadline, "the rendezvous store");
  std::string frame;
  const auto io = [&](IoResult r, std::string_view step) {
    if (r == IoResult::ok) return;
    fd_.reset();
    if (r == IoResult::timeout) {
      fail(Errc::timeout, "rendezvous store at ", where, ": no ", step,
           " before the timeout: the process there accepted the connection but did "
           "not answer (a store whose process is stopped or overloaded, or another "
           "program: check MASTER_ADDR/MASTER_PORT)");
    }
    fail(Errc::peer_lost, "rendezvous store at ", where, " closed the connection during the ", step,
         "; is something else listening on that port?");
  };
  try {
    io(sp::recv_frame(fd_.get(), frame, sp::handshake_frame_limit, deadline, "store hello"),
       "hello");
  } catch (const Error& e) {
    if (e.code() != Errc::protocol) throw;
    fd_.reset();
    fail(Errc::protocol, "rendezvous store at ", where, " is not a ddp store (", e.what(),
         "); check MASTER_ADDR/MASTER_PORT: another program listens there");
  }
  ByteReader r(frame, "store hello");
  if (r.get<std::uint32_t>() != sp::magic) {
    fd_.reset();
    fail(Errc::protocol, where, " is not a ddp rendezvous store (bad magic)");
  }
  const auto v = r.get<std::uint16_t>();
  const bool auth_required = r.get<std::uint8_t>() != 0;
  sp::Nonce server_nonce{};
  r.raw(server_nonce.data(), server_nonce.size());
  if (v != sp::version) {
    fd_.reset();
    fail(Errc::protocol, "rendezvous store at ", where, " speaks protocol ", v, ", this client ",
         sp::version);
  }
  if (!options.token.empty() && !auth_required) {
    fd_.reset();
    fail(Errc::unauthorized, "rendezvous store at ", where,
         " does not require a token but this process has one (DDP_TOKEN): refusing to talk "
         "to a store that cannot prove it knows the token");
  }
  sp::Nonce client_nonce{};
  random_bytes(client_nonce.data(), client_nonce.size());
  const auto mac = options.token.empty()
                       ? Digest{}
                       : hmac_sha256(options.token, sp::client_label, sp::as_view(server_nonce),
                                     sp::as_view(client_nonce));
  std::string auth;
  ByteWriter w(auth);
  w.put(sp::magic);
  w.put(sp::version);
  w.raw(client_nonce.data(), client_nonce.size());
  w.raw(mac.data(), mac.size());
  w.put(static_cast<std::int32_t>(options.refusal_rank));
  w.str(std::string_view(options.refusal_key).substr(0, sp::refusal_key_limit));
  io(sp::send_frame(fd_.get(), auth, deadline), "handshake");
  io(sp::recv_frame(fd_.get(), frame, sp::handshake_frame_limit, deadline, "store handshake reply"),
     "handshake reply");
  ByteReader rr(frame, "store handshake reply");
  const auto status = rr.get<sp::HandshakeStatus>();
  if (status == sp::HandshakeStatus::unauthorized) {
    fd_.reset();
    fail(Errc::unauthorized, "rendezvous store at ", where, " refused this process: ",
         options.token.empty() ? "it requires a token; set DDP_TOKEN to the job's secret"
                               : "wrong token; every rank must have the same DDP_TOKEN");
  }
  if (status != sp::HandshakeStatus::ok) {
    fd_.reset();
    fail(Errc::protocol, "rendezvous store at ", where, " refused the handshake (version)");
  }
  Digest proof{};
  rr.raw(proof.data(), proof.size());
  if (!options.token.empty()) {
    const auto expected = hmac_sha256(options.token, sp::server_label, sp::as_view(client_nonce),
                                      sp::as_view(server_nonce));
    if (!constant_time_equal(expected, proof)) {
      fd_.reset();
      fail(Errc::unauthorized, "rendezvous store at ", where,
           " could not prove it knows DDP_TOKEN: refusing to use it");
    }
  }
}

DDP_INLINE std::string TcpStoreConnection::header(Op op) {
  std::string req;
  ByteWriter w(req);
  w.put(op);
  w.put(std::uint64_t{0});  // request id, filled in by call()
  return req;
}

DDP_INLINE std::string TcpStoreConnection::call(const StoreCall& c, std::string& req,
                                                std::chrono::milliseconds timeout, bool* timed_out,
                                                std::string_view stop) {
  namespace sp = store_proto;
  auto lock = lock_for(c);
  ensure();
  const std::uint64_t id = next_request_++;
  for (std::size_t i = 0; i < 8; ++i) req[1 + i] = static_cast<char>((id >> (8 * i)) & 0xffu);
  // The server answers waits itself at their deadline; allow it some slack before giving up on
  // the connection (within a view's deadline, half a second: a rendezvous has one timeout).
  auto deadline = Deadline::after(timeout + std::chrono::seconds(5));
  if (c.deadline != Clock::time_point::max())
    deadline.at = std::min(deadline.at, c.deadline + std::chrono::milliseconds(500));
  const std::string where = host_port(host_, port_);
  const auto lost = [&](IoResult r) {
    {
      std::lock_guard w(write_mutex_);
      fd_.reset();
    }
    if (r == IoResult::timeout) {
      dead_ = "it did not answer a call before the timeout";
      fail(Errc::timeout, "store ", c.what, "(\"", c.prefix, c.key, "\"): the store at ", where,
           " did not answer before the timeout");
    }
    dead_ = "it closed the connection";
    fail(Errc::peer_lost, "store ", c.what, "(\"", c.prefix, c.key, "\"): the store at ", where,
         " closed the connection (did rank 0 or the launcher exit?)");
  };
  IoResult sent;
  {
    std::lock_guard w(write_mutex_);
    sent = sp::send_frame(fd_.get(), req, deadline);
  }
  if (sent != IoResult::ok) lost(sent);
  std::string frame;
  for (;;) {
    if (auto r =
            sp::recv_frame(fd_.get(), frame, sp::frame_limit(options), deadline, "store reply");
        r != IoResult::ok) {
      lost(r);
    }
    ByteReader r(frame, "store reply");
    const auto status = r.get<Status>();
    const auto reply_id = r.get<std::uint64_t>();
    if (reply_id != id) continue;  // a reply to a request abandoned earlier
    std::string body(r.view(r.left()));
    if (status == Status::ok) return body;
    if (status == Status::stopped) {
      ByteReader br(body, "store stop reply");
      fail_stopped(c, stop, br.str(body.size()));
    }
    if (status == Status::timeout && timed_out != nullptr) {
      *timed_out = true;
      return {};
    }
    if (status == Status::timeout) {
      ByteReader br(body, "store timeout reply");
      const auto n = br.get<std::uint32_t>();
      std::vector<std::string> missing;
      for (std::uint32_t i = 0; i < n && i < 17; ++i) missing.push_back(br.str(body.size()));
      if (n > missing.size()) missing.resize(n);  // the count, for "and N more"
      fail_missing(c, timeout, missing);
    }
    ByteReader br(body, "store error reply");
    fail(Errc::protocol, "store ", c.what, "(\"", c.prefix, c.key,
         "\") failed: ", br.view(br.left()));
  }
}

}  // namespace detail
DDP_END_NAMESPACE
