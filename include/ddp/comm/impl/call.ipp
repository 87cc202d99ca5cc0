// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/call.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void check_buf(const Buf& b, std::size_t elem, bool usable, std::string_view backend,
                          int rank, const char* what, const char* arg) {
  if (!usable) {
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `", arg, "` is on ",
         to_string(b.device), ", but backend::", backend, " cannot use that memory");
  }
  if (b.data == nullptr && b.count != 0) {
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `", arg, "` has ", b.count,
         " elements but no data");
  }
  if (b.count > max_buffer_bytes / elem) {
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `", arg, "` claims ", b.count,
         " elements of ", elem,
         " bytes: more than any buffer can hold (its size in bytes overflows); check the size "
         "the tensor's view reports");
  }
}

DDP_INLINE void check_op(ReduceOp op, DType t, const char* who, int rank, const char* what) {
  if (!is_supported(op, t)) {
    const bool bitwise = op == ReduceOp::band || op == ReduceOp::bor || op == ReduceOp::bxor;
    fail(Errc::invalid_argument, who, rank >= 0 ? concat(rank) : std::string(), ": ", what, ": op ",
         is_valid(op) ? std::string(to_string(op))
                      : concat("code ", static_cast<int>(op), " (not a ddp::ReduceOp)"),
         " is not defined on ", to_string(t),
         op == ReduceOp::avg          ? " (avg needs a floating-point type)"
         : op == ReduceOp::premul_sum ? " (premul_sum needs a floating-point type: multiply "
                                        "integers yourself and use sum)"
         : bitwise                    ? " (band, bor and bxor need integers or bool)"
                                      : "");
  }
}

DDP_INLINE void check_factor(const Reduction& r, DType t, int rank, const char* what) {
  if (r.op != ReduceOp::premul_sum) return;
  if (r.factor != r.factor)
    fail(Errc::invalid_argument, "rank ", rank, ": ", what,
         ": ReduceOp::premul_sum has no factor (or a NaN one); pass ddp::premul_sum(factor)");
  const double limit = t == DType::float64 ? std::numeric_limits<double>::max()
                                           : static_cast<double>(std::numeric_limits<float>::max());
  if (r.factor > limit || r.factor < -limit)
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": premul_sum's factor ", r.factor,
         " is not a finite ", t == DType::float64 ? "double" : "float",
         " (the inputs are multiplied in that precision); give a finite factor");
}

DDP_INLINE void check_root(int root, int size, const char* who, int rank, const char* what,
                           const char* of) {
  if (root < 0 || root >= size) {
    fail(Errc::invalid_argument, who, rank >= 0 ? concat(rank) : std::string(), ": ", what,
         ": root ", root, " is not ", of, " [0, ", size, ")");
  }
}

DDP_INLINE void check_same_dtype(const Buf& a, const Buf& b, Caller c, const char* what) {
  if (a.dtype != b.dtype) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": `in` is ", to_string(a.dtype),
         " but `out` is ", to_string(b.dtype), "; they must have the same element type");
  }
}

DDP_INLINE void check_dynamic(const DynamicView& v, bool writes, const char* what, const char* arg,
                              int rank) {
  if (v.problem != nullptr)
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `", arg,
         "` cannot be used: ", v.problem);
  if (!is_valid(v.dtype))
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `", arg, "` has dtype code ",
         static_cast<int>(v.dtype), ", which is not a ddp::DType (its adapter is wrong)");
  if (!v.contiguous)
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `", arg,
         "` is not contiguous (a slice, a transpose or an expanded tensor); pass a contiguous "
         "tensor (e.g. t.contiguous()) and copy the result back where it was written");
  if (writes && v.read_only)
    fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `", arg,
         "` is read-only, but this collective writes it");
}

DDP_INLINE void check_blocks(const Buf& whole, const Buf& part, Caller c, const char* what,
                             const char* whole_name, const char* rule) {
  const auto p = static_cast<std::size_t>(c.size);
  if (!is_product(whole.count, part.count, p)) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": `", whole_name, "` has ",
         whole.count, " elements but must have ", product_text(part.count, p), " (", rule, ")");
  }
}

DDP_INLINE void check_in_place(const Buf& whole, const Buf& part, Caller c, const char* what,
                               const char* message) {
  const std::byte* mine = whole.at(part.count * static_cast<std::size_t>(c.rank));
  if (overlaps(part.data, part.bytes(), whole.data, whole.bytes()) && part.data != mine) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, message);
  }
}

DDP_INLINE const char* check_single(Coll coll, const Buf& b, const Reduction& op, int root,
                                    Caller c) {
  const char* name = single_name(coll);
  if (coll != Coll::all_reduce) check_root(root, c, name);
  if (coll != Coll::broadcast) {
    check_op(op.op, b.dtype, c, name);
    check_factor(op, b.dtype, c.rank, name);
  }
  return name;
}

DDP_INLINE Call prepare_single(Coll coll, const Buf& b, Reduction op, int root, Caller c) {
  const char* name = check_single(coll, b, op, root, c);
  return Call{.name = name,
              .coll = coll,
              .in = b,
              .op = op.op,
              .factor = op.factor,
              .root = root,
              .bytes = b.bytes()};
}

DDP_INLINE Call prepare_all_reduce_as(const Buf& b, Reduction op, DType wire, bool moved_on_device,
                                      std::string_view backend, Caller c) {
  check_op(op.op, wire, c, "all_reduce_as");
  check_factor(op, DType::float32, c.rank, "all_reduce_as");
  if (b.dtype != DType::float32)
    fail(Errc::invalid_argument, "rank ", c.rank, ": all_reduce_as: `buf` is ", to_string(b.dtype),
         "; compression carries float32 values");
  if (moved_on_device)
    fail(Errc::unsupported, "rank ", c.rank, ": all_reduce_as: `buf` is on ", to_string(b.device),
         ", which backend::", backend,
         " moves itself, and ddp's headers carry no GPU kernels to convert it; use all_reduce, or "
         "convert on the device first");
  return Call{.name = "all_reduce_as",
              .coll = Coll::all_reduce,
              .form = Call::Form::as_wire,
              .in = b,
              .op = op.op,
              .factor = op.factor,
              .wire = wire,
              .bytes = b.bytes()};
}

DDP_INLINE Call prepare_all_reduce_coalesced(std::span<const Buf> bufs, Reduction op, Caller c) {
  std::size_t bytes = 0;
  for (const Buf& b : bufs) {
    check_op(op.op, b.dtype, c, "all_reduce_coalesced");
    check_factor(op, b.dtype, c.rank, "all_reduce_coalesced");
    bytes += b.bytes();
  }
  return Call{.name = "all_reduce_coalesced",
              .coll = Coll::all_reduce,
              .form = Call::Form::coalesced,
              .many = bufs,
              .op = op.op,
              .factor = op.factor,
              .bytes = bytes};
}

DDP_INLINE Call prepare_gather(const Buf& in, const Buf& out, int root, Caller c) {
  const char* what = root < 0 ? "all_gather" : "gather";
  if (root >= 0) check_root(root, c, what);
  Call call{.name = what, .coll = root < 0 ? Coll::all_gather : Coll::gather};
  call.in = in;
  call.root = root;
  if (root < 0 || root == c.rank) {
    check_same_dtype(in, out, c, what);
    check_blocks(out, in, c, what, "out", "in.size() x size()");
    check_in_place(out, in, c, what,
                   ": `in` overlaps `out` but is not this rank's block of it (the only in-place "
                   "form)");
    call.out = out;
  }
  call.bytes = call.in.bytes() + call.out.bytes();
  return call;
}

DDP_INLINE Call prepare_scatter(const Buf& in, const Buf& out, int root, Caller c) {
  check_root(root, c, "scatter");
  Call call{.name = "scatter", .coll = Coll::scatter};
  call.in = Buf{nullptr, 0, out.dtype, out.device, nullptr};
  call.out = out;
  call.root = root;
  if (c.rank == root) {
    check_same_dtype(in, out, c, "scatter");
    check_blocks(in, out, c, "scatter", "in", "out.size() x size()");
    check_in_place(in, out, c, "scatter",
                   ": `out` overlaps `in` but is not this rank's block of it (the only in-place "
                   "form)");
    call.in = in;
  }
  call.bytes = call.in.bytes() + call.out.bytes();
  return call;
}

DDP_INLINE Call prepare_reduce_scatter(const Buf& in, const Buf& out, Reduction op, Caller c) {
  check_same_dtype(in, out, c, "reduce_scatter");
  check_op(op.op, out.dtype, c, "reduce_scatter");
  check_factor(op, out.dtype, c.rank, "reduce_scatter");
  check_blocks(in, out, c, "reduce_scatter", "in", "out.size() x size()");
  check_in_place(in, out, c, "reduce_scatter",
                 ": `out` overlaps `in` but is not this rank's block of it (the only in-place "
                 "form)");
  Call call{.name = "reduce_scatter", .coll = Coll::reduce_scatter};
  call.in = in;
  call.out = out;
  call.op = op.op;
  call.factor = op.factor;
  call.bytes = in.bytes() + out.bytes();
  return call;
}

DDP_INLINE Call prepare_all_to_all(const Buf& in, const Buf& out, Caller c) {
  check_same_dtype(in, out, c, "all_to_all");
  const auto p = static_cast<std::size_t>(c.size);
  if (in.count != out.count || in.count % p != 0) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": all_to_all: `in` (", in.count, ") and `out` (",
         out.count, ") must have the same number of elements, a multiple of size() = ", p);
  }
  if (overlaps(in.data, in.bytes(), out.data, out.bytes())) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": all_to_all: `in` and `out` must not overlap");
  }
  Call call{.name = "all_to_all", .coll = Coll::all_to_all};
  call.in = in;
  call.out = out;
  call.bytes = in.bytes() + out.bytes();
  return call;
}

DDP_INLINE Call prepare_p2p(Coll coll, const Buf& b, int peer, int tag, Caller c) {
  const char* what = coll == Coll::send ? "send" : "recv";
  if (peer < 0 || peer >= c.size || peer == c.rank) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": peer ", peer,
         " must be another rank in [0, ", c.size, ")");
  }
  if (tag < 0)
    fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": tag ", tag, " is negative");
  Call call{.name = what, .coll = coll};
  call.in = b;
  call.root = peer;
  call.tag = tag;
  call.bytes = b.bytes();
  return call;
}

DDP_INLINE Call prepare_batch_p2p(std::span<const Buf> bufs, std::span<const std::size_t> specs,
                                  Caller c) {
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    (void)prepare_p2p(specs[3 * i] != 0 ? Coll::send : Coll::recv, bufs[i],
                      static_cast<int>(specs[3 * i + 1]), static_cast<int>(specs[3 * i + 2]), c);
    bytes += bufs[i].bytes();
  }
  // A receive writes its buffer while the batch runs: no other op may use that memory (the
  // result would depend on the order of the pairs).
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    for (std::size_t j = 0; j < bufs.size(); ++j) {
      if (i != j && specs[3 * i] == 0 && (specs[3 * j] != 0 || j > i) &&
          overlaps(bufs[i].data, bufs[i].bytes(), bufs[j].data, bufs[j].bytes())) {
        fail(Errc::invalid_argument, "rank ", c.rank, ": batch_isend_irecv: op ", i,
             " (a recv) and op ", j, specs[3 * j] != 0 ? " (a send)" : " (a recv)",
             " use overlapping memory; give each receive a buffer of its own");
      }
    }
  }
  return Call{.name = "batch_isend_irecv",
              .coll = Coll::batch_p2p,
              .many = bufs,
              .counts = specs,
              .bytes = bytes};
}

DDP_INLINE void check_entries(std::span<const std::size_t> counts, Caller c, const char* what,
                              const char* counts_name) {
  if (counts.size() != static_cast<std::size_t>(c.size)) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": `", counts_name, "` has ",
         counts.size(), " entries but must have one per rank (", c.size, ")");
  }
  for (std::size_t j = 0; j < counts.size(); ++j) {
    if (counts[j] > static_cast<std::size_t>(PTRDIFF_MAX)) {  // a negative count, converted
      fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": `", counts_name, "`[", j,
           "] is ", counts[j], " (", static_cast<long long>(counts[j]),
           " converted to std::size_t): a count is a number of elements, 0 or more");
    }
  }
}

DDP_INLINE void check_counts(std::span<const std::size_t> counts, const Buf& buf, Caller c,
                             const char* what, const char* counts_name, const char* buf_name) {
  check_entries(counts, c, what, counts_name);
  std::size_t total = 0;
  bool overflow = false;
  for (const std::size_t n : counts) {
    overflow = overflow || n > ~std::size_t{0} - total;
    if (!overflow) total += n;
  }
  if (overflow || total != buf.count) {
    fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": `", buf_name, "` has ", buf.count,
         " elements but the `", counts_name, "` add up to ",
         overflow ? std::string("more than any buffer holds") : std::to_string(total),
         "; they must be equal");
  }
}

DDP_INLINE Call prepare_all_to_all_v(const Buf& in, const Buf& out,
                                     std::span<const std::size_t> counts, Caller c) {
  check_same_dtype(in, out, c, "all_to_all");
  const auto p = static_cast<std::size_t>(c.size);
  check_counts(counts.first(std::min(p, counts.size())), in, c, "all_to_all", "in_counts", "in");
  check_counts(counts.subspan(std::min(p, counts.size())), out, c, "all_to_all", "out_counts",
               "out");
  if (overlaps(in.data, in.bytes(), out.data, out.bytes()))
    fail(Errc::invalid_argument, "rank ", c.rank, ": all_to_all: `in` and `out` must not overlap");
  return Call{.name = "all_to_all",
              .coll = Coll::all_to_all_v,
              .in = in,
              .out = out,
              .counts = counts,
              .bytes = in.bytes() + out.bytes()};
}

DDP_INLINE Call prepare_gather_v(const Buf& in, const Buf& out, std::span<const std::size_t> counts,
                                 int root, Caller c) {
  const char* what = root < 0 ? "all_gather" : "gather";
  if (root >= 0) check_root(root, c, what);
  if (root < 0 || root == c.rank) {
    check_same_dtype(in, out, c, what);
    check_counts(counts, out, c, what, "counts", "out");
    if (counts[static_cast<std::size_t>(c.rank)] != in.count)
      fail(Errc::invalid_argument, "rank ", c.rank, ": ", what, ": `in` has ", in.count,
           " elements but counts[", c.rank, "] (this rank's) is ",
           counts[static_cast<std::size_t>(c.rank)], "; they must be equal");
    if (overlaps(in.data, in.bytes(), out.data, out.bytes()))
      fail(Errc::invalid_argument, "rank ", c.rank, ": ", what,
           ": `in` and `out` must not overlap");
  }
  return Call{.name = what,
              .coll = root < 0 ? Coll::all_gather_v : Coll::gather_v,
              .in = in,
              .out = out,
              .counts = counts,
              .root = root,
              .bytes = in.bytes() + out.bytes()};
}

DDP_INLINE Call prepare_scatter_v(const Buf& in, const Buf& out,
                                  std::span<const std::size_t> counts, int root, Caller c) {
  check_root(root, c, "scatter");
  if (root == c.rank) {
    check_same_dtype(in, out, c, "scatter");
    check_counts(counts, in, c, "scatter", "counts", "in");
    if (counts[static_cast<std::size_t>(c.rank)] != out.count)
      fail(Errc::invalid_argument, "rank ", c.rank, ": scatter: `out` has ", out.count,
           " elements but counts[", c.rank, "] (this rank's) is ",
           counts[static_cast<std::size_t>(c.rank)], "; they must be equal");
    if (overlaps(in.data, in.bytes(), out.data, out.bytes()))
      fail(Errc::invalid_argument, "rank ", c.rank, ": scatter: `in` and `out` must not overlap");
  }
  return Call{.name = "scatter",
              .coll = Coll::scatter_v,
              .in = in,
              .out = out,
              .counts = counts,
              .root = root,
              .bytes = in.bytes() + out.bytes()};
}

}  // namespace detail
DDP_END_NAMESPACE
