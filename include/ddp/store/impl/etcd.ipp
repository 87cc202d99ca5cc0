// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/etcd.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <charconv>
#include <map>
#include <set>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE EtcdStoreConnection::EtcdStoreConnection(EtcdAddress address, StoreOptions o)
    : StoreConnection(std::move(o)),
      address_(std::move(address)),
      root_(concat("/ddp/", address_.ns, "/")),
      created_(options.tried_since == Clock::time_point{} ? Clock::now() : options.tried_since) {
  for (const auto& [h, p] : address_.endpoints) {
    calls_.emplace_back(h, p);
    beats_.emplace_back(h, p);
  }
  std::lock_guard lock(mutex_);
  const auto deadline = Deadline::after(options.timeout);
  join_namespace(deadline);
  // etcd counts leases in whole seconds (and grants at least its own minimum: 1.5 times its
  // election timeout, rounded up).
  const auto ttl =
      std::max<std::int64_t>(1, std::chrono::ceil<std::chrono::seconds>(options.lease_ttl).count());
  lease_ = grant(ttl, deadline, calls_, at_);
  put_raw(concat(root_, "proc/", lease_), "", lease_, deadline, calls_, at_);
}

DDP_INLINE EtcdStoreConnection::~EtcdStoreConnection() {
  stop_heartbeat();
  // Ending normally: its close records apply now (as ddp's store applies them when a
  // connection closes), and its lease goes.
  try {
    std::lock_guard lock(mutex_);
    const auto deadline = Deadline::after(std::chrono::seconds(2));
    if (!closing_.empty()) apply(closing_, false, deadline, calls_, at_);
    (void)request("/v3/kv/deleterange",
                  concat("{\"key\":", k64(concat(root_, "close/", lease_)), "}"), deadline, calls_,
                  at_);
    (void)request("/v3/kv/deleterange",
                  concat("{\"key\":", k64(concat(root_, "expire/", lease_)), "}"), deadline, calls_,
                  at_);
    (void)request("/v3/lease/revoke", concat("{\"ID\":\"", lease_, "\"}"), deadline, calls_, at_);
  } catch (...) {  // the cluster is gone: the lease runs out by itself
  }
}

DDP_INLINE void EtcdStoreConnection::set(const StoreCall& c, const std::string& key,
                                         std::string_view value) {
  auto lock = lock_for(c);
  put_raw(user(key), value, ns_lease_, deadline_of(c, options.timeout), calls_, at_);
}

DDP_INLINE std::string EtcdStoreConnection::get(const StoreCall& c, const std::string& key,
                                                std::chrono::milliseconds timeout,
                                                const std::string& stop) {
  const std::string one[] = {key};
  std::string value;
  if (!await_keys(c, one, timeout, stop, &value))
    fail_missing(c, timeout, std::vector<std::string>{key});
  return value;
}

DDP_INLINE bool EtcdStoreConnection::wait(const StoreCall& c, std::span<const std::string> keys,
                                          std::chrono::milliseconds timeout,
                                          const std::string& stop, bool report_timeout) {
  if (await_keys(c, keys, timeout, stop, nullptr)) return true;
  if (report_timeout) return false;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!check(c, std::span<const std::string>(&k, 1))) missing.push_back(k);
  fail_missing(c, timeout, missing);
}

DDP_INLINE std::int64_t EtcdStoreConnection::add(const StoreCall& c, const std::string& key,
                                                 std::int64_t delta) {
  auto lock = lock_for(c);
  const auto deadline = deadline_of(c, options.timeout);
  if (delta == 0) {  // a read (how counters are polled): no write to replicate
    const auto held = range_one(user(key), deadline).first;
    if (!held || held->size() != 8) return 0;
    ByteReader r(*held, "counter");
    return r.get<std::int64_t>();
  }
  const std::string marker = concat(root_, "op/", lease_, "/", ++ops_);
  for (;;) {
    const auto [held, revision] = range_one(user(key), deadline);
    std::int64_t value = 0;
    if (held) {
      if (held->size() != 8)
        fail(Errc::protocol, "store add(\"", c.prefix, c.key,
             "\") failed: key does not hold a counter");
      ByteReader r(*held, "counter");
      value = r.get<std::int64_t>();
    }
    value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) +
                                      static_cast<std::uint64_t>(delta));
    std::string enc;
    ByteWriter(enc).put(value);
    const std::string compare =
        held ? concat("{\"key\":", k64(user(key)), ",\"target\":\"MOD\",\"mod_revision\":\"",
                      revision, "\"}")
             : concat("{\"key\":", k64(user(key)),
                      ",\"target\":\"CREATE\",\"create_revision\":\"0\"}");
    const Json r = json(request(
        "/v3/kv/txn",
        concat("{\"compare\":[", compare, "],\"success\":[", put_op(user(key), enc, ns_lease_), ",",
               put_op(marker, enc, ns_lease_), "]}"),
        deadline, calls_, at_));
    if (r.find("succeeded") != nullptr) return value;
    if (!committed_) {  // an answer was lost on the way: was that attempt applied?
      if (const auto done = range_one(marker, deadline).first; done && done->size() == 8) {
        ByteReader br(*done, "counter");
        return br.get<std::int64_t>();
      }
    }
  }
}

DDP_INLINE std::string EtcdStoreConnection::compare_set(const StoreCall& c, const std::string& key,
                                                        std::string_view expected,
                                                        std::string_view desired) {
  auto lock = lock_for(c);
  const auto deadline = deadline_of(c, options.timeout);
  const std::string compare =
      expected.empty()
          ? concat("{\"key\":", k64(user(key)), ",\"target\":\"CREATE\",\"create_revision\":\"0\"}")
          : concat("{\"key\":", k64(user(key)), ",\"target\":\"VALUE\",\"value\":\"",
                   base64_encode(expected), "\"}");
  const Json r = json(request(
      "/v3/kv/txn",
      concat("{\"compare\":[", compare, "],\"success\":[", put_op(user(key), desired, ns_lease_),
             "],\"failure\":[", range_op(user(key)), "]}"),
      deadline, calls_, at_));
  if (r.find("succeeded") != nullptr) return std::string(desired);
  const Json* responses = r.find("responses");
  if (responses != nullptr && !responses->items.empty())
    if (const Json* rr = responses->items[0].find("response_range"))
      if (const Json* kvs = rr->find("kvs"); kvs != nullptr && !kvs->items.empty())
        return base64_decode(kvs->items[0].get("value"));
  return {};
}

DDP_INLINE bool EtcdStoreConnection::erase(const StoreCall& c, const std::string& key) {
  auto lock = lock_for(c);
  const Json r = json(request("/v3/kv/deleterange", concat("{\"key\":", k64(user(key)), "}"),
                              deadline_of(c, options.timeout), calls_, at_));
  return r.integer("deleted") > 0;
}

DDP_INLINE bool EtcdStoreConnection::check(const StoreCall& c, std::span<const std::string> keys) {
  auto lock = lock_for(c);
  return present(keys, "", deadline_of(c, options.timeout), nullptr) == keys.size();
}

DDP_INLINE void EtcdStoreConnection::set_on_close(
    const StoreCall& c, std::span<const std::pair<std::string, std::string>> keys) {
  auto lock = lock_for(c);
  std::vector<LeaseRecord> records;
  for (const auto& [k, v] : keys) records.push_back({k, v, 0, false});
  put_raw(concat(root_, "close/", lease_), encode(records), ns_lease_,
          deadline_of(c, options.timeout), calls_, at_);
  closing_ = std::move(records);
}

DDP_INLINE void EtcdStoreConnection::lease(const StoreCall& c, std::chrono::milliseconds,
                                           std::span<const LeaseRecord> on_expire) {
  // The process's lease was made with StoreOptions::lease_ttl; its expiry records go here.
  auto lock = lock_for(c);
  put_raw(concat(root_, "expire/", lease_),
          encode(std::vector<LeaseRecord>(on_expire.begin(), on_expire.end())), ns_lease_,
          deadline_of(c, options.timeout), calls_, at_);
}

DDP_INLINE std::string EtcdStoreConnection::where() const {
  std::string w = "etcd ";
  for (std::size_t i = 0; i < address_.endpoints.size(); ++i)
    w += concat(i ? "," : "", host_port(address_.endpoints[i].first, address_.endpoints[i].second));
  return concat(w, " (namespace ", address_.ns, ")");
}

DDP_INLINE std::string EtcdStoreConnection::local_address() {
  std::lock_guard lock(mutex_);
  (void)request("/v3/maintenance/status", "{}", Deadline::after(options.timeout), calls_, at_);
  return detail::local_address(calls_[at_].descriptor());
}

DDP_INLINE void EtcdStoreConnection::keepalive() {
  const auto deadline = Deadline::after(std::chrono::seconds(2));
  for (const std::int64_t id : {lease_, ns_lease_}) {
    const Json r = json(request("/v3/lease/keepalive", concat("{\"ID\":\"", id, "\"}"), deadline,
                                beats_, beat_at_));
    (void)r;  // a lease that ran out stays out: its process was counted lost
  }
}

DDP_INLINE void EtcdStoreConnection::on_beat() {
  const auto deadline = Deadline::after(std::chrono::seconds(2));
  std::set<std::string> live;
  for (const Json& kv : prefix_range(concat(root_, "proc/"), true, deadline))
    live.insert(base64_decode(kv.get("key")).substr(root_.size() + 5));
  for (const bool expiry : {false, true}) {
    const std::string at = concat(root_, expiry ? "expire/" : "close/");
    for (const Json& kv : prefix_range(at, false, deadline)) {
      const std::string id = base64_decode(kv.get("key")).substr(at.size());
      if (live.count(id) != 0) continue;
      const std::string value = base64_decode(kv.get("value"));
      apply(decode(value), expiry, deadline, beats_, beat_at_);
      (void)request(
          "/v3/kv/txn",
          concat("{\"compare\":[{\"key\":", k64(at + id), ",\"target\":\"MOD\",\"mod_revision\":\"",
                 kv.get("mod_revision"),
                 "\"}],\"success\":[{\"request_delete_range\":{\"key\":", k64(at + id), "}}]}"),
          deadline, beats_, beat_at_);
    }
  }
}

DDP_INLINE std::string EtcdStoreConnection::put_op(const std::string& key, std::string_view value,
                                                   std::int64_t lease) {
  return concat("{\"request_put\":{\"key\":", k64(key), ",\"value\":\"", base64_encode(value),
                "\",\"lease\":\"", lease, "\"}}");
}

DDP_INLINE Deadline EtcdStoreConnection::deadline_of(const StoreCall& c,
                                                     std::chrono::milliseconds timeout) {
  Deadline d = Deadline::after(timeout);
  if (c.deadline != Clock::time_point::max())
    d.at = std::min(d.at, std::max(c.deadline, Clock::now()) + std::chrono::seconds(2));
  return d;
}

DDP_INLINE std::string EtcdStoreConnection::request(std::string_view path, const std::string& body,
                                                    Deadline deadline, Clients& clients,
                                                    std::size_t& at, const StoreCall* c) {
  const bool calls = &clients == &calls_;  // the heartbeat's requests leave committed_ alone
  if (calls) committed_ = true;
  std::string last = "no member answered", answer;
  std::size_t unreachable = 0;  // members in a row that refused connections or do not resolve
  for (std::size_t tried = 0;; ++tried) {
    HttpClient& h = clients[at];
    Deadline one = Deadline::after(std::chrono::seconds(3));
    one.at = std::min(one.at, deadline.at);
    try {
      const HttpReply r = h.post(path, body, one);
      reached_ = true;
      unreachable = 0;
      if (r.status == 200) return r.body;
      last = answer = concat("member ", host_port(h.host(), h.port()), " answered ", r.status, ": ",
                             r.body.substr(0, 200));
      if (r.status < 500) fail(Errc::protocol, "etcd ", path, ": ", last);
    } catch (const Error& e) {
      if (e.code() == Errc::protocol) throw;
      last = e.what();
      if (calls) committed_ = false;  // the request may or may not have been applied
      unreachable = h.unreachable() ? unreachable + 1 : 0;
    }
    // No member was ever reached, and none accepts connections or resolves: wrong endpoints (or
    // a cluster still starting). Given StoreOptions::unreachable_window to start, then refused
    // instead of at the timeout.
    if (!reached_ && unreachable >= clients.size() &&
        Clock::now() - created_ >= options.unreachable_window)
      fail(Errc::invalid_argument, "the rendezvous store in ", where(),
           " cannot be reached: no member accepts connections (", last, ") for ",
           std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - created_).count(),
           " s; is etcd running there? check the client URLs in DDP_STORE "
           "(etcd://HOST:PORT,.../NAMESPACE) or ddprun's --rdzv-endpoint");
    at = (at + 1) % clients.size();
    if (deadline.expired())
      fail(Errc::timeout,
           c != nullptr && !c->what.empty()
               ? concat("store ", c->what, "(\"", c->prefix, c->key, "\"): ")
               : std::string(),
           "the rendezvous store in ", where(),
           " gave no usable answer before the timeout (is a majority of its members up and "
           "reachable?): ",
           last, answer.empty() || answer == last ? "" : concat("; the last answer: ", answer));
    if (tried + 1 >= clients.size())
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(100, deadline.poll_ms())));
  }
}

DDP_INLINE std::pair<std::optional<std::string>, std::string> EtcdStoreConnection::range_one(
    const std::string& key, Deadline deadline) {
  const Json r =
      json(request("/v3/kv/range", concat("{\"key\":", k64(key), "}"), deadline, calls_, at_));
  const Json* kvs = r.find("kvs");
  if (kvs == nullptr || kvs->items.empty()) return {std::nullopt, ""};
  return {base64_decode(kvs->items[0].get("value")), kvs->items[0].get("mod_revision")};
}

DDP_INLINE std::vector<Json> EtcdStoreConnection::prefix_range(const std::string& prefix,
                                                               bool keys_only, Deadline deadline) {
  std::string end = prefix;
  end.back() = static_cast<char>(end.back() + 1);
  Json r = json(request("/v3/kv/range",
                        concat("{\"key\":", k64(prefix), ",\"range_end\":", k64(end),
                               keys_only ? ",\"keys_only\":true}" : "}"),
                        deadline, beats_, beat_at_));
  if (Json* kvs = const_cast<Json*>(r.find("kvs"))) return std::move(kvs->items);
  return {};
}

DDP_INLINE std::size_t EtcdStoreConnection::present(std::span<const std::string> keys,
                                                    const std::string& stop, Deadline deadline,
                                                    std::string* value,
                                                    std::optional<std::string>* stopped,
                                                    const StoreCall* c) {
  std::string ops;
  for (const auto& k : keys) ops += concat(ops.empty() ? "" : ",", range_op(user(k)));
  if (!stop.empty()) ops += concat(ops.empty() ? "" : ",", range_op(user(stop)));
  const Json r =
      json(request("/v3/kv/txn", concat("{\"success\":[", ops, "]}"), deadline, calls_, at_, c));
  const Json* responses = r.find("responses");
  std::size_t found = 0;
  for (std::size_t i = 0; responses != nullptr && i < responses->items.size(); ++i) {
    const Json* rr = responses->items[i].find("response_range");
    const Json* kvs = rr != nullptr ? rr->find("kvs") : nullptr;
    if (kvs == nullptr || kvs->items.empty()) continue;
    if (i == keys.size() && stopped != nullptr) {
      *stopped = base64_decode(kvs->items[0].get("value"));
      continue;
    }
    if (i == 0 && value != nullptr) *value = base64_decode(kvs->items[0].get("value"));
    ++found;
  }
  return found;
}

DDP_INLINE bool EtcdStoreConnection::await_keys(const StoreCall& c,
                                                std::span<const std::string> keys,
                                                std::chrono::milliseconds timeout,
                                                const std::string& stop, std::string* value) {
  Deadline deadline = Deadline::after(timeout);
  deadline.at = std::min(deadline.at, c.deadline);
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    {
      auto lock = lock_for(c);
      std::optional<std::string> stopped;
      // Each look is a request of its own, given the store's timeout (a wait of 0 ms looks
      // once); the wait's own timeout only decides when to stop looking.
      const std::size_t n =
          present(keys, stop, deadline_of(c, options.timeout), value, &stopped, &c);
      if (stopped) fail_stopped(c, stop, *stopped);
      if (n == keys.size()) return true;
    }
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::min(pause, std::chrono::milliseconds(deadline.poll_ms())));
    pause = std::min(pause * 2, std::chrono::milliseconds(32));
  }
}

DDP_INLINE void EtcdStoreConnection::put_raw(const std::string& key, std::string_view value,
                                             std::int64_t lease, Deadline deadline,
                                             Clients& clients, std::size_t& at) {
  (void)request("/v3/kv/put",
                concat("{\"key\":", k64(key), ",\"value\":\"", base64_encode(value), "\"",
                       lease != 0 ? concat(",\"lease\":\"", lease, "\"") : std::string(), "}"),
                deadline, clients, at);
}

DDP_INLINE std::int64_t EtcdStoreConnection::grant(std::int64_t ttl, Deadline deadline,
                                                   Clients& clients, std::size_t& at) {
  const Json r =
      json(request("/v3/lease/grant", concat("{\"TTL\":\"", ttl, "\"}"), deadline, clients, at));
  const std::int64_t id = r.integer("ID");
  if (id == 0) fail(Errc::protocol, "etcd granted no lease: ", r.get("error"));
  return id;
}

DDP_INLINE void EtcdStoreConnection::join_namespace(Deadline deadline) {
  const std::int64_t mine = grant(60, deadline, calls_, at_);
  const std::string key = root_ + "ns";
  const Json r = json(request(
      "/v3/kv/txn",
      concat("{\"compare\":[{\"key\":", k64(key),
             ",\"target\":\"CREATE\",\"create_revision\":\"0\"}],\"success\":[",
             put_op(key, std::to_string(mine), mine), "],\"failure\":[", range_op(key), "]}"),
      deadline, calls_, at_));
  ns_lease_ = mine;
  if (r.find("succeeded") != nullptr) return;
  const Json* responses = r.find("responses");
  const Json* kvs = responses != nullptr && !responses->items.empty() &&
                            responses->items[0].find("response_range") != nullptr
                        ? responses->items[0].find("response_range")->find("kvs")
                        : nullptr;
  if (kvs != nullptr && !kvs->items.empty()) {
    const std::string held = base64_decode(kvs->items[0].get("value"));
    (void)std::from_chars(held.data(), held.data() + held.size(), ns_lease_);
    (void)request("/v3/lease/revoke", concat("{\"ID\":\"", mine, "\"}"), deadline, calls_, at_);
  }
}

DDP_INLINE std::string EtcdStoreConnection::encode(const std::vector<LeaseRecord>& records) {
  std::string out;
  ByteWriter w(out);
  w.put(static_cast<std::uint32_t>(records.size()));
  for (const LeaseRecord& r : records) {
    w.put(static_cast<std::uint8_t>(r.is_add ? 1 : 0));
    w.str(r.key);
    w.str(r.value);
    w.put(r.add);
  }
  return out;
}

DDP_INLINE std::vector<LeaseRecord> EtcdStoreConnection::decode(const std::string& bytes) {
  std::vector<LeaseRecord> out;
  ByteReader r(bytes, "store records");
  const auto n = std::min<std::uint32_t>(r.get<std::uint32_t>(), 64);
  for (std::uint32_t i = 0; i < n; ++i) {
    LeaseRecord rec;
    rec.is_add = r.get<std::uint8_t>() != 0;
    rec.key = r.str(4096);
    rec.value = r.str(bytes.size());
    rec.add = r.get<std::int64_t>();
    out.push_back(std::move(rec));
  }
  return out;
}

DDP_INLINE void EtcdStoreConnection::apply(const std::vector<LeaseRecord>& records, bool adds,
                                           Deadline deadline, Clients& clients, std::size_t& at) {
  for (const LeaseRecord& rec : records) {
    const std::string key = user(rec.key);
    if (!rec.is_add) {
      (void)request("/v3/kv/txn",
                    concat("{\"compare\":[{\"key\":", k64(key),
                           ",\"target\":\"CREATE\",\"create_revision\":\"0\"}],\"success\":[",
                           put_op(key, rec.value, ns_lease_), "]}"),
                    deadline, clients, at);
      continue;
    }
    if (!adds) continue;
    for (int tries = 0; tries < 16; ++tries) {  // a counter others may move meanwhile
      const Json r =
          json(request("/v3/kv/range", concat("{\"key\":", k64(key), "}"), deadline, clients, at));
      const Json* kvs = r.find("kvs");
      std::int64_t value = 0;
      std::string compare =
          concat("{\"key\":", k64(key), ",\"target\":\"CREATE\",\"create_revision\":\"0\"}");
      if (kvs != nullptr && !kvs->items.empty()) {
        const std::string held = base64_decode(kvs->items[0].get("value"));
        if (held.size() == 8) {
          ByteReader br(held, "counter");
          value = br.get<std::int64_t>();
        }
        compare = concat("{\"key\":", k64(key), ",\"target\":\"MOD\",\"mod_revision\":\"",
                         kvs->items[0].get("mod_revision"), "\"}");
      }
      std::string enc;
      ByteWriter(enc).put(value + rec.add);
      if (json(request("/v3/kv/txn",
                       concat("{\"compare\":[", compare, "],\"success\":[",
                              put_op(key, enc, ns_lease_), "]}"),
                       deadline, clients, at))
              .find("succeeded") != nullptr)
        break;
    }
  }
}

DDP_INLINE std::shared_ptr<StoreConnection> connect_etcd(std::string_view url,
                                                         std::string_view from,
                                                         const std::string& ns, StoreOptions so) {
  EtcdAddress a = EtcdAddress::parse(url, from);
  if (a.ns.empty()) a.ns = ns;
  if (a.ns.empty())
    fail(Errc::invalid_argument, from, "=\"", url,
         "\" names no namespace and no launcher gives a run id: give one for this run "
         "(etcd://HOST:PORT/NAME), the same on every rank and new for each run");
  return std::make_shared<EtcdStoreConnection>(std::move(a), std::move(so));
}

}  // namespace detail
DDP_END_NAMESPACE
