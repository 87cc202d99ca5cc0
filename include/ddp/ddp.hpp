// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// Copyright (c) 2026 the ddp authors. Licensed under the MIT License (see LICENSE).
#ifndef DDP_DDP_HPP
#define DDP_DDP_HPP

/// \file
/// The umbrella header: `#include <ddp/ddp.hpp>` for everything. Each part also stands alone.

#include "ddp/config.hpp"
#include "ddp/error.hpp"
#include "ddp/partition.hpp"
#include "ddp/process_group.hpp"
#include "ddp/sync_batch_norm.hpp"
#include "ddp/tensor.hpp"

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
#include "ddp/codec.hpp"
#include "ddp/environment.hpp"
#include "ddp/gradient.hpp"
#include "ddp/guard.hpp"
#include "ddp/objects.hpp"
#include "ddp/options.hpp"
#include "ddp/spawn.hpp"
#include "ddp/store/client.hpp"
#include "ddp/store/protocol.hpp"
#include "ddp/store/server.hpp"
#include "ddp/trace.hpp"
#include "ddp/work.hpp"
#endif
#include "ddp/types.hpp"
#include "ddp/version.hpp"

#endif  // DDP_DDP_HPP
