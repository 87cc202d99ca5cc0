// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Single-process multi-GPU: one process drives several CUDA devices through one NCCL clique
/// (ncclCommInitAll), the "one process, several cards" model of torch.nn.DataParallel done the
/// way NCCL does it: every device keeps its own replica and the replicas' gradients are averaged
/// with one all_reduce over the devices, instead of being gathered onto the first card.
///
///   ddp::NcclClique clique;                       // every visible device (or {0, 2, 3})
///   std::vector<ddp::CudaBuffer<float>> grads;    // grads[i] lives on clique.device(i)
///   clique.all_reduce(grads, ddp::ReduceOp::avg); // one NCCL group over all devices
///
/// Each collective takes one tensor per device, in the order of devices(); it checks that the
/// i-th tensor is on the i-th device and that dtypes and sizes agree, orders the work after each
/// tensor's stream and each tensor's stream after the work (events), launches every device's call
/// in one ncclGroupStart/End, and returns when all of it has finished, polling the events and
/// ncclCommGetAsyncError under the clique's timeout; past it, every communicator is aborted
/// (ncclCommAbort) and the call raises Errc::timeout. Link `ddp::nccl`.
///
/// A clique lives in one process: to combine several processes, each with several devices, use
/// Communicator<backend::Nccl> with one rank per device (ddprun --nproc-per-node = devices).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/backend/nccl_support.hpp"
#include "ddp/comm/call.hpp"
#include "ddp/cuda.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// A sized random-access range of tensors, one per device of a NcclClique.
template <class R>
concept TensorRange = std::ranges::random_access_range<R> && std::ranges::sized_range<R> &&
    TensorLike<std::ranges::range_reference_t<R>>;

/// One process driving several CUDA devices through one NCCL clique: each collective takes one
/// tensor per device, in the order of devices() (see the file comment).
class NcclClique {
 public:
  /// One NCCL communicator per device of `devices` (empty: every device this process sees),
  /// created together by ncclCommInitAll. A device may appear once.
  explicit NcclClique(std::vector<int> devices = {},
                      std::chrono::milliseconds timeout = std::chrono::minutes(5));

  NcclClique(const NcclClique&) = delete;
  NcclClique& operator=(const NcclClique&) = delete;
  ~NcclClique();

  /// The number of devices.
  [[nodiscard]] int size() const noexcept { return static_cast<int>(devices_.size()); }
  /// The CUDA devices of the clique, slot by slot.
  [[nodiscard]] const std::vector<int>& devices() const noexcept { return devices_; }
  /// The CUDA device of slot i.
  [[nodiscard]] int device(int i) const;
  /// The clique's own stream on slot i's device.
  [[nodiscard]] cudaStream_t stream(int i) const;
  /// Slot i's NCCL communicator (owned by the clique).
  [[nodiscard]] ncclComm_t comm(int i) const;

  /// tensors[i] = op over all tensors, on every device.
  template <TensorRange R>
  void all_reduce(R&& tensors, ReduceOp op = ReduceOp::sum) {
    const auto bs = bufs(tensors, "all_reduce", "tensors");
    same_shape(bs, "all_reduce");
    check_op(op, bs[0].dtype, "all_reduce");
    run("all_reduce", {&bs}, [&](std::size_t i, cudaStream_t s) {
      return ncclAllReduce(bs[i].data, bs[i].data, bs[i].count, detail::nccl_type(bs[i].dtype),
                           detail::nccl_op(op), comms_[i], s);
    });
  }

  /// Every tensor = tensors[root].
  template <TensorRange R>
  void broadcast(R&& tensors, int root = 0) {
    const auto bs = bufs(tensors, "broadcast", "tensors");
    same_shape(bs, "broadcast");
    check_root(root, "broadcast");
    run("broadcast", {&bs}, [&](std::size_t i, cudaStream_t s) {
      return ncclBroadcast(bs[i].data, bs[i].data, bs[i].count, detail::nccl_type(bs[i].dtype),
                           root, comms_[i], s);
    });
  }

  /// tensors[root] = op over all tensors; the others are left as they were.
  template <TensorRange R>
  void reduce(R&& tensors, int root = 0, ReduceOp op = ReduceOp::sum) {
    const auto bs = bufs(tensors, "reduce", "tensors");
    same_shape(bs, "reduce");
    check_root(root, "reduce");
    check_op(op, bs[0].dtype, "reduce");
    run("reduce", {&bs}, [&](std::size_t i, cudaStream_t s) {
      return ncclReduce(bs[i].data, bs[i].data, bs[i].count, detail::nccl_type(bs[i].dtype),
                        detail::nccl_op(op), root, comms_[i], s);
    });
  }

  /// out[j] = in[0] ++ in[1] ++ ... for every j: each out holds size() times in's elements.
  template <TensorRange In, TensorRange Out>
  void all_gather(In&& in, Out&& out) {
    const auto is = bufs(in, "all_gather", "in");
    const auto os = bufs(out, "all_gather", "out");
    same_shape(is, "all_gather");
    same_shape(os, "all_gather");
    paired(is, os, is[0].count * devices_.size(), "all_gather", "size() * in");
    run("all_gather", {&is, &os}, [&](std::size_t i, cudaStream_t s) {
      return ncclAllGather(is[i].data, os[i].data, is[i].count, detail::nccl_type(is[i].dtype),
                           comms_[i], s);
    });
  }

  /// out[j] = block j of (op over all in): each in holds size() times out's elements.
  template <TensorRange In, TensorRange Out>
  void reduce_scatter(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    const auto is = bufs(in, "reduce_scatter", "in");
    const auto os = bufs(out, "reduce_scatter", "out");
    same_shape(is, "reduce_scatter");
    same_shape(os, "reduce_scatter");
    check_op(op, is[0].dtype, "reduce_scatter");
    paired(os, is, os[0].count * devices_.size(), "reduce_scatter", "size() * out");
    run("reduce_scatter", {&is, &os}, [&](std::size_t i, cudaStream_t s) {
      return ncclReduceScatter(is[i].data, os[i].data, os[i].count, detail::nccl_type(os[i].dtype),
                               detail::nccl_op(op), comms_[i], s);
    });
  }

 private:
  struct Slot {
    explicit Slot(int device);
    CudaStream stream;
    CudaEvent ready, done;  // created with the slot's device current
  };

  template <class R>
  std::vector<detail::Buf> bufs(R& tensors, const char* what, const char* arg) const {
    if (comms_.empty()) {
      detail::fail(Errc::aborted, "NcclClique: ", what,
                   ": the clique was aborted by an earlier failure; make a new one");
    }
    const auto n = static_cast<std::size_t>(std::ranges::size(tensors));
    if (n != devices_.size()) {
      detail::fail(Errc::invalid_argument, "NcclClique: ", what, ": `", arg, "` has ", n,
                   " tensor(s) but the clique has ", devices_.size(),
                   " device(s); pass one tensor per device, in the order of devices()");
    }
    std::vector<detail::Buf> out;
    out.reserve(n);
    std::size_t i = 0;
    for (auto&& t : tensors) {
      const auto v = ddp::view(t);
      using E = typename decltype(v)::value_type;
      if (!v.device.is_cuda() || v.device.index != devices_[i]) {
        detail::fail(Errc::invalid_argument, "NcclClique: ", what, ": `", arg, "[", i, "]` is on ",
                     to_string(v.device), " but slot ", i, " of the clique is cuda:", devices_[i],
                     "; put the i-th tensor on device(i)");
      }
      if (v.data == nullptr && v.size != 0) {
        detail::fail(Errc::invalid_argument, "NcclClique: ", what, ": `", arg, "[", i, "]` has ",
                     v.size, " elements but no data");
      }
      out.push_back({reinterpret_cast<std::byte*>(const_cast<E*>(v.data)), v.size, dtype_of<E>,
                     v.device, v.stream});
      ++i;
    }
    return out;
  }

  static void same_shape(const std::vector<detail::Buf>& bs, const char* what);

  /// `big` must hold size() times `small`'s elements, of the same dtype.
  static void paired(const std::vector<detail::Buf>& small, const std::vector<detail::Buf>& big,
                     std::size_t want, const char* what, const char* rule);

  void check_op(ReduceOp op, DType t, const char* what) const {
    detail::check_op(op, t, "NcclClique", -1, what);
  }

  void check_root(int root, const char* what) const {
    detail::check_root(root, size(), "NcclClique", -1, what, "a slot of the clique");
  }

  /// Orders each slot's stream after its tensors' streams, launches enqueue(i, stream) for
  /// every slot in one NCCL group, orders the tensors' streams after it and waits.
  template <class Enqueue>
  void run(const char* what, std::initializer_list<const std::vector<detail::Buf>*> sets,
           const Enqueue& enqueue) {
    const std::size_t n = devices_.size();
    for (std::size_t i = 0; i < n; ++i) {
      const CudaDeviceGuard g(devices_[i]);
      for (const auto* set : sets) {
        slots_[i]->ready.record(static_cast<cudaStream_t>((*set)[i].stream));
        slots_[i]->ready.block(slots_[i]->stream.get());
      }
    }
    const auto start = std::chrono::steady_clock::now();
    if (const auto rc = ncclGroupStart(); rc != ncclSuccess) give_up(what, rc, "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    for (std::size_t i = 0; i < n && first == ncclSuccess; ++i) {
      const CudaDeviceGuard g(devices_[i]);
      first = enqueue(i, slots_[i]->stream.get());
    }
    const auto end = ncclGroupEnd();
    if (first != ncclSuccess) give_up(what, first, "enqueue");
    if (end != ncclSuccess) give_up(what, end, "ncclGroupEnd");
    for (std::size_t i = 0; i < n; ++i) {
      const CudaDeviceGuard g(devices_[i]);
      slots_[i]->done.record(slots_[i]->stream.get());
      for (const auto* set : sets)
        slots_[i]->done.block(static_cast<cudaStream_t>((*set)[i].stream));
    }
    for (std::size_t i = 0; i < n;) {
      if (slots_[i]->done.ready()) {
        ++i;
        continue;
      }
      for (std::size_t j = 0; j < n; ++j) {
        ncclResult_t st = ncclSuccess;
        const auto rc = ncclCommGetAsyncError(comms_[j], &st);
        if (rc != ncclSuccess) give_up(what, rc, "ncclCommGetAsyncError");
        if (st != ncclSuccess && st != ncclInProgress) give_up(what, st, "asynchronous error");
      }
      if (timeout_.count() > 0 && std::chrono::steady_clock::now() - start > timeout_) {
        abort_all();
        detail::fail(Errc::timeout, "NcclClique: ", what, " over ", n,
                     " device(s) did not complete within ", timeout_.count(),
                     " ms (a kernel before it on a tensor's stream did not finish, or a device "
                     "hung); the clique was aborted");
      }
      std::this_thread::yield();
    }
  }

  void abort_all();

  [[noreturn]] void give_up(const char* what, ncclResult_t rc, const char* where);

  std::vector<int> devices_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<ncclComm_t> comms_;
  detail::NcclAborter aborter_;  // last: joined before the streams are freed
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/multi_gpu.ipp"
#endif
