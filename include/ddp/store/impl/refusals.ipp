// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/refusals.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void RefusalLog::refuse(const StoreOptions& o, const std::string& peer,
                                   std::string_view why) {
  refused_.fetch_add(1);
  flush(o);
  if (logged_ < o.log_burst) {
    ++logged_;
    o.log(concat("refused ", peer, ": ", why));
  } else {
    ++suppressed_;
  }
}

DDP_INLINE void RefusalLog::flush(const StoreOptions& o) {
  const auto now = Clock::now();
  if (now - window_ < std::chrono::seconds(10)) return;
  if (suppressed_ != 0) {
    o.log(concat(suppressed_, " more connection(s) refused in the last ",
                 std::chrono::duration_cast<std::chrono::seconds>(now - window_).count(),
                 " s (not logged one by one)"));
  }
  window_ = now;
  logged_ = 0;
  suppressed_ = 0;
}

DDP_INLINE bool looks_like_text(std::string_view first4) {
  return std::all_of(first4.begin(), first4.end(), [](char ch) {
    return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || ch == ' ' || ch == '/';
  });
}

DDP_INLINE std::string printable(std::string_view s) {
  std::string out;
  for (char ch : s) out += (ch >= 32 && ch < 127) ? ch : '?';
  return out;
}

}  // namespace detail
DDP_END_NAMESPACE
