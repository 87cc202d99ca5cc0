// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Comm hooks: what is done to a full bucket of gradients (torch's DDP register_comm_hook). The
/// bucket engine (ddp/training/averaging/buckets.hpp) packs each bucket and calls its averager's
/// hook; GradientAverager::register_comm_hook and ShardedAverager::register_comm_hook set one.
///
/// A comm hook is any callable
///
///     ddp::Work hook(ddp::Communicator<Backend>& comm, ddp::GradBucket<T>& bucket);
///
/// that leaves in bucket.output, on every rank, the reduction bucket.op over every rank's
/// bucket.buffer, and returns the Work that finishes it (the bucket's buffers live until then).
/// Every rank registers the same hook. Built in:
///
///     ddp::allreduce_hook       all_reduce (GradientAverager's default)
///     ddp::fp16_compress_hook   float32 gradients travel and are reduced as float16 (half the
///     ddp::bf16_compress_hook   bytes) or bfloat16; compress_hook(DType) takes the wire type
///     ddp::reduce_scatter_hook  this rank's block only (ShardedAverager's default: ZeRO)
///
///     avg.register_comm_hook([&](auto& comm, auto& bucket) {   // counts, then the default
///       ++calls;
///       return ddp::allreduce_hook(comm, bucket);
///     });
///
/// A hook runs in the thread that completes its bucket (with autograd's hooks, backward's). If it
/// throws, or its Work fails with an exception that is not a ddp::Error, synchronize() throws a
/// ddp::Error naming the bucket and its parameters (the code of a ddp::Error it threw,
/// Errc::invalid_argument otherwise), once the buckets already started have finished; no later
/// bucket of the step starts, so ranks whose hook fails alike stay in step, and the step is
/// dropped. A collective's own failure (a lost peer, a timeout) passes as it is.
///
/// In a ddp::Join (uneven inputs), bucket.op is ReduceOp::sum and the averager divides the result
/// by the number of ranks that trained the step; a rank that has finished calls the hook for each
/// bucket of each step the others still train, with bucket.shadow set and a buffer of zeros, and
/// drops the result. So a hook reduces with bucket.op and issues the same collectives whatever the
/// buffer holds; one with state of its own (error feedback) leaves it alone when bucket.shadow.

#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"
#include "ddp/work.hpp"

#include <cstddef>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <type_traits>

DDP_BEGIN_NAMESPACE

/// A gradient's part of a bucket: elements [offset, offset + size) of parameter `param`, at
/// position `at` of the bucket's buffer.
struct BucketPiece {
  std::size_t param = 0;   ///< The parameter's index in the model.
  std::size_t offset = 0;  ///< Its first element here (0 unless ShardedAverager split it).
  std::size_t size = 0;    ///< Elements.
  std::size_t at = 0;      ///< Where they are in the bucket's buffer.
  /// The parameter's rows seen as a matrix, row-major (0: a vector, or the framework does not
  /// say; see detail::param_rows). Meaningful when the piece is the whole parameter.
  std::size_t rows = 0;
};

/// What a comm hook receives (torch's GradBucket). Valid until the step's synchronize().
template <class T>
struct GradBucket {
  std::size_t index = 0;  ///< The bucket's place in launch order (0: the last parameters').
  bool last = false;      ///< The last bucket of a step.
  /// This rank's gradients, packed in `pieces` order (zero padding after them in a
  /// ShardedAverager's bucket); host or device memory, as the backend moves it.
  TensorView<T> buffer;
  /// Where the result must be: `buffer` itself (GradientAverager), or this rank's block of it
  /// (ShardedAverager: elements [r * n / P, (r + 1) * n / P) on rank r of P).
  TensorView<T> output;
  ReduceOp op = ReduceOp::avg;  ///< The reduction to leave there: avg; sum inside a ddp::Join.
  bool shadow = false;  ///< A finished rank in a Join: `buffer` holds zeros, the result is dropped.
  std::span<const BucketPiece> pieces;  ///< The gradients in `buffer`, in order.
  /// Piece k's elements of `buffer`.
  [[nodiscard]] TensorView<T> gradient(std::size_t k) const {
    return buffer.subview(pieces[k].at, pieces[k].size);
  }
};

/// Whether F is a comm hook for gradients of element type T on communicator type Comm.
template <class F, class Comm, class T>
concept CommHookFor = (std::is_invocable_r_v<Work, F&, Comm&, GradBucket<T>&>);
/// A comm hook as an averager keeps it.
template <class Comm, class T>
using CommHook = std::function<Work(Comm&, GradBucket<T>&)>;

namespace detail {

/// The exception in flight, out of bucket k's hook (its gradients: `pieces`), as the ddp::Error
/// that names the bucket: a ddp::Error keeps its code; anything else is the hook's own fault
/// (Errc::invalid_argument).
DDP_INLINE std::exception_ptr hook_error(int rank, const char* who, std::size_t k,
                                         std::span<const BucketPiece> pieces);

}  // namespace detail

/// The built-in hook all_reduce: bucket.buffer reduced with bucket.op (torch's allreduce_hook).
struct AllReduceHook {
  /// Starts the all_reduce of `b`'s buffer; the Work finishes it.
  template <class Comm, class T>
  Work operator()(Comm& comm, GradBucket<T>& b) const {
    return comm.all_reduce_async(b.buffer, b.op);
  }
};
/// The built-in compression hooks: float32 values travel and are reduced as `wire`
/// (DType::float16 or DType::bfloat16), the result rounded to it (Communicator::all_reduce_as).
struct CompressHook {
  DType wire = DType::bfloat16;  ///< The type on the wire.
  /// Starts the all_reduce of `b`'s buffer carried as `wire`; the Work finishes it.
  template <class Comm, class T>
  Work operator()(Comm& comm, GradBucket<T>& b) const {
    return comm.all_reduce_as_async(b.buffer, wire, b.op);
  }
};
/// The built-in hook of ZeRO: the reduce_scatter of bucket.buffer into bucket.output.
struct ReduceScatterHook {
  /// Starts the reduce_scatter of `b`'s buffer into its output; the Work finishes it.
  template <class Comm, class T>
  Work operator()(Comm& comm, GradBucket<T>& b) const {
    return comm.reduce_scatter_async(b.buffer, b.output, b.op);
  }
};
/// all_reduce of the bucket (GradientAverager's default; torch's allreduce_hook).
inline constexpr AllReduceHook allreduce_hook{};
/// float32 gradients as float16 on the wire (torch's fp16_compress_hook).
inline constexpr CompressHook fp16_compress_hook{DType::float16};
/// float32 gradients as bfloat16 on the wire (torch's bf16_compress_hook).
inline constexpr CompressHook bf16_compress_hook{DType::bfloat16};
/// float32 gradients as `wire` (DType::float16 or DType::bfloat16) on the wire.
[[nodiscard]] constexpr CompressHook compress_hook(DType wire) noexcept { return {wire}; }
/// reduce_scatter of the bucket: each rank gets its block (ShardedAverager's default).
inline constexpr ReduceScatterHook reduce_scatter_hook{};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/training/averaging/impl/comm_hooks.ipp"
#endif
