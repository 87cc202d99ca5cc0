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

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The failure of a monitored_barrier that the ranks `missing` (ascending, not empty) did not
/// arrive at within `timeout`, as rank `rank` reports it (rank 0 gave the verdict; the others
/// say so): it names the first missing rank, or every one with `wait_all_ranks`; its lost
/// ranks are all of them. The one verdict of every backend's monitored_barrier.
DDP_INLINE Error missed_barrier(int rank, std::string_view what, const std::vector<int>& missing,
                                std::chrono::milliseconds timeout, bool wait_all_ranks);

/// Monitored barrier number `n` of a communicator whose keys `store` holds (this rank `rank` of
/// `size`): every rank says it arrived; rank 0 waits up to `timeout` for the others and gives
/// its verdict, naming the ranks that did not arrive (all of them with `wait_all_ranks`, else
/// the first); the others wait up to `timeout` for rank 0 to arrive, then for its verdict. Fails
/// with Errc::timeout on every rank that waits; a rank whose process left ("exit/<r>") fails it
/// at once with Errc::peer_lost.
DDP_INLINE void monitored_barrier(Store& store, std::uint64_t n, int rank, int size,
                                  std::chrono::milliseconds timeout, bool wait_all_ranks);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/membership/impl/monitored_barrier.ipp"
#endif
