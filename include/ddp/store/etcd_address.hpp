// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::EtcdAddress: where an etcd cluster is, from
/// "etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE]" (DDP_STORE, Options::store, ddprun's
/// --rdzv-endpoint), checked before anything connects.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"

#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The endpoints and namespace of "etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE]".
struct EtcdAddress {
  std::vector<std::pair<std::string, int>> endpoints;
  std::string ns;  ///< "" when the URL names none

  /// Errc::invalid_argument naming `from` (the variable or option) when `url` is malformed.
  static EtcdAddress parse(std::string_view url, std::string_view from);
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/store/impl/etcd_address.ipp"
#endif
