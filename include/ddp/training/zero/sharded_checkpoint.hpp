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
///
/// AsyncShardedSaver saves the same way in the background (every rank's file written by a thread
/// of its own; the save complete once every rank's file is on disk).
///
/// A set loads on any world size: sections put with Checkpoint::put_sharded (state per element
/// of a rank's shard, such as an optimizer's moments; ShardedAverager's parameters) are cut again
/// for the new ranks, other sections must be the same in every file (ddp/checkpoint/reshard.hpp).

#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/checkpoint/reshard.hpp"
#include "ddp/config.hpp"
#include "ddp/training/averaging/parameters.hpp"
#include "ddp/training/zero/shard_mirror.hpp"
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
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {
/// save_sharded_checkpoint, with `extra` sections added.
///
/// The protocol, on every rank: (1) agree on the new generation G, one past the newest of any
/// rank and world size that any rank sees; (2) write, flush and rename the shard into
/// "<stem>.G.ID" (a new name: nothing is replaced) and flush the directory; (3) gather every
/// rank's outcome. When all succeeded, generation G is complete everywhere, and each rank removes
/// its older generations (and those of other world sizes' rank K with K % size == rank); when a
/// rank reported a failure, each rank removes its G file, and the previous generation is
/// untouched. When the outcome cannot be gathered (a rank died), every file stays:
/// load_sharded_checkpoint takes the newest generation complete on every rank, and the next
/// successful save removes the rest.
/// One save of a sharded checkpoint on this rank: its generation, its identifier and its file.
struct ShardSave {
  std::string stem, target;  // this rank's files' stem, and its new file
  std::uint64_t generation = 0, id = 0, world = 0, me = 0;
};

/// Steps (1) of the protocol, collective: the new generation and the save's identifier.
template <class Comm>
ShardSave begin_shard_save(Comm& comm, const std::string& path,
                           const char* who = "save_sharded_checkpoint") {
  ShardSave s;
  s.stem = shard_path(path, comm.rank(), comm.size());
  std::string error;
  std::uint64_t newest = 0;
  try {
    const auto files = shard_files(path);
    if (!files.empty()) newest = files.front().g;
  } catch (const Error& e) {
    error = error_text(e);
  }
  fail_with_first(comm, comm.all_gather_object(error), who);
  for (const std::uint64_t g : comm.all_gather_object(newest))
    s.generation = std::max(s.generation, g);
  ++s.generation;
  if (comm.rank() == 0) s.id = detail::random_value<std::uint64_t>();
  comm.broadcast_object(s.id, 0);
  s.me = static_cast<std::uint64_t>(comm.rank());
  s.world = static_cast<std::uint64_t>(comm.size());
  s.target = shard_file_path(path, {s.generation, s.id, s.world, s.me});
  return s;
}

/// Step (2), this rank alone: `ck` with `extra` sections and the save's stamp, written, flushed
/// and renamed into s.target. Returns the error's text ("" when written); `written`: whether
/// the file is there (renamed, even when the flush after it failed).
DDP_INLINE std::string write_shard(const ShardSave& s, const Checkpoint& ck,
                                   std::span<const Checkpoint::Section> extra, bool& written);

/// Step (3), collective: every rank's outcome (`error`, "" for success); the older generations
/// removed when every rank's file is on disk, else this one's, and every rank fails with the
/// first rank's error.
template <class Comm>
void finish_shard_save(Comm& comm, const std::string& path, const ShardSave& s,
                       const std::string& error, bool written,
                       const char* who = "save_sharded_checkpoint") {
  const auto errors = comm.all_gather_object(error);  // a rank lost here: every file stays
  bool complete = true;
  for (const auto& e : errors) complete = complete && e.empty();
  if (!complete) {
    if (written) {  // generation G is incomplete: it goes, the previous one stays
      ::unlink(s.target.c_str());
      (void)sync_dir(parent_dir(s.target));
    }
    fail_with_first(comm, errors, who);
  }
  // Generation G is on disk on every rank: the older ones are no longer needed, of this world
  // size and of others (each file by one rank; newer ones, or other saves of G, are another
  // job's that writes to the same path: they stay).
  for (const ShardFile& f : shard_files(path)) {
    if (f.g < s.generation && (f.world == s.world ? f.rank == s.me : f.rank % s.world == s.me))
      ::unlink(shard_file_path(path, f).c_str());
  }
  remove_abandoned(s.stem);
  (void)sync_dir(parent_dir(s.stem));
}

template <class Comm>
std::uint64_t save_shard_files(Comm& comm, const Checkpoint& ck, const std::string& path,
                               std::span<const Checkpoint::Section> extra) {
  const ShardSave s = begin_shard_save(comm, path);
  bool written = false;
  const std::string error = write_shard(s, ck, extra, written);
  finish_shard_save(comm, path, s, error, written);
  return s.id;
}

/// The values of `slices` (in CUDA memory when `cuda`), as the bytes of section "ddp.values",
/// and its layout `layout` as the bytes of that section's companion.
template <class Slices>
std::pair<std::string, std::string> shard_values(const Slices& slices, const ShardLayout& layout,
                                                 bool cuda) {
  std::size_t element = 1, total = 0;
  for (const auto& sl : slices) {
    element = sizeof(*sl.value.data);
    total += sl.value.bytes();
  }
  std::string values(total, '\0');
  std::size_t at = 0;
  for (const auto& sl : slices) {
    copy_bytes(values.data() + at, sl.value.data, sl.value.bytes(), cuda, sl.value.stream);
    sync_stream(cuda, sl.value.stream);
    at += sl.value.bytes();
  }
  return {std::move(values), encode_object(layout_words(element, layout))};
}

/// ShardedAverager::save: the values of this rank's `slices` (ShardSlice; in CUDA memory when
/// `cuda`) as sharded section "ddp.values" laid out as `layout`, with `state`, through
/// save_shard_files. Collective.
template <class Comm, class Slices>
std::uint64_t save_shard(Comm& comm, const Checkpoint& state, const std::string& path,
                         const Slices& slices, const ShardLayout& layout, bool cuda) {
  const auto [values, words] = shard_values(slices, layout, cuda);
  const std::string companion = layout_section("ddp.values");
  const Checkpoint::Section extra[] = {{"ddp.values", values}, {companion, words}};
  return save_shard_files(comm, state, path, extra);
}

/// The layout a load asks for (`who`'s, "ShardedAverager" say): `mine` (this rank's) for the
/// parameters, whose sizes must be the checkpoint's (Errc::mismatch naming the first parameter
/// that differs: a checkpoint of another model), even for other sharded sections.
inline ShardLayoutFor wanted_layout(ShardLayout mine, int rank, int world, const char* who) {
  return [mine = std::move(mine), rank, world, who](
             std::string_view section, const std::vector<std::size_t>& sizes) -> ShardLayout {
    if (sizes == mine.sizes) return mine;
    if (section == "ddp.values") {
      std::size_t i = 0;
      while (i < sizes.size() && i < mine.sizes.size() && sizes[i] == mine.sizes[i]) ++i;
      fail(Errc::mismatch, who, "::load: the checkpoint holds ", sizes.size(),
           " parameters and this model ", mine.sizes.size(),
           i < sizes.size() && i < mine.sizes.size()
               ? concat("; parameter ", i, " has ", sizes[i], " elements in the checkpoint but ",
                        mine.sizes[i], " here")
               : std::string(),
           ": it was saved with another model");
    }
    return ShardLayout::even(sizes, rank, world);
  };
}

/// ShardedAverager::save(mirror, ...): the values of this rank's `slices` and `state` kept in
/// `mirror` as save `tag`, as save_shard writes them to a file. Collective.
template <class Comm, class Slices>
void save_shard_to_mirror(Comm& comm, ShardMirror& mirror, std::uint64_t tag,
                          const Checkpoint& state, const Slices& slices, const ShardLayout& layout,
                          bool cuda) {
  const auto [values, words] = shard_values(slices, layout, cuda);
  const std::string companion = layout_section("ddp.values");
  const Checkpoint::Section extra[] = {{"ddp.values", values}, {companion, words}};
  MirrorAccess::save(comm, mirror, tag, state, extra);
}

/// ShardedAverager::load: checks that `ck` (this rank's, from load_sharded_checkpoint in the
/// averager's layout; `file` names it) holds parameter values in the layout of this rank's
/// `slices`, then copies them back into the slices. Collective: a rank's problem fails every
/// rank (Errc::mismatch).
template <class Comm, class Slices>
void restore_shard(Comm& comm, const Checkpoint& ck, const std::string& file, const Slices& slices,
                   const ShardLayout& layout, bool cuda, const char* who = "ShardedAverager") {
  std::string problem;
  std::size_t bytes = 0;
  for (const auto& sl : slices) bytes += sl.value.bytes();
  const auto stamp = ck.get_object<std::vector<std::uint64_t>>("ddp.shard");
  std::vector<std::uint64_t> legacy{static_cast<std::uint64_t>(comm.size())};  // older saves
  for (const ShardRange& r : layout.ranges)
    legacy.insert(legacy.end(), {r.array, r.offset, r.size});
  if (!ck.contains("ddp.values")) {
    problem = concat(file, " holds no parameters (it was saved by save_sharded_checkpoint, not ",
                     who, "::save)");
  } else if (ck.sharded_layout("ddp.values")
                 ? *ck.sharded_layout("ddp.values") != layout
                 : std::vector<std::uint64_t>(stamp.begin() + 3, stamp.end()) != legacy) {
    problem = concat(file, " holds its parameters in another layout than this ", who, "'s");
  } else if (ck.get("ddp.values").size() != bytes) {
    problem = concat(file, " holds ", ck.get("ddp.values").size(), " bytes of parameters, not ",
                     bytes, ": it was saved with another element type");
  }
  const auto problems = comm.all_gather_object(problem);
  for (std::size_t r = 0; r < problems.size(); ++r) {
    if (!problems[r].empty())
      fail(Errc::mismatch, "rank ", comm.rank(), ": ", who, "::load: rank ", r, ": ", problems[r],
           "; resume with the model that saved it");
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
  return detail::save_shard_files(comm, ck, path, {});
}

/// The save identifier of a shard file that load_sharded_checkpoint returned (the value
/// save_sharded_checkpoint returned when it was saved), e.g. to match it to a checkpoint saved
/// beside it.
[[nodiscard]] DDP_INLINE std::uint64_t shard_save_id(const Checkpoint& shard);

/// save_sharded_checkpoint in the background (torch.distributed.checkpoint's async_save): each
/// rank's file is written by a thread of this saver while training goes on, and the save counts
/// as complete only once every rank's file is on disk. Every rank of `comm` calls save() and
/// wait() at the same points (both are collective, as save_sharded_checkpoint is):
///
///     ddp::AsyncShardedSaver saver;
///     if (step % 100 == 0) {
///       ddp::Checkpoint ck;                       // this rank's part: its shard, the step, ...
///       ck.put_sharded("m", moments, layout);
///       saver.save(comm, std::move(ck), "run.ckpt");  // agrees on the save, returns at once
///     }
///     ...
///     saver.wait(comm);                            // before the program ends
///
/// save() first completes the save before it (as wait() does), then agrees with the other ranks
/// on the new generation and starts writing this rank's file. wait() waits for this rank's
/// write and gathers every rank's outcome: when all are on disk, the older generations are
/// removed; when a rank failed (a full disk, a missing directory), its error is thrown on every
/// rank and the new generation is removed. Until then load_sharded_checkpoint takes the newest
/// generation whose files are all on disk, so a crash or SIGKILL at any moment leaves the last
/// complete save loadable. A checkpoint that every rank holds whole (no sharded state) needs no
/// coordination: rank 0 alone saves it with an AsyncSaver. The destructor waits for this rank's
/// write but completes nothing (it is not collective): the next save() or a load does.
class AsyncShardedSaver {
 public:
  AsyncShardedSaver() = default;
  AsyncShardedSaver(const AsyncShardedSaver&) = delete;
  AsyncShardedSaver& operator=(const AsyncShardedSaver&) = delete;
  ~AsyncShardedSaver() {
    if (writer_.joinable()) writer_.join();
  }

  /// Collective: completes the save in flight (wait()), then starts saving `ck` (taken, nothing
  /// copied) as this rank's part of a new generation of `path`. Returns the save's identifier
  /// (shard_save_id of its files).
  template <class Comm>
  std::uint64_t save(Comm& comm, Checkpoint&& ck, const std::string& path) {
    wait(comm);
    detail::ShardSave s = detail::begin_shard_save(comm, path, "AsyncShardedSaver::save");
    const std::uint64_t id = s.id;
    pending_.emplace(Pending{std::move(s), path, std::move(ck), {}, false});
    try {
      writer_ = std::thread(
          [p = &*pending_] { p->error = detail::write_shard(p->save, p->ck, {}, p->written); });
    } catch (const std::system_error& e) {
      pending_->error =
          detail::concat("rank ", comm.rank(), ": AsyncShardedSaver: no thread to write ",
                         pending_->save.target, ": ", e.what());
    }
    return id;
  }
  /// save() of a copy of `ck`.
  template <class Comm>
  std::uint64_t save(Comm& comm, const Checkpoint& ck, const std::string& path) {
    return save(comm, Checkpoint(ck), path);
  }

  /// Collective: waits for this rank's write of the save in flight, if any, and completes the
  /// save on every rank (or fails on every rank with the first rank's error).
  template <class Comm>
  void wait(Comm& comm) {
    if (writer_.joinable()) writer_.join();
    if (!pending_) return;
    Pending p = std::move(*pending_);
    pending_.reset();
    detail::finish_shard_save(comm, p.path, p.save, p.error, p.written, "AsyncShardedSaver::wait");
  }

  /// Whether a save was started and not yet completed by wait().
  [[nodiscard]] bool pending() const noexcept { return pending_.has_value(); }

 private:
  struct Pending {
    detail::ShardSave save;
    std::string path;
    Checkpoint ck;
    std::string error;
    bool written;
  };
  std::optional<Pending> pending_;
  std::thread writer_;
};

/// Collective: loads the newest save of `path` that has a file of every rank that saved it
/// (a save cut short leaves the one before it), saved at this world size or any other;
/// std::nullopt on every rank when no rank sees any shard file (a run that starts afresh).
///
///  * At the world size that saved it, each rank gets its own file's checkpoint as it was saved.
///  * At another world size (or with `layout` asking for other layouts), each rank gets the
///    sections that are not sharded (which must then be the same in every file) and each
///    sharded section (Checkpoint::put_sharded) holding the values of the pieces its layout
///    names: `layout(section, sizes)`, or by default, at another world size,
///    ShardLayout::even(sizes, rank, size). Old files are read once each, by any rank that sees
///    them (shared storage or each rank's own disk), and pieces travel between ranks.
///
/// Fails on every rank when a file is invalid (Errc::protocol or Errc::system, naming the rank),
/// when there are files but no complete save, when the files come from different saves, or
/// when they disagree (Errc::mismatch).
template <class Comm>
[[nodiscard]] std::optional<Checkpoint> load_sharded_checkpoint(Comm& comm, const std::string& path,
                                                                const ShardLayoutFor& layout = {}) {
  std::string error;
  std::vector<detail::ShardFile> files;
  try {
    detail::check_directory(shard_path(path, comm.rank(), comm.size()), "Checkpoint");
    files = detail::shard_files(path);
  } catch (const Error& e) {
    error = detail::error_text(e);
  }
  detail::fail_with_first(comm, comm.all_gather_object(error), "load_sharded_checkpoint");
  const std::optional<detail::ShardSet> set = detail::choose_shard_set(comm, path, files);
  if (!set) return std::nullopt;
  return detail::load_shard_set(comm, path, *set, layout);
}

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/training/zero/impl/sharded_checkpoint.ipp"
#endif
