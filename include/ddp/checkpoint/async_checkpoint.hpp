// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::AsyncSaver: checkpoint saves that do not stop training (torch.distributed.checkpoint's
/// async_save). save() returns once the checkpoint is this saver's (moved in, or its file's bytes
/// copied into a buffer the saver reuses); a thread of the saver writes the file with
/// Checkpoint::save's atomicity and checks (a temporary next to the target, fsync, rename, fsync
/// of the directory), so a crash or SIGKILL during the write leaves the previous checkpoint
/// loadable. One save at a time: the next save() waits for the one in flight, and an error of
/// that one (a full disk, a missing directory, a link at the path) is thrown there, or by wait().
///
///     ddp::AsyncSaver saver;
///     for (int step = 0;; ++step) {
///       ...train...
///       if (step % 100 == 0) {
///         ddp::Checkpoint& ck = saver.next();      // waits for the last write; its memory kept
///         ck.put_values("w", weights);              // the snapshot: one copy of the state
///         saver.save("run.ckpt");                   // returns at once; written meanwhile
///       }
///     }
///     saver.wait();                                 // before the program ends
///
/// save(std::move(ck), path) takes a checkpoint built elsewhere (nothing copied, its memory freed
/// once serialized); save(ck, path) copies its file's bytes first.
///
/// An AsyncSaver saves one process's file. In a job of several ranks, a checkpoint that every
/// rank holds whole (replicated parameters and optimizer state, DDP's) is saved by rank 0 alone
/// (`if (comm.rank() == 0) saver.save(...)`); state sharded over the ranks (ZeRO, fully sharded)
/// is saved by every rank together with AsyncShardedSaver
/// (ddp/training/zero/sharded_checkpoint.hpp), the collective twin of save_sharded_checkpoint.

#include "ddp/config.hpp"
#include "ddp/observe/timeline.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/detail/files.hpp"
#include "ddp/error.hpp"

#include <exception>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

DDP_BEGIN_NAMESPACE

/// Saves checkpoints in the background, one at a time (see the file comment). Not copyable; its
/// destructor waits for the save in flight.
class AsyncSaver {
 public:
  AsyncSaver() = default;
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;
  /// Waits for the save in flight; its error, if any, is printed to stderr (a destructor cannot
  /// throw it): call wait() first to handle it.
  ~AsyncSaver();

  /// Takes `ck` (nothing is copied) and writes it to `path` in the background, after waiting for
  /// the save before it. Throws that earlier save's error instead (and starts nothing).
  void save(Checkpoint&& ck, std::string path);

  /// Copies `ck`'s file bytes into this saver's buffer (its memory reused from one save to the
  /// next) and writes them to `path` in the background; `ck` may change as soon as this returns.
  /// Waits for, and throws the error of, the save before it, as the other overload.
  void save(const Checkpoint& ck, std::string path);

  /// The saver's own checkpoint, for the next save(path): waits for the save in flight (throwing
  /// its error), and returns the checkpoint it wrote, sections kept, so that putting the state
  /// into it again reuses their memory (the cheapest snapshot: one copy, no new pages).
  [[nodiscard]] Checkpoint& next();
  /// Writes next()'s checkpoint to `path` in the background.
  void save(std::string path);

  /// Waits for the save in flight; throws its error: Errc::system naming the path and the reason
  /// (the earlier file at the path is then as it was), Errc::invalid_argument for something other
  /// than a regular file at the path.
  void wait();

  /// Whether a save was started and has not been waited for.
  [[nodiscard]] bool pending() const noexcept { return writer_.joinable(); }

 private:
  void start(std::string path);
  void write(const std::string& path) noexcept;

  std::optional<Checkpoint> owned_;  // the checkpoint being written: moved in, or next()'s
  bool keep_ = false;                // next()'s: kept for the next snapshot
  std::string bytes_;                // its file's bytes (reused)
  std::exception_ptr error_;         // the last save's, until wait() throws it
  std::string error_path_;
  std::thread writer_;
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/checkpoint/impl/async_checkpoint.ipp"
#endif
