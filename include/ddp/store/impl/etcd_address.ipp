// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/etcd_address.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <charconv>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE EtcdAddress EtcdAddress::parse(std::string_view url, std::string_view from) {
  const auto bad = [&](std::string_view why) -> void {
    fail(Errc::invalid_argument, from, "=\"", url, "\": ", why,
         "; give etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE]");
  };
  EtcdAddress a;
  if (!url.starts_with("etcd://")) bad("not an etcd:// address");
  std::string_view rest = url.substr(7);
  if (const std::size_t slash = rest.find('/'); slash != std::string_view::npos) {
    a.ns = std::string(rest.substr(slash + 1));
    rest = rest.substr(0, slash);
    for (const char c : a.ns)
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '-' || c == '_' || c == '.'))
        bad("the namespace may hold letters, digits, '-', '_' and '.' only");
  }
  while (!rest.empty()) {
    const std::size_t comma = std::min(rest.find(','), rest.size());
    const std::string_view ep = rest.substr(0, comma);
    const std::size_t colon = ep.rfind(':');
    int port = 0;
    const char* end = ep.data() + ep.size();
    const auto parsed = colon == std::string_view::npos
                            ? std::from_chars_result{end, std::errc::invalid_argument}
                            : std::from_chars(ep.data() + colon + 1, end, port);
    if (colon == std::string_view::npos || colon == 0 || parsed.ec != std::errc{} ||
        parsed.ptr != end || port <= 0 || port > 65535)
      bad("every endpoint needs a host and a port (HOST:PORT)");
    std::string host(ep.substr(0, colon));
    if (host.size() > 2 && host.front() == '[' && host.back() == ']')
      host = host.substr(1, host.size() - 2);
    a.endpoints.emplace_back(std::move(host), port);
    if (comma < rest.size() && comma + 1 == rest.size()) bad("an empty endpoint after a ','");
    rest = comma < rest.size() ? rest.substr(comma + 1) : std::string_view{};
  }
  if (a.endpoints.empty()) bad("no endpoint");
  return a;
}

}  // namespace detail
DDP_END_NAMESPACE
