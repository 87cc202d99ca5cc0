// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/checkpoint/checkpoint.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE

DDP_INLINE Checkpoint& Checkpoint::put(std::string_view name, std::span<const std::byte> bytes) {
  if (name.starts_with("ddp.type."))
    detail::fail(Errc::invalid_argument, "Checkpoint: the section name \"", name,
                 "\" is reserved: \"ddp.type.<name>\" records the element type of put_values' "
                 "section <name>; choose another name");
  put_raw(name, bytes);
  // Raw bytes are of no element type: a type recorded by an earlier put_values goes.
  const std::string type = detail::type_section(name);
  std::erase_if(sections_, [&](const auto& section) { return section.first == type; });
  return *this;
}

DDP_INLINE void detail::CheckpointRaw::put(Checkpoint& ck, std::string_view name,
                                           std::span<const std::byte> bytes) {
  ck.put_raw(name, bytes);
}

DDP_INLINE void Checkpoint::put_raw(std::string_view name, std::span<const std::byte> bytes) {
  check_name(name);
  for (auto& [n, b] : sections_) {
    if (n == name) {
      b.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      return;
    }
  }
  sections_.emplace_back(std::string(name),
                         std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

DDP_INLINE const std::string* Checkpoint::find_section(std::string_view name) const noexcept {
  for (const auto& [n, b] : sections_)
    if (n == name) return &b;
  return nullptr;
}

DDP_INLINE std::optional<ShardLayout> Checkpoint::sharded_layout(std::string_view name) const {
  const std::string companion = detail::layout_section(name);
  if (!contains(companion)) return std::nullopt;
  return detail::layout_of_words(get_object<std::vector<std::uint64_t>>(companion), name).second;
}

DDP_INLINE bool Checkpoint::contains(std::string_view name) const noexcept {
  for (const auto& s : sections_) {
    if (s.first == name) return true;
  }
  return false;
}

DDP_INLINE std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& s : sections_) out.push_back(s.first);
  return out;
}

DDP_INLINE std::span<const std::byte> Checkpoint::get(std::string_view name) const {
  const std::string& b = section(name);
  return std::as_bytes(std::span(b.data(), b.size()));
}

DDP_INLINE std::string Checkpoint::serialize_with(std::span<const Section> extra) const {
  std::string out;
  serialize_into(out, extra);
  return out;
}

DDP_INLINE void Checkpoint::serialize_into(std::string& out, std::span<const Section> extra) const {
  std::vector<Section> all;
  for (const auto& [n, b] : sections_) {
    bool replaced = false;
    for (const auto& e : extra) replaced = replaced || e.first == n;
    if (!replaced) all.emplace_back(n, b);
  }
  for (const auto& e : extra) {
    check_name(e.first);
    all.push_back(e);
  }
  std::size_t size = sizeof magic + 16;
  for (const auto& [n, b] : all) size += 16 + n.size() + b.size();
  out.clear();
  out.reserve(size);
  out.append(magic, sizeof magic);
  put_u64(out, all.size());
  for (const auto& [n, b] : all) {
    put_u64(out, n.size());
    out += n;
    put_u64(out, b.size());
  }
  for (const auto& sec : all) out += sec.second;
  put_u64(out, checksum(out.data(), out.size()));
}

DDP_INLINE Checkpoint Checkpoint::parse(std::string_view bytes, std::string_view what) {
  const auto bad = [&](auto&&... why) {
    detail::fail(Errc::protocol, "Checkpoint: ", what, ": ", why...);
  };
  if (bytes.size() < sizeof magic || std::memcmp(bytes.data(), magic, sizeof magic) != 0)
    bad("not a ddp checkpoint (it does not start with DDPCKPT1)");
  if (bytes.size() < sizeof magic + 16) bad("truncated: ", bytes.size(), " bytes");
  const std::size_t body = bytes.size() - 8;
  if (get_u64(bytes, body) != checksum(bytes.data(), body))
    bad("the checksum does not match: the file is truncated or corrupt (", bytes.size(), " bytes)");
  std::size_t at = sizeof magic;
  const auto read = [&](std::size_t n) {
    if (n > body - at) bad("truncated or corrupt: a length runs past the end");
    const std::size_t from = at;
    at += n;
    return from;
  };
  const std::uint64_t count = get_u64(bytes, read(8));
  if (count > (body - at) / 16) bad("corrupt: ", count, " sections cannot fit");
  Checkpoint ck;
  std::vector<std::uint64_t> lens;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t n = get_u64(bytes, read(8));
    if (n > body - at) bad("truncated or corrupt: a name runs past the end");
    if (n == 0 || n > 4096) bad("corrupt: section ", i, "'s name has ", n, " bytes (1 to 4096)");
    std::string name(bytes.substr(read(static_cast<std::size_t>(n)), static_cast<std::size_t>(n)));
    lens.push_back(get_u64(bytes, read(8)));
    ck.sections_.emplace_back(std::move(name), std::string());
  }
  std::vector<std::string_view> names;  // no name twice (put() never writes one twice)
  for (const auto& sec : ck.sections_) names.emplace_back(sec.first);
  std::sort(names.begin(), names.end());
  if (std::adjacent_find(names.begin(), names.end()) != names.end())
    bad("corrupt: two sections have the same name");
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t n = lens[static_cast<std::size_t>(i)];
    if (n > body - at) bad("truncated or corrupt: section ", i, " runs past the end");
    ck.sections_[static_cast<std::size_t>(i)].second =
        std::string(bytes.substr(read(static_cast<std::size_t>(n)), static_cast<std::size_t>(n)));
  }
  if (at != body) bad("corrupt: ", body - at, " bytes after the last section");
  return ck;
}

DDP_INLINE void Checkpoint::save(const std::string& path) const {
  const detail::TimelineScope span(detail::Lane::steps, "checkpoint save", "checkpoint");
  check_target(path);
  detail::StagedFile f(path, "Checkpoint");
  f.write(serialize());
  f.commit(path);
  detail::remove_abandoned(path);
}

DDP_INLINE std::string Checkpoint::stage_bytes(const std::string& path, const std::string& bytes) {
  check_target(path);
  detail::StagedFile f(path, "Checkpoint");
  f.write(bytes);
  return f.release();
}

DDP_INLINE void Checkpoint::commit(const std::string& tmp, const std::string& path) {
  if (const char* kind = detail::non_regular(path)) {
    discard(tmp);
    refuse_target(path, kind);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    io_fail("cannot rename ", tmp, " to ", path);
  }
  if (const int err = detail::sync_dir(detail::parent_dir(path)); err != 0) {
    errno = err;
    io_fail("cannot flush the directory of ", path, " to disk");
  }
  detail::remove_abandoned(path);
}

DDP_INLINE std::optional<Checkpoint> Checkpoint::load(const std::string& path) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer, forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    io_fail("cannot open ", path);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const char* kind = detail::file_kind(st.st_mode);
    ::close(fd);
    detail::fail(Errc::invalid_argument, "Checkpoint: ", path, " is ",
                 kind != nullptr ? kind : "unreadable",
                 ", not a checkpoint file; remove it, or correct the path");
  }
  std::string bytes;
  bytes.reserve(static_cast<std::size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      errno = err;
      io_fail("cannot read ", path);
    }
    if (n == 0) break;
    bytes.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return parse(bytes, path);
}

DDP_INLINE const std::string& Checkpoint::section(std::string_view name) const {
  for (const auto& s : sections_) {
    if (s.first == name) return s.second;
  }
  std::string have;
  for (const auto& s : sections_) have += (have.empty() ? "" : ", ") + s.first;
  detail::fail(Errc::invalid_argument, "Checkpoint: no section \"", name, "\" (it has ",
               have.empty() ? std::string("none") : have, ")");
}

DDP_INLINE void Checkpoint::refuse_target(const std::string& path, const char* kind) {
  detail::fail(Errc::invalid_argument, "Checkpoint: ", path, " is ", kind,
               ", not a regular file: a checkpoint neither replaces it nor writes through "
               "it; remove it, or choose another path");
}

DDP_INLINE void Checkpoint::check_name(std::string_view name) {
  if (name.empty() || name.size() > 4096)
    detail::fail(Errc::invalid_argument, "Checkpoint: a section name must have 1 to 4096 bytes");
}

DDP_INLINE void Checkpoint::put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

DDP_INLINE std::uint64_t Checkpoint::get_u64(std::string_view in, std::size_t at) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |=
        static_cast<std::uint64_t>(static_cast<unsigned char>(in[at + static_cast<std::size_t>(i)]))
        << (8 * i);
  return v;
}

DDP_INLINE std::uint64_t Checkpoint::checksum(const char* data, std::size_t n) {
  std::uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  for (; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 32);
}
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void check_directory(const std::string& path, const char* what) {
  const std::string dir = parent_dir(path);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    fail(Errc::invalid_argument, what, ": the directory ", dir, " of ", path,
         " does not exist; create it, or correct the path");
}

}  // namespace detail
DDP_END_NAMESPACE
