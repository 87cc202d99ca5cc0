// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How Communicator turns a typed argument into a checked detail::Buf for its backend: the only
/// code compiled per tensor type. A TensorView's type already says what the compiler can check
/// (element type, read-only); a DynamicView (run-time typed) is checked here; the device must be
/// one the backend can use (backend/dispatch.hpp: its own, or CUDA staged through the host).

#include "ddp/backend/backend.hpp"
#include "ddp/backend/dispatch.hpp"
#include "ddp/config.hpp"
#include "ddp/runtime/call.hpp"
#include "ddp/runtime/collective.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <cstddef>
#include <string_view>
#include <type_traits>

DDP_BEGIN_NAMESPACE
namespace detail {

template <class Backend, class E>
Buf typed_buf(const TensorView<E>& v, int rank, const char* what, const char* name) {
  // The device field by field: copying it whole after view() wrote it piecewise makes g++
  // reload it as one 8-byte word, a store-forwarding stall that cost ~5 ns per call.
  // E is const for a read-only input (a const vector, a span<const T>): Buf is untyped.
  using M = std::remove_const_t<E>;
  const Buf b{reinterpret_cast<std::byte*>(const_cast<M*>(v.data)), v.size, dtype_of<M>,
              Device{v.device.kind, v.device.index}, v.stream};
  const bool usable = usable_device<Backend>(v.device);
  if (!usable || v.data == nullptr || v.size > max_buffer_bytes / sizeof(M)) [[unlikely]]
    check_buf(b, sizeof(M), usable, Backend::name, rank, what, name);
  return b;
}

/// A run-time-typed argument: everything the compiler checks for a TensorView, checked here.
/// Arguments named `in`, and send's buffer, are read; the others are written.
template <class Backend>
Buf dynamic_buf(const DynamicView& v, int rank, const char* what, const char* name) {
  const Buf b{static_cast<std::byte*>(v.data), v.size, v.dtype,
              Device{v.device.kind, v.device.index}, v.stream};
  const bool writes = std::string_view(name) != "in" && std::string_view(what) != "send";
  const bool usable = usable_device<Backend>(v.device);
  check_dynamic(v, writes, what, name, rank);
  if (!usable || v.data == nullptr || v.size > max_buffer_bytes / size_of(v.dtype))
    check_buf(b, size_of(v.dtype), usable, Backend::name, rank, what, name);
  return b;
}

/// Argument `name` of collective `what` on `rank`, as a checked type-erased buffer.
template <class Backend, class T>
Buf to_buf(T& t, int rank, const char* what, const char* name) {
  static_assert(!host_type_for_device_backend<Backend, T>,
                "ddp: this backend (backend::Nccl) moves CUDA device memory only, and this "
                "buffer's type is host memory (std::vector, std::array, a span, ...): use "
                "ddp::CudaBuffer<T> or a CUDA tensor type adapted with ddp::tensor_traits, or "
                "Communicator<backend::Host> for host buffers");
  if constexpr (DynamicTensor<T>) {
    return dynamic_buf<Backend>(ddp::view(t), rank, what, name);
  } else {
    return typed_buf<Backend>(ddp::view(t), rank, what, name);
  }
}

}  // namespace detail
DDP_END_NAMESPACE
