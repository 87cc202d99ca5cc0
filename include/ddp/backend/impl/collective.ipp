// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/collective.hpp>'s non-template functions. That header includes this
// file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string product_text(std::size_t part, std::size_t p) {
  if (p != 0 && part > max_buffer_bytes / p) return concat(part, " x ", p, " (which overflows)");
  return concat(part, " x ", p, " = ", part * p);
}

DDP_INLINE std::string to_string(const Fingerprint& f) {
  std::string s = concat(to_string(f.coll), '(');
  if (is_uneven(f.coll))
    s += concat(to_string(f.dtype), ", counts per rank");
  else if (f.coll != Coll::barrier)
    s += concat(to_string(f.dtype), ", count=", f.count);
  if (f.has_op != 0) s += concat(", op=", to_string(f.op));
  if (f.root >= 0) s += concat(", root=", f.root);
  return s + concat(") #", f.seq);
}

}  // namespace detail
DDP_END_NAMESPACE
