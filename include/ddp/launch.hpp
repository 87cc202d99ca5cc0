// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The former home of ddp::spawn, kept so that `#include <ddp/launch.hpp>` keeps working: it
/// includes ddp/spawn.hpp. The launcher agent behind ddprun (ddp::launch) is a tool's code now,
/// in tools/launch_agent.hpp.

#include "ddp/spawn.hpp"
