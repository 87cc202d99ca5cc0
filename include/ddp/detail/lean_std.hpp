// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What ddp uses of <chrono> (durations, time points, clocks, the literals) and of <ranges> (the
/// range concepts, data, size), without the rest of those headers: in C++20, libstdc++'s
/// <chrono> also pulls in <sstream> for its stream operators and calendar types, and <ranges>
/// every view; every user's translation unit would pay for them (about a quarter of the standard
/// headers' cost of <ddp/ddp.hpp>). With libstdc++ the sub-headers that hold exactly those parts
/// are included; with any other standard library, <chrono> and <ranges>. A program that uses
/// more of either includes it itself, as it should anyway.

#if defined(__GLIBCXX__) && __has_include(<bits/chrono.h>) && __has_include(<bits/ranges_base.h>)
#include <bits/chrono.h>       // IWYU pragma: export
#include <bits/ranges_base.h>  // IWYU pragma: export
#else
#include <chrono>  // IWYU pragma: export
#include <ranges>  // IWYU pragma: export
#endif
