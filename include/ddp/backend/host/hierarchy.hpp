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

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
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
#if DDP_BODIES
DDP_INLINE std::optional<Transport::Left> left_record(const Store& store,
                                                      const std::vector<int>& ranks,
                                                      std::chrono::milliseconds grace) {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  try {
    Store plain = store.unwatched();
    for (;;) {
      const std::string failed = "failed";
      if (plain.check(std::span<const std::string>(&failed, 1))) {
        // CommState::relay_failure's record: its origin is the rank whose rendezvous failed
        if (const auto e = decode_stop(plain.get(failed)); e && e->origin_rank() >= 0) {
          Transport::Left left;
          left.rank = e->origin_rank();
          left.code = e->code();
          left.message = std::string(e->origin_message());
          left.lost = e->lost_ranks();
          return left;
        }
      }
      for (int j : ranks) {
        const std::string key = concat("left/", j);
        if (!plain.check(std::span<const std::string>(&key, 1))) continue;
        const auto e = decode_stop(plain.get(key));
        if (!e) fail(Errc::protocol, "the leaving record of rank ", j, " is not one");
        Transport::Left left;
        left.rank = j;
        left.code = e->code();
        left.message = e->what();
        if (e->origin_rank() >= 0 && e->origin_rank() != j) {  // it relayed another rank's
          left.origin = e->origin_rank();
          left.origin_message = std::string(e->origin_message());
        }
        left.lost = e->lost_ranks();
        return left;
      }
      for (int j : ranks) {  // one that finished (CommState::announce_leaving)
        const std::string key = concat("done/", j);
        if (!plain.check(std::span<const std::string>(&key, 1))) continue;
        Transport::Left left;
        left.rank = j;
        left.code = Errc::peer_lost;
        left.finished = true;
        left.operations = std::strtoull(plain.get(key).c_str(), nullptr, 10);
        return left;
      }
      // "exit/<rank>" without a record before it: its process died (the store wrote it as the
      // connection closed), and no record will come.
      bool all_exited = true;
      for (int j : ranks) {
        const std::string key = concat("exit/", j);
        all_exited = all_exited && plain.check(std::span<const std::string>(&key, 1));
      }
      if (all_exited || std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error&) {  // the store is gone or the record unreadable: nothing to add
    return std::nullopt;
  }
}
#endif  // DDP_BODIES

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

#if DDP_BODIES
DDP_INLINE void Hierarchy::check_locally(const Fingerprint& f, Transport* remote) {
  if (!active() || local->size() <= 1 || !local->verify_fingerprints) return;
  local->slack = std::chrono::milliseconds(0);
  guarded([&](Transport*&) { empty_round(*local, &f); }, remote);
}

DDP_INLINE void Hierarchy::all_reduce(RoundScratch& s, SingleCopy& single, const Buf& b,
                                      ReduceOp op, const Fingerprint& fp, int size) {
  const bool avg = op == ReduceOp::avg;
  const auto fn = reduce_fn(b.dtype, avg ? ReduceOp::sum : op);
  const auto divide = [&](const Buf& x) {
    if (avg && x.count != 0) divide_fn(b.dtype)(x.data, x.count, size);
  };
  Transport& host = *local;
  const bool by_slices = kind == HostHierarchy::slices &&
                         b.bytes() > slices_from * static_cast<std::size_t>(host.size());
  // Each phase waits a little longer than the one before it (Transport::slack), so that a rank
  // waiting on one that waits on the culprit hears the culprit named before its own timeout.
  host.slack = std::chrono::milliseconds(0);
  if (across) across->slack = std::chrono::milliseconds(250);
  const auto last_phase = [&] { host.slack = std::chrono::milliseconds(500); };
  guarded(
      [&](Transport*& crossing) {
        if (!by_slices) {
          if (host.size() > 1) reduce_on(host, s, b, fn, 0, &fp);
          if (host.rank() == 0) {
            crossing = across.get();
            all_reduce_on(*across, s, b, fn, &fp, &single);
            crossing = nullptr;
            divide(b);
          }
          last_phase();
          if (host.size() > 1) broadcast_on(host, b, 0, nullptr);
          return;
        }
        const int q = host.size();
        const auto part = [&](int j) {  // in elements
          const auto [lo, hi] = split_range(b.count, q, j, b.elem());
          return Range{lo, hi - lo};
        };
        reduce_scatter_parts(host, s, b, fn, part, &fp);
        const Range mine = part(host.rank());
        Buf slice = b;
        slice.data = b.at(mine.off);
        slice.count = mine.len;
        crossing = across.get();
        all_reduce_on(*across, s, slice, fn, &fp, &single);
        crossing = nullptr;
        divide(slice);
        last_phase();
        all_gather_parts(host, b, part);
      },
      across.get());
}

DDP_INLINE void Hierarchy::reduce_scatter(Transport& t, RoundScratch& s, const Buf& in,
                                          const Buf& out, ReduceOp op, const Fingerprint& fp,
                                          int size) {
  const bool avg = op == ReduceOp::avg;
  const auto fn = reduce_fn(out.dtype, avg ? ReduceOp::sum : op);
  const int hosts = host_of.empty() ? 1 : *std::max_element(host_of.begin(), host_of.end()) + 1;
  const std::size_t es = out.elem();
  std::vector<const std::byte*> group, sums(static_cast<std::size_t>(hosts));
  exchange_blocks(t, s, in, out.count, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
    std::byte* partial = RoundScratch::at_least(s.bytes, static_cast<std::size_t>(hosts) * m * es);
    for (int h = 0; h < hosts; ++h) {
      group.clear();
      for (std::size_t j = 0; j < host_of.size(); ++j) {
        if (host_of[j] == h) group.push_back(ptrs[j]);
      }
      std::byte* sum = partial + static_cast<std::size_t>(h) * m * es;
      fn(sum, nullptr, group.data(), static_cast<int>(group.size()), m);
      sums[static_cast<std::size_t>(h)] = sum;
    }
    fn(out.at(s0), nullptr, sums.data(), hosts, m);
    if (avg && m != 0) divide_fn(out.dtype)(out.at(s0), m, size);
  });
}

DDP_INLINE void Hierarchy::record_leaving(const Error& e) noexcept {
  if (!store) return;
  try {
    store->set(concat("left/", rank), Store::stop_value(e));
  } catch (...) {  // the store is gone: the peers report a lost connection instead
  }
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
