// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/work.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void WorkState::finish(std::exception_ptr e) {
  {
    std::lock_guard lock(mutex);
    done = true;
    error = std::move(e);
  }
  cv.notify_all();
}

DDP_INLINE void WorkState::wait() {
  std::unique_lock lock(mutex);
  cv.wait(lock, [&] { return done; });
  if (error) std::rethrow_exception(error);
}

DDP_INLINE Executor::~Executor() {
  {
    std::lock_guard lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

DDP_INLINE Executor::Release::Release(Executor& owner) noexcept : e(owner) {}

DDP_INLINE Executor::Release::~Release() {
  // Someone queued meanwhile: the worker waits for this bit to clear.
  if (e.state_.fetch_sub(inline_bit, std::memory_order_release) != inline_bit)
    e.state_.notify_all();
}

DDP_INLINE void Executor::loop() {
  std::unique_lock lock(queue_mutex_);
  for (;;) {
    queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and drained
    auto [f, state] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    for (;;) {  // an operation issued before this one may still run inline
      const std::uint32_t v = state_.load(std::memory_order_acquire);
      if ((v & inline_bit) == 0) break;
      state_.wait(v, std::memory_order_acquire);
    }
    std::exception_ptr error;
    try {
      f();
    } catch (...) {
      error = std::current_exception();
    }
    state_.fetch_sub(queued_unit, std::memory_order_release);
    state->finish(error);
    lock.lock();
  }
}
}  // namespace detail
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE

DDP_INLINE Work::Work(std::shared_ptr<detail::WorkState> s) : state_(std::move(s)) {}

DDP_INLINE bool Work::test() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

DDP_INLINE bool Work::failed() const {
  if (!state_) return false;
  std::lock_guard lock(state_->mutex);
  return state_->done && state_->error != nullptr;
}

DDP_END_NAMESPACE
