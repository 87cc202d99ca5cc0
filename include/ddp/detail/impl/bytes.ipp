// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/bytes.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE ByteWriter::ByteWriter(std::string& out) : out_(out) {}

DDP_INLINE void ByteWriter::str(std::string_view s) {
  put(static_cast<std::uint32_t>(s.size()));
  raw(s.data(), s.size());
}

DDP_INLINE ByteReader::ByteReader(const void* data, std::size_t n, std::string_view what)
    : p_(static_cast<const std::uint8_t*>(data)), left_(n), what_(what) {}

DDP_INLINE ByteReader::ByteReader(std::string_view s, std::string_view what)
    : ByteReader(s.data(), s.size(), what) {}

DDP_INLINE void ByteReader::raw(void* out, std::size_t n) {
  need(n);
  if (n != 0) std::memcpy(out, p_, n);
  p_ += n;
  left_ -= n;
}

DDP_INLINE std::string_view ByteReader::view(std::size_t n) {
  need(n);
  std::string_view v(reinterpret_cast<const char*>(p_), n);
  p_ += n;
  left_ -= n;
  return v;
}

DDP_INLINE std::string ByteReader::str(std::size_t max_len) {
  const auto n = get<std::uint32_t>();
  if (n > max_len) {
    fail(Errc::protocol, what_, ": a string of ", n, " bytes exceeds the limit of ", max_len);
  }
  return std::string(view(n));
}

DDP_INLINE void ByteReader::need(std::size_t n) const {
  if (n > left_) {
    fail(Errc::protocol, what_, " is truncated: needs ", n, " more bytes, has ", left_);
  }
}

DDP_INLINE std::string ranks_text(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += concat(out.empty() ? "" : ", ", r);
  return out;
}

DDP_INLINE std::vector<int> parse_ranks(std::string_view text) {
  std::vector<int> out;
  int v = -1;
  for (const char c : text) {
    if (c >= '0' && c <= '9') {
      v = (v < 0 ? 0 : v * 10) + (c - '0');
    } else if (v >= 0) {
      out.push_back(v);
      v = -1;
    }
  }
  if (v >= 0) out.push_back(v);
  return out;
}

}  // namespace detail
DDP_END_NAMESPACE
