// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// backend::Mpi: ddp's collectives on an MPI library (link the `ddp::mpi` target, which defines
/// DDP_HAS_MPI=1).
///
///  * Start: adopts an MPI that the program initialized (it must provide at least
///    MPI_THREAD_SERIALIZED for async operations, which run on another thread), or calls
///    MPI_Init_thread itself and MPI_Finalize at exit. Each communicator works on its own
///    duplicate of MPI_COMM_WORLD (MPI_Comm_dup), so ddp's traffic never matches the program's;
///    split() is MPI_Comm_split. Rank and size are MPI's: run the program under mpirun or srun.
///  * Collectives map 1:1 onto MPI's blocking collectives (MPI_Allreduce, MPI_Bcast, ...), so
///    ddp costs a few nanoseconds over calling MPI directly. float16 and bfloat16 use MPI
///    operations defined here (computed in float); ReduceOp::avg is a sum divided by size().
///    The order in which MPI combines ranks is the library's: floating-point results may differ
///    in the last bits from backend::Host's rank-order reduction.
///  * send/recv carry a header, so the receiver checks the tag, dtype and count as on every
///    backend, and they wait with MPI_Test up to Options::timeout (Errc::timeout).
///  * Timeouts of collectives: a blocking MPI collective cannot be interrupted, so a watchdog
///    thread reports a collective that outlives Options::timeout on stderr (Errc::timeout, with
///    the rank, the collective and its arguments) and ends the job with MPI_Abort instead of
///    letting it hang.
///  * CUDA buffers: passed to MPI directly when the library says it is CUDA-aware
///    (MPIX_Query_cuda_support); otherwise the Communicator stages them through host memory.
///  * Errors: the communicator uses MPI_ERRORS_RETURN; a failing call raises Errc::backend with
///    the call's name and MPI_Error_string.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/backend.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/runtime/collective.hpp"
#include "ddp/types.hpp"

#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
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

namespace backend {

/// The backend on an MPI library: each collective is the matching blocking MPI call on a
/// duplicate of MPI_COMM_WORLD (see the file comment).
class Mpi {
 public:
  static constexpr std::string_view name = "mpi";  ///< The backend's name, in messages.
  /// Rank and size come from MPI, not from a rendezvous store.
  static constexpr bool needs_store = false;

  /// Initializes MPI if the program has not (MPI_THREAD_SERIALIZED; finalized at exit) and
  /// duplicates MPI_COMM_WORLD.
  [[nodiscard]] static std::unique_ptr<Mpi> create(const detail::BackendInit& init) {
    ensure_initialized();
    MPI_Comm world = MPI_COMM_NULL;
    check(MPI_Comm_dup(MPI_COMM_WORLD, &world), "MPI_Comm_dup", -1);
    auto b = std::unique_ptr<Mpi>(new Mpi(world, init.options));
    if (init.size > 1 && init.size != b->size_) {
      detail::fail(Errc::invalid_argument, "rank ", init.rank, ": backend::Mpi: the launcher says ",
                   "the world has ", init.size, " ranks but MPI_COMM_WORLD has ", b->size_,
                   "; start the program with mpirun (or srun --mpi=pmix) to use backend::Mpi");
    }
    return b;
  }

  Mpi(const Mpi&) = delete;
  Mpi& operator=(const Mpi&) = delete;
  ~Mpi() {
    watchdog_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized != 0) return;
    if (local_ != MPI_COMM_NULL) MPI_Comm_free(&local_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  /// This process's rank in MPI_COMM_WORLD (or in the split communicator).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of ranks.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// This process's rank among the ranks on this host.
  [[nodiscard]] int local_rank() const noexcept { return local_rank_; }
  /// The number of ranks on this host.
  [[nodiscard]] int local_size() const noexcept { return local_size_; }
  /// The lowest rank on this host (names the host in split()).
  [[nodiscard]] int local_leader() const noexcept { return local_leader_; }
  /// The MPI communicator ddp works on (a duplicate; do not free it).
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }

  /// Whether the MPI library accepts CUDA device pointers (Open MPI's MPIX_Query_cuda_support).
  [[nodiscard]] static bool cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
    return MPIX_Query_cuda_support() == 1;
#else
    return false;
#endif
  }
  /// Host memory always; CUDA memory when ddp is built with CUDA and MPI is cuda_aware().
  [[nodiscard]] static bool supports(const Device& device) noexcept {
    return device.is_cpu() || (DDP_HAS_CUDA && cuda_aware());
  }

  /// Communicator::all_reduce with MPI_Allreduce (in place).
  void all_reduce(const detail::Buf& b, ReduceOp op) {
    chunked(b, [&](std::byte* p, int n) {
      call(
          [&] {
            return MPI_Allreduce(MPI_IN_PLACE, p, n, type(b.dtype), mpi_op(op, b.dtype), comm_);
          },
          "all_reduce", "MPI_Allreduce", b, op, -1);
    });
    if (op == ReduceOp::avg) divide(b);
  }

  /// Communicator::broadcast with MPI_Bcast.
  void broadcast(const detail::Buf& b, int root) {
    chunked(b, [&](std::byte* p, int n) {
      call([&] { return MPI_Bcast(p, n, type(b.dtype), root, comm_); }, "broadcast", "MPI_Bcast", b,
           std::nullopt, root);
    });
  }

  /// Communicator::reduce with MPI_Reduce (in place on root).
  void reduce(const detail::Buf& b, int root, ReduceOp op) {
    chunked(b, [&](std::byte* p, int n) {
      call(
          [&] {
            return MPI_Reduce(rank_ == root ? MPI_IN_PLACE : p, p, n, type(b.dtype),
                              mpi_op(op, b.dtype), root, comm_);
          },
          "reduce", "MPI_Reduce", b, op, root);
    });
    if (op == ReduceOp::avg && rank_ == root) divide(b);
  }

  /// Communicator::all_gather with MPI_Allgather.
  void all_gather(const detail::Buf& in, const detail::Buf& out) {
    const int n = count(in, "all_gather");
    const bool in_place = in.count != 0 && in.data == out.at(in.count * unsigned_rank());
    call(
        [&] {
          return MPI_Allgather(in_place ? MPI_IN_PLACE : in.data, n, type(in.dtype), out.data, n,
                               type(in.dtype), comm_);
        },
        "all_gather", "MPI_Allgather", in, std::nullopt, -1);
  }

  /// Communicator::gather with MPI_Gather.
  void gather(const detail::Buf& in, const detail::Buf& out, int root) {
    const int n = count(in, "gather");
    const bool in_place =
        rank_ == root && in.count != 0 && in.data == out.at(in.count * unsigned_rank());
    call(
        [&] {
          return MPI_Gather(in_place ? MPI_IN_PLACE : in.data, n, type(in.dtype), out.data, n,
                            type(in.dtype), root, comm_);
        },
        "gather", "MPI_Gather", in, std::nullopt, root);
  }

  /// Communicator::scatter with MPI_Scatter.
  void scatter(const detail::Buf& in, const detail::Buf& out, int root) {
    const int n = count(out, "scatter");
    const bool in_place =
        rank_ == root && out.count != 0 && out.data == in.at(out.count * unsigned_rank());
    call(
        [&] {
          return MPI_Scatter(in.data, n, type(out.dtype), in_place ? MPI_IN_PLACE : out.data, n,
                             type(out.dtype), root, comm_);
        },
        "scatter", "MPI_Scatter", out, std::nullopt, root);
  }

  /// Communicator::reduce_scatter with MPI_Reduce_scatter_block.
  void reduce_scatter(const detail::Buf& in, const detail::Buf& out, ReduceOp op) {
    const int n = count(out, "reduce_scatter");
    // ddp's in-place form (out is this rank's block of in) is not MPI's (the result lands at the
    // start of the buffer): reduce into scratch, then copy.
    const bool overlapping = out.count != 0 && out.data == in.at(out.count * unsigned_rank());
    std::byte* dst = out.data;
    if (overlapping) {
      scratch_.resize(out.bytes());
      dst = scratch_.data();
    }
    call(
        [&] {
          return MPI_Reduce_scatter_block(in.data, dst, n, type(out.dtype), mpi_op(op, out.dtype),
                                          comm_);
        },
        "reduce_scatter", "MPI_Reduce_scatter_block", out, op, -1);
    if (overlapping) std::memcpy(out.data, dst, out.bytes());
    if (op == ReduceOp::avg) divide(out);
  }

  /// Communicator::all_to_all with MPI_Alltoall.
  void all_to_all(const detail::Buf& in, const detail::Buf& out) {
    detail::Buf block = in;
    block.count = in.count / static_cast<std::size_t>(size_);
    const int n = count(block, "all_to_all");
    call(
        [&] {
          return MPI_Alltoall(in.data, n, type(in.dtype), out.data, n, type(in.dtype), comm_);
        },
        "all_to_all", "MPI_Alltoall", block, std::nullopt, -1);
  }

  /// Communicator::barrier with MPI_Ibarrier, waited on up to Options::timeout.
  void barrier() {
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier", rank_);
    wait(req, "barrier", -1);
  }

  /// Communicator::send: a header (tag, dtype, count), then `b`, with MPI_Isend.
  void send(const detail::Buf& b, int peer, int tag) {
    const Header h{static_cast<std::int64_t>(tag), static_cast<std::int64_t>(b.dtype),
                   static_cast<std::int64_t>(b.count)};
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Isend(&h, sizeof h, MPI_BYTE, peer, p2p_tag, comm_, &req), "MPI_Isend", rank_);
    wait(req, "send", peer);
    for_chunks(b, [&](std::byte* p, int n) {
      check(MPI_Isend(p, n, type(b.dtype), peer, p2p_tag, comm_, &req), "MPI_Isend", rank_);
      wait(req, "send", peer);
    });
  }

  /// Communicator::recv: checks the sender's header against `b` and `tag`, then receives.
  void recv(const detail::Buf& b, int peer, int tag) {
    Header h{};
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Irecv(&h, sizeof h, MPI_BYTE, peer, p2p_tag, comm_, &req), "MPI_Irecv", rank_);
    wait(req, "recv", peer);
    if (h.tag != tag || h.dtype != static_cast<std::int64_t>(b.dtype) ||
        h.count != static_cast<std::int64_t>(b.count)) {
      const auto dt = static_cast<DType>(h.dtype);
      detail::fail(Errc::mismatch, "rank ", rank_, ": recv from rank ", peer, ": expected tag ",
                   tag, ", ", to_string(b.dtype), " x ", b.count, " but rank ", peer, " sent tag ",
                   h.tag, ", ", is_valid(dt) ? to_string(dt) : "invalid dtype", " x ", h.count,
                   "; make the matching send and recv agree");
    }
    for_chunks(b, [&](std::byte* p, int n) {
      check(MPI_Irecv(p, n, type(b.dtype), peer, p2p_tag, comm_, &req), "MPI_Irecv", rank_);
      wait(req, "recv", peer);
    });
  }

  /// Later operations fail at once (the Communicator poisons itself); a blocking MPI call in
  /// progress cannot be interrupted and ends at its timeout.
  void abort(Errc code, const std::string& why) {
    std::lock_guard lock(abort_mutex_);
    if (!aborted_.load()) {
      abort_code_ = code;
      abort_why_ = why;
      aborted_.store(true);
    }
  }

  /// MPI_Comm_split; nullptr for color < 0 (no group).
  [[nodiscard]] std::unique_ptr<Mpi> split(int color, int key) {
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split",
          rank_);
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::unique_ptr<Mpi>(new Mpi(sub, options_));
  }

 private:
  struct Header {
    std::int64_t tag, dtype, count;
  };
  static constexpr int p2p_tag = 7;
  static constexpr std::size_t max_chunk = std::size_t{1} << 30;  // elements per MPI call

  Mpi(MPI_Comm comm, const Options& options) : comm_(comm), options_(options) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local_),
          "MPI_Comm_split_type", rank_);
    MPI_Comm_rank(local_, &local_rank_);
    MPI_Comm_size(local_, &local_size_);
    MPI_Group local_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    MPI_Comm_group(local_, &local_group);
    MPI_Comm_group(comm_, &group);
    const int zero = 0;
    MPI_Group_translate_ranks(local_group, 1, &zero, group, &local_leader_);
    MPI_Group_free(&local_group);
    MPI_Group_free(&group);
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    serialized_ = level >= MPI_THREAD_SERIALIZED;
    owner_ = std::this_thread::get_id();
    if (options_.timeout.count() > 0)
      watchdog_ = std::make_unique<detail::MpiWatchdog>(rank_, options_.timeout);
  }

  static void ensure_initialized() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized != 0) return;
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) {
      detail::fail(Errc::backend,
                   "backend::Mpi: MPI_Init_thread failed: ", detail::mpi_error_string(rc));
    }
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalized == 0) MPI_Finalize();
    });
  }

  static void check(int rc, const char* call, int rank) {
    if (rc != MPI_SUCCESS) {
      detail::fail(Errc::backend, "rank ", rank, ": backend::Mpi: ", call,
                   " failed: ", detail::mpi_error_string(rc));
    }
  }

  [[nodiscard]] std::size_t unsigned_rank() const noexcept {
    return static_cast<std::size_t>(rank_);
  }
  [[nodiscard]] static MPI_Datatype type(DType t) { return detail::MpiTypes::get().type(t); }
  [[nodiscard]] static MPI_Op mpi_op(ReduceOp op, DType t) {
    return detail::MpiTypes::get().op(op, t);
  }

  /// Elements per rank as MPI's int, or Errc::invalid_argument beyond it.
  [[nodiscard]] int count(const detail::Buf& b, const char* what) const {
    if (b.count > static_cast<std::size_t>(INT_MAX)) {
      detail::fail(Errc::invalid_argument, "rank ", rank_, ": ", what, ": ", b.count,
                   " elements per rank exceed what one MPI call can carry (", INT_MAX,
                   "); split the buffer");
    }
    return static_cast<int>(b.count);
  }

  /// Element-wise collectives in calls of at most max_chunk elements (at least one call).
  template <class F>
  static void chunked(const detail::Buf& b, F&& f) {
    std::size_t s0 = 0;
    do {
      const std::size_t m = std::min(max_chunk, b.count - s0);
      f(b.at(s0), static_cast<int>(m));
      s0 += m;
    } while (s0 < b.count);
  }
  template <class F>
  static void for_chunks(const detail::Buf& b, F&& f) {
    for (std::size_t s0 = 0; s0 < b.count; s0 += max_chunk)
      f(b.at(s0), static_cast<int>(std::min(max_chunk, b.count - s0)));
  }

  void before(const char* what) {
    if (aborted_.load()) {
      std::lock_guard lock(abort_mutex_);
      detail::fail(abort_code_, "rank ", rank_, ": ", what, ": aborted: ", abort_why_);
    }
    if (!serialized_ && std::this_thread::get_id() != owner_) {
      detail::fail(Errc::unsupported, "rank ", rank_, ": ", what,
                   ": the program initialized MPI below MPI_THREAD_SERIALIZED, so ddp may call "
                   "MPI only from the thread that created the communicator (async operations "
                   "run on another); initialize MPI with MPI_Init_thread(..., "
                   "MPI_THREAD_SERIALIZED, ...) or let ddp initialize it");
    }
  }

  /// One blocking MPI collective under the watchdog.
  template <class F>
  void call(F&& f, const char* what, const char* mpi_call, const detail::Buf& b,
            std::optional<ReduceOp> op, int root) {
    before(what);
    if (watchdog_)
      watchdog_->arm({what, b.dtype, b.count, root, op.has_value(), op.value_or(ReduceOp::sum)});
    const int rc = f();
    if (watchdog_) watchdog_->disarm();
    check(rc, mpi_call, rank_);
  }

  /// Polls a request up to the timeout.
  void wait(MPI_Request& req, const char* what, int peer) {
    before(what);
    const auto start = std::chrono::steady_clock::now();
    int spins = 0;
    for (;;) {
      int done = 0;
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test", rank_);
      if (done != 0) return;
      if (aborted_.load()) before(what);
      if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (options_.timeout.count() > 0 &&
          std::chrono::steady_clock::now() - start > options_.timeout) {
        MPI_Cancel(&req);
        MPI_Request_free(&req);
        detail::fail(Errc::timeout, "rank ", rank_, ": backend::Mpi: ", what,
                     peer >= 0 ? detail::concat(" with rank ", peer) : std::string(),
                     " did not complete within ", options_.timeout.count(),
                     " ms; check that the peer makes the matching call");
      }
    }
  }

  void divide(const detail::Buf& b) const {
    const auto by = static_cast<double>(size_);
    const auto each = [&]<class T>(T*) {
      auto* p = reinterpret_cast<T*>(b.data);
      for (std::size_t i = 0; i < b.count; ++i)
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(by));
    };
    switch (b.dtype) {
      case DType::float16: each(static_cast<half*>(nullptr)); break;
      case DType::bfloat16: each(static_cast<bfloat16*>(nullptr)); break;
      case DType::float32: {
        auto* p = reinterpret_cast<float*>(b.data);
        const auto f = static_cast<float>(by);
        for (std::size_t i = 0; i < b.count; ++i) p[i] /= f;
        break;
      }
      case DType::float64: {
        auto* p = reinterpret_cast<double*>(b.data);
        for (std::size_t i = 0; i < b.count; ++i) p[i] /= by;
        break;
      }
      default: break;  // avg on integers is refused before this point
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm local_ = MPI_COMM_NULL;
  Options options_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, local_leader_ = 0;
  bool serialized_ = true;
  std::thread::id owner_;
  std::unique_ptr<detail::MpiWatchdog> watchdog_;
  std::vector<std::byte> scratch_;
  std::mutex abort_mutex_;
  std::atomic<bool> aborted_{false};
  Errc abort_code_ = Errc::aborted;
  std::string abort_why_;
};

}  // namespace backend
DDP_END_NAMESPACE
