// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/comm/error_file.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>

DDP_BEGIN_NAMESPACE
namespace detail {

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

DDP_INLINE void terminate_with_error_file() noexcept {
  if (const std::exception_ptr e = std::current_exception())
    write_error_file(terminate_report.path, exception_text(e));
  if (const std::terminate_handler next = terminate_report.previous.load()) next();
  std::abort();
}

DDP_INLINE void install_error_file_handler() {
  TerminateReport& r = terminate_report;
  if (r.installed.load()) return;
  std::string path = error_file_path();
  if (path.empty() || r.installed.exchange(true)) return;
  r.path = std::move(path);
  r.previous.store(std::set_terminate(&terminate_with_error_file));
}

}  // namespace detail
DDP_END_NAMESPACE
