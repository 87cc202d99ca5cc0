// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// GradientAverager<Model, Backend>: what DistributedDataParallel does to gradients.
///
///  * At construction it checks that every rank has the same parameters (count, sizes, element
///    type; Errc::mismatch names the first difference and the ranks) and copies rank 0's values
///    to every rank.
///  * Gradients are averaged in buckets: parameters in reverse order (the order backward produces
///    their gradients), a small first bucket (1 MiB) so communication starts early, then buckets
///    of up to 25 MiB. mark_ready(i) says gradient i is final; a bucket whose gradients are all
///    final starts its all_reduce at once, in the background, while backward goes on — always in
///    the same bucket order on every rank. synchronize() waits and writes the averages back.
///    Large gradients (256 KiB and up) are averaged in place, each as its own bucket, small ones
///    are copied into a bucket (one call for many tensors).
///  * A gradient not marked by synchronize() counts as zero (an unused parameter) instead of
///    hanging; every rank's gradient then holds the average.
///  * no_sync() (a guard) skips averaging while micro-batches accumulate gradients.
///  * Optional compression: float32 gradients travel as float16 or bfloat16 (half the bytes),
///    through Communicator::all_reduce_as (on backend::Host the conversions ride along the
///    transport's own copies, so compression adds no pass over memory).
///  * found_nonfinite(): whether any rank has an inf or NaN gradient, the same answer everywhere
///    (for dynamic loss scaling).
///  * It is a Joinable (ddp/training/join.hpp): with uneven inputs, ranks that finish early
///    shadow its all_reduces, and the average is over the ranks that trained the step.
///
/// A Model is a range of parameters (or has parameters() returning one); a parameter has a value
/// and a gradient, both tensors with the same floating-point element type: members `value` and
/// `grad` (data members or member functions), or a ddp::parameter_traits<P> specialization.
/// Buffers may be reallocated between steps (the averager looks them up again at the start of each
/// step), but their sizes must stay as they were.

#include "ddp/communicator.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/join.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Adapts a parameter type: specialize with static value(P&) and grad(P&) returning tensors.
/// Optional, for frameworks: ensure_grad(P&) and has_grad(P&) (gradients made lazily: see
/// detail::lazy_grad) and ready_hook(P&, std::function<void()>) (see detail::has_ready_hook).
template <class P>
struct parameter_traits {};

namespace detail {

template <class P>
concept has_value = requires(P& p) {
  parameter_traits<P>::value(p);
}
|| requires(P& p) { p.value(); }
|| requires(P& p) { p.value; };
template <class P>
concept has_grad = requires(P& p) {
  parameter_traits<P>::grad(p);
}
|| requires(P& p) { p.grad(); }
|| requires(P& p) { p.grad; };

template <has_value P>
decltype(auto) param_value(P& p) {
  if constexpr (requires { parameter_traits<P>::value(p); })
    return parameter_traits<P>::value(p);
  else if constexpr (requires { p.value(); })
    return p.value();
  else
    return (p.value);
}

template <has_grad P>
decltype(auto) param_grad(P& p) {
  if constexpr (requires { parameter_traits<P>::grad(p); })
    return parameter_traits<P>::grad(p);
  else if constexpr (requires { p.grad(); })
    return p.grad();
  else
    return (p.grad);
}

template <class M>
decltype(auto) model_parameters(M& m) {
  if constexpr (requires { m.parameters(); })
    return m.parameters();
  else
    return (m);
}

/// A framework that creates gradients lazily (libtorch: before the first backward, or after
/// zero_grad() set them to None) creates parameter p's gradient here, as zeros, before the
/// averager reads it: parameter_traits<P>::ensure_grad(p), where defined.
template <class P>
void ensure_grad(P& p) {
  if constexpr (requires { parameter_traits<P>::ensure_grad(p); })
    parameter_traits<P>::ensure_grad(p);
}

/// Whether parameter p has no gradient yet (libtorch: p.grad() undefined):
/// parameter_traits<P>::has_grad(p), where defined. The averager then looks the gradient up when
/// its bucket starts (the framework made it by then, or the parameter was unused this step and
/// gets zeros), instead of creating zeros that the backward pass would add into.
template <class P>
concept lazy_grad = requires(P& p) {
  parameter_traits<P>::ensure_grad(p);
  { parameter_traits<P>::has_grad(p) } -> std::convertible_to<bool>;
};

/// Whether the framework can call back when a parameter's gradient is final for this backward
/// pass: parameter_traits<P>::ready_hook(p, std::function<void()>) returns a handle whose
/// destruction removes the hook (libtorch: a post hook on the gradient's accumulator).
template <class P>
concept has_ready_hook = requires(P& p, std::function<void()> f) {
  {
    parameter_traits<P>::ready_hook(p, std::move(f))
    } -> std::convertible_to<std::shared_ptr<void>>;
};

/// The model's buffers (tensors that are state but not parameters, e.g. BatchNorm's running
/// statistics), where it has buffers(): copied from rank 0 like the parameters.
template <class M>
concept has_buffers = requires(M& m) {
  requires std::ranges::range<decltype(m.buffers())>;
  requires MutableTensor<std::ranges::range_reference_t<decltype(m.buffers())>>;
};

/// Copies `n` bytes between host memory and CUDA devices (`cuda`: either side is on a device),
/// ordered on `stream`.
inline void copy_bytes(void* dst, const void* src, std::size_t n, bool cuda, void* stream) {
  if (n == 0) return;
  if (!cuda) {
    std::memcpy(dst, src, n);
    return;
  }
#if DDP_HAS_CUDA
  cuda_copy_async(dst, src, n, stream);
#else
  (void)stream;
#endif
}

/// Sets `n` bytes to zero, on a CUDA device (ordered on `stream`) or on the host.
inline void zero_bytes(void* dst, std::size_t n, bool cuda, void* stream) {
  if (n == 0) return;
  if (!cuda) {
    std::memset(dst, 0, n);
    return;
  }
#if DDP_HAS_CUDA
  cuda_zero_async(dst, n, stream);
#else
  (void)stream;
#endif
}

/// Blocks until the work queued on a CUDA stream is done (nothing for host memory).
inline void sync_stream(bool cuda, void* stream) {
#if DDP_HAS_CUDA
  if (cuda) cuda_sync(stream);
#else
  (void)cuda, (void)stream;
#endif
}

/// Later work on `waiter` starts after the work queued on `producer` so far (CUDA streams).
inline void join_streams(bool cuda, void* waiter, void* producer) {
#if DDP_HAS_CUDA
  if (cuda) cuda_join_streams(waiter, producer);
#else
  (void)cuda, (void)waiter, (void)producer;
#endif
}

template <class T>
inline constexpr bool is_floating_scalar_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, half> ||
    std::is_same_v<T, bfloat16>;

}  // namespace detail

namespace detail {
template <class P>
using value_of_t = decltype(param_value(std::declval<P&>()));
template <class P>
using grad_of_t = decltype(param_grad(std::declval<P&>()));

/// Value and gradient typed at compile time: the same floating-point element type.
template <class P>
concept typed_parameter =
    !DynamicTensor<value_of_t<P>> && !DynamicTensor<grad_of_t<P>> &&
    std::is_same_v<tensor_value_t<value_of_t<P>>, tensor_value_t<grad_of_t<P>>> &&
    is_floating_scalar_v<tensor_value_t<grad_of_t<P>>>;

/// Value and gradient typed at run time (a framework's tensors): checked at construction.
template <class P>
concept dynamic_parameter = DynamicTensor<value_of_t<P>> && DynamicTensor<grad_of_t<P>>;
}  // namespace detail

/// A parameter: a value and a gradient, mutable tensors of the same floating-point type (checked
/// when the averager is made, for tensors typed at run time).
template <class P>
concept Parameter = requires(P& p) {
  { detail::param_value(p) } -> MutableTensor;
  { detail::param_grad(p) } -> MutableTensor;
}
&&(detail::typed_parameter<P> || detail::dynamic_parameter<P>);

/// A model: a sized range of Parameters, or something whose parameters() returns one.
template <class M>
concept Model = requires(M& m) {
  requires std::ranges::sized_range<decltype(detail::model_parameters(m))>;
  requires Parameter<std::ranges::range_value_t<decltype(detail::model_parameters(m))>>;
};

/// How gradients travel.
enum class Compression {
  none,     ///< as they are
  float16,  ///< float32 gradients sent as float16 (half the bytes; ~3 decimal digits)
  bfloat16  ///< float32 gradients sent as bfloat16 (half the bytes; float32's range)
};

/// How a GradientAverager buckets, compresses and synchronizes (torch DDP's constructor options).
struct AveragerOptions {
  /// Largest bucket, in bytes of gradient (torch's bucket_cap_mb = 25).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// The first bucket (the last parameters), small so that communication starts early.
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// How the gradients travel (torch's fp16/bf16 compression hooks); the averages are rounded
  /// to that type.
  Compression compression = Compression::none;
  /// A gradient of at least this many bytes is averaged in place, as a bucket of its own:
  /// copying it into a bucket and back would cost more than the call it saves.
  std::size_t in_place_bytes = std::size_t{256} << 10;
  /// Copy rank 0's parameter values to every rank at construction (torch does).
  bool broadcast_parameters = true;
  /// Models with buffers() (e.g. a torch::nn::Module's BatchNorm statistics): copy rank 0's
  /// buffers to every rank at construction and after every synchronize(), so every rank's next
  /// forward pass uses the same ones (torch DDP's broadcast_buffers).
  bool broadcast_buffers = true;
  /// Where the framework can say when a gradient is final (libtorch's autograd hooks), call
  /// mark_ready from there, so buckets start during backward. Off: mark_ready yourself, or
  /// average() after backward.
  bool hooks = true;
};

namespace detail {

/// While it lives, the averager's mark_ready/synchronize/average do nothing (no_sync()).
class AveragerNoSync {
 public:
  explicit AveragerNoSync(bool& flag) : flag_(&flag), previous_(std::exchange(flag, true)) {}
  AveragerNoSync(AveragerNoSync&& o) noexcept
      : flag_(std::exchange(o.flag_, nullptr)), previous_(o.previous_) {}
  AveragerNoSync(const AveragerNoSync&) = delete;
  AveragerNoSync& operator=(const AveragerNoSync&) = delete;
  AveragerNoSync& operator=(AveragerNoSync&&) = delete;
  ~AveragerNoSync() {
    if (flag_ != nullptr) *flag_ = previous_;
  }

 private:
  bool* flag_;
  bool previous_;
};

/// A parameter's value or gradient as a TensorView<T>: a run-time-typed one is checked here.
template <class T, class X>
TensorView<T> typed_view(X& x, int rank, std::size_t i, const char* what,
                         const char* who = "GradientAverager") {
  const auto v = ddp::view(x);
  if constexpr (std::is_same_v<std::remove_cvref_t<decltype(v)>, DynamicView>) {
    if (v.problem != nullptr)
      fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": parameter ", i, "'s ", what,
           " cannot be used: ", v.problem);
    if (!v.contiguous)
      fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": parameter ", i, "'s ", what,
           " is not contiguous");
    if (v.dtype != dtype_of<T>)
      fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": parameter ", i, "'s ", what, " is ",
           to_string(v.dtype), " but parameter 0's gradient is ", to_string(dtype_of<T>), "; the ",
           who, " takes one floating-point dtype per model");
    return {static_cast<T*>(v.data), v.size, v.device, v.stream};
  } else {
    return {v.data, v.size, v.device, v.stream};
  }
}

/// Where a model's parameters are, as an averager needs to know it.
struct Placement {
  bool cuda = false;            ///< on a CUDA device
  int device = 0;               ///< ... this one
  bool device_buckets = false;  ///< the backend moves CUDA memory: buckets live on the device
};

/// Every value and gradient must be on one device (all on the host, or all on one CUDA device).
/// A backend that moves CUDA memory gets buckets on that device; one that moves host memory gets
/// host buckets, which the gradients are copied into and out of.
template <class Backend, class T>
Placement place_parameters(int rank, const std::vector<TensorView<T>>& values,
                           const std::vector<TensorView<T>>& grads, const char* who) {
  const Device first = grads.empty() ? Device::cpu() : grads[0].device;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    for (const Device d : {values[i].device, grads[i].device}) {
      if (d != first)
        fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": parameter ", i, " is on ",
             to_string(d), " but parameter 0's gradient is on ", to_string(first),
             "; every value and gradient must be on one device");
    }
  }
  if (first.is_cuda() && !DDP_HAS_CUDA)
    fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": the parameters are on ",
         to_string(first), " but ddp was built without CUDA (link the ddp::cuda target)");
  if (!first.is_cuda() && backend_traits<Backend>::device_only)
    fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": the parameters are on ",
         to_string(first), " but backend::", Backend::name, " moves CUDA memory only");
  return {first.is_cuda(), first.index, first.is_cuda() && Backend::supports(first)};
}

/// Every rank has the same parameters: count, element type and sizes (Errc::mismatch names the
/// first difference and the ranks). Collective.
template <class T, class Backend>
void check_same_parameters(Communicator<Backend>& comm, const std::vector<TensorView<T>>& values,
                           const std::vector<TensorView<T>>& grads, const char* who) {
  // (count, element type, sizes...) of this rank against everyone's.
  std::vector<std::uint64_t> sig{grads.size(), static_cast<std::uint64_t>(dtype_of<T>)};
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].size != values[i].size)
      fail(Errc::invalid_argument, "rank ", comm.rank(), ": ", who, ": parameter ", i, " has ",
           values[i].size, " values but ", grads[i].size, " gradients");
    const auto usable = [](const Device& d) {
      return Backend::supports(d) ||
             (d.is_cuda() && DDP_HAS_CUDA && Backend::supports(Device::cpu()));
    };
    if (!usable(grads[i].device) || !usable(values[i].device))
      fail(Errc::invalid_argument, "rank ", comm.rank(), ": ", who, ": parameter ", i, " lives on ",
           to_string(grads[i].device), ", which this backend cannot use");
    sig.push_back(grads[i].size);
  }
  const auto all = comm.all_gather_object(sig);
  for (std::size_t r = 1; r < all.size(); ++r) {
    const auto& a = all[0];
    const auto& b = all[r];
    if (a == b) continue;
    if (a[0] != b[0])
      fail(Errc::mismatch, "rank ", comm.rank(), ": ", who, ": rank 0 has ", a[0],
           " parameters but rank ", r, " has ", b[0], "; every rank must build the same model");
    if (a[1] != b[1])
      fail(Errc::mismatch, "rank ", comm.rank(), ": ", who, ": the gradients are ",
           to_string(static_cast<DType>(a[1])), " on rank 0 but ",
           to_string(static_cast<DType>(b[1])), " on rank ", r);
    for (std::size_t i = 2; i < a.size(); ++i) {
      if (a[i] != b[i])
        fail(Errc::mismatch, "rank ", comm.rank(), ": ", who, ": parameter ", i - 2, " has ", a[i],
             " elements on rank 0 but ", b[i], " on rank ", r,
             "; every rank must build the same model");
    }
  }
}

/// What GradientAverager forwards to: the averager for one element type.
class AveragerBase {
 public:
  AveragerBase() = default;
  AveragerBase(const AveragerBase&) = delete;
  AveragerBase& operator=(const AveragerBase&) = delete;
  virtual ~AveragerBase() = default;
  [[nodiscard]] virtual std::size_t size() const noexcept = 0;
  [[nodiscard]] virtual std::vector<std::vector<std::size_t>> buckets() const = 0;
  virtual void mark_ready(std::size_t i) = 0;
  virtual void hook_ready(std::size_t i) = 0;
  virtual void mark_all_ready() = 0;
  virtual void synchronize() = 0;
  [[nodiscard]] virtual bool in_no_sync() const noexcept = 0;
  [[nodiscard]] virtual AveragerNoSync no_sync() = 0;
  [[nodiscard]] virtual bool found_nonfinite() = 0;
  virtual void join_attach(bool on) = 0;
  virtual void join_active(int active) = 0;
  virtual void join_step(int active) = 0;
  virtual void join_done(int last) = 0;
};

/// GradientAverager's work, for gradients of element type T (see the file comment).
template <class T, class M, class Backend>
class TypedAverager final : public AveragerBase {
  using Param = std::ranges::range_value_t<decltype(detail::model_parameters(std::declval<M&>()))>;

 public:
  TypedAverager(Communicator<Backend>& comm, M& model, AveragerOptions options)
      : comm_(&comm), model_(&model), o_(options) {
    if constexpr (!std::is_same_v<T, float>) {
      if (o_.compression != Compression::none)
        detail::fail(Errc::invalid_argument, "rank ", comm.rank(),
                     ": GradientAverager: compression applies to float32 gradients; these are ",
                     to_string(dtype_of<T>));
    }
    if (o_.bucket_bytes == 0 || o_.first_bucket_bytes == 0)
      detail::fail(Errc::invalid_argument, "rank ", comm.rank(),
                   ": GradientAverager: bucket sizes must be positive");
    for (auto&& p : detail::model_parameters(model)) {
      const std::size_t i = grads_.size();
      detail::ensure_grad(p);
      values_.push_back(typed_view<T>(detail::param_value(p), comm.rank(), i, "value"));
      grads_.push_back(typed_view<T>(detail::param_grad(p), comm.rank(), i, "gradient"));
    }
    check_devices();
    check_same_everywhere();
    if (o_.broadcast_parameters) {
      for (auto& v : values_) comm.broadcast(v, 0);
    }
    make_buckets();
    ready_.assign(grads_.size(), false);
    if constexpr (detail::lazy_grad<Param>) {
      lazy_.resize(grads_.size());
      missing_.assign(grads_.size(), false);
    }
  }

  TypedAverager(const TypedAverager&) = delete;
  TypedAverager& operator=(const TypedAverager&) = delete;
  ~TypedAverager() override {
    for (auto& b : buckets_) {  // never leave a collective writing into freed buffers
      if (b.work) {
        try {
          b.work->wait();
        } catch (...) {
        }
      }
    }
  }

  /// Number of parameters.
  [[nodiscard]] std::size_t size() const noexcept override { return grads_.size(); }
  /// The parameter indices of each bucket, in launch order.
  [[nodiscard]] std::vector<std::vector<std::size_t>> buckets() const override {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.params);
    return out;
  }

  /// Gradient i is final for this step: its bucket starts averaging once all of its gradients
  /// (and every earlier bucket) are. Ignored inside no_sync().
  void mark_ready(std::size_t i) override {
    if (!in_step_) begin_step();
    if (i >= grads_.size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": GradientAverager::mark_ready(", i, "): the model has ", grads_.size(),
                   " parameters");
    if (no_sync_ || ready_[i]) return;
    ready_[i] = true;
    Bucket& b = buckets_[bucket_of_[i]];
    ++b.ready;
    while (next_ < buckets_.size() && buckets_[next_].ready == buckets_[next_].params.size())
      launch(next_++);
  }

  /// Gradient i was accumulated by the framework's backward (its ready hook fired). A second
  /// time in one step is a second backward before synchronize(), whose accumulation races the
  /// averaging already under way in that gradient: refused, as torch's DDP does.
  void hook_ready(std::size_t i) override {
    if (!no_sync_ && i < ready_.size() && ready_[i])
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": GradientAverager: parameter ",
                   i,
                   "'s gradient was accumulated twice in one step (a second backward before "
                   "synchronize()); call synchronize() after each backward, or run all but the "
                   "last inside no_sync()");
    mark_ready(i);
  }

  /// Waits for every bucket (starting those not started: gradients never marked count as zero)
  /// and writes the averages into the gradients. Ignored inside no_sync().
  void synchronize() override {
    if (no_sync_) return;
    if (!in_step_) begin_step();
    check_joined_step();
    launch_rest();
    for (auto& b : buckets_) {
      if (!b.work) continue;  // part of a coalesced launch
      Work w = std::move(*b.work);
      b.work.reset();
      w.wait();
    }
    for (auto& b : buckets_) {
      if (join_) divide(b);
      unpack(b);
      b.ready = 0;
    }
    next_ = 0;
    in_step_ = false;
    stepped_ = false;
    std::fill(ready_.begin(), ready_.end(), false);
  }

  /// Every gradient is final: mark_ready for all, last first.
  void mark_all_ready() override {
    if (no_sync_) return;
    for (std::size_t i = grads_.size(); i-- > 0;) mark_ready(i);
  }

  [[nodiscard]] bool in_no_sync() const noexcept override { return no_sync_; }

  [[nodiscard]] AveragerNoSync no_sync() override {
    if (next_ != 0)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": GradientAverager::no_sync(): buckets of this step were already started; "
                   "enter no_sync before the backward pass");
    return AveragerNoSync(no_sync_);
  }

  /// Whether any rank's gradients hold an inf or a NaN (after synchronize(): every rank holds the
  /// same averages, so every rank also gets the same answer). Collective.
  [[nodiscard]] bool found_nonfinite() override {
    std::vector<std::int32_t> flag{0};
    std::vector<T> copy;  // CUDA gradients are checked in a host copy
    for (const auto& g : grads_) {
      const T* data = g.data;
      if (cuda_) {
        copy.resize(g.size);
        detail::copy_bytes(copy.data(), g.data, g.size * sizeof(T), true, g.stream);
        detail::sync_stream(true, g.stream);
        data = copy.data();
      }
      for (std::size_t k = 0; k < g.size && flag[0] == 0; ++k) {
        if constexpr (std::is_same_v<T, double>) {
          if (!std::isfinite(data[k])) flag[0] = 1;
        } else if (!std::isfinite(static_cast<float>(data[k]))) {
          flag[0] = 1;
        }
      }
    }
    comm_->all_reduce_host(std::span<std::int32_t>(flag), ReduceOp::max);
    return flag[0] != 0;
  }

 private:
  struct Bucket {
    std::vector<std::size_t> params;  // parameter indices, in packing order
    std::size_t elements = 0;
    std::size_t ready = 0;
    bool in_place = false;  // one gradient, averaged where it is
    std::vector<T> flat;    // host bucket (compression converts as it communicates)
#if DDP_HAS_CUDA
    CudaBuffer<T> device;  // on a backend that moves CUDA memory: the bucket on the GPU
#endif
    std::optional<Work> work;
  };

  void check_devices() {
    const Placement where =
        place_parameters<Backend>(comm_->rank(), values_, grads_, "GradientAverager");
    cuda_ = where.cuda;
    device_ = where.device;
    device_buckets_ = where.device_buckets;
    if (device_buckets_ && o_.compression != Compression::none)
      detail::fail(Errc::unsupported, "rank ", comm_->rank(),
                   ": GradientAverager: compression of gradients on ", to_string(grads_[0].device),
                   " with backend::", Backend::name,
                   " is not available (ddp's headers carry no GPU kernels to convert them); use "
                   "Compression::none, or compress with backend::Host, which converts on the host");
  }

  // Looks the buffers up again (the model may have reallocated them since the last step).
  // Gradients the framework has not made yet (lazy_grad) are looked up when their bucket starts.
  void begin_step() {
    std::size_t i = 0;
    for (auto&& p : detail::model_parameters(*model_)) {
      if (i >= grads_.size()) {
        ++i;
        continue;
      }
      if constexpr (detail::lazy_grad<Param>) {
        lazy_[i] = p;  // a handle: the same parameter
        missing_[i] = !parameter_traits<Param>::has_grad(p);
        if (missing_[i]) {
          ++i;
          continue;
        }
      }
      look_up(i, p);
      ++i;
    }
    if (i != grads_.size())
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": GradientAverager: the model now has ", i, " parameters; it had ",
                   grads_.size(), " when the averager was created");
    in_step_ = true;
  }

  template <class P>
  void look_up(std::size_t i, P& p) {
    detail::ensure_grad(p);
    const auto v = typed_view<T>(detail::param_value(p), comm_->rank(), i, "value");
    const auto g = typed_view<T>(detail::param_grad(p), comm_->rank(), i, "gradient");
    if (g.size != grads_[i].size || v.size != values_[i].size)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(), ": GradientAverager: parameter ",
                   i, " now has ", v.size, " values and ", g.size, " gradients; it had ",
                   values_[i].size, " and ", grads_[i].size,
                   " when the averager was created (sizes must not change)");
    values_[i] = v;
    grads_[i] = g;
  }

  // The gradients of bucket b, which starts now: those looked up lazily are made by now (or are
  // created as zeros: the parameter was unused this step).
  void look_up_missing(const Bucket& b) {
    if constexpr (detail::lazy_grad<Param>) {
      for (const std::size_t i : b.params) {
        if (!missing_[i]) continue;
        look_up(i, lazy_[i]);
        missing_[i] = false;
      }
    }
  }

  void check_same_everywhere() {
    check_same_parameters(*comm_, values_, grads_, "GradientAverager");
  }

  void make_buckets() {
    std::vector<std::size_t> bucket_of(grads_.size());
    Bucket cur;
    std::size_t bytes = 0;
    const auto close = [&] {
      if (cur.params.empty()) return;
      buckets_.push_back(std::move(cur));
      cur = Bucket{};
      bytes = 0;
    };
    for (std::size_t i = grads_.size(); i-- > 0;) {
      const std::size_t cap = buckets_.empty() ? o_.first_bucket_bytes : o_.bucket_bytes;
      const std::size_t b = grads_[i].size * sizeof(T);
      if (b >= o_.in_place_bytes) {
        close();
        bucket_of[i] = buckets_.size();
        buckets_.push_back(Bucket{});
        buckets_.back().params.push_back(i);
        buckets_.back().elements = grads_[i].size;
        buckets_.back().in_place = true;
        continue;
      }
      if (!cur.params.empty() && bytes + b > cap) close();
      bucket_of[i] = buckets_.size();
      cur.params.push_back(i);
      cur.elements += grads_[i].size;
      bytes += b;
    }
    close();
    bucket_of_ = std::move(bucket_of);
    for (auto& b : buckets_) {
      if (b.in_place) continue;
#if DDP_HAS_CUDA
      if (device_buckets_) {
        b.device = CudaBuffer<T>(b.elements, device_,
                                 static_cast<cudaStream_t>(grads_[b.params.front()].stream));
        continue;
      }
#endif
      b.flat.resize(b.elements);
    }
  }

  // Host buckets: the gradients are copied in (from the device, for CUDA gradients) and out.
  void pack(Bucket& b) {
    std::size_t at = 0;
    for (const std::size_t i : b.params) {
      const auto& g = grads_[i];
      T* dst = b.flat.data() + at;
      if (!ready_[i]) {  // never marked: an unused parameter contributes zero
        std::fill_n(dst, g.size, T{});
      } else {
        detail::copy_bytes(dst, g.data, g.size * sizeof(T), cuda_, g.stream);
        if (cuda_) detail::sync_stream(true, g.stream);
      }
      at += g.size;
    }
  }

  void unpack_from(const Bucket& b) {
    std::size_t at = 0;
    for (const std::size_t i : b.params) {
      auto& g = grads_[i];
      detail::copy_bytes(g.data, b.flat.data() + at, g.size * sizeof(T), cuda_, g.stream);
      if (cuda_) detail::sync_stream(true, g.stream);  // the bucket is reused
      at += g.size;
    }
  }

#if DDP_HAS_CUDA
  // Device buckets: packed and unpacked on the bucket's stream, which first waits for the
  // gradients' streams.
  void pack_device(Bucket& b) {
    void* s = b.device.stream();
    std::size_t at = 0;
    for (const std::size_t i : b.params) {
      const auto& g = grads_[i];
      if (ready_[i]) {
        detail::join_streams(true, s, g.stream);
        detail::copy_bytes(b.device.data() + at, g.data, g.size * sizeof(T), true, s);
      } else {
        detail::zero_bytes(b.device.data() + at, g.size * sizeof(T), true, s);
      }
      at += g.size;
    }
  }

  void unpack_device(Bucket& b) {
    void* s = b.device.stream();
    std::size_t at = 0;
    for (const std::size_t i : b.params) {
      detail::copy_bytes(grads_[i].data, b.device.data() + at, grads_[i].size * sizeof(T), true, s);
      at += grads_[i].size;
    }
    detail::sync_stream(true, s);  // the gradients are final for every stream when this returns
  }
#endif

  // The buckets not started yet. On a backend that moves CUDA memory they go as one coalesced
  // operation (one NCCL group); elsewhere one after another.
  void launch_rest() {
#if DDP_HAS_CUDA
    if (device_buckets_ && buckets_.size() - next_ > 1) {
      std::vector<TensorView<T>> group;
      for (; next_ < buckets_.size(); ++next_) {
        Bucket& b = buckets_[next_];
        look_up_missing(b);
        if (b.in_place) {
          auto& g = grads_[b.params.front()];
          if (!ready_[b.params.front()])
            detail::zero_bytes(g.data, g.size * sizeof(T), true, g.stream);
          group.push_back(g);
        } else {
          pack_device(b);
          group.push_back(ddp::view(b.device));
        }
      }
      buckets_.back().work.emplace(comm_->all_reduce_coalesced_async(group, ReduceOp::avg));
      return;
    }
#endif
    while (next_ < buckets_.size()) launch(next_++);
  }

  void launch(std::size_t k) {
    check_joined_step();
    Bucket& b = buckets_[k];
    look_up_missing(b);
    if (b.in_place) {
      const std::size_t i = b.params.front();
      auto& g = grads_[i];
      if (!ready_[i]) detail::zero_bytes(g.data, g.size * sizeof(T), cuda_, g.stream);  // unused
      b.work.emplace(average_async(g));
      return;
    }
#if DDP_HAS_CUDA
    if (device_buckets_) {
      pack_device(b);
      b.work.emplace(comm_->all_reduce_async(b.device, ReduceOp::avg));
      return;
    }
#endif
    if constexpr (!backend_traits<Backend>::device_only) launch_host(b);
  }

  void launch_host(Bucket& b) {
    pack(b);
    b.work.emplace(average_async(b.flat));
  }

  // The asynchronous average of one bucket's buffer, compressed as the options say. In a Join,
  // the sum (divided by the ranks that trained the step in synchronize()).
  template <class Buffer>
  Work average_async(Buffer& buf) {
    const ReduceOp op = join_ ? ReduceOp::sum : ReduceOp::avg;
    switch (o_.compression) {
      case Compression::float16: return comm_->template all_reduce_as_async<half>(buf, op);
      case Compression::bfloat16: return comm_->template all_reduce_as_async<bfloat16>(buf, op);
      case Compression::none: break;
    }
    return comm_->all_reduce_async(buf, op);
  }

  // In a Join: the sums of bucket b become averages over the ranks that trained this step.
  void divide(Bucket& b) {
    const auto by = static_cast<typename detail::Accum<T>::type>(active_);
    const auto apply = [&](T* d, std::size_t n) {
      for (std::size_t k = 0; k < n; ++k)
        d[k] = static_cast<T>(static_cast<typename detail::Accum<T>::type>(d[k]) / by);
    };
    if (b.in_place)
      apply(grads_[b.params.front()].data, b.elements);
    else
      apply(b.flat.data(), b.elements);
  }

  void check_joined_step() {
    if (join_ && !stepped_)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": GradientAverager: inside a ddp::Join, call join.step() once per optimizer "
                   "step, before its backward pass (the finished ranks count on it)");
  }

 public:
  void join_attach(bool on) override {
    if (on && (device_buckets_ || cuda_))
      detail::fail(Errc::unsupported, "rank ", comm_->rank(),
                   ": ddp::Join: GradientAverager with gradients in CUDA memory cannot join yet "
                   "(host gradients on backend::Host and backend::Mpi can)");
    if (next_ != 0)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": ddp::Join: buckets of this step were already started; make the Join "
                   "between steps");
    join_ = on;
    stepped_ = false;
  }
  void join_active(int active) override {
    active_ = active;
    stepped_ = true;
  }
  // A finished rank shadows one step: each bucket's all_reduce, in order, with zeros.
  void join_step(int) override {
    if constexpr (!backend_traits<Backend>::device_only) {
      for (const Bucket& b : buckets_) {
        shadow_.assign(b.elements, T{});
        average_async(shadow_).wait();
      }
    } else {  // join_attach refused it already
      detail::fail(Errc::unsupported, "rank ", comm_->rank(),
                   ": ddp::Join: GradientAverager on a backend that moves CUDA memory only");
    }
  }
  // Every rank has finished: the parameters of the rank that trained longest, everywhere (the
  // others stopped updating theirs when their inputs ran out).
  void join_done(int last) override {
    std::size_t i = 0;
    for (auto&& p : detail::model_parameters(*model_)) {
      auto v = typed_view<T>(detail::param_value(p), comm_->rank(), i++, "value");
      comm_->broadcast(v, last);
    }
  }

 private:
  void unpack(Bucket& b) {
    if (b.in_place) {
      if (cuda_) detail::sync_stream(true, grads_[b.params.front()].stream);
      return;
    }
#if DDP_HAS_CUDA
    if (device_buckets_) {
      unpack_device(b);
      return;
    }
#endif
    if constexpr (!backend_traits<Backend>::device_only) unpack_from(b);
  }

  Communicator<Backend>* comm_;
  M* model_;
  AveragerOptions o_;
  std::vector<TensorView<T>> values_, grads_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<bool> ready_;
  // lazy_grad parameters: their handles for this step, and whose gradients are not looked up yet.
  std::vector<Param> lazy_;
  std::vector<bool> missing_;
  bool cuda_ = false;            // the parameters are on a CUDA device
  int device_ = 0;               // ... this one
  bool device_buckets_ = false;  // the backend moves CUDA memory: buckets live on the device
  bool join_ = false;            // inside a ddp::Join: sums, divided by active_
  bool stepped_ = false;         // join.step() was called for the current step
  int active_ = 0;               // ranks that train the current step (join.step())
  std::vector<T> shadow_;        // zeros a finished rank contributes
  std::size_t next_ = 0;         // the next bucket to launch
  bool no_sync_ = false;
  bool in_step_ = false;  // buffers looked up for the current step
};

}  // namespace detail

/// What DistributedDataParallel does to gradients (see the file comment), for a Model whose
/// gradients are typed at compile time or at run time (a framework's tensors: the element type
/// is read from the first gradient when the averager is made).
template <Model M, class Backend>
class GradientAverager : public Joinable {
  using Param = std::ranges::range_value_t<decltype(detail::model_parameters(std::declval<M&>()))>;
  template <class T>
  using Typed = detail::TypedAverager<T, M, Backend>;

 public:
  /// The guard no_sync() returns: restores the previous mode when it is destroyed.
  using NoSync = detail::AveragerNoSync;

  /// Averages `model`'s gradients over `comm` (both must outlive the averager); copies rank 0's
  /// parameters (and buffers) to every rank unless `options` says not to. Collective.
  GradientAverager(Communicator<Backend>& comm, M& model, AveragerOptions options = {})
      : comm_(&comm), model_(&model), o_(options) {
    if constexpr (detail::dynamic_parameter<Param>) {
      switch (first_dtype()) {
        case DType::float64: impl_ = std::make_unique<Typed<double>>(comm, model, options); break;
        case DType::float16: impl_ = std::make_unique<Typed<half>>(comm, model, options); break;
        case DType::bfloat16:
          impl_ = std::make_unique<Typed<bfloat16>>(comm, model, options);
          break;
        default: impl_ = std::make_unique<Typed<float>>(comm, model, options); break;
      }
    } else {
      impl_ =
          std::make_unique<Typed<tensor_value_t<detail::grad_of_t<Param>>>>(comm, model, options);
    }
    if constexpr (detail::has_buffers<M>) {
      if (o_.broadcast_parameters || o_.broadcast_buffers) broadcast_buffers();
    }
    if constexpr (detail::has_ready_hook<Param>) {
      if (!o_.hooks) return;
      std::size_t i = 0;
      for (auto&& p : detail::model_parameters(model)) {
        hooks_.push_back(
            parameter_traits<Param>::ready_hook(p, [this, i] { impl_->hook_ready(i); }));
        ++i;
      }
    }
  }

  GradientAverager(const GradientAverager&) = delete;
  GradientAverager& operator=(const GradientAverager&) = delete;
  ~GradientAverager() { hooks_.clear(); }  // no hook may call into a destroyed averager

  /// Number of parameters.
  [[nodiscard]] std::size_t size() const noexcept { return impl_->size(); }
  /// The parameter indices of each bucket, in launch order.
  [[nodiscard]] std::vector<std::vector<std::size_t>> buckets() const { return impl_->buckets(); }

  /// Gradient i is final for this step: its bucket starts averaging once all of its gradients
  /// (and every earlier bucket) are. Ignored inside no_sync(). Where the framework can say when
  /// a gradient is final (libtorch: hooks on the gradients' accumulation, which the averager
  /// sets up), it is called during backward by itself.
  void mark_ready(std::size_t i) { impl_->mark_ready(i); }

  /// Waits for every bucket (starting those not started: gradients never marked count as zero)
  /// and writes the averages into the gradients; then, for a model with buffers, copies rank 0's
  /// buffers to every rank (AveragerOptions::broadcast_buffers). Ignored inside no_sync().
  void synchronize() {
    const bool skipped = impl_->in_no_sync();
    impl_->synchronize();
    if constexpr (detail::has_buffers<M>) {
      if (!skipped && o_.broadcast_buffers) broadcast_buffers();
    }
  }

  /// Every gradient is final: mark_ready for all (last first) and synchronize().
  void average() {
    impl_->mark_all_ready();
    synchronize();
  }

  /// While the returned guard lives, mark_ready/synchronize/average do nothing, so gradients of
  /// several micro-batches accumulate locally; the next synchronize() after it averages them.
  [[nodiscard]] NoSync no_sync() { return impl_->no_sync(); }

  /// Whether any rank's gradients hold an inf or a NaN (after synchronize(): every rank holds the
  /// same averages, so every rank also gets the same answer). Collective.
  [[nodiscard]] bool found_nonfinite() { return impl_->found_nonfinite(); }

  /// Joinable (ddp::Join, uneven inputs): in a Join, gradients are summed and divided by the
  /// number of ranks that trained the step; a finished rank shadows each bucket's all_reduce
  /// with zeros and, for a model with buffers, their broadcast from rank 0; when every rank has
  /// finished, every rank gets the parameters of the rank that trained longest.
  void join_attach(bool on) override { impl_->join_attach(on); }
  void join_active(int active) override { impl_->join_active(active); }
  void join_step(int active) override {
    impl_->join_step(active);
    if constexpr (detail::has_buffers<M>) {
      if (o_.broadcast_buffers) broadcast_buffers();
    }
  }
  /// Every rank has finished: the parameters (and buffers) of `last`, the rank that trained
  /// longest, are copied to every rank (torch's DDP join hook does the same).
  void join_done(int last) override {
    impl_->join_done(last);
    if constexpr (detail::has_buffers<M>) {
      for (auto&& b : model_->buffers()) comm_->broadcast(b, last);
    }
  }

 private:
  // The element type of run-time-typed gradients: the first gradient's (a model without
  // parameters: float32).
  DType first_dtype() {
    for (auto&& p : detail::model_parameters(*model_)) {
      detail::ensure_grad(p);
      const DynamicView g = ddp::view(detail::param_grad(p));
      if (g.problem != nullptr)
        detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                     ": GradientAverager: parameter 0's gradient cannot be used: ", g.problem);
      if (!is_valid(g.dtype) || !is_floating_point(g.dtype))
        detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                     ": GradientAverager: parameter 0's gradient is ", to_string(g.dtype),
                     "; gradients must be float32, float64, float16 or bfloat16");
      return g.dtype;
    }
    return DType::float32;
  }

  void broadcast_buffers() {
    if constexpr (detail::has_buffers<M>) {
      for (auto&& b : model_->buffers()) comm_->broadcast(b, 0);
    }
  }

  Communicator<Backend>* comm_;
  M* model_;
  AveragerOptions o_;
  std::unique_ptr<detail::AveragerBase> impl_;
  std::vector<std::shared_ptr<void>> hooks_;
};

/// `GradientAverager avg(comm, model)` deduces the model type and the backend.
template <class Backend, Model M>
GradientAverager(Communicator<Backend>&, M&, AveragerOptions = {}) -> GradientAverager<M, Backend>;

DDP_END_NAMESPACE
