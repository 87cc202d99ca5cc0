// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The libtorch adapter, both parts: ddp/adapters/torch_tensor.hpp (torch::Tensor in every
/// collective) and ddp/adapters/torch_training.hpp (a torch::nn::Module as a GradientAverager's
/// or ShardedAverager's model: parameters, buffers, autograd hooks, TorchShard). A program that
/// only calls collectives on torch tensors includes the first alone and does not compile the
/// training part.
///
/// Needs libtorch on the include path and linked (CMake: the ddp::torch target, or
/// find_package(Torch) and ${TORCH_LIBRARIES}); only the adapters depend on it.

#include "ddp/adapters/torch_tensor.hpp"
#include "ddp/adapters/torch_training.hpp"
