// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/codec.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cstring>

DDP_BEGIN_NAMESPACE

DDP_INLINE Encoder::Encoder(std::string& out) : out_(out) {}

DDP_INLINE void Encoder::count(std::size_t n) {
  const auto v = static_cast<std::uint64_t>(n);
  bytes(&v, sizeof v);
}

DDP_INLINE Decoder::Decoder(const void* data, std::size_t n)
    : p_(static_cast<const std::byte*>(data)), left_(n) {}

DDP_INLINE void Decoder::bytes(void* out, std::size_t n) {
  if (n > left_) {
    detail::fail(Errc::invalid_argument, "object decode: input truncated (needs ", n,
                 " more bytes, has ", left_, ")");
  }
  if (n != 0) std::memcpy(out, p_, n);
  p_ += n;
  left_ -= n;
}

DDP_INLINE std::size_t Decoder::count(std::size_t min_bytes) {
  std::uint64_t n = 0;
  bytes(&n, sizeof n);
  if (min_bytes == 0) min_bytes = 1;
  if (n > left_ / min_bytes) {
    detail::fail(Errc::invalid_argument, "object decode: a count of ", n, " cannot fit in the ",
                 left_, " bytes left (malformed or hostile input)");
  }
  return static_cast<std::size_t>(n);
}

DDP_END_NAMESPACE
