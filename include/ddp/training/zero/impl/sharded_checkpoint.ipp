// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/training/zero/sharded_checkpoint.hpp>'s non-template functions. That header
// includes this file at its bottom, and nothing else does: in the header-only mode in every unit,
// in the separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <functional>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string write_shard(const ShardSave& s, const Checkpoint& ck,
                                   std::span<const Checkpoint::Section> extra, bool& written) {
  written = false;
  try {
    const std::string stamp = encode_object(std::vector<std::uint64_t>{s.me, s.world, s.id});
    std::vector<Checkpoint::Section> sections(extra.begin(), extra.end());
    sections.emplace_back("ddp.shard", stamp);  // a view: the stamp outlives the write
    StagedFile f(s.stem, "Checkpoint");
    f.write(ck.serialize_with(sections));
    f.commit(s.target);  // a new name: nothing is replaced
    written = true;
    return {};
  } catch (const Error& e) {
    written = ::access(s.target.c_str(), F_OK) == 0;  // renamed, then the flush failed
    return error_text(e);
  } catch (const std::exception& e) {  // std::bad_alloc, from a background writer
    return concat("rank ", s.me, ": ", e.what());
  } catch (...) {
    return concat("rank ", s.me, ": writing ", s.target, " failed");
  }
}
}  // namespace detail
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE

DDP_INLINE std::uint64_t shard_save_id(const Checkpoint& shard) {
  const auto stamp = shard.get_object<std::vector<std::uint64_t>>("ddp.shard");
  if (stamp.size() < 3)
    detail::fail(Errc::protocol, "Checkpoint: the ddp.shard section is damaged");
  return stamp[2];
}

DDP_END_NAMESPACE
