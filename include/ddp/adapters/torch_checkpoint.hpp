// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// libtorch's state in ddp::Checkpoint (the checkpoint part of the torch adapter; included by
/// ddp/adapters/torch.hpp): tensors of any dtype on CPU or CUDA, a torch::nn::Module's parameters
/// and buffers by name, a torch optimizer's state, and a ShardedAverager's shard of it through
/// TorchShard. Every value goes in and comes back bitwise.
///
///     ddp::Checkpoint ck;
///     ddp::put_module(ck, "model", *net);                  // "model.<name>" per tensor
///     ddp::put_optimizer(ck, "adam", opt);                 // state and options (lr, ...)
///     ddp::save_checkpoint(comm, ck, "run.ckpt");
///     if (auto ck = ddp::load_checkpoint(comm, "run.ckpt")) {
///       ddp::get_module(*ck, "model", *net);               // into the module's own tensors
///       ddp::get_optimizer(*ck, "adam", opt);
///     }
///
/// Sharded (ZeRO-1 with torch::optim through TorchShard): the optimizer's state for this rank's
/// shard goes into sharded sections (Checkpoint::put_sharded over the averager's layout()), so
/// that a set saved by P ranks loads on any number of them:
///
///     ddp::Checkpoint state;
///     ddp::put_optimizer(state, "adam", opt, shard);      // the shard's moments and step
///     ddp::put_buffers(state, "bn", *net);                // BatchNorm's statistics, if any
///     zero.save("run.ckpt", state);                        // with the shard's parameters
///     if (auto st = zero.load("run.ckpt")) {
///       ddp::get_optimizer(*st, "adam", opt, shard);
///       ddp::get_buffers(*st, "bn", *net);
///     }
///
/// What is refused, with Errc::invalid_argument naming the section and what differs: a module
/// whose parameter and buffer names, dtypes or shapes are not the saved ones (nothing is copied
/// then), an optimizer over other parameters or of another kind than the one saved, a tensor of
/// another dtype or shape than the section's.

#include "ddp/adapters/torch_tensor.hpp"
#include "ddp/adapters/torch_training.hpp"
#include "ddp/error.hpp"
#include "ddp/training/checkpoint.hpp"

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace torch_detail {

/// The companion section of tensor section `name`: its dtype and shape, as "Float[3,4]".
inline std::string tensor_section(std::string_view name) {
  return detail::concat("ddp.tensor.", name);
}

inline std::string describe(c10::ScalarType type, c10::IntArrayRef sizes) {
  std::string out = c10::toString(type);
  out += '[';
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i != 0) out += ',';
    out += std::to_string(sizes[i]);
  }
  return out + ']';
}

/// A tensor's dtype and shape read back from describe(); Errc::protocol when damaged.
struct Described {
  c10::ScalarType type = c10::ScalarType::Undefined;
  std::vector<std::int64_t> sizes;
};
inline Described parse_description(const std::string& text, std::string_view name) {
  const auto bad = [&] {
    detail::fail(Errc::protocol, "Checkpoint: the description of tensor section \"", name,
                 "\" is damaged: \"", text, "\"");
  };
  const std::size_t open = text.find('[');
  if (open == std::string::npos || text.empty() || text.back() != ']') bad();
  Described d;
  const std::string type = text.substr(0, open);
  for (int t = 0; t < static_cast<int>(c10::ScalarType::NumOptions); ++t) {
    const auto s = static_cast<c10::ScalarType>(t);
    if (type == c10::toString(s)) d.type = s;
  }
  if (d.type == c10::ScalarType::Undefined) {
    detail::fail(Errc::invalid_argument, "Checkpoint: tensor section \"", name, "\" holds dtype ",
                 type, ", which this libtorch does not have");
  }
  std::size_t at = open + 1;
  while (at < text.size() - 1) {
    std::size_t end = text.find_first_of(",]", at);
    const std::string digits = text.substr(at, end - at);
    if (digits.empty() || digits.size() > 18 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      bad();
    d.sizes.push_back(std::stoll(digits));
    at = end + 1;
  }
  return d;
}

/// Errc::invalid_argument unless `t` can be saved (defined, strided, not quantized).
inline void check_savable(const at::Tensor& t, std::string_view what, std::string_view name) {
  const char* problem = !t.defined()                  ? "an undefined torch::Tensor"
                        : t.layout() != c10::kStrided ? "a sparse torch::Tensor (pass t.to_dense())"
                        : t.is_quantized()            ? "a quantized torch::Tensor"
                                                      : nullptr;
  if (problem) detail::fail(Errc::invalid_argument, what, "(\"", name, "\"): ", problem);
}

/// Checks that section `name` of `ck` fits `into` (its dtype and shape, when recorded; its size
/// in bytes otherwise) and returns its bytes.
inline std::span<const std::byte> fitting_bytes(const Checkpoint& ck, std::string_view name,
                                                const at::Tensor& into) {
  check_savable(into, "get_tensor", name);
  const std::span<const std::byte> bytes = ck.get(name);
  const std::string companion = tensor_section(name);
  const std::string given = describe(into.scalar_type(), into.sizes());
  if (ck.contains(companion)) {
    const auto saved = ck.get_object<std::string>(companion);
    const Described d = parse_description(saved, name);
    if (d.type != into.scalar_type() || d.sizes != into.sizes().vec())
      detail::fail(Errc::invalid_argument, "Checkpoint: section \"", name, "\" holds a tensor ",
                   saved, ", but the tensor given is ", given,
                   ": the model changed since it was saved");
  }
  if (bytes.size() != into.nbytes())
    detail::fail(Errc::invalid_argument, "Checkpoint: section \"", name, "\" holds ", bytes.size(),
                 " bytes, but the tensor given (", given, ") has ", into.nbytes(),
                 ": the model changed since it was saved");
  return bytes;
}

/// Copies `bytes` (fitting_bytes) into `into`, wherever it lives, outside autograd.
inline void copy_into(std::span<const std::byte> bytes, const at::Tensor& into) {
  torch::NoGradGuard no_grad;
  if (into.device().is_cpu() && into.is_contiguous()) {
    if (!bytes.empty()) std::memcpy(into.data_ptr(), bytes.data(), bytes.size());
    return;
  }
  at::Tensor host = at::empty(into.sizes(), into.options().device(at::kCPU));
  if (!bytes.empty()) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  into.copy_(host);
}

/// The state map's key of parameter `p`: its TensorImpl's address, as a string (libtorch 1.x)
/// or as a pointer (2.x).
template <class Map>
[[nodiscard]] typename Map::key_type state_key(const Map& /*state*/, const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;
    out << p.unsafeGetTensorImpl();
    return out.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

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
               "and RMSprop; this optimizer is none of them");
}

/// The learning rate of each of `opt`'s parameter groups.
inline std::vector<double> learning_rates(const torch::optim::Optimizer& opt) {
  std::vector<double> lr;
  for (const auto& g : opt.param_groups()) lr.push_back(g.options().get_lr());
  return lr;
}

/// The element counts of `opt`'s parameters, group after group.
inline std::vector<std::uint64_t> parameter_sizes(const torch::optim::Optimizer& opt) {
  std::vector<std::uint64_t> n;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) n.push_back(static_cast<std::uint64_t>(p.numel()));
  return n;
}

/// The companion section of an optimizer's section `name`: its parameters' element counts.
inline std::string optimizer_section(std::string_view name) {
  return detail::concat("ddp.optimizer.", name);
}

}  // namespace torch_detail

/// Section `name` of `ck` holds the elements of `tensor` (any dtype, CPU or CUDA, contiguous or
/// not: copied to host memory in torch's contiguous order), and section "ddp.tensor.<name>" its
/// dtype and shape. Errc::invalid_argument for an undefined, sparse or quantized tensor.
inline Checkpoint& put_tensor(Checkpoint& ck, std::string_view name, const at::Tensor& tensor) {
  torch_detail::check_savable(tensor, "put_tensor", name);
  const at::Tensor host = tensor.detach().to(at::kCPU).contiguous();
  ck.put(name, std::span(static_cast<const std::byte*>(host.data_ptr()), host.nbytes()));
  return ck.put_object(torch_detail::tensor_section(name),
                       torch_detail::describe(host.scalar_type(), host.sizes()));
}

/// Copies section `name` into `into` (its own storage, wherever it lives, outside autograd: the
/// tensors an averager or an optimizer holds stay the same tensors). Errc::invalid_argument when
/// the section was put with another dtype or shape (put_tensor), or holds another number of
/// bytes (Checkpoint::put_values), or `into` is undefined.
inline void get_tensor(const Checkpoint& ck, std::string_view name, const at::Tensor& into) {
  torch_detail::copy_into(torch_detail::fitting_bytes(ck, name, into), into);
}

/// Section `name` (put with put_tensor) as a new CPU tensor of its dtype and shape.
[[nodiscard]] inline at::Tensor get_tensor(const Checkpoint& ck, std::string_view name) {
  const std::string companion = torch_detail::tensor_section(name);
  if (!ck.contains(companion) && ck.contains(name))
    detail::fail(Errc::invalid_argument, "Checkpoint: section \"", name,
                 "\" was not put with put_tensor (its dtype and shape are unknown): read it into "
                 "a tensor with get_tensor(ck, name, tensor)");
  const auto d = torch_detail::parse_description(ck.get_object<std::string>(companion), name);
  at::Tensor out = at::empty(d.sizes, at::TensorOptions().dtype(d.type));
  get_tensor(ck, name, out);
  return out;
}

namespace torch_detail {
/// `module`'s parameters (unless `buffers_only`) and buffers, by name.
inline std::vector<std::pair<std::string, at::Tensor>> module_tensors(
    const torch::nn::Module& module, bool buffers_only) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!buffers_only)
    for (const auto& p : module.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

inline Checkpoint& put_module(Checkpoint& ck, std::string_view name,
                              const torch::nn::Module& module, bool buffers_only) {
  std::vector<std::string> keys;
  for (const auto& [key, t] : module_tensors(module, buffers_only)) {
    keys.push_back(key);
    put_tensor(ck, detail::concat(name, ".", key), t);
  }
  return ck.put_object(name, keys);
}

inline void get_module(const Checkpoint& ck, std::string_view name, torch::nn::Module& module,
                       bool buffers_only) {
  const char* what = buffers_only ? "get_buffers" : "get_module";
  const auto saved = ck.get_object<std::vector<std::string>>(name);
  const auto mine = module_tensors(module, buffers_only);
  for (const auto& [key, t] : mine) {
    if (std::find(saved.begin(), saved.end(), key) == saved.end())
      detail::fail(Errc::invalid_argument, what, "(\"", name, "\"): the module has ", key,
                   ", which the checkpoint's ", name,
                   " has not: it was saved from another model (it holds ", saved.size(),
                   " tensors, this module ", mine.size(), ")");
  }
  for (const auto& key : saved) {
    if (std::none_of(mine.begin(), mine.end(), [&](const auto& m) { return m.first == key; }))
      detail::fail(Errc::invalid_argument, what, "(\"", name, "\"): the checkpoint's ", name,
                   " has ", key, ", which this module has not: it was saved from another model");
  }
  std::vector<std::span<const std::byte>> bytes;  // every tensor checked before any is copied
  for (const auto& [key, t] : mine)
    bytes.push_back(fitting_bytes(ck, detail::concat(name, ".", key), t));
  for (std::size_t i = 0; i < mine.size(); ++i) copy_into(bytes[i], mine[i].second);
}
}  // namespace torch_detail

/// Every parameter and buffer of `module` (its submodules' too), as put_tensor's section
/// "<name>.<its name in the module>" ("model.fc1.weight", "model.bn.running_mean"), and section
/// `name` the list of those names.
inline Checkpoint& put_module(Checkpoint& ck, std::string_view name,
                              const torch::nn::Module& module) {
  return torch_detail::put_module(ck, name, module, false);
}

/// Copies what put_module put as `name` into `module`'s parameters and buffers, in place (the
/// averager, the optimizer and the program keep holding them). Errc::invalid_argument, with
/// nothing copied, when the names, dtypes or shapes are not the saved ones (naming the first that
/// differs: the checkpoint holds another model).
inline void get_module(const Checkpoint& ck, std::string_view name, torch::nn::Module& module) {
  torch_detail::get_module(ck, name, module, false);
}

/// put_module of `module`'s buffers alone (BatchNorm's statistics): with a ShardedAverager,
/// whose save() holds the parameters, shard by shard. The averager makes every rank's buffers
/// rank 0's after each step (broadcast_buffers), so the section is the same in every rank's file
/// and loads on any world size.
inline Checkpoint& put_buffers(Checkpoint& ck, std::string_view name,
                               const torch::nn::Module& module) {
  return torch_detail::put_module(ck, name, module, true);
}

/// get_module of what put_buffers put.
inline void get_buffers(const Checkpoint& ck, std::string_view name, torch::nn::Module& module) {
  torch_detail::get_module(ck, name, module, true);
}

namespace torch_detail {
/// What `save(archive)` writes, as bytes.
template <class F>
std::string archive_bytes(F&& save) {
  torch::serialize::OutputArchive archive;
  save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}
/// Calls load(archive) on an archive of `bytes` (tensors to `device`); Errc::invalid_argument
/// (`what`, `thing`) when torch cannot read it.
template <class F>
void from_archive(std::string_view bytes, std::optional<c10::Device> device, std::string_view what,
                  std::string_view thing, F&& load) {
  std::istringstream in{std::string(bytes)};
  try {
    torch::serialize::InputArchive archive;
    if (device)
      archive.load_from(in, *device);
    else
      archive.load_from(in);
    load(archive);
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    detail::fail(Errc::invalid_argument, what, ": torch could not read the saved ", thing,
                 " into this optimizer (", why, "): was it saved from another kind of optimizer?");
  }
}
}  // namespace torch_detail

/// Section `name` holds `opt`'s state (each parameter's: momentum buffers, Adam's moments and
/// step) in torch's own archive format, "<name>.options" every parameter group's options (the
/// learning rate, momentum, betas, ...: what a schedule changed comes back, as with PyTorch's
/// load_state_dict), "ddp.optimizer.<name>" its parameters' sizes. Any torch::optim optimizer.
inline Checkpoint& put_optimizer(Checkpoint& ck, std::string_view name,
                                 const torch::optim::Optimizer& opt) {
  const std::string state = torch_detail::archive_bytes([&](auto& a) { opt.save(a); });
  std::vector<std::string> options;
  for (const auto& g : opt.param_groups())
    options.push_back(torch_detail::archive_bytes([&](auto& a) { g.options().serialize(a); }));
  ck.put(name, std::as_bytes(std::span(state.data(), state.size())));
  ck.put_object(detail::concat(name, ".options"), options);
  return ck.put_object(torch_detail::optimizer_section(name), torch_detail::parameter_sizes(opt));
}

/// Loads what put_optimizer put as `name` into `opt` (an optimizer of the same kind over the same
/// parameters; the state goes to the parameters' device), its options too. Errc::invalid_argument
/// when `opt` has other parameters than the saved one, or when torch cannot read the state into
/// it (another kind of optimizer), naming the section; `opt` is then unchanged.
inline void get_optimizer(const Checkpoint& ck, std::string_view name,
                          torch::optim::Optimizer& opt) {
  const auto what = detail::concat("get_optimizer(\"", name, "\")");
  const auto saved =
      ck.get_object<std::vector<std::uint64_t>>(torch_detail::optimizer_section(name));
  const auto options = ck.get_object<std::vector<std::string>>(detail::concat(name, ".options"));
  const auto mine = torch_detail::parameter_sizes(opt);
  if (saved != mine || options.size() != opt.param_groups().size()) {
    std::size_t i = 0;
    while (i < saved.size() && i < mine.size() && saved[i] == mine[i]) ++i;
    detail::fail(Errc::invalid_argument, what,
                 ": the checkpoint holds the state of an optimizer over ", saved.size(),
                 " parameters in ", options.size(), " groups, this one has ", mine.size(), " in ",
                 opt.param_groups().size(),
                 i < saved.size() && i < mine.size()
                     ? detail::concat("; parameter ", i, " has ", saved[i],
                                      " elements in the checkpoint but ", mine[i], " here")
                     : std::string(),
                 ": give it the model's parameters, in the order they were saved with");
  }
  std::optional<c10::Device> device;
  if (!opt.param_groups().empty() && !opt.param_groups()[0].params().empty())
    device = opt.param_groups()[0].params()[0].device();
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> read;  // all read, then applied
  for (std::size_t g = 0; g < options.size(); ++g) {
    read.push_back(opt.param_groups()[g].options().clone());
    torch_detail::from_archive(options[g], std::nullopt, what, "options",
                               [&](auto& a) { read.back()->serialize(a); });
  }
  const std::span<const std::byte> bytes = ck.get(name);
  torch_detail::from_archive(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), device, what,
      "state", [&](auto& a) { opt.load(a); });
  for (std::size_t g = 0; g < read.size(); ++g)
    opt.param_groups()[g].set_options(std::move(read[g]));
}

/// Sections "<name>.<field>" hold the state of `opt` (an optimizer over shard.parameters()) for
/// this rank's shard, one sharded section per kind of state kept per element (SGD's
/// momentum_buffer; Adam's and AdamW's exp_avg, exp_avg_sq and, with amsgrad, max_exp_avg_sq;
/// Adagrad's sum; RMSprop's square_avg, momentum_buffer, grad_avg), laid out as the averager's
/// layout(), so that ShardedAverager::load cuts them again for any world size; section `name`
/// the optimizer's kind, its step and the fields, "<name>.lr" each parameter group's learning
/// rate. Give the checkpoint to ShardedAverager::save (to a file or a ShardMirror).
/// Errc::invalid_argument for another kind of optimizer or state that differs between the
/// shard's tensors (a step count, a kind of state that some have and others have not).
template <class Zero>
Checkpoint& put_optimizer(Checkpoint& ck, std::string_view name, const torch::optim::Optimizer& opt,
                          const TorchShard<Zero>& shard) {
  using T = typename Zero::value_type;
  const auto what = detail::concat("put_optimizer(\"", name, "\")");
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
    std::vector<std::string> desc{kind, ""};
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
            torch_detail::fields(*states[j])[f].second->detach().to(at::kCPU).contiguous();
        const auto want = static_cast<std::size_t>(tensors[j].numel()) * sizeof(T);
        if (host.nbytes() != want)
          detail::fail(Errc::invalid_argument, what, ": ", field, " of the shard's tensor ", j,
                       " has ", host.nbytes(), " bytes, not ", want);
        std::memcpy(values.data() + at, host.data_ptr(), host.nbytes());
        at += static_cast<std::size_t>(tensors[j].numel());
      }
      ck.put_sharded(detail::concat(name, ".", field), values, shard.averager().layout());
      desc.push_back(field);
    }
    ck.put_object(name, desc);
  });
  return ck.put_object(detail::concat(name, ".lr"), torch_detail::learning_rates(opt));
}

/// Loads what put_optimizer(ck, name, opt, shard) put into `opt` for this rank's shard: `ck` as
/// ShardedAverager::load returned it (saved by this world size or another: its sharded sections
/// cut for this rank's shard). The learning rates come back too. Errc::invalid_argument when the
/// checkpoint holds another kind of optimizer's state, state cut for another shard (a checkpoint
/// not loaded through this averager), or another number of parameter groups.
template <class Zero>
void get_optimizer(const Checkpoint& ck, std::string_view name, torch::optim::Optimizer& opt,
                   const TorchShard<Zero>& shard) {
  using T = typename Zero::value_type;
  const auto what = detail::concat("get_optimizer(\"", name, "\")");
  const auto desc = ck.get_object<std::vector<std::string>>(name);
  const auto lr = ck.get_object<std::vector<double>>(detail::concat(name, ".lr"));
  if (desc.size() < 2)
    detail::fail(Errc::protocol, "Checkpoint: section \"", name, "\" is damaged");
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
      const std::string section = detail::concat(name, ".", desc[f]);
      if (ck.sharded_layout(section) != layout)
        detail::fail(Errc::invalid_argument, what, ": section \"", section,
                     "\" is not cut for this rank's shard: load the checkpoint through the "
                     "ShardedAverager (zero.load(path)), which cuts it for this world size");
      values.emplace_back(layout.elements());
      ck.get_values(section, std::span(values.back()));
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
