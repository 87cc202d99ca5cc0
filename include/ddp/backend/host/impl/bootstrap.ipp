// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/bootstrap.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE HostLinks::HostLinks(int r, int s) : rank(r), size(s) {}

DDP_INLINE void HostLinks::connect(const BackendInit& init) {
  const Options& o = init.options;
  if (size == 1) {
    transport = std::make_unique<SelfTransport>(o.timeout);
    local_size = 1;
    return;
  }
  Store& store = *init.store;
  shared_store = init.store;
  hierarchy.store = init.store;
  hierarchy.rank = rank;
  // The rendezvous has one timeout in all (the store view ends its calls by then).
  const auto deadline = Deadline{std::min(Deadline::after(o.timeout).at, store.deadline())};
  const HostTransport requested = requested_transport(o);
  const std::size_t segment_request = segment_bytes(o, 0);  // 0: the transport's default

  // 1. Everyone publishes who and where it is, on the interface that reaches the store, and
  //    what it was asked for; every rank must have been asked for the same.
  Fd listener = listen_tcp(store.local_address(), 0);
  const std::string identity = host_identity();
  {
    std::string rec;
    ByteWriter w(rec);
    w.str(identity);
    w.put(static_cast<std::uint32_t>(::getpid()));
    w.str(store.local_address());
    w.put(static_cast<std::uint32_t>(local_port(listener.get())));
    w.put(static_cast<std::uint8_t>(requested));
    w.put(static_cast<std::uint64_t>(segment_request));
    w.put(static_cast<std::uint8_t>(o.hierarchy));
    w.str(machine_identity());
    w.put(static_cast<std::uint64_t>(o.shm_single_copy_bytes));
    store.set(concat("peer/", rank), rec);
  }
  std::vector<std::string> identities, transports, segments, hierarchies, machines, singles;
  std::vector<int> pids;
  std::vector<std::pair<std::string, int>> addrs;
  for (const auto& rec : gather_records(store, "peer/", rank, size, o.timeout)) {
    ByteReader r(rec, "peer record");
    identities.push_back(r.str(4096));
    pids.push_back(static_cast<int>(r.get<std::uint32_t>()));
    auto addr = r.str(256);
    addrs.emplace_back(std::move(addr), static_cast<int>(r.get<std::uint32_t>()));
    const auto t = r.get<std::uint8_t>();
    transports.push_back(t == static_cast<std::uint8_t>(HostTransport::shm)   ? "shm"
                         : t == static_cast<std::uint8_t>(HostTransport::tcp) ? "tcp"
                                                                              : "automatic");
    const auto seg = r.get<std::uint64_t>();
    segments.push_back(seg == 0 ? std::string("the default") : std::to_string(seg));
    const auto h = r.get<std::uint8_t>();
    hierarchies.push_back(h == static_cast<std::uint8_t>(HostHierarchy::flat)      ? "flat"
                          : h == static_cast<std::uint8_t>(HostHierarchy::slices)  ? "slices"
                          : h == static_cast<std::uint8_t>(HostHierarchy::leaders) ? "leaders"
                          : h == static_cast<std::uint8_t>(HostHierarchy::automatic)
                              ? "auto"
                              : std::to_string(h));
    machines.push_back(r.str(256));
    const auto copy_from = r.get<std::uint64_t>();
    singles.push_back(copy_from == 0                ? std::string("the default")
                      : copy_from == Options::never ? std::string("off")
                                                    : std::to_string(copy_from));
  }
  require_agreement(rank, "the host transport (Options::transport, DDP_HOST_TRANSPORT)",
                    "every rank must ask for the same transport", transports);
  require_agreement(rank, "the segment size (Options::segment_bytes, DDP_SEGMENT_BYTES)",
                    "every rank must use the same segment size", segments);
  require_agreement(rank, "the hierarchy (Options::hierarchy, DDP_HIERARCHY)",
                    "every rank must use the same hierarchy", hierarchies);
  require_agreement(rank, "single copy (Options::shm_single_copy_bytes, DDP_SHM_SINGLE_COPY)",
                    "every rank must use the same setting", singles);
  local_leader = rank;
  for (int j = 0; j < size; ++j) {
    if (identities[static_cast<std::size_t>(j)] != identity) continue;
    if (j < rank) ++local_rank;
    local_leader = std::min(local_leader, j);
    ++local_size;
  }
  const bool one_host = local_size == size;
  // Ranks of this machine, in any namespace or container (they share its cores).
  machine_ranks = static_cast<int>(
      std::count(machines.begin(), machines.end(), machines[static_cast<std::size_t>(rank)]));

  // 2. Pick the transport: every rank computes the same answer from the same records (rank 0
  //    may still fall back from shm to tcp when /dev/shm is too small; it says so in its record).
  HostTransport choice = requested;
  if (choice == HostTransport::automatic)
    choice = one_host ? HostTransport::shm : HostTransport::tcp;
  if (choice == HostTransport::shm && !one_host) {
    fail(Errc::invalid_argument, "rank ", rank,
         ": the shm transport was requested but the ranks are on more than one host");
  }
  if (choice == HostTransport::shm) {
    std::vector<int> all(static_cast<std::size_t>(size));
    for (int j = 0; j < size; ++j) all[static_cast<std::size_t>(j)] = j;
    transport = connect_shm(store, o, all, pids, requested);
    if (!transport) choice = HostTransport::tcp;
  }
  if (choice == HostTransport::tcp) {
    TcpTransport::SessionKey key{};
    if (rank == 0) {
      random_bytes(key.data(), key.size());
      store.set("session", std::string(reinterpret_cast<const char*>(key.data()), key.size()));
    } else {
      const std::string k = store.get("session");
      if (k.size() != key.size()) fail(Errc::protocol, "bad session key in the store");
      std::memcpy(key.data(), k.data(), key.size());
    }
    // A rank that fails meanwhile says so in the store ("failed"): stop waiting then.
    const auto peer_failed = [&store] {
      const std::string failed = "failed";
      if (store.check(std::span<const std::string>(&failed, 1))) (void)store.get(failed);
    };
    auto peers = TcpTransport::connect_mesh(rank, size, listener, addrs, key, deadline, peer_failed,
                                            init.reach_window);
    if (requested == HostTransport::automatic && o.hierarchy != HostHierarchy::flat)
      connect_hierarchy(store, o, identities, pids, peers);
    transport =
        std::make_unique<TcpTransport>(rank, size, o.timeout, std::move(peers),
                                       segment_bytes(o, std::size_t{1} << 20), machine_ranks);
  }
  for (Transport* tr : {transport.get(), hierarchy.local.get(), hierarchy.across.get()}) {
    if (tr == nullptr) continue;
    tr->verify_fingerprints = o.verify_collectives;
    // A rank that leaves says why in the store (the hierarchical path's record, or the
    // rendezvous's failure when a rank fails it after others have finished theirs).
    tr->why_left = [st = shared_store](const std::vector<int>& ranks,
                                       std::chrono::milliseconds grace) {
      return left_record(*st, ranks, grace);
    };
  }
}

DDP_INLINE void HostLinks::connect_hierarchy(Store& store, const Options& o,
                                             const std::vector<std::string>& ids,
                                             const std::vector<int>& pids,
                                             const std::vector<Fd>& mesh) {
  std::vector<std::string> hosts;  // in order of their lowest rank
  std::vector<int> host_of, local_of, per_host;
  for (const std::string& id : ids) {
    const auto h =
        static_cast<std::size_t>(std::find(hosts.begin(), hosts.end(), id) - hosts.begin());
    if (h == hosts.size()) {
      hosts.push_back(id);
      per_host.push_back(0);
    }
    host_of.push_back(static_cast<int>(h));
    local_of.push_back(per_host[h]++);
  }
  const bool shared = std::any_of(per_host.begin(), per_host.end(), [](int n) { return n > 1; });
  const bool equal =
      std::all_of(per_host.begin(), per_host.end(), [&](int n) { return n == per_host.front(); });
  if (hosts.size() < 2 || !shared) return;  // one rank per host: the mesh is the hierarchy
  if (o.hierarchy == HostHierarchy::slices && !equal) {
    std::string counts;
    for (std::size_t h = 0; h < hosts.size(); ++h)
      counts += concat(h != 0 ? ", " : "", per_host[h]);
    fail(Errc::invalid_argument, "rank ", rank,
         ": the slices hierarchy (Options::hierarchy, DDP_HIERARCHY) needs as many ranks "
         "on every host, but the hosts run ",
         counts, " ranks; use leaders or auto");
  }
  hierarchy.kind = o.hierarchy == HostHierarchy::leaders || !equal ? HostHierarchy::leaders
                                                                   : HostHierarchy::slices;
  hierarchy.host_of = host_of;
  // Below this many bytes per local rank, slices' TCP rounds cost more than they save
  // (bench/README.md, "Across hosts"): all_reduce goes through the leaders.
  hierarchy.slices_from = o.hierarchy == HostHierarchy::slices ? 0 : slices_from_bytes;
  const int me_host = host_of[static_cast<std::size_t>(rank)];
  const auto group = [&](auto&& member) {
    std::vector<int> g;
    for (int j = 0; j < size; ++j) {
      if (member(j)) g.push_back(j);
    }
    return g;
  };
  // This rank's host, in rank order.
  const std::vector<int> local =
      group([&](int j) { return host_of[static_cast<std::size_t>(j)] == me_host; });
  if (local.size() > 1) {
    std::vector<int> local_pids;
    for (int j : local) local_pids.push_back(pids[static_cast<std::size_t>(j)]);
    Store sub = store.prefixed(concat("host", local.front(), "/"));
    hierarchy.local = connect_shm(sub, o, local, local_pids, HostTransport::automatic);
    if (!hierarchy.local) hierarchy.local = mesh_group(o, local, mesh);
  } else {
    hierarchy.local = std::make_unique<SelfTransport>(o.timeout);
  }
  // Across: local rank i of every host (slices; local rank 0 is also the leaders' group), in
  // host order, which is rank order of the hosts' lowest ranks.
  const int mine = local_of[static_cast<std::size_t>(rank)];
  if (hierarchy.kind == HostHierarchy::slices || mine == 0) {
    std::vector<int> across;
    for (std::size_t h = 0; h < hosts.size(); ++h) {
      for (int j = 0; j < size; ++j) {
        if (host_of[static_cast<std::size_t>(j)] == static_cast<int>(h) &&
            local_of[static_cast<std::size_t>(j)] == mine)
          across.push_back(j);
      }
    }
    hierarchy.across = mesh_group(o, across, mesh);
  }
}

DDP_INLINE std::unique_ptr<Transport> HostLinks::mesh_group(const Options& o,
                                                            const std::vector<int>& members,
                                                            const std::vector<Fd>& mesh) {
  std::vector<Fd> fds;
  int me = 0;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const int j = members[i];
    if (j == rank) {
      me = static_cast<int>(i);
      fds.emplace_back();
      continue;
    }
    Fd fd(::fcntl(mesh[static_cast<std::size_t>(j)].get(), F_DUPFD_CLOEXEC, 0));
    if (!fd) fail_errno(errno, "rank ", rank, ": duplicating the connection to rank ", j);
    fds.push_back(std::move(fd));
  }
  auto t = std::make_unique<TcpTransport>(me, static_cast<int>(members.size()), o.timeout,
                                          std::move(fds), segment_bytes(o, std::size_t{1} << 20),
                                          machine_ranks);
  t->global_ranks = members;
  return t;
}

DDP_INLINE void HostLinks::wait_for_members(Store& store, const std::vector<std::string>& keys,
                                            const std::vector<int>& members,
                                            const std::vector<int>& pids,
                                            std::chrono::milliseconds timeout, const char* what) {
  ProcessWatch watch;
  for (std::size_t j = 0; j < members.size(); ++j) {
    if (members[j] != rank) watch.add(members[j], pids[j]);
  }
  const auto deadline = std::min(Clock::now() + timeout, store.deadline());
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const auto missing = store.missing_after(
        keys, std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(50)));
    if (missing.empty()) return;
    if (const int dead = watch.first_dead(); dead >= 0) {
      // A rank that exited after failing itself (e.g. it saw another die first) relayed its
      // error through the store: a short wait there reports that root cause instead.
      if (store.missing_after(keys, std::chrono::milliseconds(300)).empty()) continue;
      fail(Errc::peer_lost, "rank ", rank, ": Communicator::init: rank ", dead,
           " died (its process exited) while ", what,
           "; the job cannot start: restart it (a launcher with --max-restarts does)");
    }
    if (left.count() <= 0) {
      std::string who;  // the keys end in the rank: "mapped/2"
      for (const auto& k : missing)
        who += concat(who.empty() ? "rank " : ", rank ", k.substr(k.rfind('/') + 1));
      fail(Errc::timeout, "rank ", rank, ": Communicator::init: timed out after ", timeout.count(),
           " ms while ", what, ": ", who, missing.size() > 1 ? " have" : " has",
           " not answered (stopped, or too slow); the job cannot start");
    }
  }
}

DDP_INLINE std::unique_ptr<Transport> HostLinks::connect_shm(Store& store, const Options& o,
                                                             const std::vector<int>& members,
                                                             const std::vector<int>& pids,
                                                             HostTransport requested) {
  const int n = static_cast<int>(members.size());
  const int me =
      static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  const int first = members.front();
  ShmLayout layout;
  layout.world = n;
  auto segment = std::make_unique<ShmSegment>();
  std::uint64_t cookie = 0;
  if (me == 0) {
    const std::size_t slot = segment_bytes(o, std::size_t{1} << 20);
    layout.slot_bytes =
        std::clamp<std::size_t>(ShmLayout::align_up(slot, 4096), 4096, max_shm_slot);
    layout.channel_bytes = std::size_t{256} << 10;
    cookie = random_value<std::uint64_t>();
    std::string why;
    const bool made = segment->create(layout.total(), why);
    std::string rec;
    ByteWriter w(rec);
    if (!made) {
      if (requested == HostTransport::shm) {
        fail(Errc::backend, "rank ", first, ": the shm transport cannot start: ", why,
             ". Give /dev/shm more room (e.g. docker run --shm-size=1g), use a smaller "
             "DDP_SEGMENT_BYTES, or DDP_HOST_TRANSPORT=tcp");
      }
      std::fprintf(stderr,
                   "ddp: rank %d: %s; using the tcp transport instead (give /dev/shm more "
                   "room, e.g. docker run --shm-size=1g, or set DDP_HOST_TRANSPORT=tcp)\n",
                   first, why.c_str());
      w.put(std::uint8_t{0});
      store.set("shm", rec);
      return nullptr;
    }
    ShmTransport::format(segment->base(), layout, cookie);
    w.put(std::uint8_t{1});
    w.str(segment->path());
    w.put(cookie);
    w.put(static_cast<std::uint64_t>(layout.slot_bytes));
    w.put(static_cast<std::uint64_t>(layout.channel_bytes));
    store.set("shm", rec);
    // The others open the segment through this process's descriptor, which is closed once
    // all have mapped it (the segment never has a name: a crash leaves nothing behind).
    std::vector<std::string> mapped;
    for (int j = 1; j < n; ++j) mapped.push_back(concat("mapped/", j));
    try {
      wait_for_members(store, mapped, members, pids, o.timeout,
                       "the ranks of this host map the shared memory segment");
    } catch (...) {
      segment->close_descriptor();
      throw;
    }
    segment->close_descriptor();
  } else {
    wait_for_members(store, {"shm"}, members, pids, o.timeout,
                     "waiting for the shared memory segment of this host's first rank");
    const std::string rec = store.get("shm");
    ByteReader r(rec, "shm record");
    if (r.get<std::uint8_t>() == 0) return nullptr;  // the first member fell back to tcp
    const std::string path = r.str(255);
    cookie = r.get<std::uint64_t>();
    layout.slot_bytes = static_cast<std::size_t>(r.get<std::uint64_t>());
    layout.channel_bytes = static_cast<std::size_t>(r.get<std::uint64_t>());
    if (layout.slot_bytes == 0 || layout.slot_bytes > max_shm_slot || layout.channel_bytes == 0 ||
        layout.channel_bytes > max_shm_slot) {
      fail(Errc::protocol, "rank ", rank, ": bad shm record from rank ", first);
    }
    segment->open(path, layout.total());
    ShmTransport::verify(segment->base(), layout, cookie);
    store.set(concat("mapped/", me), "");
  }
  auto t = std::make_unique<ShmTransport>(me, n, o.timeout, layout, std::move(segment), pids,
                                          machine_ranks);
  if (n != size) t->global_ranks = members;
  // Single copy, when every member can read every other's memory (one that cannot, e.g. under
  // Yama's ptrace_scope or a seccomp filter, turns it off for all). Every rank asked for the
  // same threshold (checked at connect).
  const std::size_t from =
      o.shm_single_copy_bytes == 0 ? single_copy_from_bytes : o.shm_single_copy_bytes;
  if (n == size) single.choose_path = o.shm_single_copy_bytes == 0;
  if (n > 1 && from != Options::never) {
    store.set(concat("probe/", me), std::to_string(t->probe_address()));
    std::vector<std::string> probes, answers;
    for (int j = 0; j < n; ++j) {
      probes.push_back(concat("probe/", j));
      answers.push_back(concat("single-copy/", j));
    }
    wait_for_members(store, probes, members, pids, o.timeout,
                     "the ranks of this host check whether they can read each other's memory");
    bool can = true;
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      const std::string addr = store.get(concat("probe/", j));
      char* end = nullptr;
      const std::uint64_t a = std::strtoull(addr.c_str(), &end, 10);
      can = end != addr.c_str() && *end == '\0' && t->probe_single_copy(j, a) && can;
    }
    store.set(concat("single-copy/", me), can ? "1" : "0");
    wait_for_members(store, answers, members, pids, o.timeout,
                     "the ranks of this host agree on single copy");
    bool all = true;
    for (int j = 0; j < n; ++j) all = store.get(concat("single-copy/", j)) == "1" && all;
    if (all) t->use_single_copy(from);
  }
  return t;
}

}  // namespace detail
DDP_END_NAMESPACE
