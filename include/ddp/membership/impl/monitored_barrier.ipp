// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/membership/monitored_barrier.hpp>'s non-template functions. That header
// includes this file at its bottom, and nothing else does: in the header-only mode in every unit,
// in the separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE Error missed_barrier(int rank, std::string_view what, const std::vector<int>& missing,
                                std::chrono::milliseconds timeout, bool wait_all_ranks) {
  const std::size_t named = wait_all_ranks ? missing.size() : 1;
  std::string who;
  for (std::size_t i = 0; i < named; ++i) who += concat(i == 0 ? "" : ", ", missing[i]);
  return Error(
      Errc::timeout,
      concat("rank ", rank, ": ", what, ": ", rank == 0 ? "" : "failed because rank 0 reported: "),
      rank == 0 ? -1 : 0,
      concat(named == 1 ? "rank " : "ranks ", who, " did not arrive within ", timeout.count(),
             " ms (stopped, slow, or not calling it)",
             wait_all_ranks || missing.size() == 1
                 ? ""
                 : concat("; ", missing.size() - 1,
                          " more did not either (wait_all_ranks names every one)")),
      missing);
}

DDP_INLINE void monitored_barrier(Store& store, std::uint64_t n, int rank, int size,
                                  std::chrono::milliseconds timeout, bool wait_all_ranks) {
  const std::string at = concat("monitored/", n, "/");
  const std::string what = concat("monitored_barrier #", n);
  const std::string verdict = at + "verdict";  // "" when every rank arrived, else a stop value
  // Waits up to `limit` for the ranks `ranks` (-1: rank 0's verdict); returns those still
  // missing. A rank among them whose process left (its store connection closed: "exit/<r>") is
  // not waited for: that fails at once with Errc::peer_lost.
  const auto await = [&](std::vector<int> ranks, std::chrono::milliseconds limit,
                         const char* doing) {
    const auto key = [&](int r) { return r < 0 ? verdict : concat(at, r); };
    const auto deadline = Clock::now() + limit;
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      std::vector<std::string> keys;
      for (const int r : ranks) keys.push_back(key(r));
      keys = store.missing_after(
          keys, std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(100)));
      std::erase_if(
          ranks, [&](int r) { return std::find(keys.begin(), keys.end(), key(r)) == keys.end(); });
      if (ranks.empty() || left.count() <= 0) return ranks;
      for (const int r : ranks) {
        const int gone = std::max(r, 0);
        const std::string exited[] = {concat("exit/", gone)};
        if (!store.check(exited)) continue;
        const Error lost(Errc::peer_lost, concat("rank ", rank, ": ", what, ": "), -1,
                         concat("rank ", gone,
                                " left (its process exited, or it destroyed its communicator) "
                                "before ",
                                doing),
                         {gone});
        if (rank == 0) store.set(verdict, Store::stop_value(lost));
        DDP_THROW(lost);
      }
    }
  };
  store.set(concat(at, rank), "");
  if (rank == 0) {
    std::vector<int> others;
    for (int r = 1; r < size; ++r) others.push_back(r);
    const std::vector<int> missing = await(others, timeout, "arriving");
    if (missing.empty()) {
      store.set(verdict, "");
      return;
    }
    const Error e = missed_barrier(0, what, missing, timeout, wait_all_ranks);
    store.set(verdict, Store::stop_value(e));
    DDP_THROW(e);
  }
  if (!await({0}, timeout, "arriving").empty())
    fail_from(-1, {0}, Errc::timeout, "rank ", rank, ": ", what, ": rank 0 did not arrive within ",
              timeout.count(), " ms (stopped, slow, or not calling it)");
  // Rank 0 gives it within `timeout` of its own arrival (and a moment to write it).
  const auto grace = timeout + std::chrono::seconds(2);
  if (!await({-1}, grace, "giving its verdict").empty())
    fail_from(-1, {}, Errc::timeout, "rank ", rank, ": ", what, ": rank 0 gave no verdict within ",
              grace.count(), " ms of arriving");
  if (const std::string v = store.get(verdict); !v.empty()) {
    const auto e = decode_stop(v);
    if (!e) fail(Errc::protocol, "rank ", rank, ": ", what, ": rank 0's verdict is not one");
    DDP_THROW(Error(e->code(),
                    concat("rank ", rank, ": ", what, ": failed because rank 0 reported: "), 0,
                    e->origin_message(), e->lost_ranks()));
  }
}

}  // namespace detail
DDP_END_NAMESPACE
