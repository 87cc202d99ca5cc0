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
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
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
#if DDP_BODIES
DDP_INLINE std::string type_name(const std::type_info& t) {
#if __has_include(<cxxabi.h>)
  int status = 0;
  if (char* name = abi::__cxa_demangle(t.name(), nullptr, nullptr, &status)) {
    std::string out = name;
    std::free(name);
    return out;
  }
#endif
  return t.name();
}
#endif  // DDP_BODIES

/// What the exception `e` says, as the first line a launcher shows: "ddp::Error (<code>):
/// <what>", "<type>: <what>" for another std::exception.
[[nodiscard]] DDP_INLINE std::string exception_text(const std::exception_ptr& e);
#if DDP_BODIES
DDP_INLINE std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return concat("ddp::Error (", to_string(x.code()), "): ", x.what());
  } catch (const std::exception& x) {
    return concat(type_name(typeid(x)), ": ", x.what());
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}
#endif  // DDP_BODIES

/// Writes `message` to the error file `path` in torchrun's format; nothing when `path` is
/// empty. Never throws (it runs inside std::terminate).
DDP_INLINE void write_error_file(const std::string& path, const std::string& message) noexcept;
#if DDP_BODIES
DDP_INLINE void write_error_file(const std::string& path, const std::string& message) noexcept {
  try {
    if (path.empty()) return;
    // torchrun shows py_callstack (Python's traceback) in its summary: the message again.
    const std::string quoted = json_quoted(message);
    const std::string json = concat(
        "{\"message\": {\"message\": ", quoted, ", \"extraInfo\": {\"py_callstack\": ", quoted,
        ", \"timestamp\": \"", static_cast<long long>(std::time(nullptr)), "\"}}}\n");
    const int fd =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return;
    for (std::size_t at = 0; at < json.size();) {
      const ssize_t n = ::write(fd, json.data() + at, json.size() - at);
      if (n <= 0) break;
      at += static_cast<std::size_t>(n);
    }
    ::close(fd);
  } catch (...) {
  }
}
#endif  // DDP_BODIES

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
#if DDP_BODIES
DDP_INLINE void terminate_with_error_file() noexcept {
  if (const std::exception_ptr e = std::current_exception())
    write_error_file(terminate_report.path, exception_text(e));
  if (const std::terminate_handler next = terminate_report.previous.load()) next();
  std::abort();
}
#endif  // DDP_BODIES

/// Installs terminate_with_error_file once per process, when the launcher asked for an error
/// file.
DDP_INLINE void install_error_file_handler();
#if DDP_BODIES
DDP_INLINE void install_error_file_handler() {
  TerminateReport& r = terminate_report;
  if (r.installed.load()) return;
  std::string path = error_file_path();
  if (path.empty() || r.installed.exchange(true)) return;
  r.path = std::move(path);
  r.previous.store(std::set_terminate(&terminate_with_error_file));
}
#endif  // DDP_BODIES

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
