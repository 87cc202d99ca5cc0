// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What the typed Communicator hands to a backend: type-erased buffers, and the fingerprint
/// every collective carries so that ranks calling different collectives fail instead of hanging.

#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/types.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The largest buffer, in bytes, a collective accepts (what a pointer difference can express):
/// element counts are checked against it, so no byte size computed from them can wrap.
inline constexpr std::size_t max_buffer_bytes =
    static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max());

/// Whether total == part * p exactly, with no overflow in the product.
[[nodiscard]] constexpr bool is_product(std::size_t total, std::size_t part,
                                        std::size_t p) noexcept {
  return p != 0 && total % p == 0 && total / p == part;
}

/// "part x p = product", or that the product overflows.
[[nodiscard]] DDP_INLINE std::string product_text(std::size_t part, std::size_t p);

/// A type-erased buffer: `count` elements of `dtype`.
struct Buf {
  std::byte* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::float32;
  Device device{};
  void* stream = nullptr;
  /// For a piece of a larger elementwise collective (a CUDA buffer staged through host memory
  /// chunk by chunk): the whole buffer's element count, which the fingerprint carries so that
  /// ranks with different sizes fail on the first piece. 0: the buffer is whole.
  std::size_t whole = 0;

  [[nodiscard]] std::size_t elem() const noexcept { return size_of(dtype); }
  [[nodiscard]] std::size_t fingerprint_count() const noexcept {
    return whole != 0 ? whole : count;
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return count * size_of(dtype); }
  [[nodiscard]] std::byte* at(std::size_t element) const noexcept {
    return data + element * elem();
  }
};

enum class Coll : std::uint8_t {
  all_reduce = 1,
  broadcast = 2,
  reduce = 3,
  all_gather = 4,
  gather = 5,
  scatter = 6,
  reduce_scatter = 7,
  all_to_all = 8,
  barrier = 9,
  send = 10,
  recv = 11,
  // The uneven forms (a count per rank; backend/uneven.hpp), named as their even twins.
  all_gather_v = 12,
  gather_v = 13,
  scatter_v = 14,
  all_to_all_v = 15,
  batch_p2p = 16,  ///< batch_isend_irecv: sends and receives, no fingerprint
};

/// Whether `c` is an uneven form (its fingerprint's count is 0: the sizes are checked apart).
[[nodiscard]] constexpr bool is_uneven(Coll c) noexcept {
  return c == Coll::all_gather_v || c == Coll::gather_v || c == Coll::scatter_v ||
         c == Coll::all_to_all_v;
}

[[nodiscard]] constexpr std::string_view to_string(Coll c) noexcept {
  switch (c) {
    case Coll::all_reduce: return "all_reduce";
    case Coll::broadcast: return "broadcast";
    case Coll::reduce: return "reduce";
    case Coll::all_gather: return "all_gather";
    case Coll::gather: return "gather";
    case Coll::scatter: return "scatter";
    case Coll::reduce_scatter: return "reduce_scatter";
    case Coll::all_to_all: return "all_to_all";
    case Coll::barrier: return "barrier";
    case Coll::send: return "send";
    case Coll::recv: return "recv";
    case Coll::all_gather_v: return "all_gather";
    case Coll::gather_v: return "gather";
    case Coll::scatter_v: return "scatter";
    case Coll::all_to_all_v: return "all_to_all";
    case Coll::batch_p2p: return "batch_isend_irecv";
  }
  return "unknown collective";
}

/// What a rank says it is doing: compared across ranks at the start of every collective.
struct Fingerprint {
  std::uint64_t seq = 0;    ///< collectives issued on this communicator before this one
  std::uint64_t count = 0;  ///< elements per rank (the size of `in` for all_gather, ...)
  std::int32_t root = -1;   ///< root, or -1
  Coll coll = Coll::barrier;
  DType dtype = DType::uint8;
  ReduceOp op = ReduceOp::sum;
  std::uint8_t has_op = 0;

  friend bool operator==(const Fingerprint&, const Fingerprint&) = default;
};
static_assert(sizeof(Fingerprint) == 24);

/// The shared-memory transport's short form of a fingerprint, published in 48 bits with the
/// round number (see ShmTransport::round). It is exact, never a hash:
///  * 0: the round has no fingerprint;
///  * fingerprint_wide: a field does not fit; peers compare the full fingerprints;
///  * otherwise every field packed into a bit range of its own, injectively: coll (4 bits),
///    dtype (4), op (3), has_op (1), root + 1 (5), count (28), and the sequence number as its
///    distance (0 to 3) from `prev_seq`, the one of this rank's previous checked round.
/// Two equal codes therefore mean equal fingerprints whenever the two ranks' previous checked
/// rounds had equal fingerprints, which the transport makes sure of (a rank's first checked
/// round is always wide). `has_prev`: whether there was a previous checked round.
inline constexpr std::uint64_t fingerprint_wide = std::uint64_t{1} << 47;
[[nodiscard]] constexpr std::uint64_t fingerprint_code(const Fingerprint& f, std::uint64_t prev_seq,
                                                       bool has_prev) noexcept {
  const auto coll = static_cast<std::uint64_t>(f.coll);
  const auto dtype = static_cast<std::uint64_t>(f.dtype);
  const auto op = static_cast<std::uint64_t>(f.op);
  const std::uint64_t root1 = static_cast<std::uint64_t>(static_cast<std::int64_t>(f.root) + 1);
  const std::uint64_t delta = f.seq - prev_seq;
  if (!has_prev || f.seq < prev_seq || delta > 3 || coll == 0 || coll > 15 || dtype > 15 ||
      op > 7 || f.has_op > 1 || f.root < -1 || root1 > 31 || f.count >= (std::uint64_t{1} << 28))
    return fingerprint_wide;
  return coll | dtype << 4 | op << 8 | std::uint64_t{f.has_op} << 11 | root1 << 12 | delta << 17 |
         f.count << 19;
}

[[nodiscard]] DDP_INLINE std::string to_string(const Fingerprint& f);

/// A byte range of a rank's offer.
struct Range {
  std::size_t off = 0;
  std::size_t len = 0;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/impl/collective.ipp"
#endif
