// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// libtorch's tensors as ddp tensors (the collectives part of the torch adapter; the training part
/// is ddp/adapters/torch_training.hpp, and ddp/adapters/torch.hpp includes both): a torch::Tensor
/// (at::Tensor) is a run-time-typed tensor (ddp::DynamicView), so it works in every collective
/// and its _async twin, on any backend that can use its memory: CPU tensors on backend::Host and
/// backend::Mpi, CUDA tensors on backend::Nccl (ordered after the tensor's current CUDA stream)
/// and on backend::Host through its staging (ddp built with CUDA).
///
/// What a collective refuses, with Errc::invalid_argument naming the rank, the collective and
/// the argument: an undefined tensor, a sparse or otherwise non-strided one, a non-contiguous
/// one (a slice, a transpose, an expanded tensor: pass t.contiguous() and copy the result back),
/// a dtype ddp does not carry (bool, complex, quantized, float8), a device other than CPU and
/// CUDA. Tensors are read and written in place, outside autograd (as torch.distributed does).
///
/// CUDA streams: with libtorch 2.1 or later the tensor's current stream is found through c10's
/// device-generic stream API; earlier versions order collectives after the default stream.
///
/// Needs libtorch on the include path and linked (CMake: the ddp::torch target, or
/// find_package(Torch) and ${TORCH_LIBRARIES}); only the adapters depend on it.

#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstddef>
#include <exception>
#include <optional>

DDP_BEGIN_NAMESPACE
namespace torch_detail {

/// torch's unsigned types of 16 to 64 bits, in the releases that have them (2.3 and later).
template <class S = c10::ScalarType>
[[nodiscard]] std::optional<DType> unsigned_dtype_of(S t) noexcept {
  if constexpr (requires { S::UInt16, S::UInt32, S::UInt64; }) {
    if (t == S::UInt16) return DType::uint16;
    if (t == S::UInt32) return DType::uint32;
    if (t == S::UInt64) return DType::uint64;
  }
  return std::nullopt;
}
template <class S = c10::ScalarType>
[[nodiscard]] std::optional<S> unsigned_scalar_type_of(DType t) noexcept {
  if constexpr (requires { S::UInt16, S::UInt32, S::UInt64; }) {
    if (t == DType::uint16) return S::UInt16;
    if (t == DType::uint32) return S::UInt32;
    if (t == DType::uint64) return S::UInt64;
  }
  return std::nullopt;
}

/// The ddp::DType of a torch scalar type, if ddp carries it.
[[nodiscard]] inline std::optional<DType> dtype_of(c10::ScalarType t) noexcept {
  switch (t) {
    case c10::ScalarType::Float: return DType::float32;
    case c10::ScalarType::Double: return DType::float64;
    case c10::ScalarType::Half: return DType::float16;
    case c10::ScalarType::BFloat16: return DType::bfloat16;
    case c10::ScalarType::Char: return DType::int8;
    case c10::ScalarType::Byte: return DType::uint8;
    case c10::ScalarType::Short: return DType::int16;
    case c10::ScalarType::Int: return DType::int32;
    case c10::ScalarType::Long: return DType::int64;
    case c10::ScalarType::Bool: return DType::boolean;
    default: return unsigned_dtype_of(t);
  }
}

/// The torch scalar type of a ddp::DType, if torch has it (uint16, uint32 and uint64 it does not,
/// before torch 2.3).
[[nodiscard]] inline std::optional<c10::ScalarType> scalar_type_of(DType t) noexcept {
  switch (t) {
    case DType::float32: return c10::ScalarType::Float;
    case DType::float64: return c10::ScalarType::Double;
    case DType::float16: return c10::ScalarType::Half;
    case DType::bfloat16: return c10::ScalarType::BFloat16;
    case DType::int8: return c10::ScalarType::Char;
    case DType::uint8: return c10::ScalarType::Byte;
    case DType::int16: return c10::ScalarType::Short;
    case DType::int32: return c10::ScalarType::Int;
    case DType::int64: return c10::ScalarType::Long;
    case DType::boolean: return c10::ScalarType::Bool;
    default: return unsigned_scalar_type_of(t);
  }
}

/// A c10::Stream's cudaStream_t where c10 can say it (libtorch >= 2.1), else the default stream.
template <class S>
[[nodiscard]] void* native_stream(const S& s) {
  if constexpr (requires { s.native_handle(); }) {
    return s.native_handle();
  } else {
    return nullptr;
  }
}

[[nodiscard]] inline DynamicView view(const at::Tensor& t) {
  DynamicView v;
  if (!t.defined()) {
    v.problem =
        "an undefined torch::Tensor (no storage: e.g. a gradient before the first backward, or "
        "after zero_grad() set it to None)";
    return v;
  }
  if (t.layout() != c10::kStrided) {
    v.problem = "a torch::Tensor that is not strided (sparse or mkldnn): pass t.to_dense()";
    return v;
  }
  const auto dtype = dtype_of(t.scalar_type());
  if (!dtype) {
    v.problem =
        "a torch::Tensor of a dtype ddp does not carry (bool, complex, quantized, float8): ddp "
        "carries float32/64, half, bfloat16, int8/16/32/64 and uint8 (uint16/32/64 with torch 2.3 "
        "or later)";
    return v;
  }
  const c10::Device d = t.device();
  if (d.is_cpu()) {
    v.device = Device::cpu();
  } else if (d.is_cuda()) {
    v.device = Device::cuda(d.index());
    try {
      v.stream = native_stream(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(d));
    } catch (const std::exception&) {  // c10::Error: this libtorch has no CUDA, or no GPU works
      v.problem =
          "a CUDA torch::Tensor, but this libtorch cannot give its CUDA stream (built "
          "without CUDA, or no usable GPU)";
      return v;
    }
  } else {
    v.problem = "a torch::Tensor on a device other than CPU and CUDA";
    return v;
  }
  v.dtype = *dtype;
  v.data = t.data_ptr();
  v.size = static_cast<std::size_t>(t.numel());
  v.contiguous = t.is_contiguous();
  return v;
}

}  // namespace torch_detail

/// torch::Tensor (at::Tensor) as a run-time-typed ddp tensor.
template <>
struct tensor_traits<at::Tensor> {
  /// A copy shares the tensor's storage: the Work of an _async collective holds one until the
  /// operation has finished, so the caller may drop its tensor before wait() (as in PyTorch).
  static constexpr bool shares_storage = true;
  /// The tensor's data, dtype, device and layout; `problem` says why it cannot be used, if so.
  static DynamicView view(const at::Tensor& t) { return torch_detail::view(t); }
};

DDP_END_NAMESPACE
