// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/reduce.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE ReduceFn reduce_fn(DType t, ReduceOp op) {
  switch (t) {
    case DType::int8: return reduce_fn_for<std::int8_t>(op);
    case DType::uint8: return reduce_fn_for<std::uint8_t>(op);
    case DType::int16: return reduce_fn_for<std::int16_t>(op);
    case DType::uint16: return reduce_fn_for<std::uint16_t>(op);
    case DType::int32: return reduce_fn_for<std::int32_t>(op);
    case DType::uint32: return reduce_fn_for<std::uint32_t>(op);
    case DType::int64: return reduce_fn_for<std::int64_t>(op);
    case DType::uint64: return reduce_fn_for<std::uint64_t>(op);
    case DType::float16: return reduce_fn_for<half>(op);
    case DType::float32: return reduce_fn_for<float>(op);
    case DType::float64: return reduce_fn_for<double>(op);
    case DType::bfloat16: return reduce_fn_for<bfloat16>(op);
    case DType::boolean:
      return is_supported(op, t) ? reduce_fn_for<std::uint8_t>(bool_as_byte(op)) : nullptr;
  }
  return nullptr;
}

DDP_INLINE ScaleFn scale_fn(DType t) {
  switch (t) {
    case DType::float16: return &scale_kernel<half>;
    case DType::float32: return &scale_kernel<float>;
    case DType::float64: return &scale_kernel<double>;
    case DType::bfloat16: return &scale_kernel<bfloat16>;
    default: return nullptr;
  }
}

DDP_INLINE DivideFn divide_fn(DType t) {
  switch (t) {
    case DType::float16: return &divide_kernel<half>;
    case DType::float32: return &divide_kernel<float>;
    case DType::float64: return &divide_kernel<double>;
    case DType::bfloat16: return &divide_kernel<bfloat16>;
    default: return nullptr;
  }
}

DDP_INLINE WireKernels wire_kernels(DType wire, ReduceOp op) {
  switch (wire) {
    case DType::float16: return wire_kernels_for<half>(op);
    case DType::bfloat16: return wire_kernels_for<bfloat16>(op);
    default: return {};
  }
}

}  // namespace detail
DDP_END_NAMESPACE
