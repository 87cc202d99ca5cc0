// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// A worker's uncaught exception reaches its launcher: when TORCHELASTIC_ERROR_FILE is set (ddprun
/// and torchrun set it for each worker), Communicator::init installs a terminate handler that
/// writes the exception's message to that file in torchrun's JSON (what Python's `record` decorator
/// writes), then hands over to the handler that was there before (the standard library's prints
/// the exception and aborts). The launcher puts the message in its summary line ("rank 1 ... was
/// killed by SIGABRT: ddp::Error (peer_lost): rank 1: ...") and in its own error file.
///
/// A terminate handler rather than a wrapper around main: it needs no change to the program, it
/// sees every exception that escapes main or a thread, and it keeps the usual abort and core
/// dump. An exception thrown before init is not covered; ddp::record(fn) covers a whole main.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/env.hpp"
#include "ddp/detail/json.hpp"
#include "ddp/error.hpp"

#include <fcntl.h>

#include <atomic>
#include <exception>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#endif

DDP_BEGIN_NAMESPACE
namespace detail {

/// The name of the type `t`, demangled where the ABI allows ("std::runtime_error").
[[nodiscard]] DDP_INLINE std::string type_name(const std::type_info& t);

/// What the exception `e` says, as the first line a launcher shows: "ddp::Error (<code>):
/// <what>", "<type>: <what>" for another std::exception.
[[nodiscard]] DDP_INLINE std::string exception_text(const std::exception_ptr& e);

/// Writes `message` to the error file `path` in torchrun's format; nothing when `path` is
/// empty. Never throws (it runs inside std::terminate).
DDP_INLINE void write_error_file(const std::string& path, const std::string& message) noexcept;

/// The error file the launcher asked for (TORCHELASTIC_ERROR_FILE), or "".
[[nodiscard]] inline std::string error_file_path() {
  return EnvReader().get("TORCHELASTIC_ERROR_FILE");
}

struct TerminateReport {
  std::string path;  // set once, before the handler is installed
  std::atomic<std::terminate_handler> previous{nullptr};
  std::atomic<bool> installed{false};
};
inline TerminateReport terminate_report;

[[noreturn]] DDP_INLINE void terminate_with_error_file() noexcept;

/// Installs terminate_with_error_file once per process, when the launcher asked for an error
/// file.
DDP_INLINE void install_error_file_handler();

}  // namespace detail

/// Runs `fn` (a main without arguments, returning int or void); an exception that escapes it is
/// written to TORCHELASTIC_ERROR_FILE, as torch's `record` decorator does, and thrown on. For
/// exceptions thrown before Communicator::init, which installs the same report for everything after
/// it: `int main() { return ddp::record([] { ...; return 0; }); }`.
template <class F>
int record(F&& fn) {
  try {
    if constexpr (std::is_void_v<decltype(fn())>) {
      fn();
      return 0;
    } else {
      return static_cast<int>(fn());
    }
  } catch (...) {
    detail::write_error_file(detail::error_file_path(),
                             detail::exception_text(std::current_exception()));
    throw;
  }
}

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/error_file.ipp"
#endif
