// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/engine.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE StoreEngine::StoreEngine(StoreOptions options) : options_(std::move(options)) {}

DDP_INLINE auto StoreEngine::session(std::uint64_t id) -> Session* {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

DDP_INLINE std::uint64_t StoreEngine::open(std::string peer, Clock::time_point now) {
  std::size_t live = 0, pending = 0;
  for (const auto& [id, s] : sessions_) {
    live += s.closed ? 0 : 1;
    pending += !s.authed && !s.closed ? 1 : 0;
  }
  if (pending > 0 && (pending >= std::max<std::size_t>(1, options_.max_pending_handshakes) ||
                      live >= options_.max_connections)) {
    evict_oldest_pending();
    --live;
  }
  if (live >= options_.max_connections) {
    refuse(peer, "too many connections");
    return 0;
  }
  Session s;
  s.peer = std::move(peer);
  s.accepted = now;
  random_bytes(s.nonce.data(), s.nonce.size());
  std::string hello;
  ByteWriter w(hello);
  w.put(store_proto::magic);
  w.put(store_proto::version);
  w.put(static_cast<std::uint8_t>(options_.token.empty() ? 0 : 1));
  w.raw(s.nonce.data(), s.nonce.size());
  queue_frame(s, hello);
  const auto id = next_id_++;
  sessions_.emplace(id, std::move(s));
  return id;
}

DDP_INLINE void StoreEngine::receive(std::uint64_t id, std::string_view bytes,
                                     Clock::time_point now) {
  Session* s = session(id);
  if (s != nullptr) s->heard = now;
  while (s != nullptr && !s->closed && !bytes.empty()) {
    const std::size_t take = std::min(wanted(*s), bytes.size());
    s->in.append(bytes.substr(0, take));
    bytes.remove_prefix(take);
    if (s->frame_len == 0 && s->in.size() == 4 && !read_length(*s)) return;
    if (s->frame_len != 0 && s->in.size() == s->frame_len + 4) {
      try {
        const auto frame = std::string_view(s->in).substr(4);
        if (!s->authed)
          handshake(*s, frame);
        else
          handle(id, *s, frame, now);
      } catch (const Error& e) {
        return drop(*s, e.what());
      }
      release(s->in);
      s->frame_len = 0;
      if (s->close_after_write) return;  // nothing more is read from a refused client
    }
  }
}

DDP_INLINE void StoreEngine::peer_closed(std::uint64_t id) {
  Session* s = session(id);
  if (s == nullptr || s->closed) return;
  if (!s->authed && s->in.empty() && !s->close_after_write)
    refuse(s->peer, "connected and closed without a handshake");
  s->closed = true;
  if (!s->authed) return;
  if (apply_on_close(*s)) wake_waiters();
}

DDP_INLINE void StoreEngine::expire(Clock::time_point now) {
  refusals_.flush(options_);
  std::erase_if(waiters_, [&](const Waiter& wt) {
    Session* s = session(wt.conn);
    if (s == nullptr || s->closed) return true;
    if (wt.deadline > now) return false;
    std::string body;
    ByteWriter w(body);
    std::vector<std::string_view> missing;
    for (const auto& k : wt.keys) {
      if (data_.count(k) == 0) missing.push_back(k);
    }
    w.put(static_cast<std::uint32_t>(missing.size()));
    for (auto k : missing) w.str(k);
    reply(*s, wt.request, Status::timeout, body);
    return true;
  });
  bool changed = false;
  for (auto& [id, s] : sessions_) {
    if (!s.closed && !s.authed && now - s.accepted > options_.handshake_timeout)
      drop(s, "no handshake before the timeout");
    // A lease that ran out: the process is stopped, hung or cut off. It counts as gone (its
    // on_close records, once), and its lease's own records apply; the connection stays open,
    // so a process that wakes still reads why it was left out.
    if (!s.closed && s.authed && s.lease.count() > 0 && !s.expired && now - s.heard > s.lease) {
      s.expired = true;
      changed = apply_on_close(s) || changed;
      for (const LeaseRecord& r : s.on_expire) changed = apply(r) || changed;
    }
  }
  if (changed) wake_waiters();
}

DDP_INLINE Clock::time_point StoreEngine::next_deadline(Clock::time_point limit) const {
  for (const auto& w : waiters_) limit = std::min(limit, w.deadline);
  for (const auto& [id, s] : sessions_) {
    if (!s.authed && !s.closed) limit = std::min(limit, s.accepted + options_.handshake_timeout);
    if (!s.closed && s.lease.count() > 0 && !s.expired)
      limit = std::min(limit, s.heard + s.lease + std::chrono::milliseconds(1));
  }
  return limit;
}

DDP_INLINE void StoreEngine::reap() {
  std::erase_if(sessions_, [](const auto& kv) { return kv.second.closed; });
  std::erase_if(waiters_, [&](const Waiter& wt) { return sessions_.count(wt.conn) == 0; });
}

DDP_INLINE void StoreEngine::close_all() {
  for (auto& [id, s] : sessions_) s.closed = true;
}

DDP_INLINE void StoreEngine::evict_oldest_pending() {
  for (auto& [id, s] : sessions_) {  // ids grow with time: the first match is the oldest
    if (!s.authed && !s.closed) {
      drop(s, "closed to make room: too many connections that have not authenticated");
      return;
    }
  }
}

DDP_INLINE void StoreEngine::publish_refusal(const std::string& peer, std::int32_t rank,
                                             const std::string& key) {
  if (key.empty() || data_.count(key) != 0) return;
  std::string v = encode_stop(Error(
      Errc::unauthorized,
      concat("the rendezvous failed ", rank >= 0 ? concat("on rank ", rank, ": ") : ": "), rank,
      concat("the store refused its connection from ", peer,
             ": its token differs from the store's (rank 0's, or the launcher's) or "
             "is missing; every rank must have the same DDP_TOKEN")));
  if (store_value(key, std::move(v))) wake_waiters();
}

DDP_INLINE void StoreEngine::drop(Session& s, std::string_view why) {
  refuse(s.peer, why);
  s.closed = true;
}

DDP_INLINE void StoreEngine::queue_frame(Session& s, std::string_view payload) {
  ByteWriter w(s.out);
  w.put(static_cast<std::uint32_t>(payload.size()));
  s.out.append(payload);
}

DDP_INLINE void StoreEngine::release(std::string& buf) {
  if (buf.capacity() > 64 * 1024)
    std::string().swap(buf);
  else
    buf.clear();
}

DDP_INLINE bool StoreEngine::read_length(Session& s) {
  ByteReader r(s.in, "frame length");
  const auto len = r.get<std::uint32_t>();
  const std::size_t limit =
      s.authed ? store_proto::frame_limit(options_) : store_proto::handshake_frame_limit;
  if (!s.authed && looks_like_text(s.in)) {
    drop(s, concat("not a ddp store client (stray traffic starting \"", printable(s.in), "\")"));
    return false;
  }
  if (len > limit) {
    drop(s, concat("frame of ", len, " bytes refused (limit ", limit, ")"));
    return false;
  }
  if (len == 0) {
    drop(s, "empty frame");
    return false;
  }
  s.frame_len = len;
  return true;
}

DDP_INLINE void StoreEngine::handshake(Session& s, std::string_view frame) {
  namespace sp = store_proto;
  ByteReader r(frame, "store handshake");
  if (r.get<std::uint32_t>() != sp::magic) fail(Errc::protocol, "bad handshake magic");
  const auto v = r.get<std::uint16_t>();
  sp::Nonce client_nonce{};
  r.raw(client_nonce.data(), client_nonce.size());
  Digest mac{};
  r.raw(mac.data(), mac.size());
  std::int32_t claimed_rank = -1;
  std::string refusal_key;  // optional: where a refusal of this client is published
  if (r.left() != 0) {
    claimed_rank = r.get<std::int32_t>();
    refusal_key = r.str(sp::refusal_key_limit);
  }
  r.expect_end();
  std::string reply;
  ByteWriter w(reply);
  if (v != sp::version) {
    w.put(sp::HandshakeStatus::bad_version);
    queue_frame(s, reply);
    s.close_after_write = true;
    refuse(s.peer, concat("protocol version ", v, " (server speaks ", sp::version, ")"));
    return;
  }
  if (!options_.token.empty()) {
    const auto expected = hmac_sha256(options_.token, sp::client_label, sp::as_view(s.nonce),
                                      sp::as_view(client_nonce));
    if (!constant_time_equal(expected, mac)) {
      w.put(sp::HandshakeStatus::unauthorized);
      queue_frame(s, reply);
      s.close_after_write = true;
      refuse(s.peer, "wrong or missing token (DDP_TOKEN)");
      publish_refusal(s.peer, claimed_rank, refusal_key);
      return;
    }
  }
  w.put(sp::HandshakeStatus::ok);
  const auto proof = options_.token.empty()
                         ? Digest{}
                         : hmac_sha256(options_.token, sp::server_label, sp::as_view(client_nonce),
                                       sp::as_view(s.nonce));
  w.raw(proof.data(), proof.size());
  queue_frame(s, reply);
  s.authed = true;
}

DDP_INLINE void StoreEngine::reply(Session& s, std::uint64_t request, Status status,
                                   std::string_view body, const std::string* value) {
  const std::size_t n = 1 + 8 + body.size() + (value != nullptr ? 4 + value->size() : 0);
  ByteWriter w(s.out);
  w.put(static_cast<std::uint32_t>(n));
  w.put(status);
  w.put(request);
  w.raw(body.data(), body.size());
  if (value != nullptr) w.str(*value);
}

DDP_INLINE void StoreEngine::handle(std::uint64_t id, Session& s, std::string_view frame,
                                    Clock::time_point now) {
  ByteReader r(frame, "store request");
  const auto op = r.get<Op>();
  const auto request = r.get<std::uint64_t>();
  const auto key = [&] { return r.str(options_.max_key_bytes); };
  const auto timeout_at = [&] {
    const auto ms = std::min<std::uint64_t>(r.get<std::uint64_t>(), 1ull << 40);
    return now + std::chrono::milliseconds(static_cast<std::int64_t>(ms));
  };
  const auto key_list = [&] {
    const auto n = r.get<std::uint32_t>();
    if (n > options_.max_keys) fail(Errc::protocol, "request names ", n, " keys");
    std::vector<std::string> keys;
    for (std::uint32_t i = 0; i < n; ++i) keys.push_back(key());
    return keys;
  };
  std::string body;
  ByteWriter w(body);
  switch (op) {
    case Op::set: {
      auto k = key();
      auto v = r.str(options_.max_value_bytes);
      r.expect_end();
      if (!store_value(k, std::move(v))) return reply(s, request, Status::error, "store is full");
      reply(s, request, Status::ok);
      wake_waiters();
      return;
    }
    case Op::get:
    case Op::wait: {
      const bool is_get = op == Op::get;
      Waiter wt{id, request, is_get ? std::vector<std::string>{key()} : key_list(), {}, is_get, {}};
      wt.deadline = timeout_at();
      wt.stop = key();
      r.expect_end();
      if (!try_answer(s, wt)) waiters_.push_back(std::move(wt));
      return;
    }
    case Op::add: {
      auto k = key();
      const auto delta = r.get<std::int64_t>();
      r.expect_end();
      std::int64_t value = 0;
      if (auto it = data_.find(k); it != data_.end()) {
        if (it->second.size() != 8)
          return reply(s, request, Status::error, "key does not hold a counter");
        ByteReader vr(it->second, "counter");
        value = vr.get<std::int64_t>();
      }
      value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) +
                                        static_cast<std::uint64_t>(delta));
      std::string enc;
      ByteWriter(enc).put(value);
      if (!store_value(k, std::move(enc))) return reply(s, request, Status::error, "store is full");
      w.put(value);
      reply(s, request, Status::ok, body);
      wake_waiters();
      return;
    }
    case Op::compare_set: {
      auto k = key();
      auto expected = r.str(options_.max_value_bytes);
      auto desired = r.str(options_.max_value_bytes);
      r.expect_end();
      auto it = data_.find(k);
      const bool swap =
          (it == data_.end() && expected.empty()) || (it != data_.end() && it->second == expected);
      if (swap) {
        if (!store_value(k, desired)) return reply(s, request, Status::error, "store is full");
        it = data_.find(k);
        wake_waiters();
      }
      const std::string none;
      reply(s, request, Status::ok, {}, it == data_.end() ? &none : &it->second);
      return;
    }
    case Op::erase: {
      auto k = key();
      r.expect_end();
      auto it = data_.find(k);
      const bool existed = it != data_.end();
      if (existed) {
        total_bytes_ -= it->first.size() + it->second.size();
        data_.erase(it);
      }
      w.put(static_cast<std::uint8_t>(existed));
      reply(s, request, Status::ok, body);
      return;
    }
    case Op::on_close: {
      const auto n = r.get<std::uint32_t>();
      if (n > 16) fail(Errc::protocol, "on_close names ", n, " keys (at most 16)");
      std::vector<std::pair<std::string, std::string>> keys;
      for (std::uint32_t i = 0; i < n; ++i) {
        auto k = key();
        keys.emplace_back(std::move(k), r.str(options_.max_value_bytes));
      }
      r.expect_end();
      s.on_close = std::move(keys);
      reply(s, request, Status::ok);
      return;
    }
    case Op::lease: {
      const auto ms = std::min<std::uint64_t>(r.get<std::uint64_t>(), 1ull << 40);
      const auto n = r.get<std::uint32_t>();
      if (n > 16) fail(Errc::protocol, "lease names ", n, " keys (at most 16)");
      std::vector<LeaseRecord> records;
      for (std::uint32_t i = 0; i < n; ++i) {
        LeaseRecord rec;
        rec.is_add = r.get<std::uint8_t>() != 0;
        rec.key = key();
        rec.value = r.str(options_.max_value_bytes);
        rec.add = r.get<std::int64_t>();
        records.push_back(std::move(rec));
      }
      r.expect_end();
      s.lease = std::chrono::milliseconds(static_cast<std::int64_t>(ms));
      s.heard = now;
      s.expired = false;
      s.on_expire = std::move(records);
      reply(s, request, Status::ok);
      return;
    }
    case Op::keepalive:
      r.expect_end();
      return;  // its arrival is the point (receive() noted it); no reply
    case Op::check: {
      auto keys = key_list();
      r.expect_end();
      const bool all =
          std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return data_.count(k) != 0; });
      w.put(static_cast<std::uint8_t>(all));
      reply(s, request, Status::ok, body);
      return;
    }
  }
  fail(Errc::protocol, "unknown store operation ", static_cast<int>(op));
}

DDP_INLINE bool StoreEngine::apply_on_close(Session& s) {
  bool changed = false;
  for (auto& [k, v] : s.on_close)
    changed = (data_.count(k) == 0 && store_value(k, std::move(v))) || changed;
  s.on_close.clear();
  return changed;
}

DDP_INLINE bool StoreEngine::apply(const LeaseRecord& r) {
  if (!r.is_add) return data_.count(r.key) == 0 && store_value(r.key, r.value);
  std::int64_t value = 0;
  if (auto it = data_.find(r.key); it != data_.end()) {
    if (it->second.size() != 8) return false;
    ByteReader vr(it->second, "counter");
    value = vr.get<std::int64_t>();
  }
  value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) +
                                    static_cast<std::uint64_t>(r.add));
  std::string enc;
  ByteWriter(enc).put(value);
  return store_value(r.key, std::move(enc));
}

DDP_INLINE bool StoreEngine::store_value(const std::string& k, std::string v) {
  auto it = data_.find(k);
  const std::size_t old = it == data_.end() ? 0 : k.size() + it->second.size();
  if (it == data_.end() && data_.size() >= options_.max_keys) return false;
  if (total_bytes_ - old + k.size() + v.size() > options_.max_total_bytes) return false;
  total_bytes_ = total_bytes_ - old + k.size() + v.size();
  data_[k] = std::move(v);
  return true;
}

DDP_INLINE bool StoreEngine::try_answer(Session& s, const Waiter& wt) {
  if (!wt.stop.empty()) {
    if (auto it = data_.find(wt.stop); it != data_.end()) {
      reply(s, wt.request, Status::stopped, {}, &it->second);
      return true;
    }
  }
  for (const auto& k : wt.keys) {
    if (data_.count(k) == 0) return false;
  }
  if (wt.is_get) {
    reply(s, wt.request, Status::ok, {}, &data_[wt.keys.front()]);
  } else {
    reply(s, wt.request, Status::ok);
  }
  return true;
}

DDP_INLINE void StoreEngine::wake_waiters() {
  std::erase_if(waiters_, [&](const Waiter& wt) {
    Session* s = session(wt.conn);
    if (s == nullptr || s->closed) return true;
    return try_answer(*s, wt);
  });
}

}  // namespace detail
DDP_END_NAMESPACE
