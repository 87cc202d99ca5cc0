// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The flight recorder (FlightRecorder, TraceRecord, the dumps), under its older name: it lives
/// in ddp/observe/recorder.hpp, beside the runner that writes it.

#include "ddp/observe/recorder.hpp"
