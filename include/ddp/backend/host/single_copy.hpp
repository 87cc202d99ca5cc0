// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// all_reduce by single copy, where every rank can read the others' memory (the shm transport
/// with Transport::copy_from), the path chooser that picks it or the slot path per message size,
/// and all_reduce_on: the one entry of a flat all_reduce (small, single copy or segments).

#include "ddp/backend/collective.hpp"
#include "ddp/backend/host/flat.hpp"
#include "ddp/backend/host/rounds.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/backend/reduce.hpp"
#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Which path an all_reduce on shared memory takes when Options::shm_single_copy_bytes is
/// automatic (rank 0 decides; the others follow what it says in the first round): both give
/// the same bits, but which is faster depends on the size and flips with the machine's state
/// (bench/README.md, "Shared memory at mid sizes"). Per power-of-two size class, each path is
/// tried a few times in turn, then the faster by its recent times runs, and the other is
/// retried every 64th call, so that a change is noticed.
class PathChooser {
 public:
  /// Whether the next all_reduce of `bytes` goes by single copy.
  [[nodiscard]] bool single(std::size_t bytes);
  /// How long an all_reduce of `bytes` took by that path.
  void record(std::size_t bytes, bool single, double seconds);

 private:
  struct Class {
    double seconds[2] = {0, 0};  // recent time of the slot path, of single copy
    std::uint32_t runs[2] = {0, 0};
    std::uint64_t calls = 0;
  };
  Class& at(std::size_t bytes);
  static constexpr std::uint32_t tries = 3;
  static constexpr std::uint64_t retry_every = 64;
  std::array<Class, 64> classes_{};
};

/// The single-copy all_reduce's state: whether rank 0 times the two paths, and what it learnt.
class SingleCopy {
 public:
  /// Options::shm_single_copy_bytes automatic: rank 0 times both paths and picks per size.
  bool choose_path = false;

  /// all_reduce by single copy: ranks exchange where their buffers lie (the round that compares
  /// fingerprints) and which path rank 0 chose (single copy unless choosing is automatic, see
  /// PathChooser: then reduce_segments may run instead), then, segment by segment, rank j copies
  /// chunk j of every peer's buffer straight out of that peer, reduces it into its own in rank
  /// order, and, once every chunk is reduced (a round), copies the peers' reduced chunks
  /// straight into its buffer; a last round keeps every buffer alive until no peer reads it.
  /// Each rank receives N bytes, written once: no copy through shared memory. The same
  /// combination order as reduce_segments, so the same bits.
  void all_reduce(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, const Fingerprint* fp);

 private:
  /// Where a rank's buffer lies in its process.
  struct Where {
    std::uint64_t addr, bytes;
    std::uint64_t single;  // rank 0's: 1 single copy, 0 the slot path
  };
  std::vector<Where> where_;
  PathChooser chooser_;
};

/// all_reduce over transport `t` (the whole communicator, or one of the hierarchical path's
/// groups): one round that gathers whole buffers when small, single copy where the transport
/// offers it for this size (`single`, when not null), else reduce_segments.
DDP_INLINE void all_reduce_on(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn,
                              const Fingerprint* fp, SingleCopy* single);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/backend/host/impl/single_copy.ipp"
#endif
