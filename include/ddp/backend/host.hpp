// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// backend::Host: the built-in backend, with no dependency beyond the standard library and POSIX.
/// Shared memory between the ranks of one host, TCP between hosts (or on one host with
/// DDP_HOST_TRANSPORT=tcp).
///
/// Every collective is built from rounds (see backend/host/transport.hpp) with one family of
/// algorithms on both transports:
///  * all_reduce of a small buffer: every rank offers its whole buffer and reduces all of them;
///  * all_reduce of a large buffer, in segments sized for the cache: a reduce-scatter in which
///    rank j reduces chunk j of every rank's segment, then an all-gather of the reduced chunks;
///    every rank's core is busy and each input byte is read once;
///  * broadcast, gather, scatter, all_gather, reduce_scatter and all_to_all in segments.
/// Every element is reduced in rank order 0..P-1 in both paths, so results are bitwise identical
/// on every rank, in every run, for every message size and on both transports.

#include "ddp/backend/backend.hpp"
#include "ddp/backend/host/shm.hpp"
#include "ddp/backend/host/tcp.hpp"
#include "ddp/backend/host/transport.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/bytes.hpp"
#include "ddp/detail/crypto.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/runtime/collective.hpp"
#include "ddp/runtime/reduce.hpp"
#include "ddp/runtime/rendezvous.hpp"
#include "ddp/store/client.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {

/// Element range [lo, hi) of part j when m elements are split into `parts` cache-line-aligned
/// parts (the last takes the remainder; parts may be empty).
[[nodiscard]] inline std::pair<std::size_t, std::size_t> split_range(std::size_t m, int parts,
                                                                     int j, std::size_t elem) {
  const std::size_t align = std::max<std::size_t>(1, 64 / elem);
  const auto bound = [&](int k) -> std::size_t {
    if (k >= parts) return m;
    const std::size_t b = m * static_cast<std::size_t>(k) / static_cast<std::size_t>(parts);
    return b / align * align;
  };
  return {bound(j), bound(j + 1)};
}

}  // namespace detail

namespace backend {

/// The built-in backend: host memory over shared memory within a host and TCP between hosts,
/// with results bitwise identical on every rank (see the file comment).
class Host {
 public:
  static constexpr std::string_view name = "host";  ///< The backend's name, in messages.

  /// Rendezvous through init.store, choose a transport and connect (see the file comment).
  [[nodiscard]] static std::unique_ptr<Host> create(const detail::BackendInit& init) {
    auto host = std::unique_ptr<Host>(new Host(init.rank, init.size));
    host->connect(init);
    return host;
  }

  /// This process's rank, 0 .. size()-1.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of ranks.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// This process's rank among the ranks on this host.
  [[nodiscard]] int local_rank() const noexcept { return local_rank_; }
  /// The number of ranks on this host.
  [[nodiscard]] int local_size() const noexcept { return local_size_; }
  /// The lowest rank on this host (names the host in split()).
  [[nodiscard]] int local_leader() const noexcept { return local_leader_; }
  /// "shm", "tcp" or "self".
  [[nodiscard]] std::string_view transport() const noexcept { return t_->name(); }
  /// How all_reduce runs: "flat" (every rank on the transport above), or across hosts
  /// "slices" or "leaders" (see HostHierarchy and the file comment).
  [[nodiscard]] std::string_view hierarchy() const noexcept {
    return hier_ == HostHierarchy::slices    ? "slices"
           : hier_ == HostHierarchy::leaders ? "leaders"
                                             : "flat";
  }
  /// The smallest all_reduce, in bytes, that copies straight out of the peers' memory (single
  /// copy, see Options::shm_single_copy_bytes); Options::never when none does (tcp, across
  /// hosts, or the kernel does not let these ranks read each other's memory).
  [[nodiscard]] std::size_t single_copy_bytes() const noexcept { return t_->single_copy_from(); }
  /// Whether this backend can use memory on `device` (the Host backend: host memory).
  [[nodiscard]] static bool supports(const Device& device) noexcept { return device.is_cpu(); }

  /// Communicator::all_reduce: in place, each element reduced in rank order.
  void all_reduce(const detail::Buf& b, ReduceOp op) {
    const bool across = hier_ != HostHierarchy::flat;
    const auto fp =
        next(detail::Coll::all_reduce, b.dtype, b.fingerprint_count(), -1, op, true, !across);
    if (across) {
      hierarchical_all_reduce(b, op, fp);
      return;
    }
    all_reduce_on(*t_, b, detail::reduce_fn(b.dtype, op), &fp);
  }

  /// all_reduce of float32 values that travel and are reduced as `wire` (float16 or bfloat16):
  /// each rank rounds its values to `wire` as it offers them (into the shared-memory slot), the
  /// owner of a chunk reduces the `wire` values in float, in rank order, and rounds the result
  /// to `wire` once, and every rank writes the rounded result back as float32. The result is
  /// bitwise that of converting to `wire`, all_reduce on `wire`, and converting back, in the
  /// passes over memory of a plain all_reduce, with half its bytes moved.
  void all_reduce_as(const detail::Buf& b, ReduceOp op, DType wire) {
    const detail::WireKernels k = detail::wire_kernels(wire, op);
    if (b.dtype != DType::float32 || k.reduce == nullptr)
      detail::fail(Errc::invalid_argument, "rank ", rank_, ": all_reduce_as: ", to_string(b.dtype),
                   " values carried as ", to_string(wire),
                   " are not supported; compression carries float32 as float16 or bfloat16");
    const bool across = hier_ != HostHierarchy::flat;
    const auto fp =
        next(detail::Coll::all_reduce, wire, b.fingerprint_count(), -1, op, true, !across);
    const std::size_t ws = size_of(wire);
    if (across) {  // converted once each way around the hierarchical all_reduce on `wire`
      if (wire_result_.size() < b.count * ws) wire_result_.resize(b.count * ws);
      detail::Buf w = b;
      w.data = wire_result_.data();
      w.dtype = wire;
      k.encode(w.data, b.data, b.count);
      hierarchical_all_reduce(w, op, fp);
      k.decode(b.data, w.data, b.count);
      return;
    }
    const int p = size_;
    // Memory for this rank's encoded offer: the next round's slot where the transport has one.
    const auto encoded = [&](std::size_t bytes, std::vector<std::byte>& own) {
      std::byte* at = t_->stage(bytes);
      if (at != nullptr) return at;
      if (own.size() < bytes) own.resize(bytes);
      return own.data();
    };
    if (b.count * ws <= t_->small_bytes()) {  // one round; every rank reduces everything
      std::byte* enc = encoded(b.count * ws, scratch_);
      k.encode(enc, b.data, b.count);
      const detail::Piece pc{enc, b.count * ws};
      auto ptrs = t_->round(
          {&pc, 1},
          [&](int, int) {
            return detail::Range{0, b.count * ws};
          },
          &fp);
      k.reduce(b.data, nullptr, ptrs.data(), p, b.count);
      return;
    }
    const std::size_t seg =
        std::max<std::size_t>(static_cast<std::size_t>(p), t_->max_offer() / ws);
    bool first = true;
    for (std::size_t s0 = 0; s0 < b.count;) {
      const std::size_t m = std::min(seg, b.count - s0);
      const auto chunk = [&](int j) {  // in elements
        const auto [lo, hi] = detail::split_range(m, p, j, ws);
        return detail::Range{lo, hi - lo};
      };
      std::byte* enc = encoded(m * ws, scratch_);
      k.encode(enc, b.at(s0), m);
      const detail::Piece pc{enc, m * ws};
      auto ptrs = t_->round(
          {&pc, 1},
          [&](int, int dst) {
            const detail::Range c = chunk(dst);
            return detail::Range{c.off * ws, c.len * ws};
          },
          first ? &fp : nullptr);
      first = false;
      const detail::Range mine = chunk(rank_);
      std::byte* result = encoded(mine.len * ws, wire_result_);
      k.reduce(b.at(s0 + mine.off), result, ptrs.data(), p, mine.len);
      const detail::Piece out{result, mine.len * ws};
      auto got = t_->round(
          {&out, 1},
          [&](int src, int) {
            return detail::Range{0, chunk(src).len * ws};
          },
          nullptr);
      for (int j = 0; j < p; ++j) {
        const detail::Range c = chunk(j);
        if (j != rank_ && c.len != 0)
          k.decode(b.at(s0 + c.off), got[static_cast<std::size_t>(j)], c.len);
      }
      s0 += m;
    }
  }

  /// Communicator::broadcast: root's `b` copied into every rank's.
  void broadcast(const detail::Buf& b, int root) {
    const auto fp =
        next(detail::Coll::broadcast, b.dtype, b.fingerprint_count(), root, ReduceOp::sum, false);
    broadcast_on(*t_, b, root, &fp);
  }

  /// Communicator::reduce: the reduction lands in root's `b` only.
  void reduce(const detail::Buf& b, int root, ReduceOp op) {
    const auto fp = next(detail::Coll::reduce, b.dtype, b.fingerprint_count(), root, op, true);
    reduce_on(*t_, b, detail::reduce_fn(b.dtype, op), root, &fp);
  }

  /// Communicator::all_gather: every rank's `in`, in rank order, into every rank's `out`.
  void all_gather(const detail::Buf& in, const detail::Buf& out) {
    gather_impl(detail::Coll::all_gather, in, out, -1);
  }
  /// Communicator::gather: every rank's `in`, in rank order, into root's `out`.
  void gather(const detail::Buf& in, const detail::Buf& out, int root) {
    gather_impl(detail::Coll::gather, in, out, root);
  }

  /// Communicator::scatter: block r of root's `in` into rank r's `out`.
  void scatter(const detail::Buf& in, const detail::Buf& out, int root) {
    const auto fp = next(detail::Coll::scatter, out.dtype, out.count, root, ReduceOp::sum, false);
    const std::size_t es = out.elem(), n = out.count;
    const std::size_t seg =
        std::max<std::size_t>(1, t_->max_offer() / (es * static_cast<std::size_t>(size_)));
    segments(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
      pieces_.clear();
      if (rank_ == root) {
        for (int j = 0; j < size_; ++j)
          pieces_.push_back({in.at(static_cast<std::size_t>(j) * n + s0), m * es});
      }
      auto ptrs = t_->round(
          pieces_,
          [&](int src, int dst) {
            return src == root ? detail::Range{static_cast<std::size_t>(dst) * m * es, m * es}
                               : detail::Range{};
          },
          first ? &fp : nullptr);
      copy_if_distinct(out.at(s0), ptrs[static_cast<std::size_t>(root)], m * es);
    });
  }

  /// Communicator::reduce_scatter: block r of the reduction of every rank's `in` into rank r's.
  void reduce_scatter(const detail::Buf& in, const detail::Buf& out, ReduceOp op) {
    const auto fp = next(detail::Coll::reduce_scatter, out.dtype, out.count, -1, op, true);
    const auto fn = detail::reduce_fn(out.dtype, op);
    exchange_blocks(in, out.count, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
      fn(out.at(s0), nullptr, ptrs.data(), size_, m);
    });
  }

  /// Communicator::all_to_all: block j of `in` to rank j, stored as its block r of `out`.
  void all_to_all(const detail::Buf& in, const detail::Buf& out) {
    const std::size_t n = in.count / static_cast<std::size_t>(size_);
    const auto fp = next(detail::Coll::all_to_all, in.dtype, n, -1, ReduceOp::sum, false);
    exchange_blocks(in, n, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
      for (int j = 0; j < size_; ++j) {
        copy_if_distinct(out.at(static_cast<std::size_t>(j) * n + s0),
                         ptrs[static_cast<std::size_t>(j)], m * in.elem());
      }
    });
  }

  /// Communicator::barrier: returns once every rank has entered it.
  void barrier() {
    const auto fp = next(detail::Coll::barrier, DType::uint8, 0, -1, ReduceOp::sum, false);
    (void)t_->round(
        {}, [](int, int) { return detail::Range{}; }, &fp);
  }

  /// Communicator::send: `b` to `peer`, matched with its recv() in issue order.
  void send(const detail::Buf& b, int peer, int tag) {
    t_->send(b, peer, tag, send_seq_[static_cast<std::size_t>(peer)]++);
  }
  /// Communicator::recv: the next send() from `peer` into `b`, checking its tag, dtype and count.
  void recv(const detail::Buf& b, int peer, int tag) {
    t_->recv(b, peer, tag, recv_seq_[static_cast<std::size_t>(peer)]++);
  }

  /// Fails every current and later operation of this communicator with `code`; peers on shared
  /// memory fail too, TCP peers see the connections close. Thread-safe.
  void abort(Errc code, const std::string& why) {
    t_->abort(code, why);
    if (lt_) lt_->abort(code, why);
    if (xt_) xt_->abort(code, why);
  }

 private:
  Host(int rank, int size)
      : rank_(rank),
        size_(size),
        send_seq_(static_cast<std::size_t>(size)),
        recv_seq_(static_cast<std::size_t>(size)) {}

  /// The next collective's fingerprint. When all_reduce runs across hosts (the hierarchical
  /// path), `check_locally`: the other collectives first compare it among the ranks of this host
  /// (one shared-memory round), so that a rank in a hierarchical all_reduce, which talks to its
  /// host and to one rank per host, and a rank in any other collective meet in a round that
  /// compares their fingerprints, and fail with Errc::mismatch instead of a timeout.
  detail::Fingerprint next(detail::Coll c, DType t, std::size_t count, int root, ReduceOp op,
                           bool has_op, bool check_locally = true) {
    detail::Fingerprint f;
    f.seq = seq_++;
    f.count = count;
    f.root = root;
    f.coll = c;
    f.dtype = t;
    f.op = op;
    f.has_op = has_op ? 1 : 0;
    for (detail::Transport* tr : {t_.get(), lt_.get(), xt_.get()}) {
      if (tr == nullptr) continue;
      tr->current = f;
      tr->has_current = true;
    }
    if (check_locally && hier_ != HostHierarchy::flat && lt_->size() > 1 &&
        lt_->verify_fingerprints) {
      lt_->slack = std::chrono::milliseconds(0);
      guarded(
          [&](detail::Transport*&) {
            (void)lt_->round(
                {}, [](int, int) { return detail::Range{}; }, &f);
          },
          t_.get());
    }
    return f;
  }

  /// Calls f(start, count, first) for each segment of at most `seg` elements; at least once, so
  /// that an empty collective still synchronizes and checks fingerprints.
  template <class F>
  static void segments(std::size_t n, std::size_t seg, F&& f) {
    std::size_t s0 = 0;
    bool first = true;
    do {
      const std::size_t m = std::min(seg, n - s0);
      f(s0, m, first);
      first = false;
      s0 += m;
    } while (s0 < n);
  }

  /// `in` holds one block of n elements per rank; in segments, rank j receives segment part of
  /// block j from every rank, and use(start, count, ptrs) consumes it (ptrs[r]: rank r's part).
  template <class Use>
  void exchange_blocks(const detail::Buf& in, std::size_t n, const detail::Fingerprint& fp,
                       Use&& use) {
    const std::size_t es = in.elem();
    const std::size_t seg =
        std::max<std::size_t>(1, t_->max_offer() / (es * static_cast<std::size_t>(size_)));
    segments(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
      blocks(in, n, s0, m);
      auto ptrs = t_->round(
          pieces_,
          [&](int, int dst) {
            return detail::Range{static_cast<std::size_t>(dst) * m * es, m * es};
          },
          first ? &fp : nullptr);
      use(s0, m, ptrs);
    });
  }

  void blocks(const detail::Buf& in, std::size_t n, std::size_t s0, std::size_t m) {
    pieces_.clear();
    for (int j = 0; j < size_; ++j)
      pieces_.push_back({in.at(static_cast<std::size_t>(j) * n + s0), m * in.elem()});
  }

  static void copy_if_distinct(std::byte* dst, const std::byte* src, std::size_t n) {
    if (n != 0 && dst != src) std::memcpy(dst, src, n);
  }

  /// Elements per segment of the large-message paths: a slot's worth (at least one per rank).
  static std::size_t segment_elements(const detail::Transport& t, std::size_t es) {
    return std::max<std::size_t>(static_cast<std::size_t>(t.size()), t.max_offer() / es);
  }
  /// Chunk j of a segment of m elements split among p ranks, in bytes from the segment's start.
  static detail::Range chunk_bytes(std::size_t m, int p, int j, std::size_t es) {
    const auto [lo, hi] = detail::split_range(m, p, j, es);
    return detail::Range{lo * es, (hi - lo) * es};
  }

  /// The large-message path of all_reduce (root < 0) and reduce: in segments, a reduce-scatter
  /// (rank j reduces chunk j of every rank's segment, in rank order) then a gather of the reduced
  /// chunks to every rank or to root. The result is written, in the same pass, to the user's
  /// buffer and to the slot of the next round when the transport offers one; ranks other than
  /// the root of a reduce leave their buffers untouched.
  void reduce_segments(detail::Transport& t, const detail::Buf& b, detail::ReduceFn fn, int root,
                       const detail::Fingerprint* fp) {
    const std::size_t es = b.elem();
    const int p = t.size(), me = t.rank();
    const bool keeps = root < 0 || me == root;
    const std::size_t seg = segment_elements(t, es);
    bool first = true;
    for (std::size_t s0 = 0; s0 < b.count;) {
      const std::size_t m = std::min(seg, b.count - s0);
      std::byte* base = b.at(s0);
      const auto chunk = [&](int j) { return chunk_bytes(m, p, j, es); };
      const detail::Piece pc{base, m * es};
      auto ptrs = t.round(
          {&pc, 1}, [&](int, int dst) { return chunk(dst); }, first ? fp : nullptr);
      first = false;
      const detail::Range mine = chunk(me);
      std::byte* staged = t.stage(mine.len);
      std::byte* out = base + mine.off;
      if (!keeps) {  // reduce only into the slot (or scratch): this rank's buffer stays as it was
        if (staged == nullptr) {
          if (scratch_.size() < mine.len) scratch_.resize(mine.len);
          staged = scratch_.data();
        }
        out = staged;
        staged = nullptr;
      }
      fn(out, staged, ptrs.data(), p, mine.len / es);
      const detail::Piece result{staged != nullptr ? staged : out, mine.len};
      auto got = t.round(
          {&result, 1},
          [&](int src, int dst) {
            return root < 0 || dst == root ? detail::Range{0, chunk(src).len} : detail::Range{};
          },
          nullptr);
      if (keeps) {
        for (int j = 0; j < p; ++j) {
          const detail::Range r = chunk(j);
          if (j != me && r.len != 0)
            std::memcpy(base + r.off, got[static_cast<std::size_t>(j)], r.len);
        }
      }
      s0 += m;
    }
  }

  /// all_reduce over transport `t` (the whole communicator, or one of the hierarchical path's
  /// groups): one round that gathers whole buffers when small, else reduce_segments.
  void all_reduce_on(detail::Transport& t, const detail::Buf& b, detail::ReduceFn fn,
                     const detail::Fingerprint* fp) {
    if (b.bytes() <= t.small_bytes()) {
      const detail::Piece pc{b.data, b.bytes()};
      auto ptrs = t.round(
          {&pc, 1},
          [&](int, int) {
            return detail::Range{0, b.bytes()};
          },
          fp);
      fn(b.data, nullptr, ptrs.data(), t.size(), b.count);
      return;
    }
    if (b.bytes() >= t.single_copy_from()) {
      single_copy_all_reduce(t, b, fn, fp);
      return;
    }
    reduce_segments(t, b, fn, -1, fp);
  }

  /// all_reduce by single copy, where every rank can read the others' memory: ranks exchange
  /// where their buffers lie (the round that compares fingerprints) and which path rank 0 chose
  /// (single copy unless choosing is automatic, see PathChooser: then reduce_segments may run
  /// instead), then, segment by segment,
  /// rank j copies chunk j of every peer's buffer straight out of that peer, reduces it into its
  /// own in rank order, and, once every chunk is reduced (a round), copies the peers' reduced
  /// chunks straight into its buffer; a last round keeps every buffer alive until no peer reads
  /// it. Each rank receives N bytes, written once: no copy through shared memory. The same
  /// combination order as reduce_segments, so the same bits.
  void single_copy_all_reduce(detail::Transport& t, const detail::Buf& b, detail::ReduceFn fn,
                              const detail::Fingerprint* fp) {
    const std::size_t es = b.elem();
    const int p = t.size(), me = t.rank();
    const bool timed = me == 0 && choose_path_;
    const auto t0 = timed ? detail::Clock::now() : detail::Clock::time_point{};
    const bool single = me != 0 || !choose_path_ || chooser_.single(b.bytes());
    const Where mine{reinterpret_cast<std::uintptr_t>(b.data), b.bytes(), single ? 1u : 0u};
    const detail::Piece pc{reinterpret_cast<const std::byte*>(&mine), sizeof mine};
    auto got = t.round(
        {&pc, 1},
        [](int, int) {
          return detail::Range{0, sizeof(Where)};
        },
        fp);
    where_.resize(static_cast<std::size_t>(p));
    for (int j = 0; j < p; ++j) {
      std::memcpy(&where_[static_cast<std::size_t>(j)], got[static_cast<std::size_t>(j)],
                  sizeof(Where));
      if (where_[static_cast<std::size_t>(j)].bytes != mine.bytes) {
        const std::string msg = detail::concat(
            "rank ", t.global(me), ": ", t.describe(fp, nullptr), ": rank ", t.global(j),
            " reduces ", where_[static_cast<std::size_t>(j)].bytes, " bytes but this rank ",
            mine.bytes, "; every rank must pass the same count and dtype");
        t.abort(Errc::mismatch, msg);
        detail::fail(Errc::mismatch, msg);
      }
    }
    const auto done = [&](bool by_single_copy) {
      if (timed) {
        chooser_.record(b.bytes(), by_single_copy,
                        std::chrono::duration<double>(detail::Clock::now() - t0).count());
      }
    };
    if (where_[0].single == 0) {  // rank 0 chose the slot path (fingerprints already compared)
      reduce_segments(t, b, fn, -1, nullptr);
      done(false);
      return;
    }
    const std::size_t seg = segment_elements(t, es);
    std::vector<const std::byte*>& ptrs = single_ptrs_;
    ptrs.resize(static_cast<std::size_t>(p));
    for (std::size_t s0 = 0; s0 < b.count;) {
      const std::size_t m = std::min(seg, b.count - s0);
      std::byte* base = b.at(s0);
      const auto chunk = [&](int j) { return chunk_bytes(m, p, j, es); };
      const detail::Range r = chunk(me);
      if (scratch_.size() < r.len * static_cast<std::size_t>(p))
        scratch_.resize(r.len * static_cast<std::size_t>(p));
      for (int j = 0; j < p; ++j) {
        std::byte* dst = scratch_.data() + r.len * static_cast<std::size_t>(j);
        if (j == me) {
          ptrs[static_cast<std::size_t>(j)] = base + r.off;
          continue;
        }
        t.copy_from(j, where_[static_cast<std::size_t>(j)].addr + s0 * es + r.off, dst, r.len, fp);
        ptrs[static_cast<std::size_t>(j)] = dst;
      }
      fn(base + r.off, nullptr, ptrs.data(), p, r.len / es);
      (void)t.round(
          {}, [](int, int) { return detail::Range{}; }, nullptr);
      for (int j = 0; j < p; ++j) {
        const detail::Range c = chunk(j);
        if (j != me)
          t.copy_from(j, where_[static_cast<std::size_t>(j)].addr + s0 * es + c.off, base + c.off,
                      c.len, fp);
      }
      s0 += m;
    }
    (void)t.round(
        {}, [](int, int) { return detail::Range{}; }, nullptr);
    done(true);
  }

  /// Which path an all_reduce on shared memory takes when Options::shm_single_copy_bytes is
  /// automatic (rank 0 decides; the others follow what it says in the first round): both give
  /// the same bits, but which is faster depends on the size and flips with the machine's state
  /// (bench/README.md, "Shared memory at mid sizes"). Per power-of-two size class, each path is
  /// tried a few times in turn, then the faster by its recent times runs, and the other is
  /// retried every 64th call, so that a change is noticed.
  class PathChooser {
   public:
    /// Whether the next all_reduce of `bytes` goes by single copy.
    [[nodiscard]] bool single(std::size_t bytes) {
      Class& c = at(bytes);
      ++c.calls;
      if (c.runs[0] < tries || c.runs[1] < tries) return c.runs[1] < c.runs[0];
      const bool faster = c.seconds[1] < c.seconds[0];
      return c.calls % retry_every == 0 ? !faster : faster;
    }
    /// How long an all_reduce of `bytes` took by that path.
    void record(std::size_t bytes, bool single, double seconds) {
      Class& c = at(bytes);
      double& avg = c.seconds[single ? 1 : 0];
      avg = c.runs[single ? 1 : 0]++ == 0 ? seconds : (avg + seconds) / 2;
    }

   private:
    struct Class {
      double seconds[2] = {0, 0};  // recent time of the slot path, of single copy
      std::uint32_t runs[2] = {0, 0};
      std::uint64_t calls = 0;
    };
    Class& at(std::size_t bytes) {
      return classes_[static_cast<std::size_t>(std::bit_width(bytes | 1)) - 1];
    }
    static constexpr std::uint32_t tries = 3;
    static constexpr std::uint64_t retry_every = 64;
    std::array<Class, 64> classes_{};
  };

  /// reduce over `t`: the reduction lands in the buffer of t's rank `root` only.
  void reduce_on(detail::Transport& t, const detail::Buf& b, detail::ReduceFn fn, int root,
                 const detail::Fingerprint* fp) {
    if (b.bytes() <= t.small_bytes()) {
      const detail::Piece pc{b.data, b.bytes()};
      auto ptrs = t.round(
          {&pc, 1},
          [&](int, int dst) {
            return dst == root ? detail::Range{0, b.bytes()} : detail::Range{};
          },
          fp);
      if (t.rank() == root) fn(b.data, nullptr, ptrs.data(), t.size(), b.count);
      return;
    }
    reduce_segments(t, b, fn, root, fp);
  }

  /// broadcast over `t` from t's rank `root`.
  void broadcast_on(detail::Transport& t, const detail::Buf& b, int root,
                    const detail::Fingerprint* fp) {
    const std::size_t es = b.elem();
    const bool is_root = t.rank() == root;
    const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / es);
    segments(b.count, seg, [&](std::size_t s0, std::size_t m, bool first) {
      const detail::Piece pc{b.at(s0), is_root ? m * es : 0};
      auto ptrs = t.round(
          {&pc, 1},
          [&](int src, int dst) {
            return src == root && dst != root ? detail::Range{0, m * es} : detail::Range{};
          },
          first ? fp : nullptr);
      if (!is_root && m != 0) std::memcpy(b.at(s0), ptrs[static_cast<std::size_t>(root)], m * es);
    });
  }

  /// Runs body(); if it fails, fails this host's other ranks too (through the local transport)
  /// and shuts down the connections of `remote` (when not null), before rethrowing, so that no
  /// rank waits for the timeout on one that left the hierarchical path: a rank of this host in a
  /// later phase (its all-gather or broadcast) fails with this error, a rank of another host
  /// sees the connection close (Errc::peer_lost). A failure in a round of `remote` itself keeps
  /// its connections (that transport's peers learn of it as it says, e.g. both fingerprints).
  template <class F>
  void guarded(F&& body, detail::Transport* remote) {
    detail::Transport* in_remote = nullptr;
    try {
      body(in_remote);
    } catch (const Error& e) {
      lt_->abort(e.code(), e.what());
      if (remote != nullptr && remote != in_remote) {
        record_leaving(e);
        remote->abort(e.code(), e.what());
      }
      throw;
    }
  }

  /// Says in the store why this rank leaves the hierarchical path, before it closes its
  /// connections, so that a rank of another host that sees them close reports this error (with
  /// its code) rather than a lost peer (Transport::why_left). Best effort.
  void record_leaving(const Error& e) noexcept {
    try {
      store_->set(detail::concat("left/", rank_), Store::stop_value(e.code(), e.what()));
    } catch (...) {  // the store is gone: the peers report a lost connection instead
    }
  }

  /// Transport::why_left over the store's records (see record_leaving), and the rendezvous's
  /// failure ("failed"): a rank whose connections closed because it failed the rendezvous after
  /// this rank had finished its own is reported with that failure.
  std::optional<detail::Transport::Left> why_left(const std::vector<int>& ranks,
                                                  std::chrono::milliseconds grace) {
    if (!store_) return std::nullopt;
    const auto deadline = detail::Clock::now() + grace;
    try {
      Store plain = store_->unwatched();
      for (;;) {
        const std::string failed = "failed";
        if (plain.check(std::span<const std::string>(&failed, 1))) {
          const std::string rec = plain.get(failed);
          detail::ByteReader r(rec, "rendezvous failure");
          detail::Transport::Left left;
          left.code = static_cast<Errc>(r.get<std::int32_t>());
          left.message = r.str(rec.size());
          constexpr std::string_view on = "the rendezvous failed on rank ";
          if (std::string_view(left.message).starts_with(on)) {
            left.rank = std::atoi(left.message.c_str() + on.size());
            const std::size_t colon = left.message.find(": ");
            if (colon != std::string::npos) left.message.erase(0, colon + 2);
          }
          if (left.rank >= 0) return left;
        }
        for (int j : ranks) {
          const std::string key = detail::concat("left/", j);
          if (!plain.check(std::span<const std::string>(&key, 1))) continue;
          const std::string rec = plain.get(key);
          detail::ByteReader r(rec, "leaving record");
          detail::Transport::Left left;
          left.rank = j;
          left.code = static_cast<Errc>(r.get<std::int32_t>());
          left.message = r.str(rec.size());
          return left;
        }
        if (detail::Clock::now() >= deadline) return std::nullopt;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const Error&) {  // the store is gone or the record unreadable: nothing to add
      return std::nullopt;
    }
  }

  /// all_reduce when the ranks span several hosts (HostHierarchy): every element is combined as
  /// host 0's sum, op host 1's sum, ..., where hosts are ordered by their lowest rank and each
  /// host's sum combines its ranks in rank order; avg divides that sum by size() at the end. The
  /// order depends on the hosts only, not on the message size or on slices/leaders, so the result
  /// is bitwise the same on every rank and in every run (it may differ in the last bits from a
  /// single host's order 0..P-1).
  ///  * slices: a reduce-scatter inside the host (local rank i gets the host's sum of slice i of
  ///    the buffer), an all_reduce of slice i with local rank i of every other host over TCP, an
  ///    all-gather inside the host. Every rank carries 1/local_size() of the bytes across.
  ///  * leaders: a reduce to the host's lowest rank, an all_reduce among those over TCP, a
  ///    broadcast inside the host.
  void hierarchical_all_reduce(const detail::Buf& b, ReduceOp op, const detail::Fingerprint& fp) {
    const bool avg = op == ReduceOp::avg;
    const auto fn = detail::reduce_fn(b.dtype, avg ? ReduceOp::sum : op);
    const auto divide = [&](const detail::Buf& x) {
      if (avg && x.count != 0) detail::divide_fn(b.dtype)(x.data, x.count, size_);
    };
    detail::Transport& local = *lt_;
    const bool by_slices = hier_ == HostHierarchy::slices &&
                           b.bytes() > slices_from_ * static_cast<std::size_t>(local.size());
    // Each phase waits a little longer than the one before it (Transport::slack), so that a rank
    // waiting on one that waits on the culprit hears the culprit named before its own timeout.
    local.slack = std::chrono::milliseconds(0);
    if (xt_) xt_->slack = std::chrono::milliseconds(250);
    const auto last_phase = [&] { local.slack = std::chrono::milliseconds(500); };
    guarded(
        [&](detail::Transport*& crossing) {
          if (!by_slices) {
            if (local.size() > 1) reduce_on(local, b, fn, 0, &fp);
            if (local.rank() == 0) {
              crossing = xt_.get();
              all_reduce_on(*xt_, b, fn, &fp);
              crossing = nullptr;
              divide(b);
            }
            last_phase();
            if (local.size() > 1) broadcast_on(local, b, 0, nullptr);
            return;
          }
          const int q = local.size();
          const auto part = [&](int j) {  // in elements
            const auto [lo, hi] = detail::split_range(b.count, q, j, b.elem());
            return detail::Range{lo, hi - lo};
          };
          reduce_scatter_parts(local, b, fn, part, &fp);
          const detail::Range mine = part(local.rank());
          detail::Buf slice = b;
          slice.data = b.at(mine.off);
          slice.count = mine.len;
          crossing = xt_.get();
          all_reduce_on(*xt_, slice, fn, &fp);
          crossing = nullptr;
          divide(slice);
          last_phase();
          all_gather_parts(local, b, part);
        },
        xt_.get());
  }

  /// Rank j of `t` ends with the reduction, over t's ranks in their order, of part(j) of every
  /// rank's `b` (a Range in elements), in place in its own `b`; the rest of `b` is only read.
  template <class Part>
  void reduce_scatter_parts(detail::Transport& t, const detail::Buf& b, detail::ReduceFn fn,
                            const Part& part, const detail::Fingerprint* fp) {
    const int q = t.size(), me = t.rank();
    const std::size_t es = b.elem();
    const std::size_t seg =
        std::max<std::size_t>(1, t.max_offer() / (es * static_cast<std::size_t>(q)));
    std::size_t longest = 0;
    for (int j = 0; j < q; ++j) longest = std::max(longest, part(j).len);
    ranges_.resize(static_cast<std::size_t>(q));
    segments(longest, seg, [&](std::size_t s0, std::size_t, bool first) {
      pieces_.clear();
      std::size_t at = 0;
      for (int j = 0; j < q; ++j) {
        const detail::Range pj = part(j);
        const std::size_t n = pj.len > s0 ? std::min(seg, pj.len - s0) : 0;
        pieces_.push_back({n != 0 ? b.at(pj.off + s0) : b.data, n * es});
        ranges_[static_cast<std::size_t>(j)] = detail::Range{at, n * es};
        at += n * es;
      }
      auto ptrs = t.round(
          pieces_, [&](int, int dst) { return ranges_[static_cast<std::size_t>(dst)]; },
          first ? fp : nullptr);
      const std::size_t n = ranges_[static_cast<std::size_t>(me)].len / es;
      if (n != 0) fn(b.at(part(me).off + s0), nullptr, ptrs.data(), q, n);
    });
  }

  /// Every rank of `t` ends with every rank j's part(j) of `b` (its own part is offered).
  template <class Part>
  void all_gather_parts(detail::Transport& t, const detail::Buf& b, const Part& part) {
    const int q = t.size(), me = t.rank();
    const std::size_t es = b.elem();
    const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / es);
    std::size_t longest = 0;
    for (int j = 0; j < q; ++j) longest = std::max(longest, part(j).len);
    const auto len = [&](int j, std::size_t s0) {
      const std::size_t l = part(j).len;
      return l > s0 ? std::min(seg, l - s0) : std::size_t{0};
    };
    segments(longest, seg, [&](std::size_t s0, std::size_t, bool) {
      const std::size_t n = len(me, s0);
      const detail::Piece pc{n != 0 ? b.at(part(me).off + s0) : b.data, n * es};
      auto ptrs = t.round(
          {&pc, 1},
          [&](int src, int) {
            return detail::Range{0, len(src, s0) * es};
          },
          nullptr);
      for (int j = 0; j < q; ++j) {
        const std::size_t k = len(j, s0);
        if (j != me && k != 0)
          std::memcpy(b.at(part(j).off + s0), ptrs[static_cast<std::size_t>(j)], k * es);
      }
    });
  }

  void gather_impl(detail::Coll c, const detail::Buf& in, const detail::Buf& out, int root) {
    const auto fp = next(c, in.dtype, in.count, root, ReduceOp::sum, false);
    const std::size_t es = in.elem(), n = in.count;
    const std::size_t seg = std::max<std::size_t>(1, t_->max_offer() / es);
    segments(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
      const detail::Piece pc{in.at(s0), m * es};
      auto ptrs = t_->round(
          {&pc, 1},
          [&](int, int dst) {
            return root < 0 || dst == root ? detail::Range{0, m * es} : detail::Range{};
          },
          first ? &fp : nullptr);
      if (root >= 0 && rank_ != root) return;
      for (int j = 0; j < size_; ++j) {
        copy_if_distinct(out.at(static_cast<std::size_t>(j) * n + s0),
                         ptrs[static_cast<std::size_t>(j)], m * es);
      }
    });
  }

  void connect(const detail::BackendInit& init) {
    const Options& o = init.options;
    if (size_ == 1) {
      t_ = std::make_unique<detail::SelfTransport>(o.timeout);
      local_size_ = 1;
      return;
    }
    Store& store = *init.store;
    store_ = init.store;
    // The rendezvous has one timeout in all (the store view ends its calls by then).
    const auto deadline =
        detail::Deadline{std::min(detail::Deadline::after(o.timeout).at, store.deadline())};
    const HostTransport requested = requested_transport(o);
    const std::size_t segment_request = segment_bytes(o, 0);  // 0: the transport's default

    // 1. Everyone publishes who and where it is, on the interface that reaches the store, and
    //    what it was asked for; every rank must have been asked for the same.
    detail::Fd listener = detail::listen_tcp(store.local_address(), 0);
    const std::string identity = detail::host_identity();
    {
      std::string rec;
      detail::ByteWriter w(rec);
      w.str(identity);
      w.put(static_cast<std::uint32_t>(::getpid()));
      w.str(store.local_address());
      w.put(static_cast<std::uint32_t>(detail::local_port(listener.get())));
      w.put(static_cast<std::uint8_t>(requested));
      w.put(static_cast<std::uint64_t>(segment_request));
      w.put(static_cast<std::uint8_t>(o.hierarchy));
      w.str(detail::machine_identity());
      w.put(static_cast<std::uint64_t>(o.shm_single_copy_bytes));
      store.set(detail::concat("peer/", rank_), rec);
    }
    std::vector<std::string> identities, transports, segments, hierarchies, machines, singles;
    std::vector<int> pids;
    std::vector<std::pair<std::string, int>> addrs;
    for (const auto& rec : detail::gather_records(store, "peer/", rank_, size_, o.timeout)) {
      detail::ByteReader r(rec, "peer record");
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
      const auto single = r.get<std::uint64_t>();
      singles.push_back(single == 0                ? std::string("the default")
                        : single == Options::never ? std::string("off")
                                                   : std::to_string(single));
    }
    detail::require_agreement(rank_, "the host transport (Options::transport, DDP_HOST_TRANSPORT)",
                              "every rank must ask for the same transport", transports);
    detail::require_agreement(rank_, "the segment size (Options::segment_bytes, DDP_SEGMENT_BYTES)",
                              "every rank must use the same segment size", segments);
    detail::require_agreement(rank_, "the hierarchy (Options::hierarchy, DDP_HIERARCHY)",
                              "every rank must use the same hierarchy", hierarchies);
    detail::require_agreement(rank_,
                              "single copy (Options::shm_single_copy_bytes, DDP_SHM_SINGLE_COPY)",
                              "every rank must use the same setting", singles);
    local_leader_ = rank_;
    for (int j = 0; j < size_; ++j) {
      if (identities[static_cast<std::size_t>(j)] != identity) continue;
      if (j < rank_) ++local_rank_;
      local_leader_ = std::min(local_leader_, j);
      ++local_size_;
    }
    const bool one_host = local_size_ == size_;
    // Ranks of this machine, in any namespace or container (they share its cores).
    machine_ranks_ = static_cast<int>(
        std::count(machines.begin(), machines.end(), machines[static_cast<std::size_t>(rank_)]));

    // 2. Pick the transport: every rank computes the same answer from the same records (rank 0
    //    may still fall back from shm to tcp when /dev/shm is too small; it says so in its record).
    HostTransport choice = requested;
    if (choice == HostTransport::automatic)
      choice = one_host ? HostTransport::shm : HostTransport::tcp;
    if (choice == HostTransport::shm && !one_host) {
      detail::fail(Errc::invalid_argument, "rank ", rank_,
                   ": the shm transport was requested but the ranks are on more than one host");
    }
    if (choice == HostTransport::shm) {
      std::vector<int> all(static_cast<std::size_t>(size_));
      for (int j = 0; j < size_; ++j) all[static_cast<std::size_t>(j)] = j;
      t_ = connect_shm(store, o, all, pids, requested);
      if (!t_) choice = HostTransport::tcp;
    }
    if (choice == HostTransport::tcp) {
      detail::TcpTransport::SessionKey key{};
      if (rank_ == 0) {
        detail::random_bytes(key.data(), key.size());
        store.set("session", std::string(reinterpret_cast<const char*>(key.data()), key.size()));
      } else {
        const std::string k = store.get("session");
        if (k.size() != key.size()) detail::fail(Errc::protocol, "bad session key in the store");
        std::memcpy(key.data(), k.data(), key.size());
      }
      // A rank that fails meanwhile says so in the store ("failed"): stop waiting then.
      const auto peer_failed = [&store] {
        const std::string failed = "failed";
        if (store.check(std::span<const std::string>(&failed, 1))) (void)store.get(failed);
      };
      auto peers = detail::TcpTransport::connect_mesh(rank_, size_, listener, addrs, key, deadline,
                                                      peer_failed);
      if (requested == HostTransport::automatic && o.hierarchy != HostHierarchy::flat)
        connect_hierarchy(store, o, identities, pids, peers);
      t_ = std::make_unique<detail::TcpTransport>(rank_, size_, o.timeout, std::move(peers),
                                                  segment_bytes(o, std::size_t{1} << 20),
                                                  machine_ranks_);
    }
    for (detail::Transport* tr : {t_.get(), lt_.get(), xt_.get()}) {
      if (tr == nullptr) continue;
      tr->verify_fingerprints = o.verify_collectives;
      // A rank that leaves says why in the store (the hierarchical path's record, or the
      // rendezvous's failure when a rank fails it after others have finished theirs).
      tr->why_left = [this](const std::vector<int>& ranks, std::chrono::milliseconds grace) {
        return why_left(ranks, grace);
      };
    }
  }

  /// The hierarchical all_reduce's transports, when the ranks span hosts and some host runs
  /// several (see hierarchical_all_reduce): shared memory among this host's ranks (lt_; a group of
  /// the TCP mesh's connections when /dev/shm has no room) and, over the mesh's connections, the
  /// group that carries this rank's part across hosts (xt_). Every rank decides the same from
  /// the same records.
  void connect_hierarchy(Store& store, const Options& o, const std::vector<std::string>& ids,
                         const std::vector<int>& pids, const std::vector<detail::Fd>& mesh) {
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
        counts += detail::concat(h != 0 ? ", " : "", per_host[h]);
      detail::fail(Errc::invalid_argument, "rank ", rank_,
                   ": the slices hierarchy (Options::hierarchy, DDP_HIERARCHY) needs as many ranks "
                   "on every host, but the hosts run ",
                   counts, " ranks; use leaders or auto");
    }
    hier_ = o.hierarchy == HostHierarchy::leaders || !equal ? HostHierarchy::leaders
                                                            : HostHierarchy::slices;
    // Below this many bytes per local rank, slices' TCP rounds cost more than they save
    // (bench/README.md, "Across hosts"): all_reduce goes through the leaders.
    slices_from_ = o.hierarchy == HostHierarchy::slices ? 0 : slices_from_bytes;
    const int me_host = host_of[static_cast<std::size_t>(rank_)];
    const auto group = [&](auto&& member) {
      std::vector<int> g;
      for (int j = 0; j < size_; ++j) {
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
      Store sub = store.prefixed(detail::concat("host", local.front(), "/"));
      lt_ = connect_shm(sub, o, local, local_pids, HostTransport::automatic);
      if (!lt_) lt_ = mesh_group(o, local, mesh);
    } else {
      lt_ = std::make_unique<detail::SelfTransport>(o.timeout);
    }
    // Across: local rank i of every host (slices; local rank 0 is also the leaders' group), in
    // host order, which is rank order of the hosts' lowest ranks.
    const int mine = local_of[static_cast<std::size_t>(rank_)];
    if (hier_ == HostHierarchy::slices || mine == 0) {
      std::vector<int> across;
      for (std::size_t h = 0; h < hosts.size(); ++h) {
        for (int j = 0; j < size_; ++j) {
          if (host_of[static_cast<std::size_t>(j)] == static_cast<int>(h) &&
              local_of[static_cast<std::size_t>(j)] == mine)
            across.push_back(j);
        }
      }
      xt_ = mesh_group(o, across, mesh);
    }
  }

  /// A TCP transport over the mesh's connections to `members` (communicator ranks, this rank
  /// among them), numbered by their place in `members`. The connections are shared with the
  /// mesh (duplicated descriptors): a failure closes both, and a rank in a round of one meets a
  /// rank in a round of the other on the same stream, where the fingerprints are compared.
  std::unique_ptr<detail::Transport> mesh_group(const Options& o, const std::vector<int>& members,
                                                const std::vector<detail::Fd>& mesh) {
    std::vector<detail::Fd> fds;
    int me = 0;
    for (std::size_t i = 0; i < members.size(); ++i) {
      const int j = members[i];
      if (j == rank_) {
        me = static_cast<int>(i);
        fds.emplace_back();
        continue;
      }
      detail::Fd fd(::fcntl(mesh[static_cast<std::size_t>(j)].get(), F_DUPFD_CLOEXEC, 0));
      if (!fd)
        detail::fail_errno(errno, "rank ", rank_, ": duplicating the connection to rank ", j);
      fds.push_back(std::move(fd));
    }
    auto t = std::make_unique<detail::TcpTransport>(
        me, static_cast<int>(members.size()), o.timeout, std::move(fds),
        segment_bytes(o, std::size_t{1} << 20), machine_ranks_);
    t->global_ranks = members;
    return t;
  }

  /// Options::transport and segment_bytes, the environment applied (Options::with_env).
  static HostTransport requested_transport(const Options& o) { return o.transport; }
  static std::size_t segment_bytes(const Options& o, std::size_t fallback) {
    return o.segment_bytes != 0 ? o.segment_bytes : fallback;
  }

  /// Waits for `keys` in `store` (this host's members publish them while the shm transport is
  /// set up), checking every 50 ms that those members' processes (`pids`, communicator ranks
  /// `members`) are alive: one that died fails this rank at once with Errc::peer_lost naming it,
  /// instead of at the timeout. Errc::timeout naming the missing keys after `timeout`.
  void wait_for_members(Store& store, const std::vector<std::string>& keys,
                        const std::vector<int>& members, const std::vector<int>& pids,
                        std::chrono::milliseconds timeout, const char* what) {
    detail::ProcessWatch watch;
    for (std::size_t j = 0; j < members.size(); ++j) {
      if (members[j] != rank_) watch.add(members[j], pids[j]);
    }
    const auto deadline = std::min(detail::Clock::now() + timeout, store.deadline());
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - detail::Clock::now());
      const auto missing = store.missing_after(
          keys, std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(50)));
      if (missing.empty()) return;
      if (const int dead = watch.first_dead(); dead >= 0) {
        // A rank that exited after failing itself (e.g. it saw another die first) relayed its
        // error through the store: a short wait there reports that root cause instead.
        if (store.missing_after(keys, std::chrono::milliseconds(300)).empty()) continue;
        detail::fail(Errc::peer_lost, "rank ", rank_, ": Communicator::init: rank ", dead,
                     " died (its process exited) while ", what,
                     "; the job cannot start: restart it (a launcher with --max-restarts does)");
      }
      if (left.count() <= 0) {
        std::string who;  // the keys end in the rank: "mapped/2"
        for (const auto& k : missing)
          who += detail::concat(who.empty() ? "rank " : ", rank ", k.substr(k.rfind('/') + 1));
        detail::fail(Errc::timeout, "rank ", rank_, ": Communicator::init: timed out after ",
                     timeout.count(), " ms while ", what, ": ", who,
                     missing.size() > 1 ? " have" : " has",
                     " not answered (stopped, or too slow); the job cannot start");
      }
    }
  }

  /// Largest shm slot: a round moves at most one slot, and rounds this large already run at
  /// memory speed, so larger requests are clamped here rather than reserve memory nobody reads.
  static constexpr std::size_t max_shm_slot = std::size_t{64} << 20;

  /// The shared-memory transport among `members` (communicator ranks on this host, this rank
  /// among them; `pids` theirs), set up through `store`; nullptr when the first member found
  /// /dev/shm too small and the ranks fall back to tcp (an error instead when shm was asked for
  /// explicitly).
  std::unique_ptr<detail::Transport> connect_shm(Store& store, const Options& o,
                                                 const std::vector<int>& members,
                                                 const std::vector<int>& pids,
                                                 HostTransport requested) {
    const int n = static_cast<int>(members.size());
    const int me =
        static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    const int first = members.front();
    detail::ShmLayout layout;
    layout.world = n;
    auto segment = std::make_unique<detail::ShmSegment>();
    std::uint64_t cookie = 0;
    if (me == 0) {
      const std::size_t slot = segment_bytes(o, std::size_t{1} << 20);
      layout.slot_bytes =
          std::clamp<std::size_t>(detail::ShmLayout::align_up(slot, 4096), 4096, max_shm_slot);
      layout.channel_bytes = std::size_t{256} << 10;
      cookie = detail::random_value<std::uint64_t>();
      std::string why;
      const bool made = segment->create(layout.total(), why);
      std::string rec;
      detail::ByteWriter w(rec);
      if (!made) {
        if (requested == HostTransport::shm) {
          detail::fail(Errc::backend, "rank ", first, ": the shm transport cannot start: ", why,
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
      detail::ShmTransport::format(segment->base(), layout, cookie);
      w.put(std::uint8_t{1});
      w.str(segment->path());
      w.put(cookie);
      w.put(static_cast<std::uint64_t>(layout.slot_bytes));
      w.put(static_cast<std::uint64_t>(layout.channel_bytes));
      store.set("shm", rec);
      // The others open the segment through this process's descriptor, which is closed once
      // all have mapped it (the segment never has a name: a crash leaves nothing behind).
      std::vector<std::string> mapped;
      for (int j = 1; j < n; ++j) mapped.push_back(detail::concat("mapped/", j));
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
      detail::ByteReader r(rec, "shm record");
      if (r.get<std::uint8_t>() == 0) return nullptr;  // the first member fell back to tcp
      const std::string path = r.str(255);
      cookie = r.get<std::uint64_t>();
      layout.slot_bytes = static_cast<std::size_t>(r.get<std::uint64_t>());
      layout.channel_bytes = static_cast<std::size_t>(r.get<std::uint64_t>());
      if (layout.slot_bytes == 0 || layout.slot_bytes > max_shm_slot || layout.channel_bytes == 0 ||
          layout.channel_bytes > max_shm_slot) {
        detail::fail(Errc::protocol, "rank ", rank_, ": bad shm record from rank ", first);
      }
      segment->open(path, layout.total());
      detail::ShmTransport::verify(segment->base(), layout, cookie);
      store.set(detail::concat("mapped/", me), "");
    }
    auto t = std::make_unique<detail::ShmTransport>(me, n, o.timeout, layout, std::move(segment),
                                                    pids, machine_ranks_);
    if (n != size_) t->global_ranks = members;
    // Single copy, when every member can read every other's memory (one that cannot, e.g. under
    // Yama's ptrace_scope or a seccomp filter, turns it off for all). Every rank asked for the
    // same threshold (checked at connect).
    const std::size_t from =
        o.shm_single_copy_bytes == 0 ? single_copy_from_bytes : o.shm_single_copy_bytes;
    if (n == size_) choose_path_ = o.shm_single_copy_bytes == 0;
    if (n > 1 && from != Options::never) {
      store.set(detail::concat("probe/", me), std::to_string(t->probe_address()));
      std::vector<std::string> probes, answers;
      for (int j = 0; j < n; ++j) {
        probes.push_back(detail::concat("probe/", j));
        answers.push_back(detail::concat("single-copy/", j));
      }
      wait_for_members(store, probes, members, pids, o.timeout,
                       "the ranks of this host check whether they can read each other's memory");
      bool can = true;
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        const std::string addr = store.get(detail::concat("probe/", j));
        char* end = nullptr;
        const std::uint64_t a = std::strtoull(addr.c_str(), &end, 10);
        can = end != addr.c_str() && *end == '\0' && t->probe_single_copy(j, a) && can;
      }
      store.set(detail::concat("single-copy/", me), can ? "1" : "0");
      wait_for_members(store, answers, members, pids, o.timeout,
                       "the ranks of this host agree on single copy");
      bool all = true;
      for (int j = 0; j < n; ++j) all = store.get(detail::concat("single-copy/", j)) == "1" && all;
      if (all) t->use_single_copy(from);
    }
    return t;
  }

  int rank_;
  int size_;
  int local_rank_ = 0;
  int local_size_ = 0;
  int local_leader_ = 0;
  int machine_ranks_ = 0;
  /// Below this many bytes per local rank, the slices hierarchy sends all_reduce through the
  /// leaders (measured: bench/README.md, "Across hosts").
  static constexpr std::size_t slices_from_bytes = std::size_t{16} << 10;
  /// The default Options::shm_single_copy_bytes (measured: bench/README.md, "Shared memory at
  /// mid sizes").
  static constexpr std::size_t single_copy_from_bytes = std::size_t{64} << 10;

  std::shared_ptr<Store> store_;
  std::unique_ptr<detail::Transport> t_;
  std::unique_ptr<detail::Transport> lt_;  // this host's ranks, when all_reduce is hierarchical
  std::unique_ptr<detail::Transport> xt_;  // the ranks that carry this rank's part across hosts
  HostHierarchy hier_ = HostHierarchy::flat;
  std::size_t slices_from_ = 0;
  std::vector<detail::Range> ranges_;
  std::uint64_t seq_ = 0;
  std::vector<std::uint64_t> send_seq_, recv_seq_;
  std::vector<detail::Piece> pieces_;
  std::vector<std::byte> scratch_;
  /// Where a rank's buffer lies in its process, for single_copy_all_reduce.
  struct Where {
    std::uint64_t addr, bytes;
    std::uint64_t single;  // rank 0's: 1 single copy, 0 the slot path
  };
  std::vector<Where> where_;
  bool choose_path_ = false;  // Options::shm_single_copy_bytes automatic: rank 0 times the paths
  PathChooser chooser_;
  std::vector<const std::byte*> single_ptrs_;
  std::vector<std::byte> wire_result_;  // all_reduce_as without a staging slot (TCP)
};

}  // namespace backend
DDP_END_NAMESPACE
