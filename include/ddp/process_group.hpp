// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::ProcessGroup: what the training helpers need from a communicator — its rank and size,
/// and a few host values reduced or broadcast on any backend (all_reduce_host, broadcast_host).
/// Communicator<Backend> satisfies it for every backend. exact_mean and sync_batch_stats take
/// any ProcessGroup; GradientAverager and ZeroFirstGuard take a Communicator<Backend>, whose
/// Backend they deduce (they move the backend's own kind of buffer).

#include "ddp/config.hpp"
#include "ddp/types.hpp"

#include <concepts>
#include <cstdint>
#include <span>

DDP_BEGIN_NAMESPACE

template <class C>
concept ProcessGroup = requires(C& c, std::span<double> values, std::span<std::int64_t> ints) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce_host(values, ReduceOp::sum);
  c.broadcast_host(ints, 0);
};

DDP_END_NAMESPACE
