// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What backend::Mpi (backend/mpi.hpp) is built on: MPI's error strings, the MPI datatypes and
/// operations ddp defines for float16 and bfloat16 (MpiTypes), the watchdog that ends a job
/// whose blocking MPI collective outlives Options::timeout (MpiWatchdog), and recovery from lost
/// ranks with ULFM where the library has it (mpi_shrink).

#include "ddp/backend/collective.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/types.hpp"

#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#if defined(MPIX_ERR_PROC_FAILED) && defined(MPIX_ERR_REVOKED)
#define DDP_MPI_ULFM 1  // the library declares ULFM's MPIX_Comm_shrink, _agree, _revoke
#else
#define DDP_MPI_ULFM 0
#endif

#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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
      case DType::uint8:
      case DType::boolean: return MPI_UINT8_T;
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

  /// avg maps to sum (the backend divides afterwards), premul_sum to sum (the communicator has
  /// multiplied the inputs), bool's operators to those on its 0/1 bytes.
  [[nodiscard]] MPI_Op op(ReduceOp op, DType t) const noexcept {
    if (t == DType::boolean) op = bool_as_byte(op);
    if (op == ReduceOp::band) return MPI_BAND;
    if (op == ReduceOp::bor) return MPI_BOR;
    if (op == ReduceOp::bxor) return MPI_BXOR;
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

/// Whether the library has ULFM and the job was started with it enabled (Open MPI 5:
/// `mpirun --with-ft ulfm`, seen in the MPI_FT attribute).
[[nodiscard]] inline bool mpi_fault_tolerant() noexcept {
#if DDP_MPI_ULFM && defined(MPIX_FT)
  int* on = nullptr;
  int flag = 0;
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPIX_FT, &on, &flag) != MPI_SUCCESS || flag == 0)
    return false;
  return on != nullptr && *on != 0;
#else
  return DDP_MPI_ULFM != 0;
#endif
}

/// With ULFM on, a survivor's write to a dead peer's TCP connection raises SIGPIPE inside the MPI
/// library, whose default action ends the survivor without a word; so SIGPIPE is ignored (the
/// write fails, the library reports the failure) unless the program installed its own handler.
inline void mpi_survive_broken_pipes() noexcept {
  if (!mpi_fault_tolerant()) return;
  struct sigaction now {};
  if (::sigaction(SIGPIPE, nullptr, &now) != 0 || now.sa_handler != SIG_DFL) return;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  (void)::sigaction(SIGPIPE, &ignore, nullptr);
}

/// The ranks in `comm` of `group`'s members, in the group's order.
[[nodiscard]] inline std::vector<int> mpi_ranks_in(MPI_Group group, MPI_Comm comm) {
  MPI_Group all = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &all);
  int n = 0;
  MPI_Group_size(group, &n);
  std::vector<int> in(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) in[static_cast<std::size_t>(i)] = i;
  MPI_Group_translate_ranks(group, n, in.data(), all, out.data());
  MPI_Group_free(&all);
  return out;
}

/// Each rank of `sub`'s rank in `parent`.
[[nodiscard]] inline std::vector<int> mpi_translate(MPI_Comm sub, MPI_Comm parent) {
  MPI_Group g = MPI_GROUP_NULL;
  MPI_Comm_group(sub, &g);
  std::vector<int> out = mpi_ranks_in(g, parent);
  MPI_Group_free(&g);
  return out;
}

/// A failed call `call` (of collective `what`) on `comm`: with ULFM, when a rank died (or
/// another survivor revoked `comm` after one), Errc::peer_lost naming the dead ranks, after
/// revoking `comm` so that every survivor learns it. Returns otherwise.
inline void mpi_check_lost(int rc, MPI_Comm comm, int rank, const char* what, const char* call) {
#if DDP_MPI_ULFM
  int cls = rc;
  MPI_Error_class(rc, &cls);
  if (cls != MPIX_ERR_PROC_FAILED && cls != MPIX_ERR_PROC_FAILED_PENDING && cls != MPIX_ERR_REVOKED)
    return;
  std::string dead;
  MPI_Group failed = MPI_GROUP_NULL;
  if (MPIX_Comm_get_failed(comm, &failed) == MPI_SUCCESS) {
    const std::vector<int> here = mpi_ranks_in(failed, comm);
    for (std::size_t i = 0; i < here.size(); ++i)
      dead += concat(i == 0 ? (here.size() == 1 ? "rank " : "ranks ") : ", ", here[i]);
    MPI_Group_free(&failed);
  }
  (void)MPIX_Comm_revoke(comm);
  if (dead.empty())
    fail(Errc::peer_lost, "rank ", rank, ": ", what,
         ": another rank revoked the communicator (it saw a rank die, or called shrink()) (", call,
         ": ", mpi_error_string(rc),
         "); every live rank calls shrink() to go on together, or restart the job");
  fail(Errc::peer_lost, "rank ", rank, ": ", what, ": ", dead, " died (", call, ": ",
       mpi_error_string(rc),
       "); the survivors call shrink() to go on without it, or restart "
       "the job");
#else
  (void)rc, (void)comm, (void)rank, (void)what, (void)call;
#endif
}

/// The survivors' communicator of `comm` (this process's rank `rank`): MPIX_Comm_shrink, then
/// MPIX_Comm_agree, again while a member dies meanwhile; ranked in their order in `comm`.
/// Armed under `watchdog` (when given): every live rank must call it.
/// Errc::unsupported without ULFM, saying what is missing.
[[nodiscard]] inline MPI_Comm mpi_shrink(MPI_Comm comm, int rank, MpiWatchdog* watchdog) {
#if DDP_MPI_ULFM
  struct Armed {  // the job ends past the timeout when a live rank does not call shrink()
    MpiWatchdog* w;
    ~Armed() {
      if (w != nullptr) w->disarm();
    }
  } armed{watchdog};
  if (watchdog != nullptr) watchdog->arm({"shrink"});
  if (!mpi_fault_tolerant())
    fail(Errc::unsupported, "rank ", rank,
         ": shrink: the MPI library has ULFM but this job was started without it; start it with "
         "`mpirun --with-ft ulfm` (Open MPI 5), without which a rank's death ends the job");
  MPI_Comm from = comm;
  for (int round = 0;; ++round) {
    (void)MPIX_Comm_revoke(from);  // every survivor leaves its pending calls on it
    MPI_Comm next = MPI_COMM_NULL;
    const int rc = MPIX_Comm_shrink(from, &next);
    if (from != comm) MPI_Comm_free(&from);
    if (rc != MPI_SUCCESS || next == MPI_COMM_NULL)
      fail(Errc::backend, "rank ", rank,
           ": shrink: MPIX_Comm_shrink failed: ", mpi_error_string(rc));
    MPI_Comm_set_errhandler(next, MPI_ERRORS_RETURN);
    int all_there = 1;
    if (MPIX_Comm_agree(next, &all_there) == MPI_SUCCESS) return next;
    if (round >= 64)  // each round needs another death: a bound only a broken library meets
      fail(Errc::backend, "rank ", rank,
           ": shrink: the survivors did not agree after 64 rounds of MPIX_Comm_shrink");
    from = next;  // a member died while agreeing: shrink again without it
  }
#else
  (void)comm, (void)watchdog;
  fail(Errc::unsupported, "rank ", rank,
       ": shrink: not available on backend::Mpi (it would need an MPI library with ULFM fault "
       "tolerance (MPIX_Comm_shrink), as Open MPI 5 and MPICH have; this program was compiled "
       "against one without it); for fault tolerance use backend::Host");
#endif
}

}  // namespace detail

DDP_END_NAMESPACE
