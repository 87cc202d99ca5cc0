// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The first steps of every communicator's rendezvous, before the backend connects:
///  * each rank claims its rank number in the store (compare-and-set), so a second process
///    started with the same RANK is refused at once and told who holds it;
///  * each rank publishes the job as it sees it (world size, backend, library version,
///    fingerprint check) and checks every other rank's record against its own, so ranks that
///    were started differently fail together with Errc::mismatch instead of running with
///    different views of the job (and different results).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/store/client.hpp"
#include "ddp/version.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Fails with Errc::mismatch unless every rank's `values[j]` equals this rank's, naming the ranks
/// that differ and their values: "rank 0: the ranks disagree on WHAT: this rank has A, rank 1 has
/// B; FIX".
DDP_INLINE void require_agreement(int rank, std::string_view what, std::string_view fix,
                                  const std::vector<std::string>& values);
#if DDP_BODIES
DDP_INLINE void require_agreement(int rank, std::string_view what, std::string_view fix,
                                  const std::vector<std::string>& values) {
  const std::string& mine = values.at(static_cast<std::size_t>(rank));
  std::string others;
  int n = 0;
  for (std::size_t j = 0; j < values.size(); ++j) {
    if (values[j] == mine) continue;
    if (n < 4) others += concat(", rank ", j, " has ", values[j]);
    ++n;
  }
  if (n == 0) return;
  if (n > 4) others += concat(" (and ", n - 4, " more ranks differ)");
  fail(Errc::mismatch, "rank ", rank, ": the ranks disagree on ", what, ": this rank has ", mine,
       others, "; ", fix);
}
#endif  // DDP_BODIES

/// The rendezvous timeout, naming the ranks whose `prefix<j>` key never appeared, and what every
/// rank must have been given alike to meet in `where` (the store: "etcd H:P,... (namespace N)",
/// or ddp's own at "H:P").
[[noreturn]] DDP_INLINE void fail_missing_ranks(int rank, int size,
                                                std::chrono::milliseconds timeout,
                                                const std::vector<std::string>& missing,
                                                std::size_t prefix_len, const std::string& where);
#if DDP_BODIES
DDP_INLINE void fail_missing_ranks(int rank, int size, std::chrono::milliseconds timeout,
                                   const std::vector<std::string>& missing, std::size_t prefix_len,
                                   const std::string& where) {
  std::string who;
  for (const auto& k : missing) who += concat(who.empty() ? "" : ", ", k.substr(prefix_len));
  const bool etcd = where.starts_with("etcd ");
  fail(Errc::timeout, "rank ", rank, ": rendezvous timed out after ", timeout.count(),
       " ms: ", size - static_cast<int>(missing.size()), "/", size, " ranks joined in the store ",
       etcd ? "" : "at ", where, "; missing rank", missing.size() == 1 ? " " : "s ", who,
       etcd ? ". Check that every rank was started with the same DDP_STORE (these etcd "
              "endpoints and namespace), DDP_GROUP and WORLD_SIZE"
            : ". Check that every rank was started with the same MASTER_ADDR, MASTER_PORT and "
              "WORLD_SIZE");
}
#endif  // DDP_BODIES

/// Waits up to `timeout` for `prefix<j>` of every rank j and returns their values; a timeout
/// names the ranks that are missing.
[[nodiscard]] DDP_INLINE std::vector<std::string> gather_records(Store& store,
                                                                 std::string_view prefix, int rank,
                                                                 int size,
                                                                 std::chrono::milliseconds timeout);
#if DDP_BODIES
DDP_INLINE std::vector<std::string> gather_records(Store& store, std::string_view prefix, int rank,
                                                   int size, std::chrono::milliseconds timeout) {
  std::vector<std::string> keys;
  for (int j = 0; j < size; ++j) keys.push_back(concat(prefix, j));
  if (auto missing = store.missing_after(keys, timeout); !missing.empty())
    fail_missing_ranks(rank, size, timeout, missing, prefix.size(), store.where());
  std::vector<std::string> values;
  for (const auto& k : keys) values.push_back(store.get(k));
  return values;
}
#endif  // DDP_BODIES

/// What a rank believes about its job; every rank must believe the same.
struct JobView {
  int world_size = 1;
  std::string backend;
  bool verify_collectives = true;
  std::int64_t heartbeat_ms = 0;  ///< Options::heartbeat (0: none)
  bool timeline = false;          ///< Options::timeline is set (init() aligns the clocks)
};

/// Who this process is, as another process would be told ("pid 123 on host node7").
[[nodiscard]] DDP_INLINE std::string process_label();
#if DDP_BODIES
DDP_INLINE std::string process_label() {
  char name[256] = {};
  (void)::gethostname(name, sizeof name - 1);
  return concat("pid ", ::getpid(), " on host ", name);
}
#endif  // DDP_BODIES

/// Process `pid`'s start time (clock ticks after boot, /proc/PID/stat field 22); "" when it is
/// gone or has ended (a zombie its parent has not reaped yet).
[[nodiscard]] DDP_INLINE std::string process_start(int pid);
#if DDP_BODIES
DDP_INLINE std::string process_start(int pid) {
  const std::string path = concat("/proc/", pid, "/stat");
  std::string stat(1024, '\0');
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  const ssize_t n = fd < 0 ? 0 : ::read(fd, stat.data(), stat.size());
  if (fd >= 0) ::close(fd);
  if (n <= 0) return {};
  stat.resize(static_cast<std::size_t>(n));
  std::size_t at = stat.rfind(')');  // the name may hold spaces
  if (at == std::string::npos || at + 2 >= stat.size() || stat[at + 2] == 'Z' ||
      stat[at + 2] == 'X')
    return {};
  for (int field = 2; field < 22 && at != std::string::npos; ++field) at = stat.find(' ', at + 1);
  if (at == std::string::npos) return {};
  return stat.substr(at + 1, stat.find(' ', at + 1) - at - 1);
}
#endif  // DDP_BODIES

/// This process as another process on the same machine can find it: host name, boot id and pid
/// namespace, then pid and start time ("host|boot|pidns pid start").
[[nodiscard]] DDP_INLINE std::string process_identity();
#if DDP_BODIES
DDP_INLINE std::string process_identity() {
  char name[256] = {};
  (void)::gethostname(name, sizeof name - 1);
  const auto first_line = [](const char* path) {
    std::string text(256, '\0');
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    const ssize_t n = fd < 0 ? 0 : ::read(fd, text.data(), text.size());
    if (fd >= 0) ::close(fd);
    text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    return text.substr(0, text.find('\n'));
  };
  char ns[128] = {};
  (void)!::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  return concat(name, "|", first_line("/proc/sys/kernel/random/boot_id"), "|", ns, " ", ::getpid(),
                " ", process_start(::getpid()));
}
#endif  // DDP_BODIES

/// Whether the process `identity` (process_identity()) ran on this machine, in this pid
/// namespace, and has ended: certain evidence of a death, without waiting for a lease.
[[nodiscard]] DDP_INLINE bool ended_here(std::string_view identity);
#if DDP_BODIES
DDP_INLINE bool ended_here(std::string_view identity) {
  const std::string mine = process_identity();
  const std::size_t a = identity.find(' '), b = mine.find(' ');
  if (a == std::string_view::npos || identity.substr(0, a) != std::string_view(mine).substr(0, b))
    return false;
  const std::string_view rest = identity.substr(a + 1);
  const std::size_t sp = rest.find(' ');
  int pid = 0;
  if (sp == std::string_view::npos ||
      std::from_chars(rest.data(), rest.data() + sp, pid).ec != std::errc{} || pid <= 0)
    return false;
  return process_start(pid) != rest.substr(sp + 1);
}
#endif  // DDP_BODIES

/// Claims `rank` in the store: fails with Errc::invalid_argument, naming the process that holds
/// it, when another process claimed it first. Returns normally once the rank is this process's.
DDP_INLINE void claim_rank(Store& store, int rank, std::string_view group);
#if DDP_BODIES
DDP_INLINE void claim_rank(Store& store, int rank, std::string_view group) {
  const std::string me =
      concat(process_label(), " [", random_value<std::uint64_t>(), "]");  // unique per claim
  const std::string held = store.compare_set(concat("claim/", rank), "", me);
  if (held == me) return;
  const std::string who = held.substr(0, held.find(" ["));
  int pid = 0;
  const bool here = who.ends_with(process_label().substr(process_label().find(" on host")));
  if (here && std::from_chars(who.data() + 4, who.data() + who.size(), pid).ec == std::errc{} &&
      pid > 0 && process_start(pid).empty())
    fail(Errc::invalid_argument, "rank ", rank, ": rank ", rank, " of group \"", group,
         "\" was claimed by ", who,
         ", which has ended: the store holds an earlier run's keys (with an etcd store, give "
         "each run its own namespace, DDP_STORE=etcd://.../NAME, or --rdzv-id; an ended run's "
         "keys vanish a minute after its last process)");
  fail(Errc::invalid_argument, "rank ", rank, ": rank ", rank, " of group \"", group,
       "\" is already taken by ", who, "; this process (", process_label(),
       ") was started with the same RANK. Give every process its own RANK (0..WORLD_SIZE-1)");
}
#endif  // DDP_BODIES

/// Publishes this rank's view of the job and checks it against every rank's (see the file
/// comment). Errc::mismatch names the ranks that differ and both values. `widest` is set to the
/// largest world size any rank claimed (before a mismatch is thrown): the store's host waits for
/// that many ranks to read the failure before it stops serving.
DDP_INLINE void agree_on_job(Store& store, int rank, const JobView& job,
                             std::chrono::milliseconds timeout, int& widest);
#if DDP_BODIES
DDP_INLINE void agree_on_job(Store& store, int rank, const JobView& job,
                             std::chrono::milliseconds timeout, int& widest) {
  std::string rec;
  ByteWriter w(rec);
  w.str(DDP_VERSION_STRING);
  w.put(static_cast<std::uint32_t>(job.world_size));
  w.str(job.backend);
  w.put(static_cast<std::uint8_t>(job.verify_collectives ? 1 : 0));
  w.put(job.heartbeat_ms);
  w.put(static_cast<std::uint8_t>(job.timeline ? 1 : 0));
  store.set(concat("job/", rank), rec);
  std::vector<std::string> versions, worlds, backends, verify, heartbeats, timelines;
  for (const auto& r : gather_records(store, "job/", rank, job.world_size, timeout)) {
    ByteReader rd(r, "job record");
    versions.push_back(rd.str(64));
    const auto ws = rd.get<std::uint32_t>();
    worlds.push_back(std::to_string(ws));
    if (ws <= 1u << 20) widest = std::max(widest, static_cast<int>(ws));
    backends.push_back(rd.str(64));
    verify.push_back(rd.get<std::uint8_t>() != 0 ? "on" : "off");
    const auto hb = rd.get<std::int64_t>();
    heartbeats.push_back(hb > 0 ? concat(hb, " ms") : std::string("none"));
    timelines.push_back(rd.get<std::uint8_t>() != 0 ? "a directory" : "none");
  }
  require_agreement(rank, "the world size",
                    "start every rank with the same WORLD_SIZE (if the others are another job's "
                    "processes, give each job its own MASTER_PORT)",
                    worlds);
  require_agreement(rank, "the ddp version", "build every rank against the same ddp", versions);
  require_agreement(rank, "the backend", "every rank must create the same Communicator<Backend>",
                    backends);
  require_agreement(rank, "Options::verify_collectives (DDP_VERIFY_COLLECTIVES)",
                    "every rank must use the same setting", verify);
  require_agreement(rank, "Options::heartbeat (DDP_HEARTBEAT)",
                    "every rank must use the same heartbeat (a rank that waits longer than the "
                    "others sign would count them lost, or they it)",
                    heartbeats);
  require_agreement(rank, "Options::timeline (DDP_TIMELINE)",
                    "set it on every rank or on none (init() aligns the ranks' clocks together)",
                    timelines);
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
