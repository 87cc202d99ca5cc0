// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::ShardMirror: a ShardedAverager's sharded state kept in memory, each rank's shard also on
/// the rank before it (rank 0's on the last), so that a job that loses a rank recovers that
/// rank's shard of the optimizer state from its neighbour, without a disk and without losing a
/// step (ShardedAverager::save(state, mirror, tag), load(mirror, tag)).
///
///  * save(mirror, ...): two small all_gathers (the save's number, the sizes), then an
///    all_to_all in which each rank sends its shard (what save(path) would write: the shard's
///    parameter values, its layout, `state`) to the rank before it. Each rank keeps the two
///    newest saves: its own shard and its neighbour's of each (4 shards' worth of memory, reused
///    from save to save).
///  * load(mirror, tag) takes the newest save (with that tag) of which the survivors hold every
///    old rank's shard, and cuts it again for the new world as a sharded checkpoint is cut
///    (checkpoint/reshard.hpp). One loss, or losses of ranks no two of which are neighbours, lose
///    nothing; two neighbours lost together take a shard with them (Errc::mismatch, naming it:
///    resume from a sharded checkpoint on disk).
///  * A save that a failure interrupted is complete on some ranks and not on others; the older
///    save is kept for that case. load() mirrors the save it loaded again on the new world
///    before it returns, so a second loss right after a recovery loses nothing either. With
///    TrainingState, save before commit() and load the tag of the restored commit: a commit
///    completes only after every rank finished its save.

#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/checkpoint/reshard.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {
struct MirrorAccess;
}

/// The in-memory sharded state of a ShardedAverager (see the file comment). Make it once, before
/// the averager, and keep it across membership changes (the averager is made again after
/// each; the mirror is not).
class ShardMirror {
 public:
  /// Bytes held on this rank (its own shards and its neighbour's, of the saves kept).
  [[nodiscard]] std::size_t bytes() const noexcept;
  /// The tags of the saves kept on this rank, oldest first.
  [[nodiscard]] std::vector<std::uint64_t> tags() const;
  /// Forgets every save.
  void clear() noexcept { saves_.clear(); }

 private:
  friend struct detail::MirrorAccess;
  struct Save {
    std::uint64_t tag = 0, g = 0, id = 0, world = 0, rank = 0;
    std::string own, next;  // this rank's shard, and rank (rank + 1) % world's
  };
  static constexpr std::size_t kept = 2;
  std::vector<Save> saves_;  // oldest first
};

namespace detail {

/// ShardedAverager's access to a ShardMirror.
struct MirrorAccess {
  /// Collective: this rank's shard checkpoint (`state` with `extra` sections) kept in `m` and on
  /// the rank before, as save `tag`.
  template <class Comm>
  static void save(Comm& comm, ShardMirror& m, std::uint64_t tag, const Checkpoint& state,
                   std::span<const Checkpoint::Section> extra) {
    const auto n = static_cast<std::uint64_t>(comm.size()),
               me = static_cast<std::uint64_t>(comm.rank());
    // 1. Every rank is here, so every rank finished the newest save: the one before it is
    // needed no more, and its memory takes this one.
    // The ranks must save the same tag and the same unsharded sections (after a loss they go
    // to every survivor), checked here rather than found out after a loss.
    const std::uint64_t newest = m.saves_.empty() ? 0 : m.saves_.back().g;
    const auto ids = comm.all_gather_object(std::vector<std::uint64_t>{
        newest, me == 0 ? random_value<std::uint64_t>() : 0, tag, plain_checksum(state)});
    for (std::uint64_t r = 1; r < n; ++r) {
      if (ids[r][2] != ids[0][2])
        fail(Errc::mismatch, "rank ", me, ": ShardedAverager::save (in-memory copies): rank ", r,
             " saves tag ", ids[r][2], " but rank 0 tag ", ids[0][2],
             "; every rank saves the same tag (the steps done, say)");
      if (ids[r][3] != ids[0][3]) refuse_plain(comm, state, r);
    }
    ShardMirror::Save s{tag, 0, ids[0][1], n, me, {}, {}};
    for (const auto& r : ids) s.g = std::max(s.g, r[0]);
    ++s.g;
    if (m.saves_.size() >= ShardMirror::kept) {
      s.own = std::move(m.saves_.front().own);
      s.next = std::move(m.saves_.front().next);
      m.saves_.erase(m.saves_.begin());
    }
    // 2. This rank's shard, then to the rank before it (sizes first).
    std::vector<Checkpoint::Section> sections(extra.begin(), extra.end());
    const std::string stamp = encode_object(std::vector<std::uint64_t>{me, n, tag});
    sections.emplace_back("ddp.shard", stamp);
    state.serialize_into(s.own, sections);
    if (n > 1) {
      const auto sizes = comm.all_gather_object(static_cast<std::uint64_t>(s.own.size()));
      const std::uint64_t before = (me + n - 1) % n, after = (me + 1) % n;
      std::vector<std::size_t> out_counts(n, 0), in_counts(n, 0);
      out_counts[before] = s.own.size();
      in_counts[after] = static_cast<std::size_t>(sizes[after]);
      s.next.resize(in_counts[after]);
      on_host_data(comm, bytes(s.own), bytes(s.next),  // through the device on backend::Nccl
                   [&](auto& in, auto& out) { comm.all_to_all(in, out, out_counts, in_counts); });
    } else {
      s.next.clear();
    }
    m.saves_.push_back(std::move(s));
  }

  /// Collective: each rank's checkpoint of the newest save (with tag `tag`, when given) of which
  /// the ranks hold every old rank's shard, cut for this world in the layouts `want` gives;
  /// std::nullopt when no rank holds such a save. Before it returns, that save is mirrored again
  /// on this world (each new shard on its own rank and the rank before it, under the same tag),
  /// and every other save is dropped: the next loss, however soon, finds every shard twice.
  template <class Comm>
  static std::optional<Checkpoint> load(Comm& comm, ShardMirror& m,
                                        std::optional<std::uint64_t> tag,
                                        const ShardLayoutFor& want) {
    const char* what = "ShardedAverager::load (in-memory copies)";
    if (tag) {  // a tag no rank holds, while saves are held: say which are
      std::vector<std::uint64_t> mine;
      for (const auto& s : m.saves_) mine.push_back(s.tag);
      std::set<std::uint64_t> tags;
      for (const auto& r : comm.all_gather_object(mine)) tags.insert(r.begin(), r.end());
      if (!tags.empty() && tags.count(*tag) == 0) {
        std::string list;
        for (const auto t : tags) list += concat(list.empty() ? "" : ", ", t);
        fail(Errc::mismatch, "rank ", comm.rank(), ": ", what, ": no rank holds a save tagged ",
             *tag, " (the ranks hold tags ", list, "; each keeps its two newest saves)");
      }
    }
    std::vector<ShardFile> held;
    for (const auto& s : m.saves_) {
      if (tag && s.tag != *tag) continue;
      held.push_back({s.g, s.id, s.world, s.rank});
      if (s.world > 1) held.push_back({s.g, s.id, s.world, (s.rank + 1) % s.world});
    }
    const auto set = choose_held(
        comm, held, [&](const ShardFile& f, const std::string& have, const std::string& missing) {
          fail(Errc::mismatch, "rank ", comm.rank(), ": ", what, ": no rank holds a copy of rank ",
               f.rank, "'s shard of save ", f.g, " (", f.world,
               " ranks), neither its own nor the one "
               "on the rank before it: both were lost (held: ranks ",
               have, "; missing: ranks ", missing, "); resume from a sharded checkpoint on disk");
        });
    if (!set) return std::nullopt;
    std::map<std::uint64_t, Checkpoint> shards;  // old rank -> its checkpoint, on its reader
    std::string error;
    try {
      for (std::uint64_t k = 0; k < set->world; ++k) {
        if (set->reader[k] != comm.rank()) continue;
        for (const auto& s : m.saves_) {
          if (s.g != set->g || s.id != set->id || s.world != set->world) continue;
          const std::string& b = s.rank == k ? s.own : s.next;
          shards.emplace(k, Checkpoint::parse(b, name(k, *set)));
        }
      }
    } catch (const Error& e) {
      error = error_text(e);
    }
    fail_with_first(comm, comm.all_gather_object(error), what);
    Checkpoint mine = reshard_held(comm, *set, shards, want, what,
                                   [&](std::uint64_t k) { return name(k, *set); });
    // Redundancy again before training goes on: the loaded save, mirrored on this world. The
    // saves it came from are dropped (the loaded one is kept until its copy is whole).
    const auto chosen = [&](const ShardMirror::Save& s) {
      return s.g == set->g && s.id == set->id && s.world == set->world;
    };
    std::uint64_t loaded_tag = 0;
    for (const auto& s : m.saves_)
      if (chosen(s)) loaded_tag = s.tag;
    for (const std::uint64_t t : comm.all_gather_object(loaded_tag))
      loaded_tag = std::max(loaded_tag, t);
    std::erase_if(m.saves_, [&](const ShardMirror::Save& s) { return !chosen(s); });
    Checkpoint again;
    for (const std::string& section : mine.names())
      if (section != "ddp.shard") detail::CheckpointRaw::put(again, section, mine.get(section));
    save(comm, m, loaded_tag, again, {});
    return mine;
  }

 private:
  /// The unsharded sections of `state` (not put with put_sharded), named with their checksums.
  static std::vector<std::pair<std::string, std::uint64_t>> plain_sections(const Checkpoint& c);
  static std::uint64_t plain_checksum(const Checkpoint& c);
  /// Collective (every rank found that rank `r`'s unsharded sections differ from rank 0's):
  /// Errc::mismatch naming the first section that differs.
  template <class Comm>
  [[noreturn]] static void refuse_plain(Comm& comm, const Checkpoint& state, std::uint64_t r) {
    const auto all = comm.all_gather_object(plain_sections(state));
    const auto& a = all[0];
    const auto& b = all[r];
    std::string which;
    for (std::size_t i = 0; i < std::max(a.size(), b.size()) && which.empty(); ++i) {
      if (i >= a.size() || i >= b.size() || a[i].first != b[i].first)
        which = concat("section \"", i < b.size() ? b[i].first : a[i].first,
                       "\" is on one of them only");
      else if (a[i].second != b[i].second)
        which = concat("section \"", a[i].first, "\" differs");
    }
    fail(Errc::mismatch, "rank ", comm.rank(), ": ShardedAverager::save (in-memory copies): rank ",
         r,
         "'s state and rank 0's have "
         "other unsharded sections (",
         which,
         "): after a loss they go to every survivor, so they "
         "must be the same on every rank; put per-rank state with Checkpoint::put_sharded");
  }
  static std::span<std::uint8_t> bytes(std::string& s);
  static std::string name(std::uint64_t k, const ShardSet& set);
};

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/training/zero/impl/shard_mirror.ipp"
#endif
