// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/poison.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void CommPoison::poison_with(const Error& e) {
  std::lock_guard lock(poison_mutex);
  if (poison.empty()) {
    poison = e.what();
    poison_code = e.code();
    poison_origin = e.origin_rank();
    poison_lost = e.lost_ranks();
    poisoned.store(true, std::memory_order_release);
  }
}

DDP_INLINE void CommPoison::poison_with(std::string why, Errc code) {
  std::lock_guard lock(poison_mutex);
  if (poison.empty()) {
    poison = std::move(why);
    poison_code = code;
    poisoned.store(true, std::memory_order_release);
  }
}

DDP_INLINE std::optional<Error> CommPoison::failure() const {
  std::lock_guard lock(poison_mutex);
  if (poison.empty()) return std::nullopt;
  return Error(poison_code, std::string_view{}, poison_origin, poison, poison_lost);
}

DDP_INLINE void CommPoison::check_poisoned(int rank, const char* name) const {
  if (poisoned.load(std::memory_order_acquire)) [[unlikely]]
    fail_poisoned(rank, name);
}

}  // namespace detail
DDP_END_NAMESPACE
