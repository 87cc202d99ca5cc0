// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/flat.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void reduce_segments(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, int root,
                                const Fingerprint* fp) {
  const std::size_t es = b.elem();
  const int p = t.size(), me = t.rank();
  const bool keeps = root < 0 || me == root;
  const std::size_t seg = segment_elements(t, es);
  bool first = true;
  for (std::size_t s0 = 0; s0 < b.count;) {
    const std::size_t m = std::min(seg, b.count - s0);
    std::byte* base = b.at(s0);
    const auto chunk = [&](int j) { return chunk_bytes(m, p, j, es); };
    const Piece pc{base, m * es};
    auto ptrs = t.round(
        {&pc, 1}, [&](int, int dst) { return chunk(dst); }, first ? fp : nullptr);
    first = false;
    const Range mine = chunk(me);
    std::byte* staged = t.stage(mine.len);
    std::byte* out = base + mine.off;
    if (!keeps) {  // reduce only into the slot (or scratch): this rank's buffer stays as it was
      out = staged != nullptr ? staged : RoundScratch::at_least(s.bytes, mine.len);
      staged = nullptr;
    }
    fn(out, staged, ptrs.data(), p, mine.len / es);
    const Piece result{staged != nullptr ? staged : out, mine.len};
    auto got = t.round(
        {&result, 1},
        [&](int src, int dst) {
          return root < 0 || dst == root ? Range{0, chunk(src).len} : Range{};
        },
        nullptr);
    if (keeps) {
      for (int j = 0; j < p; ++j) {
        const Range r = chunk(j);
        if (j != me && r.len != 0)
          std::memcpy(base + r.off, got[static_cast<std::size_t>(j)], r.len);
      }
    }
    s0 += m;
  }
}

DDP_INLINE void all_reduce_small(Transport& t, const Buf& b, ReduceFn fn, const Fingerprint* fp) {
  const Piece pc{b.data, b.bytes()};
  auto ptrs = t.round(
      {&pc, 1},
      [&](int, int) {
        return Range{0, b.bytes()};
      },
      fp);
  fn(b.data, nullptr, ptrs.data(), t.size(), b.count);
}

DDP_INLINE void reduce_on(Transport& t, RoundScratch& s, const Buf& b, ReduceFn fn, int root,
                          const Fingerprint* fp) {
  if (b.bytes() <= t.small_bytes()) {
    const Piece pc{b.data, b.bytes()};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int dst) {
          return dst == root ? Range{0, b.bytes()} : Range{};
        },
        fp);
    if (t.rank() == root) fn(b.data, nullptr, ptrs.data(), t.size(), b.count);
    return;
  }
  reduce_segments(t, s, b, fn, root, fp);
}

DDP_INLINE void broadcast_on(Transport& t, const Buf& b, int root, const Fingerprint* fp) {
  const std::size_t es = b.elem();
  const bool is_root = t.rank() == root;
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / es);
  for_each_segment(b.count, seg, [&](std::size_t s0, std::size_t m, bool first) {
    const Piece pc{b.at(s0), is_root ? m * es : 0};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int src, int dst) {
          return src == root && dst != root ? Range{0, m * es} : Range{};
        },
        first ? fp : nullptr);
    if (!is_root && m != 0) std::memcpy(b.at(s0), ptrs[static_cast<std::size_t>(root)], m * es);
  });
}

DDP_INLINE void all_reduce_as_on(Transport& t, RoundScratch& s, const Buf& b, const WireKernels& k,
                                 std::size_t ws, const Fingerprint& fp) {
  const int p = t.size(), me = t.rank();
  // Memory for this rank's encoded offer: the next round's slot where the transport has one.
  const auto encoded = [&](std::size_t bytes, std::vector<std::byte>& own) {
    std::byte* at = t.stage(bytes);
    return at != nullptr ? at : RoundScratch::at_least(own, bytes);
  };
  if (b.count * ws <= t.small_bytes()) {  // one round; every rank reduces everything
    std::byte* enc = encoded(b.count * ws, s.bytes);
    k.encode(enc, b.data, b.count);
    const Piece pc{enc, b.count * ws};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int) {
          return Range{0, b.count * ws};
        },
        &fp);
    k.reduce(b.data, nullptr, ptrs.data(), p, b.count);
    return;
  }
  const std::size_t seg = std::max<std::size_t>(static_cast<std::size_t>(p), t.max_offer() / ws);
  bool first = true;
  for (std::size_t s0 = 0; s0 < b.count;) {
    const std::size_t m = std::min(seg, b.count - s0);
    const auto chunk = [&](int j) {  // in elements
      const auto [lo, hi] = split_range(m, p, j, ws);
      return Range{lo, hi - lo};
    };
    std::byte* enc = encoded(m * ws, s.bytes);
    k.encode(enc, b.at(s0), m);
    const Piece pc{enc, m * ws};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int dst) {
          const Range c = chunk(dst);
          return Range{c.off * ws, c.len * ws};
        },
        first ? &fp : nullptr);
    first = false;
    const Range mine = chunk(me);
    std::byte* result = encoded(mine.len * ws, s.wire);
    k.reduce(b.at(s0 + mine.off), result, ptrs.data(), p, mine.len);
    const Piece out{result, mine.len * ws};
    auto got = t.round(
        {&out, 1},
        [&](int src, int) {
          return Range{0, chunk(src).len * ws};
        },
        nullptr);
    for (int j = 0; j < p; ++j) {
      const Range c = chunk(j);
      if (j != me && c.len != 0)
        k.decode(b.at(s0 + c.off), got[static_cast<std::size_t>(j)], c.len);
    }
    s0 += m;
  }
}

DDP_INLINE void scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out, int root,
                           const Fingerprint& fp) {
  const std::size_t es = out.elem(), n = out.count;
  const auto p = static_cast<std::size_t>(t.size());
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / (es * p));
  for_each_segment(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
    s.pieces.clear();
    if (t.rank() == root) {
      for (std::size_t j = 0; j < p; ++j) s.pieces.push_back({in.at(j * n + s0), m * es});
    }
    auto ptrs = t.round(
        s.pieces,
        [&](int src, int dst) {
          return src == root ? Range{static_cast<std::size_t>(dst) * m * es, m * es} : Range{};
        },
        first ? &fp : nullptr);
    copy_if_distinct(out.at(s0), ptrs[static_cast<std::size_t>(root)], m * es);
  });
}

DDP_INLINE void reduce_scatter_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                                  ReduceFn fn, const Fingerprint& fp) {
  exchange_blocks(t, s, in, out.count, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
    fn(out.at(s0), nullptr, ptrs.data(), t.size(), m);
  });
}

DDP_INLINE void all_to_all_on(Transport& t, RoundScratch& s, const Buf& in, const Buf& out,
                              const Fingerprint& fp) {
  const std::size_t n = in.count / static_cast<std::size_t>(t.size());
  exchange_blocks(t, s, in, n, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
    for (std::size_t j = 0; j < static_cast<std::size_t>(t.size()); ++j)
      copy_if_distinct(out.at(j * n + s0), ptrs[j], m * in.elem());
  });
}

DDP_INLINE void gather_on(Transport& t, const Buf& in, const Buf& out, int root,
                          const Fingerprint& fp) {
  const std::size_t es = in.elem(), n = in.count;
  const std::size_t seg = std::max<std::size_t>(1, t.max_offer() / es);
  for_each_segment(n, seg, [&](std::size_t s0, std::size_t m, bool first) {
    const Piece pc{in.at(s0), m * es};
    auto ptrs = t.round(
        {&pc, 1},
        [&](int, int dst) {
          return root < 0 || dst == root ? Range{0, m * es} : Range{};
        },
        first ? &fp : nullptr);
    if (root >= 0 && t.rank() != root) return;
    for (std::size_t j = 0; j < static_cast<std::size_t>(t.size()); ++j)
      copy_if_distinct(out.at(j * n + s0), ptrs[j], m * es);
  });
}

}  // namespace detail
DDP_END_NAMESPACE
