// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How the Host backend starts: every rank publishes who and where it is in the store, the ranks
/// check that they were asked for the same transport, segment size, hierarchy and single-copy
/// setting, and connect: the shared-memory segment of a host (made by its first rank, opened by
/// the others through that rank's descriptor, never named), the TCP mesh, and across hosts the
/// hierarchy's groups. A rank that dies meanwhile is named at once (its process is watched); one
/// that stops is named at the rendezvous's one timeout.

#include "ddp/backend/backend.hpp"
#include "ddp/backend/host/hierarchy.hpp"
#include "ddp/backend/host/shm.hpp"
#include "ddp/backend/host/single_copy.hpp"
#include "ddp/backend/host/tcp.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/membership/rendezvous.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"

#include <fcntl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// What a Host backend holds once connected: its place among the ranks of its host, the
/// transport of the whole communicator, the hierarchy's transports and the single-copy state.
struct HostLinks {
  HostLinks(int r, int s);

  int rank;
  int size;
  int local_rank = 0;     ///< this rank among the ranks on its host
  int local_size = 0;     ///< the ranks on this host
  int local_leader = 0;   ///< the lowest rank on this host
  int machine_ranks = 0;  ///< ranks on this machine, in any namespace or container (its cores)
  std::shared_ptr<Store> shared_store;
  std::unique_ptr<Transport> transport;  ///< every rank of the communicator
  Hierarchy hierarchy;                   ///< across hosts (flat otherwise)
  SingleCopy single;

  /// Below this many bytes per local rank, the slices hierarchy sends all_reduce through the
  /// leaders (measured: bench/README.md, "Across hosts").
  static constexpr std::size_t slices_from_bytes = std::size_t{16} << 10;
  /// The default Options::shm_single_copy_bytes (measured: bench/README.md, "Shared memory at
  /// mid sizes").
  static constexpr std::size_t single_copy_from_bytes = std::size_t{64} << 10;

  /// Rendezvous through init.store and connect: publish this rank's record, check that every
  /// rank asked for the same, choose the transport (shm on one host, tcp across hosts or when
  /// asked; rank 0 may fall back from shm to tcp when /dev/shm is too small) and, across hosts,
  /// the hierarchy's transports.
  void connect(const BackendInit& init);

  /// The hierarchical all_reduce's transports, when the ranks span hosts and some host runs
  /// several (see hierarchical_all_reduce): shared memory among this host's ranks (hierarchy.local;
  /// a group of the TCP mesh's connections when /dev/shm has no room) and, over the mesh's
  /// connections, the group that carries this rank's part across hosts (hierarchy.across). Every
  /// rank decides the same from the same records.
  void connect_hierarchy(Store& store, const Options& o, const std::vector<std::string>& ids,
                         const std::vector<int>& pids, const std::vector<Fd>& mesh);

  /// A TCP transport over the mesh's connections to `members` (communicator ranks, this rank
  /// among them), numbered by their place in `members`. The connections are shared with the
  /// mesh (duplicated descriptors): a failure closes both, and a rank in a round of one meets a
  /// rank in a round of the other on the same stream, where the fingerprints are compared.
  std::unique_ptr<Transport> mesh_group(const Options& o, const std::vector<int>& members,
                                        const std::vector<Fd>& mesh);

  /// Options::transport and segment_bytes, the environment applied (Options::with_env).
  static HostTransport requested_transport(const Options& o) { return o.transport; }
  static std::size_t segment_bytes(const Options& o, std::size_t fallback) {
    return o.segment_bytes != 0 ? o.segment_bytes : fallback;
  }

  /// Waits for `keys` in `store` (this host's members publish them while the shm transport is
  /// set up), checking every 50 ms that those members' processes (`pids`, communicator ranks
  /// `members`) are alive: one that died fails this rank at once with Errc::peer_lost naming it,
  /// instead of at the timeout. Errc::timeout naming the missing keys after `timeout`.
  void wait_for_members(Store& store, const std::vector<std::string>& keys,
                        const std::vector<int>& members, const std::vector<int>& pids,
                        std::chrono::milliseconds timeout, const char* what);

  /// Largest shm slot: a round moves at most one slot, and rounds this large already run at
  /// memory speed, so larger requests are clamped here rather than reserve memory nobody reads.
  static constexpr std::size_t max_shm_slot = std::size_t{64} << 20;

  /// The shared-memory transport among `members` (communicator ranks on this host, this rank
  /// among them; `pids` theirs), set up through `store`; nullptr when the first member found
  /// /dev/shm too small and the ranks fall back to tcp (an error instead when shm was asked for
  /// explicitly).
  std::unique_ptr<Transport> connect_shm(Store& store, const Options& o,
                                         const std::vector<int>& members,
                                         const std::vector<int>& pids, HostTransport requested);
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/bootstrap.ipp"
#endif
