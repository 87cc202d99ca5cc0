// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/checkpoint/reshard.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string shard_file_path(const std::string& path, const ShardFile& f) {
  std::string out = concat(path, ".rank", f.rank, "-of-", f.world);
  if (f.g == 0) return out;
  char hex[17];
  for (int i = 0; i < 16; ++i) hex[i] = "0123456789abcdef"[(f.id >> (60 - 4 * i)) & 15];
  hex[16] = '\0';
  return concat(out, ".", f.g, ".", hex);
}

DDP_INLINE bool parse_decimal(std::string_view t, std::uint64_t& v) {
  if (t.empty() || t.size() > 18 || (t[0] == '0' && t.size() > 1)) return false;
  v = 0;
  for (const char c : t) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return true;
}

DDP_INLINE std::vector<ShardFile> shard_files(const std::string& path) {
  std::vector<ShardFile> out;
  for (const std::string& rest : suffixes(path)) {  // "rankK-of-N[.G.<16 hex>]"
    const std::string_view r = rest;
    const std::size_t of = r.find("-of-");
    if (r.substr(0, 4) != "rank" || of == std::string_view::npos) continue;
    const std::size_t dot = r.find('.', of);
    ShardFile f;
    if (!parse_decimal(r.substr(4, of - 4), f.rank) ||
        !parse_decimal(r.substr(of + 4, dot == std::string_view::npos ? dot : dot - of - 4),
                       f.world) ||
        f.world == 0 || f.rank >= f.world)
      continue;
    if (dot != std::string_view::npos) {
      const std::string_view gen = r.substr(dot + 1);
      const std::size_t d = gen.find('.');
      if (d == std::string_view::npos || gen.size() != d + 17 ||
          !parse_decimal(gen.substr(0, d), f.g) || f.g == 0)
        continue;
      bool ok = true;
      for (const char c : gen.substr(d + 1)) {
        const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        ok = ok && v >= 0;
        f.id = f.id << 4 | static_cast<std::uint64_t>(v < 0 ? 0 : v);
      }
      if (!ok) continue;
    }
    out.push_back(f);
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

DDP_INLINE std::uint64_t section_checksum(std::span<const std::byte> b) {
  std::uint64_t h = 0xcbf29ce484222325ull ^ b.size();
  for (const std::byte c : b) h = (h ^ static_cast<std::uint64_t>(c)) * 0x100000001b3ull;
  return h;
}

DDP_INLINE FileInfo describe(const Checkpoint& ck, const std::string& file) {
  FileInfo info;
  for (const std::string& name : ck.names()) {
    if (name == "ddp.shard" || name.rfind("ddp.sharded.", 0) == 0) continue;
    if (const auto layout = ck.sharded_layout(name)) {
      const auto words = ck.get_object<std::vector<std::uint64_t>>(layout_section(name));
      if (ck.get(name).size() != layout->elements() * words[0])
        fail(Errc::protocol, "Checkpoint: ", file, ": sharded section \"", name, "\" holds ",
             ck.get(name).size(), " bytes, not the ", layout->elements(), " elements of ", words[0],
             " bytes its layout says");
      info.emplace_back(name, words);
    } else if (name == "ddp.values") {
      fail(Errc::mismatch, "Checkpoint: ", file,
           " was saved by an older ddp, without the layout a new world size or other "
           "BucketOptions need; load it with those that saved it, save again, then resume");
    } else {
      info.emplace_back(
          name, std::vector<std::uint64_t>{0, section_checksum(ck.get(name)), ck.get(name).size()});
    }
  }
  return info;
}

}  // namespace detail
DDP_END_NAMESPACE
