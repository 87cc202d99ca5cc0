// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::EtcdStoreConnection: the rendezvous store in an etcd cluster (v3 API through its
/// HTTP/JSON gateway, etcd 3.4+), so that no process of the job is a single point of failure:
/// etcd replicates every write on a majority of its members (Raft), and a call that finds one
/// member dead, stopped or cut off goes on with the next. Selected with DDP_STORE or
/// Options::store = "etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE]".
///
/// Under the namespace root R = "/ddp/<namespace>/":
///  * the job's keys are R "k/" key; every key is attached to the namespace's lease (R "ns"),
///    which each process keeps alive: the keys of a job that has ended (every process gone)
///    vanish a minute later, so a namespace can be used again;
///  * each process holds a lease of its own (its heartbeat: StoreOptions::lease_ttl), with
///    R "proc/<lease>" attached to it. What ddp's own store does when a connection closes or
///    falls silent (Store::set_on_close, Store::lease) is kept as records in R "close/<lease>"
///    and R "expire/<lease>"; every process sweeps them after each sign of life, and applies
///    those of a lease that ran out (the process died, or stopped signing), then removes them.
///    A process that ends normally applies its own close records and revokes its lease.
/// Counters (add) are compare-and-swapped, marked with the request's number: a request retried
/// after a lost answer is not applied twice. Waits poll (1 ms doubling to 32 ms). Plain HTTP.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/http.hpp"
#include "ddp/detail/json.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/store/connection.hpp"
#include "ddp/store/etcd_address.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// A rendezvous store in etcd (see the file comment).
class EtcdStoreConnection final : public StoreConnection {
 public:
  /// Connects to the cluster and joins namespace `ns` (its lease made, or kept alive), within
  /// options.timeout.
  EtcdStoreConnection(EtcdAddress address, StoreOptions o);
  DDP_INLINE ~EtcdStoreConnection() override;

  DDP_INLINE void set(const StoreCall& c, const std::string& key, std::string_view value) override;

  DDP_INLINE std::string get(const StoreCall& c, const std::string& key,
                             std::chrono::milliseconds timeout, const std::string& stop) override;

  DDP_INLINE bool wait(const StoreCall& c, std::span<const std::string> keys,
                       std::chrono::milliseconds timeout, const std::string& stop,
                       bool report_timeout) override;

  DDP_INLINE std::int64_t add(const StoreCall& c, const std::string& key,
                              std::int64_t delta) override;

  DDP_INLINE std::string compare_set(const StoreCall& c, const std::string& key,
                                     std::string_view expected, std::string_view desired) override;

  DDP_INLINE bool erase(const StoreCall& c, const std::string& key) override;

  DDP_INLINE bool check(const StoreCall& c, std::span<const std::string> keys) override;

  DDP_INLINE void set_on_close(const StoreCall& c,
                               std::span<const std::pair<std::string, std::string>> keys) override;

  DDP_INLINE void lease(const StoreCall& c, std::chrono::milliseconds,
                        std::span<const LeaseRecord> on_expire) override;

  [[nodiscard]] bool lost() override { return false; }  // every call tries every member
  /// The process's lease is signed from the start (the rendezvous may outlast it).
  void adopted() override { start_heartbeat(options.lease_ttl); }
  [[nodiscard]] DDP_INLINE std::string where() const override;
  [[nodiscard]] const std::string& host() const noexcept override {
    return address_.endpoints.front().first;
  }
  [[nodiscard]] int port() const noexcept override { return address_.endpoints.front().second; }
  [[nodiscard]] DDP_INLINE std::string local_address() override;

 protected:
  /// The process's lease and the namespace's, on the heartbeat's own connections.
  DDP_INLINE void keepalive() override;

  /// Applies the records of the leases that ran out (the processes that died or stopped).
  DDP_INLINE void on_beat() override;

 private:
  using Clients = std::vector<HttpClient>;

  [[nodiscard]] std::string user(const std::string& key) const { return concat(root_, "k/", key); }
  static std::string k64(std::string_view key) { return concat("\"", base64_encode(key), "\""); }
  static std::string put_op(const std::string& key, std::string_view value, std::int64_t lease);
  static std::string range_op(const std::string& key) {
    return concat("{\"request_range\":{\"key\":", k64(key), "}}");
  }
  static Json json(const std::string& text) { return parse_json(text); }

  /// A request's deadline: `timeout`, within the view's deadline and a moment after it (a
  /// request begun just before it ends is given its chance to answer, as ddp's own store's).
  static Deadline deadline_of(const StoreCall& c, std::chrono::milliseconds timeout);

  /// POSTs to one member after another (from the last that answered) until one answers, each
  /// given a few seconds, all of them until `deadline`; etcd's own errors (no leader yet, a
  /// member that lost the majority) count as no answer. The reply's body.
  std::string request(std::string_view path, const std::string& body, Deadline deadline,
                      Clients& clients, std::size_t& at, const StoreCall* c = nullptr);

  /// The value (and modification revision) of `key`, or none.
  std::pair<std::optional<std::string>, std::string> range_one(const std::string& key,
                                                               Deadline deadline);

  /// Every key under `prefix` (keys only, or with values), from the heartbeat's connections.
  std::vector<Json> prefix_range(const std::string& prefix, bool keys_only, Deadline deadline);

  /// How many of `keys` exist (user keys), and whether `stop` does (its value in `stopped`);
  /// the first key's value in `value`, when asked. One transaction.
  std::size_t present(std::span<const std::string> keys, const std::string& stop, Deadline deadline,
                      std::string* value, std::optional<std::string>* stopped = nullptr,
                      const StoreCall* c = nullptr);

  /// Waits (polling) until every key exists; false at the timeout. A stop key throws.
  bool await_keys(const StoreCall& c, std::span<const std::string> keys,
                  std::chrono::milliseconds timeout, const std::string& stop, std::string* value);

  void put_raw(const std::string& key, std::string_view value, std::int64_t lease,
               Deadline deadline, Clients& clients, std::size_t& at);

  std::int64_t grant(std::int64_t ttl, Deadline deadline, Clients& clients, std::size_t& at);

  /// The namespace's lease: made by the first process to come, kept alive by every process.
  void join_namespace(Deadline deadline);

  static std::string encode(const std::vector<LeaseRecord>& records);
  static std::vector<LeaseRecord> decode(const std::string& bytes);

  /// Applies records (user keys): set when absent; add (expiry records only) to a counter.
  void apply(const std::vector<LeaseRecord>& records, bool adds, Deadline deadline,
             Clients& clients, std::size_t& at);

  EtcdAddress address_;
  std::string root_;
  Clients calls_, beats_;             // the calls' connections, and the heartbeat's
  std::size_t at_ = 0, beat_at_ = 0;  // the member each last reached
  std::int64_t lease_ = 0, ns_lease_ = 0;
  std::uint64_t ops_ = 0;
  bool committed_ = true;             // the last request's answer arrived
  bool reached_ = false;              // a member answered once
  Clock::time_point created_;         // since when the endpoints are tried
  std::vector<LeaseRecord> closing_;  // this process's close records
};

/// A Store connection to the etcd cluster of `url` ("etcd://..."; `from` names where it came
/// from, for errors), in namespace `ns` when the URL names none.
DDP_INLINE std::shared_ptr<StoreConnection> connect_etcd(std::string_view url,
                                                         std::string_view from,
                                                         const std::string& ns, StoreOptions so);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/etcd.ipp"
#endif
