// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The Host backend across hosts: the hierarchical all_reduce (shared memory inside a host, TCP
/// between hosts, slices or leaders, see HostHierarchy) and how a failure in one of its phases
/// reaches every rank at once (the other ranks of the host through the local transport, the
/// other hosts through a record in the store and the connections closing).

#include "ddp/backend/collective.hpp"
#include "ddp/backend/host/flat.hpp"
#include "ddp/backend/host/rounds.hpp"
#include "ddp/backend/host/single_copy.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/backend/reduce.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"

#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Transport::why_left over the store's records: a rank that left the hierarchical path says
/// why under "left/<rank>" (Hierarchy::record_leaving; a failed communicator's rank too, when
/// it is destroyed), a rank that finished says so under "done/<rank>" with the number of
/// operations it ran (CommState::announce_leaving), and a rank that failed the rendezvous
/// after this rank had finished its own left its failure under "failed". Waits up to `grace`
/// for one; nothing when the store is gone or holds none, or at once when every rank of `ranks`
/// died (its "exit/<rank>" is there without a record).
DDP_INLINE std::optional<Transport::Left> left_record(const Store& store,
                                                      const std::vector<int>& ranks,
                                                      std::chrono::milliseconds grace);

/// The hierarchical path of one communicator: its kind (flat when the ranks share one host, or
/// each runs alone on its host), the transport among this host's ranks (`local`) and the one that
/// carries this rank's part across hosts (`across`; leaders: only a host's lowest rank has it).
class Hierarchy {
 public:
  HostHierarchy kind = HostHierarchy::flat;
  /// Below this many bytes per local rank, slices send all_reduce through the leaders.
  std::size_t slices_from = 0;
  std::unique_ptr<Transport> local;
  std::unique_ptr<Transport> across;
  std::shared_ptr<Store> store;  ///< where record_leaving writes (may be null)
  int rank = 0;                  ///< this rank in the communicator
  /// Each rank's host (0, 1, ...: hosts in order of their lowest rank); set when active().
  std::vector<int> host_of;

  [[nodiscard]] bool active() const noexcept { return kind != HostHierarchy::flat; }

  /// Before a collective other than the hierarchical all_reduce: compares its fingerprint among
  /// this host's ranks (one local round), so that a rank in a hierarchical all_reduce, which
  /// talks to its host and to one rank per host, and a rank in any other collective meet in a
  /// round that compares their fingerprints, and fail with Errc::mismatch instead of a timeout.
  void check_locally(const Fingerprint& f, Transport* remote);

  /// all_reduce when the ranks span several hosts: every element is combined as host 0's sum,
  /// op host 1's sum, ..., where hosts are ordered by their lowest rank and each host's sum
  /// combines its ranks in rank order; avg divides that sum by `size` at the end. The order
  /// depends on the hosts only, not on the message size or on slices/leaders, so the result is
  /// bitwise the same on every rank and in every run (it may differ in the last bits from a
  /// single host's order 0..P-1).
  ///  * slices: a reduce-scatter inside the host (local rank i gets the host's sum of slice i of
  ///    the buffer), an all_reduce of slice i with local rank i of every other host over TCP, an
  ///    all-gather inside the host. Every rank carries 1/local_size() of the bytes across.
  ///  * leaders: a reduce to the host's lowest rank, an all_reduce among those over TCP, a
  ///    broadcast inside the host.
  void all_reduce(RoundScratch& s, SingleCopy& single, const Buf& b, ReduceOp op,
                  const Fingerprint& fp, int size);

  /// reduce_scatter over `t` (every rank of the communicator) when the ranks span several
  /// hosts: each block is combined in all_reduce's order above (each host's ranks in rank order,
  /// then the hosts' sums in host order; avg divides by `size` at the end), so that a rank's
  /// block is bitwise that block of the same all_reduce. The bytes travel as in the flat
  /// reduce_scatter; only the order of the combination differs.
  void reduce_scatter(Transport& t, RoundScratch& s, const Buf& in, const Buf& out, ReduceOp op,
                      const Fingerprint& fp, int size);

  /// Runs body(crossing); if it fails, fails this host's other ranks too (through the local
  /// transport) and shuts down the connections of `remote` (when not null), before rethrowing,
  /// so that no rank waits for the timeout on one that left the hierarchical path: a rank of
  /// this host in a later phase (its all-gather or broadcast) fails with this error, a rank of
  /// another host sees the connection close (Errc::peer_lost). A failure in a round of `remote`
  /// itself (body sets `crossing` to it meanwhile) keeps its connections (that transport's peers
  /// learn of it as it says, e.g. both fingerprints).
  template <class F>
  void guarded(F&& body, Transport* remote) {
    Transport* crossing = nullptr;
    try {
      body(crossing);
    } catch (const Error& e) {
      local->abort(e.code(), e.what());
      if (remote != nullptr && remote != crossing) {
        record_leaving(e);
        remote->abort(e.code(), e.what());
      }
      throw;
    }
  }

  /// Says in the store why this rank leaves the hierarchical path, before it closes its
  /// connections, so that a rank of another host that sees them close reports this error (with
  /// its code) rather than a lost peer (Transport::why_left). Best effort.
  void record_leaving(const Error& e) noexcept;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/hierarchy.ipp"
#endif
