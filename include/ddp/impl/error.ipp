// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/error.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string ErrcCategory::message(int value) const {
  return std::string(to_string(static_cast<Errc>(value)));
}
}  // namespace detail
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE

DDP_INLINE const std::error_category& error_category() noexcept {
  static const detail::ErrcCategory category;
  return category;
}

DDP_INLINE Error::Error(Errc code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

DDP_INLINE Error::Error(Errc code, const char* message)
    : std::runtime_error(message), code_(code) {}

DDP_INLINE std::string_view Error::origin_message() const noexcept {
  const std::string_view whole = what();
  return origin_at_ < whole.size() ? whole.substr(origin_at_) : std::string_view{};
}

DDP_INLINE Error::Error(Errc code, std::string_view context, int origin_rank,
                        std::string_view origin_message, std::vector<int> lost_ranks)
    : std::runtime_error(std::string(context).append(origin_message)),
      code_(code),
      origin_(origin_rank),
      origin_at_(context.size()),
      lost_(std::move(lost_ranks)) {}

DDP_END_NAMESPACE
