// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How Communicator runs a call on its backend: detail::dispatch maps a detail::Call to the
/// backend's member of the collective (all_reduce_many where the backend reduces several buffers
/// at once, all_reduce_as where it converts the wire type itself, else the conversion around a
/// plain all_reduce), staging CUDA buffers through pinned host memory when the backend moves
/// host memory only (runtime/staging.hpp).

#include "ddp/backend/backend.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/runtime/call.hpp"
#include "ddp/runtime/collective.hpp"
#include "ddp/runtime/comm_state.hpp"
#include "ddp/runtime/reduce.hpp"
#include "ddp/types.hpp"

#include <cstddef>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Whether CUDA buffers given to a backend that moves host memory only are staged through
/// pinned host memory (ddp built with CUDA) rather than refused.
template <class Backend>
bool stages_cuda() noexcept {
  return DDP_HAS_CUDA != 0 && !backend_traits<Backend>::device_only &&
         Backend::supports(Device::cpu()) && !Backend::supports(Device::cuda());
}

/// Whether the backend can take a buffer on `device`: its own kind of memory, or a CUDA buffer
/// staged through pinned host memory.
template <class Backend>
bool usable_device(const Device& device) noexcept {
  return Backend::supports(device) || (device.is_cuda() && stages_cuda<Backend>());
}

template <class Backend>
bool staged(const Buf& b) noexcept {
  return b.device.is_cuda() && b.data != nullptr && b.count != 0 && stages_cuda<Backend>();
}

/// Runs f(buffer) for an elementwise collective, through the staging pipeline when `b` is a
/// CUDA buffer this backend cannot use (see runtime/staging.hpp).
template <class Backend, class F>
void elementwise(CommState& s, const Buf& b, bool fetch, bool store, const F& f) {
  if (!staged<Backend>(b)) return f(b);
#if DDP_HAS_CUDA
  s.cuda_staging().elementwise(b, fetch, store, f);
#else
  (void)s, (void)fetch, (void)store;
#endif
}

/// Runs f(buffers...) with every CUDA buffer among `a` staged whole.
template <class Backend, class F, class... A>
void whole(CommState& s, int rank, const char* what, const F& f, A... a) {
  if (!(staged<Backend>(a.buf) || ...)) return f(a.buf...);
#if DDP_HAS_CUDA
  s.cuda_staging().whole(rank, what, f, &staged<Backend>, a...);
#else
  (void)s, (void)rank, (void)what;
#endif
}

/// all_reduce of float32 `h` carried as `wire`: by the backend when it can, else converted
/// around a plain all_reduce.
template <class W, class Backend>
void all_reduce_as_wire(Backend& be, const Buf& h, ReduceOp op) {
  if constexpr (backend_traits<Backend>::converts_wire) {
    be.all_reduce_as(h, op, dtype_of<W>);
  } else {
    std::vector<W> wire(h.count);
    auto* w = reinterpret_cast<std::byte*>(wire.data());
    encode_kernel<W>(w, h.data, h.count);
    be.all_reduce(Buf{w, h.count, dtype_of<W>, h.device, nullptr, h.whole}, op);
    decode_kernel<W>(h.data, w, h.count);
  }
}

template <class Backend>
void run_single(Backend& be, CommState& s, Coll coll, const Buf& b, ReduceOp op, int root) {
  switch (coll) {
    case Coll::all_reduce:
      return elementwise<Backend>(s, b, true, true, [&](const Buf& h) { be.all_reduce(h, op); });
    case Coll::broadcast: {
      const bool mine = be.rank() == root;
      return elementwise<Backend>(s, b, mine, !mine, [&](const Buf& h) { be.broadcast(h, root); });
    }
    default:
      return elementwise<Backend>(s, b, true, be.rank() == root,
                                  [&](const Buf& h) { be.reduce(h, root, op); });
  }
}

template <class Backend>
void dispatch(Backend& be, CommState& s, const Call& c) {
  const auto in_out = [&](const auto& f) {
    whole<Backend>(s, be.rank(), c.name, f, StagedArg{c.in, true, false},
                   StagedArg{c.out, false, true});
  };
  switch (c.coll) {
    case Coll::all_reduce:
      if (c.form == Call::Form::coalesced) {
        if constexpr (backend_traits<Backend>::reduces_many) {
          be.all_reduce_many(c.many, c.op);
        } else {
          for (const Buf& b : c.many)
            elementwise<Backend>(s, b, true, true, [&](const Buf& h) { be.all_reduce(h, c.op); });
        }
      } else if (c.form == Call::Form::as_wire) {
        elementwise<Backend>(s, c.in, true, true, [&](const Buf& h) {
          if (c.wire == DType::float16)
            all_reduce_as_wire<half>(be, h, c.op);
          else
            all_reduce_as_wire<bfloat16>(be, h, c.op);
        });
      } else {
        run_single(be, s, c.coll, c.in, c.op, c.root);
      }
      return;
    case Coll::broadcast:
    case Coll::reduce: return run_single(be, s, c.coll, c.in, c.op, c.root);
    case Coll::all_gather: return in_out([&](const Buf& i, const Buf& o) { be.all_gather(i, o); });
    case Coll::gather: return in_out([&](const Buf& i, const Buf& o) { be.gather(i, o, c.root); });
    case Coll::scatter:
      return in_out([&](const Buf& i, const Buf& o) { be.scatter(i, o, c.root); });
    case Coll::reduce_scatter:
      return in_out([&](const Buf& i, const Buf& o) { be.reduce_scatter(i, o, c.op); });
    case Coll::all_to_all: return in_out([&](const Buf& i, const Buf& o) { be.all_to_all(i, o); });
    case Coll::send:
      return whole<Backend>(
          s, be.rank(), c.name, [&](const Buf& h) { be.send(h, c.root, c.tag); },
          StagedArg{c.in, true, false});
    case Coll::recv:
      return whole<Backend>(
          s, be.rank(), c.name, [&](const Buf& h) { be.recv(h, c.root, c.tag); },
          StagedArg{c.in, false, true});
    case Coll::barrier: be.barrier(); return;
  }
}

}  // namespace detail
DDP_END_NAMESPACE
