// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What backend::Mpi (backend/mpi.hpp) is built on: MPI's error strings, the MPI datatypes and
/// operations ddp defines for float16 and bfloat16 (MpiTypes), and the watchdog that ends a job
/// whose blocking MPI collective outlives Options::timeout (MpiWatchdog).

#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/runtime/collective.hpp"
#include "ddp/types.hpp"

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

[[nodiscard]] inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return concat("MPI error ", code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// float16 and bfloat16 reductions for MPI, computed in float and rounded per step.
template <class T, ReduceOp Op>
void mpi_small_float_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    float r = 0;
    if constexpr (Op == ReduceOp::prod)
      r = x * y;
    else if constexpr (Op == ReduceOp::min)
      r = x < y ? x : y;
    else if constexpr (Op == ReduceOp::max)
      r = y < x ? x : y;
    else
      r = x + y;
    b[i] = T(r);
  }
}

/// The MPI datatypes and operations ddp needs beyond the predefined ones; made once per process.
class MpiTypes {
 public:
  static MpiTypes& get() {
    static MpiTypes types;
    return types;
  }

  [[nodiscard]] MPI_Datatype type(DType t) const noexcept {
    switch (t) {
      case DType::int8: return MPI_INT8_T;
      case DType::uint8: return MPI_UINT8_T;
      case DType::int16: return MPI_INT16_T;
      case DType::uint16: return MPI_UINT16_T;
      case DType::int32: return MPI_INT32_T;
      case DType::uint32: return MPI_UINT32_T;
      case DType::int64: return MPI_INT64_T;
      case DType::uint64: return MPI_UINT64_T;
      case DType::float16: return half_;
      case DType::bfloat16: return bfloat16_;
      case DType::float32: return MPI_FLOAT;
      case DType::float64: return MPI_DOUBLE;
    }
    return MPI_DATATYPE_NULL;
  }

  /// avg maps to sum (the backend divides afterwards).
  [[nodiscard]] MPI_Op op(ReduceOp op, DType t) const noexcept {
    const int k = op == ReduceOp::prod ? 1 : op == ReduceOp::min ? 2 : op == ReduceOp::max ? 3 : 0;
    if (t == DType::float16) return half_ops_[k];
    if (t == DType::bfloat16) return bfloat16_ops_[k];
    static const MPI_Op builtin[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};
    return builtin[k];
  }

 private:
  MpiTypes() {
    MPI_Type_contiguous(2, MPI_BYTE, &half_);
    MPI_Type_commit(&half_);
    MPI_Type_contiguous(2, MPI_BYTE, &bfloat16_);
    MPI_Type_commit(&bfloat16_);
    make_ops<half>(half_ops_);
    make_ops<bfloat16>(bfloat16_ops_);
  }
  template <class T>
  static void make_ops(MPI_Op (&ops)[4]) {
    MPI_Op_create(&mpi_small_float_op<T, ReduceOp::sum>, 1, &ops[0]);
    MPI_Op_create(&mpi_small_float_op<T, ReduceOp::prod>, 1, &ops[1]);
    MPI_Op_create(&mpi_small_float_op<T, ReduceOp::min>, 1, &ops[2]);
    MPI_Op_create(&mpi_small_float_op<T, ReduceOp::max>, 1, &ops[3]);
  }

  MPI_Datatype half_ = MPI_DATATYPE_NULL;
  MPI_Datatype bfloat16_ = MPI_DATATYPE_NULL;
  MPI_Op half_ops_[4] = {};
  MPI_Op bfloat16_ops_[4] = {};
};

/// What a blocking MPI call is doing, for the watchdog's message.
struct MpiCall {
  const char* what = "";
  DType dtype = DType::uint8;
  std::size_t count = 0;
  int root = -1;
  bool has_op = false;
  ReduceOp op = ReduceOp::sum;
};

/// Ends the job when a blocking MPI call outlives the timeout (it cannot be interrupted). Arming
/// costs a plain atomic store (no lock, no clock read, no wake-up): the thread looks every
/// timeout/10 (10 ms to 1 s) and fires when the same call has been running for the timeout
/// (between timeout and timeout + one period after it started).
class MpiWatchdog {
 public:
  MpiWatchdog(int rank, std::chrono::milliseconds timeout)
      : rank_(rank),
        timeout_(timeout),
        period_(std::clamp<std::chrono::milliseconds>(timeout / 10, std::chrono::milliseconds(10),
                                                      std::chrono::seconds(1))),
        thread_([this] { loop(); }) {}
  MpiWatchdog(const MpiWatchdog&) = delete;
  MpiWatchdog& operator=(const MpiWatchdog&) = delete;
  ~MpiWatchdog() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Called only by the thread running the operation (operations are serialized): plain stores.
  void arm(const MpiCall& call) noexcept {
    call_ = call;
    serial_.store(serial_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  void disarm() noexcept {
    serial_.store(serial_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    std::uint64_t seen = 0;  // the running call (odd serial) seen at `since`
    auto since = std::chrono::steady_clock::now();
    while (!cv_.wait_for(lock, period_, [&] { return stopping_; })) {
      const std::uint64_t s = serial_.load(std::memory_order_acquire);
      const auto now = std::chrono::steady_clock::now();
      if ((s & 1U) == 0 || s != seen) {  // idle, or another call than last time
        seen = s;
        since = now;
        continue;
      }
      if (now - since + period_ < timeout_) continue;  // it started at most a period before
      std::string d = concat("rank ", rank_, ": backend::Mpi: ", call_.what, "(",
                             to_string(call_.dtype), ", count=", call_.count);
      if (call_.has_op) d += concat(", op=", to_string(call_.op));
      if (call_.root >= 0) d += concat(", root=", call_.root);
      std::fprintf(stderr,
                   "ddp: %s) did not complete within %lld ms (Errc::timeout): a peer stopped, "
                   "died or called another collective; MPI collectives cannot be interrupted, "
                   "so the job is ended with MPI_Abort\n",
                   d.c_str(), static_cast<long long>(timeout_.count()));
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 124);
      std::_Exit(124);
    }
  }

  int rank_;
  std::chrono::milliseconds timeout_, period_;
  MpiCall call_;
  std::atomic<std::uint64_t> serial_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace detail

DDP_END_NAMESPACE
