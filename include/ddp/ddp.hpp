// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// Copyright (c) 2026 the ddp authors. Licensed under the MIT License (see LICENSE).

// The implementation unit of the separate-compilation mode defines DDP_IMPLEMENTATION before its
// first ddp include; defined after one, it would define nothing (the headers are read already).
#if defined(DDP_IMPLEMENTATION) && defined(DDP_BODIES) && \
    (!DDP_BODIES || !defined(DDP_SEPARATE_COMPILATION))
#error \
    "DDP_IMPLEMENTATION is defined after a ddp header was included: define it (or include <ddp/impl/src.hpp>) before any other ddp header in the implementation unit"
#endif

#ifndef DDP_DDP_HPP
#define DDP_DDP_HPP

/// \file
/// The umbrella header: `#include <ddp/ddp.hpp>` for everything. Each part also stands alone.

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

DDP_BEGIN_NAMESPACE
namespace backend {
namespace detail {
/// What backend::Mpi / backend::Nccl name when the build did not enable them: using one (e.g.
/// Communicator<backend::Nccl>) fails with this message instead of "Nccl is not a member of
/// ddp::backend".
template <bool Enabled = false>
struct MpiNotEnabled {
  static_assert(Enabled,
                "ddp: backend::Mpi is not enabled in this translation unit: link the ddp::mpi "
                "target (CMake; meson: dependency('ddp-mpi')), or define DDP_HAS_MPI=1 and "
                "compile and link with your MPI (mpicxx)");
};
template <bool Enabled = false>
struct NcclNotEnabled {
  static_assert(Enabled,
                "ddp: backend::Nccl is not enabled in this translation unit: link the ddp::nccl "
                "target (CMake; meson: dependency('ddp-nccl')), or define DDP_HAS_CUDA=1 and "
                "DDP_HAS_NCCL=1 and add CUDA's include directory and -lnccl -lcudart");
};
}  // namespace detail
#if !DDP_HAS_MPI
/// Not enabled here: naming it is fine, using it is a compile error that says what to link.
using Mpi = detail::MpiNotEnabled<>;
#endif
#if !DDP_HAS_NCCL
/// Not enabled here: naming it is fine, using it is a compile error that says what to link.
using Nccl = detail::NcclNotEnabled<>;
#endif
}  // namespace backend
DDP_END_NAMESPACE
#endif

#endif  // DDP_DDP_HPP
