// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Sharded checkpoints: every rank saves and loads its own file (its shard of the optimizer
/// state, ShardedAverager's parameters), collectively, so that no rank writes the whole model.
///
///     ddp::save_sharded_checkpoint(comm, ck, "run.ckpt");   // run.ckpt.rank<R>-of-<P>.<G>.<id>
///     if (auto ck = ddp::load_sharded_checkpoint(comm, "run.ckpt")) { ... }
///
/// Each save is a new generation G of the files; the older ones are removed only once every rank
/// has its new file on disk, so a failure or a kill at any moment, on any rank, leaves a complete
/// set to load: the newest generation that every rank has.

#include "ddp/config.hpp"
#include "ddp/training/checkpoint.hpp"
#include "ddp/training/parameters.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/files.hpp"
#include "ddp/error.hpp"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {
/// A shard file (of any rank) of a world size other than `world` next to `path` ("" if none).
inline std::string other_world_shard(const std::string& path, int world) {
  const std::string dir = parent_dir(path);
  const std::size_t slash = path.rfind('/');
  const std::string prefix = path.substr(slash == std::string::npos ? 0 : slash + 1) + ".rank";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return {};
  std::string found;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    std::string rest = name.substr(prefix.size());  // "R-of-N.G.ID" (or "R-of-N": older saves)
    rest = rest.substr(0, rest.find('.'));
    const std::size_t of = rest.find("-of-");
    const auto digits = [](const std::string& t) {
      return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos;
    };
    if (of == std::string::npos || !digits(rest.substr(0, of)) || !digits(rest.substr(of + 4)) ||
        rest.substr(of + 4) == std::to_string(world))
      continue;
    found = slash == std::string::npos ? name : concat(dir == "/" ? "" : dir, "/", name);
    break;
  }
  ::closedir(d);
  return found;
}

}  // namespace detail

/// The name that rank `rank` of `world`'s shard files start with: path.rankR-of-P. Each save
/// writes a new generation of them, path.rankR-of-P.G.ID (G = 1, 2, ...; ID: the save's
/// identifier, 16 hex digits), and removes the older generations only once the new one is
/// complete on every rank.
[[nodiscard]] inline std::string shard_path(const std::string& path, int rank, int world) {
  return detail::concat(path, ".rank", rank, "-of-", world);
}

namespace detail {
/// One save's shard file of a rank: generation `g` (1, 2, ...) written by the save `id`
/// ("<stem>.<g>.<id as 16 hex digits>"), or g = 0: the one unnumbered file "<stem>" that saves
/// before generations wrote (its id is in the file only).
struct ShardGeneration {
  std::uint64_t g = 0;
  std::uint64_t id = 0;
  friend auto operator<=>(const ShardGeneration&, const ShardGeneration&) = default;
};

inline std::string shard_generation_path(const std::string& stem, ShardGeneration s) {
  if (s.g == 0) return stem;
  char hex[17];
  for (int i = 0; i < 16; ++i) hex[i] = "0123456789abcdef"[(s.id >> (60 - 4 * i)) & 15];
  hex[16] = '\0';
  return concat(stem, ".", s.g, ".", hex);
}

/// This rank's shard files in stem's directory, newest first.
inline std::vector<ShardGeneration> shard_generations(const std::string& stem) {
  std::vector<ShardGeneration> out;
  for (const std::string& rest : suffixes(stem)) {  // "<g>.<16 hex>"
    const std::size_t dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos || dot > 18 || rest.size() != dot + 17) continue;
    ShardGeneration s;
    bool ok = rest[0] != '0';
    for (std::size_t i = 0; i < dot && ok; ++i) {
      ok = rest[i] >= '0' && rest[i] <= '9';
      s.g = s.g * 10 + static_cast<std::uint64_t>(rest[i] - '0');
    }
    for (std::size_t i = dot + 1; i < rest.size() && ok; ++i) {
      const char c = rest[i];
      const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      ok = v >= 0;
      s.id = s.id << 4 | static_cast<std::uint64_t>(v < 0 ? 0 : v);
    }
    if (ok) out.push_back(s);
  }
  struct stat st {};
  if (::lstat(stem.c_str(), &st) == 0 && S_ISREG(st.st_mode)) out.push_back({});
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

/// The generations as words for all_gather_object: g, id, g, id, ...
inline std::vector<std::uint64_t> flatten(const std::vector<ShardGeneration>& gens) {
  std::vector<std::uint64_t> out;
  for (const auto& s : gens) out.insert(out.end(), {s.g, s.id});
  return out;
}
inline std::vector<ShardGeneration> unflatten(const std::vector<std::uint64_t>& words) {
  std::vector<ShardGeneration> out;
  for (std::size_t i = 0; i + 1 < words.size(); i += 2) out.push_back({words[i], words[i + 1]});
  return out;
}

/// The generations' numbers as text, for messages: "3 and 4", or "none".
inline std::string generations_text(const std::vector<ShardGeneration>& gens) {
  if (gens.empty()) return "none";
  std::string out;
  for (std::size_t i = gens.size(); i-- > 0;)
    out += concat(out.empty() ? "" : i == 0 ? " and " : ", ", gens[i].g);
  return out;
}

/// save_sharded_checkpoint, with `stamp` words after the rank, the world size and the save id in
/// the "ddp.shard" section, and `extra` sections added.
///
/// The protocol, on every rank: (1) agree on the new generation G, one past the newest any rank
/// has; (2) write, flush and rename the shard into "<stem>.G.ID" (a new name: nothing is replaced)
/// and flush the directory; (3) gather every rank's outcome. When all succeeded, generation G is
/// complete everywhere, and each rank removes its older generations; when a rank reported a
/// failure, each rank removes its G file, and the previous generation is untouched. When the
/// outcome cannot be gathered (a rank died), every file stays: load_sharded_checkpoint takes the
/// newest generation complete on every rank, and the next successful save removes the rest.
template <class Comm>
std::uint64_t save_shard_files(Comm& comm, const Checkpoint& ck, const std::string& path,
                               const std::vector<std::uint64_t>& stamp_extra,
                               std::span<const Checkpoint::Section> extra) {
  const std::string stem = shard_path(path, comm.rank(), comm.size());
  std::string error;
  std::uint64_t newest = 0;
  try {
    const auto gens = shard_generations(stem);
    if (!gens.empty()) newest = gens.front().g;
  } catch (const Error& e) {
    error = error_text(e);
  }
  fail_with_first(comm, comm.all_gather_object(error), "save_sharded_checkpoint");
  std::uint64_t generation = 0;
  for (const std::uint64_t g : comm.all_gather_object(newest)) generation = std::max(generation, g);
  ++generation;
  std::uint64_t id = 0;
  if (comm.rank() == 0) {
    id = detail::random_value<std::uint64_t>();
  }
  comm.broadcast_object(id, 0);
  std::vector<std::uint64_t> words{static_cast<std::uint64_t>(comm.rank()),
                                   static_cast<std::uint64_t>(comm.size()), id};
  words.insert(words.end(), stamp_extra.begin(), stamp_extra.end());
  const std::string stamp = encode_object(words);
  std::vector<Checkpoint::Section> sections(extra.begin(), extra.end());
  sections.emplace_back("ddp.shard", stamp);
  const std::string target = shard_generation_path(stem, {generation, id});
  bool written = false;
  try {
    StagedFile f(stem, "Checkpoint");
    f.write(ck.serialize_with(sections));
    f.commit(target);  // a new name: nothing is replaced
    written = true;
  } catch (const Error& e) {
    error = error_text(e);
    if (::access(target.c_str(), F_OK) == 0) written = true;  // renamed, then the flush failed
  }
  const auto errors = comm.all_gather_object(error);  // a rank lost here: every file stays
  bool complete = true;
  for (const auto& e : errors) complete = complete && e.empty();
  if (!complete) {
    if (written) {  // generation G is incomplete: it goes, the previous one stays
      ::unlink(target.c_str());
      (void)sync_dir(parent_dir(target));
    }
    fail_with_first(comm, errors, "save_sharded_checkpoint");
  }
  // Generation G is on disk on every rank: the older ones are no longer needed (newer ones, or
  // other saves of G, are another job's that writes to the same path: they stay).
  for (const ShardGeneration& s : shard_generations(stem)) {
    if (s.g < generation) ::unlink(shard_generation_path(stem, s).c_str());
  }
  remove_abandoned(stem);
  (void)sync_dir(parent_dir(stem));
  return id;
}

/// A shard's layout as ShardedAverager::save records it: the world size, then each slice's
/// parameter, offset and size.
template <class Slices>
std::vector<std::uint64_t> shard_layout(int world, const Slices& slices) {
  std::vector<std::uint64_t> out{static_cast<std::uint64_t>(world)};
  for (const auto& sl : slices) out.insert(out.end(), {sl.param, sl.offset, sl.value.size});
  return out;
}

/// ShardedAverager::save: the values of this rank's `slices` (ShardSlice; in CUDA memory when
/// `cuda`) and their layout, with `state`, through save_shard_files. Collective.
template <class Comm, class Slices>
std::uint64_t save_shard(Comm& comm, const Checkpoint& state, const std::string& path,
                         const Slices& slices, bool cuda) {
  std::string values;
  for (const auto& sl : slices) {
    values.resize(values.size() + sl.value.bytes());
    copy_bytes(values.data() + values.size() - sl.value.bytes(), sl.value.data, sl.value.bytes(),
               cuda, sl.value.stream);
    sync_stream(cuda, sl.value.stream);
  }
  const Checkpoint::Section extra[] = {{"ddp.values", values}};
  return save_shard_files(comm, state, path, shard_layout(comm.size(), slices), extra);
}

/// ShardedAverager::load: checks that `ck` (this rank's file of `path`, loaded) holds parameter
/// values in the layout of this rank's `slices`, then copies them back into the slices.
/// Collective: a rank's problem fails every rank (Errc::mismatch), naming it.
template <class Comm, class Slices>
void restore_shard(Comm& comm, const Checkpoint& ck, const std::string& path, const Slices& slices,
                   bool cuda) {
  std::string problem;
  std::size_t bytes = 0;
  for (const auto& sl : slices) bytes += sl.value.bytes();
  const std::string file = shard_path(path, comm.rank(), comm.size());
  const std::vector<std::uint64_t> layout = shard_layout(comm.size(), slices);
  const auto stamp = ck.get_object<std::vector<std::uint64_t>>("ddp.shard");
  const std::vector<std::uint64_t> saved(stamp.begin() + 3, stamp.end());
  if (saved.empty() || !ck.contains("ddp.values")) {
    problem = concat(file,
                     " holds no parameters (it was saved by save_sharded_checkpoint, not "
                     "ShardedAverager::save)");
  } else if (saved != layout) {
    problem = concat(file, " holds a shard of ", (saved.size() - 1) / 3,
                     " slices but this averager's has ", (layout.size() - 1) / 3,
                     " (or the same count at other places): it was saved with other "
                     "ShardedOptions or another model");
  } else if (ck.get("ddp.values").size() != bytes) {
    problem =
        concat(file, " holds ", ck.get("ddp.values").size(), " bytes of parameters, not ", bytes);
  }
  const auto problems = comm.all_gather_object(problem);
  for (std::size_t r = 0; r < problems.size(); ++r) {
    if (!problems[r].empty())
      fail(Errc::mismatch, "rank ", comm.rank(), ": ShardedAverager::load: rank ", r, ": ",
           problems[r], "; resume with the model, world size and ShardedOptions that saved it");
  }
  const std::byte* values = ck.get("ddp.values").data();
  for (const auto& sl : slices) {
    copy_bytes(sl.value.data, values, sl.value.bytes(), cuda, sl.value.stream);
    sync_stream(cuda, sl.value.stream);
    values += sl.value.bytes();
  }
}
}  // namespace detail

/// Collective: every rank saves its own `ck` (its shard of the optimizer state) as a new
/// generation of its shard files (shard_path(path, rank, size) + ".G.ID"). Each rank writes,
/// flushes and renames its file into a name of its own; only when every rank has succeeded are
/// the older generations removed. A failure anywhere (a full disk on one rank, a rank killed at
/// any moment) therefore leaves the previous complete set loadable: a rank that reports a
/// failure makes every rank remove the new generation and fail with that rank's error; a rank
/// that dies leaves the files as they are, and load_sharded_checkpoint takes the newest set
/// that is complete on every rank. Each file records the rank, the world size and a save
/// identifier (the same in every rank's file: shard_save_id) that load_sharded_checkpoint
/// checks. Returns the identifier. (ShardedAverager::save also records the shard's layout and
/// parameter values.) Ranks may save to one shared file system or each to its own disk.
template <class Comm>
std::uint64_t save_sharded_checkpoint(Comm& comm, const Checkpoint& ck, const std::string& path) {
  return detail::save_shard_files(comm, ck, path, {}, {});
}

/// The save identifier of a shard file that load_sharded_checkpoint returned (the value
/// save_sharded_checkpoint returned when it was saved), e.g. to match it to a checkpoint saved
/// beside it.
[[nodiscard]] inline std::uint64_t shard_save_id(const Checkpoint& shard) {
  const auto stamp = shard.get_object<std::vector<std::uint64_t>>("ddp.shard");
  if (stamp.size() < 3)
    detail::fail(Errc::protocol, "Checkpoint: the ddp.shard section is damaged");
  return stamp[2];
}

/// Collective: each rank loads and verifies its own shard file of the newest generation that
/// every rank has (a save cut short leaves the one before it); std::nullopt on every rank when
/// no rank has any (a run that starts afresh). Fails on every rank when one rank's file is
/// invalid (Errc::protocol or Errc::system, naming the rank), when the ranks have no generation
/// in common, or when the files come from different saves or a different rank or world size
/// (Errc::mismatch).
template <class Comm>
[[nodiscard]] std::optional<Checkpoint> load_sharded_checkpoint(Comm& comm,
                                                                const std::string& path) {
  const std::string stem = shard_path(path, comm.rank(), comm.size());
  std::string error;
  std::vector<detail::ShardGeneration> gens;
  try {
    detail::check_directory(stem, "Checkpoint");
    gens = detail::shard_generations(stem);
  } catch (const Error& e) {
    error = detail::error_text(e);
  }
  detail::fail_with_first(comm, comm.all_gather_object(error), "load_sharded_checkpoint");
  std::vector<std::vector<detail::ShardGeneration>> all;
  for (const auto& words : comm.all_gather_object(detail::flatten(gens)))
    all.push_back(detail::unflatten(words));
  std::optional<std::size_t> with, without;
  for (std::size_t r = 0; r < all.size(); ++r) (all[r].empty() ? without : with) = r;
  if (!with) {  // a fresh start, unless shard files of another world size are there
    std::string other = comm.rank() == 0 ? detail::other_world_shard(path, comm.size()) : "";
    comm.broadcast_object(other, 0);
    if (other.empty()) return std::nullopt;
    detail::fail(Errc::mismatch, "rank ", comm.rank(),
                 ": load_sharded_checkpoint: there is no "
                 "shard file for ",
                 comm.size(), " ranks (", stem, ".*) but there is ", other,
                 ": sharded state resumes on the world size that saved it");
  }
  if (without)
    detail::fail(Errc::mismatch, "rank ", comm.rank(), ": load_sharded_checkpoint: rank ", *with,
                 " has its shard file but rank ", *without, " has none (",
                 shard_path(path, static_cast<int>(*without), comm.size()),
                 ".*): the checkpoint is incomplete, or was saved with another world size");
  std::optional<detail::ShardGeneration> chosen;  // the newest save every rank has a file of
  for (const detail::ShardGeneration& g : all[0]) {
    bool everywhere = true;
    for (const auto& r : all)
      everywhere = everywhere && std::find(r.begin(), r.end(), g) != r.end();
    if (everywhere) {
      chosen = g;
      break;
    }
  }
  if (!chosen) {
    std::size_t other = 1;
    while (other + 1 < all.size() && all[other] == all[0]) ++other;
    detail::fail(Errc::mismatch, "rank ", comm.rank(),
                 ": load_sharded_checkpoint: the ranks have no save in common (rank 0 has "
                 "generation ",
                 detail::generations_text(all[0]), " of ", shard_path(path, 0, comm.size()),
                 ", rank ", other, " has ", detail::generations_text(all[other]),
                 "): the files come from different runs; resume from a complete checkpoint");
  }
  const std::string mine = detail::shard_generation_path(stem, *chosen);
  std::optional<Checkpoint> ck;
  std::vector<std::uint64_t> stamp;  // rank, world, save id[, the caller's words]
  try {
    ck = Checkpoint::load(mine);
    if (!ck)
      detail::fail(Errc::system, "Checkpoint: ", mine, " disappeared while it was being loaded");
    if (!ck->contains("ddp.shard"))
      detail::fail(Errc::mismatch, "Checkpoint: ", mine,
                   " is not a shard file (it was not written by save_sharded_checkpoint)");
    stamp = ck->get_object<std::vector<std::uint64_t>>("ddp.shard");
    if (stamp.size() < 3 || stamp[0] != static_cast<std::uint64_t>(comm.rank()) ||
        stamp[1] != static_cast<std::uint64_t>(comm.size()))
      detail::fail(Errc::mismatch, "Checkpoint: ", mine, " was written by rank ",
                   stamp.empty() ? 0 : stamp[0], " of ", stamp.size() < 2 ? 0 : stamp[1],
                   " ranks; a shard resumes on its own rank with the same world size");
    if (chosen->g != 0 && stamp[2] != chosen->id)
      detail::fail(Errc::mismatch, "Checkpoint: ", mine,
                   " holds another save than its name says (it was copied or renamed)");
  } catch (const Error& e) {
    error = detail::error_text(e);
  }
  detail::fail_with_first(comm, comm.all_gather_object(error), "load_sharded_checkpoint");
  const auto ids = comm.all_gather_object(stamp[2]);
  for (std::size_t r = 1; r < ids.size(); ++r) {
    if (ids[r] != ids[0])
      detail::fail(Errc::mismatch, "rank ", comm.rank(), ": load_sharded_checkpoint: rank ", r,
                   "'s shard file comes from a different save than rank 0's (generation ",
                   chosen->g, "); resume from a complete checkpoint");
  }
  return ck;
}

DDP_END_NAMESPACE
