// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// FullyShardedAverager<Backend, T>: fully sharded parameters (ZeRO-3), the units' engine.
///
/// The program's parameters are grouped into units (a layer, a block). Each unit's parameters,
/// end to end, form one flat array padded with zeros to a multiple of P; rank r keeps block r of
/// it (its values, their gradients, and whatever an optimizer keeps for them), so no rank holds a
/// whole unit except while it is gathered:
///
///     ddp::FullyShardedAverager fsdp(comm, {{4096 * 4096, 4096}, {4096 * 10, 10}},
///                                    [](std::size_t unit, std::size_t param, std::size_t offset,
///                                       std::span<float> values) { /* initialize them */ });
///     for (...) {
///       fsdp.prefetch(0);
///       for (u in forward order) {
///         std::span<float> w = fsdp.gather(u);   // the unit's parameters, end to end
///         if (u + 1 < units) fsdp.prefetch(u + 1); // while this unit computes
///         forward(u, w);
///         fsdp.release(u);                        // (or keep it for the backward)
///       }
///       for (u in backward order) {
///         std::span<float> w = fsdp.gather(u);
///         backward(u, w, fsdp.grad(u));            // adds into the unit's gradients
///         fsdp.release(u);
///         fsdp.reduce(u);                         // averaged into the shard in the background
///       }
///       fsdp.synchronize();                       // the shard's gradients hold the averages
///       opt.step(fsdp.shard());                   // the optimizer on the shard (ShardSlice)
///     }
///
/// The averages are every rank's gradients reduced with ReduceOp::avg, as GradientAverager's: on
/// backend::Host (every element reduced in rank order on every path) they are bitwise its
/// averages, so a run is bitwise a GradientAverager run. The shard is ShardedAverager's kind
/// (ShardSlice over (parameter, offset, size), layout() for Checkpoint::put_sharded), so
/// optimizers written for a model or a ShardedAverager's shard run on it unchanged.
///
/// Mixed precision (MixedPrecisionPolicy): FullyShardedAverager<Backend, float, bfloat16, float>
/// keeps float masters in the shard, gathers the parameters converted to bfloat16, and takes the
/// backward's gradients in float (the third type: the reduce's), converted into the shard.
///
/// Uneven inputs: a Joinable (ddp::Join) once on_join_step(update) says how a rank updates its
/// shard; a rank whose inputs are done answers the others' steps and keeps its shard current.
///
/// Memory (FullyShardedOptions): units gathered and the shard kept on the host, or on a CUDA
/// device (backend::Nccl's default: the communicator's device; backend::Host stages through
/// pinned memory), or units on the device and the shard on the host (`offload`, as FSDP2's
/// CPUOffloadPolicy). gather() and grad() then return device memory, shard() device views (the
/// optimizer runs where the shard is); init, gather_to and scatter_from stay host memory,
/// copied through. Mixed precision on a device converts this rank's block through the host.
///
/// save(state, path) / load(path) are ShardedAverager's sharded checkpoints (a set loads at any
/// world size), save(mirror, tag) / load(mirror) its in-memory copies for recovery;
/// gather_to(root, fn) hands `root` the whole model a unit at a time, for export.
///
/// A unit is gathered at most once at a time: gather() waits for a prefetch() of it, and
/// gathering a gathered unit (kept from the forward for the backward) returns the same values.
/// A unit out of range, reduce() without grad() and a second reduce() before the next grad()
/// fail with Errc::invalid_argument naming the unit. Every rank must make the same units
/// (Errc::mismatch at construction, naming the first unit that differs). A rank lost during a
/// gather or a reduce fails the others' calls that wait for it with Errc::peer_lost; the shard's
/// values, written only by the optimizer, stay as they were (save them to a ShardMirror each
/// step, and the survivors go on from there without the lost rank's shard: load(mirror)).

#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/communicator.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/averaging/join.hpp"
#include "ddp/training/fully_sharded/unit_memory.hpp"
#include "ddp/training/zero/shard_mirror.hpp"
#include "ddp/training/zero/sharded.hpp"
#include "ddp/training/zero/sharded_checkpoint.hpp"
#include "ddp/work.hpp"

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Fully sharded parameters (see the file comment). T: the element type of the shard (the
/// optimizer's, "master" values); ParamT: of the gathered parameters (bfloat16 to gather and
/// compute in it, as MixedPrecisionPolicy's param_dtype); ReduceT: of the gradients the backward
/// writes and the reduce averages in (reduce_dtype), converted to T in the shard.
template <class Backend, class T = float, class ParamT = T, class ReduceT = ParamT>
class FullyShardedAverager : public Joinable {
 public:
  /// A unit: its parameters' element counts, in the order the program lays them end to end.
  using Unit = std::vector<std::size_t>;
  /// The shard's element type.
  using value_type = T;
  /// Fills `values` with the initial values of elements [offset, offset + values.size()) of
  /// parameter `param` (its index in unit `unit`): called for this rank's pieces only.
  using Init = std::function<void(std::size_t unit, std::size_t param, std::size_t offset,
                                  std::span<T> values)>;

  /// Collective: makes this rank's shard of `units`, its values from `init` (given host memory
  /// to fill, copied to the device where the shard lives there), its memory where `o` says.
  /// Errc::mismatch on every rank when the ranks' units differ; Errc::invalid_argument for a
  /// unit without elements; Errc::unsupported for a device the backend cannot move.
  FullyShardedAverager(Communicator<Backend>& comm, std::vector<Unit> units, const Init& init,
                       const FullyShardedOptions& o = {})
      : comm_(&comm) {
    place(o);
    const auto p = static_cast<std::size_t>(comm.size()), r = static_cast<std::size_t>(comm.rank());
    std::vector<std::uint64_t> shape{units.size(), o.check_order ? 1u : 0u};
    for (std::size_t u = 0; u < units.size(); ++u) {
      Block b;
      b.sizes = std::move(units[u]);
      std::size_t n = 0;
      for (const std::size_t s : b.sizes)
        if ((n += s) < s || n > std::numeric_limits<std::size_t>::max() / 16)
          detail::fail(Errc::invalid_argument, "rank ", comm.rank(),
                       ": FullyShardedAverager: unit ", u,
                       " has more elements than memory can address");
      if (n == 0)
        detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": FullyShardedAverager: unit ",
                     u, " has no elements");
      b.elements = n;
      b.block = (n + p - 1) / p;
      b.value = detail::UnitArray<T>(b.block, shard_at_, comm.rank(), "a shard's values");
      b.grad = detail::UnitArray<T>(b.block, shard_at_, comm.rank(), "a shard's gradients");
      std::vector<T> staged(init && shard_at_.cuda() ? b.block : 0);  // init's, for the device
      T* const fill = shard_at_.cuda() ? staged.data() : b.value.data();
      // This rank's pieces: parameter by parameter, the part of [r*block, (r+1)*block) it covers.
      std::size_t first = 0;
      for (std::size_t i = 0; i < b.sizes.size(); ++i) {
        const std::size_t lo = std::max(first, r * b.block),
                          hi = std::min(first + b.sizes[i], (r + 1) * b.block);
        if (lo < hi) {
          const std::size_t at = lo - r * b.block;
          b.pieces.push_back({i, lo - first, at, hi - lo});
          if (init) init(u, i, lo - first, std::span<T>(fill + at, hi - lo));
        }
        first += b.sizes[i];
      }
      if (!staged.empty()) b.value.from_host(0, staged);
      shape.push_back(b.sizes.size());
      shape.insert(shape.end(), b.sizes.begin(), b.sizes.end());
      blocks_.push_back(std::move(b));
    }
    agree(shape);
  }

  FullyShardedAverager(const FullyShardedAverager&) = delete;
  FullyShardedAverager& operator=(const FullyShardedAverager&) = delete;
  /// Waits for what is in flight (its errors are dropped: the destructor cannot throw).
  ~FullyShardedAverager() {
    for (Block& b : blocks_) {
      for (Work* w : {&b.gathering, &b.reducing}) {
        try {
          w->wait();
        } catch (...) {  // leaving anyway
        }
      }
    }
  }

  /// The number of units.
  [[nodiscard]] std::size_t units() const noexcept { return blocks_.size(); }
  /// The communicator.
  [[nodiscard]] Communicator<Backend>& comm() const noexcept { return *comm_; }
  /// Where units are gathered (FullyShardedOptions::device, or its default).
  [[nodiscard]] Device device() const noexcept { return units_at_.device; }
  /// The program's CUDA stream (FullyShardedOptions::stream).
  [[nodiscard]] void* stream() const noexcept { return streams_.compute(); }

  /// Starts gathering unit `u` in the background (no-op when it is gathered or on its way).
  void prefetch(std::size_t u) {
    Block& b = at(u, "prefetch");
    if (!b.full.empty()) return;
    if (join_) trace_.push_back({u, false});
    order_.note(u, false);
    streams_.own_after_compute();  // the optimizer's writes, the last reads of a kept buffer
    b.full = params_.take(b.block * static_cast<std::size_t>(comm_->size()), units_at_,
                          comm_->rank(), "a gathered unit", false);
    if constexpr (std::is_same_v<ParamT, T>) {
      if (!offloaded()) {
        b.gathering = comm_->all_gather_async(b.value.view(), b.full.view());
        return;
      }
    }
    // This rank's block converted (or copied in from the host) into its place, gathered around it.
    const std::size_t at = static_cast<std::size_t>(comm_->rank()) * b.block;
    const std::span<const T> mine = b.value.on_host(staged_);
    if (!units_at_.cuda()) {
      detail::convert_values(mine, std::span<ParamT>(b.full.data() + at, b.block));
    } else if constexpr (std::is_same_v<ParamT, T>) {
      b.full.from_host(at, mine);
    } else {
      std::vector<ParamT> converted(b.block);
      detail::convert_values(mine, std::span<ParamT>(converted));
      b.full.from_host(at, converted);
    }
    b.gathering = comm_->all_gather_async(b.full.view(at, b.block), b.full.view());
  }

  /// Unit `u`'s parameters end to end (its element count: the padding is left out), gathered
  /// from every rank's block (waiting for a prefetch() of it), in device memory when units are
  /// gathered on a CUDA device. Valid until release(u).
  [[nodiscard]] std::span<ParamT> gather(std::size_t u) {
    Block& b = at(u, "gather");
    prefetch(u);
    order_.named(comm_->rank(), u, false, [&] { b.gathering.wait(); });
    b.gathering = Work();
    return std::span<ParamT>(b.full.data(), b.elements);
  }

  /// Frees unit `u`'s gathered parameters (the shard stays). Waits for a prefetch still on
  /// its way.
  void release(std::size_t u) {
    Block& b = at(u, "release");
    order_.named(comm_->rank(), u, false, [&] { b.gathering.wait(); });
    b.gathering = Work();
    params_.give(b.full);
  }

  /// Unit `u`'s gradients end to end, for the backward to add into: zeros when first asked for
  /// after the unit's last reduce() (a reduce still on its way is waited for). Valid until
  /// reduce(u).
  [[nodiscard]] std::span<ReduceT> grad(std::size_t u) {
    Block& b = at(u, "grad");
    finish(b);
    if (b.full_grad.empty())
      b.full_grad = grads_.take(b.block * static_cast<std::size_t>(comm_->size()), units_at_,
                                comm_->rank(), "a unit's gradients", true);
    streams_.compute_after_own();  // zeroed before the backward adds into them
    return std::span<ReduceT>(b.full_grad.data(), b.elements);
  }

  /// Starts averaging unit `u`'s gradients over the ranks into this rank's shard (a
  /// reduce_scatter, in the background); the unit's full gradients are freed when it is done:
  /// the reduces issued before are waited for here (by now they have usually finished, as this
  /// unit's backward ran meanwhile), so that one unit's full gradients are in flight at a time.
  void reduce(std::size_t u) {
    Block& b = at(u, "reduce");
    if (b.full_grad.empty())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": FullyShardedAverager: unit ",
                   u, " is reduced without gradients: call grad(", u, ") in its backward first");
    if (b.reduced)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": FullyShardedAverager: unit ",
                   u, " is reduced twice without a backward between: call grad(", u,
                   ") for its next backward");
    for (Block& other : blocks_) finish(other);
    // In a Join: summed, then divided by the ranks that trained the step (finish()).
    const ReduceOp op = join_ ? ReduceOp::sum : ReduceOp::avg;
    b.divide_by = join_ ? active_ : 0;
    if (join_) trace_.push_back({u, true});
    order_.note(u, true);
    streams_.own_after_compute();  // the backward's gradients written
    if constexpr (std::is_same_v<ReduceT, T>) {
      if (!offloaded()) {  // straight into the shard
        b.reducing = comm_->reduce_scatter_async(b.full_grad.view(), b.grad.view(), op);
        b.reduced = b.stepped = true;
        return;
      }
    }
    // Averaged in ReduceT where the unit is, taken into the shard by finish().
    b.reduced_block =
        detail::UnitArray<ReduceT>(b.block, units_at_, comm_->rank(), "a reduced block");
    b.reducing = comm_->reduce_scatter_async(b.full_grad.view(), b.reduced_block.view(), op);
    b.reduced = b.stepped = true;
  }

  /// Returns the buffers of released units and reduced gradients that are kept for the next
  /// ones (at most two of each: the peak is the same with them) to the system, e.g. before a
  /// phase that needs the memory for something else.
  void trim() noexcept {
    params_.clear();
    grads_.clear();
  }

  /// Collective, once per step on every rank: reduces the units whose grad() was taken but not
  /// reduced this step (last unit first), waits for every reduce (the shard's gradients then
  /// hold the averages), releases every gathered unit (the optimizer changes the shard next, so
  /// a unit gathered across it would be stale) and checks that the ranks issued the same
  /// gathers and reduces in the same order (FullyShardedOptions::check_order; Errc::mismatch,
  /// the averages not to be used). grad(u) after reduce(u) is the next backward's zeros, not
  /// the averages (those are in shard()).
  void synchronize() {
    for (std::size_t u = blocks_.size(); u-- > 0;)
      if (!blocks_[u].full_grad.empty() && !blocks_[u].reduced && !blocks_[u].stepped) reduce(u);
    for (std::size_t u = 0; u < blocks_.size(); ++u) {  // the optimizer changes the shard next
      finish(blocks_[u]);
      release(u);
      grads_.give(blocks_[u].full_grad);  // zeros asked for after the unit's reduce: unused
      blocks_[u].stepped = false;
    }
    if (check_order_)
      order_.check(*comm_, "FullyShardedAverager::synchronize");
    else
      order_.clear();
  }

  /// This rank's shard: a slice per piece (parameter index counted over every unit's parameters
  /// in order, offset within it, the values and their averaged gradients), for the optimizer.
  [[nodiscard]] std::vector<ShardSlice<T>> shard() {
    std::vector<ShardSlice<T>> out;
    std::size_t first_param = 0;
    for (Block& b : blocks_) {
      for (const Piece& pc : b.pieces)
        out.push_back({first_param + pc.param, pc.offset, on_compute(b.value.view(pc.at, pc.size)),
                       on_compute(b.grad.view(pc.at, pc.size))});
      first_param += b.sizes.size();
    }
    return out;
  }

  /// The shard as a ShardLayout (the arrays: every unit's parameters in order; the pieces:
  /// shard()'s), for Checkpoint::put_sharded of state kept per element of the shard.
  [[nodiscard]] ShardLayout layout() const {
    ShardLayout l;
    std::size_t first_param = 0;
    for (const Block& b : blocks_) {
      l.sizes.insert(l.sizes.end(), b.sizes.begin(), b.sizes.end());
      for (const Piece& pc : b.pieces)
        l.ranges.push_back({first_param + pc.param, pc.offset, pc.size});
      first_param += b.sizes.size();
    }
    return l;
  }

  /// Collective: saves this rank's part of a sharded checkpoint, next to the others' (as
  /// ShardedAverager::save): its shard of the parameter values (a sharded section laid out as
  /// layout()) and `state` (the optimizer's state for the shard, put with
  /// Checkpoint::put_sharded(name, values, layout()); the step, ...), to shard_path(path, rank,
  /// size) through the two phases of save_sharded_checkpoint. No rank writes the whole model.
  /// Returns the save identifier.
  std::uint64_t save(const Checkpoint& state, const std::string& path) {
    return detail::save_shard(*comm_, state, path, shard(), layout(), shard_at_.cuda());
  }
  /// save() with no state besides the parameters.
  std::uint64_t save(const std::string& path) { return save(Checkpoint{}, path); }
  /// The older order of save(state, path).
  [[deprecated(
      "save(state, path): what is saved first, where second, as every save of ddp")]] std::uint64_t
  save(const std::string& path, const Checkpoint& state) {
    return save(state, path);
  }

  /// Collective: loads what save() wrote, at this world size or any other (every rank's shard
  /// cut again from the files that hold its elements), and returns the checkpoint for the rest
  /// (`state`'s sections, its sharded sections over this model in layout()). Gathered units are
  /// released and pending reduces finished first: spans from gather() and grad() end here.
  /// std::nullopt on every rank, parameters untouched, when there is none; Errc::mismatch on
  /// every rank for a set saved with other units' parameters.
  [[nodiscard]] std::optional<Checkpoint> load(const std::string& path) {
    return restore(load_sharded_checkpoint(*comm_, path, wanted()),
                   shard_path(path, comm_->rank(), comm_->size()));
  }

  /// Collective: keeps this rank's shard (what save(state, path) writes) in `mirror` and a copy
  /// on the rank before it, as save `tag` (ShardMirror): after a rank is lost, the survivors'
  /// new averager loads it with load(mirror).
  void save(const Checkpoint& state, ShardMirror& mirror, std::uint64_t tag) {
    detail::save_shard_to_mirror(*comm_, mirror, tag, state, shard(), layout(), shard_at_.cuda());
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
  /// the newest save in `mirror` (tag `tag`, when given) of which the ranks hold every old rank's
  /// shard, cut again for this world, as load(path) does (see ShardedAverager::load(mirror)).
  [[nodiscard]] std::optional<Checkpoint> load(ShardMirror& mirror,
                                               std::optional<std::uint64_t> tag = std::nullopt) {
    return restore(detail::MirrorAccess::load(*comm_, mirror, tag, wanted()),
                   detail::concat("the in-memory copy of rank ", comm_->rank(), "'s shard"));
  }

  /// Collective: the whole model at rank `root` (to export it), a unit at a time, so that
  /// `root` holds one unit in full besides its shard: there `fn(unit, param, values)` is called
  /// for each parameter of each unit in order (`values` valid during the call); the other ranks
  /// only send their blocks. Errc::invalid_argument for a root outside the world.
  template <class F>
  void gather_to(int root, F&& fn) {
    if (root < 0 || root >= comm_->size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": FullyShardedAverager::gather_to: root ", root, " outside the world of ",
                   comm_->size());
    const bool here = comm_->rank() == root;
    streams_.own_after_compute();
    trim();  // the kept buffers go, so that the export's buffer does not add to the peak
    for (std::size_t u = 0; u < blocks_.size(); ++u) {
      const Block& b = blocks_[u];
      const std::size_t n = here ? b.block * static_cast<std::size_t>(comm_->size()) : 0;
      const detail::UnitArray<T> full(n, units_at_, comm_->rank(), "a unit gathered to export it");
      detail::UnitArray<T> staged;  // an offloaded block, on the device for the backend
      if (offloaded()) {
        staged = detail::UnitArray<T>(b.block, units_at_, comm_->rank(), "a block to export");
        staged.from_host(0, std::span<const T>(b.value.data(), b.block));
      }
      comm_->gather((offloaded() ? staged : b.value).view(), full.view(), root);
      if (!here) continue;
      detail::PageArray<T> copy;  // a unit gathered on a device, on the host for fn
      const T* values = full.data();
      if (units_at_.cuda()) {
        copy = detail::PageArray<T>(n, comm_->rank(), "a unit gathered to export it");
        full.to_host(0, std::span<T>(copy.data(), n));
        values = copy.data();
      }
      std::size_t at = 0;
      for (std::size_t i = 0; i < b.sizes.size(); ++i) {
        fn(u, i, std::span<const T>(values + at, b.sizes[i]));
        at += b.sizes[i];
      }
    }
  }

  /// Collective: the shard's values from the whole model at rank `root`, a unit at a time (as
  /// gather_to the other way): there `fn(unit, param, values)` writes each parameter of each
  /// unit into `values` (its element count); the other ranks only receive their blocks. Gathered
  /// units are released first. Errc::invalid_argument for a root outside the world.
  template <class F>
  void scatter_from(int root, F&& fn) {
    if (root < 0 || root >= comm_->size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": FullyShardedAverager::scatter_from: root ", root, " outside the world of ",
                   comm_->size());
    const bool here = comm_->rank() == root;
    for (std::size_t u = 0; u < blocks_.size(); ++u) {
      release(u);
      Block& b = blocks_[u];
      const std::size_t n = here ? b.block * static_cast<std::size_t>(comm_->size()) : 0;
      detail::PageArray<T> laid(n, comm_->rank(), "a unit laid out to shard it");
      for (std::size_t i = 0, at = 0; here && i < b.sizes.size(); at += b.sizes[i++])
        fn(u, i, std::span<T>(laid.data() + at, b.sizes[i]));
      detail::UnitArray<T> full(units_at_.cuda() ? n : 0, units_at_, comm_->rank(),
                                "a unit laid out to shard it");
      TensorView<T> in{laid.data(), n};
      if (units_at_.cuda()) {  // the backend takes it from the device
        full.from_host(0, std::span<const T>(laid.data(), n));
        laid = detail::PageArray<T>();
        in = full.view();
      }
      if (!offloaded()) {
        comm_->scatter(in, b.value.view(), root);
      } else {
        const detail::UnitArray<T> mine(b.block, units_at_, comm_->rank(), "a block to shard");
        comm_->scatter(in, mine.view(), root);
        mine.to_host(0, std::span<T>(b.value.data(), b.block));
      }
    }
  }

  /// For uneven inputs (ddp::Join, with this averager among its Joinables): `update(shard())`
  /// is what a rank does with the averaged gradients of a step (the optimizer on its shard). A
  /// rank whose inputs are done still owns its shard, so for each step of the others it takes
  /// part in that step's gathers and reduces (those of its own last step, with zero gradients)
  /// and then runs `update`; the averages are over the ranks that trained the step. Set it on
  /// every rank before the Join is made (Errc::invalid_argument there otherwise).
  template <class F>
  void on_join_step(F&& update) {
    join_update_ = std::forward<F>(update);
  }

  /// Joinable: see on_join_step().
  void join_attach(bool on) override {
    if (on && !join_update_)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": FullyShardedAverager in a ddp::Join: call on_join_step(update) first, with "
                   "the optimizer's step on the shard, which a rank whose inputs are done still "
                   "runs for the others' steps");
    join_ = on;
    trace_.clear();
  }
  void join_active(int active) override {
    active_ = active;
    trace_.clear();  // this step's gathers and reduces, recorded for a finished rank
  }
  void join_step(int active) override {
    if (trace_.empty())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": FullyShardedAverager in a ddp::Join: this rank finished without training a "
                   "step, so it does not know which units a step gathers and reduces; give every "
                   "rank at least one batch");
    active_ = active;
    const std::vector<Op> ops = trace_;
    for (std::size_t u = 0; u < blocks_.size(); ++u) release(u);
    for (const Op& op : ops) {
      if (op.reduce) {
        (void)grad(op.unit);  // zeros: this rank adds nothing
        reduce(op.unit);
      } else {
        release(op.unit);
        prefetch(op.unit);
      }
    }
    for (std::size_t u = 0; u < blocks_.size(); ++u) release(u);
    synchronize();
    join_update_(shard());
    trace_ = ops;
  }

  /// Elements this rank keeps: its blocks' sizes added up (about 1/P of the model).
  [[nodiscard]] std::size_t shard_size() const noexcept {
    std::size_t n = 0;
    for (const Block& b : blocks_) n += b.block;
    return n;
  }

 private:
  struct Piece {
    std::size_t param = 0;   // within the unit
    std::size_t offset = 0;  // within the parameter
    std::size_t at = 0;      // within this rank's block
    std::size_t size = 0;
  };
  struct Block {
    std::vector<std::size_t> sizes;
    std::size_t elements = 0, block = 0;
    detail::UnitArray<T> value, grad;  // this rank's block: values and averaged gradients
    detail::UnitArray<ParamT> full;    // the gathered unit (P blocks), or none
    detail::UnitArray<ReduceT> full_grad, reduced_block;  // its gradients; their block, averaged
    std::vector<Piece> pieces;
    Work gathering, reducing;
    bool reduced = false;  // reduce() issued since the last grad()
    bool stepped = false;  // reduce() issued since the last synchronize()
    int divide_by = 0;     // in a Join: the ranks that trained the reduced step
  };

  /// The layout load() asks for (another model's checkpoint refused).
  [[nodiscard]] ShardLayoutFor wanted() const {
    return detail::wanted_layout(layout(), comm_->rank(), comm_->size(), "FullyShardedAverager");
  }

  /// The shard of `ck` (named `where` in errors) back in place, every unit released first.
  std::optional<Checkpoint> restore(std::optional<Checkpoint> ck, const std::string& where) {
    if (!ck) return std::nullopt;
    for (std::size_t u = 0; u < blocks_.size(); ++u) {
      release(u);
      finish(blocks_[u]);
      blocks_[u].full_grad = detail::UnitArray<ReduceT>();
      trim();
    }
    detail::restore_shard(*comm_, *ck, where, shard(), layout(), shard_at_.cuda(),
                          "FullyShardedAverager");
    return ck;
  }

  /// Waits for `b`'s reduce, if any, and frees its full gradients.
  void finish(Block& b) {
    if (!b.reduced) return;
    order_.named(comm_->rank(), std::size_t(&b - blocks_.data()), true, [&] { b.reducing.wait(); });
    b.reducing = Work();
    b.reduced = false;
    grads_.give(b.full_grad);
    if (!b.reduced_block.empty()) {
      take_reduced(b);
      b.reduced_block = detail::UnitArray<ReduceT>();
    }
    if (b.divide_by > 0) {  // a Join's sum: over the ranks that trained (as GradientAverager's)
      using A = typename detail::Accum<T>::type;
      const int n = std::exchange(b.divide_by, 0);
      b.grad.edit([n](std::span<T> g) {
        for (T& x : g) x = static_cast<T>(static_cast<A>(x) / static_cast<A>(n));
      });
    }
  }

  /// The averaged block of `b` (ReduceT, where units are) into the shard's gradients.
  void take_reduced(Block& b) {
    if constexpr (std::is_same_v<ReduceT, T>) {  // offloaded: copied out
      if (!shard_at_.cuda()) {
        b.reduced_block.to_host(0, std::span<T>(b.grad.data(), b.block));
        return;
      }
    }
    std::vector<ReduceT> scratch;  // converted on the host
    const std::span<const ReduceT> avg = b.reduced_block.on_host(scratch);
    b.grad.edit([&](std::span<T> g) { detail::convert_values(avg, g); });
  }

  /// `v` on the program's stream (the shard's views, for the optimizer).
  [[nodiscard]] TensorView<T> on_compute(TensorView<T> v) const noexcept {
    if (v.device.is_cuda()) v.stream = streams_.compute();
    return v;
  }

  /// Units gathered on a device, the shard kept on the host.
  [[nodiscard]] bool offloaded() const noexcept { return units_at_.cuda() && !shard_at_.cuda(); }

  /// Where units and the shard go (FullyShardedOptions), refused where the backend cannot go.
  void place(const FullyShardedOptions& o) {
    const Device d = detail::unit_device<Backend>(*comm_, o);
    streams_ = detail::UnitStreams(d, d.is_cuda() ? o.stream : nullptr);
    check_order_ = o.check_order;
    units_at_ = {d, streams_.own()};
    shard_at_ = o.offload ? detail::Place{} : units_at_;
  }

  Block& at(std::size_t u, const char* what) {
    if (u >= blocks_.size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": FullyShardedAverager::", what,
                   ": unit ", u, " of ", blocks_.size());
    return blocks_[u];
  }

  /// Every rank's units the same, else Errc::mismatch on every rank naming the first difference.
  void agree(const std::vector<std::uint64_t>& shape) {
    const auto all = comm_->all_gather_object(shape);
    for (std::size_t j = 1; j < all.size(); ++j) {
      if (all[j] == all[0]) continue;
      if (all[j][1] != all[0][1])
        detail::fail(Errc::mismatch, "rank ", comm_->rank(),
                     ": FullyShardedAverager: FullyShardedOptions::check_order is ", all[0][1] != 0,
                     " on rank 0 but ", all[j][1] != 0, " on rank ", j,
                     ": the check is a collective, so every rank must make the same choice");
      std::size_t k = 0;
      while (k < all[0].size() && k < all[j].size() && all[0][k] == all[j][k]) ++k;
      detail::fail(Errc::mismatch, "rank ", comm_->rank(), ": FullyShardedAverager: rank ", j,
                   "'s units differ from rank 0's (", all[0][0], " and ", all[j][0],
                   " units; the first difference at word ", k,
                   " of their shapes): every rank must make the same units");
    }
  }

  struct Op {  // a collective a step issued: unit's all_gather, or its reduce_scatter
    std::size_t unit = 0;
    bool reduce = false;
  };

  Communicator<Backend>* comm_;
  std::vector<Block> blocks_;
  detail::UnitStreams streams_;  // on a device: the engine's stream and the program's
  detail::UnitOrder order_;      // this step's gathers and reduces, in order
  bool check_order_ = true;
  detail::Place units_at_, shard_at_;  // where units are gathered; where the shard is
  std::vector<T> staged_;              // a block of values copied out of the device
  detail::PageCache<ParamT> params_;   // freed gathered units, for the next gathers
  detail::PageCache<ReduceT> grads_;   // freed full gradients, for the next units' backward
  std::function<void(std::vector<ShardSlice<T>>)> join_update_;
  std::vector<Op> trace_;  // in a Join: this rank's collectives of its current (last) step
  bool join_ = false;
  int active_ = 0;
};

/// Deduces the backend from the communicator: FullyShardedAverager fsdp(comm, units, init).
template <class Backend, class I>
FullyShardedAverager(Communicator<Backend>&, std::vector<std::vector<std::size_t>>, I)
    -> FullyShardedAverager<Backend, float>;
/// Deduces the backend from the communicator: FullyShardedAverager fsdp(comm, units, init, o).
template <class Backend, class I>
FullyShardedAverager(Communicator<Backend>&, std::vector<std::vector<std::size_t>>, I,
                     FullyShardedOptions) -> FullyShardedAverager<Backend, float>;

DDP_END_NAMESPACE
