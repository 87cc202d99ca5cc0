// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ShardedAverager<Model, Backend>: sharded optimizer state (ZeRO stages 1 and 2), the sibling of
/// GradientAverager.
///
///     ddp::ShardedAverager zero(comm, model);   // broadcasts rank 0's parameters
///     Adam opt(zero.shard());                   // state for this rank's shard only: ~1/P
///     for (...) {
///       forward_backward(model, batch);         // zero.mark_ready(i) as gradients are final
///       zero.synchronize();                     // this rank's shard holds averaged gradients
///       opt.step(zero.shard());                 // update the shard only
///       zero.gather();                          // every rank gets every updated parameter
///     }
///
///  * The same bucket engine as GradientAverager's (ddp/training/averaging/buckets.hpp, the same
///  options),
///    with each bucket cut into P contiguous blocks of equal size (padded with zeros to a
///    multiple of P); rank r owns block r of every bucket, so its shard is balanced to within one
///    element per bucket. A large gradient (in_place_bytes and up) is communicated where it is:
///    its first n - n % P elements; the n % P left over join the next small bucket.
///  * A bucket whose gradients are all final starts its reduce_scatter (ddp::reduce_scatter_hook;
///    register_comm_hook replaces it) in the background while backward goes on: rank r receives
///    the averaged gradients of its blocks only (ZeRO-2). synchronize() waits and writes them
///    into the gradients' owned ranges (the rest is unspecified afterwards).
///  * shard() lists the owned ranges as ShardSlice: a parameter index, an offset, views of those
///    values and gradients. A slice has `value` and `grad`, so the shard is itself a Model: an
///    optimizer written for a model runs unchanged on it and keeps state (momentum, Adam's
///    moments) for 1/P of the parameters (ZeRO-1). gather() all-gathers the updated blocks;
///    reduce_scatter + all_gather move the bytes of one all_reduce.
///  * Unused parameters count as zero; no_sync() accumulates micro-batches; buffers() are copied
///    from rank 0 after each synchronize(). Not a Joinable: with uneven inputs use
///    GradientAverager in a ddp::Join, or give every rank the same step count.
///
/// Checkpoints: save(state, path) has every rank write its own file (its shard of the parameters,
/// the shard's layout, and `state`: your optimizer's state for the shard, the step), all or none;
/// load(path) puts every rank's shard back, gathers, and returns `state`, from a set saved at any
/// world size and with any BucketOptions: state put with Checkpoint::put_sharded(name, values,
/// layout()) is cut again for the new shard (ZeRO resharding). A set saved with another model is
/// refused (Errc::mismatch). With a framework whose
/// backward adds into the gradients, zero_grad() the whole model after a step (TorchShard::step
/// does): an optimizer on the shard zeroes only the shard's.

#include "ddp/communicator.hpp"
#include "ddp/training/averaging/buckets.hpp"
#include "ddp/training/averaging/gradient.hpp"
#include "ddp/training/averaging/parameters.hpp"
#include "ddp/training/zero/shard_mirror.hpp"
#include "ddp/training/zero/sharded_checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// One piece of the shard a rank owns: elements [offset, offset + value.size) of parameter
/// `param`. It has a value and a gradient, so it is a Parameter and a shard is a Model.
template <class T>
struct ShardSlice {
  std::size_t param = 0;   ///< The parameter's index in the model.
  std::size_t offset = 0;  ///< The slice's first element within the parameter.
  TensorView<T> value;     ///< The parameter's values [offset, offset + size).
  TensorView<T> grad;      ///< Their averaged gradients (after synchronize()).
};

/// Sharded optimizer state (see the file comment). T: the parameters' element type (deduced for
/// typed parameters; give it for run-time-typed ones that are not float32). mark_ready,
/// synchronize, average, no_sync, found_nonfinite and register_comm_hook are GradientAverager's.
template <Model M, class Backend, class T = typename detail::model_element<M>::type>
class ShardedAverager : public detail::Averager<M, Backend> {
  using Base = detail::Averager<M, Backend>;
  using Engine = detail::BucketEngine<T, M, Backend>;
  static_assert(detail::is_floating_scalar_v<T>,
                "ShardedAverager: T must be float, double, ddp::half or ddp::bfloat16");

 public:
  /// The parameters' element type.
  using value_type = T;
  /// One owned range (see ShardSlice).
  using Slice = ShardSlice<T>;

  /// Shards `model`'s gradients and optimizer updates over `comm` (both must outlive it); copies
  /// rank 0's parameters (and buffers) to every rank unless `options` says not to. Collective.
  ShardedAverager(Communicator<Backend>& comm, M& model, BucketOptions options = {})
      : Base(comm, model, options, dtype_of<T>) {
    this->impl_ = std::make_unique<Engine>(comm, model, options, true);
    if (options.broadcast_parameters || options.broadcast_buffers) this->broadcast_buffers(0);
    engine().for_each_owned([&](std::size_t param, std::size_t offset, std::size_t n) {
      slices_.push_back({param, offset, {nullptr, n, {}, nullptr}, {nullptr, n, {}, nullptr}});
      shard_size_ += n;
    });
    std::sort(slices_.begin(), slices_.end(), [](const Slice& a, const Slice& b) {
      return a.param != b.param ? a.param < b.param : a.offset < b.offset;
    });
    for (const auto& v : engine().values()) total_size_ += v.size;
  }
  /// A model ddp cannot take, after the compile error that says why (detail::rejected_model).
  template <class Other>
    requires std::same_as<M, detail::rejected_model> ShardedAverager(Communicator<Backend>& comm,
                                                                     Other& model,
                                                                     BucketOptions options = {});

  /// This rank's shard: the ranges of parameters it updates, by parameter then offset. The
  /// views follow the model's buffers (looked up again at each step); a Model, for optimizers.
  [[nodiscard]] std::span<Slice> shard() noexcept {
    const auto &values = engine().values(), &grads = engine().grads();
    for (Slice& s : slices_) {
      const TensorView<T>&v = values[s.param], &g = grads[s.param];
      s.value = {v.data + s.offset, s.value.size, v.device, v.stream};
      s.grad = {g.data + s.offset, s.grad.size, g.device, g.stream};
    }
    return slices_;
  }
  /// Elements in this rank's shard (the padding of buckets not counted).
  [[nodiscard]] std::size_t shard_size() const noexcept { return shard_size_; }
  /// Elements in all parameters.
  [[nodiscard]] std::size_t total_size() const noexcept { return total_size_; }

  /// Every rank's shard, updated, to every rank: afterwards each rank holds every parameter.
  /// The bucket all_gathers run in the background while earlier ones are copied out. Refused
  /// unless synchronize() has run since the last gather() (the shard's gradients would not be
  /// averaged). Collective.
  void gather() {
    if (engine().started())
      fail("gather(): this step's gradients are being reduced; call synchronize() first");
    if (!engine().synced())
      fail(
          "gather(): synchronize() has not run since the last gather(), so the shard's gradients "
          "are not averaged; call synchronize() (or average()) before the update");
    engine().look_up_all();  // the parameters where they are now
    engine().gather_values();
  }

  /// Sets every gradient of the model to zero (gradients a framework has not made yet are left
  /// alone). For frameworks whose backward adds into the gradients (libtorch): after a step the
  /// shard's gradients hold averages and the rest hold what this rank sent, and an optimizer on
  /// the shard zeroes only its own; call this (TorchShard::step does) before the next backward.
  void zero_grad() { engine().zero_grads(); }

  /// This rank's shard as a ShardLayout: the arrays are the parameters (their element counts),
  /// the pieces are shard()'s slices in order. Give it to Checkpoint::put_sharded with state
  /// kept per element of the shard (an optimizer's moments, in shard() order), so that load()
  /// can cut that state again for another world size or other BucketOptions.
  [[nodiscard]] ShardLayout layout() const {
    ShardLayout out;
    for (const auto& v : engine().values()) out.sizes.push_back(v.size);
    for (const Slice& s : slices_) out.ranges.push_back({s.param, s.offset, s.value.size});
    return out;
  }

  /// Collective: saves this rank's part of a sharded checkpoint, next to the others': the
  /// parameter values of its shard (a sharded section laid out as layout()) and `state` (the
  /// optimizer's state for the shard, put with Checkpoint::put_sharded(name, values, layout());
  /// the step, ...), to shard_path(path, rank, size) through the two phases of
  /// save_sharded_checkpoint (every rank's file, or none). No rank writes the whole model.
  /// Returns the save identifier.
  std::uint64_t save(const Checkpoint& state, const std::string& path) {
    engine().look_up_all();
    return detail::save_shard(*this->comm_, state, path, shard(), layout(), engine().cuda());
  }
  /// save() with no state besides the parameters.
  std::uint64_t save(const std::string& path) { return save(Checkpoint{}, path); }
  /// The older order of save(state, path).
  [[deprecated(
      "save(state, path): what is saved first, where second, as every save of ddp")]] std::uint64_t
  save(const std::string& path, const Checkpoint& state) {
    return save(state, path);
  }

  /// Collective: loads what save() wrote, saved at this world size or any other, with these
  /// BucketOptions or others: every rank's shard of the parameters goes back in place and is
  /// gathered (every rank then holds every parameter), and the checkpoint is returned for the
  /// rest (`state`'s sections), its sharded sections over this model's parameters in layout()
  /// (other sharded sections evenly: see load_sharded_checkpoint). std::nullopt on every rank,
  /// parameters untouched, when there is none. A set saved with another model, or by
  /// save_sharded_checkpoint alone, fails on every rank with Errc::mismatch; damaged or mixed
  /// files fail as in load_sharded_checkpoint.
  [[nodiscard]] std::optional<Checkpoint> load(const std::string& path) {
    return restore(load_sharded_checkpoint(*this->comm_, path, wanted()),
                   shard_path(path, this->comm_->rank(), this->comm_->size()));
  }

  /// Collective: keeps this rank's shard (what save(state, path) writes) in `mirror`, and a
  /// copy on the rank before it, as save `tag` (the steps done, say); the two newest are kept
  /// (ShardMirror). Costs one all_to_all of a shard per step and four shards of memory. Every
  /// rank must save the same tag and the same unsharded sections of `state` (Errc::mismatch).
  void save(const Checkpoint& state, ShardMirror& mirror, std::uint64_t tag) {
    engine().look_up_all();
    detail::save_shard_to_mirror(*this->comm_, mirror, tag, state, shard(), layout(),
                                 engine().cuda());
  }
  /// save() into `mirror` with no state besides the parameters.
  void save(ShardMirror& mirror, std::uint64_t tag) { save(Checkpoint{}, mirror, tag); }
  /// The older order of save(state, mirror, tag).
  [[deprecated(
      "save(state, mirror, tag): what is saved first, where second, as every save of ddp")]] void
  save(ShardMirror& mirror, std::uint64_t tag, const Checkpoint& state) {
    save(state, mirror, tag);
  }

  /// Collective, after a membership change (an averager made again over the survivors): loads
  /// the newest save in `mirror` (with tag `tag`, when given) of which the ranks hold every old
  /// rank's shard, as load(path) loads a sharded checkpoint (cut again for this world size), and
  /// mirrors it again over this world before returning (every shard on two ranks again).
  /// std::nullopt when no rank holds any save; Errc::mismatch when no rank holds `tag` (naming
  /// the tags held), or when a shard was lost with both of the ranks holding it.
  [[nodiscard]] std::optional<Checkpoint> load(ShardMirror& mirror,
                                               std::optional<std::uint64_t> tag = std::nullopt) {
    return restore(detail::MirrorAccess::load(*this->comm_, mirror, tag, wanted()),
                   detail::concat("the in-memory copy of rank ", this->comm_->rank(), "'s shard"));
  }

  /// One optimizer step: average(), then `update(shard())` (the optimizer, on this rank's shard
  /// only), then gather(). Ignored inside no_sync().
  template <class F>
  void step(F&& update) {
    if (this->impl_->in_no_sync()) return;
    this->average();
    std::forward<F>(update)(shard());
    gather();
  }

  /// The 2-norm of the whole averaged gradient (after synchronize()), from every rank's shard:
  /// the same value on every rank, for gradient clipping (scale the shard's gradients by
  /// max_norm / norm before the update). Collective.
  [[nodiscard]] double grad_norm() {
    return detail::gradient_norm<T>(
        [&](auto&& f) { engine().for_each_result(f); },
        [&](std::vector<double>& v, bool max) {
          this->comm_->all_reduce_host(std::span<double>(v), max ? ReduceOp::max : ReduceOp::sum);
        });
  }

 private:
  Engine& engine() { return static_cast<Engine&>(*this->impl_); }
  const Engine& engine() const { return static_cast<const Engine&>(*this->impl_); }

  /// The layout load() asks for: this averager's for its parameters (a checkpoint of another
  /// model refused), even for other sharded sections.
  [[nodiscard]] ShardLayoutFor wanted() const {
    return detail::wanted_layout(layout(), this->comm_->rank(), this->comm_->size(),
                                 "ShardedAverager");
  }
  /// The shard of `ck` (named `where` in errors) back in place, gathered.
  std::optional<Checkpoint> restore(std::optional<Checkpoint> ck, const std::string& where) {
    if (!ck) return std::nullopt;
    engine().look_up_all();
    detail::restore_shard(*this->comm_, *ck, where, shard(), layout(), engine().cuda());
    engine().gather_values();
    return ck;
  }

  template <class... A>
  [[noreturn]] void fail(const A&... a) const {
    detail::fail(Errc::invalid_argument, "rank ", this->comm_->rank(), ": ShardedAverager: ", a...);
  }

  std::vector<Slice> slices_;
  std::size_t shard_size_ = 0, total_size_ = 0;
};

/// `ShardedAverager zero(comm, model)` deduces the model type and the backend.
template <class Backend, class M>
ShardedAverager(Communicator<Backend>&, M&, BucketOptions = {})
    -> ShardedAverager<detail::model_t<M>, Backend>;

DDP_END_NAMESPACE
