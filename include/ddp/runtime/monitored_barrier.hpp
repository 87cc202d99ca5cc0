// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Communicator::monitored_barrier over a rendezvous store (torch's monitored_barrier): every
/// rank says it arrived; rank 0 waits for the others and gives its verdict, naming the ranks that
/// did not arrive.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/store/client.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Monitored barrier number `n` of a communicator whose keys `store` holds (this rank `rank` of
/// `size`): every rank says it arrived; rank 0 waits up to `timeout` for the others and gives
/// its verdict, naming the ranks that did not arrive (all of them with `wait_all_ranks`, else
/// the first); the others wait up to `timeout` for rank 0 to arrive, then for its verdict. Fails
/// with Errc::timeout on every rank that waits; a rank whose process left ("exit/<r>") fails it
/// at once with Errc::peer_lost.
DDP_INLINE void monitored_barrier(Store& store, std::uint64_t n, int rank, int size,
                                  std::chrono::milliseconds timeout, bool wait_all_ranks);
#if DDP_BODIES
DDP_INLINE void monitored_barrier(Store& store, std::uint64_t n, int rank, int size,
                                  std::chrono::milliseconds timeout, bool wait_all_ranks) {
  const std::string at = concat("monitored/", n, "/");
  const std::string what = concat("monitored_barrier #", n);
  const std::string verdict = at + "verdict";
  // Waits up to `limit` for `keys` (each ends in the rank it waits for; the verdict is rank
  // 0's); returns those still missing. A rank among them whose process left (its store
  // connection closed: "exit/<r>") is not waited for: that fails at once with Errc::peer_lost.
  const auto await = [&](std::vector<std::string> keys, std::chrono::milliseconds limit,
                         const char* doing) {
    const auto deadline = Clock::now() + limit;
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      keys = store.missing_after(
          keys, std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(100)));
      if (keys.empty() || left.count() <= 0) return keys;
      for (const std::string& k : keys) {
        const std::string r = k == verdict ? "0" : k.substr(k.rfind('/') + 1),
                          exited[] = {concat("exit/", r)};
        if (!store.check(exited)) continue;
        const std::string why = concat("rank ", r,
                                       " left (its process exited, or it destroyed "
                                       "its communicator) before ",
                                       doing);
        if (rank == 0) store.set(verdict, why);
        fail(Errc::peer_lost, "rank ", rank, ": ", what, ": ", why);
      }
    }
  };
  store.set(concat(at, rank), "");
  if (rank == 0) {
    std::vector<std::string> keys;
    for (int r = 1; r < size; ++r) keys.push_back(concat(at, r));
    const auto missing = await(keys, timeout, "arriving");
    if (missing.empty()) {
      store.set(verdict, "");
      return;
    }
    std::string who;
    const std::size_t named = wait_all_ranks ? missing.size() : 1;
    for (std::size_t i = 0; i < named; ++i)
      who += concat(i == 0 ? "" : ", ", missing[i].substr(at.size()));
    const std::string why =
        concat(named == 1 ? "rank " : "ranks ", who, " did not arrive within ", timeout.count(),
               " ms (stopped, slow, or not calling it)",
               wait_all_ranks || missing.size() == 1
                   ? ""
                   : concat("; ", missing.size() - 1,
                            " more did not either (wait_all_ranks names every one)"));
    store.set(verdict, why);
    fail(Errc::timeout, "rank 0: ", what, ": ", why);
  }
  if (!await({at + "0"}, timeout, "arriving").empty())
    fail(Errc::timeout, "rank ", rank, ": ", what, ": rank 0 did not arrive within ",
         timeout.count(), " ms (stopped, slow, or not calling it)");
  // Rank 0 gives it within `timeout` of its own arrival (and a moment to write it).
  const auto grace = timeout + std::chrono::seconds(2);
  if (!await({verdict}, grace, "giving its verdict").empty())
    fail(Errc::timeout, "rank ", rank, ": ", what, ": rank 0 gave no verdict within ",
         grace.count(), " ms of arriving");
  if (std::string why = store.get(verdict); !why.empty())
    fail(why.find(" left (") != std::string::npos ? Errc::peer_lost : Errc::timeout, "rank ", rank,
         ": ", what, ": failed because rank 0 reported: ", why);
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
