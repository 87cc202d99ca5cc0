// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The instantiations the separate-compilation mode compiles once: `Communicator<backend::Host>`
/// (every non-template member: init, the type-erased part of each collective, shrink, grow,
/// split, ...) is declared `extern template` in every unit and defined in the implementation
/// unit (<ddp/impl/src.hpp>, or DDP_IMPLEMENTATION with the single header). Header-only, this
/// header adds nothing: each unit instantiates what it uses, as before.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/host.hpp"
#include "ddp/communicator.hpp"

#ifdef DDP_SEPARATE_COMPILATION
DDP_BEGIN_NAMESPACE
#if DDP_BODIES
template class Communicator<backend::Host>;
#else
extern template class Communicator<backend::Host>;
#endif
DDP_END_NAMESPACE
#endif
