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
///  * Fault tolerance with ULFM (Open MPI 5 under `mpirun --with-ft ulfm`, MPICH): a rank's
///    death is Errc::peer_lost on every survivor (the communicator is revoked); shrink() is
///    MPIX_Comm_shrink + MPIX_Comm_agree (mpi_support.hpp). Without it a death ends the job and
///    shrink() is refused.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/backend.hpp"
#include "ddp/backend/collective.hpp"
#include "ddp/backend/mpi_support.hpp"
#include "ddp/backend/uneven.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/membership/monitored_barrier.hpp"
#include "ddp/types.hpp"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

DDP_BEGIN_NAMESPACE

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

  /// Communicator::all_to_all with split sizes: the ranks' plans agreed (MPI_Allgather, see
  /// backend/uneven.hpp), then MPI_Alltoallv.
  void all_to_all_v(const detail::Buf& in, const detail::Buf& out,
                    std::span<const std::size_t> in_counts,
                    std::span<const std::size_t> out_counts) {
    (void)agree(detail::UnevenPlan::all_to_all(in_counts, out_counts), "all_to_all", in.dtype);
    const auto sc = ints(in_counts, "all_to_all"), rc = ints(out_counts, "all_to_all");
    const auto sd = offsets(sc), rd = offsets(rc);
    call(
        [&] {
          return MPI_Alltoallv(in.data, sc.data(), sd.data(), type(in.dtype), out.data, rc.data(),
                               rd.data(), type(in.dtype), comm_);
        },
        "all_to_all", "MPI_Alltoallv", in, std::nullopt, -1);
  }
  /// Communicator::all_gather (root < 0) and gather with a count per rank: MPI_Allgatherv and
  /// MPI_Gatherv, after the plans agreed.
  void gather_v(const detail::Buf& in, const detail::Buf& out, std::span<const std::size_t> counts,
                int root) {
    const char* what = root < 0 ? "all_gather" : "gather";
    const auto agreed =
        agree(detail::UnevenPlan::gather(size_, rank_, in.count, counts, root), what, in.dtype);
    const auto p = static_cast<std::size_t>(size_),
               to = static_cast<std::size_t>(std::max(root, 0));
    std::vector<std::size_t> all(p);  // what each rank sends (to the root)
    for (std::size_t j = 0; j < p; ++j) all[j] = agreed[j * p + to];
    const auto rc = ints(all, what);
    const auto rd = offsets(rc);
    const int n = count(in, what);
    call(
        [&] {
          return root < 0 ? MPI_Allgatherv(in.data, n, type(in.dtype), out.data, rc.data(),
                                           rd.data(), type(in.dtype), comm_)
                          : MPI_Gatherv(in.data, n, type(in.dtype), out.data, rc.data(), rd.data(),
                                        type(in.dtype), root, comm_);
        },
        what, root < 0 ? "MPI_Allgatherv" : "MPI_Gatherv", in, std::nullopt, root);
  }
  /// Communicator::scatter with a count per rank: MPI_Scatterv, after the plans agreed.
  void scatter_v(const detail::Buf& in, const detail::Buf& out, std::span<const std::size_t> counts,
                 int root) {
    const auto agreed = agree(detail::UnevenPlan::scatter(size_, rank_, out.count, counts, root),
                              "scatter", out.dtype);
    const auto p = static_cast<std::size_t>(size_);
    const auto sc =
        ints(std::span(agreed).subspan(static_cast<std::size_t>(root) * p, p), "scatter");
    const auto sd = offsets(sc);
    const int n = count(out, "scatter");
    call(
        [&] {
          return MPI_Scatterv(in.data, sc.data(), sd.data(), type(out.dtype), out.data, n,
                              type(out.dtype), root, comm_);
        },
        "scatter", "MPI_Scatterv", out, std::nullopt, root);
  }

  /// Communicator::monitored_barrier: every rank sends rank 0 a token; rank 0 waits up to
  /// `timeout` for them, then tells every rank which did not arrive (a tag per call, so that a
  /// token that comes too late never counts for a later call).
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    const char* what = "monitored_barrier";
    before(what);
    const int tag = 1000 + static_cast<int>(monitored_++ % 30000);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<int> missing(static_cast<std::size_t>(size_), 0);
    std::vector<MPI_Request> reqs;
    if (rank_ == 0) {
      std::vector<int> tokens(static_cast<std::size_t>(size_));
      for (int r = 1; r < size_; ++r) {
        reqs.push_back(MPI_REQUEST_NULL);
        check_call(MPI_Irecv(&tokens[static_cast<std::size_t>(r)], 1, MPI_INT, r, tag, comm_,
                             &reqs.back()),
                   what, "MPI_Irecv");
      }
      for (bool all = reqs.empty(); !all;) {
        int done = 0;
        check_call(
            MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE),
            what, "MPI_Testall");
        all = done != 0;
        if (!all && std::chrono::steady_clock::now() > deadline) break;
        if (!all) std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      for (int r = 1; r < size_; ++r) {
        MPI_Request& q = reqs[static_cast<std::size_t>(r - 1)];
        if (q == MPI_REQUEST_NULL) continue;
        missing[static_cast<std::size_t>(r)] = 1;
        MPI_Cancel(&q);
        MPI_Request_free(&q);
      }
      for (int r = 1; r < size_; ++r)  // small: sent eagerly, also to the late ones
        check_call(MPI_Send(missing.data(), size_, MPI_INT, r, tag, comm_), what, "MPI_Send");
    } else {
      int token = 1;
      check_call(MPI_Send(&token, 1, MPI_INT, 0, tag, comm_), what, "MPI_Send");
      MPI_Request req = MPI_REQUEST_NULL;
      check_call(MPI_Irecv(missing.data(), size_, MPI_INT, 0, tag, comm_, &req), what, "MPI_Irecv");
      const auto saved = options_.timeout;
      options_.timeout = 2 * timeout;  // rank 0 waits `timeout` from its own arrival
      try {
        wait(req, what, 0);
      } catch (...) {
        options_.timeout = saved;
        throw;
      }
      options_.timeout = saved;
    }
    std::vector<int> late;
    for (int r = 0; r < size_; ++r)
      if (missing[static_cast<std::size_t>(r)] != 0) late.push_back(r);
    if (!late.empty())
      DDP_THROW(detail::missed_barrier(rank_, what, late, timeout, wait_all_ranks));
  }

  /// Communicator::barrier with MPI_Ibarrier, waited on up to Options::timeout.
  void barrier() {
    MPI_Request req = MPI_REQUEST_NULL;
    check_call(MPI_Ibarrier(comm_, &req), "barrier", "MPI_Ibarrier");
    wait(req, "barrier", -1);
  }

  /// Communicator::send: a header (tag, dtype, count), then `b`, with MPI_Isend.
  void send(const detail::Buf& b, int peer, int tag) {
    const Header h{static_cast<std::int64_t>(tag), static_cast<std::int64_t>(b.dtype),
                   static_cast<std::int64_t>(b.count)};
    MPI_Request req = MPI_REQUEST_NULL;
    check_call(MPI_Isend(&h, sizeof h, MPI_BYTE, peer, p2p_tag, comm_, &req), "send", "MPI_Isend");
    wait(req, "send", peer);
    for_chunks(b, [&](std::byte* p, int n) {
      check_call(MPI_Isend(p, n, type(b.dtype), peer, p2p_tag, comm_, &req), "send", "MPI_Isend");
      wait(req, "send", peer);
    });
  }

  /// Communicator::recv: checks the sender's header against `b` and `tag`, then receives.
  void recv(const detail::Buf& b, int peer, int tag) {
    Header h{};
    MPI_Request req = MPI_REQUEST_NULL;
    check_call(MPI_Irecv(&h, sizeof h, MPI_BYTE, peer, p2p_tag, comm_, &req), "recv", "MPI_Irecv");
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
      check_call(MPI_Irecv(p, n, type(b.dtype), peer, p2p_tag, comm_, &req), "recv", "MPI_Irecv");
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
  [[nodiscard]] std::unique_ptr<Mpi> split(int color, int key, const Options& options) {
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split",
          rank_);
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::unique_ptr<Mpi>(new Mpi(sub, options));
  }

  /// Whether this job can recover from a lost rank: the library has ULFM and the job was
  /// started with it enabled (Open MPI 5: `mpirun --with-ft ulfm`; the MPI_FT attribute).
  [[nodiscard]] static bool fault_tolerant() noexcept { return detail::mpi_fault_tolerant(); }

  /// Communicator::shrink: the survivors' communicator (MPIX_Comm_shrink, then MPIX_Comm_agree,
  /// again while a rank dies meanwhile), ranked in the order of their ranks here; `previous`
  /// gets each new rank's rank here. Every live rank must call it: it runs under the watchdog
  /// (the job ends past Options::timeout). Errc::unsupported without ULFM.
  [[nodiscard]] std::unique_ptr<Mpi> shrink(std::vector<int>& previous) {
    MPI_Comm sub = detail::mpi_shrink(comm_, rank_, watchdog_.get());
    previous = detail::mpi_translate(sub, comm_);
    return std::unique_ptr<Mpi>(new Mpi(sub, options_));
  }

 private:
  struct Header {
    std::int64_t tag, dtype, count;
  };
  static constexpr int p2p_tag = 7;
  std::uint64_t monitored_ = 0;                                   // monitored_barrier calls so far
  static constexpr std::size_t max_chunk = std::size_t{1} << 30;  // elements per MPI call

  Mpi(MPI_Comm comm, const Options& options) : comm_(comm), options_(options) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    detail::mpi_survive_broken_pipes();
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

  /// check() for a call on this communicator; with ULFM, a rank's death is Errc::peer_lost
  /// (detail::mpi_check_lost).
  void check_call(int rc, const char* what, const char* call) {
    if (rc == MPI_SUCCESS) return;
    detail::mpi_check_lost(rc, comm_, rank_, what, call);
    check(rc, call, rank_);
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

  /// Every rank's plan of an uneven collective, shared with MPI_Allgather and checked pair by
  /// pair (detail::agreed_sizes): the agreed sends[src * size() + dst].
  std::vector<std::uint64_t> agree(const detail::UnevenPlan& plan, const char* what, DType t) {
    std::vector<std::uint64_t> row = plan.row();
    std::vector<std::uint64_t> rows(row.size() * static_cast<std::size_t>(size_));
    const detail::Buf b{reinterpret_cast<std::byte*>(row.data()), row.size(), DType::uint64};
    call(
        [&] {
          return MPI_Allgather(row.data(), static_cast<int>(row.size()), MPI_UINT64_T, rows.data(),
                               static_cast<int>(row.size()), MPI_UINT64_T, comm_);
        },
        what, "MPI_Allgather", b, std::nullopt, -1);
    return detail::agreed_sizes(rows, static_cast<std::size_t>(size_), rank_,
                                detail::concat(what, "(", to_string(t), ", counts per rank)"),
                                [](int j) { return j; });
  }
  /// Counts as MPI's ints (each, and their sum, within INT_MAX), or Errc::invalid_argument.
  template <class C>
  [[nodiscard]] std::vector<int> ints(const C& counts, const char* what) const {
    std::vector<int> v;
    std::size_t total = 0;
    for (const auto n : counts) {
      total += static_cast<std::size_t>(n);
      if (total > static_cast<std::size_t>(INT_MAX)) {
        detail::fail(Errc::invalid_argument, "rank ", rank_, ": ", what, ": ", total,
                     " elements exceed what one MPI call can carry (", INT_MAX,
                     "); split the buffer");
      }
      v.push_back(static_cast<int>(n));
    }
    return v;
  }
  [[nodiscard]] static std::vector<int> offsets(const std::vector<int>& counts) {
    std::vector<int> at(counts.size());
    for (std::size_t j = 1; j < counts.size(); ++j) at[j] = at[j - 1] + counts[j - 1];
    return at;
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
    check_call(rc, what, mpi_call);
  }

  /// Polls a request up to the timeout.
  void wait(MPI_Request& req, const char* what, int peer) {
    before(what);
    const auto start = std::chrono::steady_clock::now();
    int spins = 0;
    for (;;) {
      int done = 0;
      check_call(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what, "MPI_Test");
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
