// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace backend {

DDP_INLINE std::unique_ptr<Host> Host::create(const detail::BackendInit& init) {
  auto host = std::unique_ptr<Host>(new Host(init.rank, init.size));
  host->net_.connect(init);
  return host;
}

DDP_INLINE std::string_view Host::hierarchy() const noexcept {
  const HostHierarchy h = net_.hierarchy.kind;
  return h == HostHierarchy::slices ? "slices" : h == HostHierarchy::leaders ? "leaders" : "flat";
}

DDP_INLINE void Host::all_reduce(const detail::Buf& b, ReduceOp op) {
  const bool across = net_.hierarchy.active();
  const auto fp =
      next(detail::Coll::all_reduce, b.dtype, b.fingerprint_count(), -1, op, true, !across);
  if (across) {
    net_.hierarchy.all_reduce(scratch_, net_.single, b, op, fp, size_);
    return;
  }
  detail::all_reduce_on(t(), scratch_, b, detail::reduce_fn(b.dtype, op), &fp, &net_.single);
}

DDP_INLINE void Host::all_reduce_as(const detail::Buf& b, ReduceOp op, DType wire) {
  const detail::WireKernels k = detail::wire_kernels(wire, op);
  if (b.dtype != DType::float32 || k.reduce == nullptr)
    detail::fail(Errc::invalid_argument, "rank ", rank_, ": all_reduce_as: ", to_string(b.dtype),
                 " values carried as ", to_string(wire),
                 " are not supported; compression carries float32 as float16 or bfloat16");
  const bool across = net_.hierarchy.active();
  const auto fp =
      next(detail::Coll::all_reduce, wire, b.fingerprint_count(), -1, op, true, !across);
  const std::size_t ws = size_of(wire);
  if (across) {  // converted once each way around the hierarchical all_reduce on `wire`
    detail::Buf w = b;
    w.data = detail::RoundScratch::at_least(scratch_.wire, b.count * ws);
    w.dtype = wire;
    k.encode(w.data, b.data, b.count);
    net_.hierarchy.all_reduce(scratch_, net_.single, w, op, fp, size_);
    k.decode(b.data, w.data, b.count);
    return;
  }
  detail::all_reduce_as_on(t(), scratch_, b, k, ws, fp);
}

DDP_INLINE void Host::broadcast(const detail::Buf& b, int root) {
  const auto fp =
      next(detail::Coll::broadcast, b.dtype, b.fingerprint_count(), root, ReduceOp::sum, false);
  detail::broadcast_on(t(), b, root, &fp);
}

DDP_INLINE void Host::reduce(const detail::Buf& b, int root, ReduceOp op) {
  const auto fp = next(detail::Coll::reduce, b.dtype, b.fingerprint_count(), root, op, true);
  detail::reduce_on(t(), scratch_, b, detail::reduce_fn(b.dtype, op), root, &fp);
}

DDP_INLINE void Host::all_gather(const detail::Buf& in, const detail::Buf& out) {
  const auto fp = next(detail::Coll::all_gather, in.dtype, in.count, -1, ReduceOp::sum, false);
  detail::gather_on(t(), in, out, -1, fp);
}

DDP_INLINE void Host::gather(const detail::Buf& in, const detail::Buf& out, int root) {
  const auto fp = next(detail::Coll::gather, in.dtype, in.count, root, ReduceOp::sum, false);
  detail::gather_on(t(), in, out, root, fp);
}

DDP_INLINE void Host::scatter(const detail::Buf& in, const detail::Buf& out, int root) {
  const auto fp = next(detail::Coll::scatter, out.dtype, out.count, root, ReduceOp::sum, false);
  detail::scatter_on(t(), scratch_, in, out, root, fp);
}

DDP_INLINE void Host::reduce_scatter(const detail::Buf& in, const detail::Buf& out, ReduceOp op) {
  const auto fp = next(detail::Coll::reduce_scatter, out.dtype, out.count, -1, op, true);
  if (net_.hierarchy.active()) {  // bitwise the matching block of the hierarchical all_reduce
    net_.hierarchy.reduce_scatter(t(), scratch_, in, out, op, fp, size_);
    return;
  }
  detail::reduce_scatter_on(t(), scratch_, in, out, detail::reduce_fn(out.dtype, op), fp);
}

DDP_INLINE void Host::all_to_all(const detail::Buf& in, const detail::Buf& out) {
  const std::size_t n = in.count / static_cast<std::size_t>(size_);
  const auto fp = next(detail::Coll::all_to_all, in.dtype, n, -1, ReduceOp::sum, false);
  detail::all_to_all_on(t(), scratch_, in, out, fp);
}

DDP_INLINE void Host::all_to_all_v(const detail::Buf& in, const detail::Buf& out,
                                   std::span<const std::size_t> in_counts,
                                   std::span<const std::size_t> out_counts) {
  const auto fp = next(detail::Coll::all_to_all_v, in.dtype, 0, -1, ReduceOp::sum, false);
  detail::all_to_all_v_on(t(), scratch_, in, out, in_counts, out_counts, fp);
}

DDP_INLINE void Host::gather_v(const detail::Buf& in, const detail::Buf& out,
                               std::span<const std::size_t> counts, int root) {
  const auto c = root < 0 ? detail::Coll::all_gather_v : detail::Coll::gather_v;
  const auto fp = next(c, in.dtype, 0, root, ReduceOp::sum, false);
  detail::gather_v_on(t(), scratch_, in, out, counts, root, fp);
}

DDP_INLINE void Host::scatter_v(const detail::Buf& in, const detail::Buf& out,
                                std::span<const std::size_t> counts, int root) {
  const auto fp = next(detail::Coll::scatter_v, out.dtype, 0, root, ReduceOp::sum, false);
  detail::scatter_v_on(t(), scratch_, in, out, counts, root, fp);
}

DDP_INLINE void Host::barrier() {
  const auto fp = next(detail::Coll::barrier, DType::uint8, 0, -1, ReduceOp::sum, false);
  detail::empty_round(t(), &fp);
}

DDP_INLINE void Host::send(const detail::Buf& b, int peer, int tag) {
  t().send(b, peer, tag, send_seq_[static_cast<std::size_t>(peer)]++);
}

DDP_INLINE void Host::recv(const detail::Buf& b, int peer, int tag) {
  t().recv(b, peer, tag, recv_seq_[static_cast<std::size_t>(peer)]++);
}

DDP_INLINE void Host::abort(Errc code, const std::string& why) {
  t().abort(code, why);
  if (net_.hierarchy.local) net_.hierarchy.local->abort(code, why);
  if (net_.hierarchy.across) net_.hierarchy.across->abort(code, why);
}

DDP_INLINE void Host::abort_with(const Error& e) {
  t().abort_with(e);
  if (net_.hierarchy.local) net_.hierarchy.local->abort_with(e);
  if (net_.hierarchy.across) net_.hierarchy.across->abort_with(e);
}

DDP_INLINE Host::Host(int rank, int size)
    : rank_(rank),
      size_(size),
      net_(rank, size),
      send_seq_(static_cast<std::size_t>(size)),
      recv_seq_(static_cast<std::size_t>(size)) {}

DDP_INLINE detail::Fingerprint Host::next(detail::Coll c, DType type, std::size_t count, int root,
                                          ReduceOp op, bool has_op, bool check_locally) {
  detail::Fingerprint f;
  f.seq = seq_++;
  f.count = count;
  f.root = root;
  f.coll = c;
  f.dtype = type;
  f.op = op;
  f.has_op = has_op ? 1 : 0;
  for (detail::Transport* tr :
       {net_.transport.get(), net_.hierarchy.local.get(), net_.hierarchy.across.get()}) {
    if (tr == nullptr) continue;
    tr->current = f;
    tr->has_current = true;
  }
  if (check_locally) net_.hierarchy.check_locally(f, net_.transport.get());
  return f;
}

}  // namespace backend
DDP_END_NAMESPACE
