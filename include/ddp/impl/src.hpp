// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The implementation unit of the separate-compilation mode: include this header in exactly one
/// source file of a program whose every unit is compiled with DDP_SEPARATE_COMPILATION defined
/// (the ddp::compiled CMake target builds that file for you). It defines ddp's non-template
/// functions and the instantiations that the other units only declare. Include it before any
/// other ddp header in that file. With the single header, define DDP_IMPLEMENTATION before
/// including ddp.hpp instead.

#if defined(DDP_BODIES) && !DDP_BODIES
#error "include <ddp/impl/src.hpp> before any other ddp header in its file"
#endif
#ifndef DDP_IMPLEMENTATION
#define DDP_IMPLEMENTATION
#endif

#include "ddp/ddp.hpp"
