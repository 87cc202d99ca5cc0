// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The bucket engine of GradientAverager and ShardedAverager, and the options they share. It
/// plans the buckets (parameters in reverse order; large gradients in place; ShardedAverager: each
/// bucket padded to P blocks, rank r owning block r), looks the buffers up again each step (the
/// model may reallocate them), counts the gradients marked ready (mark_ready, or the framework's
/// hooks), starts each full bucket in bucket order on every rank (its gradients packed into its
/// host or device buffer, then its comm hook called: ddp/training/averaging/comm_hooks.hpp), waits
/// for them in synchronize() and copies the results back.

#include "ddp/communicator.hpp"
#include "ddp/observe/timeline.hpp"
#include "ddp/training/averaging/comm_hooks.hpp"
#include "ddp/training/averaging/join.hpp"
#include "ddp/training/averaging/parameters.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// How GradientAverager's gradients travel (BucketOptions::compression).
enum class Compression {
  none,     ///< as they are
  float16,  ///< float32 gradients sent as float16 (half the bytes; ~3 decimal digits)
  bfloat16  ///< float32 gradients sent as bfloat16 (half the bytes; float32's range)
};

/// How the averagers bucket and synchronize (torch DDP's constructor options). GradientAverager
/// and ShardedAverager both take it (AveragerOptions and ShardedOptions are its older names);
/// ShardedAverager refuses compression.
struct BucketOptions {
  /// Largest bucket, in bytes of gradient (torch's bucket_cap_mb = 25).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// The first bucket (the last parameters), small so that communication starts early.
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// GradientAverager: how float32 gradients travel (the built-in fp16/bf16 compression hooks;
  /// the averages are rounded to that type). register_comm_hook replaces it.
  Compression compression = Compression::none;
  /// A gradient of this many bytes or more is communicated in place, as a bucket of its own.
  std::size_t in_place_bytes = std::size_t{256} << 10;
  /// Copy rank 0's parameter values to every rank at construction (torch does).
  bool broadcast_parameters = true;
  /// Models with buffers() (BatchNorm's statistics): copy rank 0's to every rank at construction
  /// and after every synchronize() (torch DDP's broadcast_buffers).
  bool broadcast_buffers = true;
  /// Where the framework can say when a gradient is final (libtorch's autograd hooks), call
  /// mark_ready from there, so buckets start during backward.
  bool hooks = true;
};
/// GradientAverager's options' older name.
using AveragerOptions [[deprecated("named BucketOptions: one options struct for both averagers")]] =
    BucketOptions;
/// ShardedAverager's options' older name.
using ShardedOptions [[deprecated("named BucketOptions: one options struct for both averagers")]] =
    BucketOptions;

namespace detail {

/// While it lives, the averager's mark_ready/synchronize/average do nothing (no_sync()).
class AveragerNoSync {
 public:
  explicit AveragerNoSync(bool& flag) : flag_(&flag), previous_(std::exchange(flag, true)) {}
  AveragerNoSync(AveragerNoSync&& o) noexcept
      : flag_(std::exchange(o.flag_, nullptr)), previous_(o.previous_) {}
  AveragerNoSync& operator=(AveragerNoSync&&) = delete;
  ~AveragerNoSync() {
    if (flag_ != nullptr) *flag_ = previous_;
  }

 private:
  bool* flag_;
  bool previous_;
};

/// What GradientAverager forwards to: the engine for one element type.
class AveragerBase : public Joinable {
 public:
  [[nodiscard]] virtual std::size_t size() const noexcept = 0;
  [[nodiscard]] virtual std::vector<std::vector<std::size_t>> buckets() const = 0;
  virtual void mark_ready(std::size_t i) = 0;
  virtual void mark_all_ready() = 0;
  virtual void synchronize() = 0;
  [[nodiscard]] virtual bool in_no_sync() const noexcept = 0;
  [[nodiscard]] virtual AveragerNoSync no_sync() = 0;
  [[nodiscard]] virtual bool found_nonfinite() = 0;
};

/// The engine (see the file comment) for gradients of element type T: GradientAverager's, or
/// ShardedAverager's (`sharded`: P blocks per bucket, reduce_scatter_hook).
template <class T, class M, class Backend>
class BucketEngine final : public AveragerBase {
  using Param = param_of_t<M>;
  using Comm = Communicator<Backend>;
  using View = TensorView<T>;

 public:
  BucketEngine(Comm& comm, M& model, const BucketOptions& o, bool sharded)
      : comm_(&comm), model_(&model), o_(o), sharded_(sharded) {
    who_ = sharded ? "ShardedAverager" : "GradientAverager";
    if (o_.bucket_bytes == 0 || o_.first_bucket_bytes == 0) fail("bucket sizes must be positive");
    if (o_.compression != Compression::none && (sharded || !std::is_same_v<T, float>))
      fail("compression applies to GradientAverager's float32 gradients (these are ",
           to_string(dtype_of<T>), sharded ? ", sharded" : "", "); use Compression::none");
    for (auto&& p : model_parameters(model)) {
      ensure_grad(p);
      values_.push_back(typed_view<T>(param_value(p), comm.rank(), size(), "value", who_));
      grads_.push_back(typed_view<T>(param_grad(p), comm.rank(), size(), "gradient", who_));
      rows_.push_back(param_rows(p));
    }
    place();
    check_same_parameters(*comm_, values_, grads_, who_, "BucketOptions",
                          {o_.bucket_bytes, o_.first_bucket_bytes, o_.in_place_bytes,
                           o_.broadcast_parameters, static_cast<std::uint64_t>(o_.compression)});
    if (o_.broadcast_parameters)
      for (auto& v : values_) comm.broadcast(v, 0);
    if (sharded) shards_ = static_cast<std::size_t>(comm.size()), owner_ = rank();
    plan();
    ready_.assign(size(), false);
    if constexpr (lazy_grad<Param>) lazy_.resize(size()), missing_.assign(size(), false);
    const DType wire = o_.compression == Compression::float16 ? DType::float16 : DType::bfloat16;
    coalesce_ = !sharded && o_.compression == Compression::none;  // the default: all_reduce
    hook_ = sharded     ? CommHook<Comm, T>(reduce_scatter_hook)
            : coalesce_ ? CommHook<Comm, T>(allreduce_hook)
                        : CommHook<Comm, T>(compress_hook(wire));
    if constexpr (has_ready_hook<Param>) {
      std::size_t i = 0;
      for (auto&& p : model_parameters(model))
        if (o_.hooks)
          hooks_.push_back(parameter_traits<Param>::ready_hook(p, [this, k = i++] { ready(k); }));
    }
  }
  BucketEngine(const BucketEngine&) = delete;
  BucketEngine& operator=(const BucketEngine&) = delete;
  ~BucketEngine() override {
    hooks_.clear();  // no hook may call into a destroyed engine
    abandon();       // nor a collective write into freed buckets
  }

  [[nodiscard]] std::size_t size() const noexcept override { return grads_.size(); }
  [[nodiscard]] std::vector<std::vector<std::size_t>> buckets() const override {
    std::vector<std::vector<std::size_t>> out(buckets_.size());
    for (std::size_t k = 0; k < buckets_.size(); ++k)
      for (const BucketPiece& p : buckets_[k].pieces) out[k].push_back(p.param);
    return out;
  }

  void mark_ready(std::size_t i) override {
    if (!in_step_) look_up_all(), in_step_ = true;
    if (i >= size()) fail("mark_ready(", i, "): the model has ", size(), " parameters");
    if (no_sync_ || ready_[i]) return;
    ready_[i] = true;
    for (const std::size_t b : buckets_of_[i]) ++buckets_[b].ready;
    while (next_ < buckets_.size() && buckets_[next_].ready == buckets_[next_].pieces.size())
      launch(next_++);
  }
  void mark_all_ready() override {
    for (std::size_t i = size(); i-- > 0 && !no_sync_;) mark_ready(i);
  }

  void synchronize() override {
    if (no_sync_) return;
    if (!in_step_) look_up_all(), in_step_ = true;
    check_joined_step();
    guarded([&] {
      launch_rest();
      wait_all();
    });
    for (Bucket& b : buckets_) {
      if (join_) divide(b);
      if (!b.in_place)
        transfer(b, grads_, owner_ * b.block, (owner_ + 1) * b.block, false);
      else if (cuda_)
        sync_stream(true, grads_[b.pieces[0].param].stream);
    }
    settle();
    abandon();  // the step is over
    synced_ = true;
  }

  [[nodiscard]] bool in_no_sync() const noexcept override { return no_sync_; }
  [[nodiscard]] AveragerNoSync no_sync() override {
    if (started()) fail("no_sync(): buckets of this step were already started; enter it earlier");
    return AveragerNoSync(no_sync_);
  }
  /// Whether buckets of the current step were started.
  [[nodiscard]] bool started() const noexcept { return in_step_ && next_ != 0; }
  /// Whether synchronize() has completed since the last gather_values().
  [[nodiscard]] bool synced() const noexcept { return synced_; }

  /// Whether any rank's results (ShardedAverager: shard) hold an inf or a NaN. Collective.
  [[nodiscard]] bool found_nonfinite() override {
    std::vector<std::int32_t> flag{0};
    for_each_result([&](const T* g, std::size_t n) {
      for (std::size_t k = 0; k < n && flag[0] == 0; ++k)
        flag[0] = !std::isfinite(static_cast<double>(static_cast<typename Accum<T>::type>(g[k])));
    });
    comm_->all_reduce_host(std::span<std::int32_t>(flag), ReduceOp::max);
    return flag[0] != 0;
  }

  /// What is done to each full bucket from now on (between steps).
  void set_hook(CommHook<Comm, T> h) {
    if (!h) fail("register_comm_hook: the hook is empty");
    if (started())
      fail(
          "register_comm_hook: buckets of this step were already started; register it between "
          "steps");
    hook_ = std::move(h);
    coalesce_ = false;
  }

  void join_attach(bool on) override {
    if (next_ != 0)
      fail("ddp::Join: buckets of this step were already started; make the Join between steps");
    join_ = on;
    stepped_ = false;
  }
  void join_active(int active) override { active_ = active, stepped_ = true; }
  // A finished rank shadows a step: each bucket's hook, in order, on zeros.
  void join_step(int) override {
    guarded([&] {
      for (std::size_t k = 0; k < buckets_.size(); ++k) {
        run_hook(k, zeros(buckets_[k].elements), true);
        wait_all();
      }
    });
  }
  // Every rank has finished: the parameters of the rank that trained longest, everywhere.
  void join_done(int last) override {
    look_up_all();
    for (auto& v : values_) comm_->broadcast(v, last);
  }

  [[nodiscard]] const std::vector<View>& values() const noexcept { return values_; }
  [[nodiscard]] const std::vector<View>& grads() const noexcept { return grads_; }
  [[nodiscard]] bool cuda() const noexcept { return cuda_; }

  /// f(param, offset, n) for each range of a parameter in this rank's block of a bucket.
  template <class F>
  void for_each_owned(F&& f) const {
    for (const Bucket& b : buckets_)
      overlap(b, owner_ * b.block, (owner_ + 1) * b.block,
              [&](const BucketPiece& p, std::size_t at, std::size_t n) {
                f(p.param, p.offset + (at - p.at), n);
              });
  }
  /// f(data, n) over this rank's results in host memory (CUDA ones copied there).
  template <class F>
  void for_each_result(F&& f) {
    std::vector<T> host;
    for_each_owned([&](std::size_t i, std::size_t offset, std::size_t n) {
      const T* data = grads_[i].data + offset;
      if (cuda_) {
        host.resize(n);
        copy_bytes(host.data(), data, n * sizeof(T), true, grads_[i].stream);
        sync_stream(true, grads_[i].stream);
        data = host.data();
      }
      f(data, n);
    });
  }

  /// Looks the buffers up again (the model may have reallocated them since the last step).
  /// Gradients the framework has not made yet (lazy_grad) are looked up when their bucket starts.
  void look_up_all() {
    std::size_t i = 0;
    for (auto&& p : model_parameters(*model_)) {
      if constexpr (lazy_grad<Param>)
        if (i < size()) lazy_[i] = p, missing_[i] = !parameter_traits<Param>::has_grad(p);
      if (i < size()) look_up(i, p);
      ++i;
    }
    if (i != size())
      fail("the model now has ", i, " parameters; it had ", size(), " when the averager was made");
  }

  /// Sets every gradient the model has made (lazy_grad) to zero.
  void zero_grads() {
    look_up_all();
    for (std::size_t i = 0; i < size(); ++i)
      if (!lazy_grad<Param> || !missing_[i])
        zero_bytes(grads_[i].data, grads_[i].bytes(), cuda_, grads_[i].stream);
  }

  /// ZeRO's second action: every rank's block of the values to every rank, one all_gather per
  /// bucket, each copied out while the later ones run.
  void gather_values() {
    synced_ = false;
    guarded([&] {
      for (Bucket& b : buckets_) {
        const std::size_t mine = owner_ * b.block;
        View all = b.in_place ? values_[b.pieces[0].param].subview(0, b.elements) : b.flat;
        if (!b.in_place) transfer(b, values_, mine, mine + b.block, true);
        b.work.emplace(comm_->all_gather_async(all.subview(mine, b.block), all));
      }
      for (Bucket& b : buckets_) {
        std::exchange(b.work, std::nullopt)->wait();
        if (!b.in_place) transfer(b, values_, 0, b.elements, false);
      }
    });
    settle();
  }

 private:
  struct Bucket {
    std::vector<BucketPiece> pieces;
    std::size_t elements = 0;  // padded to a multiple of shards_
    std::size_t block = 0;     // elements / shards_: what each rank owns
    std::size_t ready = 0;     // pieces whose gradients are final
    bool in_place = false;     // one piece, communicated where it is
    std::vector<T> host;       // the buffer on the host
#if DDP_HAS_CUDA
    CudaBuffer<T> device;  // ... or on the GPU, for a backend that moves CUDA memory
#endif
    View flat;           // whichever of the two (in place: none)
    GradBucket<T> grad;  // what the hook was given
    std::optional<Work> work;
  };

  template <class... A>
  [[noreturn]] void fail_as(Errc code, const A&... a) const {
    detail::fail(code, "rank ", comm_->rank(), ": ", who_, ": ", a...);
  }
  template <class... A>
  [[noreturn]] void fail(const A&... a) const {
    fail_as(Errc::invalid_argument, a...);
  }
  [[nodiscard]] std::size_t rank() const { return static_cast<std::size_t>(comm_->rank()); }

  // f(), and after a failure, nothing left in flight and the step forgotten.
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      abandon();
      throw;
    }
  }

  // Every value and gradient on one device (host, or one CUDA device). A backend that moves
  // CUDA memory gets buckets there; else host buckets, which CUDA gradients are copied through.
  void place() {
    const Device first = grads_.empty() ? Device::cpu() : grads_[0].device;
    for (std::size_t i = 0; i < size(); ++i)
      for (const Device d : {values_[i].device, grads_[i].device})
        if (d != first)
          fail("parameter ", i, " is on ", to_string(d), " but parameter 0's gradient is on ",
               to_string(first), "; every value and gradient must be on one device");
    cuda_ = first.is_cuda();
    device_ = first.index;
    device_buckets_ = cuda_ && Backend::supports(first);
    if (cuda_ && !DDP_HAS_CUDA)
      fail("the parameters are on ", to_string(first),
           " but ddp was built without CUDA (link the ddp::cuda target)");
    if (!cuda_ && backend_traits<Backend>::device_only)
      fail("the parameters are on ", to_string(first), " but backend::", Backend::name,
           " moves CUDA memory only");
    if (!device_buckets_ && !Backend::supports(Device::cpu()))
      fail("the parameters live on ", to_string(first), ", which this backend cannot use");
    if (device_buckets_ && o_.compression != Compression::none)
      fail_as(Errc::unsupported, "compression of gradients on ", to_string(first),
              " with backend::", Backend::name,
              " is not available (no GPU kernels here to convert them); use Compression::none, "
              "or compress with backend::Host, which converts on the host");
  }

  void plan() {
    // In place where the backend moves the gradient's memory itself, or stages a whole one (a
    // block of a CUDA gradient staged through the host needs a host bucket).
    const bool in_place_ok = !sharded_ || !cuda_ || device_buckets_;
    buckets_of_.assign(size(), {});
    Bucket cur;
    std::size_t bytes = 0;
    const auto add = [&](std::size_t i, std::size_t offset, std::size_t n) {
      buckets_of_[i].push_back(buckets_.size());
      cur.pieces.push_back({i, offset, n, cur.elements, rows_[i]});
      cur.elements += n;
      bytes += n * sizeof(T);
    };
    const auto close = [&] {
      if (cur.pieces.empty()) return;
      cur.elements = (cur.elements + shards_ - 1) / shards_ * shards_;
      cur.block = cur.elements / shards_;
      buckets_.push_back(std::exchange(cur, Bucket{}));
      bytes = 0;
    };
    for (std::size_t i = size(); i-- > 0;) {
      const std::size_t n = grads_[i].size, left = n % shards_;
      if (n == 0) continue;  // nothing to communicate
      if (in_place_ok && n * sizeof(T) >= o_.in_place_bytes && n >= shards_) {
        close();
        add(i, 0, n - left);
        cur.in_place = true;
        close();
        if (left != 0) add(i, n - left, left);  // the leftover: in the next bucket
        continue;
      }
      const std::size_t cap = buckets_.empty() ? o_.first_bucket_bytes : o_.bucket_bytes;
      if (!cur.pieces.empty() && bytes + n * sizeof(T) > cap) close();
      add(i, 0, n);
    }
    close();
    for (Bucket& b : buckets_) {
      if (b.in_place) continue;
#if DDP_HAS_CUDA
      if (device_buckets_) {
        b.device = CudaBuffer<T>(b.elements, device_,
                                 static_cast<cudaStream_t>(grads_[b.pieces[0].param].stream));
        b.flat = ddp::view(b.device);
        continue;
      }
#endif
      b.host.assign(b.elements, T{});
      b.flat = View{b.host.data(), b.host.size(), Device::cpu(), nullptr};
    }
  }

  // Parameter i's buffers as the model has them now (not a gradient yet to be made).
  template <class P>
  void look_up(std::size_t i, P& p) {
    const View v = typed_view<T>(param_value(p), comm_->rank(), i, "value", who_);
    View g = grads_[i];
    if (!lazy_grad<Param> || !missing_[i]) {
      ensure_grad(p);
      g = typed_view<T>(param_grad(p), comm_->rank(), i, "gradient", who_);
    }
    if (g.size != grads_[i].size || v.size != values_[i].size)
      fail("parameter ", i, " now has ", v.size, " values and ", g.size, " gradients; it had ",
           values_[i].size, " and ", grads_[i].size,
           " when the averager was created (sizes must not change)");
    values_[i] = v;
    grads_[i] = g;
  }

  // Bucket b's gradients looked up again as it starts: made by now (zeros if unused), or replaced
  // since the step began (torch's backward with create_graph makes new tensors).
  void look_up_missing(const Bucket& b) {
    if constexpr (lazy_grad<Param>) {
      for (const BucketPiece& p : b.pieces)
        missing_[p.param] = false, look_up(p.param, lazy_[p.param]);
    }
  }

  // The framework's hook: gradient i was accumulated by backward. A second time in one step is
  // a second backward before synchronize(), whose accumulation races the communication under
  // way in that gradient: refused, as torch's DDP does.
  void ready(std::size_t i) {
    if (!no_sync_ && ready_[i])
      fail("parameter ", i,
           "'s gradient was accumulated twice in one step (a second backward before "
           "synchronize()); call synchronize() after each backward, or run all but the last "
           "inside no_sync()");
    mark_ready(i);
  }

  void check_joined_step() {
    if (join_ && !stepped_)
      fail(
          "inside a ddp::Join, call join.step() once per optimizer step, before its backward "
          "pass (the finished ranks count on it)");
  }

  // Bucket b ready to go: its gradients packed into its buffer (an in-place gradient never
  // marked set to zero). Returns the buffer.
  View prepare(Bucket& b) {
    look_up_missing(b);
    if (b.in_place) {
      const BucketPiece& p = b.pieces[0];
      const View g = grads_[p.param].subview(0, p.size);
      if (!ready_[p.param]) zero_bytes(g.data, g.bytes(), cuda_, g.stream);  // unused
      return g;
    }
    std::size_t end = 0;
    for (const BucketPiece& p : b.pieces) {
      const View& g = grads_[p.param];
      if (ready_[p.param])
        copy(b, b.flat.data + p.at, g.data + p.offset, p.size, g.stream);
      else
        zero_bytes(b.flat.data + p.at, p.size * sizeof(T), device_buckets_, b.flat.stream);
      end = p.at + p.size;
    }
    zero_bytes(b.flat.data + end, (b.elements - end) * sizeof(T), device_buckets_, b.flat.stream);
    return b.flat;
  }

  void launch(std::size_t k) {
    check_joined_step();
    if (!failure_) run_hook(k, prepare(buckets_[k]), false);
  }

  // The buckets not started yet. With the default all_reduce on a backend that moves CUDA
  // memory they go as one coalesced operation (one NCCL group); else one after another.
  void launch_rest() {
    if (coalesce_ && device_buckets_ && buckets_.size() - next_ > 1) {
      std::vector<View> group;
      for (; next_ < buckets_.size(); ++next_) group.push_back(prepare(buckets_[next_]));
      buckets_.back().work.emplace(comm_->all_reduce_coalesced_async(group, ReduceOp::avg));
    }
    while (next_ < buckets_.size()) launch(next_++);
  }

  // Bucket k's hook on `buffer`. A failure is kept for synchronize(), and no later bucket starts.
  void run_hook(std::size_t k, View buf, bool shadow) {
    const detail::BucketSpan span(k, buf.size * sizeof(T));  // the timeline's
    Bucket& b = buckets_[k];
    const bool last = k + 1 == buckets_.size();
    const ReduceOp op = join_ ? ReduceOp::sum : ReduceOp::avg;
    b.grad = {k, last, buf, buf.subview(owner_ * b.block, b.block), op, shadow, b.pieces};
    try {
      b.work.emplace(hook_(*comm_, b.grad));
    } catch (...) {
      failure_ = hook_error(comm_->rank(), who_, k, buckets_[k].pieces);
    }
  }

  // Waits for every bucket's work, in order; then throws a hook's failure (a collective's own
  // ddp::Error passes as it is).
  void wait_all() {
    for (std::size_t k = 0; k < buckets_.size(); ++k) {
      try {
        if (buckets_[k].work) std::exchange(buckets_[k].work, std::nullopt)->wait();
      } catch (const Error&) {
        throw;
      } catch (...) {
        if (!failure_) failure_ = hook_error(comm_->rank(), who_, k, buckets_[k].pieces);
      }
    }
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  }

  // The step is over, or failed: no work left in flight, nothing marked.
  void abandon() noexcept {
    for (Bucket& b : buckets_) {
      try {
        if (b.work) std::exchange(b.work, std::nullopt)->wait();
      } catch (...) {
      }
      b.ready = 0;
    }
    next_ = 0;
    in_step_ = stepped_ = synced_ = false;
    failure_ = nullptr;
    std::fill(ready_.begin(), ready_.end(), false);
  }

  // `n` zeros where the buckets live, the contribution of a rank that finished (Join).
  View zeros(std::size_t n) {
#if DDP_HAS_CUDA
    if (device_buckets_) {
      if (shadow_device_.size() < n)
        shadow_device_ = CudaBuffer<T>(n, device_, static_cast<cudaStream_t>(grads_[0].stream));
      zero_bytes(shadow_device_.data(), n * sizeof(T), true, shadow_device_.stream());
      return ddp::view(shadow_device_).subview(0, n);
    }
#endif
    shadow_.assign(n, T{});
    return View{shadow_.data(), n, Device::cpu(), nullptr};
  }

  // In a Join: the sums of bucket b become averages over the ranks that trained this step. No
  // GPU kernels here: a bucket in CUDA memory is divided on the host, a copy each way.
  void divide(Bucket& b) {
    using A = typename Accum<T>::type;
    T* d = b.in_place ? grads_[b.pieces[0].param].data : b.flat.data;
    void* stream = b.in_place ? grads_[b.pieces[0].param].stream : b.flat.stream;
    const bool dev = b.in_place ? cuda_ : device_buckets_;
    if (dev) shadow_.resize(b.elements);
    T* h = dev ? shadow_.data() : d;
    copy_bytes(h, d, dev ? b.elements * sizeof(T) : 0, true, stream), sync_stream(dev, stream);
    for (std::size_t k = 0; k < b.elements; ++k)
      h[k] = static_cast<T>(static_cast<A>(h[k]) / static_cast<A>(active_));
    copy_bytes(d, h, dev ? b.elements * sizeof(T) : 0, true, stream), sync_stream(dev, stream);
  }

  // f(piece, at, n) for the parts [at, at + n) of b's pieces that lie in [lo, hi).
  template <class F>
  static void overlap(const Bucket& b, std::size_t lo, std::size_t hi, F&& f) {
    for (const BucketPiece& p : b.pieces) {
      const std::size_t from = std::max(lo, p.at), to = std::min(hi, p.at + p.size);
      if (from < to) f(p, from, to - from);
    }
  }

  // Elements [lo, hi) of bucket b copied from the parameters' `views` into it (`in`) or back.
  void transfer(Bucket& b, const std::vector<View>& views, std::size_t lo, std::size_t hi,
                bool in) {
    overlap(b, lo, hi, [&](const BucketPiece& p, std::size_t at, std::size_t n) {
      T* param = views[p.param].data + p.offset + (at - p.at);
      copy(b, in ? b.flat.data + at : param, in ? param : b.flat.data + at, n,
           views[p.param].stream);
    });
  }

  // Copies n elements between a parameter and bucket b: on a device bucket's stream after the
  // parameter's; else on the parameter's stream, waited for here.
  void copy(const Bucket& b, T* dst, const T* src, std::size_t n, void* param_stream) {
    if (device_buckets_) join_streams(true, b.flat.stream, param_stream);
    copy_bytes(dst, src, n * sizeof(T), cuda_, device_buckets_ ? b.flat.stream : param_stream);
    if (cuda_ && !device_buckets_) sync_stream(true, param_stream);
  }
  // The copies out of device buckets are complete (the optimizer or forward pass may read them).
  void settle() {
    for (const Bucket& b : buckets_)
      if (device_buckets_ && !b.in_place) sync_stream(true, b.flat.stream);
  }

  Comm* comm_;
  M* model_;
  std::vector<std::size_t> rows_;  // each parameter's rows as a matrix (param_rows)
  BucketOptions o_;
  bool sharded_;
  const char* who_;
  std::vector<View> values_, grads_;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<std::size_t>> buckets_of_;  // the buckets holding each parameter
  std::vector<bool> ready_;
  std::vector<Param> lazy_;    // lazy_grad: the parameters' handles for this step, and
  std::vector<bool> missing_;  // whose gradients are not looked up yet
  std::vector<std::shared_ptr<void>> hooks_;  // the framework's ready hooks
  CommHook<Comm, T> hook_;                    // what is done to a full bucket
  std::exception_ptr failure_;                // a hook's, kept for synchronize()
  std::vector<T> shadow_;  // the zeros a finished rank contributes; a device bucket divided
#if DDP_HAS_CUDA
  CudaBuffer<T> shadow_device_;  // the zeros in CUDA memory, for a backend that moves it
#endif
  std::size_t shards_ = 1, owner_ = 0;  // blocks per bucket; this rank's
  std::size_t next_ = 0;                // the next bucket to launch
  int device_ = 0, active_ = 0;  // the parameters' CUDA device; ranks training this step (Join)
  bool cuda_ = false, device_buckets_ = false;  // the parameters on a GPU; the buckets too
  bool coalesce_ = false;                // the default all_reduce: the last buckets may go as one
  bool join_ = false, stepped_ = false;  // in a ddp::Join; join.step() called for this step
  bool no_sync_ = false, in_step_ = false;  // in no_sync(); buffers looked up for this step
  bool synced_ = false;                     // synchronize() ran since the last gather_values()
};

}  // namespace detail

DDP_END_NAMESPACE
