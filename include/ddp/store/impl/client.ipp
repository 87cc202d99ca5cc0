// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/client.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>

DDP_BEGIN_NAMESPACE

DDP_INLINE Store::Store(std::string host, int port, StoreOptions options)
    : Store(std::make_shared<detail::TcpStoreConnection>(std::move(host), port,
                                                         std::move(options))) {}

DDP_INLINE Store::Store(std::shared_ptr<detail::StoreConnection> c) : conn_(std::move(c)) {
  if (conn_->self.expired()) {
    conn_->self = conn_;
    conn_->adopted();
  }
}

DDP_INLINE Store Store::prefixed(std::string_view prefix) const {
  Store s(*this);
  s.prefix_ += prefix;
  return s;
}

DDP_INLINE Store Store::watching(std::string_view key) const {
  Store s(*this);
  s.stop_ = full(key);
  return s;
}

DDP_INLINE Store Store::with_deadline(detail::Clock::time_point deadline) const {
  Store s(*this);
  s.deadline_ = deadline;
  return s;
}

DDP_INLINE Store Store::unwatched() const {
  Store s(*this);
  s.stop_.clear();
  return s;
}

DDP_INLINE Store Store::soft() const {
  Store s(*this);
  s.soft_ = true;
  return s;
}

DDP_INLINE std::string Store::stop_value(Errc code, std::string_view message) {
  std::string v;
  detail::ByteWriter w(v);
  w.put(static_cast<std::int32_t>(code));
  w.str(message);
  return v;
}

DDP_INLINE void Store::set_on_close(std::span<const std::pair<std::string, std::string>> keys) {
  std::vector<std::pair<std::string, std::string>> all;
  for (const auto& [k, v] : keys) all.emplace_back(full(k), v);
  conn_->set_on_close(call("set_on_close", keys.empty() ? std::string_view{} : keys.front().first),
                      all);
}

DDP_INLINE void Store::lease(std::chrono::milliseconds ttl,
                             std::span<const LeaseRecord> on_expire) {
  std::vector<LeaseRecord> all(on_expire.begin(), on_expire.end());
  for (LeaseRecord& r : all) r.key = full(r.key);
  conn_->lease(call("lease", on_expire.empty() ? std::string_view{} : on_expire.front().key), ttl,
               all);
  conn_->start_heartbeat(ttl);
}

DDP_INLINE std::uint64_t Store::add_tick(std::function<void(Store&)> tick) {
  std::weak_ptr<detail::StoreConnection> w = conn_;
  return conn_->add_tick([w, tick = std::move(tick)] {
    if (const auto c = w.lock()) {
      Store soft_view(c);
      soft_view.soft_ = true;
      tick(soft_view);
    }
  });
}

DDP_INLINE bool Store::check(std::span<const std::string> keys) {
  std::vector<std::string> all;
  for (const auto& k : keys) all.push_back(full(k));
  return conn_->check(call("check", {}), all);
}

DDP_INLINE std::vector<std::string> Store::missing_after(std::span<const std::string> keys,
                                                         std::chrono::milliseconds timeout) {
  if (wait_for(keys, timeout, true)) return {};
  std::vector<std::string> missing;
  for (const auto& k : keys) {
    if (!check(std::span<const std::string>(&k, 1))) missing.push_back(k);
  }
  return missing;
}

DDP_INLINE std::string Store::full(std::string_view key) const {
  return prefix_ + std::string(key);
}

DDP_INLINE bool Store::wait_for(std::span<const std::string> keys,
                                std::chrono::milliseconds timeout, bool report_timeout) {
  std::vector<std::string> all;
  for (const auto& k : keys) all.push_back(full(k));
  return conn_->wait(call("wait", keys.empty() ? std::string_view{} : std::string_view(keys[0])),
                     all, capped(timeout), stop_, report_timeout);
}

DDP_INLINE std::chrono::milliseconds Store::capped(std::chrono::milliseconds timeout) const {
  if (deadline_ == detail::Clock::time_point::max()) return timeout;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline_ - detail::Clock::now());
  return std::clamp(left, std::chrono::milliseconds(0), timeout);
}
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string peek_key(Store& s, const std::string& key) {
  const std::string k[] = {key};
  return s.check(k) ? s.get(key) : std::string();
}

}  // namespace detail
DDP_END_NAMESPACE
