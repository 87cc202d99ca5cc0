// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::FullyShard<M, Backend>: a model's own parameters fully sharded (ZeRO-3, as FSDP2's
/// `fully_shard`), for a model of any parameter type, over a FullyShardedAverager.
///
/// The program lists its parameters by unit (indices into the model's parameters; every
/// parameter in one unit). Each rank then keeps 1/P of every unit; the parameters themselves
/// point at nothing (empty values and gradients) except while their unit runs:
///
///     ddp::FullyShard fsdp(comm, net, {{0, 1}, {2, 3}, {4, 5}});   // three layers' (w, b)
///     for (...) {
///       for (u = 0; u < 3; ++u) fsdp.forward(u, [&] { layer_forward(u, net); });
///       for (u = 3; u-- > 0;) fsdp.backward(u, [&] { layer_backward(u, net); });  // += grads
///       fsdp.step([&](auto shard) { opt.step(shard); });  // the optimizer on the shard
///     }
///
/// forward(u, fn) gathers unit u (prefetched while the unit before it ran), points its
/// parameters' values at it, starts gathering the unit after it (the last step's forward order),
/// runs fn() and releases the unit (Options::reshard_after_forward = false keeps it for the
/// backward). backward(u, fn) gathers it again (prefetching the unit before it), points the
/// values and the gradients (zeros, for fn to add into) at the unit's buffers, runs fn(),
/// releases the unit and reduce-scatters its gradients into the shard in the background, while
/// the program goes on with the units before it. step(update) waits for the reduces (a unit
/// whose backward did not run this step is reduced with zero gradients), runs update(shard())
/// (ShardSlice: the same optimizers as ShardedAverager's shard) and starts gathering the first
/// unit of the next forward. On backend::Host the averages are GradientAverager's bitwise, so
/// with the same elementwise optimizer a run is bitwise a GradientAverager run.
///
/// Mixed precision (MixedPrecisionPolicy): FullyShard<M, Backend, bfloat16, float> over a model
/// of bfloat16 parameters keeps float masters in the shard for the optimizer, gathers the
/// parameters in bfloat16 and averages the bfloat16 gradients (FullyShardedAverager<Backend,
/// float, bfloat16, bfloat16>).
///
/// Re-pointing a parameter: parameter_traits<P>::point(P& p, std::span<T> value, std::span<T>
/// grad) makes p's value and gradient views of those elements (empty spans: of nothing), for a
/// tensor type of one's own; a parameter whose value and grad are std::span<T> or
/// ddp::TensorView<T> members (or references to them) needs none.
///
/// The shard starts as rank 0's parameter values (the model is read once, then its parameters
/// are pointed at nothing: free their memory), or, made with an initializer, from values made
/// for this rank's pieces only, so that no rank ever holds the whole model (the parameters'
/// sizes are read, not their values). Every rank must list the same units (Errc::mismatch) and
/// run the same units' forwards and backwards in the same order (the gathers and reduces are
/// collectives; checked at each step, Options::check_order: Errc::mismatch before the update).
/// Errc::invalid_argument for a parameter listed twice or in no unit, a unit run twice in one
/// step's backward, and a parameter pointed elsewhere (given elements) while its unit was released.
/// A parameter read outside forward() / backward() of its unit has no elements. An exception from a
/// backward's fn leaves its unit's gradients partly added: this object then refuses every call
/// until reset(comm) (after shrink(), say; then load the shard).
///
/// After a change of membership (ddp::Elastic's on_reset), reset(comm) shards the same units over
/// the new world and the shard is loaded from a ShardMirror saved each step (averager().save(
/// mirror, tag, state) before the commit; averager().load(mirror, tag)) or from a checkpoint.

#include "ddp/communicator.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/averaging/parameters.hpp"
#include "ddp/training/fully_sharded/fully_sharded.hpp"
#include "ddp/training/fully_sharded/unit_memory.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {

/// The unit after u in `order` (a step's forward order): `none` when u comes last or not at all;
/// u + 1 while no order is known yet (the first step).
inline std::size_t unit_after(const std::vector<std::size_t>& order, std::size_t u,
                              std::size_t none) {
  for (std::size_t k = 0; k + 1 < order.size(); ++k)
    if (order[k] == u) return order[k + 1];
  return order.empty() ? u + 1 : none;
}

/// The unit before the last u in `order` (the next one a backward reaches), or `none`.
inline std::size_t unit_before(const std::vector<std::size_t>& order, std::size_t u,
                               std::size_t none) {
  for (std::size_t k = order.size(); k-- > 1;)
    if (order[k] == u) return order[k - 1];
  return none;
}

/// P's value and gradient can be pointed at a unit's elements: parameter_traits<P>::point, or
/// members assignable from std::span<T> or TensorView<T>.
template <class P, class T>
concept pointable_parameter = requires(P& p, std::span<T> s) {
  parameter_traits<P>::point(p, s, s);
}
|| ((std::is_assignable_v<value_of_t<P>, std::span<T>> ||
     std::is_assignable_v<value_of_t<P>,
                          TensorView<T>>)&&(std::is_assignable_v<grad_of_t<P>, std::span<T>> ||
                                            std::is_assignable_v<grad_of_t<P>, TensorView<T>>));

template <class X, class T>
void point_to(X&& x, std::span<T> s, const Place& at) {
  if constexpr (std::is_assignable_v<X&&, std::span<T>>)
    std::forward<X>(x) = s;
  else
    std::forward<X>(x) = TensorView<T>{s.data(), s.size(), at.device, at.stream};
}

/// Points p's value and gradient at `value` and `grad` (empty: at nothing), memory at `at`.
template <class T, class P>
void point_parameter(P& p, std::span<T> value, std::span<T> grad, const Place& at) {
  if constexpr (requires { parameter_traits<P>::point(p, value, grad); }) {
    parameter_traits<P>::point(p, value, grad);
  } else {
    point_to(param_value(p), value, at);
    point_to(param_grad(p), grad, at);
  }
}

}  // namespace detail

/// FullyShard's options.
struct FullyShardOptions {
  /// Release a unit after its forward (gathered again for its backward), as FSDP2's
  /// reshard_after_forward; false keeps it gathered until its backward is done.
  bool reshard_after_forward = true;
  /// Gather the next unit in the background while one computes (forward and backward order).
  bool prefetch = true;
  /// Check at each step, in one all_reduce of 16 bytes, that every rank ran the same units'
  /// forwards and backwards in the same order (units of one size run in different orders would
  /// otherwise mix their values up silently): Errc::mismatch before the update.
  bool check_order = true;
  /// Where units are gathered and the shard kept (a CUDA device, the shard offloaded to the
  /// host): the engine's options (its check_order is the one above). Parameters' values and
  /// gradients are then device memory.
  FullyShardedOptions memory{};
};

/// A model's parameters fully sharded over a FullyShardedAverager (see the file comment). T: the
/// element type of the model's parameters (their values and gradients, gathered and reduced in
/// it); Master: of the shard the optimizer updates (float masters for a bfloat16 model, as
/// MixedPrecisionPolicy's).
template <Model M, class Backend, class T = typename detail::model_element<M>::type,
          class Master = T>
class FullyShard {
 public:
  /// The model's parameter type.
  using Param = detail::param_of_t<M>;
  /// The engine underneath.
  using Averager = FullyShardedAverager<Backend, Master, T, T>;
  /// The options.
  using Options = FullyShardOptions;
  /// Fills `values` with the initial values of elements [offset, offset + values.size()) of the
  /// model's parameter `param`: called for this rank's pieces only.
  using Init = std::function<void(std::size_t param, std::size_t offset, std::span<Master> values)>;

  static_assert(detail::pointable_parameter<Param, T>,
                "ddp::FullyShard points a unit's parameters at its gathered elements: specialize "
                "ddp::parameter_traits<P>::point(P&, std::span<T> value, std::span<T> grad) for "
                "the parameter type, or give it value and grad members that are std::span<T> or "
                "ddp::TensorView<T>");

  /// Collective: shards `model`'s parameters by `units` (indices into its parameters) from rank
  /// 0's values, then points every parameter at nothing. Errc::invalid_argument for a parameter
  /// in no unit or in two, a unit without elements; Errc::mismatch when the ranks' units differ.
  FullyShard(Communicator<Backend>& comm, M& model, std::vector<std::vector<std::size_t>> units,
             Options o = {})
      : FullyShard(comm, model, std::move(units), Init(), o) {}

  /// Collective: as above, the shard made by `init` for this rank's pieces only (the
  /// parameters' values are not read: they may point at nothing already, with their sizes; an
  /// empty `init`: rank 0's values).
  FullyShard(Communicator<Backend>& comm, M& model, std::vector<std::vector<std::size_t>> units,
             const Init& init, Options o = {})
      : comm_(&comm), opt_(o) {
    opt_.memory.check_order = o.check_order;  // the engine checks the step's order
    static_assert(std::is_lvalue_reference_v<decltype(detail::model_parameters(model))>,
                  "ddp::FullyShard re-points the model's own parameters: its parameters() must "
                  "return a reference to them, not a copy");
    for (auto& p : detail::model_parameters(model)) params_.push_back(&p);
    agree(units);
    std::vector<int> owner(params_.size(), -1);
    std::vector<std::vector<std::size_t>> sizes;
    for (std::size_t u = 0; u < units.size(); ++u) {
      Unit un;
      sizes.emplace_back();
      for (const std::size_t i : units[u]) {
        if (i >= params_.size())
          detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": FullyShard: unit ", u,
                       " lists parameter ", i, " of a model of ", params_.size());
        if (owner[i] >= 0)
          detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": FullyShard: parameter ", i,
                       " is in unit ", owner[i], " and in unit ", u, ": list each parameter once");
        owner[i] = static_cast<int>(u);
        un.params.push_back(i);
        un.offsets.push_back(un.elements);
        const std::size_t n = value(i).size;
        un.sizes.push_back(n);
        if ((un.elements += n) < n)
          detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": FullyShard: unit ", u,
                       " has more elements than memory can address");
        sizes.back().push_back(n);
      }
      if (un.elements == 0)
        detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": FullyShard: unit ", u,
                     " has no elements (list parameters with elements in it; when a FullyShard "
                     "made over this model before points its parameters at nothing, keep that "
                     "one, and reset(comm) it after a change of membership)");
      units_.push_back(std::move(un));
    }
    for (std::size_t i = 0; i < owner.size(); ++i)
      if (owner[i] < 0)
        detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": FullyShard: parameter ", i,
                     " is in no unit: list every parameter of the model in one unit");
    typename Averager::Init each;
    if (init)
      each = [&](std::size_t u, std::size_t i, std::size_t offset, std::span<Master> values) {
        init(units_[u].params[i], offset, values);
      };
    fsdp_ = std::make_unique<Averager>(comm, std::move(sizes), each, opt_.memory);
    at_ = {fsdp_->device(), fsdp_->stream()};
    if (!init)
      fsdp_->scatter_from(0, [&](std::size_t u, std::size_t i, std::span<Master> out) {
        const TensorView<T> v = value(units_[u].params[i]);
        std::vector<T> staged(v.device.is_cuda() ? v.size : 0);  // a device parameter's values
        const T* from = v.data;
        if (!staged.empty()) {
          detail::copy_bytes(staged.data(), v.data, v.bytes(), true, v.stream);
          detail::sync_stream(true, v.stream);
          from = staged.data();
        }
        detail::convert_values(std::span<const T>(from, v.size), out);
      });
    for (Unit& un : units_) point(un, {}, {});
  }

  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;
  /// The parameters are left pointing at nothing (none at freed memory).
  ~FullyShard() {
    for (Unit& un : units_) point(un, {}, {});
  }

  /// Runs unit `u`'s forward, fn(), with its parameters' values gathered (their gradients
  /// empty); returns what fn returns.
  template <class F>
  decltype(auto) forward(std::size_t u, F&& fn) {
    Unit& un = at(u, "forward");
    gather(u, false);
    if (!un.forwarded) {
      un.forwarded = true;
      order_.push_back(u);
    }
    synced_ = false;
    ran_ = true;
    if (opt_.prefetch) {
      const std::size_t next = detail::unit_after(last_order_, u, units_.size());
      if (next < units_.size() && !units_[next].forwarded) fsdp_->prefetch(next);
    }
    return run(u, std::forward<F>(fn), [&] {
      if (opt_.reshard_after_forward) release(u);
    });
  }

  /// Runs unit `u`'s backward, fn(), with its parameters' values gathered and their gradients
  /// pointed at zeros for fn to add into; then reduces them into the shard in the background.
  /// Once per unit and step (Errc::invalid_argument otherwise).
  template <class F>
  void backward(std::size_t u, F&& fn) {
    Unit& un = at(u, "backward");
    if (un.backwarded)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": FullyShard: unit ", u,
                   "'s backward runs again before step(): its gradients were reduced into the "
                   "shard already; call step() (or synchronize()) after each backward");
    gather(u, true);
    un.backwarded = true;
    synced_ = false;
    ran_ = true;
    if (opt_.prefetch) {
      const std::size_t before = detail::unit_before(order_, u, units_.size());
      if (before < units_.size() && !units_[before].backwarded) fsdp_->prefetch(before);
    }
    try {
      std::forward<F>(fn)();
    } catch (...) {
      broken_ = true;  // its gradients are partly added: no reduce can make them right
      release(u);
      throw;
    }
    release(u);
    fsdp_->reduce(u);
  }

  /// Waits for the units' reduces; a unit whose backward did not run this step is reduced here
  /// (in reverse order, zeros): the shard's gradients then hold the averages of every unit.
  void synchronize() {
    check();
    if (synced_) return;
    for (std::size_t k = units_.size(); k-- > 0;) {
      if (units_[k].backwarded) continue;
      (void)fsdp_->grad(k);
      fsdp_->reduce(k);
    }
    std::exception_ptr failed;  // the order check's: the step ends all the same
    try {
      fsdp_->synchronize();
    } catch (...) {
      failed = std::current_exception();
    }
    for (std::size_t k = 0; k < units_.size(); ++k) {
      release(k);
      fsdp_->release(k);  // prefetched but not run this step (stale after the update)
      units_[k].forwarded = units_[k].backwarded = false;
    }
    if (!order_.empty()) last_order_ = order_;
    order_.clear();
    if (failed) std::rethrow_exception(failed);
    synced_ = true;
  }

  /// One step after the backward: synchronize(), then update(shard()) (the optimizer on the
  /// shard's averaged gradients). Errc::invalid_argument when no forward or backward ran since
  /// the last step() (or since the FullyShard was made or reset), a failed step() included (its
  /// order check or its update threw): the update would apply the same averages again, or zeros.
  template <class F>
  void step(F&& update) {
    if (!ran_)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": FullyShard::step: no forward or backward ran since the last step() (or "
                   "since the FullyShard was made or reset; a step() that failed counts: its "
                   "averages are not applied again); one step() per backward");
    ran_ = false;  // a step that fails (its check, its update) is not applied again on these
    synchronize();
    std::forward<F>(update)(fsdp_->shard());
  }

  /// Collective over `comm`, after a change of membership (Communicator::shrink, grow; in
  /// ddp::Elastic's on_reset): the same units sharded over the new world, the shard zeros until
  /// the caller loads it (averager().load(mirror, tag), or load(path)). What was in flight on
  /// the old communicator is dropped, and a failed backward forgotten.
  void reset(Communicator<Backend>& comm) {
    for (Unit& un : units_) {
      point(un, {}, {});
      un.forwarded = un.backwarded = false;
    }
    std::vector<std::vector<std::size_t>> sizes;
    for (const Unit& un : units_) sizes.push_back(un.sizes);
    fsdp_.reset();
    comm_ = &comm;
    fsdp_ =
        std::make_unique<Averager>(comm, std::move(sizes), typename Averager::Init(), opt_.memory);
    at_ = {fsdp_->device(), fsdp_->stream()};
    order_.clear();
    last_order_.clear();
    synced_ = ran_ = broken_ = false;
  }

  /// This rank's shard (FullyShardedAverager::shard()).
  [[nodiscard]] std::vector<ShardSlice<Master>> shard() { return fsdp_->shard(); }
  /// The FullyShardedAverager underneath, between steps: save/load (sharded checkpoints at any
  /// world size, mirrors), gather_to, trim, layout().
  [[nodiscard]] Averager& averager() const noexcept { return *fsdp_; }
  /// The number of units.
  [[nodiscard]] std::size_t units() const noexcept { return units_.size(); }
  /// Unit `u`'s parameters (indices into the model's parameters).
  [[nodiscard]] const std::vector<std::size_t>& unit_parameters(std::size_t u) const {
    if (u >= units_.size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": FullyShard::unit_parameters: unit ", u, " of ", units_.size());
    return units_[u].params;
  }

 private:
  struct Unit {
    std::vector<std::size_t> params, offsets, sizes;  // model indices; where in the unit; sizes
    std::size_t elements = 0;
    bool gathered = false, with_grads = false, forwarded = false, backwarded = false;
  };

  TensorView<T> value(std::size_t i) {
    return detail::typed_view<T>(detail::param_value(*params_[i]), comm_->rank(), i, "value",
                                 "FullyShard");
  }

  /// Points unit `un`'s parameters at their parts of `values` and `grads` (empty: at nothing).
  void point(Unit& un, std::span<T> values, std::span<T> grads) {
    for (std::size_t j = 0; j < un.params.size(); ++j) {
      const auto part = [&](std::span<T> all) {
        return all.empty() ? std::span<T>() : all.subspan(un.offsets[j], un.sizes[j]);
      };
      detail::point_parameter<T>(*params_[un.params[j]], part(values), part(grads), at_);
    }
    un.gathered = !values.empty();
    un.with_grads = !grads.empty();
  }

  /// Unit u gathered, its parameters pointing at it (and at zeroed gradients for a backward).
  void gather(std::size_t u, bool grads) {
    check();
    Unit& un = units_[u];
    if (un.gathered && (un.with_grads || !grads)) return;
    if (!un.gathered)
      for (const std::size_t i : un.params)
        if (const std::size_t n = value(i).size; n != 0)
          detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": FullyShard: parameter ",
                       i, " of unit ", u, " was given ", n,
                       " elements while the unit was released: a fully sharded parameter points "
                       "where FullyShard points it (a changed model needs a new FullyShard, over "
                       "parameters with their memory)");
    const std::span<T> values = fsdp_->gather(u);
    point(un, values, grads ? fsdp_->grad(u) : std::span<T>());
  }

  void release(std::size_t u) {
    Unit& un = units_[u];
    if (!un.gathered) return;
    point(un, {}, {});
    fsdp_->release(u);
  }

  /// fn(), then `after()`; an exception from fn releases unit u first.
  template <class F, class A>
  decltype(auto) run(std::size_t u, F&& fn, A&& after) {
    using R = decltype(std::forward<F>(fn)());
    static_assert(!std::is_reference_v<R>, "FullyShard::forward: fn returns by value");
    try {
      if constexpr (std::is_void_v<R>) {
        std::forward<F>(fn)();
        after();
      } else {
        R out = std::forward<F>(fn)();
        after();
        return out;
      }
    } catch (...) {
      release(u);
      throw;
    }
  }

  /// Every rank lists the same parameters in the same units (sizes alone would let two ranks
  /// swap parameters of one size), else Errc::mismatch on every rank.
  void agree(const std::vector<std::vector<std::size_t>>& units) {
    std::vector<std::uint64_t> mine{units.size()};
    for (const auto& un : units) {
      mine.push_back(un.size());
      mine.insert(mine.end(), un.begin(), un.end());
    }
    const auto all = comm_->all_gather_object(mine);
    for (std::size_t j = 1; j < all.size(); ++j)
      if (all[j] != all[0])
        detail::fail(Errc::mismatch, "rank ", comm_->rank(), ": FullyShard: rank ", j,
                     " lists other units or parameters than rank 0: every rank must list the same "
                     "parameter indices in the same units");
  }

  void check() const {
    if (broken_)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": FullyShard: a backward failed inside its fn, leaving its unit's gradients "
                   "partly added: reset(comm) it (after shrink(), say) and load its shard from a "
                   "mirror or a checkpoint");
  }

  Unit& at(std::size_t u, const char* what) {
    if (u >= units_.size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": FullyShard::", what,
                   ": unit ", u, " of ", units_.size());
    return units_[u];
  }

  Communicator<Backend>* comm_;
  Options opt_;
  detail::Place at_;  // where units are gathered
  std::vector<Param*> params_;
  std::vector<Unit> units_;
  std::unique_ptr<Averager> fsdp_;
  std::vector<std::size_t> order_, last_order_;  // units in forward order: this step's, the last
  bool synced_ = false;                          // synchronize() done, no forward since
  bool ran_ = false;     // a forward or backward since the last step() (or construction, reset)
  bool broken_ = false;  // a backward's fn threw
};

/// Deduces the model and the backend: FullyShard fsdp(comm, model, units).
template <class Backend, class M>
FullyShard(Communicator<Backend>&, M&, std::vector<std::vector<std::size_t>>,
           FullyShardOptions = {}) -> FullyShard<detail::model_t<M>, Backend>;
/// Deduces the model and the backend: FullyShard fsdp(comm, model, units, init).
template <class Backend, class M, class I>
FullyShard(Communicator<Backend>&, M&, std::vector<std::vector<std::size_t>>, I,
           FullyShardOptions = {}) -> FullyShard<detail::model_t<M>, Backend>;

DDP_END_NAMESPACE
