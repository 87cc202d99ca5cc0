// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/tcp.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <atomic>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE TcpTransport::TcpTransport(int rank, int size, std::chrono::milliseconds timeout,
                                      std::vector<Fd> peers, std::size_t segment_bytes,
                                      int local_ranks)
    : Transport(rank, size, timeout),
      oversubscribed_(local_ranks > usable_cpus()),
      segment_(segment_bytes),
      peers_(std::move(peers)),
      ptrs_(static_cast<std::size_t>(size)),
      xfers_(static_cast<std::size_t>(size)),
      headers_in_(static_cast<std::size_t>(size)) {
  for (auto& fd : peers_) {
    if (fd) set_nonblocking(fd.get(), true);
  }
}

DDP_INLINE std::vector<Fd> TcpTransport::connect_mesh(
    int rank, int size, Fd& listener, const std::vector<std::pair<std::string, int>>& addrs,
    const SessionKey& key, Deadline deadline, const std::function<void()>& check_stop,
    std::chrono::milliseconds reach_window) {
  std::vector<Fd> peers(static_cast<std::size_t>(size));
  if (reach_window.count() > 0) {
    const Deadline window{std::min(deadline.at, Clock::now() + reach_window)};
    peers = connect_below(rank, addrs, key, window);
    peers.resize(static_cast<std::size_t>(size));
    std::vector<int> cut;
    for (int j = 0; j < rank; ++j)
      if (!peers[static_cast<std::size_t>(j)]) cut.push_back(j);
    if (!cut.empty())
      DDP_THROW(Error(
          Errc::peer_lost, {}, -1,
          concat("rank ", rank, ": could not connect to ", cut.size() == 1 ? "rank " : "ranks ",
                 ranks_text(cut), " within ", reach_window.count(),
                 " ms (tcp transport): the links between them are down or cut, "
                 "though this rank reaches the store"),
          cut));
  }
  for (int j = reach_window.count() > 0 ? rank : 0; j < rank; ++j) {  // one at a time
    const auto& [host, port] = addrs[static_cast<std::size_t>(j)];
    Fd fd = connect_tcp(host, port, deadline, concat("rank ", j), check_stop);
    std::string hello;
    ByteWriter w(hello);
    w.put(hello_magic);
    w.raw(key.data(), key.size());
    w.put(static_cast<std::uint32_t>(rank));
    if (send_all(fd.get(), hello.data(), hello.size(), deadline) != IoResult::ok) {
      fail(Errc::peer_lost, "rank ", rank, ": could not introduce itself to rank ", j, " at ",
           host_port(host, port));
    }
    peers[static_cast<std::size_t>(j)] = std::move(fd);
  }
  int missing = size - 1 - rank;
  set_nonblocking(listener.get(), true);
  while (missing > 0) {
    if (check_stop) check_stop();  // throws when another rank failed meanwhile
    pollfd p{listener.get(), POLLIN, 0};
    const int rc = ::poll(&p, 1, deadline.poll_ms(200));
    if (rc == 0 && deadline.expired()) {
      std::string who;
      int count = 0;
      for (int j = rank + 1; j < size; ++j) {
        if (!peers[static_cast<std::size_t>(j)]) {
          who += concat(who.empty() ? "" : ", ", j);
          ++count;
        }
      }
      fail(Errc::timeout, "rank ", rank, ": timed out waiting for ",
           count == 1 ? "rank " : "ranks ", who,
           " to connect (tcp transport): a rank that is stopped, overloaded or cannot reach "
           "this host (a firewall, a wrong interface) does this; every rank must reach every "
           "other on the ports the rendezvous published");
    }
    Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd) {
      // Out of descriptors the listener stays readable: retrying would spin until the timeout.
      fail_if_out_of_fds(errno, concat("rank ", rank,
                                       ": cannot accept rank(s) above it (tcp "
                                       "transport)"));
      continue;
    }
    set_nodelay(fd.get());
    std::array<std::byte, 4 + 16 + 4> hello{};
    // A stray connection gets a short window; it must not stall the mesh.
    const auto short_deadline =
        Deadline{std::min(deadline.at, Clock::now() + std::chrono::seconds(2))};
    if (recv_all(fd.get(), hello.data(), hello.size(), short_deadline) != IoResult::ok) continue;
    ByteReader r(hello.data(), hello.size(), "peer hello");
    if (r.get<std::uint32_t>() != hello_magic) continue;
    SessionKey got{};
    r.raw(got.data(), got.size());
    const auto peer = static_cast<int>(r.get<std::uint32_t>());
    if (!constant_time_equal(got, key) || peer <= rank || peer >= size ||
        peers[static_cast<std::size_t>(peer)]) {
      continue;  // not ours: drop it
    }
    peers[static_cast<std::size_t>(peer)] = std::move(fd);
    --missing;
  }
  return peers;
}

DDP_INLINE std::vector<Fd> TcpTransport::connect_below(
    int rank, const std::vector<std::pair<std::string, int>>& addrs, const SessionKey& key,
    Deadline window) {
  const auto n = static_cast<std::size_t>(rank);
  std::vector<Fd> done(n), trying(n);
  std::vector<Clock::time_point> retry_at(n, Clock::now());
  std::string hello;
  ByteWriter w(hello);
  w.put(hello_magic);
  w.raw(key.data(), key.size());
  w.put(static_cast<std::uint32_t>(rank));
  const auto start = [&](std::size_t j) {  // a non-blocking connect to rank j
    const auto& [host, port] = addrs[j];
    const AddrInfo ai(host, port, /*passive=*/false, "MASTER_ADDR");
    const addrinfo* a = ai.begin();
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!fd) fail_if_out_of_fds(errno, concat("rank ", rank, ": cannot connect to rank ", j));
    if (!fd) return;
    set_nonblocking(fd.get(), true);
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0 || errno == EINPROGRESS)
      trying[j] = std::move(fd);
    else
      retry_at[j] = Clock::now() + std::chrono::milliseconds(50);  // refused, unreachable
  };
  const auto connected = [&](std::size_t j) {  // introduces itself; empty again on failure
    Fd fd = std::move(trying[j]);
    int err = 0;
    socklen_t len = sizeof err;
    (void)::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err == 0 && !connected_to_itself(fd.get())) {
      set_nonblocking(fd.get(), false);
      set_nodelay(fd.get());
      if (send_all(fd.get(), hello.data(), hello.size(), window) == IoResult::ok) {
        done[j] = std::move(fd);
        return;
      }
    }
    retry_at[j] = Clock::now() + std::chrono::milliseconds(50);
  };
  std::vector<pollfd> fds;
  std::vector<std::size_t> which;
  for (;;) {
    fds.clear();
    which.clear();
    const auto now = Clock::now();
    for (std::size_t j = 0; j < n; ++j) {
      if (done[j]) continue;
      if (!trying[j] && now >= retry_at[j]) start(j);
      if (trying[j]) {
        fds.push_back({trying[j].get(), POLLOUT, 0});
        which.push_back(j);
      }
    }
    if (std::all_of(done.begin(), done.end(), [](const Fd& f) { return bool(f); }) ||
        window.expired())
      return done;
    const int rc = ::poll(fds.data(), fds.size(), std::min(50, window.poll_ms(50)));
    for (std::size_t i = 0; rc > 0 && i < fds.size(); ++i)
      if (fds[i].revents != 0) connected(which[i]);
  }
}

DDP_INLINE std::size_t TcpTransport::small_bytes() const noexcept {
  // Measured (bench/README.md): above these, the two-round path (each rank reduces 1/P of the
  // buffer) beats gathering whole buffers (each reduces all of it) despite its second round.
  return std::min(segment_, size_ == 2 ? (std::size_t{128} << 10) : (std::size_t{64} << 10));
}

DDP_INLINE std::span<const std::byte* const> TcpTransport::round(std::span<const Piece> offer,
                                                                 Want want, const Fingerprint* fp) {
  check_abort(fp);
  std::size_t scratch_needed = 0;
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) scratch_needed += want(j, rank_).len;
  }
  if (scratch_.size() < scratch_needed)
    scratch_.resize(scratch_needed);  // zero-filled: pre-faulted
  std::size_t scratch_at = 0;
  for (int j = 0; j < size_; ++j) {
    auto& x = xfers_[static_cast<std::size_t>(j)];
    x.clear();
    if (j == rank_) continue;
    if (fp != nullptr && verify_fingerprints) {
      x.out.push_back(
          {reinterpret_cast<std::byte*>(const_cast<Fingerprint*>(fp)), sizeof(Fingerprint)});
      x.in.push_back({reinterpret_cast<std::byte*>(&headers_in_[static_cast<std::size_t>(j)]),
                      sizeof(Fingerprint)});
      x.header_in = true;
    }
    const Range out = want(rank_, j);
    std::size_t base = 0;
    for (const Piece& p : offer) {
      const std::size_t lo = std::max(out.off, base),
                        hi = std::min(out.off + out.len, base + p.len);
      if (lo < hi) x.out.push_back({const_cast<std::byte*>(p.data) + (lo - base), hi - lo});
      base += p.len;
    }
    const Range in = want(j, rank_);
    if (in.len != 0) x.in.push_back({scratch_.data() + scratch_at, in.len});
    ptrs_[static_cast<std::size_t>(j)] = in.len != 0 ? scratch_.data() + scratch_at : nullptr;
    scratch_at += in.len;
  }
  progress(fp, nullptr);
  ptrs_[static_cast<std::size_t>(rank_)] = SelfTransport::locate(offer, want(rank_, rank_));
  return ptrs_;
}

DDP_INLINE void TcpTransport::send(const Buf& buf, int peer, int tag, std::uint64_t seq) {
  check_abort(nullptr);
  p2p_header_ = {seq, buf.count, tag, P2PHeader::p2p, buf.dtype, {}};
  for (auto& x : xfers_) x.clear();
  auto& x = xfers_[static_cast<std::size_t>(peer)];
  x.out.push_back({reinterpret_cast<std::byte*>(&p2p_header_), sizeof p2p_header_});
  if (buf.bytes() != 0) x.out.push_back({buf.data, buf.bytes()});
  const std::string what = concat("send(to rank ", peer, ", tag ", tag, ", ", to_string(buf.dtype),
                                  ", count=", buf.count, ")");
  progress(nullptr, what.c_str());
}

DDP_INLINE void TcpTransport::recv(const Buf& buf, int peer, int tag, std::uint64_t seq) {
  check_abort(nullptr);
  for (auto& x : xfers_) x.clear();
  auto& x = xfers_[static_cast<std::size_t>(peer)];
  x.in.push_back({reinterpret_cast<std::byte*>(&p2p_header_), sizeof p2p_header_});
  const std::string what = recv_description(buf, peer, tag);
  progress(nullptr, what.c_str());
  if (const std::string msg = p2p_mismatch(buf, peer, tag, seq, p2p_header_); !msg.empty()) {
    poison();
    fail(Errc::mismatch, msg);
  }
  x.clear();
  if (buf.bytes() != 0) x.in.push_back({buf.data, buf.bytes()});
  progress(nullptr, what.c_str());
}

DDP_INLINE void TcpTransport::abort(Errc code, const std::string&) {
  set_local_abort(code);
  poison();
}

DDP_INLINE std::size_t TcpTransport::gather(const std::vector<Seg>& segs, std::size_t i,
                                            std::size_t off) {
  std::size_t k = 0;
  for (; i < segs.size() && k < iov_.size(); ++i, off = 0) {
    if (segs[i].n > off) iov_[k++] = {segs[i].p + off, segs[i].n - off};
  }
  return k;
}

DDP_INLINE void TcpTransport::advance(const std::vector<Seg>& segs, std::size_t& i,
                                      std::size_t& off, std::size_t n) {
  while (i < segs.size() && segs[i].n - off <= n) {
    n -= segs[i].n - off;
    ++i;
    off = 0;
  }
  off += n;
}

DDP_INLINE void TcpTransport::Xfer::clear() {
  out.clear();
  in.clear();
  out_i = out_off = in_i = in_off = 0;
  header_in = false;
}

DDP_INLINE void TcpTransport::lost(int peer, const Fingerprint* fp, const char* what) {
  check_abort(fp);  // our own abort() shut the sockets down: report that, not a lost peer
  if (fp != nullptr && verify_fingerprints)
    collect_headers(*fp, Deadline::after(std::chrono::milliseconds(500)));
  std::vector<int> closed{peer};
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || j == peer) continue;
    pollfd p{peers_[static_cast<std::size_t>(j)].get(), POLLRDHUP, 0};
    if (::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0)
      closed.push_back(j);
  }
  // A rank that failed and left may have said why (a rank that died says nothing).
  fail_if_left(closed, std::chrono::milliseconds(300), fp, what);
  if (closed.size() == 1) {
    fail_from(-1, {global(peer)}, Errc::peer_lost, "rank ", global(rank_), ": ", describe(fp, what),
              ": the connection to rank ", global(peer),
              " closed (that process died or failed) (tcp transport); the job cannot continue with "
              "this communicator (the ranks still alive can go on with shrink())");
  }
  std::sort(closed.begin(), closed.end());
  std::string list;
  std::vector<int> lost;
  for (int j : closed) {
    list += concat(list.empty() ? "" : ", ", "rank ", global(j));
    lost.push_back(global(j));
  }
  fail_from(
      -1, std::move(lost), Errc::peer_lost, "rank ", global(rank_), ": ", describe(fp, what),
      ": the connections to ", list,
      " closed (one of those processes died, and the others left because of it) (tcp "
      "transport); the job cannot continue with this communicator (the ranks still alive can go "
      "on with shrink())");
}

DDP_INLINE void TcpTransport::pump(int j, bool out, const Fingerprint* fp, const char* what) {
  auto& x = xfers_[static_cast<std::size_t>(j)];
  std::vector<Seg>& segs = out ? x.out : x.in;
  std::size_t& i = out ? x.out_i : x.in_i;
  std::size_t& off = out ? x.out_off : x.in_off;
  const int fd = peers_[static_cast<std::size_t>(j)].get();
  while (i < segs.size()) {
    msghdr msg{};
    msg.msg_iov = iov_.data();
    msg.msg_iovlen = gather(segs, i, off);
    if (msg.msg_iovlen == 0) {  // only empty segments are left
      i = segs.size();
      break;
    }
    // A receive never takes more than this round's bytes: the next round's stay in the socket.
    const ssize_t n =
        out ? ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) : ::recvmsg(fd, &msg, MSG_DONTWAIT);
    if (n > 0) {
      const bool header_pending = !out && x.header_in && i == 0;
      advance(segs, i, off, static_cast<std::size_t>(n));
      if (header_pending && i > 0) check_header(j, *fp);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      lost(j, fp, what);
    }
  }
}

DDP_INLINE bool TcpTransport::pump_all(const Fingerprint* fp, const char* what) {
  bool done = true;
  for (int j = 0; j < size_; ++j) {
    auto& x = xfers_[static_cast<std::size_t>(j)];
    if (!x.out_done()) pump(j, true, fp, what);
    if (!x.in_done()) pump(j, false, fp, what);
    done = done && x.out_done() && x.in_done();
  }
  return done;
}

DDP_INLINE void TcpTransport::progress(const Fingerprint* fp, const char* what) {
  if (pump_all(fp, what)) return;
  const auto busy_until = Clock::now() + (oversubscribed_ ? std::chrono::microseconds(200)
                                                          : std::chrono::microseconds(50));
  do {
    if (oversubscribed_) {
      ::sched_yield();
    } else {
      for (int i = 0; i < 16; ++i) cpu_relax();
    }
    check_abort(fp);
    if (pump_all(fp, what)) return;
  } while (Clock::now() < busy_until);
  const auto deadline = Deadline::after(timeout_ + slack);
  std::vector<pollfd> fds;
  std::vector<int> who;
  for (;;) {
    fds.clear();
    who.clear();
    for (int j = 0; j < size_; ++j) {
      const auto& x = xfers_[static_cast<std::size_t>(j)];
      short ev = 0;
      if (!x.out_done()) ev = static_cast<short>(ev | POLLOUT);
      if (!x.in_done()) ev = static_cast<short>(ev | POLLIN);
      if (ev != 0) {
        fds.push_back({peers_[static_cast<std::size_t>(j)].get(), ev, 0});
        who.push_back(j);
      }
    }
    if (fds.empty()) return;
    check_abort(fp);
    const int rc = ::poll(fds.data(), fds.size(), deadline.poll_ms(50));
    if (rc < 0 && errno != EINTR) fail_errno(errno, "poll");
    if (rc <= 0) {
      if (deadline.expired()) {
        // One of them may have failed at its own timeout, or for another reason, just now.
        fail_if_left(who, std::chrono::milliseconds(100), fp, what);
        std::string list;
        for (int j : who) list += concat(list.empty() ? "" : ", ", global(j));
        // No poison(): the other ranks time out on their own, with their own message.
        fail(Errc::timeout, "rank ", global(rank_), ": ", describe(fp, what), ": timed out after ",
             (timeout_ + slack).count(), " ms waiting for ", who.size() == 1 ? "rank " : "ranks ",
             list, " (tcp transport); that rank is stopped, slow, or did not call this collective");
      }
      continue;
    }
    for (std::size_t i = 0; i < fds.size(); ++i) {
      const int j = who[i];
      const auto& x = xfers_[static_cast<std::size_t>(j)];
      const short re = fds[i].revents;
      if ((re & POLLOUT) != 0 || ((re & (POLLERR | POLLHUP)) != 0 && !x.out_done()))
        pump(j, true, fp, what);
      if ((re & (POLLIN | POLLERR | POLLHUP)) != 0) pump(j, false, fp, what);
    }
  }
}

DDP_INLINE void TcpTransport::collect_headers(const Fingerprint& mine, Deadline deadline) {
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    for (int j = 0; j < size_; ++j) {
      const auto& x = xfers_[static_cast<std::size_t>(j)];
      if (j != rank_ && x.header_in && x.in_i == 0) {
        fds.push_back({peers_[static_cast<std::size_t>(j)].get(), POLLIN, 0});
        who.push_back(j);
      }
    }
    if (fds.empty()) return;
    const int rc = ::poll(fds.data(), fds.size(), deadline.poll_ms(50));
    if (rc <= 0) {
      if (deadline.expired() || (rc < 0 && errno != EINTR)) return;
      continue;
    }
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      auto& x = xfers_[static_cast<std::size_t>(who[i])];
      Seg& h = x.in[0];
      const ssize_t n = ::recv(fds[i].fd, h.p + x.in_off, h.n - x.in_off, MSG_DONTWAIT);
      if (n > 0) {
        x.in_off += static_cast<std::size_t>(n);
        if (x.in_off == h.n) {
          check_header(who[i], mine);
          ++x.in_i;
          x.in_off = 0;
        }
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR && errno != EWOULDBLOCK)) {
        x.header_in = false;  // gone without a fingerprint: nothing more to learn there
      }
    }
  }
}

DDP_INLINE void TcpTransport::check_header(int peer, const Fingerprint& mine) {
  const Fingerprint& theirs = headers_in_[static_cast<std::size_t>(peer)];
  if (!(theirs == mine)) {
    const std::string msg = mismatch_message(mine, peer, theirs);
    flush_headers();
    fail(Errc::mismatch, msg);
  }
}

DDP_INLINE void TcpTransport::flush_headers() {
  const auto deadline = Deadline::after(std::chrono::milliseconds(500));
  for (int j = 0; j < size_; ++j) {
    auto& x = xfers_[static_cast<std::size_t>(j)];
    if (j == rank_ || x.out.empty() || x.out_i > 0) continue;  // header already sent (or none)
    const Seg& h = x.out[0];
    (void)send_all(peers_[static_cast<std::size_t>(j)].get(), h.p + x.out_off, h.n - x.out_off,
                   deadline);
    ++x.out_i;
    x.out_off = 0;
  }
}

}  // namespace detail
DDP_END_NAMESPACE
