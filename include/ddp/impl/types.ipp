// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/types.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE

DDP_INLINE std::string to_string(const Device& d) {
  if (d.is_cpu()) return "cpu";
  return detail::concat(to_string(d.kind), ':', d.index);
}

DDP_END_NAMESPACE
