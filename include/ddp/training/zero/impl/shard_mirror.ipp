// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/training/zero/shard_mirror.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE

DDP_INLINE std::size_t ShardMirror::bytes() const noexcept {
  std::size_t n = 0;
  for (const Save& s : saves_) n += s.own.size() + s.next.size();
  return n;
}

DDP_INLINE std::vector<std::uint64_t> ShardMirror::tags() const {
  std::vector<std::uint64_t> t;
  for (const Save& s : saves_) t.push_back(s.tag);
  return t;
}
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::vector<std::pair<std::string, std::uint64_t>> MirrorAccess::plain_sections(
    const Checkpoint& c) {
  std::vector<std::pair<std::string, std::uint64_t>> out;
  for (const std::string& name : c.names())
    if (!c.sharded_layout(name) && name.rfind("ddp.sharded.", 0) != 0)
      out.emplace_back(name, section_checksum(c.get(name)));
  return out;
}

DDP_INLINE std::uint64_t MirrorAccess::plain_checksum(const Checkpoint& c) {
  std::uint64_t h = 0;
  for (const auto& [name, sum] : plain_sections(c))
    h = (h ^ section_checksum(std::as_bytes(std::span(name.data(), name.size())))) * 31 + sum;
  return h;
}

DDP_INLINE std::span<std::uint8_t> MirrorAccess::bytes(std::string& s) {
  return {reinterpret_cast<std::uint8_t*>(s.data()), s.size()};
}

DDP_INLINE std::string MirrorAccess::name(std::uint64_t k, const ShardSet& set) {
  return concat("the in-memory copy of rank ", k, "'s shard (save ", set.g, " of ", set.world,
                " ranks)");
}

}  // namespace detail
DDP_END_NAMESPACE
