// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/tensor.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE

DDP_INLINE Counts::Counts(std::initializer_list<std::size_t> c) : own_(c), view_(own_) {}

DDP_INLINE Counts::Counts(const Counts& o) : own_(o.own_), view_(o.owns() ? own_ : o.view_) {}

DDP_END_NAMESPACE
