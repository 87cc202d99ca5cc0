// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Staging: how a backend that moves host memory only (backend::Host, a non-CUDA-aware
/// backend::Mpi) runs a collective on device buffers. Each device buffer is copied into host
/// staging memory, the backend works there, and results are copied back.
///
/// Elementwise collectives (all_reduce, broadcast, reduce) give the same result piece by piece,
/// so they run as a pipeline over fixed-size pieces in three rotating staging slots: while the
/// backend works on piece k, piece k+1 is copied in and piece k-1 copied out. Every piece carries
/// the whole buffer's count in its fingerprint (Buf::whole), so ranks that disagree on the size
/// fail on the first piece. Other collectives stage each buffer whole.
///
/// The copies are a `StagingCopier` (ddp::detail::CudaStager with pinned memory and CUDA
/// streams; the unit tests use plain memcpy), so this file has no device dependency.

#include "ddp/backend/collective.hpp"
#include "ddp/config.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <tuple>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The copies staging needs. Slots are independent staging areas; a slot is only resized or
/// reused after its copies were waited for.
template <class C>
concept StagingCopier = requires(C& c, int slot, std::byte* p, const std::byte* q, std::size_t n,
                                 void* stream) {
  { c.slot(slot, n) } -> std::same_as<std::byte*>;  // host memory of at least n bytes
  c.after(stream);         // later copies (both ways) start after the work queued on `stream`
  c.fetch(slot, p, q, n);  // device q -> host p, asynchronously
  c.wait_fetch(slot);      // the slot's last fetch has landed
  c.store(slot, p, q, n);  // host q -> device p, asynchronously
  c.wait_store(slot);      // the slot's last store has landed (no-op when none is pending)
};

/// Staging slots 0..2 rotate through the pieces of an elementwise collective; whole-buffer
/// staging uses slots 3 and 4.
inline constexpr int staging_pipeline_slots = 3;
inline constexpr int staging_whole_slot = 3;

/// Runs op(host piece) over `dev` in pieces of at most `piece_bytes`, copying each piece in first
/// when `fetch` and back afterwards when `store`; returns when every store has landed. Always
/// calls op at least once (an empty collective still synchronizes the ranks). Every store has
/// landed when this returns, so later work on any stream sees the results.
template <StagingCopier C, class Op>
void stage_elementwise(C& c, const Buf& dev, bool fetch, bool store, std::size_t piece_bytes,
                       Op&& op) {
  const std::size_t elem = dev.elem();
  const std::size_t per = std::max<std::size_t>(1, piece_bytes / elem);
  const std::size_t pieces = std::max<std::size_t>(1, (dev.count + per - 1) / per);
  const auto length = [&](std::size_t k) { return std::min(per, dev.count - k * per); };
  const std::size_t slot_bytes = std::min(per, dev.count) * elem;  // piece 0 is the longest
  const auto host = [&](std::size_t k) {
    return c.slot(static_cast<int>(k % staging_pipeline_slots), slot_bytes);
  };
  c.after(dev.stream);
  if (fetch && dev.count != 0) {
    c.fetch(0, host(0), dev.at(0), length(0) * elem);
  }
  for (std::size_t k = 0; k < pieces; ++k) {
    const int slot = static_cast<int>(k % staging_pipeline_slots);
    if (fetch && k + 1 < pieces) {  // bring the next piece in while this one is worked on
      const int next = static_cast<int>((k + 1) % staging_pipeline_slots);
      c.wait_store(next);
      c.fetch(next, host(k + 1), dev.at((k + 1) * per), length(k + 1) * elem);
    }
    const std::size_t n = dev.count == 0 ? 0 : length(k);
    std::byte* h = n == 0 ? nullptr : host(k);
    if (fetch && n != 0) c.wait_fetch(slot);
    if (!fetch && n != 0) c.wait_store(slot);  // store-only: the slot's previous store is done
    op(Buf{h, n, dev.dtype, Device::cpu(), nullptr, dev.count});
    if (store && n != 0) c.store(slot, dev.at(k * per), h, n * elem);
  }
  for (int s = 0; s < staging_pipeline_slots; ++s) c.wait_store(s);
}

/// A buffer of a non-elementwise collective and what the collective does with it.
struct StagedArg {
  Buf buf;
  bool fetch = false;  // the collective reads it
  bool store = false;  // the collective writes it
};

/// Runs op(host buffers...) with every device buffer among `args` staged whole: copied in when
/// read, copied back when written. Host buffers and empty ones pass through.
template <StagingCopier C, class Op, std::size_t N>
void stage_whole(C& c, std::array<StagedArg, N> args, Op&& op) {
  std::array<Buf, N> host{};
  std::array<bool, N> moved{};
  for (std::size_t i = 0; i < N; ++i) {
    const Buf& b = args[i].buf;
    host[i] = b;
    if (b.device.is_cpu() || b.data == nullptr || b.count == 0) continue;
    const int slot = staging_whole_slot + static_cast<int>(i);
    host[i] = Buf{c.slot(slot, b.bytes()), b.count, b.dtype, Device::cpu(), nullptr};
    moved[i] = true;
    c.after(b.stream);  // read or overwritten: after the work that uses it now
    if (args[i].fetch) c.fetch(slot, host[i].data, b.data, b.bytes());
  }
  for (std::size_t i = 0; i < N; ++i) {
    if (moved[i] && args[i].fetch) c.wait_fetch(staging_whole_slot + static_cast<int>(i));
  }
  std::apply([&](const auto&... h) { op(h...); }, host);
  for (std::size_t i = 0; i < N; ++i) {
    if (moved[i] && args[i].store) {
      const int slot = staging_whole_slot + static_cast<int>(i);
      c.store(slot, args[i].buf.data, host[i].data, args[i].buf.bytes());
    }
  }
  for (std::size_t i = 0; i < N; ++i) {
    if (moved[i] && args[i].store) c.wait_store(staging_whole_slot + static_cast<int>(i));
  }
}

}  // namespace detail
DDP_END_NAMESPACE
