// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The library version: DDP_VERSION_* and ddp::version(). The versioned namespace every ddp
/// symbol lives in is declared by ddp/config.hpp.

#define DDP_VERSION_MAJOR 0
#define DDP_VERSION_MINOR 1
#define DDP_VERSION_PATCH 0

#define DDP_DETAIL_STR2(x) #x
#define DDP_DETAIL_STR(x) DDP_DETAIL_STR2(x)
#define DDP_VERSION_STRING          \
  DDP_DETAIL_STR(DDP_VERSION_MAJOR) \
  "." DDP_DETAIL_STR(DDP_VERSION_MINOR) "." DDP_DETAIL_STR(DDP_VERSION_PATCH)

/// A single integer for preprocessor comparisons: 10203 for 1.2.3.
#define DDP_VERSION (DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH)

#include "ddp/config.hpp"

#include <string_view>

/// \namespace ddp
/// Everything ddp declares: communicators, backends, launchers, the training helpers and the
/// tensor customization points. Written ddp::X; declared inside an inline namespace named after
/// the major version (DDP_ABI_NAMESPACE), so that two incompatible copies cannot be mixed.

DDP_BEGIN_NAMESPACE

/// The version of the headers this translation unit was compiled against, as "MAJOR.MINOR.PATCH".
[[nodiscard]] constexpr std::string_view version() noexcept { return DDP_VERSION_STRING; }

/// The version as numbers, for comparisons at run time.
struct VersionInfo {
  int major;  ///< DDP_VERSION_MAJOR: incompatible API changes.
  int minor;  ///< DDP_VERSION_MINOR: compatible additions.
  int patch;  ///< DDP_VERSION_PATCH: fixes.
};

/// The version of the headers this translation unit was compiled against, as numbers.
[[nodiscard]] constexpr VersionInfo version_info() noexcept {
  return {DDP_VERSION_MAJOR, DDP_VERSION_MINOR, DDP_VERSION_PATCH};
}

DDP_END_NAMESPACE
