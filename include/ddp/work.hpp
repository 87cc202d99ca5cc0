// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Asynchronous execution: ddp::Work (the handle an _async collective returns) and the executor
/// that runs a communicator's operations one at a time, in the order they were issued.
///
/// The synchronous path takes no lock: a call that finds the communicator idle claims it with
/// one compare-and-swap, runs in the calling thread and releases it with one atomic subtraction
/// (4 ns of the ~20 ns a Communicator call adds to a raw MPI_Allreduce: bench/README.md).
/// Anything issued while an operation runs goes through the queue, to a worker thread started on
/// first use, and a synchronous call that finds the queue busy waits for its turn there.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

DDP_BEGIN_NAMESPACE

namespace detail {

/// The completion state an asynchronous operation shares with its Work.
struct WorkState {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e);

  void wait();
};

/// Runs operations one at a time in issue order: inline when idle, else on a worker thread.
class Executor {
 public:
  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  ~Executor();

  /// Runs f(true) now, in this thread, when nothing else runs or waits. Otherwise queues f(false)
  /// behind everything issued before it, calling queued() as it joins the queue (see
  /// submit_recorded). Returns when f has run; rethrows what it threw.
  template <class F, class Q>
  void run(F&& f, Q&& queued) {
    std::uint32_t idle = 0;
    if (state_.compare_exchange_strong(idle, inline_bit, std::memory_order_acquire,
                                       std::memory_order_relaxed)) [[likely]] {
      const Release release{*this};
      f(true);
      return;
    }
    submit_recorded(queued, [&f](auto) {
      return std::function<void()>([&f] { f(false); });
    })->wait();
  }

  /// Queues make(record()) behind everything issued before it, calling record() (which numbers
  /// the operation, e.g. in the flight recorder) inside the queue's critical section: the numbers
  /// follow the queue's order, so an operation numbered k runs before any numbered after it.
  template <class R, class M>
  std::shared_ptr<WorkState> submit_recorded(R&& record, M&& make) {
    auto state = std::make_shared<WorkState>();
    {
      std::lock_guard lock(queue_mutex_);
      if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
      std::function<void()> f = make(record());
      state_.fetch_add(queued_unit, std::memory_order_relaxed);  // before a caller can go inline
      queue_.emplace_back(std::move(f), state);
    }
    queue_cv_.notify_one();
    return state;
  }

 private:
  // state_: bit 0 set while an operation runs inline in a caller's thread; the bits above count
  // the operations queued or running on the worker.
  static constexpr std::uint32_t inline_bit = 1;
  static constexpr std::uint32_t queued_unit = 2;

  struct Release {
    explicit Release(Executor& owner) noexcept;
    Executor& e;
    Release(const Release&) = delete;
    Release& operator=(const Release&) = delete;
    ~Release();
  };

  void loop();

  std::atomic<std::uint32_t> state_{0};
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<WorkState>>> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace detail

/// The handle of an asynchronous operation.
class Work {
 public:
  /// A Work that is already complete.
  Work() = default;
  /// Wraps the shared state an executor completes; what the _async collectives return.
  explicit Work(std::shared_ptr<detail::WorkState> s);

  /// Blocks until the operation has finished; rethrows its ddp::Error if it failed.
  void wait() const {
    if (state_) state_->wait();
  }

  /// Whether the operation has finished (successfully or not); never blocks, never throws.
  [[nodiscard]] bool test() const;

  /// Whether the operation finished and failed.
  [[nodiscard]] bool failed() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/work.ipp"
#endif
