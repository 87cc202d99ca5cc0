// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// A ShardedAverager's (or FullyShardedAverager's) shard of a torch optimizer's state in
/// checkpoints (part of the torch adapter; included by ddp/adapters/torch.hpp): with ZeRO-1 through
/// TorchShard, the optimizer's state for this rank's shard goes into sharded sections
/// (Checkpoint::put_sharded over the averager's layout()), so that a set saved by P ranks loads on
/// any number of them, bitwise:
///
///     ddp::Checkpoint state;
///     ddp::put_optimizer(state, "adam", opt, shard);      // the shard's moments and step
///     ddp::put_buffers(state, "bn", *net);                // BatchNorm's statistics, if any
///     zero.save(state, "run.ckpt");                        // with the shard's parameters
///     if (auto st = zero.load("run.ckpt")) {
///       ddp::get_optimizer(*st, "adam", opt, shard);
///       ddp::get_buffers(*st, "bn", *net);
///     }
///
/// The sections: "adam.<field>" per kind of state kept per element, and
/// "ddp.sharded_optimizer.adam" (kind, step, fields, learning rates); see
/// ddp/adapters/torch_checkpoint.hpp for the rest.

#include "ddp/adapters/torch_checkpoint.hpp"
#include "ddp/adapters/torch_training.hpp"
#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/error.hpp"

#include <ATen/core/Tensor.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace torch_detail {

/// The tensors a parameter's state keeps per element, by name, for the optimizers whose state
/// a sharded save carries.
inline auto fields(torch::optim::SGDParamState& s) {
  return std::array{std::pair{"momentum_buffer", &s.momentum_buffer()}};
}
inline auto fields(torch::optim::AdamParamState& s) {
  return std::array{std::pair{"exp_avg", &s.exp_avg()}, std::pair{"exp_avg_sq", &s.exp_avg_sq()},
                    std::pair{"max_exp_avg_sq", &s.max_exp_avg_sq()}};
}
inline auto fields(torch::optim::AdamWParamState& s) {
  return std::array{std::pair{"exp_avg", &s.exp_avg()}, std::pair{"exp_avg_sq", &s.exp_avg_sq()},
                    std::pair{"max_exp_avg_sq", &s.max_exp_avg_sq()}};
}
inline auto fields(torch::optim::AdagradParamState& s) {
  return std::array{std::pair{"sum", &s.sum()}};
}
inline auto fields(torch::optim::RMSpropParamState& s) {
  return std::array{std::pair{"square_avg", &s.square_avg()},
                    std::pair{"momentum_buffer", &s.momentum_buffer()},
                    std::pair{"grad_avg", &s.grad_avg()}};
}

/// Calls f.template operator()<ParamState>(kind) for `opt`'s kind; Errc::invalid_argument
/// (`what`) for another optimizer.
template <class F>
void with_kind(const torch::optim::Optimizer& opt, std::string_view what, F&& f) {
  namespace o = torch::optim;
  if (dynamic_cast<const o::SGD*>(&opt)) return f.template operator()<o::SGDParamState>("SGD");
  if (dynamic_cast<const o::Adam*>(&opt)) return f.template operator()<o::AdamParamState>("Adam");
  if (dynamic_cast<const o::AdamW*>(&opt))
    return f.template operator()<o::AdamWParamState>("AdamW");
  if (dynamic_cast<const o::Adagrad*>(&opt))
    return f.template operator()<o::AdagradParamState>("Adagrad");
  if (dynamic_cast<const o::RMSprop*>(&opt))
    return f.template operator()<o::RMSpropParamState>("RMSprop");
  detail::fail(Errc::invalid_argument, what,
               ": a sharded save carries the state of torch::optim's SGD, Adam, AdamW, Adagrad "
               "and RMSprop; this optimizer is ",
               kind_name(opt), " (save it unsharded, with put_optimizer(ck, name, opt))");
}

/// The learning rate of each of `opt`'s parameter groups.
inline std::vector<double> learning_rates(const torch::optim::Optimizer& opt) {
  std::vector<double> lr;
  for (const auto& g : opt.param_groups()) lr.push_back(g.options().get_lr());
  return lr;
}

/// Errc::invalid_argument (`what`) unless `opt`'s parameters are `shard`'s tensors, in order.
inline void check_over_shard(const torch::optim::Optimizer& opt,
                             const std::vector<at::Tensor>& shard, std::string_view what) {
  std::vector<const void*> mine;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) mine.push_back(p.unsafeGetTensorImpl());
  bool same = mine.size() == shard.size();
  for (std::size_t i = 0; same && i < mine.size(); ++i)
    same = mine[i] == shard[i].unsafeGetTensorImpl();
  if (!same)
    detail::fail(Errc::invalid_argument, what,
                 ": the optimizer is not over the shard's tensors: make it over "
                 "shard.parameters() (it has ",
                 mine.size(), " parameters, the shard ", shard.size(), " tensors)");
}

/// A shard of a model as tensors for torch's optimizers: TorchShard (over a ShardedAverager) or
/// TorchFullyShard (over a FullyShardedAverager).
template <class S>
concept tensor_shard = requires(const S& s) {
  { s.parameters() } -> std::convertible_to<const std::vector<at::Tensor>&>;
  { s.averager().layout() } -> std::convertible_to<ShardLayout>;
  typename std::remove_cvref_t<decltype(s.averager())>::value_type;
};
template <class S>
using shard_value_t =
    typename std::remove_cvref_t<decltype(std::declval<const S&>().averager())>::value_type;

}  // namespace torch_detail

/// Sections "<name>.<field>" hold the state of `opt` (an optimizer over shard.parameters()) for
/// this rank's shard, one sharded section per kind of state kept per element (SGD's
/// momentum_buffer; Adam's and AdamW's exp_avg, exp_avg_sq and, with amsgrad, max_exp_avg_sq;
/// Adagrad's sum; RMSprop's square_avg, momentum_buffer, grad_avg), laid out as the averager's
/// layout(), so that ShardedAverager::load cuts them again for any world size; section
/// "ddp.sharded_optimizer.<name>" the optimizer's kind, its step, the fields and each parameter
/// group's learning rate. Give the checkpoint to ShardedAverager::save (to a file or a
/// ShardMirror). Errc::invalid_argument, nothing put, for another kind of optimizer, one that is
/// not over shard.parameters(), or state that differs between the shard's tensors (a step count,
/// a kind of state that some have and others have not).
template <torch_detail::tensor_shard Shard>
Checkpoint& put_optimizer(Checkpoint& ck, std::string_view name, const torch::optim::Optimizer& opt,
                          const Shard& shard) {
  using T = torch_detail::shard_value_t<Shard>;
  const auto what = detail::concat("put_optimizer(\"", name.substr(0, 40), "\")");
  const std::string section = torch_detail::sharded_optimizer_section(name);
  torch_detail::check_names(
      what, {section, detail::layout_section(detail::concat(name, ".momentum_buffer")),
             detail::layout_section(detail::concat(name, ".max_exp_avg_sq"))});
  torch_detail::check_over_shard(opt, shard.parameters(), what);
  std::vector<std::string> desc;
  std::vector<std::pair<std::string, std::vector<T>>> sections;  // all made, then put
  torch_detail::with_kind(opt, what, [&]<class S>(const char* kind) {
    const auto& tensors = shard.parameters();
    std::vector<S*> states;
    for (const at::Tensor& p : tensors) {
      const auto it = opt.state().find(torch_detail::state_key(opt.state(), p));
      if (it != opt.state().end()) states.push_back(static_cast<S*>(it->second.get()));
    }
    if (!states.empty() && states.size() != tensors.size())
      detail::fail(Errc::invalid_argument, what, ": the optimizer has state for ", states.size(),
                   " of the shard's ", tensors.size(), " tensors (give it shard.parameters())");
    desc = {kind, ""};
    if constexpr (requires(S & s) { s.step(); }) {
      if (!states.empty()) {
        for (S* s : states)
          if (s->step() != states[0]->step())
            detail::fail(Errc::invalid_argument, what,
                         ": the shard's tensors have made different numbers of steps");
        desc[1] = std::to_string(states[0]->step());
      }
    }
    const std::size_t count = states.empty() ? 0 : torch_detail::fields(*states[0]).size();
    for (std::size_t f = 0; f < count; ++f) {
      const char* field = torch_detail::fields(*states[0])[f].first;
      std::size_t defined = 0;
      for (S* s : states) defined += torch_detail::fields(*s)[f].second->defined() ? 1U : 0U;
      if (defined == 0) continue;
      if (defined != states.size())
        detail::fail(Errc::invalid_argument, what, ": ", field, " is kept for ", defined,
                     " of the shard's ", states.size(), " tensors");
      std::vector<T> values(shard.averager().layout().elements());
      std::size_t at = 0;
      for (std::size_t j = 0; j < states.size(); ++j) {
        const at::Tensor host =
            torch_detail::torch_call(what, "copy the state to host memory", [&] {
              return torch_detail::fields(*states[j])[f].second->detach().to(at::kCPU).contiguous();
            });
        const auto want = static_cast<std::size_t>(tensors[j].numel()) * sizeof(T);
        if (host.nbytes() != want || host.scalar_type() != tensors[j].scalar_type())
          detail::fail(Errc::invalid_argument, what, ": ", field, " of the shard's tensor ", j,
                       " is ", torch_detail::describe(host.scalar_type(), host.sizes()),
                       ", not as the tensor");
        std::memcpy(values.data() + at, host.data_ptr(), host.nbytes());
        at += static_cast<std::size_t>(tensors[j].numel());
      }
      sections.emplace_back(detail::concat(name, ".", field), std::move(values));
      desc.push_back(field);
    }
  });
  for (const auto& [n, values] : sections) ck.put_sharded(n, values, shard.averager().layout());
  return ck.put_object(section, std::pair{desc, torch_detail::learning_rates(opt)});
}

/// Loads what put_optimizer(ck, name, opt, shard) put into `opt` (over shard.parameters()) for
/// this rank's shard, replacing its state: `ck` as ShardedAverager::load returned it (saved by
/// this world size or another: its sharded sections cut for this rank's shard). The learning
/// rates come back too. Errc::invalid_argument, `opt` unchanged, when the checkpoint holds
/// another kind of optimizer's state, state cut for another shard (a checkpoint not loaded
/// through this averager), another number of parameter groups, or no such optimizer, or when
/// `opt` is not over shard.parameters().
template <torch_detail::tensor_shard Shard>
void get_optimizer(const Checkpoint& ck, std::string_view name, torch::optim::Optimizer& opt,
                   const Shard& shard) {
  using T = torch_detail::shard_value_t<Shard>;
  using Described = std::pair<std::vector<std::string>, std::vector<double>>;
  const auto what = detail::concat("get_optimizer(\"", name.substr(0, 40), "\")");
  const std::string section = torch_detail::sharded_optimizer_section(name);
  torch_detail::check_entry(ck, what, name, section, "sharded optimizer", "ddp.sharded_optimizer.",
                            torch_detail::optimizer_section(name),
                            "it was put without a shard (the whole optimizer): load it with "
                            "ddp::get_optimizer(ck, name, opt)");
  torch_detail::check_over_shard(opt, shard.parameters(), what);
  const auto [desc, lr] = ck.get_object<Described>(section);
  if (desc.size() < 2 ||
      (!desc[1].empty() &&
       (desc[1].size() > 18 || desc[1].find_first_not_of("0123456789") != std::string::npos)))
    detail::fail(Errc::protocol, "Checkpoint: section \"", section, "\" is damaged");
  if (lr.size() != opt.param_groups().size())
    detail::fail(Errc::invalid_argument, what, ": the checkpoint's optimizer has ", lr.size(),
                 " parameter groups, this one ", opt.param_groups().size());
  const ShardLayout layout = shard.averager().layout();
  torch_detail::with_kind(opt, what, [&]<class S>(const char* kind) {
    if (desc[0] != kind)
      detail::fail(Errc::invalid_argument, what, ": the checkpoint holds ", desc[0],
                   " state, the optimizer given is ", kind);
    std::vector<std::vector<T>> values;  // read and checked before anything changes
    for (std::size_t f = 2; f < desc.size(); ++f) {
      const std::string field = detail::concat(name, ".", desc[f]);
      if (ck.sharded_layout(field) != layout)
        detail::fail(Errc::invalid_argument, what, ": section \"", field,
                     "\" is not cut for this rank's shard: load the checkpoint through the "
                     "ShardedAverager (zero.load(path)), which cuts it for this world size");
      values.emplace_back(layout.elements());
      ck.get_values(field, std::span(values.back()));
    }
    const auto& tensors = shard.parameters();
    for (std::size_t j = 0, at = 0; j < tensors.size(); ++j) {
      const auto key = torch_detail::state_key(opt.state(), tensors[j]);
      if (desc.size() == 2 && desc[1].empty()) {  // saved before the first step
        opt.state().erase(key);
        continue;
      }
      auto state = std::make_unique<S>();
      if constexpr (requires(S & s) { s.step(std::int64_t{}); })
        state->step(desc[1].empty() ? 0 : std::stoll(desc[1]));
      const auto n = static_cast<std::size_t>(tensors[j].numel());
      for (auto& [field, tensor] : torch_detail::fields(*state)) {
        const auto k = std::find(desc.begin() + 2, desc.end(), field);
        if (k == desc.end()) continue;  // not kept (momentum 0, amsgrad off): undefined
        const auto& from = values[static_cast<std::size_t>(k - desc.begin() - 2)];
        at::Tensor host =
            at::empty({static_cast<std::int64_t>(n)}, tensors[j].options().device(at::kCPU));
        std::memcpy(host.data_ptr(), from.data() + at, n * sizeof(T));
        *tensor = host.to(tensors[j].device());
      }
      opt.state()[key] = std::move(state);
      at += n;
    }
  });
  for (std::size_t g = 0; g < lr.size(); ++g) opt.param_groups()[g].options().set_lr(lr[g]);
}

DDP_END_NAMESPACE
