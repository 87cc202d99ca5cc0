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
///  * The gradients are cut into the same buckets as GradientAverager's (parameters in reverse
///    order, a small first bucket, then up to 25 MiB), and each bucket is cut into P contiguous
///    blocks of equal size (the bucket padded with zeros to a multiple of P). Rank r owns block r
///    of every bucket: its shard is balanced to within one element per bucket.
///  * A bucket whose gradients are all final starts its reduce_scatter at once, in the background,
///    while backward goes on (the same overlap as the averager's all_reduce); rank r receives the
///    averaged gradients of its blocks only (ZeRO-2). synchronize() waits and writes them into the
///    gradients' owned ranges; outside the shard the gradients are unspecified afterwards.
///  * shard() lists the owned ranges as ShardSlice: a parameter index, an offset, and views of
///    those values and gradients. A slice has `value` and `grad`, so the shard is itself a Model:
///    an optimizer written for a model (reading parameters through ddp::view(p.value) and
///    ddp::view(p.grad)) runs unchanged on the shard, and keeps state (momentum, Adam's moments)
///    for 1/P of the parameters (ZeRO-1).
///  * gather() all-gathers the updated blocks, so every rank holds every parameter again.
///    reduce_scatter + all_gather move the bytes of one all_reduce.
///  * A large gradient (in_place_bytes and up) is a bucket of its own, communicated where it is
///    (no copy): its first n - n % P elements; the n % P left over join the next small bucket.
///  * Unused parameters (never marked) count as zero; no_sync() accumulates micro-batches; a
///    model with buffers() gets rank 0's buffers after each synchronize(), like the averager.
///  * Not a Joinable: a rank whose inputs ran out would have to go on updating its shard. With
///    uneven inputs use GradientAverager in a ddp::Join, or give every rank the same step count.
///
/// Checkpoints: save(path, state) has every rank write its own file (its shard of the parameters,
/// the shard's layout, and `state`: your optimizer's state for the shard, the step), all or none;
/// load(path) puts every rank's shard back, gathers, and returns `state`. The shard depends on
/// the world size and the options, so a set saved with others is refused (Errc::mismatch).
/// With a framework whose backward adds into the gradients, zero_grad() the whole model after a
/// step (TorchShard::step does): an optimizer on the shard zeroes only the shard's.

#include "ddp/communicator.hpp"
#include "ddp/config.hpp"
#include "ddp/training/sharded_checkpoint.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/gradient.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
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

/// How a ShardedAverager buckets and synchronizes (the GradientAverager options that apply).
struct ShardedOptions {
  /// Largest bucket, in bytes of gradient (each rank owns 1/P of every bucket).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// The first bucket (the last parameters), small so that communication starts early.
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// A gradient of at least this many bytes is reduce-scattered and all-gathered where it is,
  /// as a bucket of its own, instead of being copied into a bucket.
  std::size_t in_place_bytes = std::size_t{256} << 10;
  /// Copy rank 0's parameter values to every rank at construction.
  bool broadcast_parameters = true;
  /// Models with buffers(): copy rank 0's buffers to every rank at construction and after every
  /// synchronize().
  bool broadcast_buffers = true;
  /// Where the framework can say when a gradient is final (libtorch's autograd hooks), call
  /// mark_ready from there.
  bool hooks = true;
};

namespace detail {
/// The element type a ShardedAverager of M uses by default: the gradients' type, or float32
/// where it is known only at run time (then checked at construction).
template <class M,
          class P = std::ranges::range_value_t<decltype(model_parameters(std::declval<M&>()))>,
          bool = dynamic_parameter<P>>
struct model_element {
  using type = tensor_value_t<grad_of_t<P>>;
};
template <class M, class P>
struct model_element<M, P, true> {
  using type = float;
};
}  // namespace detail

/// Sharded optimizer state (see the file comment). T: the parameters' element type (deduced for
/// typed parameters; give it for run-time-typed ones that are not float32).
template <Model M, class Backend, class T = typename detail::model_element<M>::type>
class ShardedAverager {
  using Param = std::ranges::range_value_t<decltype(detail::model_parameters(std::declval<M&>()))>;
  static_assert(detail::is_floating_scalar_v<T>,
                "ShardedAverager: T must be float, double, ddp::half or ddp::bfloat16");

 public:
  /// The parameters' element type.
  using value_type = T;
  /// One owned range (see ShardSlice).
  using Slice = ShardSlice<T>;
  /// The guard no_sync() returns: restores the previous mode when it is destroyed.
  using NoSync = detail::AveragerNoSync;

  /// Shards `model`'s gradients and optimizer updates over `comm` (both must outlive it); copies
  /// rank 0's parameters (and buffers) to every rank unless `options` says not to. Collective.
  ShardedAverager(Communicator<Backend>& comm, M& model, ShardedOptions options = {})
      : comm_(&comm), model_(&model), o_(options) {
    if (o_.bucket_bytes == 0 || o_.first_bucket_bytes == 0) fail("bucket sizes must be positive");
    for (auto&& p : detail::model_parameters(model)) {
      const std::size_t i = grads_.size();
      detail::ensure_grad(p);
      values_.push_back(
          detail::typed_view<T>(detail::param_value(p), comm.rank(), i, "value", who));
      grads_.push_back(
          detail::typed_view<T>(detail::param_grad(p), comm.rank(), i, "gradient", who));
    }
    const detail::Placement where =
        detail::place_parameters<Backend>(comm.rank(), values_, grads_, who);
    cuda_ = where.cuda;
    device_ = where.device;
    device_buckets_ = where.device_buckets;
    detail::check_same_parameters(*comm_, values_, grads_, who);
    check_same_options();
    if (o_.broadcast_parameters) {
      for (auto& v : values_) comm.broadcast(v, 0);
    }
    if constexpr (detail::has_buffers<M>) {
      if (o_.broadcast_parameters || o_.broadcast_buffers) broadcast_buffers();
    }
    make_buckets();
    make_shard();
    ready_.assign(grads_.size(), false);
    if constexpr (detail::has_ready_hook<Param>) {
      if (!o_.hooks) return;
      std::size_t i = 0;
      for (auto&& p : detail::model_parameters(model)) {
        hooks_.push_back(parameter_traits<Param>::ready_hook(p, [this, i] { hook_ready(i); }));
        ++i;
      }
    }
  }

  ShardedAverager(const ShardedAverager&) = delete;
  ShardedAverager& operator=(const ShardedAverager&) = delete;
  ~ShardedAverager() {
    hooks_.clear();             // no hook may call into a destroyed averager
    for (auto& b : buckets_) {  // never leave a collective writing into freed buffers
      if (!b.work) continue;
      try {
        b.work->wait();
      } catch (...) {
      }
    }
  }

  /// Number of parameters.
  [[nodiscard]] std::size_t size() const noexcept { return grads_.size(); }
  /// The parameter indices of each bucket, in launch order (a large parameter's leftover
  /// elements appear again in a later bucket).
  [[nodiscard]] std::vector<std::vector<std::size_t>> buckets() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) {
      out.emplace_back();
      for (const Piece& p : b.pieces) out.back().push_back(p.param);
    }
    return out;
  }

  /// This rank's shard: the ranges of parameters it updates, by parameter then offset. The
  /// views follow the model's buffers (looked up again at each step); a Model, for optimizers.
  [[nodiscard]] std::span<Slice> shard() noexcept { return slices_; }
  /// Elements in this rank's shard (the padding of buckets not counted).
  [[nodiscard]] std::size_t shard_size() const noexcept { return shard_size_; }
  /// Elements in all parameters.
  [[nodiscard]] std::size_t total_size() const noexcept { return total_size_; }

  /// Gradient i is final for this step: its bucket starts its reduce_scatter once all of its
  /// gradients (and every earlier bucket) are. Ignored inside no_sync().
  void mark_ready(std::size_t i) {
    if (!in_step_) begin_step();
    if (i >= grads_.size())
      fail("mark_ready(", i, "): the model has ", grads_.size(), " parameters");
    if (no_sync_ || ready_[i]) return;
    ready_[i] = true;
    for (const std::size_t b : buckets_of_[i]) ++buckets_[b].ready;
    while (next_ < buckets_.size() && buckets_[next_].ready == buckets_[next_].pieces.size())
      launch(next_++);
  }

  /// Waits for every bucket's reduce_scatter (starting those not started: gradients never marked
  /// count as zero) and writes the averaged gradients into this rank's shard; then, for a model
  /// with buffers, copies rank 0's buffers to every rank. Ignored inside no_sync().
  void synchronize() {
    if (no_sync_) return;
    if (!in_step_) begin_step();
    try {
      while (next_ < buckets_.size()) launch(next_++);
      wait_all();
    } catch (...) {
      abandon();  // a later call starts afresh (and meets the communicator's error)
      throw;
    }
    for (auto& b : buckets_) {
      if (!b.in_place) unpack_shard(b);
      b.ready = 0;
    }
    settle();
    next_ = 0;
    in_step_ = false;
    synced_ = true;
    std::fill(ready_.begin(), ready_.end(), false);
    if constexpr (detail::has_buffers<M>) {
      if (o_.broadcast_buffers) broadcast_buffers();
    }
  }

  /// Every gradient is final: mark_ready for all (last first) and synchronize().
  void average() {
    if (no_sync_) return;
    for (std::size_t i = grads_.size(); i-- > 0;) mark_ready(i);
    synchronize();
  }

  /// Every rank's shard, updated, to every rank: afterwards each rank holds every parameter.
  /// The bucket all_gathers run in the background while earlier ones are copied out. Refused
  /// unless synchronize() has run since the last gather() (the shard's gradients would not be
  /// averaged). Collective.
  void gather() {
    if (in_step_ && next_ != 0)
      fail("gather(): this step's gradients are being reduced; call synchronize() first");
    if (!synced_)
      fail(
          "gather(): synchronize() has not run since the last gather(), so the shard's "
          "gradients are not averaged; call synchronize() (or average()) before the update");
    if (!in_step_) look_up();  // the parameters where they are now
    gather_all();
    synced_ = false;
  }

  /// Sets every gradient of the model to zero (gradients a framework has not made yet are left
  /// alone). For frameworks whose backward adds into the gradients (libtorch): after a step the
  /// shard's gradients hold averages and the rest hold what this rank sent, and an optimizer on
  /// the shard zeroes only its own; call this (TorchShard::step does) before the next backward.
  void zero_grad() {
    std::size_t i = 0;
    for (auto&& p : detail::model_parameters(*model_)) {
      if constexpr (detail::lazy_grad<Param>) {
        if (!parameter_traits<Param>::has_grad(p)) {
          ++i;
          continue;
        }
      }
      const auto g =
          detail::typed_view<T>(detail::param_grad(p), comm_->rank(), i++, "gradient", who);
      detail::zero_bytes(g.data, g.bytes(), g.device.is_cuda(), g.stream);
    }
  }

  /// Collective: saves this rank's part of a sharded checkpoint, next to the others': the
  /// parameter values of its shard, the shard's layout, and `state` (the optimizer's state for
  /// the shard, the step, ...), to shard_path(path, rank, size) through the two phases of
  /// save_sharded_checkpoint (every rank's file, or none). No rank writes the whole model.
  /// Returns the save identifier.
  std::uint64_t save(const std::string& path, const Checkpoint& state = Checkpoint{}) {
    if (!in_step_) look_up();
    std::string values;
    for (const Slice& sl : slices_) {
      const std::size_t at = values.size();
      values.resize(at + sl.value.bytes());
      detail::copy_bytes(values.data() + at, sl.value.data, sl.value.bytes(), cuda_,
                         sl.value.stream);
      detail::sync_stream(cuda_, sl.value.stream);
    }
    const Checkpoint::Section extra[] = {{"ddp.values", values}};
    return detail::save_shard_files(*comm_, state, path, layout(), extra);
  }

  /// Collective: loads what save() wrote: every rank's shard of the parameters goes back in place
  /// and is gathered (every rank then holds every parameter), and the checkpoint is returned
  /// for the rest (`state`'s sections). std::nullopt on every rank, parameters untouched, when
  /// there is none. A set saved with another world size or other ShardedOptions (another
  /// layout), or by save_sharded_checkpoint alone, fails on every rank with Errc::mismatch;
  /// damaged or mixed files fail as in load_sharded_checkpoint.
  [[nodiscard]] std::optional<Checkpoint> load(const std::string& path) {
    std::optional<Checkpoint> ck = load_sharded_checkpoint(*comm_, path);
    if (!ck) return std::nullopt;
    if (!in_step_) look_up();
    std::string problem;
    const auto stamp = ck->get_object<std::vector<std::uint64_t>>("ddp.shard");
    const std::vector<std::uint64_t> saved(stamp.begin() + 3, stamp.end()), mine = layout();
    if (saved.empty() || !ck->contains("ddp.values")) {
      problem = detail::concat(shard_path(path, comm_->rank(), comm_->size()),
                               " holds no parameters (it was saved by save_sharded_checkpoint, "
                               "not ShardedAverager::save)");
    } else if (saved != mine) {
      problem = detail::concat(shard_path(path, comm_->rank(), comm_->size()), " holds a shard of ",
                               (saved.size() - 1) / 3, " slices but this averager's has ",
                               (mine.size() - 1) / 3,
                               " (or the same count at other places): it was saved with other "
                               "ShardedOptions or another model");
    } else if (ck->get("ddp.values").size() != shard_size_ * sizeof(T)) {
      problem = detail::concat(shard_path(path, comm_->rank(), comm_->size()), " holds ",
                               ck->get("ddp.values").size(), " bytes of parameters, not ",
                               shard_size_ * sizeof(T));
    }
    const auto problems = comm_->all_gather_object(problem);
    for (std::size_t r = 0; r < problems.size(); ++r) {
      if (!problems[r].empty())
        detail::fail(Errc::mismatch, "rank ", comm_->rank(), ": ShardedAverager::load: rank ", r,
                     ": ", problems[r],
                     "; resume with the model, world size and ShardedOptions "
                     "that saved it");
    }
    const std::span<const std::byte> bytes = ck->get("ddp.values");
    std::size_t at = 0;
    for (const Slice& sl : slices_) {
      detail::copy_bytes(sl.value.data, bytes.data() + at, sl.value.bytes(), cuda_,
                         sl.value.stream);
      detail::sync_stream(cuda_, sl.value.stream);
      at += sl.value.bytes();
    }
    gather_all();
    return ck;
  }

  /// One optimizer step: average(), then `update(shard())` (the optimizer, on this rank's shard
  /// only), then gather(). Ignored inside no_sync().
  template <class F>
  void step(F&& update) {
    if (no_sync_) return;
    average();
    std::forward<F>(update)(shard());
    gather();
  }

  /// While the returned guard lives, mark_ready/synchronize/average/step do nothing, so gradients
  /// of several micro-batches accumulate locally.
  [[nodiscard]] NoSync no_sync() {
    if (next_ != 0)
      fail(
          "no_sync(): buckets of this step were already started; enter no_sync before the "
          "backward pass");
    return NoSync(no_sync_);
  }

  /// Whether any rank's shard of averaged gradients holds an inf or a NaN (after synchronize();
  /// the same answer on every rank). Collective.
  [[nodiscard]] bool found_nonfinite() {
    std::vector<std::int32_t> flag{0};
    for_each_owned_gradient([&](const T* g, std::size_t n) {
      for (std::size_t k = 0; k < n && flag[0] == 0; ++k)
        if (!std::isfinite(static_cast<double>(static_cast<typename detail::Accum<T>::type>(g[k]))))
          flag[0] = 1;
    });
    comm_->all_reduce_host(std::span<std::int32_t>(flag), ReduceOp::max);
    return flag[0] != 0;
  }

  /// The 2-norm of the whole averaged gradient (after synchronize()), from every rank's shard:
  /// the same value on every rank, for gradient clipping (scale the shard's gradients by
  /// max_norm / norm before the update). Collective.
  [[nodiscard]] double grad_norm() {
    std::vector<double> sum{0.0};
    for_each_owned_gradient([&](const T* g, std::size_t n) {
      for (std::size_t k = 0; k < n; ++k) {
        const auto x = static_cast<double>(static_cast<typename detail::Accum<T>::type>(g[k]));
        sum[0] += x * x;
      }
    });
    comm_->all_reduce_host(std::span<double>(sum), ReduceOp::sum);
    return std::sqrt(sum[0]);
  }

 private:
  static constexpr const char* who = "ShardedAverager";

  struct Piece {
    std::size_t param = 0;   // parameter index
    std::size_t offset = 0;  // first element within the parameter
    std::size_t size = 0;    // elements
    std::size_t at = 0;      // position in the bucket
  };
  struct Bucket {
    std::vector<Piece> pieces;
    std::size_t elements = 0;  // padded to a multiple of P
    std::size_t block = 0;     // elements / P: what each rank owns
    std::size_t ready = 0;     // pieces whose gradients are final
    bool in_place = false;     // one piece: communicated where it is
    std::vector<T> host;       // the bucket, on the host
#if DDP_HAS_CUDA
    CudaBuffer<T> device;  // ... or on the GPU, for a backend that moves CUDA memory
#endif
    TensorView<T> flat;  // whichever of the two (in place: none)
    std::optional<Work> work;
  };

  // Waits for every bucket's work, in order.
  void wait_all() {
    for (auto& b : buckets_) {
      if (!b.work) continue;
      Work w = std::move(*b.work);
      b.work.reset();
      w.wait();
    }
  }
  // After a failure: no work left in flight, the step forgotten.
  void abandon() noexcept {
    for (auto& b : buckets_) {
      if (b.work) {
        try {
          b.work->wait();
        } catch (...) {
        }
        b.work.reset();
      }
      b.ready = 0;
    }
    next_ = 0;
    in_step_ = false;
    synced_ = false;
    std::fill(ready_.begin(), ready_.end(), false);
  }
  void gather_all() {
    try {
      for (auto& b : buckets_) launch_gather(b);
      for (auto& b : buckets_) {
        Work w = std::move(*b.work);
        b.work.reset();
        w.wait();
        if (!b.in_place) unpack_all(b);
      }
    } catch (...) {
      abandon();
      throw;
    }
    settle();
  }
  // The shard's layout, as save() records it: the world size, then (parameter, offset, size) of
  // each slice.
  [[nodiscard]] std::vector<std::uint64_t> layout() const {
    std::vector<std::uint64_t> out{static_cast<std::uint64_t>(comm_->size())};
    for (const Slice& sl : slices_) {
      out.push_back(sl.param);
      out.push_back(sl.offset);
      out.push_back(sl.value.size);
    }
    return out;
  }

  template <class... A>
  [[noreturn]] void fail(const A&... a) const {
    detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": ShardedAverager: ", a...);
  }

  [[nodiscard]] std::size_t rank() const { return static_cast<std::size_t>(comm_->rank()); }

  // The bucket options decide the shards, and broadcast_parameters whether construction
  // broadcasts: every rank must give the same.
  void check_same_options() {
    const std::vector<std::uint64_t> mine{o_.bucket_bytes, o_.first_bucket_bytes, o_.in_place_bytes,
                                          o_.broadcast_parameters ? 1u : 0u};
    const auto all = comm_->all_gather_object(mine);
    static constexpr const char* names[] = {"bucket_bytes", "first_bucket_bytes", "in_place_bytes",
                                            "broadcast_parameters"};
    for (std::size_t r = 1; r < all.size(); ++r)
      for (std::size_t k = 0; k < mine.size(); ++k)
        if (all[r][k] != all[0][k])
          detail::fail(Errc::mismatch, "rank ", comm_->rank(),
                       ": ShardedAverager: ShardedOptions::", names[k], " is ", all[0][k],
                       " on rank 0 but ", all[r][k], " on rank ", r,
                       "; every rank must give the same ShardedOptions");
  }

  void make_buckets() {
    const auto world = static_cast<std::size_t>(comm_->size());
    // In place on a backend that moves the parameters' memory itself (staging a CUDA parameter
    // through the host needs a host bucket anyway).
    const bool in_place_ok = !cuda_ || device_buckets_;
    buckets_of_.assign(grads_.size(), {});
    Bucket cur;
    std::size_t bytes = 0;
    const auto add = [&](std::size_t i, std::size_t offset, std::size_t n) {
      buckets_of_[i].push_back(buckets_.size());
      cur.pieces.push_back({i, offset, n, cur.elements});
      cur.elements += n;
      bytes += n * sizeof(T);
    };
    const auto close = [&] {
      if (cur.pieces.empty()) return;
      cur.elements = (cur.elements + world - 1) / world * world;
      cur.block = cur.elements / world;
      buckets_.push_back(std::move(cur));
      cur = Bucket{};
      bytes = 0;
    };
    for (std::size_t i = grads_.size(); i-- > 0;) {
      const std::size_t n = grads_[i].size;
      total_size_ += n;
      if (n == 0) continue;
      const std::size_t cap = buckets_.empty() ? o_.first_bucket_bytes : o_.bucket_bytes;
      if (in_place_ok && n * sizeof(T) >= o_.in_place_bytes && n >= world) {
        close();
        const std::size_t m = n - n % world;
        buckets_of_[i].push_back(buckets_.size());
        Bucket b;
        b.pieces.push_back({i, 0, m, 0});
        b.elements = m;
        b.block = m / world;
        b.in_place = true;
        buckets_.push_back(std::move(b));
        if (m != n) add(i, m, n - m);  // the leftover, in the next small bucket
        continue;
      }
      if (!cur.pieces.empty() && bytes + n * sizeof(T) > cap) close();
      add(i, 0, n);
    }
    close();
    for (auto& b : buckets_) {
      if (b.in_place) continue;
#if DDP_HAS_CUDA
      if (device_buckets_) {
        b.device = CudaBuffer<T>(b.elements, device_, stream_of(b));
        b.flat = ddp::view(b.device);
        continue;
      }
#endif
      b.host.assign(b.elements, T{});
      b.flat = TensorView<T>{b.host.data(), b.host.size(), Device::cpu(), nullptr};
    }
  }

  // The CUDA stream a device bucket's work is ordered on: its first gradient's.
  [[nodiscard]] void* stream_raw(const Bucket& b) const {
    return grads_[b.pieces.front().param].stream;
  }
#if DDP_HAS_CUDA
  [[nodiscard]] cudaStream_t stream_of(const Bucket& b) const {
    return static_cast<cudaStream_t>(stream_raw(b));
  }
#endif

  // This rank's block of each bucket, as slices of parameters, sorted by parameter and offset.
  void make_shard() {
    slices_.clear();
    shard_size_ = 0;
    for (const auto& b : buckets_) {
      for_each_owned(b, [&](std::size_t from, std::size_t to, const Piece& p) {
        Slice s;
        s.param = p.param;
        s.offset = p.offset + (from - p.at);
        s.value = values_[p.param].subview(s.offset, to - from);
        s.grad = grads_[p.param].subview(s.offset, to - from);
        slices_.push_back(s);
        shard_size_ += to - from;
      });
    }
    std::sort(slices_.begin(), slices_.end(), [](const Slice& a, const Slice& b) {
      return a.param != b.param ? a.param < b.param : a.offset < b.offset;
    });
  }

  // Looks the buffers up again (the model may have reallocated them since the last step).
  void begin_step() {
    look_up();
    in_step_ = true;
  }

  // The model's buffers and the shard's views, looked up again (the model may have reallocated
  // them: between steps, and before a checkpoint is saved or loaded).
  void look_up() {
    std::size_t i = 0;
    for (auto&& p : detail::model_parameters(*model_)) {
      if (i < grads_.size()) {
        detail::ensure_grad(p);
        const auto v =
            detail::typed_view<T>(detail::param_value(p), comm_->rank(), i, "value", who);
        const auto g =
            detail::typed_view<T>(detail::param_grad(p), comm_->rank(), i, "gradient", who);
        if (g.size != grads_[i].size || v.size != values_[i].size)
          fail("parameter ", i, " now has ", v.size, " values and ", g.size, " gradients; it had ",
               values_[i].size, " and ", grads_[i].size,
               " when the averager was created (sizes must not change)");
        values_[i] = v;
        grads_[i] = g;
      }
      ++i;
    }
    if (i != grads_.size())
      fail("the model now has ", i, " parameters; it had ", grads_.size(),
           " when the averager was created");
    for (auto& s : slices_) {
      s.value = values_[s.param].subview(s.offset, s.value.size);
      s.grad = grads_[s.param].subview(s.offset, s.grad.size);
    }
  }

  void hook_ready(std::size_t i) {
    if (!no_sync_ && i < ready_.size() && ready_[i])
      fail("parameter ", i,
           "'s gradient was accumulated twice in one step (a second backward before "
           "synchronize()); call synchronize() after each backward, or run all but the last "
           "inside no_sync()");
    mark_ready(i);
  }

  // Copies n elements between a parameter's memory and a bucket. Device buckets: ordered on the
  // bucket's stream after the parameter's; host buckets of CUDA parameters: on the parameter's
  // stream (settle() waits for those).
  void copy(T* dst, const T* src, std::size_t n, const Bucket& b, void* param_stream) {
    if (device_buckets_) {
      detail::join_streams(true, stream_raw(b), param_stream);
      detail::copy_bytes(dst, src, n * sizeof(T), true, stream_raw(b));
      return;
    }
    detail::copy_bytes(dst, src, n * sizeof(T), cuda_, param_stream);
    if (cuda_) detail::sync_stream(true, param_stream);
  }
  void zero(T* dst, std::size_t n, void* stream) {
    detail::zero_bytes(dst, n * sizeof(T), cuda_, stream);
  }
  // Device buckets: the copies out of them are complete (the optimizer may read the shard, the
  // forward pass the parameters).
  void settle() {
    if (!device_buckets_) return;
    for (const auto& b : buckets_) detail::sync_stream(true, stream_raw(b));
  }

  void launch(std::size_t k) {
    Bucket& b = buckets_[k];
    const std::size_t mine = rank() * b.block;
    if (b.in_place) {
      const Piece& p = b.pieces.front();
      const TensorView<T> g = grads_[p.param].subview(0, p.size);
      if (!ready_[p.param]) zero(g.data, g.size, g.stream);  // unused: counts as zero
      b.work.emplace(comm_->reduce_scatter_async(g, g.subview(mine, b.block), ReduceOp::avg));
      return;
    }
    void* s = device_buckets_ ? stream_raw(b) : nullptr;
    std::size_t end = 0;
    for (const Piece& p : b.pieces) {
      const TensorView<T>& g = grads_[p.param];
      if (ready_[p.param])
        copy(b.flat.data + p.at, g.data + p.offset, p.size, b, g.stream);
      else
        zero_flat(b, p.at, p.size, s);
      end = p.at + p.size;
    }
    zero_flat(b, end, b.elements - end, s);  // the padding
    b.work.emplace(
        comm_->reduce_scatter_async(b.flat, b.flat.subview(mine, b.block), ReduceOp::avg));
  }
  void zero_flat(Bucket& b, std::size_t at, std::size_t n, void* s) {
    detail::zero_bytes(b.flat.data + at, n * sizeof(T), device_buckets_, s);
  }

  // Calls f(from, to, piece) for each piece's part that lies in this rank's block of b.
  template <class F>
  void for_each_owned(const Bucket& b, F&& f) const {
    const std::size_t lo = rank() * b.block, hi = lo + b.block;
    for (const Piece& p : b.pieces) {
      const std::size_t from = std::max(lo, p.at), to = std::min(hi, p.at + p.size);
      if (from < to) f(from, to, p);
    }
  }

  // The averaged gradients of this rank's block into the gradients.
  void unpack_shard(Bucket& b) {
    for_each_owned(b, [&](std::size_t from, std::size_t to, const Piece& p) {
      const TensorView<T>& g = grads_[p.param];
      copy(g.data + p.offset + (from - p.at), b.flat.data + from, to - from, b, g.stream);
    });
  }

  // This rank's updated values into its block, then the all_gather of the bucket.
  void launch_gather(Bucket& b) {
    const std::size_t mine = rank() * b.block;
    if (b.in_place) {
      const TensorView<T> v = values_[b.pieces.front().param].subview(0, b.elements);
      b.work.emplace(comm_->all_gather_async(v.subview(mine, b.block), v));
      return;
    }
    for_each_owned(b, [&](std::size_t from, std::size_t to, const Piece& p) {
      const TensorView<T>& v = values_[p.param];
      copy(b.flat.data + from, v.data + p.offset + (from - p.at), to - from, b, v.stream);
    });
    b.work.emplace(comm_->all_gather_async(b.flat.subview(mine, b.block), b.flat));
  }

  // Every piece's gathered values back into the parameters.
  void unpack_all(Bucket& b) {
    for (const Piece& p : b.pieces) {
      const TensorView<T>& v = values_[p.param];
      copy(v.data + p.offset, b.flat.data + p.at, p.size, b, v.stream);
    }
  }

  // f(data, n) over this rank's averaged gradients, on the host (CUDA ones copied there).
  template <class F>
  void for_each_owned_gradient(F&& f) {
    std::vector<T> host;
    for (const Slice& s : slices_) {
      const T* data = s.grad.data;
      if (cuda_) {
        host.resize(s.grad.size);
        detail::copy_bytes(host.data(), s.grad.data, s.grad.bytes(), true, s.grad.stream);
        detail::sync_stream(true, s.grad.stream);
        data = host.data();
      }
      f(data, s.grad.size);
    }
  }

  void broadcast_buffers() {
    if constexpr (detail::has_buffers<M>) {
      for (auto&& b : model_->buffers()) comm_->broadcast(b, 0);
    }
  }

  Communicator<Backend>* comm_;
  M* model_;
  ShardedOptions o_;
  std::vector<TensorView<T>> values_, grads_;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<std::size_t>> buckets_of_;  // the buckets holding each parameter
  std::vector<Slice> slices_;
  std::size_t shard_size_ = 0, total_size_ = 0;
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<void>> hooks_;
  bool cuda_ = false;            // the parameters are on a CUDA device
  int device_ = 0;               // ... this one
  bool device_buckets_ = false;  // the backend moves CUDA memory: buckets live on the device
  std::size_t next_ = 0;         // the next bucket to launch
  bool no_sync_ = false;
  bool in_step_ = false;  // buffers looked up for the current step
  bool synced_ = false;   // synchronize() ran since the last gather()
};

/// `ShardedAverager zero(comm, model)` deduces the model type and the backend.
template <class Backend, Model M>
ShardedAverager(Communicator<Backend>&, M&, ShardedOptions = {}) -> ShardedAverager<M, Backend>;

DDP_END_NAMESPACE
