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

#if defined(DDP_BODIES) && !defined(DDP_IMPLEMENTATION)
#error "include <ddp/impl/src.hpp> before any other ddp header in its file"
#endif
#ifndef DDP_IMPLEMENTATION
#define DDP_IMPLEMENTATION
#endif

// What <ddp/ddp.hpp> includes (tools/check_layout.py checks that the lists agree).
#include "ddp/config.hpp"
#include "ddp/data/partition.hpp"
#include "ddp/error.hpp"
#include "ddp/process_group.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/averaging/sync_batch_norm.hpp"
#include "ddp/types.hpp"
#include "ddp/version.hpp"

// The runtime reports failures across threads and layers with exceptions; with -fno-exceptions
// only the core types above are available.
#if DDP_HAS_EXCEPTIONS
// First, in a block of its own: what it includes is then included outside the #ifs below.
#include "ddp/communicator.hpp"

#include "ddp/backend/host.hpp"
#if DDP_HAS_MPI
#include "ddp/backend/mpi.hpp"
#endif
#if DDP_HAS_CUDA
#include "ddp/cuda.hpp"
#endif
#if DDP_HAS_NCCL
#include "ddp/backend/nccl.hpp"
#include "ddp/multi_gpu.hpp"
#endif
#include "ddp/checkpoint/async_checkpoint.hpp"
#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/codec.hpp"
#include "ddp/environment.hpp"
#include "ddp/instances.hpp"
#include "ddp/observe/logging.hpp"
#include "ddp/observe/metrics.hpp"
#include "ddp/observe/recorder.hpp"
#include "ddp/options.hpp"
#include "ddp/spawn.hpp"
#include "ddp/store/client.hpp"
#include "ddp/store/protocol.hpp"
#include "ddp/store/server.hpp"
#include "ddp/training/averaging/gradient.hpp"
#include "ddp/training/averaging/join.hpp"
#include "ddp/training/averaging/powersgd.hpp"
#include "ddp/training/elastic/elastic.hpp"
#include "ddp/training/elastic/state.hpp"
#include "ddp/training/fully_sharded/fully_shard.hpp"
#include "ddp/training/fully_sharded/fully_sharded.hpp"
#include "ddp/training/fully_sharded/unit_memory.hpp"
#include "ddp/training/guard.hpp"
#include "ddp/training/zero/sharded.hpp"
#include "ddp/training/zero/sharded_checkpoint.hpp"
#include "ddp/work.hpp"
#endif
