// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/crypto.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <cerrno>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void Sha256::reset() {
  state_ = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
            0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
  length_ = 0;
  used_ = 0;
}

DDP_INLINE void Sha256::update(const void* data, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  length_ += static_cast<std::uint64_t>(n) * 8u;
  while (n > 0) {
    const std::size_t take = std::min<std::size_t>(64 - used_, n);
    std::memcpy(block_.data() + used_, p, take);
    used_ += take;
    p += take;
    n -= take;
    if (used_ == 64) {
      compress();
      used_ = 0;
    }
  }
}

DDP_INLINE Digest Sha256::finish() {
  const std::uint64_t bits = length_;
  const std::uint8_t one = 0x80;
  update(&one, 1);
  const std::uint8_t zero = 0;
  while (used_ != 56) update(&zero, 1);
  std::uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
  update(len, 8);
  Digest out{};
  for (std::size_t i = 0; i < 8; ++i) {
    for (std::size_t j = 0; j < 4; ++j) {
      out[4 * i + j] = static_cast<std::uint8_t>(state_[i] >> (24 - 8 * j));
    }
  }
  reset();
  return out;
}

DDP_INLINE void Sha256::compress() {
  static constexpr std::uint32_t k[64] = {
      0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
      0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
      0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
      0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
      0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
      0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
      0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
      0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
      0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
      0xc67178f2u};
  std::uint32_t w[64];
  for (std::size_t i = 0; i < 16; ++i) {
    w[i] = static_cast<std::uint32_t>(block_[4 * i]) << 24 |
           static_cast<std::uint32_t>(block_[4 * i + 1]) << 16 |
           static_cast<std::uint32_t>(block_[4 * i + 2]) << 8 | block_[4 * i + 3];
  }
  for (std::size_t i = 16; i < 64; ++i) {
    const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  auto s = state_;
  for (std::size_t i = 0; i < 64; ++i) {
    const std::uint32_t e1 = rotr(s[4], 6) ^ rotr(s[4], 11) ^ rotr(s[4], 25);
    const std::uint32_t ch = (s[4] & s[5]) ^ (~s[4] & s[6]);
    const std::uint32_t t1 = s[7] + e1 + ch + k[i] + w[i];
    const std::uint32_t e0 = rotr(s[0], 2) ^ rotr(s[0], 13) ^ rotr(s[0], 22);
    const std::uint32_t maj = (s[0] & s[1]) ^ (s[0] & s[2]) ^ (s[1] & s[2]);
    const std::uint32_t t2 = e0 + maj;
    s[7] = s[6];
    s[6] = s[5];
    s[5] = s[4];
    s[4] = s[3] + t1;
    s[3] = s[2];
    s[2] = s[1];
    s[1] = s[0];
    s[0] = t1 + t2;
  }
  for (std::size_t i = 0; i < 8; ++i) state_[i] += s[i];
}

DDP_INLINE bool constant_time_equal(std::span<const std::uint8_t> a,
                                    std::span<const std::uint8_t> b) {
  if (a.size() != b.size()) return false;
  volatile std::uint8_t diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff = static_cast<std::uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

DDP_INLINE void random_bytes(void* buf, std::size_t n) {
  auto* p = static_cast<std::uint8_t*>(buf);
  while (n > 0) {
    const ssize_t r = ::getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_errno(errno, "getrandom");
    }
    p += r;
    n -= static_cast<std::size_t>(r);
  }
}

}  // namespace detail
DDP_END_NAMESPACE
