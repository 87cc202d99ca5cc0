// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Communicator<Backend>: a process group with every collective of torch.distributed,
/// typed (any ddp::TensorLike buffer), checked before anything is sent, with an _async twin for
/// each collective (returning ddp::Work), object collectives and split().
///
/// Operations on one communicator run one at a time, in the order they were issued, whichever
/// thread issued them. A synchronous call with nothing queued runs in the calling thread (no
/// hand-off); async calls run on the communicator's worker thread. Buffers given to an async
/// call must stay alive and untouched until its Work completes.
///
/// After a collective fails (timeout, a lost peer, a mismatch, abort()), the communicator is
/// unusable: every later call fails at once with Errc::aborted naming the first failure. Build a
/// new one (with another Options::group) to continue.

#include "ddp/backend/host.hpp"
#include "ddp/codec.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/collective.hpp"
#include "ddp/detail/fork.hpp"
#include "ddp/detail/reduce.hpp"
#include "ddp/detail/rendezvous.hpp"
#include "ddp/detail/staging.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/store.hpp"
#include "ddp/tensor.hpp"
#include "ddp/trace.hpp"
#include "ddp/types.hpp"
#if DDP_HAS_CUDA
#include "ddp/cuda.hpp"
#endif

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// What Communicator needs from a backend: byte movement on type-erased buffers.
template <class B>
concept CommBackend = requires(B& b, const detail::Buf& buf, ReduceOp op, int i,
                               const detail::BackendInit& init, const std::string& s) {
  { B::create(init) } -> std::same_as<std::unique_ptr<B>>;
  { B::supports(Device{}) } -> std::convertible_to<bool>;
  { b.rank() } -> std::convertible_to<int>;
  { b.size() } -> std::convertible_to<int>;
  { b.local_rank() } -> std::convertible_to<int>;
  { b.local_size() } -> std::convertible_to<int>;
  { b.local_leader() } -> std::convertible_to<int>;
  b.all_reduce(buf, op);
  b.broadcast(buf, i);
  b.reduce(buf, i, op);
  b.all_gather(buf, buf);
  b.gather(buf, buf, i);
  b.scatter(buf, buf, i);
  b.reduce_scatter(buf, buf, op);
  b.all_to_all(buf, buf);
  b.send(buf, i, i);
  b.recv(buf, i, i);
  b.barrier();
  b.abort(Errc::aborted, s);
};

namespace detail {

/// Whether Communicator::init must rendezvous through a Store before creating the backend
/// (backend::Mpi, which gets ranks from the MPI library, says `needs_store = false`).
template <class B>
inline constexpr bool backend_needs_store = true;
template <class B>
  requires requires { B::needs_store; }
inline constexpr bool backend_needs_store<B> = B::needs_store;

/// Whether a backend that moves only CUDA memory (`device_kind = DeviceKind::cuda`) is given a
/// buffer whose type says it is host memory: rejected when the program is compiled.
template <class B, class T>
inline constexpr bool host_type_for_device_backend = false;
template <class B, class T>
  requires requires { B::device_kind; }
inline constexpr bool host_type_for_device_backend<B, T> =
    B::device_kind == DeviceKind::cuda && static_device_kind_v<T> == DeviceKind::cpu;

/// Whether a backend moves device memory only (backend::Nccl): host data of object collectives
/// goes through a device copy there.
template <class B>
inline constexpr bool device_only_backend = false;
template <class B>
  requires requires { B::device_kind; }
inline constexpr bool device_only_backend<B> = B::device_kind == DeviceKind::cuda;

/// Whether the backend makes sub-groups itself (MPI_Comm_split, ncclCommSplit).
template <class B>
concept splits_itself = requires(B& b, int i) {
  { b.split(i, i) } -> std::same_as<std::unique_ptr<B>>;
};

struct WorkState {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
};

/// Runs operations one at a time in issue order: inline when idle, else on a worker thread.
class Executor {
 public:
  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  ~Executor() {
    {
      std::lock_guard lock(queue_mutex_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  template <class F>
  void run(F&& f) {
    std::unique_lock lock(queue_mutex_);
    if (queue_.empty() && !busy_) {
      std::lock_guard run_lock(run_mutex_);
      lock.unlock();
      f();
      return;
    }
    auto state = enqueue_locked(std::function<void()>(std::forward<F>(f)));
    lock.unlock();
    std::unique_lock wait_lock(state->mutex);
    state->cv.wait(wait_lock, [&] { return state->done; });
    if (state->error) std::rethrow_exception(state->error);
  }

  std::shared_ptr<WorkState> submit(std::function<void()> f) {
    std::lock_guard lock(queue_mutex_);
    if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
    auto state = enqueue_locked(std::move(f));
    queue_cv_.notify_one();
    return state;
  }

 private:
  std::shared_ptr<WorkState> enqueue_locked(std::function<void()> f) {
    if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
    auto state = std::make_shared<WorkState>();
    queue_.emplace_back(std::move(f), state);
    queue_cv_.notify_one();
    return state;
  }

  void loop() {
    std::unique_lock lock(queue_mutex_);
    for (;;) {
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and drained
      auto [f, state] = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      std::exception_ptr error;
      {
        std::lock_guard run_lock(run_mutex_);
        try {
          f();
        } catch (...) {
          error = std::current_exception();
        }
      }
      state->finish(error);
      lock.lock();
      busy_ = false;
    }
  }

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<WorkState>>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::mutex run_mutex_;
  std::thread worker_;
};

/// Whether [a, a+an) and [b, b+bn) share a byte.
[[nodiscard]] inline bool overlaps(const std::byte* a, std::size_t an, const std::byte* b,
                                   std::size_t bn) {
  return an != 0 && bn != 0 && a < b + bn && b < a + an;
}

}  // namespace detail

/// The handle of an asynchronous operation.
class Work {
 public:
  /// A Work that is already complete.
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> s) : state_(std::move(s)) {}

  /// Blocks until the operation has finished; rethrows its ddp::Error if it failed.
  void wait() const {
    if (!state_) return;
    std::unique_lock lock(state_->mutex);
    state_->cv.wait(lock, [&] { return state_->done; });
    if (state_->error) std::rethrow_exception(state_->error);
  }

  /// Whether the operation has finished (successfully or not); never blocks, never throws.
  [[nodiscard]] bool test() const {
    if (!state_) return true;
    std::lock_guard lock(state_->mutex);
    return state_->done;
  }

  /// Whether the operation finished and failed.
  [[nodiscard]] bool failed() const {
    if (!state_) return false;
    std::lock_guard lock(state_->mutex);
    return state_->done && state_->error != nullptr;
  }

 private:
  std::shared_ptr<detail::WorkState> state_;
};

template <CommBackend Backend>
class Communicator {
 public:
  /// split() color for ranks that join no group (MPI_UNDEFINED).
  static constexpr int no_color = -1;

  /// Joins the process group described by `env`: rank 0 starts the rendezvous store at
  /// MASTER_ADDR:MASTER_PORT (unless a launcher hosts it), every rank connects, and the backend
  /// connects the ranks. A world of one needs no store.
  [[nodiscard]] static Communicator init(const Environment& env = Environment::detect(),
                                         Options options = {}) {
    try {
      return init_unnamed(env, std::move(options));
    } catch (const Error& e) {  // every message names the rank
      if (std::string_view(e.what()).starts_with("rank ")) throw;
      detail::fail(e.code(), "rank ", env.rank, ": ", e.what());
    }
  }

 private:
  static Communicator init_unnamed(const Environment& env, Options options) {
    auto state = std::make_shared<State>();
    state->configure(options);
    state->world_rank = env.rank;
    detail::BackendInit bi;
    bi.rank = env.rank;
    bi.size = env.world_size;
    bi.local_rank = env.local_rank;
    state->local_rank_hint = env.local_rank;
    bi.options = options;
    if (env.world_size > 1 && detail::backend_needs_store<Backend>) {
      if (env.master_port == 0) {
        detail::fail(Errc::invalid_argument, "rank ", env.rank,
                     ": Communicator::init: MASTER_PORT is not set (world size ", env.world_size,
                     "); export MASTER_ADDR and MASTER_PORT, or launch with ddprun");
      }
      StoreOptions so;
      so.timeout = options.timeout;
      so.token = options.token;
      const int store_port = env.store_port != 0 ? env.store_port : env.master_port;
      const bool hosted = options.external_store || detail::env_or("DDP_STORE_HOSTED", "0") == "1";
      if (env.rank == 0 && !hosted) {
        try {
          state->server = std::make_unique<StoreServer>(env.master_addr, store_port, so);
        } catch (const Error& e) {
          if (e.code() != Errc::address_in_use) throw;
          detail::fail(Errc::address_in_use, "rank 0: cannot host the rendezvous store: ", e.what(),
                       " (or a second process was started with RANK=0)");
        }
      }
      const std::string prefix =
          detail::concat("ddp/", detail::env_or("DDP_RESTART_COUNT", "0"), "/", options.group, "/");
      state->root_store = std::make_shared<Store>(env.master_addr, store_port, so);
      state->prefix = prefix;
      bi.store = std::make_shared<Store>(state->root_store->prefixed(prefix).watching("failed"));
      state->store = bi.store;
      state->world_size = env.world_size;
      detail::claim_rank(*bi.store, env.rank, options.group);
      state->joined = true;
    }
    state->create_backend(bi, [&] {
      if (bi.store) {
        detail::agree_on_job(*bi.store, bi.rank,
                             {bi.size, std::string(Backend::name), options.verify_collectives},
                             options.timeout, state->world_size);
      }
    });
    return Communicator(std::move(state));
  }

 public:
  Communicator(Communicator&&) noexcept = default;
  Communicator& operator=(Communicator&&) noexcept = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator() = default;

  /// False for the result of split() with no_color.
  [[nodiscard]] bool valid() const noexcept { return state_ && state_->backend; }
  [[nodiscard]] int rank() const { return backend().rank(); }
  [[nodiscard]] int size() const { return backend().size(); }
  [[nodiscard]] int local_rank() const { return backend().local_rank(); }
  [[nodiscard]] int local_size() const { return backend().local_size(); }
  [[nodiscard]] const Options& options() const { return checked().options; }
  /// The backend, for backend-specific queries (e.g. backend().transport()).
  [[nodiscard]] Backend& backend() const { return *checked().backend; }

  // ---- collectives -------------------------------------------------------------------------

  /// Reduces `buf` over all ranks, in place (every rank gets the result).
  template <MutableTensor T>
  void all_reduce(T&& buf, ReduceOp op = ReduceOp::sum) {
    exec(prepare_all_reduce(buf, op));
  }
  template <MutableTensor T>
  [[nodiscard]] Work all_reduce_async(T&& buf, ReduceOp op = ReduceOp::sum) {
    return submit(prepare_all_reduce(buf, op));
  }

  /// all_reduce of float32 values that travel and are reduced as W (ddp::half or ddp::bfloat16):
  /// half the bytes, for a result rounded to W (torch's fp16/bf16 compression hooks). The result
  /// is bitwise that of converting to W, all_reduce on W (accumulating in float, in rank order)
  /// and converting back; backend::Host fuses the conversions into its own passes over memory,
  /// other host-memory backends convert around a plain all_reduce. Not available for buffers
  /// that backend::Nccl moves (Errc::unsupported: ddp's headers carry no GPU kernels).
  template <class W, MutableTensor T>
    requires(std::is_same_v<W, half> || std::is_same_v<W, bfloat16>)
  void all_reduce_as(T&& buf, ReduceOp op = ReduceOp::sum) {
    exec(prepare_all_reduce_as<W>(buf, op));
  }
  template <class W, MutableTensor T>
    requires(std::is_same_v<W, half> || std::is_same_v<W, bfloat16>)
  [[nodiscard]] Work all_reduce_as_async(T&& buf, ReduceOp op = ReduceOp::sum) {
    return submit(prepare_all_reduce_as<W>(buf, op));
  }

  /// all_reduce of several buffers as one operation (torch's all_reduce_coalesced): one NCCL
  /// group on backend::Nccl (one launch, one wait), one buffer after another elsewhere.
  template <std::ranges::range R>
    requires MutableTensor<std::ranges::range_reference_t<R>>
  void all_reduce_coalesced(R&& bufs, ReduceOp op = ReduceOp::sum) {
    exec(prepare_all_reduce_coalesced(bufs, op));
  }
  template <std::ranges::range R>
    requires MutableTensor<std::ranges::range_reference_t<R>>
  [[nodiscard]] Work all_reduce_coalesced_async(R&& bufs, ReduceOp op = ReduceOp::sum) {
    return submit(prepare_all_reduce_coalesced(bufs, op));
  }

  /// Copies root's `buf` to every rank.
  template <MutableTensor T>
  void broadcast(T&& buf, int root = 0) {
    exec(prepare_broadcast(buf, root));
  }
  template <MutableTensor T>
  [[nodiscard]] Work broadcast_async(T&& buf, int root = 0) {
    return submit(prepare_broadcast(buf, root));
  }

  /// Reduces `buf` over all ranks into root's `buf`; the other ranks' buffers are unchanged.
  template <MutableTensor T>
  void reduce(T&& buf, int root = 0, ReduceOp op = ReduceOp::sum) {
    exec(prepare_reduce(buf, root, op));
  }
  template <MutableTensor T>
  [[nodiscard]] Work reduce_async(T&& buf, int root = 0, ReduceOp op = ReduceOp::sum) {
    return submit(prepare_reduce(buf, root, op));
  }

  /// out[r*n .. r*n+n) = rank r's `in` (n = in's size); out.size() == in.size() * size().
  /// In place when `in` is exactly this rank's block of `out`.
  template <TensorLike In, MutableTensor Out>
  void all_gather(In&& in, Out&& out) {
    exec(prepare_gather(detail::Coll::all_gather, in, out, -1));
  }
  template <TensorLike In, MutableTensor Out>
  [[nodiscard]] Work all_gather_async(In&& in, Out&& out) {
    return submit(prepare_gather(detail::Coll::all_gather, in, out, -1));
  }

  /// Like all_gather, into root's `out` only (`out` is not used on the other ranks).
  template <TensorLike In, MutableTensor Out>
  void gather(In&& in, Out&& out, int root = 0) {
    exec(prepare_gather(detail::Coll::gather, in, out, root));
  }
  template <TensorLike In, MutableTensor Out>
  [[nodiscard]] Work gather_async(In&& in, Out&& out, int root = 0) {
    return submit(prepare_gather(detail::Coll::gather, in, out, root));
  }

  /// Rank r receives root's in[r*n .. r*n+n) into `out` (n = out's size; `in` used on root only).
  template <TensorLike In, MutableTensor Out>
  void scatter(In&& in, Out&& out, int root = 0) {
    exec(prepare_scatter(in, out, root));
  }
  template <TensorLike In, MutableTensor Out>
  [[nodiscard]] Work scatter_async(In&& in, Out&& out, int root = 0) {
    return submit(prepare_scatter(in, out, root));
  }

  /// out = block r of the reduction of every rank's `in`; in.size() == out.size() * size().
  template <TensorLike In, MutableTensor Out>
  void reduce_scatter(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    exec(prepare_reduce_scatter(in, out, op));
  }
  template <TensorLike In, MutableTensor Out>
  [[nodiscard]] Work reduce_scatter_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    return submit(prepare_reduce_scatter(in, out, op));
  }

  /// Block j of `in` goes to rank j, which stores it as its block r of `out`.
  template <TensorLike In, MutableTensor Out>
  void all_to_all(In&& in, Out&& out) {
    exec(prepare_all_to_all(in, out));
  }
  template <TensorLike In, MutableTensor Out>
  [[nodiscard]] Work all_to_all_async(In&& in, Out&& out) {
    return submit(prepare_all_to_all(in, out));
  }

  /// Point-to-point. Between a pair, sends and receives match in issue order; the receiver checks
  /// the tag, dtype and count.
  template <TensorLike T>
  void send(T&& buf, int peer, int tag = 0) {
    exec(prepare_p2p(detail::Coll::send, buf, peer, tag));
  }
  template <TensorLike T>
  [[nodiscard]] Work send_async(T&& buf, int peer, int tag = 0) {
    return submit(prepare_p2p(detail::Coll::send, buf, peer, tag));
  }
  template <MutableTensor T>
  void recv(T&& buf, int peer, int tag = 0) {
    exec(prepare_p2p(detail::Coll::recv, buf, peer, tag));
  }
  template <MutableTensor T>
  [[nodiscard]] Work recv_async(T&& buf, int peer, int tag = 0) {
    return submit(prepare_p2p(detail::Coll::recv, buf, peer, tag));
  }

  void barrier() {
    exec(Op{"barrier", [](Backend& b, State&) { b.barrier(); }});
  }
  [[nodiscard]] Work barrier_async() {
    return submit(Op{"barrier", [](Backend& b, State&) { b.barrier(); }});
  }

  // ---- small host values on any backend --------------------------------------------------

  /// all_reduce of a few host values (counts, flags, metrics) on any backend: on one that moves
  /// device memory only (backend::Nccl) they travel through a device copy, so code above the
  /// Communicator (exact_mean, sync_batch_stats, ZeroFirstGuard) works on every backend alike.
  /// For large data use all_reduce on the backend's own kind of buffer.
  template <Scalar E>
  void all_reduce_host(std::span<E> values, ReduceOp op = ReduceOp::sum) {
    on_host_data(values, std::span<E>(), [&](auto& v, auto&) { all_reduce(v, op); });
  }
  /// broadcast of a few host values on any backend (see all_reduce_host).
  template <Scalar E>
  void broadcast_host(std::span<E> values, int root) {
    on_host_data(values, std::span<E>(), [&](auto& v, auto&) { broadcast(v, root); });
  }

  // ---- object collectives ------------------------------------------------------------------

  /// Every rank's value, in rank order.
  template <Encodable T>
  [[nodiscard]] std::vector<T> all_gather_object(const T& value) {
    return gather_objects<T>(value, -1);
  }

  /// Every rank's value on root (in rank order); an empty vector on the other ranks.
  template <Encodable T>
  [[nodiscard]] std::vector<T> gather_object(const T& value, int root = 0) {
    return gather_objects<T>(value, root);
  }

  /// Replaces `value` on every rank with root's.
  template <Encodable T>
  void broadcast_object(T& value, int root = 0) {
    check_root(root, "broadcast_object");
    std::string bytes;
    if (rank() == root) bytes = detail::encode_object(value);
    std::int64_t n = static_cast<std::int64_t>(bytes.size());
    broadcast_host(std::span<std::int64_t>(&n, 1), root);
    check_object_size(n, "broadcast_object", root);
    bytes.resize(static_cast<std::size_t>(n));
    broadcast_host(
        std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(bytes.data()), bytes.size()), root);
    if (rank() != root) value = detail::decode_object<T>(bytes.data(), bytes.size());
  }

  // ---- groups and failure ------------------------------------------------------------------

  /// MPI_Comm_split: ranks passing the same color form a communicator, ordered by (key, rank).
  /// Ranks passing no_color get an invalid communicator. Collective over this communicator.
  [[nodiscard]] Communicator split(int color, int key = 0) {
    if (color < no_color) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": split: color ", color,
                   " is negative (use no_color)");
    }
    if constexpr (detail::splits_itself<Backend>) {
      std::unique_ptr<Backend> made;
      exec(Op{"split", [&](Backend& b, State&) { made = b.split(color, key); }});
      if (!made) return Communicator(nullptr);
      auto sub = std::make_shared<State>();
      sub->configure(state_->options);
      sub->world_rank = state_->world_rank;
      sub->local_rank_hint = state_->local_rank_hint;
      sub->backend = std::move(made);
      return Communicator(std::move(sub));
    }
    const auto all = all_gather_object(std::pair<int, int>{color, key});
    const std::uint64_t n = checked().splits++;
    if (color == no_color) return Communicator(nullptr);
    std::vector<std::pair<int, int>> members;  // (key, old rank)
    for (int r = 0; r < static_cast<int>(all.size()); ++r) {
      if (all[static_cast<std::size_t>(r)].first == color)
        members.emplace_back(all[static_cast<std::size_t>(r)].second, r);
    }
    std::sort(members.begin(), members.end());
    auto sub = std::make_shared<State>();
    sub->configure(state_->options);
    sub->world_rank = state_->world_rank;
    sub->root_store = state_->root_store;
    sub->prefix = detail::concat(state_->prefix, "split", n, "/", color, "/");
    detail::BackendInit bi;
    bi.size = static_cast<int>(members.size());
    for (int i = 0; i < bi.size; ++i) {
      if (members[static_cast<std::size_t>(i)].second == rank()) bi.rank = i;
    }
    bi.options = state_->options;
    bi.local_rank = state_->local_rank_hint;
    sub->local_rank_hint = state_->local_rank_hint;
    if (state_->root_store) {
      bi.store =
          std::make_shared<Store>(state_->root_store->prefixed(sub->prefix).watching("failed"));
      sub->store = bi.store;
      sub->world_size = bi.size;
      sub->joined = true;
    }
    exec(Op{"split", [&](Backend&, State&) { sub->create_backend(bi, [] {}); }});
    return Communicator(std::move(sub));
  }

  /// The ranks of this communicator on this host, as a communicator (made by split() on first
  /// use, then cached). Collective on first use.
  [[nodiscard]] Communicator& local_group() {
    auto& s = checked();
    if (!s.local_group) {
      s.local_group = std::make_unique<Communicator>(split(backend().local_leader(), rank()));
    }
    return *s.local_group;
  }

  // ---- diagnostics ---------------------------------------------------------------------------

  /// The flight recorder: the last Options::trace_entries operations on this communicator
  /// (op, seq, bytes, state), oldest first. Safe from any thread, e.g. a watchdog.
  [[nodiscard]] std::vector<TraceRecord> recent() const { return checked().recorder.recent(); }

  /// The same as text (what a timeout writes to Options::trace_dump), with `why` in its header.
  [[nodiscard]] std::string trace(std::string_view why = {}) const { return checked().trace(why); }

  /// Makes every pending and later operation fail with Errc::aborted, here and, where the
  /// backend can reach them, on the peers. Safe to call from any thread, e.g. a watchdog.
  void abort(const std::string& why = "Communicator::abort() was called") {
    auto& s = same_process("abort");
    {
      std::lock_guard lock(s.poison_mutex);
      if (s.poison.empty()) {
        s.poison = detail::concat("rank ", s.backend->rank(), ": aborted: ", why);
        s.poison_code = Errc::aborted;
        s.poisoned.store(true, std::memory_order_release);
      }
    }
    s.backend->abort(Errc::aborted, why);
  }

 private:
  struct State {
    ~State() {
      if (detail::fork_generation() != fork_generation) {
        // A fork() child's copy: the parent owns the store, the shared memory and the peers,
        // and this process has none of the threads. Touch nothing; keep it reachable.
        static std::vector<State*> inherited;
        inherited.push_back(new State(std::move(*this), Inherited{}));
        return;
      }
      local_group.reset();
      executor.reset();  // drain the queue first
      // Rank 0 keeps the store up until every rank has left, so none loses it mid-call; after a
      // failed rendezvous too, so the others can read why it failed.
      if (store && joined && !store->lost()) {
        try {
          Store plain = store->unwatched();  // the waits below must not end at "failed"
          plain.set(detail::concat("exit/", world_rank_in_group), "");
          const auto limit =
              std::min<std::chrono::milliseconds>(options.timeout, std::chrono::seconds(10));
          if (server && backend && poison.empty()) {
            std::vector<std::string> keys;
            for (int r = 0; r < world_size; ++r) keys.push_back(detail::concat("exit/", r));
            (void)plain.missing_after(keys, limit);
          } else if (server && !backend) {
            linger_after_failed_rendezvous(plain, limit);
          }
        } catch (...) {  // leaving anyway
        }
      }
      backend.reset();
    }
    State() = default;
    struct Inherited {};

    /// The rendezvous failed here, and this process hosts the store: keep it up until every rank
    /// that claimed its place has left (and has so read why), for at most `limit`; ranks that
    /// never claimed one get a second to appear. Nobody waits for a rank that was never started.
    void linger_after_failed_rendezvous(Store& plain, std::chrono::milliseconds limit) const {
      const auto start = std::chrono::steady_clock::now();
      for (;;) {
        bool all_left = true, all_claimed = true;
        for (int r = 0; r < world_size && all_left; ++r) {
          const std::string claim = detail::concat("claim/", r);
          const std::string left = detail::concat("exit/", r);
          if (!plain.check(std::span<const std::string>(&claim, 1)))
            all_claimed = false;
          else if (!plain.check(std::span<const std::string>(&left, 1)))
            all_left = false;
        }
        const auto waited = std::chrono::steady_clock::now() - start;
        if ((all_left && (all_claimed || waited > std::chrono::seconds(1))) || waited > limit)
          return;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    // Moves the members out of a fork child's copy (see ~State) without running their cleanup.
    State(State&& o, Inherited) {
      executor.reset(o.executor.release());
      server.reset(o.server.release());
      backend.reset(o.backend.release());
      local_group.reset(o.local_group.release());
      root_store = std::move(o.root_store);
      store = std::move(o.store);
#if DDP_HAS_CUDA
      stager.reset(o.stager.release());
#endif
    }

    /// Creates the backend after `before()` (checks that need the store), telling the other
    /// ranks when this rank fails: they are waiting on the store for it, and fail at once with
    /// its reason instead of at their timeout.
    template <class Check>
    void create_backend(const detail::BackendInit& bi, const Check& before) {
      world_rank_in_group = bi.rank;
      try {
        before();
        backend = Backend::create(bi);
      } catch (const Error& e) {
        constexpr std::string_view relayed = "the rendezvous failed on rank ";
        if (std::string_view(e.what()).starts_with(relayed)) {  // another rank's, via the store
          detail::fail(e.code(), "rank ", bi.rank, ": ", e.what());
        }
        if (store && !store->lost()) {
          try {
            (void)store->compare_set(
                "failed", "",
                Store::stop_value(e.code(), detail::concat(relayed, bi.rank, ": ", e.what())));
          } catch (...) {  // the store is gone too: the peers learn from it
          }
        }
        throw;
      }
    }
    void configure(const Options& o) {
      options = o;
      recorder.resize(detail::trace_capacity(o));
    }
    [[nodiscard]] std::string trace(std::string_view why) const {
      return detail::format_trace(recorder.recent(), recorder.issued(), backend->rank(),
                                  backend->size(), options.group, why);
    }

    Options options;
    detail::FlightRecorder recorder;
    std::uint64_t fork_generation = detail::fork_generation();  // made in this process
    int pid = static_cast<int>(::getpid());
    bool joined = false;          // this process holds its rank's claim in the store
    int world_size = 1;           // ranks in this communicator (for the store host's wait)
    int world_rank_in_group = 0;  // this rank in this communicator
    int world_rank = 0;
    int local_rank_hint = 0;  // the launcher's local rank: the default CUDA device
    std::unique_ptr<StoreServer> server;
    std::shared_ptr<Store> root_store;
    std::shared_ptr<Store> store;
    std::string prefix;
    std::unique_ptr<Backend> backend;
    std::unique_ptr<detail::Executor> executor = std::make_unique<detail::Executor>();
    std::uint64_t splits = 0;
    std::unique_ptr<Communicator> local_group;
    std::mutex poison_mutex;
    std::string poison;
    Errc poison_code = Errc::aborted;
    std::atomic<bool> poisoned{false};  // poison is set: read without the lock on every call
#if DDP_HAS_CUDA
    std::unique_ptr<detail::CudaStager> stager;  // made on first use

    detail::CudaStager& stager_for(int device) {
      if (!stager || stager->device() != device) {
        stager.reset();
        stager = std::make_unique<detail::CudaStager>(device, options.timeout);
      }
      return *stager;
    }
#endif
  };

  /// A prepared operation: checked arguments captured in `body`.
  template <class F>
  struct Op {
    const char* name;
    F body;
    std::size_t bytes = 0;  // this rank's buffers, for the flight recorder
  };
  template <class F>
  Op(const char*, F) -> Op<F>;
  template <class F>
  Op(const char*, F, std::size_t) -> Op<F>;

  explicit Communicator(std::shared_ptr<State> s) : state_(std::move(s)) {}

  /// checked(), and that this is the process that created the communicator: a fork() child
  /// shares its peers' shared memory and sockets, and using them would corrupt the parent's job.
  State& same_process(const char* what) const {
    State& s = checked();
    if (detail::fork_generation() != s.fork_generation) [[unlikely]] {
      detail::fail(Errc::invalid_argument, "rank ", s.backend->rank(), ": ", what,
                   ": this communicator was created by process ", s.pid,
                   " and cannot be used by a child it fork()ed (this is process ", ::getpid(),
                   "): the child would write into the parent's connections and shared memory. "
                   "Create a new communicator in the child (another MASTER_PORT or "
                   "Options::group), or fork before init()");
    }
    return s;
  }

  State& checked() const {
    if (!valid()) {
      detail::fail(
          Errc::invalid_argument,
          "this communicator is empty (moved from, or split() with no_color); it has no ranks");
    }
    return *state_;
  }

  /// Runs an operation unless the communicator is poisoned (then fails at once), and poisons it
  /// when the operation fails; keeps the flight recorder's entry `seq` up to date and dumps the
  /// recorder when the operation times out.
  template <class F>
  static void run_guarded(State& s, std::uint64_t seq, const char* name, const F& body) {
    using St = TraceRecord::State;
    s.recorder.update(seq, St::running);
    try {
      run_poisoning(s, name, body);
    } catch (const Error& e) {
      s.recorder.update(seq, St::failed);
      if (e.code() == Errc::timeout && !s.options.trace_dump.empty()) {
        detail::dump_trace(s.options.trace_dump, s.trace(e.what()), s.options.group,
                           s.backend->rank());
      }
      throw;
    } catch (...) {
      s.recorder.update(seq, St::failed);
      throw;
    }
    s.recorder.update(seq, St::done);
  }

  template <class F>
  static void run_poisoning(State& s, const char* name, const F& body) {
    {
      if (s.poisoned.load(std::memory_order_acquire)) {
        std::lock_guard lock(s.poison_mutex);
        detail::fail(Errc::aborted, "rank ", s.backend->rank(), ": ", name,
                     ": this communicator failed earlier and cannot be used (", s.poison,
                     "); create a new communicator (with another Options::group) to continue");
      }
    }
    try {
      body(*s.backend, s);
    } catch (const Error& e) {
      std::lock_guard lock(s.poison_mutex);
      if (s.poison.empty()) {
        s.poison = e.what();
        s.poison_code = e.code();
        s.poisoned.store(true, std::memory_order_release);
      }
      throw;
    } catch (...) {
      std::lock_guard lock(s.poison_mutex);
      if (s.poison.empty()) s.poison = "an operation threw a non-ddp exception";
      s.poisoned.store(true, std::memory_order_release);
      throw;
    }
  }

  /// Synchronous: inline when nothing is queued (no allocation on that path).
  template <class F>
  void exec(const Op<F>& op) {
    State& s = same_process(op.name);
    const auto seq = s.recorder.issue(op.name, op.bytes, TraceRecord::State::queued);
    s.executor->run([&] { run_guarded(s, seq, op.name, op.body); });
  }

  template <class F>
  Work submit(Op<F> op) {
    auto s = state_;
    same_process(op.name);
    const auto seq = s->recorder.issue(op.name, op.bytes, TraceRecord::State::queued);
    return Work(s->executor->submit(
        [s, seq, op = std::move(op)] { run_guarded(*s, seq, op.name, op.body); }));
  }

  /// Whether CUDA buffers given to a backend that moves host memory only are staged through
  /// pinned host memory (ddp built with CUDA) rather than refused.
  static bool stages_cuda() noexcept {
    return DDP_HAS_CUDA != 0 && Backend::supports(Device::cpu()) &&
           !Backend::supports(Device::cuda());
  }

  static bool staged(const detail::Buf& b) noexcept {
    return b.device.is_cuda() && b.data != nullptr && b.count != 0 && stages_cuda();
  }

  /// Runs f(buffer) for an elementwise collective, through the staging pipeline when `b` is a
  /// CUDA buffer this backend cannot use (see detail/staging.hpp).
  template <class F>
  static void elementwise(State& s, const detail::Buf& b, bool fetch, bool store, const F& f) {
    if (!staged(b)) return f(b);
#if DDP_HAS_CUDA
    const CudaDeviceGuard current(b.device.index);
    detail::stage_elementwise(s.stager_for(b.device.index), b, fetch, store,
                              s.options.cuda_staging_bytes, f);
#else
    (void)s, (void)fetch, (void)store;
#endif
  }

  /// Runs f(buffers...) with every CUDA buffer among `args` staged whole.
  template <class F, class... A>
  static void whole(State& s, const char* what, const F& f, A... args) {
    if (!(staged(args.buf) || ...)) return f(args.buf...);
#if DDP_HAS_CUDA
    int device = -1;
    for (const detail::StagedArg& a : {args...}) {
      if (!staged(a.buf)) continue;
      if (device >= 0 && a.buf.device.index != device) {
        detail::fail(Errc::invalid_argument, "rank ", s.backend->rank(), ": ", what,
                     ": the buffers are on cuda:", device, " and cuda:", a.buf.device.index,
                     "; staged collectives need them on one device");
      }
      device = a.buf.device.index;
    }
    const CudaDeviceGuard current(device);
    detail::stage_whole(s.stager_for(device), std::array<detail::StagedArg, sizeof...(A)>{args...},
                        f);
#else
    (void)s, (void)what;
#endif
  }

  template <class T>
  detail::Buf to_buf(T& t, const char* what, const char* arg) const {
    static_assert(!detail::host_type_for_device_backend<Backend, T>,
                  "ddp: this backend (backend::Nccl) moves CUDA device memory only, and this "
                  "buffer's type is host memory (std::vector, std::array, a span, ...): use "
                  "ddp::CudaBuffer<T> or a CUDA tensor type adapted with ddp::tensor_traits, or "
                  "Communicator<backend::Host> for host buffers");
    const auto v = ddp::view(t);
    if (!Backend::supports(v.device) && !(v.device.is_cuda() && stages_cuda())) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": `", arg, "` is on ",
                   to_string(v.device), ", but backend::", Backend::name,
                   " cannot use that memory");
    }
    if (v.data == nullptr && v.size != 0) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": `", arg, "` has ",
                   v.size, " elements but no data");
    }
    using E = typename decltype(v)::value_type;
    if (v.size > detail::max_buffer_bytes / sizeof(E)) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": `", arg, "` claims ",
                   v.size, " elements of ", sizeof(E),
                   " bytes: more than any buffer can hold (its size in bytes overflows); check "
                   "the size the tensor's view reports");
    }
    return {reinterpret_cast<std::byte*>(const_cast<E*>(v.data)), v.size, dtype_of<E>, v.device,
            v.stream};
  }

  void check_op(ReduceOp op, DType t, const char* what) const {
    if (!is_supported(op, t)) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": op ",
                   is_valid(op) ? to_string(op) : "invalid", " is not defined on ", to_string(t),
                   op == ReduceOp::avg ? " (avg needs a floating-point type)" : "");
    }
  }

  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size()) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": root ", root,
                   " is not a rank of this communicator [0, ", size(), ")");
    }
  }

  static void check_same_dtype(const detail::Buf& a, const detail::Buf& b, int rank,
                               const char* what) {
    if (a.dtype != b.dtype) {
      detail::fail(Errc::invalid_argument, "rank ", rank, ": ", what, ": `in` is ",
                   to_string(a.dtype), " but `out` is ", to_string(b.dtype),
                   "; they must have the same element type");
    }
  }

  template <class T>
  auto prepare_all_reduce(T& t, ReduceOp op) {
    auto b = to_buf(t, "all_reduce", "buf");
    check_op(op, b.dtype, "all_reduce");
    return Op{"all_reduce",
              [b, op](Backend& be, State& s) {
                elementwise(s, b, true, true, [&](const detail::Buf& h) { be.all_reduce(h, op); });
              },
              b.bytes()};
  }

  template <class W, class T>
  auto prepare_all_reduce_as(T& t, ReduceOp op) {
    auto b = to_buf(t, "all_reduce_as", "buf");
    check_op(op, dtype_of<W>, "all_reduce_as");
    if (b.dtype != DType::float32)
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": all_reduce_as: `buf` is ",
                   to_string(b.dtype), "; compression carries float32 values");
    if (b.device.is_cuda() && !staged(b))
      detail::fail(Errc::unsupported, "rank ", rank(), ": all_reduce_as: `buf` is on ",
                   to_string(b.device), ", which backend::", Backend::name,
                   " moves itself, and ddp's headers carry no GPU kernels to convert it; use "
                   "all_reduce, or convert on the device first");
    return Op{
        "all_reduce_as",
        [b, op](Backend& be, State& s) {
          elementwise(s, b, true, true, [&](const detail::Buf& h) {
            if constexpr (requires { be.all_reduce_as(h, op, dtype_of<W>); }) {
              be.all_reduce_as(h, op, dtype_of<W>);
            } else {  // convert around a plain all_reduce
              std::vector<W> wire(h.count);
              auto* w = reinterpret_cast<std::byte*>(wire.data());
              detail::encode_kernel<W>(w, h.data, h.count);
              be.all_reduce(detail::Buf{w, h.count, dtype_of<W>, h.device, nullptr, h.whole}, op);
              detail::decode_kernel<W>(h.data, w, h.count);
            }
          });
        },
        b.bytes()};
  }

  template <class R>
  auto prepare_all_reduce_coalesced(R& bufs, ReduceOp op) {
    std::vector<detail::Buf> bs;
    std::size_t bytes = 0;
    for (auto&& t : bufs) {
      bs.push_back(to_buf(t, "all_reduce_coalesced", "bufs"));
      check_op(op, bs.back().dtype, "all_reduce_coalesced");
      bytes += bs.back().bytes();
    }
    return Op{"all_reduce_coalesced",
              [bs = std::move(bs), op](Backend& be, State& s) {
                if constexpr (requires { be.all_reduce_many(bs, op); }) {
                  be.all_reduce_many(bs, op);
                } else {
                  for (const auto& b : bs) {
                    elementwise(s, b, true, true,
                                [&](const detail::Buf& h) { be.all_reduce(h, op); });
                  }
                }
              },
              bytes};
  }

  template <class T>
  auto prepare_broadcast(T& t, int root) {
    auto b = to_buf(t, "broadcast", "buf");
    check_root(root, "broadcast");
    return Op{"broadcast",
              [b, root](Backend& be, State& s) {
                const bool mine = be.rank() == root;
                elementwise(s, b, mine, !mine,
                            [&](const detail::Buf& h) { be.broadcast(h, root); });
              },
              b.bytes()};
  }

  template <class T>
  auto prepare_reduce(T& t, int root, ReduceOp op) {
    auto b = to_buf(t, "reduce", "buf");
    check_root(root, "reduce");
    check_op(op, b.dtype, "reduce");
    return Op{"reduce",
              [b, root, op](Backend& be, State& s) {
                elementwise(s, b, true, be.rank() == root,
                            [&](const detail::Buf& h) { be.reduce(h, root, op); });
              },
              b.bytes()};
  }

  template <class In, class Out>
  auto prepare_gather(detail::Coll c, In& in_t, Out& out_t, int root) {
    const char* what = c == detail::Coll::all_gather ? "all_gather" : "gather";
    auto in = to_buf(in_t, what, "in");
    if (root >= 0) check_root(root, what);
    const bool receives = root < 0 || root == rank();
    detail::Buf out{};
    if (receives) {
      out = to_buf(out_t, what, "out");
      check_same_dtype(in, out, rank(), what);
      const std::size_t p = static_cast<std::size_t>(size());
      if (!detail::is_product(out.count, in.count, p)) {
        detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": `out` has ", out.count,
                     " elements but must have ", detail::product_text(in.count, p),
                     " (in.size() x size())");
      }
      const std::byte* mine = out.at(in.count * static_cast<std::size_t>(rank()));
      if (detail::overlaps(in.data, in.bytes(), out.data, out.bytes()) && in.data != mine) {
        detail::fail(
            Errc::invalid_argument, "rank ", rank(), ": ", what,
            ": `in` overlaps `out` but is not this rank's block of it (the only in-place form)");
      }
    }
    return Op{what,
              [c, in, out, root, what](Backend& be, State& s) {
                whole(
                    s, what,
                    [&](const detail::Buf& i, const detail::Buf& o) {
                      if (c == detail::Coll::all_gather)
                        be.all_gather(i, o);
                      else
                        be.gather(i, o, root);
                    },
                    detail::StagedArg{in, true, false}, detail::StagedArg{out, false, true});
              },
              in.bytes() + out.bytes()};
  }

  template <class In, class Out>
  auto prepare_scatter(In& in_t, Out& out_t, int root) {
    auto out = to_buf(out_t, "scatter", "out");
    check_root(root, "scatter");
    detail::Buf in{nullptr, 0, out.dtype, out.device, nullptr};
    if (rank() == root) {
      in = to_buf(in_t, "scatter", "in");
      check_same_dtype(in, out, rank(), "scatter");
      const std::size_t p = static_cast<std::size_t>(size());
      if (!detail::is_product(in.count, out.count, p)) {
        detail::fail(Errc::invalid_argument, "rank ", rank(), ": scatter: `in` has ", in.count,
                     " elements but must have ", detail::product_text(out.count, p),
                     " (out.size() x size())");
      }
      const std::byte* mine = in.at(out.count * static_cast<std::size_t>(rank()));
      if (detail::overlaps(in.data, in.bytes(), out.data, out.bytes()) && out.data != mine) {
        detail::fail(Errc::invalid_argument, "rank ", rank(),
                     ": scatter: `out` overlaps `in` but is not this rank's block of it (the only "
                     "in-place form)");
      }
    }
    return Op{"scatter",
              [in, out, root](Backend& be, State& s) {
                whole(
                    s, "scatter",
                    [&](const detail::Buf& i, const detail::Buf& o) { be.scatter(i, o, root); },
                    detail::StagedArg{in, true, false}, detail::StagedArg{out, false, true});
              },
              in.bytes() + out.bytes()};
  }

  template <class In, class Out>
  auto prepare_reduce_scatter(In& in_t, Out& out_t, ReduceOp op) {
    auto in = to_buf(in_t, "reduce_scatter", "in");
    auto out = to_buf(out_t, "reduce_scatter", "out");
    check_same_dtype(in, out, rank(), "reduce_scatter");
    check_op(op, out.dtype, "reduce_scatter");
    const std::size_t p = static_cast<std::size_t>(size());
    if (!detail::is_product(in.count, out.count, p)) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": reduce_scatter: `in` has ", in.count,
                   " elements but must have ", detail::product_text(out.count, p),
                   " (out.size() x size())");
    }
    const std::byte* mine = in.at(out.count * static_cast<std::size_t>(rank()));
    if (detail::overlaps(in.data, in.bytes(), out.data, out.bytes()) && out.data != mine) {
      detail::fail(Errc::invalid_argument, "rank ", rank(),
                   ": reduce_scatter: `out` overlaps `in` but is not this rank's block of it (the "
                   "only in-place form)");
    }
    return Op{
        "reduce_scatter",
        [in, out, op](Backend& be, State& s) {
          whole(
              s, "reduce_scatter",
              [&](const detail::Buf& i, const detail::Buf& o) { be.reduce_scatter(i, o, op); },
              detail::StagedArg{in, true, false}, detail::StagedArg{out, false, true});
        },
        in.bytes() + out.bytes()};
  }

  template <class In, class Out>
  auto prepare_all_to_all(In& in_t, Out& out_t) {
    auto in = to_buf(in_t, "all_to_all", "in");
    auto out = to_buf(out_t, "all_to_all", "out");
    check_same_dtype(in, out, rank(), "all_to_all");
    const std::size_t p = static_cast<std::size_t>(size());
    if (in.count != out.count || in.count % p != 0) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": all_to_all: `in` (", in.count,
                   ") and `out` (", out.count,
                   ") must have the same number of elements, a multiple of size() = ", p);
    }
    if (detail::overlaps(in.data, in.bytes(), out.data, out.bytes())) {
      detail::fail(Errc::invalid_argument, "rank ", rank(),
                   ": all_to_all: `in` and `out` must not overlap");
    }
    return Op{"all_to_all",
              [in, out](Backend& be, State& s) {
                whole(
                    s, "all_to_all",
                    [&](const detail::Buf& i, const detail::Buf& o) { be.all_to_all(i, o); },
                    detail::StagedArg{in, true, false}, detail::StagedArg{out, false, true});
              },
              in.bytes() + out.bytes()};
  }

  template <class T>
  auto prepare_p2p(detail::Coll c, T& t, int peer, int tag) {
    const char* what = c == detail::Coll::send ? "send" : "recv";
    auto b = to_buf(t, what, "buf");
    if (peer < 0 || peer >= size() || peer == rank()) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": peer ", peer,
                   " must be another rank in [0, ", size(), ")");
    }
    if (tag < 0)
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": tag ", tag,
                   " is negative");
    const bool sending = c == detail::Coll::send;
    return Op{what,
              [b, peer, tag, sending, what](Backend& be, State& s) {
                whole(
                    s, what,
                    [&](const detail::Buf& h) {
                      if (sending)
                        be.send(h, peer, tag);
                      else
                        be.recv(h, peer, tag);
                    },
                    detail::StagedArg{b, sending, !sending});
              },
              b.bytes()};
  }

  static constexpr std::int64_t max_object_bytes = std::int64_t{1} << 30;

  void check_object_size(std::int64_t n, const char* what, int from) const {
    if (n < 0 || n > max_object_bytes) {
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": ", what, ": rank ", from,
                   "'s object encodes to ", n, " bytes, beyond the limit of ", max_object_bytes);
    }
  }

  /// Runs f(a, b) on host spans; on a backend that moves device memory only, on device copies of
  /// them instead, copied back afterwards. For small host data (object collectives, *_host).
  template <class E, class F>
  void on_host_data(std::span<E> a, std::span<E> b, const F& f) {
    if constexpr (detail::device_only_backend<Backend>) {
#if DDP_HAS_CUDA
      const int device = backend().device();
      const CudaDeviceGuard current(device);
      CudaBuffer<E> da(std::span<const E>(a), device), db(std::span<const E>(b), device);
      f(da, db);
      if (!a.empty()) da.copy_to(a);
      if (!b.empty()) db.copy_to(b);
#else
      static_assert(!detail::device_only_backend<Backend>, "a CUDA backend without DDP_HAS_CUDA");
#endif
    } else {
      f(a, b);
    }
  }

  template <class T>
  std::vector<T> gather_objects(const T& value, int root) {
    const char* what = root < 0 ? "all_gather_object" : "gather_object";
    if (root >= 0) check_root(root, what);
    const std::string mine = detail::encode_object(value);
    const auto p = static_cast<std::size_t>(size());
    std::vector<std::int64_t> sizes(p);
    std::int64_t my_size = static_cast<std::int64_t>(mine.size());
    on_host_data(std::span<std::int64_t>(&my_size, 1), std::span<std::int64_t>(sizes),
                 [&](auto& in, auto& out) { all_gather(in, out); });
    std::int64_t longest = 0;
    for (std::size_t r = 0; r < p; ++r) {
      check_object_size(sizes[r], what, static_cast<int>(r));
      longest = std::max(longest, sizes[r]);
    }
    const auto width = static_cast<std::size_t>(longest);
    std::vector<std::uint8_t> padded(width);
    std::memcpy(padded.data(), mine.data(), mine.size());
    const bool receives = root < 0 || root == rank();
    std::vector<std::uint8_t> all(receives ? width * p : 0);
    on_host_data(std::span<std::uint8_t>(padded), std::span<std::uint8_t>(all),
                 [&](auto& in, auto& out) {
                   if (root < 0)
                     all_gather(in, out);
                   else
                     gather(in, out, root);
                 });
    std::vector<T> out;
    if (!receives) return out;
    out.reserve(p);
    for (std::size_t r = 0; r < p; ++r) {
      out.push_back(
          detail::decode_object<T>(all.data() + r * width, static_cast<std::size_t>(sizes[r])));
    }
    return out;
  }

  std::shared_ptr<State> state_;
};

DDP_END_NAMESPACE
