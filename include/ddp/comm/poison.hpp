// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::CommPoison: the mark that makes every call on a communicator fail at once after a
/// failure (the first failure's message, code, origin and lost ranks, read without a lock on every
/// call), and the membership epoch that replaced the communicator, when another did.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

struct CommPoison {
  mutable std::mutex poison_mutex;
  std::string poison;
  Errc poison_code = Errc::aborted;
  int poison_origin = -1;             // the first failure's Error::origin_rank()
  std::vector<int> poison_lost;       // and its lost_ranks()
  std::atomic<bool> poisoned{false};  // poison is set: read without the lock on every call
  /// The membership epoch a shrink() or grow() of this communicator formed (0: none): it is
  /// replaced.
  std::uint64_t replaced_by = 0;

  /// Marks the communicator failed with `why` (the first failure wins).
  void poison_with(std::string why, Errc code);
  /// The same with `e`'s message, code, origin and lost ranks.
  void poison_with(const Error& e);

  /// The first failure, as an Error (none while the communicator is healthy).
  [[nodiscard]] std::optional<Error> failure() const;

  /// Fails with Errc::aborted, quoting the first failure, when the communicator is poisoned.
  void check_poisoned(int rank, const char* name) const;

  [[noreturn, gnu::noinline, gnu::cold]] void fail_poisoned(int rank, const char* name) const {
    std::lock_guard lock(poison_mutex);
    if (replaced_by != 0)
      fail_from(poison_origin, poison_lost, Errc::aborted, "rank ", rank, ": ", name,
                ": this communicator was replaced by membership epoch ", replaced_by, " (", poison,
                "): use the communicator that shrink() or grow() returned");
    fail_from(poison_origin, poison_lost, Errc::aborted, "rank ", rank, ": ", name,
              ": this communicator failed earlier and cannot be used (", poison,
              "); the ranks still alive can go on together with shrink(), or make a new "
              "communicator with Communicator::init");
  }
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/poison.ipp"
#endif
