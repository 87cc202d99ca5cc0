// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// libtorch's state in ddp::Checkpoint (the checkpoint part of the torch adapter; included by
/// ddp/adapters/torch.hpp): tensors of any dtype on CPU or CUDA, a torch::nn::Module's parameters
/// and buffers by name, a torch optimizer's state and options. Every value goes in and comes back
/// bitwise.
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
/// With a ShardedAverager and TorchShard, ddp/adapters/torch_shard_checkpoint.hpp saves the shard's
/// optimizer state so that it loads on any world size.
///
/// The sections: put_tensor(ck, "w", t) puts "w" (the bytes) and "ddp.tensor.w" (dtype, shape);
/// put_module(ck, "model", m) a tensor "model.<name>" per parameter and buffer and
/// "ddp.module.model" (their names; put_buffers: "ddp.buffers.<name>"); put_optimizer(ck, "adam",
/// opt) "adam" (torch's archive), "adam.options" and "ddp.optimizer.adam" (kind, parameters);
/// with a shard "adam.<field>" per kind of state and "ddp.sharded_optimizer.adam". They share the
/// checkpoint's one set of names: a put replaces sections of the same names (so that a
/// checkpoint is filled again for each save, as AsyncSaver::next() lends it), so give entries
/// names that do not overlap ("model" and "model.fc.weight" do).
///
/// What is refused, with Errc::invalid_argument naming the section and what differs: a module
/// whose parameter and buffer names, dtypes or shapes are not the saved ones (nothing is copied
/// then), an optimizer of another kind than the one saved or over parameters of other dtypes or
/// shapes (the optimizer unchanged), a tensor of another dtype or shape than the section's, an
/// entry the checkpoint does not hold (naming those it holds), a tensor that cannot be saved or
/// written (undefined, sparse, quantized, meta, expanded), a name too long for the sections made
/// from it (nothing put).

#include "ddp/adapters/torch_tensor.hpp"
#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/error.hpp"

#include <ATen/Functions.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
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
#include <typeinfo>
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

/// Errc::invalid_argument unless `t` can be saved (defined, strided, not quantized, with data),
/// or, as a `destination`, written (no two elements in one place).
inline void check_savable(const at::Tensor& t, std::string_view what, std::string_view name,
                          bool destination = false) {
  const char* problem =
      !t.defined()                  ? "an undefined torch::Tensor"
      : t.layout() != c10::kStrided ? "a sparse torch::Tensor (pass t.to_dense())"
      : t.is_quantized()            ? "a quantized torch::Tensor"
      : t.device().is_meta()        ? "a meta torch::Tensor (it has no data: materialize it first)"
      : destination && at::has_internal_overlap(t) == at::MemOverlap::Yes
          ? "a torch::Tensor whose elements share memory (an expand()ed view: pass a tensor of "
            "its own, e.g. t.clone())"
          : nullptr;
  if (problem) detail::fail(Errc::invalid_argument, what, "(\"", name, "\"): ", problem);
}

/// Errc::invalid_argument (`what`) unless every section name in `names` (the one given and those
/// made from it) has 1 to 4096 bytes: checked before anything is put.
inline void check_names(std::string_view what, std::initializer_list<std::string_view> names) {
  for (const std::string_view n : names) {
    if (n.empty() || n.size() > 4096)
      detail::fail(Errc::invalid_argument, what, ": the section name \"", n.substr(0, 40),
                   n.size() > 40 ? "...\"" : "\"", " (made from the name given) has ", n.size(),
                   " bytes; section names have 1 to 4096: give a shorter name");
  }
}

/// Runs f(), turning an exception of torch's into Errc::invalid_argument (`what`, `doing`).
template <class F>
decltype(auto) torch_call(std::string_view what, std::string_view doing, F&& f) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    detail::fail(Errc::invalid_argument, what, ": torch could not ", doing, ": ", why);
  }
}

/// Checks that section `name` of `ck` fits `into` (its dtype and shape, when recorded; its size
/// in bytes otherwise) and returns its bytes.
inline std::span<const std::byte> fitting_bytes(const Checkpoint& ck, std::string_view name,
                                                const at::Tensor& into) {
  check_savable(into, "get_tensor", name, true);
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
inline void copy_into(std::span<const std::byte> bytes, const at::Tensor& into,
                      std::string_view name) {
  torch::NoGradGuard no_grad;
  if (into.device().is_cpu() && into.is_contiguous()) {
    if (!bytes.empty()) std::memcpy(into.data_ptr(), bytes.data(), bytes.size());
    return;
  }
  torch_call(detail::concat("get_tensor(\"", name, "\")"), "copy into the tensor given", [&] {
    at::Tensor host = at::empty(into.sizes(), into.options().device(at::kCPU));
    if (!bytes.empty()) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
    into.copy_(host);
  });
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

/// `opt`'s kind: torch::optim's name for it, else its type's (implementation's) name.
inline std::string kind_name(const torch::optim::Optimizer& opt) {
  namespace o = torch::optim;
  if (dynamic_cast<const o::SGD*>(&opt)) return "SGD";
  if (dynamic_cast<const o::Adam*>(&opt)) return "Adam";
  if (dynamic_cast<const o::AdamW*>(&opt)) return "AdamW";
  if (dynamic_cast<const o::Adagrad*>(&opt)) return "Adagrad";
  if (dynamic_cast<const o::RMSprop*>(&opt)) return "RMSprop";
  if (dynamic_cast<const o::LBFGS*>(&opt)) return "LBFGS";
  return typeid(opt).name();
}

/// `opt`'s parameters' dtypes and shapes (describe()), group after group.
inline std::vector<std::string> parameter_descriptions(const torch::optim::Optimizer& opt) {
  std::vector<std::string> out;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) out.push_back(describe(p.scalar_type(), p.sizes()));
  return out;
}

/// The companion sections: an optimizer's (its kind and parameters), a sharded optimizer's (its
/// kind, step, fields and learning rates), a module's and a module's buffers (their names).
inline std::string optimizer_section(std::string_view name) {
  return detail::concat("ddp.optimizer.", name);
}
inline std::string sharded_optimizer_section(std::string_view name) {
  return detail::concat("ddp.sharded_optimizer.", name);
}
inline std::string module_section(std::string_view name, bool buffers_only) {
  return detail::concat(buffers_only ? "ddp.buffers." : "ddp.module.", name);
}

/// The names of the entries whose companion sections start with `prefix`, for messages.
inline std::string entries(const Checkpoint& ck, std::string_view prefix) {
  std::string out;
  for (const std::string& n : ck.names()) {
    if (n.size() <= prefix.size() || n.compare(0, prefix.size(), prefix) != 0) continue;
    if (!out.empty()) out += ", ";
    out += '"' + n.substr(prefix.size()) + '"';
  }
  return out.empty() ? std::string("none") : out;
}

/// Errc::invalid_argument (`what`) unless `ck` has companion section `section` of entry `name`,
/// a `kind` ("module", "optimizer", ...) of which the checkpoint names those it holds (`prefix`);
/// `other` and `hint`: a companion of another form of the entry, and what to do then.
inline void check_entry(const Checkpoint& ck, std::string_view what, std::string_view name,
                        const std::string& section, std::string_view kind, std::string_view prefix,
                        const std::string& other = {}, std::string_view hint = {}) {
  if (ck.contains(section)) return;
  if (!other.empty() && ck.contains(other)) detail::fail(Errc::invalid_argument, what, ": ", hint);
  detail::fail(Errc::invalid_argument, what, ": the checkpoint holds no ", kind, " named \"", name,
               "\" (its ", kind, "s: ", entries(ck, prefix), ")");
}

}  // namespace torch_detail

/// Section `name` of `ck` holds the elements of `tensor` (any dtype, CPU or CUDA, contiguous or
/// not: copied to host memory in torch's contiguous order), and section "ddp.tensor.<name>" its
/// dtype and shape. Errc::invalid_argument for an undefined, sparse or quantized tensor.
inline Checkpoint& put_tensor(Checkpoint& ck, std::string_view name, const at::Tensor& tensor) {
  const auto what = detail::concat("put_tensor(\"", name.substr(0, 40), "\")");
  torch_detail::check_names(what, {name, torch_detail::tensor_section(name)});
  torch_detail::check_savable(tensor, "put_tensor", name);
  const at::Tensor host = torch_detail::torch_call(what, "copy the tensor to host memory", [&] {
    return tensor.detach().to(at::kCPU).contiguous();
  });
  ck.put(name, std::span(static_cast<const std::byte*>(host.data_ptr()), host.nbytes()));
  return ck.put_object(torch_detail::tensor_section(name),
                       torch_detail::describe(host.scalar_type(), host.sizes()));
}

/// Copies section `name` into `into` (its own storage, wherever it lives, outside autograd: the
/// tensors an averager or an optimizer holds stay the same tensors). Errc::invalid_argument when
/// the section was put with another dtype or shape (put_tensor), or holds another number of
/// bytes (Checkpoint::put_values), or `into` is undefined.
inline void get_tensor(const Checkpoint& ck, std::string_view name, const at::Tensor& into) {
  torch_detail::copy_into(torch_detail::fitting_bytes(ck, name, into), into, name);
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
  const auto what =
      detail::concat(buffers_only ? "put_buffers(\"" : "put_module(\"", name.substr(0, 40), "\")");
  const auto tensors = module_tensors(module, buffers_only);
  std::vector<std::string> keys;
  check_names(what, {name, module_section(name, buffers_only)});
  for (const auto& [key, t] : tensors) {  // everything checked before anything is put
    keys.push_back(detail::concat(name, ".", key));
    check_names(what, {keys.back(), tensor_section(keys.back())});
    check_savable(t, what, key);
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) put_tensor(ck, keys[i], tensors[i].second);
  keys.clear();
  for (const auto& [key, t] : tensors) keys.push_back(key);
  return ck.put_object(module_section(name, buffers_only), keys);
}

inline void get_module(const Checkpoint& ck, std::string_view name, torch::nn::Module& module,
                       bool buffers_only) {
  const auto what =
      detail::concat(buffers_only ? "get_buffers(\"" : "get_module(\"", name.substr(0, 40), "\")");
  const std::string section = module_section(name, buffers_only);
  check_entry(ck, what, name, section, buffers_only ? "set of buffers" : "module",
              buffers_only ? "ddp.buffers." : "ddp.module.", module_section(name, !buffers_only),
              buffers_only ? "it was put with put_module: read it with get_module"
                           : "it was put with put_buffers (buffers alone): read it with "
                             "get_buffers");
  const auto saved = ck.get_object<std::vector<std::string>>(section);
  const auto mine = module_tensors(module, buffers_only);
  for (const auto& [key, t] : mine) {
    if (std::find(saved.begin(), saved.end(), key) == saved.end())
      detail::fail(Errc::invalid_argument, what, ": the module has ", key,
                   ", which the checkpoint's \"", name,
                   "\" has not: it was saved from another model (it holds ", saved.size(),
                   " tensors, this module ", mine.size(), ")");
  }
  for (const auto& key : saved) {
    if (std::none_of(mine.begin(), mine.end(), [&](const auto& m) { return m.first == key; }))
      detail::fail(Errc::invalid_argument, what, ": the checkpoint's \"", name, "\" has ", key,
                   ", which this module has not: it was saved from another model");
  }
  std::vector<std::span<const std::byte>> bytes;  // every tensor checked before any is copied
  for (const auto& [key, t] : mine)
    bytes.push_back(fitting_bytes(ck, detail::concat(name, ".", key), t));
  for (std::size_t i = 0; i < mine.size(); ++i)
    copy_into(bytes[i], mine[i].second, detail::concat(name, ".", mine[i].first));
}
}  // namespace torch_detail

/// Every parameter and buffer of `module` (its submodules' too), as put_tensor's sections
/// "<name>.<its name in the module>" ("model.fc1.weight", "model.bn.running_mean"), and section
/// "ddp.module.<name>" the list of those names. Nothing is put when a tensor cannot be saved.
inline Checkpoint& put_module(Checkpoint& ck, std::string_view name,
                              const torch::nn::Module& module) {
  return torch_detail::put_module(ck, name, module, false);
}

/// Copies what put_module put as `name` into `module`'s parameters and buffers, in place (the
/// averager, the optimizer and the program keep holding them). Errc::invalid_argument, with
/// nothing copied, when the names, dtypes or shapes are not the saved ones (naming the first that
/// differs: the checkpoint holds another model), or the checkpoint holds no module `name`.
inline void get_module(const Checkpoint& ck, std::string_view name, torch::nn::Module& module) {
  torch_detail::get_module(ck, name, module, false);
}

/// put_module of `module`'s buffers alone (BatchNorm's statistics; their list in section
/// "ddp.buffers.<name>"): with a ShardedAverager, whose save() holds the parameters, shard by
/// shard. The averager makes every rank's buffers rank 0's after each step (broadcast_buffers),
/// so the sections are the same in every rank's file and load on any world size.
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
  torch_call(what, detail::concat("read the saved ", thing), [&] {
    torch::serialize::InputArchive archive;
    if (device)
      archive.load_from(in, *device);
    else
      archive.load_from(in);
    load(archive);
  });
}
}  // namespace torch_detail

/// Section `name` holds `opt`'s state (each parameter's: momentum buffers, Adam's moments and
/// step) in torch's own archive format, "<name>.options" every parameter group's options (the
/// learning rate, momentum, betas, ...: what a schedule changed comes back, as with PyTorch's
/// load_state_dict), "ddp.optimizer.<name>" its kind and its parameters' dtypes and shapes. Any
/// torch::optim optimizer. (A scheduler's own count, such as StepLR's, is the program's: put it
/// with Checkpoint::put_object.)
inline Checkpoint& put_optimizer(Checkpoint& ck, std::string_view name,
                                 const torch::optim::Optimizer& opt) {
  const auto what = detail::concat("put_optimizer(\"", name.substr(0, 40), "\")");
  const std::string options_name = detail::concat(name, ".options");
  torch_detail::check_names(what, {name, options_name, torch_detail::optimizer_section(name)});
  const auto [state, options] = torch_detail::torch_call(what, "save the optimizer", [&] {
    std::pair<std::string, std::vector<std::string>> out;
    out.first = torch_detail::archive_bytes([&](auto& a) { opt.save(a); });
    for (const auto& g : opt.param_groups())
      out.second.push_back(torch_detail::archive_bytes([&](auto& a) { g.options().serialize(a); }));
    return out;
  });
  ck.put(name, std::as_bytes(std::span(state.data(), state.size())));
  ck.put_object(options_name, options);
  return ck.put_object(
      torch_detail::optimizer_section(name),
      std::pair{torch_detail::kind_name(opt), torch_detail::parameter_descriptions(opt)});
}

/// Loads what put_optimizer put as `name` into `opt`, replacing its state as a whole (state the
/// checkpoint does not hold is dropped, as PyTorch's load_state_dict does) and its options: `opt`
/// must be of the same kind, over parameters of the same dtypes and shapes in the same order
/// (the state goes to the parameters' device). Errc::invalid_argument naming what differs (the
/// kind, a parameter, the groups), or when the checkpoint holds no optimizer `name`; `opt` is
/// then unchanged.
inline void get_optimizer(const Checkpoint& ck, std::string_view name,
                          torch::optim::Optimizer& opt) {
  using Described = std::pair<std::string, std::vector<std::string>>;
  const auto what = detail::concat("get_optimizer(\"", name.substr(0, 40), "\")");
  torch_detail::check_entry(ck, what, name, torch_detail::optimizer_section(name), "optimizer",
                            "ddp.optimizer.", torch_detail::sharded_optimizer_section(name),
                            "it was put with a TorchShard (the state of a shard): load it with "
                            "ddp::get_optimizer(ck, name, opt, shard)");
  const auto [kind, saved] = ck.get_object<Described>(torch_detail::optimizer_section(name));
  const auto options = ck.get_object<std::vector<std::string>>(detail::concat(name, ".options"));
  const auto mine = torch_detail::parameter_descriptions(opt);
  if (kind != torch_detail::kind_name(opt))
    detail::fail(Errc::invalid_argument, what, ": the checkpoint holds ", kind,
                 " state, the optimizer given is ", torch_detail::kind_name(opt));
  if (saved != mine || options.size() != opt.param_groups().size()) {
    std::size_t i = 0;
    while (i < saved.size() && i < mine.size() && saved[i] == mine[i]) ++i;
    detail::fail(Errc::invalid_argument, what,
                 ": the checkpoint holds the state of an optimizer over ", saved.size(),
                 " parameters in ", options.size(), " groups, this one has ", mine.size(), " in ",
                 opt.param_groups().size(),
                 i < saved.size() && i < mine.size()
                     ? detail::concat("; parameter ", i, " is ", saved[i],
                                      " in the checkpoint but ", mine[i], " here")
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
  auto previous = std::move(opt.state());  // replaced as a whole; back if the state is unreadable
  opt.state().clear();
  try {
    torch_detail::from_archive(
        std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), device, what,
        "state", [&](auto& a) { opt.load(a); });
  } catch (...) {
    opt.state() = std::move(previous);
    throw;
  }
  for (std::size_t g = 0; g < read.size(); ++g)
    opt.param_groups()[g].set_options(std::move(read[g]));
}

DDP_END_NAMESPACE
