// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What the rendezvous handshake needs and nothing more: SHA-256 (FIPS 180-4), HMAC-SHA-256
/// (RFC 2104), random bytes from the kernel, and a constant-time comparison.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"

#include <fcntl.h>
#include <sys/random.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

DDP_BEGIN_NAMESPACE
namespace detail {

using Digest = std::array<std::uint8_t, 32>;

class Sha256 {
 public:
  Sha256() { reset(); }

  void reset();

  void update(const void* data, std::size_t n);
  void update(std::string_view s) { update(s.data(), s.size()); }

  [[nodiscard]] Digest finish();

 private:
  static constexpr std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void compress();

  std::array<std::uint32_t, 8> state_{};
  std::array<std::uint8_t, 64> block_{};
  std::uint64_t length_ = 0;
  std::size_t used_ = 0;
};

/// HMAC-SHA-256(key, message parts...).
template <class... Parts>
[[nodiscard]] Digest hmac_sha256(std::string_view key, const Parts&... parts) {
  std::array<std::uint8_t, 64> k{};
  if (key.size() > 64) {
    Sha256 h;
    h.update(key);
    const Digest d = h.finish();
    std::memcpy(k.data(), d.data(), d.size());
  } else {
    std::memcpy(k.data(), key.data(), key.size());
  }
  std::array<std::uint8_t, 64> ipad{}, opad{};
  for (std::size_t i = 0; i < 64; ++i) {
    ipad[i] = static_cast<std::uint8_t>(k[i] ^ 0x36u);
    opad[i] = static_cast<std::uint8_t>(k[i] ^ 0x5cu);
  }
  Sha256 inner;
  inner.update(ipad.data(), ipad.size());
  (inner.update(parts.data(), parts.size()), ...);
  const Digest ih = inner.finish();
  Sha256 outer;
  outer.update(opad.data(), opad.size());
  outer.update(ih.data(), ih.size());
  return outer.finish();
}

/// Compares two byte strings without an early exit, so timing reveals nothing about where they
/// differ.
[[nodiscard]] DDP_INLINE bool constant_time_equal(std::span<const std::uint8_t> a,
                                                  std::span<const std::uint8_t> b);

/// Fills buf with bytes from the kernel's CSPRNG.
DDP_INLINE void random_bytes(void* buf, std::size_t n);

template <class T>
[[nodiscard]] T random_value() {
  T v{};
  random_bytes(&v, sizeof v);
  return v;
}

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/detail/impl/crypto.ipp"
#endif
