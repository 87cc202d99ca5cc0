// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What backend::Nccl and NcclClique share: how ddp's types and ops map to NCCL's, which Errc an
/// NCCL failure is, and detail::NcclAborter (ncclCommAbort on a thread of its own). Needs
/// DDP_HAS_NCCL=1 (the ddp::nccl target).

#include "ddp/backend/collective.hpp"
#include "ddp/backend/uneven.hpp"
#include "ddp/config.hpp"
#include "ddp/cuda.hpp"
#include "ddp/error.hpp"
#include "ddp/types.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The NCCL type a buffer travels as. NCCL has no 16-bit integers: they move as float16, whose
/// copies are bitwise (broadcast, gathers, all_to_all, send/recv); reductions of them are refused
/// before this is asked (Nccl::reducible).
[[nodiscard]] inline ncclDataType_t nccl_type(DType t) noexcept {
  switch (t) {
    case DType::int16:
    case DType::uint16: return ncclFloat16;
    case DType::int8: return ncclInt8;
    case DType::uint8:
    case DType::boolean: return ncclUint8;
    case DType::int32: return ncclInt32;
    case DType::uint32: return ncclUint32;
    case DType::int64: return ncclInt64;
    case DType::uint64: return ncclUint64;
    case DType::float16: return ncclFloat16;
    case DType::float32: return ncclFloat32;
    case DType::float64: return ncclFloat64;
    case DType::bfloat16: return ncclBfloat16;
  }
  return ncclNumTypes;
}

[[nodiscard]] inline ncclRedOp_t nccl_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::prod: return ncclProd;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::avg: return ncclAvg;
    default: return ncclSum;  // premul_sum: NcclRedOp; bitwise: refused (nccl_refuses_op)
  }
}

/// The reduction operator of one NCCL call: `op` on `t` (bool's operators as those on its 0/1
/// bytes); premul_sum's made with ncclRedOpCreatePreMulSum, the factor in the element type
/// (float for half and bfloat16 rounded to them) read when the call is made, and destroyed
/// with this object, after the last call that uses it has returned.
class NcclRedOp {
 public:
  NcclRedOp(ReduceOp op, DType t, double factor, ncclComm_t comm, int rank) : comm_(comm) {
    if (op != ReduceOp::premul_sum) {
      op_ = nccl_op(t == DType::boolean ? bool_as_byte(op) : op);
      return;
    }
    if (t == DType::float16)
      store(half(static_cast<float>(factor)));
    else if (t == DType::bfloat16)
      store(bfloat16(static_cast<float>(factor)));
    else if (t == DType::float32)
      store(static_cast<float>(factor));
    else
      store(factor);
    const auto rc =
        ncclRedOpCreatePreMulSum(&op_, scalar_, nccl_type(t), ncclScalarHostImmediate, comm);
    if (rc != ncclSuccess)
      fail(Errc::backend, "rank ", rank,
           ": backend::Nccl: ncclRedOpCreatePreMulSum failed: ", ncclGetErrorString(rc));
    made_ = true;
  }
  NcclRedOp(NcclRedOp&& o) noexcept
      : comm_(o.comm_), op_(o.op_), made_(std::exchange(o.made_, false)) {
    std::memcpy(scalar_, o.scalar_, sizeof scalar_);
  }
  NcclRedOp(const NcclRedOp&) = delete;
  NcclRedOp& operator=(const NcclRedOp&) = delete;
  NcclRedOp& operator=(NcclRedOp&&) = delete;
  ~NcclRedOp() {
    if (made_) (void)ncclRedOpDestroy(op_, comm_);
  }
  [[nodiscard]] ncclRedOp_t get() const noexcept { return op_; }

 private:
  template <class S>
  void store(S value) noexcept {
    std::memcpy(scalar_, &value, sizeof value);
  }
  ncclComm_t comm_;
  ncclRedOp_t op_ = ncclSum;
  bool made_ = false;
  alignas(8) unsigned char scalar_[8] = {};
};

/// backend::Nccl::refuses for operators: NCCL has no bitwise reductions (nullptr: accepted).
inline const char* nccl_refuses_op(ReduceOp op, DType t) noexcept {
  if (op != ReduceOp::band && op != ReduceOp::bor && op != ReduceOp::bxor) return nullptr;
  if (t == DType::boolean && op != ReduceOp::bxor) return nullptr;  // min and max on 0/1 bytes
  return "NCCL has no bitwise reductions (band, bor, bxor; on bool band and bor are min and max); "
         "use backend::Host for them";
}

/// The Errc for an NCCL failure: a remote process or the network -> peer_lost, else backend.
[[nodiscard]] inline Errc nccl_errc(ncclResult_t rc) noexcept {
  return rc == ncclRemoteError ? Errc::peer_lost : Errc::backend;
}

/// ncclCommAbort on a thread of its own. The abort returns only once the communicator's kernels
/// have stopped, and a kernel queued before them on a tensor's stream (the stuck producer that
/// made the collective time out) delays that for as long as it runs; the error that asked for the
/// abort is raised at once instead, and the owner's destructor waits for the abort to finish.
class NcclAborter {
 public:
  NcclAborter() = default;
  NcclAborter(const NcclAborter&) = delete;
  NcclAborter& operator=(const NcclAborter&) = delete;
  ~NcclAborter() { join(); }

  /// Aborts every non-null communicator (comms[i] on devices[i]).
  void abort(std::vector<ncclComm_t> comms, std::vector<int> devices) {
    join();
    thread_ = std::thread([comms = std::move(comms), devices = std::move(devices)] {
      for (std::size_t i = 0; i < comms.size(); ++i) {
        if (comms[i] == nullptr) continue;
        (void)cudaSetDevice(devices[i]);
        (void)ncclCommAbort(comms[i]);
      }
    });
  }
  void join() noexcept {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
};

/// The one stream `bufs` (pointers to detail::Buf) share, if they share one.
template <class Bufs>
std::optional<cudaStream_t> common_stream(const Bufs& bufs) {
  std::optional<cudaStream_t> common;
  for (const auto* b : bufs) {
    const auto s = static_cast<cudaStream_t>(b->stream);
    if (common && *common != s) return std::nullopt;
    common = s;
  }
  return common;
}

/// Every rank's plan of an uneven collective (backend/uneven.hpp), shared with an all_gather on
/// `be` (backend::Nccl) through device memory and checked pair by pair: the agreed
/// sends[src * size + dst].
template <class Be>
std::vector<std::uint64_t> nccl_agree(Be& be, const UnevenPlan& plan, const char* what, DType t) {
  const std::vector<std::uint64_t> row = plan.row();
  const std::size_t n = row.size(), at = n * static_cast<std::size_t>(be.rank());
  CudaBuffer<std::uint64_t> all(n * static_cast<std::size_t>(be.size()), be.device(), be.stream());
  DDP_CUDA_CHECK(cudaMemcpyAsync(all.data() + at, row.data(), n * sizeof(std::uint64_t),
                                 cudaMemcpyHostToDevice, be.stream()));
  be.all_gather({reinterpret_cast<std::byte*>(all.data() + at), n, DType::uint64,
                 Device::cuda(be.device()), be.stream()},
                {reinterpret_cast<std::byte*>(all.data()), all.size(), DType::uint64,
                 Device::cuda(be.device()), be.stream()});
  std::vector<std::uint64_t> rows(all.size());
  all.copy_to(rows);
  return agreed_sizes(rows, static_cast<std::size_t>(be.size()), be.rank(),
                      concat(what, "(", to_string(t), ", counts per rank)"),
                      [](int j) { return j; });
}

/// backend::Nccl::refuses: NCCL reduces no 16-bit integers (nullptr: accepted).
inline const char* nccl_refuses(std::string_view what, DType t) noexcept {
  if (t != DType::int16 && t != DType::uint16) return nullptr;
  if (what != "all_reduce" && what != "reduce" && what != "reduce_scatter" &&
      what != "all_reduce_coalesced")
    return nullptr;
  return "NCCL cannot reduce 16-bit integers; reduce them as int32 (or float16 where the values "
         "fit), or use backend::Host";
}

}  // namespace detail

DDP_END_NAMESPACE
