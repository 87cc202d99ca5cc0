// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// A collective call as data, and the argument checks that build it. Communicator turns each
/// typed argument into a detail::Buf (the only code instantiated per tensor type) and hands
/// the Bufs to the prepare_* functions here: plain functions, compiled once, that check
/// everything that can be checked before anything is sent (roots, peers, tags, sizes, dtype/op
/// pairs, overlaps) and fail with Errc::invalid_argument naming the rank and the collective.
/// The resulting Call is what the executor runs and the flight recorder records.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Who checks a call: this rank in a group of `size`.
struct Caller {
  int rank = 0;
  int size = 1;
  /// The backend's refusal of an operator on a dtype (backend_traits::refuses_ops: NCCL has no
  /// bitwise reductions), or nullptr.
  const char* (*refuses_op)(ReduceOp, DType) = nullptr;
  std::string_view backend;  ///< the backend's name, for that refusal
};

/// A checked collective call.
struct Call {
  enum class Form : std::uint8_t {
    plain,      ///< `coll` on `in` (and `out`)
    as_wire,    ///< all_reduce of float32 `in` carried as `wire` (all_reduce_as)
    coalesced,  ///< all_reduce of every buffer of `many` (all_reduce_coalesced)
  };
  const char* name = "";
  Coll coll = Coll::barrier;
  Form form = Form::plain;
  Buf in{};   ///< the buffer of single-buffer collectives; `in` of the others
  Buf out{};  ///< `out` of all_gather, gather, scatter, reduce_scatter, all_to_all
  /// The buffers of all_reduce_coalesced, owned by the caller (Communicator keeps them alive
  /// until the call has run). A Call is trivially copyable: cheap to build on every call.
  std::span<const Buf> many{};
  /// The counts per rank of an uneven collective, owned like `many`: all_to_all's in_counts
  /// then out_counts; the others' counts (read where the collective reads them).
  std::span<const std::size_t> counts{};
  ReduceOp op = ReduceOp::sum;
  double factor = 1.0;  ///< premul_sum's factor (Reduction::factor)
  int root = -1;        ///< root, or the peer of send/recv
  int tag = 0;
  DType wire = DType::float32;
  std::size_t bytes = 0;  ///< this rank's buffers, for the flight recorder
};

static_assert(std::is_trivially_copyable_v<Call>);

/// Whether [a, a+an) and [b, b+bn) share a byte.
[[nodiscard]] inline bool overlaps(const std::byte* a, std::size_t an, const std::byte* b,
                                   std::size_t bn) {
  return an != 0 && bn != 0 && a < b + bn && b < a + an;
}

/// The checks of a typed argument once it is a Buf: `usable` says whether the backend can use
/// its memory (directly or staged).
DDP_INLINE void check_buf(const Buf& b, std::size_t elem, bool usable, std::string_view backend,
                          int rank, const char* what, const char* arg);

/// `op` on dtype `t`, else Errc::invalid_argument. `who` and `rank` open the message ("rank 3",
/// or "NcclClique" with rank -1); `what` names the call. (Communicators and NcclClique alike.)
DDP_INLINE void check_op(ReduceOp op, DType t, const char* who, int rank, const char* what);
/// premul_sum's factor: given (ddp::premul_sum(f), not a bare ReduceOp::premul_sum), finite, and
/// within float's range where the multiplication is in float (every dtype but float64).
DDP_INLINE void check_factor(const Reduction& r, DType t, int rank, const char* what);
inline void check_op(ReduceOp op, DType t, Caller c, const char* what) {
  check_op(op, t, "rank ", c.rank, what);
  if (c.refuses_op != nullptr) {
    if (const char* why = c.refuses_op(op, t)) [[unlikely]]
      fail(Errc::invalid_argument, "rank ", c.rank, ": backend::", c.backend, ": ", what, "(",
           to_string(t), ", op ", to_string(op), "): ", why);
  }
}

/// `root` in [0, size), else Errc::invalid_argument naming `who`/`rank` (as check_op), `what`
/// and what a root is one of (`of`: "a rank of this communicator").
DDP_INLINE void check_root(int root, int size, const char* who, int rank, const char* what,
                           const char* of);
inline void check_root(int root, Caller c, const char* what) {
  check_root(root, c.size, "rank ", c.rank, what, "a rank of this communicator");
}

DDP_INLINE void check_same_dtype(const Buf& a, const Buf& b, Caller c, const char* what);

/// The checks of a DynamicView that a TensorView passes at compile time (the device, a null
/// pointer and the size follow in check_buf, as for a TensorView).
DDP_INLINE void check_dynamic(const DynamicView& v, bool writes, const char* what, const char* arg,
                              int rank);

/// `whole` must be `part` x size() elements; `part_name` is the argument that sets the size.
DDP_INLINE void check_blocks(const Buf& whole, const Buf& part, Caller c, const char* what,
                             const char* whole_name, const char* rule);

/// The only in-place form of a collective with blocks: `part` is exactly this rank's block of
/// `whole`.
DDP_INLINE void check_in_place(const Buf& whole, const Buf& part, Caller c, const char* what,
                               const char* message);

/// The name of a single-buffer collective (all_reduce, broadcast, reduce).
constexpr const char* single_name(Coll coll) {
  return coll == Coll::all_reduce ? "all_reduce" : coll == Coll::broadcast ? "broadcast" : "reduce";
}

/// The checks of the single-buffer collectives (all_reduce, broadcast, reduce); returns the
/// collective's name. Their synchronous form runs without building a Call.
DDP_INLINE const char* check_single(Coll coll, const Buf& b, const Reduction& op, int root,
                                    Caller c);

[[nodiscard]] DDP_INLINE Call prepare_single(Coll coll, const Buf& b, Reduction op, int root,
                                             Caller c);

/// `moved_on_device`: the backend moves this CUDA buffer itself (no staging), so there is no
/// host pass in which to convert it.
[[nodiscard]] DDP_INLINE Call prepare_all_reduce_as(const Buf& b, Reduction op, DType wire,
                                                    bool moved_on_device, std::string_view backend,
                                                    Caller c);

/// `bufs` must outlive the call.
[[nodiscard]] DDP_INLINE Call prepare_all_reduce_coalesced(std::span<const Buf> bufs, Reduction op,
                                                           Caller c);

/// all_gather (root < 0) or gather; `out` is used (and checked) only where it receives.
[[nodiscard]] DDP_INLINE Call prepare_gather(const Buf& in, const Buf& out, int root, Caller c);

/// scatter; `in` is used (and checked) on the root only.
[[nodiscard]] DDP_INLINE Call prepare_scatter(const Buf& in, const Buf& out, int root, Caller c);

[[nodiscard]] DDP_INLINE Call prepare_reduce_scatter(const Buf& in, const Buf& out, Reduction op,
                                                     Caller c);

[[nodiscard]] DDP_INLINE Call prepare_all_to_all(const Buf& in, const Buf& out, Caller c);

[[nodiscard]] DDP_INLINE Call prepare_p2p(Coll coll, const Buf& b, int peer, int tag, Caller c);

/// batch_isend_irecv: bufs[i] is op i's buffer; `specs` (3 per op: 1 for a send, the peer,
/// the tag) must outlive the call. Each op is checked as send or recv is.
[[nodiscard]] DDP_INLINE Call prepare_batch_p2p(std::span<const Buf> bufs,
                                                std::span<const std::size_t> specs, Caller c);

[[nodiscard]] inline Call prepare_barrier() {
  return Call{.name = "barrier", .coll = Coll::barrier};
}

/// An uneven collective's counts: one per rank.
DDP_INLINE void check_entries(std::span<const std::size_t> counts, Caller c, const char* what,
                              const char* counts_name);

/// The counts of an uneven collective: one per rank, and `buf` holding their sum.
DDP_INLINE void check_counts(std::span<const std::size_t> counts, const Buf& buf, Caller c,
                             const char* what, const char* counts_name, const char* buf_name);

/// all_to_all with split sizes; `counts` holds in_counts then out_counts (size() each).
[[nodiscard]] DDP_INLINE Call prepare_all_to_all_v(const Buf& in, const Buf& out,
                                                   std::span<const std::size_t> counts, Caller c);

/// all_gather (root < 0) or gather with a count per rank; `out` and `counts` are used (and
/// checked) only where they receive.
[[nodiscard]] DDP_INLINE Call prepare_gather_v(const Buf& in, const Buf& out,
                                               std::span<const std::size_t> counts, int root,
                                               Caller c);

/// scatter with a count per rank; `in` and `counts` are used (and checked) on the root only.
[[nodiscard]] DDP_INLINE Call prepare_scatter_v(const Buf& in, const Buf& out,
                                                std::span<const std::size_t> counts, int root,
                                                Caller c);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/call.ipp"
#endif
