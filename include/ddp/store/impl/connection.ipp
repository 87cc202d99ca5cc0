// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/connection.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void fail_stopped(const StoreCall& c, std::string_view stop, const std::string& value) {
  if (auto e = decode_stop(value)) DDP_THROW(std::move(*e));
  fail(Errc::aborted, "store ", c.what, "(\"", c.prefix, c.key, "\"): stopped by \"", stop,
       "\": ", value);
}

DDP_INLINE void fail_missing(const StoreCall& c, std::chrono::milliseconds timeout,
                             const std::vector<std::string>& missing) {
  std::string names;
  for (std::size_t i = 0; i < missing.size() && i < 16; ++i)
    names += concat(i ? ", \"" : "\"", missing[i], "\"");
  if (missing.size() > 16) names += concat(" and ", missing.size() - 16, " more");
  fail(Errc::timeout, "store ", c.what, ": timed out after ", timeout.count(), " ms waiting for ",
       names);
}

DDP_INLINE StoreConnection::StoreConnection(StoreOptions o) : options(std::move(o)) {}

DDP_INLINE void StoreConnection::start_heartbeat(std::chrono::milliseconds ttl) {
  {
    std::lock_guard lock(beat_->mutex);
    beat_->period = ttl / 5;
  }
  beat_->wake.notify_all();
  if (heartbeat_.joinable() || ttl.count() <= 0) return;
  heartbeat_ = std::thread([b = beat_, w = self] { beating(b, w); });
}

DDP_INLINE std::uint64_t StoreConnection::add_tick(std::function<void()> tick) {
  std::lock_guard lock(tick_mutex_);
  ticks_.emplace(++next_tick_, std::move(tick));
  return next_tick_;
}

DDP_INLINE void StoreConnection::remove_tick(std::uint64_t id) {
  std::lock_guard lock(tick_mutex_);
  ticks_.erase(id);
}

DDP_INLINE std::unique_lock<std::mutex> StoreConnection::lock_for(const StoreCall& c) {
  std::unique_lock lock(mutex_, std::defer_lock);
  if (!c.soft)
    lock.lock();
  else if (!lock.try_lock())
    fail(Errc::timeout, "store ", c.what, ": the connection is busy with another call");
  return lock;
}

DDP_INLINE void StoreConnection::stop_heartbeat() noexcept {
  if (!heartbeat_.joinable()) return;
  {
    std::lock_guard lock(beat_->mutex);
    beat_->stop = true;
  }
  beat_->wake.notify_all();
  // A fork() child's copy has no such thread; the thread itself may drop the last reference.
  if (fork_generation() != made_in_ || heartbeat_.get_id() == std::this_thread::get_id())
    heartbeat_.detach();
  else
    heartbeat_.join();
}

DDP_INLINE void StoreConnection::beating(const std::shared_ptr<Beat>& b,
                                         const std::weak_ptr<StoreConnection>& w) {
  for (;;) {
    {
      std::unique_lock lock(b->mutex);
      if (b->period.count() <= 0)
        b->wake.wait(lock, [&] { return b->stop || b->period.count() > 0; });
      if (b->stop || b->wake.wait_for(lock, b->period, [&] { return b->stop; })) return;
    }
    std::shared_ptr<StoreConnection> me = w.lock();
    if (!me) return;
    try {
      me->keepalive();
      me->on_beat();
    } catch (...) {  // the next call finds out what is wrong
    }
    std::lock_guard lock(me->tick_mutex_);
    for (auto& [id, tick] : me->ticks_) {
      try {
        tick();
      } catch (...) {  // a tick's failure is its own business; the next beat tries again
      }
    }
  }  // `me` dropped last: should it hold the last reference, the destructor detaches this thread
}

}  // namespace detail
DDP_END_NAMESPACE
