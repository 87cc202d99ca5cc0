// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The insides of load_sharded_checkpoint: finding the newest complete set of shard files (of
/// any world size) among the files every rank sees, and handing each rank its state, cut again
/// for the world size that loads it.
///
///  * Each rank lists the shard files it sees ("<path>.rankK-of-N.G.ID"); the lists are gathered,
///    and the newest save G with a file of every one of its N ranks somewhere is chosen. Ranks
///    may share one file system or each have a disk of its own.
///  * Old rank K's file is read by rank K % M when that rank sees it (K itself when the world
///    size is unchanged), else by the lowest rank that does: each file is read once.
///  * Unchanged world size and layouts: each rank keeps its own file, nothing moves. Otherwise
///    each reader cuts its files' sharded sections (Checkpoint::put_sharded) into the pieces each
///    new rank's layout needs and scatters them; every rank can compute every piece's size from
///    the gathered layouts, so bytes are all that travel. A section that is not sharded must be
///    the same in every file (it goes to every rank) unless the world size is unchanged (each
///    rank keeps its own).

#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/files.hpp"
#include "ddp/error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// The name that rank `rank` of `world`'s shard files start with: path.rankR-of-P. Each save
/// writes a new generation of them, path.rankR-of-P.G.ID (G = 1, 2, ...; ID: the save's
/// identifier, 16 hex digits), and removes the older generations only once the new one is
/// complete on every rank.
[[nodiscard]] inline std::string shard_path(const std::string& path, int rank, int world) {
  return detail::concat(path, ".rank", rank, "-of-", world);
}

/// The layout a rank wants a sharded section in (load_sharded_checkpoint): given the section's
/// name and its arrays' sizes.
using ShardLayoutFor =
    std::function<ShardLayout(std::string_view section, const std::vector<std::size_t>& sizes)>;

namespace detail {

/// One shard file: old rank `rank` of `world`, generation `g` of save `id` (g = 0: the one
/// unnumbered file "<path>.rankR-of-N" that saves before generations wrote).
struct ShardFile {
  std::uint64_t g = 0, id = 0, world = 0, rank = 0;
  friend auto operator<=>(const ShardFile&, const ShardFile&) = default;
};

DDP_INLINE std::string shard_file_path(const std::string& path, const ShardFile& f);

/// Digits without a leading zero ("0" itself allowed) as a number.
DDP_INLINE bool parse_decimal(std::string_view t, std::uint64_t& v);

/// Every shard file of `path` (any rank, any world size) in its directory, newest first.
DDP_INLINE std::vector<ShardFile> shard_files(const std::string& path);

/// The save load_sharded_checkpoint takes: its world size N, generation, id, and which rank
/// reads each old rank's file.
struct ShardSet {
  std::uint64_t world = 0, g = 0, id = 0;
  std::vector<int> reader;  ///< reader[K]: the rank that reads old rank K's file
};

/// Collective: the newest save of which some rank holds every old rank's shard, `mine` being
/// what this rank holds (std::nullopt when no rank holds any; Errc::mismatch when none is
/// complete: `incomplete(key, have, missing, first_missing)` says what is missing).
template <class Comm, class Incomplete>
std::optional<ShardSet> choose_held(Comm& comm, const std::vector<ShardFile>& mine,
                                    Incomplete&& incomplete) {
  std::vector<std::uint64_t> words;
  for (const ShardFile& f : mine) words.insert(words.end(), {f.g, f.id, f.world, f.rank});
  // (g, id, world) -> the ranks that see each old rank's file
  std::map<std::vector<std::uint64_t>, std::map<std::uint64_t, std::vector<int>>, std::greater<>>
      saves;
  const auto all = comm.all_gather_object(words);
  for (std::size_t r = 0; r < all.size(); ++r) {
    for (std::size_t i = 0; i + 3 < all[r].size(); i += 4)
      saves[{all[r][i], all[r][i + 1], all[r][i + 2]}][all[r][i + 3]].push_back(
          static_cast<int>(r));
  }
  if (saves.empty()) return std::nullopt;
  const auto m = static_cast<std::uint64_t>(comm.size());
  // The newest complete save; among saves of one generation (another job's, under the same
  // path), the one of this world size first.
  const std::map<std::uint64_t, std::vector<int>>* best = nullptr;
  ShardSet set;
  for (const auto& [key, files] : saves) {
    if (files.size() != key[2]) continue;  // old ranks 0..N-1 each seen (rank < world)
    if (best != nullptr && (key[0] < set.g || set.world == m || key[2] != m)) continue;
    best = &files;
    set.g = key[0];
    set.id = key[1];
    set.world = key[2];
  }
  if (best == nullptr) {
    const auto& [key, files] = *saves.begin();  // the newest, incomplete
    std::string have, missing;
    std::uint64_t first_missing = 0;
    for (std::uint64_t k = key[2]; k-- > 0;) {
      const bool seen = files.count(k) != 0;
      if (!seen) first_missing = k;
      std::string& to = seen ? have : missing;
      to = concat(k, to.empty() ? "" : ", ", to);
    }
    const auto shorten = [](std::string t) { return t.size() > 40 ? t.substr(0, 37) + "..." : t; };
    incomplete(ShardFile{key[0], key[1], key[2], first_missing}, shorten(have), shorten(missing));
  }
  for (std::uint64_t k = 0; k < set.world; ++k) {
    const std::vector<int>& seen = best->at(k);
    const int preferred = static_cast<int>(k % m);
    set.reader.push_back(
        std::find(seen.begin(), seen.end(), preferred) != seen.end() ? preferred : seen.front());
  }
  return set;
}

/// Collective: the newest save with a file of every one of its ranks seen by some rank
/// (std::nullopt when no rank sees any shard file; Errc::mismatch, saying what is missing, when
/// there are files but no complete save). `mine`: this rank's shard_files.
template <class Comm>
std::optional<ShardSet> choose_shard_set(Comm& comm, const std::string& path,
                                         const std::vector<ShardFile>& mine) {
  return choose_held(
      comm, mine, [&](const ShardFile& f, const std::string& have, const std::string& missing) {
        fail(Errc::mismatch, "rank ", comm.rank(),
             ": load_sharded_checkpoint: no save has a file of every rank: the newest, generation ",
             f.g, " of ", f.world, " ranks, has the files of rank ", have, " but none of rank ",
             missing, " (", shard_file_path(path, f),
             "): the checkpoint is incomplete, its files come from different runs, or a rank's "
             "disk cannot be reached; resume from a complete checkpoint");
      });
}

/// What a shard file holds, as every rank needs to know it: its sections in order, each with
/// words: {0, checksum, bytes} for a plain section; layout_words (element size first, never 0)
/// for a sharded one.
using FileInfo = std::vector<std::pair<std::string, std::vector<std::uint64_t>>>;

DDP_INLINE std::uint64_t section_checksum(std::span<const std::byte> b);

DDP_INLINE FileInfo describe(const Checkpoint& ck, const std::string& file);

/// Calls f(destination element, source element, count) for each run of elements that old
/// layout `from` and new layout `to` share, in `to`'s order, then `from`'s.
template <class F>
void for_each_overlap(const ShardLayout& to, const ShardLayout& from, F&& f) {
  std::size_t wp = 0;
  for (const ShardRange& w : to.ranges) {
    std::size_t sp = 0;
    for (const ShardRange& o : from.ranges) {
      if (o.array == w.array) {
        const std::size_t lo = std::max(o.offset, w.offset);
        const std::size_t hi = std::min(o.offset + o.size, w.offset + w.size);
        if (lo < hi) f(wp + lo - w.offset, sp + lo - o.offset, hi - lo);
      }
      sp += o.size;
    }
    wp += w.size;
  }
}

/// Collective: each rank's checkpoint, in the layouts `want` gives (null: each rank's own at
/// the same world size, ShardLayout::even at another), of save `set`, whose old rank K's
/// checkpoint `files` holds on rank set.reader[K]. `what` and `file_name(K)` name them in errors.
template <class Comm, class Name>
Checkpoint reshard_held(Comm& comm, const ShardSet& set, std::map<std::uint64_t, Checkpoint>& files,
                        const ShardLayoutFor& want, const char* what, Name&& file_name) {
  const int me = comm.rank();
  const auto m = static_cast<std::uint64_t>(comm.size());
  const bool same_world = set.world == m;
  const auto failed = [&](const std::string& error) {
    fail_with_first(comm, comm.all_gather_object(error), what);
  };
  std::vector<std::pair<std::uint64_t, FileInfo>> infos;
  std::string error;
  try {
    for (const auto& [k, ck] : files) infos.emplace_back(k, describe(ck, file_name(k)));
  } catch (const Error& e) {
    error = error_text(e);
  }
  failed(error);
  // 2. What every file holds, on every rank; the files must agree on their sections.
  std::vector<FileInfo> info(set.world);
  for (auto& from_rank : comm.all_gather_object(infos))
    for (auto& [k, i] : from_rank) info[k] = std::move(i);
  const auto refuse = [&](const auto&... why) {
    fail(Errc::mismatch, "rank ", me, ": ", what, ": ", why...,
         "; resume from a complete checkpoint");
  };
  std::vector<std::string> sharded;  // the sharded sections' names, in file 0's order
  std::vector<std::size_t> element;  // their element sizes
  for (const auto& [name, words] : info[0]) {
    if (words[0] != 0) {
      sharded.push_back(name);
      element.push_back(static_cast<std::size_t>(words[0]));
    }
  }
  for (std::uint64_t k = 1; k < set.world; ++k) {
    if (info[k].size() != info[0].size())
      refuse(file_name(k), " has ", info[k].size(), " sections but ", file_name(0), " has ",
             info[0].size());
    for (std::size_t i = 0; i < info[0].size(); ++i) {
      const auto& [name, words] = info[k][i];
      const auto& first = info[0][i].second;
      if (name != info[0][i].first)
        refuse(file_name(k), "'s section ", i, " is \"", name, "\" but ", file_name(0), "'s is \"",
               info[0][i].first, "\"");
      if ((words[0] == 0) != (first[0] == 0))
        refuse("section \"", name, "\" is sharded in one rank's file and not in another's");
      if (words[0] == 0 && !same_world && words != first)
        refuse("section \"", name, "\" differs between ", file_name(0), " and ", file_name(k),
               ", and it is not sharded: on another world size than the one that saved it, a "
               "section must be the same on every rank (it goes to every rank) or be put with "
               "Checkpoint::put_sharded (its values are cut again)");
    }
  }
  std::vector<std::vector<ShardLayout>> old(sharded.size());  // [section][old rank]
  for (std::size_t s = 0; s < sharded.size(); ++s) {
    std::vector<std::vector<std::pair<std::size_t, std::size_t>>> cover;
    for (std::uint64_t k = 0; k < set.world; ++k) {
      std::vector<std::uint64_t> words;
      for (const auto& [name, w] : info[k])
        if (name == sharded[s]) words = w;
      auto [bytes, layout] = layout_of_words(words, file_name(k));
      if (bytes != element[s] || (k != 0 && layout.sizes != old[s][0].sizes))
        refuse("sharded section \"", sharded[s], "\" has other element sizes or arrays in ",
               file_name(k), " than in ", file_name(0));
      cover.resize(layout.sizes.size());
      for (const ShardRange& r : layout.ranges) cover[r.array].emplace_back(r.offset, r.size);
      old[s].push_back(std::move(layout));
    }
    for (std::size_t a = 0; a < cover.size(); ++a) {  // the files hold each element once
      std::sort(cover[a].begin(), cover[a].end());
      std::size_t next = 0;
      bool once = true;
      for (const auto& [offset, size] : cover[a]) {
        once = once && offset == next;  // a gap (offset > next) or an overlap (offset < next)
        next = offset + size;
      }
      if (!once || next != old[s][0].sizes[a])
        refuse("the shard files' pieces of sharded section \"", sharded[s], "\" do not hold array ",
               a, " (", old[s][0].sizes[a], " elements) exactly once");
    }
  }
  // 3. The layout each rank wants each sharded section in.
  std::vector<std::vector<std::uint64_t>> wanted_words;
  try {
    for (std::size_t s = 0; s < sharded.size(); ++s) {
      const std::vector<std::size_t>& sizes = old[s][0].sizes;
      ShardLayout l = want         ? want(sharded[s], sizes)
                      : same_world ? old[s][static_cast<std::size_t>(me)]
                                   : ShardLayout::even(sizes, me, comm.size());
      if (l.sizes != sizes)
        fail(Errc::mismatch, "the layout asked for sharded section \"", sharded[s], "\" has ",
             l.sizes.size(), " arrays of other sizes than the ", sizes.size(),
             " it was saved with");
      check_layout(l, concat("the layout asked for sharded section \"", sharded[s], "\""));
      wanted_words.push_back(layout_words(element[s], l));
    }
    error.clear();
  } catch (const Error& e) {
    error = error_text(e);
  }
  failed(error);
  const auto all_wanted = comm.all_gather_object(wanted_words);
  std::vector<std::vector<ShardLayout>> wanted(m);  // [new rank][section]
  bool moves = !same_world;
  for (std::uint64_t d = 0; d < m; ++d) {
    for (std::size_t s = 0; s < sharded.size(); ++s) {
      wanted[d].push_back(layout_of_words(all_wanted[d][s], what).second);
      moves = moves || !(wanted[d][s] == old[s][d]);
    }
  }
  for (std::uint64_t k = 0; k < set.world; ++k)
    moves = moves || set.reader[k] != static_cast<int>(k);
  if (!moves) return std::move(files.at(static_cast<std::uint64_t>(me)));  // its own file
  // 4. The plain sections come from old rank d's file (same world size) or rank 0's; the sharded
  // ones from every file holding a piece of d's layout. Bytes s sends d, in the order d reads.
  const auto plain_from = [&](std::uint64_t d) { return same_world ? d : 0; };
  const auto for_each_piece = [&](int s, std::uint64_t d, auto&& f) {  // f(section, k, from, to, n)
    for (std::uint64_t k = 0; k < set.world; ++k) {
      if (set.reader[k] != s || k != plain_from(d)) continue;
      for (const auto& [name, words] : info[k])
        if (words[0] == 0)
          f(name, k, std::size_t{0}, std::size_t{0}, static_cast<std::size_t>(words[2]));
    }
    for (std::size_t sec = 0; sec < sharded.size(); ++sec) {
      for (std::uint64_t k = 0; k < set.world; ++k) {
        if (set.reader[k] != s) continue;
        for_each_overlap(
            wanted[d][sec], old[sec][k], [&](std::size_t to, std::size_t from, std::size_t n) {
              f(sharded[sec], k, from * element[sec], to * element[sec], n * element[sec]);
            });
      }
    }
  };
  Checkpoint out;
  std::map<std::string, std::string> values;  // the sharded sections' new bytes
  for (std::size_t s = 0; s < sharded.size(); ++s)
    values[sharded[s]].resize(wanted[static_cast<std::size_t>(me)][s].elements() * element[s]);
  std::map<std::string, std::string> plain;
  // One all_to_all of bytes: what this rank sends each rank, and receives from each, in rank
  // order (every rank computes every size from what it gathered).
  const auto me64 = static_cast<std::uint64_t>(me);
  std::vector<std::size_t> send(m, 0), recv(m, 0);
  for (std::uint64_t d = 0; d < m; ++d) {
    for_each_piece(me, d,
                   [&](const std::string&, std::uint64_t, std::size_t, std::size_t, std::size_t n) {
                     send[d] += n;
                   });
    for_each_piece(static_cast<int>(d), me64,
                   [&](const std::string&, std::uint64_t, std::size_t, std::size_t, std::size_t n) {
                     recv[d] += n;
                   });
  }
  std::string out_bytes, got;
  std::size_t total_send = 0, total_recv = 0;
  for (std::uint64_t d = 0; d < m; ++d) total_send += send[d], total_recv += recv[d];
  out_bytes.reserve(total_send);
  for (std::uint64_t d = 0; d < m; ++d)
    for_each_piece(me, d,
                   [&](const std::string& name, std::uint64_t k, std::size_t from, std::size_t,
                       std::size_t n) {
                     const auto b = files.at(k).get(name);
                     out_bytes.append(reinterpret_cast<const char*>(b.data()) + from, n);
                   });
  got.resize(total_recv);
  on_host_data(comm,  // through the device on backend::Nccl
               std::span(reinterpret_cast<std::uint8_t*>(out_bytes.data()), out_bytes.size()),
               std::span(reinterpret_cast<std::uint8_t*>(got.data()), got.size()),
               [&](auto& from, auto& into) { comm.all_to_all(from, into, send, recv); });
  std::size_t at = 0;
  for (std::uint64_t s = 0; s < m; ++s) {
    for_each_piece(
        static_cast<int>(s), me64,
        [&](const std::string& name, std::uint64_t k, std::size_t, std::size_t to, std::size_t n) {
          const bool is_plain = [&] {
            for (const auto& [nm, words] : info[k])
              if (nm == name) return words[0] == 0;
            return false;
          }();
          if (is_plain)
            plain[name] = got.substr(at, n);
          else
            got.copy(values[name].data() + to, n, at);
          at += n;
        });
  }
  // 5. This rank's checkpoint: the plain sections in their order, the sharded ones, the stamp.
  for (const auto& [name, words] : info[plain_from(static_cast<std::uint64_t>(me))]) {
    const std::string& b = words[0] == 0 ? plain[name] : values[name];
    CheckpointRaw::put(out, name, std::as_bytes(std::span(b.data(), b.size())));
    if (words[0] != 0) {
      const auto s = static_cast<std::size_t>(std::find(sharded.begin(), sharded.end(), name) -
                                              sharded.begin());
      out.put_object(layout_section(name), all_wanted[static_cast<std::size_t>(me)][s]);
    }
  }
  out.put_object("ddp.shard",
                 std::vector<std::uint64_t>{static_cast<std::uint64_t>(me), m, set.id});
  return out;
}

/// Collective: each rank's checkpoint of save `set` of `path`, in the layouts `want` gives
/// (null: each rank's own at the same world size, ShardLayout::even at another).
template <class Comm>
Checkpoint load_shard_set(Comm& comm, const std::string& path, const ShardSet& set,
                          const ShardLayoutFor& want) {
  const int me = comm.rank();
  // 1. Each reader loads and checks its files.
  std::map<std::uint64_t, Checkpoint> files;  // old rank -> its file, on its reader
  std::string error;
  try {
    for (std::uint64_t k = 0; k < set.world; ++k) {
      if (set.reader[k] != me) continue;
      const std::string file = shard_file_path(path, {set.g, set.id, set.world, k});
      std::optional<Checkpoint> ck = Checkpoint::load(file);
      if (!ck) fail(Errc::system, "Checkpoint: ", file, " disappeared while it was being loaded");
      if (!ck->contains("ddp.shard"))
        fail(Errc::mismatch, "Checkpoint: ", file,
             " is not a shard file (it was not written by save_sharded_checkpoint)");
      const auto stamp = ck->get_object<std::vector<std::uint64_t>>("ddp.shard");
      if (stamp.size() < 3 || stamp[0] != k || stamp[1] != set.world)
        fail(Errc::mismatch, "Checkpoint: ", file, " was written by rank ",
             stamp.empty() ? 0 : stamp[0], " of ", stamp.size() < 2 ? 0 : stamp[1],
             " ranks; a shard file is read under the name its rank and world size gave it");
      if (set.g != 0 && stamp[2] != set.id)
        fail(Errc::mismatch, "Checkpoint: ", file,
             " holds another save than its name says (it was copied or renamed)");
      files.emplace(k, std::move(*ck));
    }
  } catch (const Error& e) {
    error = error_text(e);
  }
  fail_with_first(comm, comm.all_gather_object(error), "load_sharded_checkpoint");
  return reshard_held(comm, set, files, want, "load_sharded_checkpoint", [&](std::uint64_t k) {
    return shard_file_path(path, {set.g, set.id, set.world, k});
  });
}

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/checkpoint/impl/reshard.ipp"
#endif
