// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/membership/rendezvous.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <algorithm>
#include <charconv>

DDP_BEGIN_NAMESPACE
namespace detail {

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

DDP_INLINE std::string process_label() {
  char name[256] = {};
  (void)::gethostname(name, sizeof name - 1);
  return concat("pid ", ::getpid(), " on host ", name);
}

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

}  // namespace detail
DDP_END_NAMESPACE
