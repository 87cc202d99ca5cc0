// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Files that a crash, a full disk or a hostile directory cannot corrupt, for checkpoints:
///  * StagedFile: a temporary file next to its target, created exclusively under an
///    unpredictable name (never through a link someone planted), locked while in use, flushed,
///    then renamed into place; removed when anything fails;
///  * remove_abandoned(): the temporaries of processes that were killed mid-save, found by their
///    lock and their process id, removed by the next save;
///  * non_regular(): what a path is when it is not a regular file (a link, a FIFO, a directory),
///    without following links and without opening it (opening a FIFO blocks);
///  * suffixes(): the regular files "<stem>.<rest>" of a directory (checkpoint generations).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/crypto.hpp"
#include "ddp/error.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The directory `path` is in: "." for a bare name, "/" for a file in the root.
DDP_INLINE std::string parent_dir(const std::string& path);

/// The last component of `path`.
DDP_INLINE std::string base_name(const std::string& path);

/// What a file of mode `m` is, for messages; nullptr for a regular file.
DDP_INLINE const char* file_kind(mode_t m) noexcept;

/// What `path` is when something other than a regular file is there ("a symbolic link", "a
/// FIFO", ...), not following a link and not opening it; nullptr for a regular file or nothing.
DDP_INLINE const char* non_regular(const std::string& path) noexcept;

/// Flushes directory `dir`, so that a rename or an unlink in it is on disk. Returns 0, or the
/// errno of a failed flush (EIO); where directories cannot be flushed at all (EINVAL, EROFS) it
/// counts as done.
DDP_INLINE int sync_dir(const std::string& dir) noexcept;

/// The rest of the names of the regular files "<base_name(stem)>.<rest>" in stem's directory, in
/// no particular order. Fails with Errc::system when the directory cannot be read.
DDP_INLINE std::vector<std::string> suffixes(const std::string& stem);

/// Whether process `pid` has ended on this host: it does not exist, or is a zombie (dead, not yet
/// reaped by its parent). A process of another user counts as running.
DDP_INLINE bool process_gone(long pid) noexcept;

/// Removes the temporaries "<family>.tmp.<pid>[.<anything>]" (StagedFile's, and the older
/// "<path>.tmp.<pid>") that a process killed mid-save left behind: those whose process has ended
/// on this host (a zombie included) and that nobody holds locked. Best effort; never throws.
DDP_INLINE void remove_abandoned(const std::string& family) noexcept;

/// A temporary file "<family>.tmp.<pid>.<16 hex digits>" in family's directory, created with
/// O_EXCL | O_NOFOLLOW (a link or anything else planted under its name is never written through;
/// a new name is drawn), locked (flock) while this object holds it, written and flushed by
/// write(), renamed into place by commit(), and removed on destruction unless committed or
/// released. Errors are Errc::system, "<what>: <action> <file>: <reason>".
class StagedFile {
 public:
  StagedFile(const std::string& family, std::string what);
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;
  StagedFile(StagedFile&& o) noexcept;
  StagedFile& operator=(StagedFile&&) = delete;
  ~StagedFile() { discard(); }

  /// The temporary file's name.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

  /// Writes all of `bytes` and flushes them to disk; on failure the file is removed.
  void write(std::string_view bytes);

  /// Renames the file to `to` and flushes the directory, so that `to` is the new file in one
  /// step. `to` must be a regular file or nothing (Errc::invalid_argument otherwise: a link is
  /// not replaced, nor written through).
  void commit(const std::string& to);

  /// Gives the file up without removing it (it is closed and unlocked); returns its name.
  std::string release() noexcept;

  /// Removes the file (when there is one).
  void discard() noexcept;

 private:
  template <class... A>
  [[noreturn]] void io_fail(const A&... a) const {
    const int err = errno;
    fail(Errc::system, what_, ": ", a..., ": ", std::strerror(err));
  }
  template <class... A>
  [[noreturn]] void failed(int err, const A&... a) {
    const std::string msg = concat(what_, ": ", a..., ": ", std::strerror(err));
    discard();
    fail(Errc::system, msg);
  }

  std::string what_;
  std::string name_;
  int fd_ = -1;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/files.ipp"
#endif
