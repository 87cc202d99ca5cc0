// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How Communicator turns a typed argument into a checked detail::Buf for its backend: the only
/// code compiled per tensor type. A TensorView's type already says what the compiler can check
/// (element type, read-only); a DynamicView (run-time typed) is checked here; the device must be
/// one the backend can use (comm/dispatch.hpp: its own, or CUDA staged through the host).

#include "ddp/backend/backend.hpp"
#include "ddp/backend/collective.hpp"
#include "ddp/comm/call.hpp"
#include "ddp/comm/dispatch.hpp"
#include "ddp/config.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

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

/// Who checks a call on `be`: its rank and size, and its refusal of an operator on a dtype
/// (backend_traits::refuses_ops) where it has one.
template <class Backend>
Caller caller_of(const Backend& be) {
  Caller c{be.rank(), be.size(), nullptr, Backend::name};
  if constexpr (backend_traits<Backend>::refuses_ops)
    c.refuses_op = [](ReduceOp op, DType t) -> const char* { return Backend::refuses(op, t); };
  return c;
}

/// Argument `name` of collective `what` on `rank`, as a checked type-erased buffer.
template <class Backend, class T>
Buf to_buf(T& t, int rank, const char* what, const char* name) {
  static_assert(!host_type_for_device_backend<Backend, T>,
                "ddp: this backend (backend::Nccl) moves CUDA device memory only, and this "
                "buffer's type is host memory (std::vector, std::array, a span, ...): use "
                "ddp::CudaBuffer<T> or a CUDA tensor type adapted with ddp::tensor_traits, or "
                "Communicator<backend::Host> for host buffers");
  Buf b;
  if constexpr (DynamicTensor<T>) {
    b = dynamic_buf<Backend>(ddp::view(t), rank, what, name);
  } else {
    b = typed_buf<Backend>(ddp::view(t), rank, what, name);
  }
  if constexpr (backend_traits<Backend>::refuses_some) {
    if (const char* why = Backend::refuses(what, b.dtype)) [[unlikely]]
      fail(Errc::invalid_argument, "rank ", rank, ": backend::", Backend::name, ": ", what, "(",
           to_string(b.dtype), "): ", why);
  }
  return b;
}

/// all_to_all's in_counts then out_counts, one per rank each, checked.
DDP_INLINE std::vector<std::size_t> joined_counts(std::span<const std::size_t> a,
                                                  std::span<const std::size_t> b, Caller caller);

/// An uneven collective's call; `in`, `out` and `counts` read only where the collective reads
/// them (see comm/call.hpp).
template <class Backend, class In, class Out>
Call prepare_uneven_args(Coll coll, In& in_t, Out& out_t, std::span<const std::size_t> counts,
                         int root, Caller caller) {
  const char* what = to_string(coll).data();
  const int rank = caller.rank;
  if (coll == Coll::all_to_all_v)
    return prepare_all_to_all_v(to_buf<Backend>(in_t, rank, what, "in"),
                                to_buf<Backend>(out_t, rank, what, "out"), counts, caller);
  if (coll == Coll::scatter_v) {
    const Buf out = to_buf<Backend>(out_t, rank, what, "out");
    return prepare_scatter_v(rank == root ? to_buf<Backend>(in_t, rank, what, "in") : Buf{}, out,
                             counts, root, caller);
  }
  const Buf in = to_buf<Backend>(in_t, rank, what, "in");
  const bool receives = root < 0 || root == rank;
  return prepare_gather_v(in, receives ? to_buf<Backend>(out_t, rank, what, "out") : Buf{}, counts,
                          root, caller);
}

/// all_gather's (root < 0) or gather's call.
template <class Backend, class In, class Out>
Call prepare_gather_args(In& in_t, Out& out_t, int root, Caller caller) {
  const char* what = root < 0 ? "all_gather" : "gather";
  const Buf in = to_buf<Backend>(in_t, caller.rank, what, "in");
  if (root >= 0) check_root(root, caller, what);
  const bool receives = root < 0 || root == caller.rank;
  return prepare_gather(in, receives ? to_buf<Backend>(out_t, caller.rank, what, "out") : Buf{},
                        root, caller);
}

/// scatter's call.
template <class Backend, class In, class Out>
Call prepare_scatter_args(In& in_t, Out& out_t, int root, Caller caller) {
  const Buf out = to_buf<Backend>(out_t, caller.rank, "scatter", "out");
  check_root(root, caller, "scatter");
  return prepare_scatter(
      root == caller.rank ? to_buf<Backend>(in_t, caller.rank, "scatter", "in") : Buf{}, out, root,
      caller);
}

/// A range of typed arguments as checked type-erased buffers (all_reduce_coalesced).
template <class Backend, class R>
std::vector<Buf> to_bufs(R& range, int rank, const char* what) {
  std::vector<Buf> out;
  for (auto&& t : range) out.push_back(to_buf<Backend>(t, rank, what, "bufs"));
  return out;
}

/// batch_isend_irecv's call, its buffers and its (is_send, peer, tag) triples.
struct BatchArgs {
  Call call;
  std::vector<Buf> bufs;
  std::vector<std::size_t> specs;
};
template <class Backend>
BatchArgs prepare_batch_args(std::span<const P2POp> ops, Caller caller) {
  BatchArgs b;
  for (const P2POp& o : ops) {
    b.bufs.push_back(
        dynamic_buf<Backend>(o.buf, caller.rank, "batch_isend_irecv", o.is_send ? "in" : "buf"));
    b.specs.insert(b.specs.end(), {o.is_send ? 1u : 0u, static_cast<std::size_t>(o.peer),
                                   static_cast<std::size_t>(o.tag)});
  }
  b.call = prepare_batch_p2p(b.bufs, b.specs, caller);
  return b;
}

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/arguments.ipp"
#endif
