// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How Communicator's object collectives (all_gather_object, gather_object, broadcast_object,
/// scatter_object)
/// and small host-value helpers (all_reduce_host, broadcast_host) are made: written on the public
/// collectives, the way torch.distributed layers its object collectives above the ProcessGroup.
/// The spelling users call is the member (`comm.all_gather_object(value)`); these are its insides.
///
/// Objects travel as bytes made by ddp::codec (never executed); a rank's object may encode to at
/// most 1 GiB. On a backend that moves device memory only (backend::Nccl) host data travels
/// through a device copy, so code above the Communicator works on every backend alike.

#include "ddp/codec.hpp"
#include "ddp/comm/call.hpp"
#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/types.hpp"
#if DDP_HAS_CUDA
#include "ddp/cuda.hpp"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {

inline constexpr std::int64_t max_object_bytes = std::int64_t{1} << 30;

DDP_INLINE void check_object_size(std::int64_t n, int rank, const char* what, int from);

/// Runs f(a, b) on host spans; on a backend that moves device memory only, on device copies of
/// them instead, copied back afterwards. For small host data (object collectives, *_host).
template <class Comm, class E, class F>
void on_host_data(Comm& comm, std::span<E> a, std::span<E> b, const F& f) {
  if constexpr (Comm::device_only) {
#if DDP_HAS_CUDA
    const int device = comm.backend().device();
    const CudaDeviceGuard current(device);
    CudaBuffer<E> da(std::span<const E>(a), device), db(std::span<const E>(b), device);
    f(da, db);
    if (!a.empty()) da.copy_to(a);
    if (!b.empty()) db.copy_to(b);
#else
    static_assert(!Comm::device_only, "a CUDA backend without DDP_HAS_CUDA");
    (void)comm, (void)a, (void)b, (void)f;
#endif
  } else {
    (void)comm;
    f(a, b);
  }
}

/// decode_object of what rank `from` sent to this rank `rank` in object collective `what`: a
/// failure says which ranks and call, and what it means (Errc::mismatch).
template <class T>
T decode_received(int rank, const char* what, int from, const void* data, std::size_t n) {
  try {
    return decode_object<T>(data, n);
  } catch (const Error& e) {
    fail(Errc::mismatch, "rank ", rank, ": ", what, ": what rank ", from,
         " sent does not decode as the type this rank passed (", e.what(),
         "): the ranks called different object collectives here (one rank skipped a call, or "
         "called another), or passed different types; every rank must make the same calls with "
         "the same types");
  }
}

template <class T, class Comm>
std::vector<T> gather_objects(Comm& comm, const T& value, int root) {
  const char* what = root < 0 ? "all_gather_object" : "gather_object";
  if (root >= 0)
    check_root(root, comm.size(), "rank ", comm.rank(), what, "a rank of this communicator");
  const std::string mine = encode_object(value);
  const auto p = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> sizes(p);
  std::int64_t my_size = static_cast<std::int64_t>(mine.size());
  on_host_data(comm, std::span<std::int64_t>(&my_size, 1), std::span<std::int64_t>(sizes),
               [&](auto& in, auto& out) { comm.all_gather(in, out); });
  std::int64_t longest = 0;
  for (std::size_t r = 0; r < p; ++r) {
    check_object_size(sizes[r], comm.rank(), what, static_cast<int>(r));
    longest = std::max(longest, sizes[r]);
  }
  const auto width = static_cast<std::size_t>(longest);
  std::vector<std::uint8_t> padded(width);
  if (!mine.empty()) std::memcpy(padded.data(), mine.data(), mine.size());
  const bool receives = root < 0 || root == comm.rank();
  std::vector<std::uint8_t> all(receives ? width * p : 0);
  on_host_data(comm, std::span<std::uint8_t>(padded), std::span<std::uint8_t>(all),
               [&](auto& in, auto& out) {
                 if (root < 0)
                   comm.all_gather(in, out);
                 else
                   comm.gather(in, out, root);
               });
  std::vector<T> out;
  if (!receives) return out;
  out.reserve(p);
  for (std::size_t r = 0; r < p; ++r) {
    out.push_back(decode_received<T>(comm.rank(), root < 0 ? "all_gather_object" : "gather_object",
                                     static_cast<int>(r), all.data() + r * width,
                                     static_cast<std::size_t>(sizes[r])));
  }
  return out;
}

/// all_reduce of a few host values (counts, flags, metrics) on any backend: on one that moves
/// device memory only (backend::Nccl) they travel through a device copy, so code above the
/// Communicator (exact_mean, sync_batch_stats, ZeroFirstGuard) works on every backend alike.
/// For large data use all_reduce on the backend's own kind of buffer.
template <class Comm, Scalar E>
void all_reduce_host(Comm& comm, std::span<E> values, ReduceOp op = ReduceOp::sum) {
  on_host_data(comm, values, std::span<E>(), [&](auto& v, auto&) { comm.all_reduce(v, op); });
}

/// broadcast of a few host values on any backend (see all_reduce_host).
template <class Comm, Scalar E>
void broadcast_host(Comm& comm, std::span<E> values, int root) {
  on_host_data(comm, values, std::span<E>(), [&](auto& v, auto&) { comm.broadcast(v, root); });
}

/// Every rank's value, in rank order.
template <Encodable T, class Comm>
[[nodiscard]] std::vector<T> all_gather_object(Comm& comm, const T& value) {
  return gather_objects<T>(comm, value, -1);
}

/// Every rank's value on root (in rank order); an empty vector on the other ranks.
template <Encodable T, class Comm>
[[nodiscard]] std::vector<T> gather_object(Comm& comm, const T& value, int root = 0) {
  return gather_objects<T>(comm, value, root);
}

/// Replaces `value` on every rank with root's.
template <Encodable T, class Comm>
void broadcast_object(Comm& comm, T& value, int root = 0) {
  check_root(root, comm.size(), "rank ", comm.rank(), "broadcast_object",
             "a rank of this communicator");
  std::string bytes;
  if (comm.rank() == root) bytes = encode_object(value);
  std::int64_t n = static_cast<std::int64_t>(bytes.size());
  broadcast_host(comm, std::span<std::int64_t>(&n, 1), root);
  check_object_size(n, comm.rank(), "broadcast_object", root);
  bytes.resize(static_cast<std::size_t>(n));
  broadcast_host(
      comm, std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(bytes.data()), bytes.size()),
      root);
  if (comm.rank() != root)
    value = decode_received<T>(comm.rank(), "broadcast_object", root, bytes.data(), bytes.size());
}

/// Rank j's entry of root's `objects` (one per rank) on rank j. A root with the wrong number of
/// objects fails, and so does every other rank, saying so (never a hang).
template <Encodable T, class Comm>
[[nodiscard]] T scatter_object(Comm& comm, const std::vector<T>& objects, int root = 0) {
  const auto p = static_cast<std::size_t>(comm.size());
  check_root(root, comm.size(), "rank ", comm.rank(), "scatter_object",
             "a rank of this communicator");
  constexpr std::int64_t wrong_count = -2;  // what every rank receives when root's list is wrong
  std::vector<std::int64_t> sizes(comm.rank() == root ? p : 0);
  std::vector<std::uint8_t> bytes;
  if (comm.rank() == root) {
    if (objects.size() != p) {
      std::fill(sizes.begin(), sizes.end(), wrong_count);
    } else {
      for (std::size_t j = 0; j < p; ++j) {
        const std::string e = encode_object(objects[j]);
        sizes[j] = static_cast<std::int64_t>(e.size());
        check_object_size(sizes[j], comm.rank(), "scatter_object", root);
        bytes.insert(bytes.end(), e.begin(), e.end());
      }
    }
  }
  std::int64_t n = 0;
  on_host_data(comm, std::span<std::int64_t>(sizes), std::span<std::int64_t>(&n, 1),
               [&](auto& in, auto& out) { comm.scatter(in, out, root); });
  if (n == wrong_count) {
    fail(Errc::invalid_argument, "rank ", comm.rank(), ": scatter_object: the root (rank ", root,
         ") passed ",
         comm.rank() == root ? std::to_string(objects.size()) : std::string("a wrong number of"),
         " objects, but it must pass one per rank (", p, ")");
  }
  check_object_size(n, comm.rank(), "scatter_object", root);
  std::vector<std::size_t> counts(sizes.begin(), sizes.end());
  std::vector<std::uint8_t> mine(static_cast<std::size_t>(n));
  on_host_data(comm, std::span<std::uint8_t>(bytes), std::span<std::uint8_t>(mine),
               [&](auto& in, auto& out) { comm.scatter(in, out, counts, root); });
  return decode_received<T>(comm.rank(), "scatter_object", root, mine.data(), mine.size());
}

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/objects.ipp"
#endif
