// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// backend::Nccl: ddp's collectives on NCCL, for buffers in CUDA device memory (link the
/// `ddp::nccl` target, which defines DDP_HAS_CUDA=1 and DDP_HAS_NCCL=1).
///
///  * Start: the device is bound explicitly before anything else (Options::device, else the
///    local rank); rank 0 makes the ncclUniqueId and shares it through the rendezvous Store;
///    the communicator is created non-blocking (ncclCommInitRankConfig, config.blocking = 0), so
///    that initialization too honours Options::timeout.
///  * Streams: user kernels and collectives never race, whichever stream either runs on. When a
///    collective's buffers share one stream, it is enqueued on that stream (ordered by the
///    stream itself, no extra CUDA calls); otherwise on the communicator's own stream, ordered
///    after the work queued on every buffer's stream (event record + cudaStreamWaitEvent), with
///    those streams ordered after it. One collective is in flight at a time (each call waits for
///    its work), so NCCL's kernels never run on two streams at once.
///  * Completion and timeouts: a call returns when its work has finished on the GPU (async calls
///    on the Communicator's worker thread); while waiting it polls the completion event and
///    ncclCommGetAsyncError, and past Options::timeout, or on an asynchronous NCCL error, or on
///    abort(), it calls ncclCommAbort and raises Errc::timeout, Errc::peer_lost (ncclRemoteError)
///    or Errc::backend.
///  * gather, scatter and all_to_all are grouped ncclSend/ncclRecv; send/recv carry a small
///    header, so the receiver checks the tag, dtype and count as on every backend.
///  * Types: half -> ncclFloat16, bfloat16 -> ncclBfloat16, bool -> ncclUint8, ReduceOp::avg ->
///    ncclAvg, premul_sum -> ncclRedOpCreatePreMulSum (bitwise ops refused). Host
///    buffers: a host-typed one (std::vector, ...) does not compile with this backend; a view on
///    the host, or on another device, is refused with Errc::invalid_argument.
///  * Membership changes (shrink, grow, join) as on backend::Host: agreed through the store,
///    then a new NCCL communicator, the old one aborted (not ncclCommShrink, which needs the
///    failed communicator intact: this backend aborts one at its first error).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/backend.hpp"
#include "ddp/backend/collective.hpp"
#include "ddp/backend/nccl_support.hpp"
#include "ddp/backend/uneven.hpp"
#include "ddp/cuda.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/store/client.hpp"
#include "ddp/types.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace backend {

/// The backend on NCCL, for buffers in CUDA device memory: one CUDA device per rank, every call
/// waits for its work on the GPU (see the file comment).
class Nccl {
 public:
  static constexpr std::string_view name = "nccl";  ///< The backend's name, in messages.
  /// Buffers must be CUDA device memory; host-typed buffers are rejected at compile time.
  static constexpr DeviceKind device_kind = DeviceKind::cuda;

  /// Binds the CUDA device (Options::device, else the local rank), shares rank 0's
  /// ncclUniqueId through the store and creates the NCCL communicator within Options::timeout.
  [[nodiscard]] static std::unique_ptr<Nccl> create(const detail::BackendInit& init) {
    const int device = init.options.device >= 0 ? init.options.device : init.local_rank;
    const int devices = cuda_device_count();
    if (device >= devices) {
      detail::fail(Errc::invalid_argument, "rank ", init.rank, ": backend::Nccl: CUDA device ",
                   device, " does not exist (this process sees ", devices,
                   " device(s)); set Options::device, or run at most that many ranks per host");
    }
    DDP_CUDA_CHECK(cudaSetDevice(device));
    auto b = std::unique_ptr<Nccl>(new Nccl(init, device));
    b->connect(init);
    return b;
  }

  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;
  ~Nccl() {
    if (comm_ == nullptr) return;
    if (aborted_.load()) {  // replaced (shrink, grow) or failed: nothing to flush
      abort_comm();
      return;
    }
    const detail::CudaDeviceScope scope(device_);
    // Flush and free; a communicator that cannot finish in time is aborted instead.
    ncclResult_t st = ncclCommFinalize(comm_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((st == ncclSuccess || st == ncclInProgress) &&
           ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st == ncclInProgress &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    if (st == ncclSuccess)
      (void)ncclCommDestroy(comm_);
    else
      (void)ncclCommAbort(comm_);
  }

  /// This process's rank, 0 .. size()-1.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of ranks.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// This process's rank among the ranks on this host.
  [[nodiscard]] int local_rank() const noexcept { return local_rank_; }
  /// The number of ranks on this host.
  [[nodiscard]] int local_size() const noexcept { return local_size_; }
  /// The lowest rank on this host (names the host in split()).
  [[nodiscard]] int local_leader() const noexcept { return local_leader_; }
  /// The CUDA device this communicator's ranks use here.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The communicator's own stream.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }
  /// The NCCL communicator (owned by this backend).
  [[nodiscard]] ncclComm_t comm() const noexcept { return comm_; }
  /// CUDA device memory only.
  [[nodiscard]] static bool supports(const Device& device) noexcept { return device.is_cuda(); }

  /// Communicator::all_reduce with ncclAllReduce (in place); `factor`: premul_sum's.
  void all_reduce(const detail::Buf& b, ReduceOp op, double factor = 1) {
    reducible(b, "all_reduce");
    const detail::NcclRedOp o(op, b.dtype, factor, comm_, rank_);
    run("all_reduce", {&b},
        [&] { return ncclAllReduce(b.data, b.data, b.count, type(b), o.get(), comm_, on()); });
  }

  /// Several all_reduces in one NCCL group: one launch, one wait (Communicator::
  /// all_reduce_coalesced; the GradientAverager's buckets).
  void all_reduce_many(std::span<const detail::Buf> bufs, ReduceOp op, double factor = 1) {
    std::vector<const detail::Buf*> ptrs;
    std::vector<detail::NcclRedOp> ops;  // alive until the group has ended
    for (const auto& b : bufs) {
      reducible(b, "all_reduce_coalesced");
      ptrs.push_back(&b);
      ops.emplace_back(op, b.dtype, factor, comm_, rank_);
    }
    run_on("all_reduce_coalesced", ptrs, [&] {
      return grouped([&]() -> ncclResult_t {
        for (std::size_t i = 0; i < bufs.size(); ++i) {
          const auto& b = bufs[i];
          const auto rc =
              ncclAllReduce(b.data, b.data, b.count, type(b), ops[i].get(), comm_, on());
          if (rc != ncclSuccess && rc != ncclInProgress) return rc;
        }
        return ncclSuccess;
      });
    });
  }

  /// Communicator::broadcast with ncclBroadcast.
  void broadcast(const detail::Buf& b, int root) {
    run("broadcast", {&b}, [&] {
      return ncclBroadcast(b.data, b.data, b.count, detail::nccl_type(b.dtype), root, comm_, on());
    });
  }

  /// Communicator::reduce with ncclReduce.
  void reduce(const detail::Buf& b, int root, ReduceOp op, double factor = 1) {
    reducible(b, "reduce");
    const detail::NcclRedOp o(op, b.dtype, factor, comm_, rank_);
    run("reduce", {&b},
        [&] { return ncclReduce(b.data, b.data, b.count, type(b), o.get(), root, comm_, on()); });
  }

  /// Communicator::all_gather with ncclAllGather.
  void all_gather(const detail::Buf& in, const detail::Buf& out) {
    run("all_gather", {&in, &out}, [&] {
      return ncclAllGather(in.data, out.data, in.count, detail::nccl_type(in.dtype), comm_, on());
    });
  }

  /// Communicator::gather: grouped ncclSend to root, ncclRecv on root (exchange).
  void gather(const detail::Buf& in, const detail::Buf& out, int root) {
    const std::size_t n = in.count;
    exchange(
        "gather", in, out,
        [&](int r) {
          return r == root ? Part{in.data, n} : Part{};
        },
        [&](int r) {
          return rank_ == root ? Part{out.at(n * static_cast<std::size_t>(r)), n} : Part{};
        });
  }

  /// Communicator::scatter: grouped ncclSend from root, ncclRecv elsewhere (exchange).
  void scatter(const detail::Buf& in, const detail::Buf& out, int root) {
    const std::size_t n = out.count;
    exchange(
        "scatter", in, out,
        [&](int r) {
          return rank_ == root ? Part{in.at(n * static_cast<std::size_t>(r)), n} : Part{};
        },
        [&](int r) {
          return r == root ? Part{out.data, n} : Part{};
        });
  }

  /// Communicator::reduce_scatter with ncclReduceScatter.
  void reduce_scatter(const detail::Buf& in, const detail::Buf& out, ReduceOp op,
                      double factor = 1) {
    reducible(out, "reduce_scatter");
    const detail::NcclRedOp o(op, out.dtype, factor, comm_, rank_);
    run("reduce_scatter", {&in, &out}, [&] {
      return ncclReduceScatter(in.data, out.data, out.count, type(out), o.get(), comm_, on());
    });
  }

  /// Communicator::all_to_all: a grouped ncclSend and ncclRecv with every rank (exchange).
  void all_to_all(const detail::Buf& in, const detail::Buf& out) {
    const std::size_t n = in.count / static_cast<std::size_t>(size_);
    exchange(
        "all_to_all", in, out,
        [&](int r) {
          return Part{in.at(n * static_cast<std::size_t>(r)), n};
        },
        [&](int r) {
          return Part{out.at(n * static_cast<std::size_t>(r)), n};
        });
  }

  /// Communicator::all_to_all with split sizes: the plans agreed (agree), then exchange.
  void all_to_all_v(const detail::Buf& in, const detail::Buf& out,
                    std::span<const std::size_t> in_counts,
                    std::span<const std::size_t> out_counts) {
    (void)detail::nccl_agree(*this, detail::UnevenPlan::all_to_all(in_counts, out_counts),
                             "all_to_all", in.dtype);
    const auto sd = detail::block_offsets(in_counts), rd = detail::block_offsets(out_counts);
    const auto u = [](int r) { return static_cast<std::size_t>(r); };
    exchange(
        "all_to_all", in, out,
        [&](int r) {
          return Part{in.at(sd[u(r)]), in_counts[u(r)]};
        },
        [&](int r) {
          return Part{out.at(rd[u(r)]), out_counts[u(r)]};
        });
  }
  /// Communicator::all_gather (root < 0) and gather with a count per rank: exchange (all_gather
  /// sends this rank's block to every rank).
  void gather_v(const detail::Buf& in, const detail::Buf& out, std::span<const std::size_t> counts,
                int root) {
    const char* what = root < 0 ? "all_gather" : "gather";
    (void)detail::nccl_agree(
        *this, detail::UnevenPlan::gather(size_, rank_, in.count, counts, root), what, in.dtype);
    const bool receives = root < 0 || rank_ == root;
    const auto rd = receives ? detail::block_offsets(counts) : std::vector<std::size_t>{};
    const auto u = [](int r) { return static_cast<std::size_t>(r); };
    exchange(
        what, in, out,
        [&](int r) {
          return root < 0 || r == root ? Part{in.data, in.count} : Part{};
        },
        [&](int r) {
          return receives ? Part{out.at(rd[u(r)]), counts[u(r)]} : Part{};
        });
  }
  /// Communicator::scatter with a count per rank: exchange, after the plans agreed.
  void scatter_v(const detail::Buf& in, const detail::Buf& out, std::span<const std::size_t> counts,
                 int root) {
    (void)detail::nccl_agree(*this,
                             detail::UnevenPlan::scatter(size_, rank_, out.count, counts, root),
                             "scatter", out.dtype);
    const auto sd = rank_ == root ? detail::block_offsets(counts) : std::vector<std::size_t>{};
    const auto u = [](int r) { return static_cast<std::size_t>(r); };
    exchange(
        "scatter", in, out,
        [&](int r) {
          return rank_ == root ? Part{in.at(sd[u(r)]), counts[u(r)]} : Part{};
        },
        [&](int r) {
          return r == root ? Part{out.data, out.count} : Part{};
        });
  }

  /// Communicator::barrier: an ncclAllReduce of one value, waited on.
  void barrier() {
    const detail::Buf b{reinterpret_cast<std::byte*>(scratch_.data()), 1, DType::int64,
                        Device::cuda(device_), stream()};
    run("barrier", {&b},
        [&] { return ncclAllReduce(b.data, b.data, 1, ncclInt64, ncclSum, comm_, on()); });
  }

  /// Communicator::send: a header (tag, dtype, count), then `b`, with ncclSend.
  void send(const detail::Buf& b, int peer, int tag) {
    header_[0] = tag;
    header_[1] = static_cast<std::int64_t>(b.dtype);
    header_[2] = static_cast<std::int64_t>(b.count);
    DDP_CUDA_CHECK(cudaMemcpyAsync(scratch_.data(), header_.data(), 3 * sizeof(std::int64_t),
                                   cudaMemcpyHostToDevice, stream()));
    const detail::Buf h{reinterpret_cast<std::byte*>(scratch_.data()), 3, DType::int64,
                        Device::cuda(device_), stream()};
    run("send", {&h}, [&] { return ncclSend(h.data, 3, ncclInt64, peer, comm_, on()); });
    if (b.count == 0) return;
    run("send", {&b}, [&] { return ncclSend(b.data, b.count, type(b), peer, comm_, on()); });
  }

  /// Communicator::recv: checks the sender's header against `b` and `tag`, then ncclRecv.
  void recv(const detail::Buf& b, int peer, int tag) {
    const detail::Buf h{reinterpret_cast<std::byte*>(scratch_.data()), 3, DType::int64,
                        Device::cuda(device_), stream()};
    run("recv", {&h}, [&] { return ncclRecv(h.data, 3, ncclInt64, peer, comm_, on()); });
    DDP_CUDA_CHECK(cudaMemcpy(header_.data(), scratch_.data(), 3 * sizeof(std::int64_t),
                              cudaMemcpyDeviceToHost));
    if (header_[0] != tag || header_[1] != static_cast<std::int64_t>(b.dtype) ||
        header_[2] != static_cast<std::int64_t>(b.count)) {
      const auto dt = static_cast<DType>(header_[1]);
      detail::fail(Errc::mismatch, "rank ", rank_, ": recv from rank ", peer, ": expected tag ",
                   tag, ", ", to_string(b.dtype), " x ", b.count, " but rank ", peer, " sent tag ",
                   header_[0], ", ", is_valid(dt) ? to_string(dt) : "invalid dtype", " x ",
                   header_[2], "; make the matching send and recv agree");
    }
    if (b.count == 0) return;
    run("recv", {&b}, [&] { return ncclRecv(b.data, b.count, type(b), peer, comm_, on()); });
  }

  /// ncclCommSplit: ranks passing the same color form a communicator, ordered by (key, rank);
  /// nullptr for color < 0. Collective over this communicator.
  [[nodiscard]] std::unique_ptr<Nccl> split(int color, int key, const Options& options) {
    // Every rank's (color, key), to know the members of each group and which share a host.
    CudaBuffer<std::int64_t> all(2 * static_cast<std::size_t>(size_), device_, stream());
    const std::int64_t mine[2] = {color, key};
    const std::size_t at = 2 * static_cast<std::size_t>(rank_);
    DDP_CUDA_CHECK(
        cudaMemcpyAsync(all.data() + at, mine, sizeof mine, cudaMemcpyHostToDevice, stream()));
    all_gather({reinterpret_cast<std::byte*>(all.data() + at), 2, DType::int64,
                Device::cuda(device_), stream()},
               {reinterpret_cast<std::byte*>(all.data()), all.size(), DType::int64,
                Device::cuda(device_), stream()});
    std::vector<std::int64_t> ck(all.size());
    all.copy_to(ck);
    std::vector<int> members;  // parent ranks of my group, in (key, rank) order
    for (int r = 0; r < size_; ++r) {
      if (color >= 0 && ck[2 * static_cast<std::size_t>(r)] == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return ck[2 * static_cast<std::size_t>(a) + 1] < ck[2 * static_cast<std::size_t>(b) + 1];
    });

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t made = nullptr;
    const CudaDeviceGuard g(device_);
    const auto start = std::chrono::steady_clock::now();
    const auto rc =
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &made, &config);
    if (rc != ncclSuccess && rc != ncclInProgress)
      give_up("split", detail::nccl_errc(rc), ncclGetErrorString(rc));
    // Non-blocking: the split runs as a job of the parent, which must return to ncclSuccess
    // before the parent is used again; only then is the child's handle written.
    settle("split (ncclCommSplit)", start);
    if (color < 0) {
      if (made != nullptr) (void)ncclCommDestroy(made);
      return nullptr;
    }
    if (made == nullptr) {
      detail::fail(Errc::backend, "rank ", rank_, ": backend::Nccl: split: ncclCommSplit gave no ",
                   "communicator for color ", color, last_error());
    }
    auto sub = std::unique_ptr<Nccl>(new Nccl(rank_, size_, device_, options.timeout));
    sub->comm_ = made;
    sub->size_ = static_cast<int>(members.size());
    sub->rank_ =
        static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    for (const int r : members) sub->hosts_.push_back(hosts_[static_cast<std::size_t>(r)]);
    sub->find_local();
    sub->settle("split (ncclCommSplit)", start);
    return sub;
  }

  /// Fails the operation in progress (its wait sees the flag and calls ncclCommAbort) and every
  /// later one. Thread-safe.
  void abort(Errc code, const std::string& why) {
    std::lock_guard lock(abort_mutex_);
    if (!aborted_.load()) {
      abort_code_ = code;
      abort_why_ = why;
      aborted_.store(true);
    }
  }

  /// backend_traits::refuses_some: NCCL reduces no 16-bit integers (detail::nccl_refuses).
  static const char* refuses(std::string_view what, DType t) noexcept {
    return detail::nccl_refuses(what, t);
  }
  /// backend_traits::refuses_ops: NCCL has no bitwise reductions (detail::nccl_refuses_op).
  static const char* refuses(ReduceOp op, DType t) noexcept {
    return detail::nccl_refuses_op(op, t);
  }

 private:
  Nccl(const detail::BackendInit& init, int device)
      : Nccl(init.rank, init.size, device, init.options.timeout) {}
  Nccl(int rank, int size, int device, std::chrono::milliseconds timeout)
      : rank_(rank),
        size_(size),
        device_(device),
        timeout_(timeout),
        stream_(device),
        scratch_(3, device) {}

  void connect(const detail::BackendInit& init) {
    ncclUniqueId id{};
    local_rank_ = 0;
    local_size_ = 1;
    local_leader_ = rank_;
    if (size_ > 1) {
      auto& store = *init.store;
      store.set(detail::concat("nccl/host/", rank_), detail::host_identity());
      if (rank_ == 0) {
        check(ncclGetUniqueId(&id), "ncclGetUniqueId");
        store.set("nccl/id", std::string_view(reinterpret_cast<const char*>(&id), sizeof id));
      } else {
        const std::string bytes = store.get("nccl/id");
        if (bytes.size() != sizeof id) {
          detail::fail(Errc::protocol, "rank ", rank_,
                       ": backend::Nccl: the ncclUniqueId in the "
                       "store has ",
                       bytes.size(), " bytes, expected ", sizeof id);
        }
        std::memcpy(&id, bytes.data(), sizeof id);
      }
      for (int r = 0; r < size_; ++r) hosts_.push_back(store.get(detail::concat("nccl/host/", r)));
      find_local();
    } else {
      hosts_.push_back(detail::host_identity());
      check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const CudaDeviceGuard g(device_);
    const auto rc = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      comm_ = nullptr;
      check(rc, "ncclCommInitRankConfig");
    }
    settle("ncclCommInitRankConfig", std::chrono::steady_clock::now());
  }

  /// local_rank/local_size/local_leader from the host of every rank.
  void find_local() {
    local_rank_ = 0;
    local_size_ = 0;
    local_leader_ = -1;
    for (int r = 0; r < size_; ++r) {
      if (hosts_[static_cast<std::size_t>(r)] != hosts_[static_cast<std::size_t>(rank_)]) continue;
      if (local_leader_ < 0) local_leader_ = r;
      if (r < rank_) ++local_rank_;
      ++local_size_;
    }
  }

  void check(ncclResult_t rc, const char* call) const {
    if (rc != ncclSuccess && rc != ncclInProgress) {
      detail::fail(detail::nccl_errc(rc), "rank ", rank_, ": backend::Nccl: ", call,
                   " failed: ", ncclGetErrorString(rc), last_error());
    }
  }

  [[nodiscard]] std::string last_error() const {
    const char* text = comm_ != nullptr ? ncclGetLastError(comm_) : nullptr;
    return text != nullptr && *text != '\0' ? detail::concat(" (", text, ")") : std::string();
  }

  void reducible(const detail::Buf& b, const char* what) const {
    if (const char* why = refuses(what, b.dtype))
      detail::fail(Errc::invalid_argument, "rank ", rank_, ": backend::Nccl: ", what, "(",
                   to_string(b.dtype), "): ", why);
  }

  [[nodiscard]] static ncclDataType_t type(const detail::Buf& b) noexcept {
    return detail::nccl_type(b.dtype);
  }

  /// The stream the collective being enqueued goes on (set by run_on).
  [[nodiscard]] cudaStream_t on() const noexcept { return on_; }

  /// Device-to-device copy on the collective's stream (the local block of gather & co).
  void copy(std::byte* dst, const std::byte* src, std::size_t n) {
    if (n != 0 && dst != src)
      DDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, on()));
  }

  /// Where one block of an exchange lies, and its elements (0: none).
  struct Part {
    std::byte* data = nullptr;
    std::size_t count = 0;
  };
  /// One NCCL group: ncclSend of send(r) to each rank r, ncclRecv of recv(r) from it; this
  /// rank's own block copied on the device.
  template <class Send, class Recv>
  void exchange(const char* what, const detail::Buf& in, const detail::Buf& out, const Send& send,
                const Recv& recv) {
    const detail::Buf& typed = out.data != nullptr ? out : in;  // the one that is set
    run(what, {&in, &out}, [&] {
      return grouped([&]() -> ncclResult_t {
        for (int r = 0; r < size_; ++r) {
          const Part s = send(r), d = recv(r);
          if (r == rank_) {
            copy(d.data, s.data, s.count * typed.elem());
            continue;
          }
          ncclResult_t rc = ncclSuccess;
          if (s.count != 0) rc = ncclSend(s.data, s.count, type(typed), r, comm_, on());
          if ((rc == ncclSuccess || rc == ncclInProgress) && d.count != 0)
            rc = ncclRecv(d.data, d.count, type(typed), r, comm_, on());
          if (rc != ncclSuccess && rc != ncclInProgress) return rc;
        }
        return ncclSuccess;
      });
    });
  }

  template <class F>
  ncclResult_t grouped(F&& body) {
    check(ncclGroupStart(), "ncclGroupStart");
    const ncclResult_t rc = body();
    const ncclResult_t end = ncclGroupEnd();
    return rc != ncclSuccess && rc != ncclInProgress ? rc : end;
  }

  void fail_if_aborted(const char* what) {
    if (!aborted_.load()) return;
    abort_comm();
    std::lock_guard lock(abort_mutex_);
    detail::fail(abort_code_, "rank ", rank_, ": ", what, ": aborted: ", abort_why_);
  }

  /// Waits for a non-blocking NCCL call to leave ncclInProgress, up to the timeout.
  void settle(const char* what, std::chrono::steady_clock::time_point start) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      check(ncclCommGetAsyncError(comm_, &st), "ncclCommGetAsyncError");
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) give_up(what, detail::nccl_errc(st), ncclGetErrorString(st));
      poll_pause(what, start);
    }
  }

  void poll_pause(const char* what, std::chrono::steady_clock::time_point start) {
    fail_if_aborted(what);
    if (timeout_.count() > 0 && std::chrono::steady_clock::now() - start > timeout_) {
      give_up(what, Errc::timeout,
              detail::concat("did not complete within ", timeout_.count(),
                             " ms; a peer stopped, died or called another collective"));
    }
    std::this_thread::yield();
  }

  /// Aborts the NCCL communicator in the background (detail::NcclAborter); later calls fail.
  void abort_comm() {
    if (comm_ == nullptr) return;
    aborter_.abort({std::exchange(comm_, nullptr)}, {device_});
  }

  [[noreturn]] void give_up(const char* what, Errc code, const std::string& why) {
    const std::string detail_text = last_error();
    abort_comm();
    abort(code, detail::concat(what, " failed earlier"));
    detail::fail(code, "rank ", rank_, ": backend::Nccl: ", what, ": ", why, detail_text,
                 "; the NCCL communicator was aborted");
  }

  /// Orders the collective after its buffers' streams, enqueues it, orders the buffers' streams
  /// after it, and waits for it to finish (polling, under the timeout).
  template <class Enqueue>
  void run(const char* what, std::initializer_list<const detail::Buf*> bufs, Enqueue&& enqueue) {
    run_on(what, bufs, enqueue);
  }
  template <class Bufs, class Enqueue>
  void run_on(const char* what, const Bufs& bufs, Enqueue&& enqueue) {
    fail_if_aborted(what);
    for (const auto* b : bufs) {
      if (b->count != 0 && b->device.index != device_) {
        detail::fail(Errc::invalid_argument, "rank ", rank_, ": ", what, ": a buffer is on ",
                     to_string(b->device), " but this communicator uses cuda:", device_,
                     "; move the tensor or create the communicator with Options::device = ",
                     b->device.index);
      }
    }
    const CudaDeviceGuard g(device_);
    // The buffers' one stream, when they share one: the collective goes on it, ordered after
    // the work there and before later work by the stream itself (each call finishes before the
    // next is enqueued, so NCCL's kernels never run concurrently on two streams). Otherwise the
    // communicator's stream, ordered by events both ways.
    const std::optional<cudaStream_t> shared = detail::common_stream(bufs);
    on_ = shared.value_or(stream());
    if (!shared) {
      for (const auto* b : bufs) {
        ready_.record(static_cast<cudaStream_t>(b->stream));
        ready_.block(on_);
      }
    }
    const auto start = std::chrono::steady_clock::now();
    const ncclResult_t rc = enqueue();
    if (rc != ncclSuccess && rc != ncclInProgress)
      give_up(what, detail::nccl_errc(rc), ncclGetErrorString(rc));
    if (rc == ncclInProgress) settle(what, start);
    done_.record(on_);
    if (!shared) {
      for (const auto* b : bufs) done_.block(static_cast<cudaStream_t>(b->stream));
    }
    // Small collectives finish within microseconds: spin on the event first (a yield is a
    // system call, about as long as the collective), then poll the error state and yield.
    for (unsigned spins = 0;; ++spins) {
      if (done_.ready()) return;
      if (spins < 256) continue;
      ncclResult_t st = ncclSuccess;
      check(ncclCommGetAsyncError(comm_, &st), "ncclCommGetAsyncError");
      if (st != ncclSuccess && st != ncclInProgress)
        give_up(what, detail::nccl_errc(st), ncclGetErrorString(st));
      poll_pause(what, start);
    }
  }

  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, local_leader_ = 0;
  int device_ = 0;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  CudaStream stream_;
  cudaStream_t on_ = nullptr;  // the stream of the collective being enqueued (run_on)
  CudaEvent ready_, done_;
  CudaBuffer<std::int64_t> scratch_;  // barrier word and the p2p header
  std::vector<std::int64_t> header_ = std::vector<std::int64_t>(3);
  std::vector<std::string> hosts_;  // the host of every rank
  std::mutex abort_mutex_;
  std::atomic<bool> aborted_{false};
  Errc abort_code_ = Errc::aborted;
  std::string abort_why_;
  detail::NcclAborter aborter_;  // last: joined before the streams and buffers are freed
};

}  // namespace backend
DDP_END_NAMESPACE
