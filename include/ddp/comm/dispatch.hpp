// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How Communicator runs a call on its backend: detail::dispatch maps a detail::Call to the
/// backend's member of the collective (all_reduce_many where the backend reduces several buffers
/// at once, all_reduce_as where it converts the wire type itself, else the conversion around a
/// plain all_reduce), staging CUDA buffers through pinned host memory when the backend moves
/// host memory only (comm/staging.hpp).

#include "ddp/backend/backend.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/backend/reduce.hpp"
#include "ddp/comm/call.hpp"
#include "ddp/comm/state.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
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
/// CUDA buffer this backend cannot use (see comm/staging.hpp).
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

/// premul_sum's first step where the backend has none of its own: this rank's values in `h`
/// (host memory) multiplied by `factor`.
DDP_INLINE void premultiply(const Buf& h, double factor, int rank, const char* what);

/// A copy of `h`'s bytes, for premul_sum where the input must stay as it is (reduce's non-root
/// ranks, reduce_scatter's `in`).
struct ScaledCopy {
  std::vector<std::byte> bytes;
  Buf buf;
  ScaledCopy(const Buf& h, double factor, int rank, const char* what)
      : bytes(h.data, h.data + h.bytes()), buf(h) {
    buf.data = bytes.data();
    premultiply(buf, factor, rank, what);
  }
};

/// all_reduce of `h` with `r`: premul_sum's factor applied by the backend where it can
/// (backend_traits::premultiplies), else to this rank's values first.
template <class Backend>
void all_reduce_with(Backend& be, const Buf& h, const Reduction& r, const char* what) {
  if (r.op == ReduceOp::premul_sum) {
    if constexpr (backend_traits<Backend>::premultiplies) return be.all_reduce(h, r.op, r.factor);
    premultiply(h, r.factor, be.rank(), what);
  }
  be.all_reduce(h, r.op);
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
void run_single(Backend& be, CommState& s, Coll coll, const Buf& b, Reduction r, int root) {
  const bool mine = be.rank() == root;
  switch (coll) {
    case Coll::all_reduce:
      return elementwise<Backend>(s, b, true, true,
                                  [&](const Buf& h) { all_reduce_with(be, h, r, "all_reduce"); });
    case Coll::broadcast:
      return elementwise<Backend>(s, b, mine, !mine, [&](const Buf& h) { be.broadcast(h, root); });
    default:
      return elementwise<Backend>(s, b, true, mine, [&](const Buf& h) {
        if (r.op != ReduceOp::premul_sum) return be.reduce(h, root, r.op);
        if constexpr (backend_traits<Backend>::premultiplies) {
          be.reduce(h, root, r.op, r.factor);
        } else if (mine || staged<Backend>(b)) {  // root's result overwrites it; a staged copy
          premultiply(h, r.factor, be.rank(), "reduce");
          be.reduce(h, root, r.op);
        } else {  // a non-root rank's buffer stays as it is
          be.reduce(ScaledCopy(h, r.factor, be.rank(), "reduce").buf, root, r.op);
        }
      });
  }
}

/// batch_isend_irecv's operations, one pair at a time in an order that cannot deadlock whatever
/// the batches of the other ranks hold (as long as each op has its match): with each peer in
/// increasing order, the lower rank of the pair sends first, then receives; the higher rank
/// receives first. Ops of one direction with one peer keep their order (they match in order).
template <class Backend>
void run_batch_p2p(Backend& be, CommState& s, const Call& c) {
  const auto op = [&](std::size_t i) {
    return std::pair{c.counts[3 * i] != 0, static_cast<int>(c.counts[3 * i + 1])};
  };
  std::vector<std::size_t> order(c.many.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  const int me = be.rank();
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const auto [sa, pa] = op(a);
    const auto [sb, pb] = op(b);
    const auto phase = [&](bool send, int peer) { return (me < peer) == send ? 0 : 1; };
    return pa != pb ? pa < pb : phase(sa, pa) < phase(sb, pb);
  });
  for (const std::size_t i : order) {
    const bool send = c.counts[3 * i] != 0;  // not a structured binding: lambdas capture these
    const int peer = static_cast<int>(c.counts[3 * i + 1]);
    const int tag = static_cast<int>(c.counts[3 * i + 2]);
    whole<Backend>(
        s, me, c.name,
        [&](const Buf& h) {
          if (send)
            be.send(h, peer, tag);
          else
            be.recv(h, peer, tag);
        },
        StagedArg{c.many[i], send, !send});
  }
}

/// An uneven collective on a backend without its own (backend_traits::uneven): one message per
/// pair that exchanges elements, in batch_isend_irecv's order; each receive checks the count
/// the sender sent (Errc::mismatch where they disagree).
template <class Backend>
void run_uneven_by_pairs(Backend& be, CommState& s, const Call& c, const Buf& in, const Buf& out) {
  const int p = be.size(), me = be.rank(), root = c.root;
  const auto at = [](const Buf& b, std::span<const std::size_t> counts, int j) {
    std::size_t off = 0;
    for (int k = 0; k < j; ++k) off += counts[static_cast<std::size_t>(k)];
    return Buf{b.data == nullptr ? nullptr : b.at(off), counts[static_cast<std::size_t>(j)],
               b.dtype, b.device, b.stream};
  };
  const std::size_t half = c.counts.size() / 2;
  const auto piece = [&](bool sending, int j) -> Buf {  // what goes to / comes from rank j
    const Buf& b = sending ? in : out;
    switch (c.coll) {
      case Coll::all_to_all_v:
        return at(b, sending ? c.counts.first(half) : c.counts.subspan(half), j);
      case Coll::scatter_v:
        if (sending) return me == root ? at(in, c.counts, j) : Buf{};
        return j == root ? out : Buf{};
      default:  // all_gather_v (root < 0), gather_v
        if (sending) return root < 0 || j == root ? in : Buf{};
        return root < 0 || me == root ? at(out, c.counts, j) : Buf{};
    }
  };
  const auto involved = [&](bool sending, int j) {
    switch (c.coll) {
      case Coll::gather_v: return sending ? j == root : me == root;
      case Coll::scatter_v: return sending ? me == root : j == root;
      default: return true;  // all_to_all_v, all_gather_v
    }
  };
  if (involved(true, me)) {  // this rank's own block
    if constexpr (backend_traits<Backend>::device_only) {
      fail(Errc::unsupported, "rank ", me, ": ", c.name, ": backend::", Backend::name,
           " has no collectives with a count per rank (all_to_all_v, gather_v, scatter_v)");
    } else {
      const Buf mine = piece(true, me), back = piece(false, me);
      if (mine.count != 0) std::memcpy(back.data, mine.data, mine.bytes());
    }
  }
  std::vector<Buf> bufs;
  std::vector<std::size_t> specs;
  for (int j = 0; j < p; ++j) {
    for (const bool sending : {true, false}) {
      if (j == me || !involved(sending, j)) continue;
      bufs.push_back(piece(sending, j));
      specs.insert(specs.end(), {sending ? 1u : 0u, static_cast<std::size_t>(j), 0u});
    }
  }
  Call batch = c;
  batch.many = bufs;
  batch.counts = specs;
  run_batch_p2p(be, s, batch);
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
        if constexpr (backend_traits<Backend>::reduces_many &&
                      backend_traits<Backend>::premultiplies) {
          be.all_reduce_many(c.many, c.op, c.factor);
        } else if constexpr (backend_traits<Backend>::reduces_many) {
          be.all_reduce_many(c.many, c.op);
        } else {
          for (const Buf& b : c.many)
            elementwise<Backend>(s, b, true, true, [&](const Buf& h) {
              all_reduce_with(be, h, {c.op, c.factor}, c.name);
            });
        }
      } else if (c.form == Call::Form::as_wire) {
        elementwise<Backend>(s, c.in, true, true, [&](const Buf& h) {
          if (c.op == ReduceOp::premul_sum) premultiply(h, c.factor, be.rank(), c.name);
          if (c.wire == DType::float16)
            all_reduce_as_wire<half>(be, h, c.op);
          else
            all_reduce_as_wire<bfloat16>(be, h, c.op);
        });
      } else {
        run_single(be, s, c.coll, c.in, {c.op, c.factor}, c.root);
      }
      return;
    case Coll::broadcast:
    case Coll::reduce: return run_single(be, s, c.coll, c.in, {c.op, c.factor}, c.root);
    case Coll::all_gather: return in_out([&](const Buf& i, const Buf& o) { be.all_gather(i, o); });
    case Coll::gather: return in_out([&](const Buf& i, const Buf& o) { be.gather(i, o, c.root); });
    case Coll::scatter:
      return in_out([&](const Buf& i, const Buf& o) { be.scatter(i, o, c.root); });
    case Coll::reduce_scatter:
      return in_out([&](const Buf& i, const Buf& o) {
        if (c.op != ReduceOp::premul_sum) return be.reduce_scatter(i, o, c.op);
        if constexpr (backend_traits<Backend>::premultiplies)
          be.reduce_scatter(i, o, c.op, c.factor);
        else  // `in` stays as it is
          be.reduce_scatter(ScaledCopy(i, c.factor, be.rank(), c.name).buf, o, c.op);
      });
    case Coll::all_to_all: return in_out([&](const Buf& i, const Buf& o) { be.all_to_all(i, o); });
    case Coll::all_to_all_v:
    case Coll::all_gather_v:
    case Coll::gather_v:
    case Coll::scatter_v:
      return in_out([&](const Buf& i, const Buf& o) {
        if constexpr (backend_traits<Backend>::uneven) {
          const std::size_t p = c.counts.size() / 2;
          if (c.coll == Coll::all_to_all_v)
            be.all_to_all_v(i, o, c.counts.first(p), c.counts.subspan(p));
          else if (c.coll == Coll::scatter_v)
            be.scatter_v(i, o, c.counts, c.root);
          else
            be.gather_v(i, o, c.counts, c.root);
        } else {
          run_uneven_by_pairs(be, s, c, i, o);
        }
      });
    case Coll::send:
      return whole<Backend>(
          s, be.rank(), c.name, [&](const Buf& h) { be.send(h, c.root, c.tag); },
          StagedArg{c.in, true, false});
    case Coll::recv:
      return whole<Backend>(
          s, be.rank(), c.name, [&](const Buf& h) { be.recv(h, c.root, c.tag); },
          StagedArg{c.in, false, true});
    case Coll::barrier: be.barrier(); return;
    case Coll::batch_p2p: return run_batch_p2p(be, s, c);
  }
}

/// Communicator::monitored_barrier: over the rendezvous store where there is one, else the
/// backend's own, else refused (a world of one passes).
template <class Backend>
void run_monitored_barrier(Backend& be, CommState& st, std::chrono::milliseconds timeout,
                           bool wait_all_ranks) {
  if (st.store)
    st.monitored_barrier(be.rank(), be.size(), timeout, wait_all_ranks);
  else if constexpr (requires { be.monitored_barrier(timeout, wait_all_ranks); })
    be.monitored_barrier(timeout, wait_all_ranks);
  else if (be.size() > 1)
    fail(Errc::unsupported, "rank ", be.rank(), ": monitored_barrier: backend::", Backend::name,
         " has no store here; use barrier()");
}

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/dispatch.ipp"
#endif
