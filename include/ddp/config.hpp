// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Build configuration. The optional backends are switched on by the build targets
/// (`ddp::nccl` defines DDP_HAS_NCCL=1 and DDP_HAS_CUDA=1, `ddp::mpi` defines DDP_HAS_MPI=1),
/// never by probing for headers, so a program's meaning does not depend on what happens to be
/// installed.

/// Separate compilation (README "Compiled once"). Header-only by default: every function is
/// defined in the headers. With DDP_SEPARATE_COMPILATION defined in every unit of a program, the
/// headers only declare ddp's non-template functions (and the instantiations every program
/// uses), and the one unit that includes <ddp/impl/src.hpp> (or defines DDP_IMPLEMENTATION
/// before the single header) defines them.
#if defined(DDP_IMPLEMENTATION) && !defined(DDP_SEPARATE_COMPILATION)
#define DDP_SEPARATE_COMPILATION
#endif
#ifdef DDP_SEPARATE_COMPILATION
#define DDP_INLINE  // one definition, in the implementation unit
#ifdef DDP_IMPLEMENTATION
#define DDP_BODIES 1
#else
#define DDP_BODIES 0
#endif
#else
#define DDP_INLINE inline
#define DDP_BODIES 1
#endif

// Every symbol is declared in an inline namespace named after the major version, so two
// incompatible copies of the header in one program do not silently violate the ODR (the same
// scheme as fmt and nlohmann/json), and after the mode: a unit compiled header-only and one in
// the separate-compilation mode share no symbol, so that passing ddp's objects between them
// fails to link instead of running two copies of ddp's state (a fork counter, say) that each
// believe they are the only one. Users always spell names as ddp::X.
#ifdef DDP_SEPARATE_COMPILATION
#define DDP_ABI_NAMESPACE v0_compiled  // v<DDP_VERSION_MAJOR> (ddp/version.hpp): change together
#else
#define DDP_ABI_NAMESPACE v0
#endif
#define DDP_BEGIN_NAMESPACE \
  namespace ddp {           \
  inline namespace DDP_ABI_NAMESPACE {
#define DDP_END_NAMESPACE \
  }                       \
  }

// A program in the separate-compilation mode without its implementation unit fails to link
// naming what is missing: every other unit refers to this constant, which only that unit defines.
#ifdef DDP_SEPARATE_COMPILATION
DDP_BEGIN_NAMESPACE
namespace detail {
extern const int separate_compilation_needs_one_unit_that_includes_ddp_impl_src_hpp;
#if DDP_BODIES
const int separate_compilation_needs_one_unit_that_includes_ddp_impl_src_hpp = 1;
#elif defined(__GNUC__) || defined(__clang__)
[[gnu::used]] static const int* const separate_compilation_link_check =
    &separate_compilation_needs_one_unit_that_includes_ddp_impl_src_hpp;
#endif
}  // namespace detail
DDP_END_NAMESPACE
#endif

extern "C" {
/// Which of the two modes a program's units were compiled in (bit 1: header-only units, bit 2:
/// separately compiled). A program whose units meet only through its own types (a class holding
/// a Communicator, no ddp type in any function's signature) links with units of both modes, and
/// would run two copies of ddp's state; each mode's code sets its bit here before main, in one
/// variable both copies share (C linkage, outside the versioned namespace), and
/// Communicator::init refuses a program with both.
inline unsigned ddp_program_modes = 0;
}
DDP_BEGIN_NAMESPACE
namespace detail {
#ifdef DDP_SEPARATE_COMPILATION
inline constexpr unsigned this_mode = 2;
#else
inline constexpr unsigned this_mode = 1;
#endif
inline const bool mode_registered = (ddp_program_modes |= this_mode, true);
}  // namespace detail
DDP_END_NAMESPACE

#ifndef DDP_HAS_CUDA
#define DDP_HAS_CUDA 0
#endif
#ifndef DDP_HAS_NCCL
#define DDP_HAS_NCCL 0
#endif
#ifndef DDP_HAS_MPI
#define DDP_HAS_MPI 0
#endif

#if DDP_HAS_NCCL && !DDP_HAS_CUDA
#error "DDP_HAS_NCCL=1 requires DDP_HAS_CUDA=1: link the ddp::nccl target, which sets both"
#endif

#if !defined(__cplusplus) || (__cplusplus < 202002L && !defined(_MSVC_LANG))
#error "ddp requires C++20 (compile with -std=c++20 or newer)"
#endif

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
#define DDP_HAS_EXCEPTIONS 1
#else
#define DDP_HAS_EXCEPTIONS 0
#endif

/// Placed at the top of the runtime headers (store, communicator, backends, ...).
#define DDP_REQUIRE_EXCEPTIONS_MESSAGE \
  "ddp's runtime needs C++ exceptions; with -fno-exceptions only the core types are available"

/// Throws an exception object; with exceptions disabled (-fno-exceptions) prints its message
/// to stderr and aborts, as nlohmann/json's JSON_THROW does.
#if DDP_HAS_EXCEPTIONS
#define DDP_THROW(exception) throw exception
#else
#include <cstdio>
#include <cstdlib>
#define DDP_THROW(exception)                                      \
  do {                                                            \
    std::fprintf(stderr, "ddp: fatal: %s\n", (exception).what()); \
    std::abort();                                                 \
  } while (false)
#endif

#if defined(__GNUC__) || defined(__clang__)
#define DDP_LIKELY(x) __builtin_expect(!!(x), 1)
#define DDP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define DDP_LIKELY(x) (x)
#define DDP_UNLIKELY(x) (x)
#endif
