// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The libtorch adapter, all its parts: ddp/adapters/torch_tensor.hpp (torch::Tensor in every
/// collective), ddp/adapters/torch_training.hpp (a torch::nn::Module as a GradientAverager's
/// or ShardedAverager's model: parameters, buffers, autograd hooks, TorchShard),
/// ddp/adapters/torch_checkpoint.hpp (tensors, modules and optimizers in ddp::Checkpoint) and
/// ddp/adapters/torch_shard_checkpoint.hpp (a TorchShard's optimizer state, resharded on load).
/// A program that only calls collectives on torch tensors includes the first alone and does not
/// compile the others.
///
/// Needs libtorch on the include path and linked (CMake: the ddp::torch target, or
/// find_package(Torch) and ${TORCH_LIBRARIES}); only the adapters depend on it.

#include "ddp/adapters/torch_checkpoint.hpp"
#include "ddp/adapters/torch_fully_sharded.hpp"
#include "ddp/adapters/torch_shard_checkpoint.hpp"
#include "ddp/adapters/torch_tensor.hpp"
#include "ddp/adapters/torch_training.hpp"
