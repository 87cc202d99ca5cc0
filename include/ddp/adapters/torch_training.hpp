// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// libtorch's modules as ddp models (the training part of the torch adapter; ddp/adapters/torch.hpp
/// includes it with the collectives part, ddp/adapters/torch_tensor.hpp).
///
/// A torch::nn::Module is a ddp Model: `ddp::GradientAverager avg(comm, *net)` copies rank 0's
/// parameters and buffers (BatchNorm statistics) to every rank, creates gradients that do not
/// exist yet (before the first backward, or after zero_grad() set them to None) as zeros, and
/// hooks each parameter's gradient accumulation, so that buckets start averaging during
/// backward() while the rest of it runs; avg.synchronize() after backward() waits for them
/// (avg.average() without hooks does the same at the end; with hooks on it starts only what the
/// hooks have not). The hooks are post hooks on the parameters' AccumulateGrad nodes, which
/// libtorch 1.13 and 2.x both have. Comm hooks (avg.register_comm_hook) see the gradients'
/// dtype at run time: write them as generic lambdas ([](auto& comm, auto& bucket) { ... }).
///
/// A ShardedAverager over a module shards torch's optimizers through ddp::TorchShard: its
/// parameters() are 1-D tensors sharing the shard's slices, so torch::optim keeps its state
/// (momentum, Adam's moments) for this rank's shard only.

#include "ddp/adapters/torch_tensor.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/averaging/gradient.hpp"
#include "ddp/training/averaging/parameters.hpp"
#include "ddp/training/zero/sharded.hpp"
#include "ddp/types.hpp"

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace torch_detail {

/// Calls back after autograd has accumulated a parameter's gradient for this backward pass.
class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit ReadyHook(std::function<void()> f) : f_(std::move(f)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    f_();
    return outputs;
  }

 private:
  std::function<void()> f_;
};

}  // namespace torch_detail

/// A torch parameter (an at::Tensor that requires grad): its value is itself, its gradient
/// p.grad(), created as zeros where autograd has not made it yet.
template <>
struct parameter_traits<at::Tensor> {
  /// The parameter itself.
  static at::Tensor& value(at::Tensor& p) { return p; }
  /// p.grad(), writable.
  static at::Tensor& grad(at::Tensor& p) { return p.mutable_grad(); }
  /// Rows of p seen as a matrix (torch's view(p.size(0), -1)): 0 for a scalar or a vector.
  static std::size_t rows(const at::Tensor& p) {
    return p.dim() >= 2 ? static_cast<std::size_t>(p.size(0)) : 0;
  }
  /// Whether autograd has made p.grad() yet.
  static bool has_grad(const at::Tensor& p) { return p.grad().defined(); }
  /// Creates p.grad() as contiguous zeros if it is undefined.
  static void ensure_grad(at::Tensor& p) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p, at::MemoryFormat::Contiguous);
  }
  /// A post hook on p's AccumulateGrad node; the handle removes it (and keeps the node alive,
  /// as torch's DDP reducer does). nullptr for a parameter that does not require grad.
  static std::shared_ptr<void> ready_hook(at::Tensor& p, std::function<void()> on_ready) {
    if (!p.requires_grad()) return nullptr;
    // A std::shared_ptr up to torch 2.x's later releases, a c10::intrusive_ptr since.
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc) return nullptr;
    const std::uintptr_t key =
        acc->add_post_hook(std::make_unique<torch_detail::ReadyHook>(std::move(on_ready)));
    return {acc.get(), [acc, key](void*) { acc->del_post_hook(key); }};
  }
};

/// A ShardedAverager's shard as tensors that torch's optimizers take, so that an optimizer keeps
/// state for this rank's shard only (ZeRO-1 with torch::optim):
///
///     ddp::ShardedAverager zero(comm, *net);     // hooks start reduce_scatters during backward
///     ddp::TorchShard shard(zero);
///     torch::optim::Adam opt(shard.parameters(), torch::optim::AdamOptions(1e-3));
///     for (...) { opt.zero_grad(); ...; loss.backward(); shard.step(opt); }
///
/// The parameters are detached 1-D tensors sharing the slices' values; step() points their
/// gradients at the averaged slices before opt.step(), and zeroes the model's gradients after it.
/// The model's parameters must stay where they are (a module moved to another device needs a new
/// averager and TorchShard).
template <class Zero>
class TorchShard {
  using T = typename Zero::value_type;

 public:
  /// Wraps `zero`'s shard (`zero` must outlive this).
  explicit TorchShard(Zero& zero) : zero_(&zero) {
    for (const auto& s : zero.shard()) tensors_.push_back(wrap(s.value));
  }
  /// One tensor per slice of the shard, sharing its values: give these to the optimizer.
  [[nodiscard]] const std::vector<at::Tensor>& parameters() const noexcept { return tensors_; }
  /// The ShardedAverager whose shard this is.
  [[nodiscard]] Zero& averager() const noexcept { return *zero_; }
  /// One step after backward(): the averaged gradients of the shard (zero.average()), then
  /// opt.step() on the shard, then zero.gather() (every rank gets every updated parameter), and
  /// last zero.zero_grad(): the model's gradients are zero afterwards, ready for the next
  /// backward to add into (opt.zero_grad() reaches only the shard's tensors).
  template <class Optimizer>
  void step(Optimizer& opt) {
    zero_->step([&](std::span<typename Zero::Slice> shard) {
      for (std::size_t j = 0; j < shard.size(); ++j) {
        if (shard[j].value.data != tensors_[j].data_ptr())
          detail::fail(Errc::invalid_argument, "TorchShard: parameter ", shard[j].param,
                       " was reallocated since the TorchShard was made; make the ShardedAverager "
                       "and the TorchShard again after moving the module");
        tensors_[j].mutable_grad() = wrap(shard[j].grad);
      }
      opt.step();
    });
    zero_->zero_grad();
  }

 private:
  static at::Tensor wrap(const TensorView<T>& v) {
    auto options = at::TensorOptions().dtype(*torch_detail::scalar_type_of(dtype_of<T>));
    options =
        v.device.is_cuda()
            ? options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(v.device.index)))
            : options.device(at::kCPU);
    return at::from_blob(v.data, {static_cast<std::int64_t>(v.size)}, options);
  }

  Zero* zero_;
  std::vector<at::Tensor> tensors_;
};

DDP_END_NAMESPACE
