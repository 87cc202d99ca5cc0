// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The backend contract: what Communicator<Backend> needs from a backend, in one place.
///
///  * `CommBackend<B>`: the required part — `B::create(BackendInit)`, the group's shape (rank,
///    size, local rank/size/leader), `B::supports(Device)`, every collective on type-erased
///    buffers (detail::Buf), barrier and abort.
///  * `BackendInit`: what every backend is created from (rank, size, local rank, the
///    communicator's namespace in the rendezvous store, the Options).
///  * `backend_traits<B>`: the optional capabilities, each detected from the backend's members,
///    each with the fallback the Communicator uses when it is absent:
///
///    | capability | member | fallback |
///    |---|---|---|
///    | needs_store | `static constexpr bool needs_store` | true: init() rendezvous first |
///    | device_kind | `static constexpr DeviceKind device_kind` | cpu (host memory) |
///    | splits | `std::unique_ptr<B> split(color, key, options)` | split() over the store |
///    | converts_wire | `all_reduce_as(Buf, ReduceOp, DType wire)` | convert around all_reduce |
///    | reduces_many | `all_reduce_many(std::span<const Buf>, ReduceOp)` | one all_reduce each |
///    | uneven | `all_to_all_v`, `gather_v`, `scatter_v` (counts per rank) | send/recv pairs |
///    | has_device | `int device()` (the CUDA device it uses) | — |
///    | refuses_some | `static const char* refuses(std::string_view collective, DType)` | none |
///    | refuses_ops | `static const char* refuses(ReduceOp, DType)` | none |
///    | premultiplies | `all_reduce(Buf, ReduceOp, double factor)`, ... | multiply, then sum |
///
/// backend::Host (backend/host.hpp), backend::Nccl (backend/nccl.hpp) and backend::Mpi
/// (backend/mpi.hpp) implement it. A new backend includes this header, and
/// backend/uneven.hpp for the uneven collectives' fallbacks, store/client.hpp when it
/// rendezvouses through the store.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <fcntl.h>

#include <concepts>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {

/// What every backend is created from.
struct BackendInit {
  int rank = 0;
  int size = 1;
  /// The launcher's local rank (the default CUDA device of the CUDA backends).
  int local_rank = 0;
  /// The communicator's namespace in the rendezvous store (absent for a world of one).
  std::shared_ptr<Store> store;
  Options options;
  /// A membership change's connection (shrink): how long this rank tries to connect to its
  /// peers, all at once, before it counts those it could not reach as cut off from it (0: until
  /// the timeout, failing at the first). The backend::Host's tcp transport then fails with
  /// Errc::peer_lost listing them in Error::lost_ranks, for the survivors to leave out the ranks
  /// on the wrong side of a partition.
  std::chrono::milliseconds reach_window{0};
};

/// This machine's boot id: the same for every process of the machine, whatever namespaces or
/// containers they run in ("" where the kernel does not say). Out of file descriptors it fails
/// (Errc::system, naming the limit) rather than return "", which would pass for another machine.
[[nodiscard]] DDP_INLINE std::string machine_identity();

/// Identifies "the same host" for shared memory and for grouping ranks by host: same machine
/// (host name and boot id), same /dev/shm (mount namespace), same pids (pid namespace) and same
/// network namespace. $DDP_HOST_ID, when set, replaces it (as NCCL_HOSTID does NCCL's): ranks
/// with the same value count as one host (they must share /dev/shm and pids), ranks with
/// different values as different hosts, whatever machine they run on.
[[nodiscard]] DDP_INLINE std::string host_identity();

}  // namespace detail

/// \namespace ddp::backend
/// The backends a Communicator runs on: backend::Host, backend::Nccl and backend::Mpi.

/// What Communicator needs from a backend: byte movement on type-erased buffers.
template <class B>
concept CommBackend = requires(B& b, const detail::Buf& buf, ReduceOp op, int i,
                               const detail::BackendInit& init, const std::string& s) {
  { B::name } -> std::convertible_to<std::string_view>;
  { B::create(init) } -> std::same_as<std::unique_ptr<B>>;
  { B::supports(Device{}) } -> std::convertible_to<bool>;
  { b.rank() } -> std::convertible_to<int>;
  { b.size() } -> std::convertible_to<int>;
  { b.local_rank() } -> std::convertible_to<int>;
  { b.local_size() } -> std::convertible_to<int>;
  { b.local_leader() } -> std::convertible_to<int>;
  b.all_reduce(buf, op);
  b.broadcast(buf, i);
  b.reduce(buf, i, op);
  b.all_gather(buf, buf);
  b.gather(buf, buf, i);
  b.scatter(buf, buf, i);
  b.reduce_scatter(buf, buf, op);
  b.all_to_all(buf, buf);
  b.send(buf, i, i);
  b.recv(buf, i, i);
  b.barrier();
  b.abort(Errc::aborted, s);
};

/// The optional capabilities of a backend (see the table in this file's comment).
template <class B>
struct backend_traits {
  /// init() must rendezvous through a Store before creating the backend (backend::Mpi, which
  /// gets its ranks from the MPI library, says `needs_store = false`).
  static constexpr bool needs_store = [] {
    if constexpr (requires { B::needs_store; })
      return static_cast<bool>(B::needs_store);
    else
      return true;
  }();
  /// The memory the backend moves: DeviceKind::cuda for one that moves device memory only
  /// (backend::Nccl); host-typed buffers are then refused when the program is compiled.
  static constexpr DeviceKind device_kind = [] {
    if constexpr (requires { B::device_kind; })
      return DeviceKind{B::device_kind};
    else
      return DeviceKind::cpu;
  }();
  /// The backend moves CUDA device memory only (device_kind is DeviceKind::cuda).
  static constexpr bool device_only = device_kind == DeviceKind::cuda;
  /// The backend refuses some element types in some collectives (backend::Nccl: 16-bit integer
  /// reductions): refuses() gives the reason, or nullptr. Asked as each argument is checked,
  /// before any rank sends, so a refused call leaves the communicator usable.
  static constexpr bool refuses_some = requires(std::string_view w, DType t) {
    { B::refuses(w, t) } -> std::convertible_to<const char*>;
  };
  /// The backend refuses some operators on some element types (backend::Nccl: no bitwise
  /// reductions): refuses(op, dtype) gives the reason, or nullptr; asked as refuses_some is.
  static constexpr bool refuses_ops = requires(ReduceOp op, DType t) {
    { B::refuses(op, t) } -> std::convertible_to<const char*>;
  };
  /// The backend applies premul_sum's factor itself (ncclRedOpCreatePreMulSum): its
  /// all_reduce, reduce, reduce_scatter (and all_reduce_many, where it has one) take the factor
  /// after the op. Elsewhere the communicator multiplies this rank's input (in host memory) and
  /// the backend sums.
  static constexpr bool premultiplies = requires(B & b, const detail::Buf& x, ReduceOp op) {
    b.all_reduce(x, op, 1.0);
    b.reduce(x, 0, op, 1.0);
    b.reduce_scatter(x, x, op, 1.0);
  };
  /// The backend makes sub-groups itself (MPI_Comm_split, ncclCommSplit).
  static constexpr bool splits = requires(B & b, int i, const Options& o) {
    { b.split(i, i, o) } -> std::same_as<std::unique_ptr<B>>;
  };
  /// The backend forms the survivors' communicator itself after a loss (MPIX_Comm_shrink):
  /// shrink(previous) returns it and fills each new rank's old rank.
  static constexpr bool shrinks = requires(B & b, std::vector<int>& previous) {
    { b.shrink(previous) } -> std::same_as<std::unique_ptr<B>>;
  };
  /// The backend runs the collectives with a count per rank itself (backend/uneven.hpp).
  static constexpr bool uneven =
      requires(B & b, const detail::Buf& x, int i, std::span<const std::size_t> c) {
    b.all_to_all_v(x, x, c, c);
    b.gather_v(x, x, c, i);
    b.scatter_v(x, x, c, i);
  };
  /// The backend carries float32 values as half/bfloat16 itself (fused conversions).
  static constexpr bool converts_wire = requires(B & b, const detail::Buf& x, ReduceOp op) {
    b.all_reduce_as(x, op, DType::float16);
  };
  /// The backend reduces several buffers as one operation (one NCCL group).
  static constexpr bool reduces_many =
      requires(B & b, std::span<const detail::Buf> v, ReduceOp op) {
    b.all_reduce_many(v, op);
  };
  /// The backend uses one CUDA device, named by device().
  static constexpr bool has_device = requires(const B& b) {
    { b.device() } -> std::convertible_to<int>;
  };
};

namespace detail {

/// Whether a backend that moves only CUDA memory is given a buffer whose type says it is host
/// memory: rejected when the program is compiled.
template <class B, class T>
inline constexpr bool host_type_for_device_backend =
    backend_traits<B>::device_only&& static_device_kind_v<T> == DeviceKind::cpu;

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/impl/backend.ipp"
#endif
