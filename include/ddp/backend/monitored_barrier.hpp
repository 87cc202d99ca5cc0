// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The path this header had before the library was arranged in rooms; kept so that programs
/// written for it still compile. New code includes <ddp/membership/monitored_barrier.hpp>.
#include "ddp/membership/monitored_barrier.hpp"
