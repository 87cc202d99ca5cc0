// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::RefusalLog: how the store server reports the connections it refuses (a wrong token, a
/// stranger, too many clients): each is counted, at most StoreOptions::log_burst are logged one
/// by one per 10 s and the rest summed up in one line, so a flood of bad connections cannot flood
/// the log; and how a stranger's first bytes are described.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/store/protocol.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The refusals of one store server. refuse() and flush() run on the server's thread; count()
/// from any.
class RefusalLog {
 public:
  /// Counts and logs (through `o.log`) a refusal of `peer`, rate-limited.
  void refuse(const StoreOptions& o, const std::string& peer, std::string_view why);
  /// Starts a new log window when the last one is over, first saying how many lines it held back.
  void flush(const StoreOptions& o);
  /// Refusals so far.
  [[nodiscard]] std::uint64_t count() const noexcept { return refused_.load(); }

 private:
  std::atomic<std::uint64_t> refused_{0};
  Clock::time_point window_ = Clock::now();
  std::size_t logged_ = 0;
  std::uint64_t suppressed_ = 0;
};

/// Whether a connection's first bytes look like text (an HTTP request, a port scanner's probe):
/// stray traffic, named as such.
DDP_INLINE bool looks_like_text(std::string_view first4);
/// `s` with every byte outside printable ASCII shown as '?'.
DDP_INLINE std::string printable(std::string_view s);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/refusals.ipp"
#endif
