// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Fully sharded libtorch modules (ZeRO-3, as PyTorch's FSDP2 `fully_shard`): ddp::TorchFullyShard
/// over a FullyShardedAverager (part of the torch adapter; ddp/adapters/torch.hpp includes it).
///
/// The units are modules (a layer, a block; the root last, for the parameters no other unit
/// takes): each parameter belongs to the smallest listed module that holds it. Between a unit's
/// forwards a rank keeps 1/P of its parameters; the module's parameters have no elements then
/// (their memory is freed):
///
///     ddp::TorchFullyShard fsdp(comm, {net->fc1.ptr(), net->fc2.ptr()});  // net.ptr() last too
///                                                 // when the root holds parameters of its own
///     torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-3));  // the shard
///     for (...) {
///       // in the model's forward, each unit's part runs inside fsdp.forward(unit, fn):
///       auto h = fsdp.forward(0, [&] { return net->fc1(x); });
///       auto y = fsdp.forward(1, [&] { return net->fc2(torch::relu(h)); });
///       loss(y).backward();   // units gathered again and reduced as their backward runs
///       fsdp.step(opt);       // opt.step() on the shard's averaged gradients
///     }
///
/// forward(u, fn) gathers unit u (prefetched while the unit before it ran), points its module's
/// parameters at the gathered values, starts gathering the next unit, runs fn(), and releases the
/// unit again (Options::reshard_after_forward = false keeps it for the backward). A hook on each
/// output that requires grad gathers the unit again just before its backward (prefetching the
/// unit before it); autograd then adds the unit's gradients straight into the unit's gradient
/// buffer, and once every parameter of the unit has its gradient (AccumulateGrad post hooks) the
/// unit is released and reduce-scattered into the shard in the background, while the backward
/// goes on with the units before it. The parameters saved for the backward (views such as a
/// weight's transpose) share one storage per unit whose memory is swapped in at each gather, so
/// autograd sees the values gathered again.
///
/// Mixed precision (MixedPrecisionPolicy(param_dtype = reduce_dtype = bfloat16)):
/// TorchFullyShard<Backend, ddp::bfloat16> (or ddp::half) gathers the parameters in bfloat16, so
/// the units compute in it (cast their inputs: x.to(torch::kBFloat16)), averages the bfloat16
/// gradients and keeps float masters in the shard for the optimizer (parameters() are float).
///
/// On backend::Host the averages are GradientAverager's bitwise, so with the same elementwise
/// optimizer a run is bitwise a GradientAverager run. parameters() are 1-D tensors sharing the
/// shard's slices (as TorchShard's): torch::optim keeps state for this rank's shard only.
/// The shard starts as rank 0's parameters (as GradientAverager's); buffers (BatchNorm's
/// statistics) stay whole on every rank and are not averaged.
///
/// Misuse: a unit's parameters that get gradients though the unit's outputs did not come out of
/// forward(u, fn) (so that nothing gathered them for the backward) fail the backward with
/// Errc::invalid_argument naming the unit; so do a parameter changed in size between forwards
/// or frozen / unfrozen after construction, a view of a unit's own parameters returned from its
/// fn (return a copy), a backward with create_graph, a unit's forward again after its backward
/// before step() (with grad mode on: one forward and backward per step; evaluating under
/// torch::NoGradGuard is fine), and a torch optimizer given to step() over other tensors than
/// parameters(). A torch error inside fn while other units are released (their parameters have
/// no elements) comes back as Errc::invalid_argument naming those units and torch's message.
/// synchronize() (and step()) ends a step: a later backward's averages replace the shard's
/// gradients, they are not added to them. A module run outside forward()
/// sees its parameters without elements (torch's own error); a parameter replaced by another
/// tensor (module->weight = t) is not seen. Frozen parameters (requires_grad false) are sharded
/// too; their shard tensors get no gradient, so torch's optimizers leave them alone. A unit's
/// parameters stay gathered after its gradients are reduced until the backward reaches a unit
/// that ran before it in the forward. Float parameters, on the CPU or on one CUDA device (units
/// gathered there, the shard there too or, with Options::offload, on the host: parameters() are
/// then CPU tensors and the optimizer runs on the CPU); one backward per step.

#include "ddp/adapters/torch_training.hpp"
#include "ddp/communicator.hpp"
#include "ddp/error.hpp"
#include "ddp/training/fully_sharded/fully_shard.hpp"
#include "ddp/training/fully_sharded/fully_sharded.hpp"

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/core/Storage.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// TorchFullyShard's options.
struct TorchFullyShardOptions {
  /// Release a unit after its forward (gathered again for its backward), as FSDP2's
  /// reshard_after_forward; false keeps it gathered until its backward is done.
  bool reshard_after_forward = true;
  /// Gather the next unit in the background while one computes (forward and backward order).
  bool prefetch = true;
  /// Check at each step, in one all_reduce of 16 bytes, that every rank ran the same units in
  /// the same order (units of one size mixed up otherwise): Errc::mismatch before the update.
  bool check_order = true;
  /// For modules on a CUDA device: keep the shard (the float masters, their averaged gradients,
  /// hence the optimizer's state) in host memory, as FSDP2's CPUOffloadPolicy; parameters() are
  /// then CPU tensors. Units are gathered on the modules' device either way.
  bool offload = false;
};

/// libtorch modules fully sharded over a FullyShardedAverager (see the file comment). ParamT:
/// what the parameters are gathered, computed and reduced in (float; ddp::bfloat16 or ddp::half
/// for mixed precision, as MixedPrecisionPolicy's param_dtype = reduce_dtype), the shard's masters
/// staying float.
template <class Backend, class ParamT = float>
class TorchFullyShard {
  static_assert(std::is_same_v<ParamT, float> || std::is_same_v<ParamT, bfloat16> ||
                    std::is_same_v<ParamT, half>,
                "TorchFullyShard gathers parameters in float, ddp::bfloat16 or ddp::half");

 public:
  /// The engine underneath (float shards, parameters and gradients in ParamT).
  using Averager = FullyShardedAverager<Backend, float, ParamT, ParamT>;
  /// The options.
  using Options = TorchFullyShardOptions;

  /// Collective: shards the modules' parameters over the ranks (rank 0's values) and frees the
  /// modules' own copies. Errc::invalid_argument for a module listed twice, a parameter that is
  /// not a float tensor or on another device than the first, a unit without parameters;
  /// Errc::mismatch when the ranks' units differ.
  TorchFullyShard(Communicator<Backend>& comm,
                  const std::vector<std::shared_ptr<torch::nn::Module>>& modules, Options o = {})
      : comm_(&comm), opt_(o) {
    assign(modules);
    std::vector<std::vector<std::size_t>> sizes;
    for (const Unit& un : units_) {
      sizes.emplace_back();
      for (const Param& p : un.params) sizes.back().push_back(p.numel);
    }
    FullyShardedOptions memory;  // units where the modules are (torch's default CUDA stream)
    memory.device = device_.is_cuda() ? Device::cuda(device_.index()) : Device::cpu();
    memory.offload = o.offload;
    memory.check_order = o.check_order;  // the engine checks the step's order
    fsdp_ = std::make_unique<Averager>(comm, sizes, nullptr, memory);
    scatter_from_root();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      Unit& un = units_[u];
      un.storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, at::DataPtr(nullptr, device_),
                                nullptr, false);
      for (std::size_t i = 0; i < un.params.size(); ++i) {
        Param& p = un.params[i];
        p.trainable = p.tensor.requires_grad();
        if (!p.trainable) continue;
        // Made while the parameter has its shape: autograd checks gradients against it.
        p.hook = parameter_traits<at::Tensor>::ready_hook(p.tensor, [this, u, i] { ready(u, i); });
        ++un.trainable;
      }
      point(un, nullptr, 0);  // the module's own copy goes
    }
    std::vector<bool> trainable;
    for (const Unit& un : units_)
      for (const Param& p : un.params) trainable.push_back(p.trainable);
    for (const auto& s : fsdp_->shard()) {
      shard_.push_back(wrap(s.value));
      shard_grads_.push_back(trainable[s.param] ? wrap(s.grad) : at::Tensor());
    }
  }

  TorchFullyShard(const TorchFullyShard&) = delete;
  TorchFullyShard& operator=(const TorchFullyShard&) = delete;
  /// The modules' parameters are left without elements (none points at freed memory): export
  /// the model first (averager().gather_to). A backward through its forwards must end before.
  ~TorchFullyShard() {
    *alive_ = false;
    for (Unit& un : units_) {
      try {
        point(un, nullptr, 0);
        for (Param& q : un.params) q.tensor.mutable_grad() = at::Tensor();
      } catch (...) {  // leaving anyway
      }
    }
  }

  /// Runs unit `u`'s forward, fn(), with its parameters gathered (see the file comment); returns
  /// what fn returns (a tensor, a vector or tuple of them, ...), hooked for the backward.
  template <class F>
  decltype(auto) forward(std::size_t u, F&& fn) {
    Unit& un = at(u, "forward");
    if ((un.reduced || un.in_backward) && c10::GradMode::is_enabled())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ", u,
                   "'s forward runs again after its backward, before step(): one forward and "
                   "backward per step (accumulate over a larger batch); call fsdp.step(opt) "
                   "first, or run the forward under torch::NoGradGuard to evaluate");
    gather(u);
    if (!un.forwarded) {
      un.forwarded = true;
      order_.push_back(u);
    }
    if (opt_.prefetch) {
      const std::size_t next = detail::unit_after(last_order_, u, units_.size());
      if (next < units_.size() && !units_[next].forwarded) fsdp_->prefetch(next);
    }
    using R = decltype(std::forward<F>(fn)());
    static_assert(!std::is_reference_v<R>, "TorchFullyShard::forward: fn returns by value");
    auto out = call(u, std::forward<F>(fn));
    synced_ = false;
    stepped_ = stepped_ && !c10::GradMode::is_enabled();
    bool hooked = false;
    visit(out, [&](const at::Tensor& t) {
      if (!t.defined()) return;
      if (t.has_storage() &&
          t.storage().unsafeGetStorageImpl() == un.storage.unsafeGetStorageImpl())
        detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ", u,
                     "'s forward returned a view of its own parameters, whose memory goes when "
                     "the unit is released: return a copy (.clone())");
      if (!t.requires_grad()) return;
      hooked = true;
      t.register_hook([this, u, alive = std::weak_ptr<bool>(alive_)](const at::Tensor&) {
        const auto a = alive.lock();
        if (!a || !*a)
          detail::fail(Errc::invalid_argument, "TorchFullyShard: a backward through unit ", u,
                       "'s forward ran after the TorchFullyShard was destroyed");
        before_backward(u);
      });
    });
    if (!hooked || opt_.reshard_after_forward) release(u);
    return out;
  }

  /// Waits for the units' reduces after backward(); a unit whose backward did not run (or not for
  /// every parameter) is reduced here, in reverse order, with what it has (zeros when nothing):
  /// the shard's gradients then hold the averages of every unit.
  void synchronize() {
    if (synced_) return;  // again before the next forward: the averages are there already
    for (std::size_t k = units_.size(); k-- > 0;) {
      Unit& un = units_[k];
      if (un.reduced) continue;
      if (!un.in_backward) (void)fsdp_->grad(k);
      finish_backward(k);
    }
    std::exception_ptr failed;  // the order check's: the step ends all the same
    try {
      fsdp_->synchronize();
    } catch (...) {
      failed = std::current_exception();
    }
    for (std::size_t k = 0; k < units_.size(); ++k) {
      units_[k].reduced = false;
      units_[k].forwarded = false;
      release(k);
      fsdp_->release(k);  // a unit prefetched but not used this step (stale after the update)
    }
    if (!order_.empty()) last_order_ = order_;
    order_.clear();
    backward_.clear();
    if (failed) std::rethrow_exception(failed);
    // The shard's tensors' gradients: the averages (none for frozen parameters, which torch's
    // optimizers then leave alone); opt.zero_grad() may have dropped them since the last step.
    for (std::size_t j = 0; j < shard_.size(); ++j) shard_[j].mutable_grad() = shard_grads_[j];
    synced_ = true;
  }

  /// The shard as tensors for torch's optimizers (1-D, sharing its slices' values); after
  /// synchronize() their gradients are the averages (undefined for frozen parameters).
  [[nodiscard]] const std::vector<at::Tensor>& parameters() const noexcept { return shard_; }

  /// One step after backward(): synchronize(), then opt.step() on the shard's averaged
  /// gradients. Errc::invalid_argument, before anything is averaged, for a torch optimizer over
  /// other tensors than parameters() (the module's own parameters have no elements).
  template <class Optimizer>
  void step(Optimizer& opt) {
    if constexpr (std::is_base_of_v<torch::optim::Optimizer, Optimizer>) {
      for (const auto& g : opt.param_groups())
        for (const auto& p : g.params()) {
          bool mine = false;
          for (const at::Tensor& t : shard_) mine = mine || t.is_same(p);
          if (!mine)
            detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                         ": TorchFullyShard::step: the optimizer holds a tensor that is not the "
                         "shard's: make it over fsdp.parameters()");
        }
    }
    if (stepped_)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": TorchFullyShard::step: no forward ran (with grad mode on) since the last "
                   "step() (or since the TorchFullyShard was made; a step() that failed "
                   "counts), so the optimizer would apply the same averages again, or zeros; one "
                   "step() per backward");
    stepped_ = true;  // a step that fails (its check, opt.step()) is not applied again on them
    synchronize();
    opt.step();
  }

  /// The FullyShardedAverager underneath, between steps (every unit released): save/load
  /// (sharded checkpoints at any world size, mirrors), gather_to, trim, shard(). The optimizer's
  /// state goes with put_optimizer(ck, name, opt, fsdp) / get_optimizer(ck, name, opt, fsdp).
  [[nodiscard]] Averager& averager() const noexcept { return *fsdp_; }
  /// The number of units.
  [[nodiscard]] std::size_t units() const noexcept { return units_.size(); }
  /// Unit `u`'s parameters (the module's tensors; without elements while the unit is released).
  [[nodiscard]] std::vector<at::Tensor> unit_parameters(std::size_t u) {
    std::vector<at::Tensor> out;
    for (const Param& p : at(u, "unit_parameters").params) out.push_back(p.tensor);
    return out;
  }

 private:
  struct Param {
    at::Tensor tensor;                  // the module's parameter (the same TensorImpl)
    std::vector<std::int64_t> sizes;    // its shape
    std::size_t numel = 0, offset = 0;  // elements; where in the unit's values
    std::string name;
    std::shared_ptr<void> hook;  // the AccumulateGrad post hook (keeps the node alive)
    bool trainable = false;      // requires_grad when the TorchFullyShard was made
  };
  struct Unit {
    std::vector<Param> params;
    std::size_t elements = 0;
    c10::Storage storage;  // the gathered values (swapped in and out), shared by every view
    int trainable = 0, pending = 0;
    bool gathered = false, in_backward = false, reduced = false, forwarded = false;
    ParamT* grads = nullptr;  // its gradient buffer during its backward
  };

  /// Each parameter to the smallest listed module holding it.
  void assign(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
    std::vector<std::vector<std::pair<std::string, at::Tensor>>> held(modules.size());
    for (std::size_t u = 0; u < modules.size(); ++u) {
      if (!modules[u])
        detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ", u,
                     " is a null module");
      for (std::size_t v = 0; v < u; ++v)
        if (modules[v] == modules[u])
          detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ",
                       u, " is the module of unit ", v, " again: list each module once");
      for (const auto& item : modules[u]->named_parameters(true))
        held[u].emplace_back(item.key(), item.value());
    }
    units_.resize(modules.size());
    for (const auto& h : held)  // the device: the first parameter's
      if (!h.empty()) {
        device_ = h.front().second.device();
        break;
      }
    for (std::size_t u = 0; u < modules.size(); ++u) {
      for (const auto& [name, t] : held[u]) {
        std::size_t owner = u;  // the smallest module holding it (the first listed of those)
        for (std::size_t v = 0; v < modules.size(); ++v)
          if (v != owner && holds(held[v], t) &&
              (held[v].size() < held[owner].size() ||
               (held[v].size() == held[owner].size() && v < owner)))
            owner = v;
        if (owner != u) continue;
        if (t.scalar_type() != at::kFloat)
          detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                       ": TorchFullyShard: parameter ", name, " of unit ", u,
                       " is not a float tensor (float parameters: mixed precision is ParamT)");
        if (t.device() != device_)
          detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                       ": TorchFullyShard: parameter ", name, " of unit ", u, " is on ",
                       t.device().str(), " while the first is on ", device_.str(),
                       ": every parameter on the CPU or on one CUDA device");
        Unit& un = units_[u];
        Param p;
        p.tensor = t;
        p.sizes.assign(t.sizes().begin(), t.sizes().end());
        p.numel = static_cast<std::size_t>(t.numel());
        p.offset = un.elements;
        p.name = name;
        un.elements += p.numel;
        un.params.push_back(std::move(p));
      }
      if (units_[u].elements == 0)
        detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ", u,
                     " has no parameters of its own (the smaller units listed took them all)");
    }
  }

  static bool holds(const std::vector<std::pair<std::string, at::Tensor>>& h, const at::Tensor& t) {
    for (const auto& [name, x] : h)
      if (x.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return true;
    return false;
  }

  /// Rank 0's values into every rank's shard, a unit at a time (rank 0 lays out one unit).
  void scatter_from_root() {
    fsdp_->scatter_from(0, [&](std::size_t u, std::size_t i, std::span<float> out) {
      at::NoGradGuard no_grad;
      const Param& q = units_[u].params[i];
      const at::Tensor c = q.tensor.detach().to(at::kCPU).contiguous();
      std::memcpy(out.data(), c.data_ptr<float>(), q.numel * sizeof(float));
    });
  }

  /// Points unit `un`'s storage at `data` (its gathered values; nullptr: released) and its
  /// parameters at their parts of it (no elements when released).
  void point(Unit& un, ParamT* data, std::size_t elements) {
    at::NoGradGuard no_grad;
    c10::StorageImpl* s = un.storage.unsafeGetStorageImpl();
    s->set_data_ptr_noswap(data == nullptr ? at::DataPtr(nullptr, device_)
                                           : at::DataPtr(data, data, &no_delete, device_));
    s->set_nbytes(elements * sizeof(ParamT));
    const auto options = at::TensorOptions().dtype(kParam).device(device_);
    for (Param& q : un.params) {
      if (data == nullptr) {
        q.tensor.set_data(at::empty({0}, options));
      } else {
        at::Tensor v = at::empty({0}, options);
        std::vector<std::int64_t> strides(q.sizes.size(), 1);
        for (std::size_t d = q.sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * q.sizes[d];
        v.set_(un.storage, static_cast<std::int64_t>(q.offset), q.sizes, strides);
        q.tensor.set_data(v);
      }
    }
    un.gathered = data != nullptr;
  }
  static void no_delete(void*) {}

  /// A shard's slice as a 1-D float tensor over its memory (the host, or the modules' device).
  [[nodiscard]] at::Tensor wrap(const TensorView<float>& v) const {
    const at::Device d = v.device.is_cuda() ? device_ : at::Device(at::kCPU);
    return at::from_blob(v.data, {static_cast<std::int64_t>(v.size)},
                         at::TensorOptions().dtype(at::kFloat).device(d));
  }

  /// Unit u gathered, its parameters pointing at it; a parameter changed since is refused.
  void gather(std::size_t u) {
    Unit& un = units_[u];
    if (un.gathered) return;
    for (const Param& q : un.params)
      if (q.tensor.numel() != 0)
        detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                     ": TorchFullyShard: parameter ", q.name, " of unit ", u, " was given ",
                     q.tensor.numel(),
                     " elements while the unit was released (the shard holds its ", q.numel,
                     "): a fully sharded parameter keeps its shape; make the TorchFullyShard "
                     "again after changing the model");
    const std::span<ParamT> values = fsdp_->gather(u);
    point(un, values.data(), values.size());
  }

  void release(std::size_t u) {
    Unit& un = units_[u];
    if (!un.gathered) return;
    point(un, nullptr, 0);
    fsdp_->release(u);
  }

  /// From the hook on unit u's outputs: gathered again, autograd's gradients pointed at the
  /// unit's gradient buffer, the unit before it (in this step's forward order) prefetched.
  void before_backward(std::size_t u) {
    Unit& un = units_[u];
    if (un.in_backward) return;
    if (un.reduced)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ", u,
                   "'s backward runs again before step(): its gradients were reduced into the "
                   "shard already; call fsdp.step(opt) (or fsdp.synchronize()) after each "
                   "backward, one backward per step");
    for (const Param& q : un.params)
      if (q.tensor.requires_grad() != q.trainable)
        detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                     ": TorchFullyShard: parameter ", q.name, " of unit ", u, " was ",
                     q.trainable ? "frozen" : "unfrozen",
                     " after the TorchFullyShard was made: make it again after changing "
                     "requires_grad");
    // Units whose backward is done and that ran after this one in the forward: autograd is past
    // them now (it runs the nodes made later first), so their parameters go.
    const std::size_t here = position(u);
    for (std::size_t k = 0; k < backward_.size();) {
      if (units_[backward_[k]].reduced && position(backward_[k]) > here) {
        release(backward_[k]);
        backward_.erase(backward_.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        ++k;
      }
    }
    gather(u);
    const std::span<ParamT> g = fsdp_->grad(u);
    const auto options = at::TensorOptions().dtype(kParam).device(device_);
    for (Param& q : un.params)
      q.tensor.mutable_grad() = at::from_blob(g.data() + q.offset, q.sizes, options);
    un.grads = g.data();
    un.in_backward = true;
    un.pending = un.trainable;
    backward_.push_back(u);
    if (!opt_.prefetch) return;
    const std::size_t before = detail::unit_before(order_, u, units_.size());
    if (before < units_.size() && !units_[before].in_backward && !units_[before].reduced)
      fsdp_->prefetch(before);
  }

  /// From an AccumulateGrad post hook of unit u: the unit is reduced once every parameter has
  /// its gradient.
  void ready(std::size_t u, std::size_t i) {
    Unit& un = units_[u];
    if (un.in_backward &&
        un.params[i].tensor.grad().data_ptr() != static_cast<void*>(un.grads + un.params[i].offset))
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: parameter ",
                   un.params[i].name, " of unit ", u,
                   ": autograd replaced its gradient instead of adding into the unit's gradients "
                   "(a backward with create_graph, which TorchFullyShard does not support)");
    if (!un.in_backward)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ", u,
                   "'s parameters got gradients, but no output of forward(", u,
                   ", fn) led there, so the unit was not gathered for its backward: run the "
                   "unit's module inside fsdp.forward(",
                   u, ", fn) and return its outputs from fn");
    if (--un.pending == 0) finish_backward(u);
  }

  /// Unit u's gradients are complete: reduced into the shard. Its parameters stay until the
  /// backward reaches a unit before it (nodes of its own, or frozen parameters' uses, may still
  /// need them), or until synchronize().
  void finish_backward(std::size_t u) {
    Unit& un = units_[u];
    for (Param& q : un.params) q.tensor.mutable_grad() = at::Tensor();
    fsdp_->reduce(u);
    un.in_backward = false;
    un.reduced = true;
    un.grads = nullptr;
  }

  /// Where unit u came in this step's forward order (after every unit when it did not).
  [[nodiscard]] std::size_t position(std::size_t u) const {
    for (std::size_t k = 0; k < order_.size(); ++k)
      if (order_[k] == u) return k;
    return order_.size();
  }

  /// fn(), a torch error in it named with the units released meanwhile.
  template <class F>
  auto call(std::size_t u, F&& fn) -> decltype(std::forward<F>(fn)()) {
    try {
      return std::forward<F>(fn)();
    } catch (const c10::Error& e) {
      std::string released;
      for (std::size_t k = 0; k < units_.size(); ++k)
        if (!units_[k].gathered) released += (released.empty() ? "" : ", ") + std::to_string(k);
      if (released.empty() && std::is_same_v<ParamT, float>) throw;
      detail::fail(
          Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard: unit ", u,
          "'s forward failed: ", e.what_without_backtrace(),
          std::is_same_v<ParamT, float>
              ? ""
              : " (the units compute in 16 bits: cast their inputs, x.to(torch::kBFloat16) "
                "or kHalf, inside fn)",
          released.empty() ? "" : " (units ", released,
          released.empty() ? ""
                           : " are released, their parameters without elements: a "
                             "unit's parameters are there only inside "
                             "fsdp.forward(unit, fn))");
    }
  }

  /// Calls f on every tensor in x (a tensor, a vector, a tuple or pair of them).
  template <class X, class G>
  static void visit(const X& x, G&& f) {
    if constexpr (std::is_convertible_v<const X&, const at::Tensor&>) {
      f(x);
    } else if constexpr (requires {
                           x.begin();
                           x.end();
                         }) {
      for (const auto& e : x) visit(e, f);
    } else if constexpr (requires { std::tuple_size<X>::value; }) {
      std::apply([&](const auto&... e) { (visit(e, f), ...); }, x);
    }
  }

  Unit& at(std::size_t u, const char* what) {
    if (u >= units_.size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": TorchFullyShard::", what,
                   ": unit ", u, " of ", units_.size());
    return units_[u];
  }

  /// ParamT as torch's dtype.
  static constexpr at::ScalarType kParam = std::is_same_v<ParamT, float>      ? at::kFloat
                                           : std::is_same_v<ParamT, bfloat16> ? at::kBFloat16
                                                                              : at::kHalf;

  Communicator<Backend>* comm_;
  Options opt_;
  at::Device device_ = at::kCPU;  // the modules' parameters' device
  std::vector<Unit> units_;
  std::unique_ptr<Averager> fsdp_;
  std::vector<at::Tensor> shard_, shard_grads_;
  std::vector<std::size_t> order_, last_order_;  // units in forward order: this step's, the last
  std::vector<std::size_t> backward_;  // units whose backward started this step, not released
  bool synced_ = false;                // synchronize() done, no forward since
  bool stepped_ = true;  // step() done (or none yet), no forward with grad mode on since
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // for hooks that outlive this
};

/// Deduces the backend from the communicator: TorchFullyShard fsdp(comm, modules).
template <class Backend>
TorchFullyShard(Communicator<Backend>&, const std::vector<std::shared_ptr<torch::nn::Module>>&)
    -> TorchFullyShard<Backend>;
/// Deduces the backend from the communicator: TorchFullyShard fsdp(comm, modules, options).
template <class Backend>
TorchFullyShard(Communicator<Backend>&, const std::vector<std::shared_ptr<torch::nn::Module>>&,
                TorchFullyShardOptions) -> TorchFullyShard<Backend>;

DDP_END_NAMESPACE
