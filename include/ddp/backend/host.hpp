// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// backend::Host: the built-in backend, with no dependency beyond the standard library and POSIX.
/// Shared memory between the ranks of one host, TCP between hosts (or on one host with
/// DDP_HOST_TRANSPORT=tcp).
///
/// Every collective is built from rounds (backend/host/transport.hpp) with one family of
/// algorithms on every transport, in layers:
///  * backend/host/rounds.hpp: segments, chunks and the reused scratch memory;
///  * backend/host/flat.hpp: the algorithms over one transport (small and segmented all_reduce,
///    reduce, broadcast, gather, scatter, all_gather, reduce_scatter, all_to_all);
///  * backend/host/single_copy.hpp: all_reduce straight out of the peers' memory, and the path
///    chooser;
///  * backend/host/hierarchy.hpp: the all_reduce across hosts and its failure relay;
///  * backend/host/bootstrap.hpp: the rendezvous and the transports' set-up.
/// Every element is reduced in rank order 0..P-1 in every path, so results are bitwise identical
/// on every rank, in every run, for every message size and on every transport.

#include "ddp/backend/backend.hpp"
#include "ddp/backend/host/bootstrap.hpp"
#include "ddp/backend/host/flat.hpp"
#include "ddp/backend/host/hierarchy.hpp"
#include "ddp/backend/host/rounds.hpp"
#include "ddp/backend/host/single_copy.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/backend/host/uneven.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/backend/reduce.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace backend {

/// The built-in backend: host memory over shared memory within a host and TCP between hosts,
/// with results bitwise identical on every rank (see the file comment).
class Host {
 public:
  static constexpr std::string_view name = "host";  ///< The backend's name, in messages.

  /// Rendezvous through init.store, choose a transport and connect (see the file comment).
  [[nodiscard]] static std::unique_ptr<Host> create(const detail::BackendInit& init);

  /// This process's rank, 0 .. size()-1.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of ranks.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// This process's rank among the ranks on this host.
  [[nodiscard]] int local_rank() const noexcept { return net_.local_rank; }
  /// The number of ranks on this host.
  [[nodiscard]] int local_size() const noexcept { return net_.local_size; }
  /// The lowest rank on this host (names the host in split()).
  [[nodiscard]] int local_leader() const noexcept { return net_.local_leader; }
  /// "shm", "tcp" or "self".
  [[nodiscard]] std::string_view transport() const noexcept { return net_.transport->name(); }
  /// How all_reduce runs: "flat" (every rank on the transport above), or across hosts
  /// "slices" or "leaders" (see HostHierarchy and the file comment).
  [[nodiscard]] std::string_view hierarchy() const noexcept;
  /// The smallest all_reduce, in bytes, that copies straight out of the peers' memory (single
  /// copy, see Options::shm_single_copy_bytes); Options::never when none does (tcp, across
  /// hosts, or the kernel does not let these ranks read each other's memory).
  [[nodiscard]] std::size_t single_copy_bytes() const noexcept {
    return net_.transport->single_copy_from();
  }
  /// Whether this backend can use memory on `device` (the Host backend: host memory).
  [[nodiscard]] static bool supports(const Device& device) noexcept { return device.is_cpu(); }

  /// Communicator::all_reduce: in place, each element reduced in rank order.
  void all_reduce(const detail::Buf& b, ReduceOp op);

  /// all_reduce of float32 values that travel and are reduced as `wire` (float16 or bfloat16):
  /// bitwise the result of converting to `wire`, all_reduce on `wire` and converting back, in the
  /// passes over memory of a plain all_reduce, with half its bytes moved (see
  /// detail::all_reduce_as_on).
  void all_reduce_as(const detail::Buf& b, ReduceOp op, DType wire);

  /// Communicator::broadcast: root's `b` copied into every rank's.
  void broadcast(const detail::Buf& b, int root);

  /// Communicator::reduce: the reduction lands in root's `b` only.
  void reduce(const detail::Buf& b, int root, ReduceOp op);

  /// Communicator::all_gather: every rank's `in`, in rank order, into every rank's `out`.
  void all_gather(const detail::Buf& in, const detail::Buf& out);
  /// Communicator::gather: every rank's `in`, in rank order, into root's `out`.
  void gather(const detail::Buf& in, const detail::Buf& out, int root);

  /// Communicator::scatter: block r of root's `in` into rank r's `out`.
  void scatter(const detail::Buf& in, const detail::Buf& out, int root);

  /// Communicator::reduce_scatter: block r of the reduction of every rank's `in` into rank r's.
  void reduce_scatter(const detail::Buf& in, const detail::Buf& out, ReduceOp op);

  /// Communicator::all_to_all: block j of `in` to rank j, stored as its block r of `out`.
  void all_to_all(const detail::Buf& in, const detail::Buf& out);

  /// Communicator::all_to_all with split sizes (backend/uneven.hpp).
  void all_to_all_v(const detail::Buf& in, const detail::Buf& out,
                    std::span<const std::size_t> in_counts,
                    std::span<const std::size_t> out_counts);
  /// Communicator::all_gather (root < 0) and gather with a count per rank.
  void gather_v(const detail::Buf& in, const detail::Buf& out, std::span<const std::size_t> counts,
                int root);
  /// Communicator::scatter with a count per rank.
  void scatter_v(const detail::Buf& in, const detail::Buf& out, std::span<const std::size_t> counts,
                 int root);

  /// Communicator::barrier: returns once every rank has entered it.
  void barrier();

  /// Communicator::send: `b` to `peer`, matched with its recv() in issue order.
  void send(const detail::Buf& b, int peer, int tag);
  /// Communicator::recv: the next send() from `peer` into `b`, checking its tag, dtype and count.
  void recv(const detail::Buf& b, int peer, int tag);

  /// Fails every current and later operation of this communicator with `code`; peers on shared
  /// memory fail too, TCP peers see the connections close. Thread-safe.
  void abort(Errc code, const std::string& why);
  /// abort() for a failure found on this rank or learned from another (a peer silent past the
  /// heartbeat): peers on shared memory learn the rank that found it and the ranks it lost.
  void abort_with(const Error& e);

 private:
  /// The transport of the whole communicator.
  detail::Transport& t() const noexcept { return *net_.transport; }

  Host(int rank, int size);

  /// The next collective's fingerprint, made current on every transport. When all_reduce runs
  /// across hosts, `check_locally`: the other collectives first compare it among the ranks of
  /// this host (Hierarchy::check_locally).
  detail::Fingerprint next(detail::Coll c, DType type, std::size_t count, int root, ReduceOp op,
                           bool has_op, bool check_locally = true);

  int rank_;
  int size_;
  detail::HostLinks net_;
  std::uint64_t seq_ = 0;
  std::vector<std::uint64_t> send_seq_, recv_seq_;
  detail::RoundScratch scratch_;
};

}  // namespace backend
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/impl/host.ipp"
#endif
