// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// GradientAverager<Model, Backend>: what DistributedDataParallel does to gradients.
///
///  * At construction it checks that every rank has the same parameters (count, sizes, element
///    type) and options (Errc::mismatch names the first difference and the ranks), and copies
///    rank 0's values (and buffers) to every rank.
///  * Gradients are averaged in buckets (ddp/training/averaging/buckets.hpp): parameters in reverse
///  order,
///    a small first bucket (1 MiB) so that communication starts early, then up to 25 MiB; 256 KiB
///    and larger in place. mark_ready(i) says gradient i is final; a bucket whose gradients are
///    all final starts in the background while backward goes on, in the same order on every
///    rank. synchronize() waits and writes the averages back; a gradient never marked counts as
///    zero (an unused parameter). no_sync() skips averaging while micro-batches accumulate.
///  * What is done to a full bucket is its comm hook (ddp/training/averaging/comm_hooks.hpp):
///    ddp::allreduce_hook; with BucketOptions::compression the fp16 or bf16 hook (float32
///    gradients travel as float16 or bfloat16: half the bytes); or register_comm_hook's.
///  * found_nonfinite() agrees across ranks (dynamic loss scaling). It is a Joinable
///    (ddp/training/averaging/join.hpp): with uneven inputs, the average is over the ranks that
///    trained.
///
/// Models, parameters and their adaptation: ddp/training/averaging/parameters.hpp.

#include "ddp/backend/reduce.hpp"
#include "ddp/communicator.hpp"
#include "ddp/observe/timeline.hpp"
#include "ddp/training/averaging/buckets.hpp"
#include "ddp/training/averaging/comm_hooks.hpp"
#include "ddp/training/averaging/join.hpp"
#include "ddp/training/averaging/parameters.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {

/// The 2-norm of gradients given range by range (`each(f)` calls f(const T*, n) for each):
/// the sum of squares in double, as torch's clip_grad_norm_ takes it. When that sum is not finite
/// although every element is (double gradients beyond 1e154, whose squares overflow), or so small
/// that squares may have underflowed (gradients below 1e-154), it is taken again scaled by the
/// largest magnitude, as a careful BLAS nrm2 does: the norm is then right over the whole range
/// of doubles, subnormals included. `reduce(values)` sums (or maxes, `max` true) over the ranks
/// that hold parts of the gradients (identity for one rank's whole set); every rank gets the
/// same result.
template <class T, class Each, class Reduce>
double gradient_norm(Each&& each, Reduce&& reduce) {
  const auto as_double = [](T x) {
    return static_cast<double>(static_cast<typename detail::Accum<T>::type>(x));
  };
  std::vector<double> sum{0.0};
  each([&](const T* g, std::size_t n) {
    for (std::size_t k = 0; k < n; ++k) {
      const double x = as_double(g[k]);
      sum[0] += x * x;
    }
  });
  reduce(sum, false);
  // The plain sum is right unless squares overflowed, or the sum is so small (below 2^-900,
  // 1e-271) that squares may have underflowed to zero or to subnormals (gradients below 1e-154).
  if (std::isfinite(sum[0]) && sum[0] >= 0x1p-900) return std::sqrt(sum[0]);
  std::vector<double> top{0.0, 0.0};  // the largest magnitude; 1 when an element is inf or NaN
  each([&](const T* g, std::size_t n) {
    for (std::size_t k = 0; k < n; ++k) {
      const double x = as_double(g[k]);
      if (!std::isfinite(x))
        top[1] = 1.0;
      else
        top[0] = std::max(top[0], std::fabs(x));
    }
  });
  reduce(top, true);
  if (top[1] != 0.0 || top[0] == 0.0) return std::sqrt(sum[0]);  // inf or NaN: theirs
  std::vector<double> scaled{0.0};
  each([&](const T* g, std::size_t n) {
    for (std::size_t k = 0; k < n; ++k) {
      const double x = as_double(g[k]) / top[0];
      scaled[0] += x * x;
    }
  });
  reduce(scaled, false);
  return top[0] * std::sqrt(scaled[0]);
}

/// What GradientAverager and ShardedAverager both offer, over their bucket engine.
template <class M, class Backend>
class Averager {
  using Comm = Communicator<Backend>;

 public:
  /// The guard no_sync() returns: restores the previous mode when it is destroyed.
  using NoSync = AveragerNoSync;
  Averager(const Averager&) = delete;
  Averager& operator=(const Averager&) = delete;

  /// Number of parameters.
  [[nodiscard]] std::size_t size() const noexcept { return impl_->size(); }
  /// The parameter indices of each bucket, in launch order (ShardedAverager: a large parameter's
  /// leftover elements appear again in a later bucket).
  [[nodiscard]] std::vector<std::vector<std::size_t>> buckets() const { return impl_->buckets(); }

  /// What is done to every full bucket from now on (torch's register_comm_hook): `hook(comm,
  /// bucket)` leaves in bucket.output the reduction bucket.op of every rank's bucket.buffer and
  /// returns the Work that finishes it; see ddp/training/averaging/comm_hooks.hpp for the contract,
  /// the built-in hooks, errors and ddp::Join. It replaces BucketOptions::compression. Every rank
  /// registers the same hook, between steps. Gradients typed at run time: take `auto&`.
  template <class F>
  void register_comm_hook(F hook) {
    typed([&](auto t) {
      using T = decltype(t);
      if constexpr (CommHookFor<F, Comm, T>)
        static_cast<BucketEngine<T, M, Backend>&>(*impl_).set_hook(std::move(hook));
      else if constexpr (!dynamic_parameter<param_of_t<M>>)
        static_assert(CommHookFor<F, Comm, T>,
                      "ddp: register_comm_hook: the hook must be callable as ddp::Work(ddp::"
                      "Communicator<Backend>&, ddp::GradBucket<T>&), T the gradients' type");
      else
        fail(Errc::invalid_argument, "rank ", comm_->rank(),
             ": register_comm_hook: the hook does not take GradBucket<", to_string(dtype_of<T>),
             ">, the gradients' type; take it as `auto&`");
    });
  }

  /// Gradient i is final for this step: its bucket starts once all of its gradients (and every
  /// earlier bucket) are. Ignored inside no_sync(). Where the framework can say when a gradient
  /// is final (libtorch: hooks on the gradients' accumulation, which the averager sets up), it
  /// is called during backward by itself.
  void mark_ready(std::size_t i) { impl_->mark_ready(i); }

  /// Waits for every bucket (starting those not started: gradients never marked count as zero)
  /// and writes the averages into the gradients (ShardedAverager: this rank's shard of them);
  /// then, for a model with buffers, copies rank 0's buffers to every rank
  /// (broadcast_buffers). Ignored inside no_sync(). Safe with hooks on: it starts only the
  /// buckets the hooks have not.
  void synchronize() {
    if (impl_->in_no_sync()) return;
    const detail::StepSpan step(steps_);  // the timeline's
    impl_->synchronize();
    if (o_.broadcast_buffers) broadcast_buffers(0);
  }

  /// Every gradient is final: mark_ready for all (last first) and synchronize().
  void average() {
    impl_->mark_all_ready();
    synchronize();
  }

  /// While the returned guard lives, mark_ready/synchronize/average do nothing, so gradients of
  /// several micro-batches accumulate locally; the next synchronize() after it averages them.
  [[nodiscard]] NoSync no_sync() { return impl_->no_sync(); }

  /// Whether any rank's averaged gradients (ShardedAverager: shard) hold an inf or a NaN, after
  /// synchronize(): the same answer on every rank (for dynamic loss scaling). Collective.
  [[nodiscard]] bool found_nonfinite() { return impl_->found_nonfinite(); }

 protected:
  Averager(Comm& comm, M& model, const BucketOptions& o, DType dtype)
      : comm_(&comm), model_(&model), o_(o), dtype_(dtype) {}
  ~Averager() = default;

  // The gradients' element type, when typed at compile time.
  using Typed = typename model_element<M>::type;

  // f(T{}) for the gradients' element type T.
  template <class F>
  void typed(F&& f) {
    if constexpr (!dynamic_parameter<param_of_t<M>>) {
      f(Typed{});
    } else {
      switch (dtype_) {
        case DType::float64: return f(double{});
        case DType::float16: return f(half{});
        case DType::bfloat16: return f(bfloat16{});
        default: return f(float{});
      }
    }
  }
  void broadcast_buffers(int root) {
    if constexpr (has_buffers<M>) {
      for (auto&& b : model_->buffers()) comm_->broadcast(b, root);
    }
  }

  Comm* comm_;
  M* model_;
  BucketOptions o_;
  DType dtype_;  // the gradients' element type
  std::unique_ptr<AveragerBase> impl_;
  detail::StepClock steps_;  // the timeline's steps
};

}  // namespace detail

/// What DistributedDataParallel does to gradients (see the file comment), for a Model whose
/// gradients are typed at compile time or at run time (a framework's tensors: the element type
/// is read from the first gradient when the averager is made).
template <Model M, class Backend>
class GradientAverager : public detail::Averager<M, Backend>, public Joinable {
  using Base = detail::Averager<M, Backend>;

 public:
  /// Averages `model`'s gradients over `comm` (both must outlive the averager); copies rank 0's
  /// parameters (and buffers) to every rank unless `options` says not to. Collective.
  GradientAverager(Communicator<Backend>& comm, M& model, BucketOptions options = {})
      : Base(comm, model, options, first_dtype(comm, model)) {
    this->typed([&](auto t) {
      this->impl_ = std::make_unique<detail::BucketEngine<decltype(t), M, Backend>>(comm, model,
                                                                                    options, false);
    });
    if (options.broadcast_parameters || options.broadcast_buffers) this->broadcast_buffers(0);
  }
  /// A model ddp cannot take, after the compile error that says why (detail::rejected_model).
  template <class Other>
    requires std::same_as<M, detail::rejected_model> GradientAverager(Communicator<Backend>& comm,
                                                                      Other& model,
                                                                      BucketOptions options = {});

  /// Joinable (ddp::Join, uneven inputs): in a Join, gradients are summed and divided by the
  /// number of ranks that trained the step; a finished rank runs each bucket's comm hook on
  /// zeros and, for a model with buffers, their broadcast from rank 0; when every rank has
  /// finished, every rank gets the parameters (and buffers) of the rank that trained longest.
  void join_attach(bool on) override { this->impl_->join_attach(on); }
  void join_active(int active) override { this->impl_->join_active(active); }
  void join_step(int active) override {
    this->impl_->join_step(active);
    if (this->o_.broadcast_buffers) this->broadcast_buffers(0);
  }
  void join_done(int last) override {
    this->impl_->join_done(last);
    this->broadcast_buffers(last);
  }

  /// The 2-norm of all the averaged gradients together, after synchronize() (or average()): the
  /// norm torch's clip_grad_norm_ computes after DDP's backward, accumulated in double. Every
  /// rank holds the same averages (bitwise), so every rank gets the same value, without any
  /// communication. inf or NaN when a gradient holds one. CUDA gradients are read through host
  /// memory.
  [[nodiscard]] double grad_norm() {
    double norm = 0;
    this->typed([&](auto t) {
      using T = decltype(t);
      norm = detail::gradient_norm<T>([&](auto&& f) { engine<T>().for_each_result(f); },
                                      [](std::vector<double>&, bool) {});
    });
    return norm;
  }

  /// torch's clip_grad_norm_(parameters, max_norm) after synchronize(): when grad_norm() exceeds
  /// `max_norm`, multiplies every gradient by max_norm / (norm + 1e-6); returns the norm before
  /// clipping. A norm that is not finite fails with Errc::invalid_argument naming the first
  /// parameter whose average holds an inf or a NaN (on every rank alike), gradients untouched;
  /// with `error_if_nonfinite` false it is returned instead (torch's default), gradients
  /// untouched too.
  double clip_grad_norm(double max_norm, bool error_if_nonfinite = true) {
    if (!(max_norm > 0.0) || !std::isfinite(max_norm))
      detail::fail(Errc::invalid_argument, "rank ", this->comm_->rank(),
                   ": clip_grad_norm: max_norm is ", max_norm, "; give a positive finite norm");
    const double norm = grad_norm();
    if (!std::isfinite(norm)) {
      if (!error_if_nonfinite) return norm;
      const std::size_t first = first_nonfinite();
      if (first == this->size())  // every average finite: their norm is beyond the largest double
        detail::fail(Errc::invalid_argument, "rank ", this->comm_->rank(),
                     ": clip_grad_norm: the averaged gradients are all finite, but their norm is "
                     "beyond the largest double (",
                     std::numeric_limits<double>::max(),
                     "); scale the loss down or lower the learning rate, or pass "
                     "error_if_nonfinite = false");
      detail::fail(Errc::invalid_argument, "rank ", this->comm_->rank(),
                   ": clip_grad_norm: the averaged gradients' norm is ", norm, ": parameter ",
                   first,
                   "'s average holds an inf or a NaN (on every rank: the averages are the same "
                   "everywhere); skip the step (found_nonfinite() says so before clipping), scale "
                   "the loss or lower the learning rate, or pass error_if_nonfinite = false");
    }
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) this->typed([&](auto t) { scale<decltype(t)>(coef); });
    return norm;
  }

 private:
  template <class T>
  detail::BucketEngine<T, M, Backend>& engine() {
    return static_cast<detail::BucketEngine<T, M, Backend>&>(*this->impl_);
  }

  // f(param, data, n) over every range of the gradients, in host memory: CUDA ranges are copied
  // to the host before f and back after it when `write`.
  template <class T, class F>
  void each_gradient(bool write, F&& f) {
    auto& e = engine<T>();
    std::vector<T> host;
    e.for_each_owned([&](std::size_t i, std::size_t offset, std::size_t n) {
      const auto& g = e.grads()[i];
      T* data = g.data + offset;
      if (!e.cuda()) return f(i, data, n);
      host.resize(n);
      detail::copy_bytes(host.data(), data, n * sizeof(T), true, g.stream);
      detail::sync_stream(true, g.stream);
      f(i, host.data(), n);
      if (!write) return;
      detail::copy_bytes(data, host.data(), n * sizeof(T), true, g.stream);
      detail::sync_stream(true, g.stream);
    });
  }

  template <class T>
  void scale(double factor) {
    using A = typename detail::Accum<T>::type;
    const A f = static_cast<A>(factor);
    each_gradient<T>(true, [&](std::size_t, T* g, std::size_t n) {
      for (std::size_t k = 0; k < n; ++k) g[k] = static_cast<T>(static_cast<A>(g[k]) * f);
    });
  }

  std::size_t first_nonfinite() {
    std::size_t first = this->size();
    this->typed([&](auto t) {
      using T = decltype(t);
      each_gradient<T>(false, [&](std::size_t i, T* g, std::size_t n) {
        for (std::size_t k = 0; k < n && i < first; ++k)
          if (!std::isfinite(
                  static_cast<double>(static_cast<typename detail::Accum<T>::type>(g[k]))))
            first = i;
      });
    });
    return first;
  }

  // The element type of run-time-typed gradients: the first gradient's (a model without
  // parameters: float32).
  static DType first_dtype(Communicator<Backend>& comm, M& model) {
    if constexpr (detail::dynamic_parameter<detail::param_of_t<M>>) {
      for (auto&& p : detail::model_parameters(model)) {
        detail::ensure_grad(p);
        const DynamicView g = ddp::view(detail::param_grad(p));
        if (g.problem != nullptr || !is_valid(g.dtype) || !is_floating_point(g.dtype))
          detail::fail(Errc::invalid_argument, "rank ", comm.rank(),
                       ": GradientAverager: parameter 0's gradient is ",
                       g.problem != nullptr ? g.problem : to_string(g.dtype),
                       "; gradients must be float32, float64, float16 or bfloat16");
        return g.dtype;
      }
    }
    return DType::float32;
  }
};

/// `GradientAverager avg(comm, model)` deduces the model type and the backend.
template <class Backend, class M>
GradientAverager(Communicator<Backend>&, M&, BucketOptions = {})
    -> GradientAverager<detail::model_t<M>, Backend>;

DDP_END_NAMESPACE
