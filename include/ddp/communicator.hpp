// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Communicator<Backend>: a process group with every collective of torch.distributed,
/// typed (any ddp::TensorLike buffer), checked before anything is sent, with an _async twin for
/// each collective (returning ddp::Work, see work.hpp), and split().
///
/// Each typed argument becomes a detail::Buf (the only code compiled per tensor type); the rest
/// of its way runs down through comm/ (checks, the runner, dispatch, init) to the backend.
///
/// Operations on one communicator run one at a time, in the order they were issued, whichever
/// thread issued them. A synchronous call with nothing queued runs in the calling thread (no
/// hand-off, no lock); async calls run on the communicator's worker thread. Buffers given to an
/// async call must stay alive and untouched until its Work completes.
///
/// After a collective fails (timeout, a lost peer, a mismatch, abort()), the communicator is
/// unusable: every later call fails at once with Errc::aborted naming the first failure; the
/// ranks still alive go on together with shrink(), a communicator of the survivors.

#include "ddp/backend/backend.hpp"
#include "ddp/comm/arguments.hpp"
#include "ddp/comm/dispatch.hpp"
#include "ddp/comm/init.hpp"
#include "ddp/comm/runner.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/comm/call.hpp"
#include "ddp/comm/objects.hpp"
#include "ddp/comm/state.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/membership/rendezvous.hpp"
#include "ddp/observe/recorder.hpp"
#include "ddp/options.hpp"
#include "ddp/process_group.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"
#include "ddp/work.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// A process group over `Backend` (backend::Host, backend::Mpi or backend::Nccl): every
/// collective of torch.distributed on typed buffers, each with an _async twin that returns a
/// Work. Made by init() (or split()); move-only.
template <CommBackend Backend>
class Communicator {
 public:
  using backend_type = Backend;  ///< The backend that moves the data.
  /// The backend moves CUDA device memory only (backend::Nccl): host data travels through a
  /// device copy in the object collectives and *_host helpers.
  static constexpr bool device_only = backend_traits<Backend>::device_only;
  /// split() color for ranks that join no group (MPI_UNDEFINED).
  static constexpr int no_color = -1;

  /// Joins the process group described by `env`: rank 0 starts the rendezvous store at
  /// MASTER_ADDR:MASTER_PORT (unless a launcher hosts it), every rank connects, and the backend
  /// connects the ranks. A world of one needs no store.
  [[nodiscard]] static Communicator init(const Environment& env = Environment::detect(),
                                         Options options = {});

  /// Takes over `other`'s process group; `other` is left invalid.
  Communicator(Communicator&&) noexcept = default;
  /// Takes over `other`'s process group, releasing the one this communicator held.
  Communicator& operator=(Communicator&&) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator();

  /// False for the result of split() with no_color.
  [[nodiscard]] bool valid() const noexcept { return state_ && state_->backend; }
  /// This process's rank in the group, 0 .. size()-1.
  [[nodiscard]] int rank() const { return backend().rank(); }
  /// The number of ranks in the group.
  [[nodiscard]] int size() const { return backend().size(); }
  /// This process's rank among the group's ranks on this host.
  [[nodiscard]] int local_rank() const { return backend().local_rank(); }
  /// The number of the group's ranks on this host.
  [[nodiscard]] int local_size() const { return backend().local_size(); }
  /// The options the communicator was made with (after the DDP_* environment overrides).
  [[nodiscard]] const Options& options() const { return checked().options; }
  /// The backend, for backend-specific queries (e.g. backend().transport()).
  [[nodiscard]] Backend& backend() const { return *checked().backend; }

  // ---- collectives -------------------------------------------------------------------------

  /// Reduces `buf` over all ranks, in place (every rank gets the result).
  template <detail::tensor_output T>
  void all_reduce(T&& buf, Reduction op = ReduceOp::sum) {
    exec_single(detail::Coll::all_reduce, buf, op, 0);
  }
  /// all_reduce(), run asynchronously: returns at once. The buffers must outlive the Work,
  /// unless their type shares its storage (torch::Tensor: see ddp::tensor_traits), which the
  /// Work keeps alive until the operation has finished.
  template <detail::tensor_output T>
  [[nodiscard]] Work all_reduce_async(T&& buf, Reduction op = ReduceOp::sum) {
    return submit(detail::prepare_single(detail::Coll::all_reduce, arg(buf, "all_reduce", "buf"),
                                         op, 0, caller()),
                  {}, detail::hold(buf));
  }

  /// all_reduce of float32 values that travel and are reduced as W (ddp::half or ddp::bfloat16):
  /// half the bytes, for a result rounded to W (torch's fp16/bf16 compression hooks). The result
  /// is bitwise that of converting to W, all_reduce on W (accumulating in float, in rank order)
  /// and converting back; backend::Host fuses the conversions into its own passes over memory,
  /// other host-memory backends convert around a plain all_reduce. Not available for buffers
  /// that backend::Nccl moves (Errc::unsupported: ddp's headers carry no GPU kernels).
  template <class W, detail::tensor_output T>
    requires(std::is_same_v<W, half> || std::is_same_v<W, bfloat16>)
  void all_reduce_as(T&& buf, Reduction op = ReduceOp::sum) {
    exec(prepare_all_reduce_as(arg(buf, "all_reduce_as", "buf"), op, dtype_of<W>));
  }
  /// all_reduce_as(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <class W, detail::tensor_output T>
    requires(std::is_same_v<W, half> || std::is_same_v<W, bfloat16>)
  [[nodiscard]] Work all_reduce_as_async(T&& buf, Reduction op = ReduceOp::sum) {
    return submit(prepare_all_reduce_as(arg(buf, "all_reduce_as", "buf"), op, dtype_of<W>), {},
                  detail::hold(buf));
  }
  /// all_reduce_as_async() with the wire type as a value, DType::float16 or DType::bfloat16 (how
  /// the compression comm hooks carry it).
  template <MutableTensor T>
  [[nodiscard]] Work all_reduce_as_async(T&& buf, DType wire, Reduction op = ReduceOp::sum) {
    if (wire != DType::float16 && wire != DType::bfloat16)
      detail::fail(Errc::invalid_argument, "rank ", rank(), ": all_reduce_as: the wire type is ",
                   to_string(wire), "; compressed values travel as float16 or bfloat16");
    return submit(prepare_all_reduce_as(arg(buf, "all_reduce_as", "buf"), op, wire), {},
                  detail::hold(buf));
  }

  /// all_reduce of several buffers as one operation (torch's all_reduce_coalesced): one NCCL
  /// group on backend::Nccl (one launch, one wait), one buffer after another elsewhere.
  template <std::ranges::range R>
    requires detail::tensor_output<std::ranges::range_reference_t<R>>
  void all_reduce_coalesced(R&& bufs, Reduction op = ReduceOp::sum) {
    const auto b = detail::to_bufs<Backend>(bufs, rank(), "all_reduce_coalesced");
    exec(detail::prepare_all_reduce_coalesced(b, op, caller()));
  }
  /// all_reduce_coalesced(), run asynchronously: the buffers must outlive the returned Work.
  template <std::ranges::range R>
    requires detail::tensor_output<std::ranges::range_reference_t<R>>
  [[nodiscard]] Work all_reduce_coalesced_async(R&& bufs, Reduction op = ReduceOp::sum) {
    auto b = detail::to_bufs<Backend>(bufs, rank(), "all_reduce_coalesced");
    const auto call = detail::prepare_all_reduce_coalesced(b, op, caller());
    detail::Holds held;
    for (auto&& t : bufs) detail::hold_into(held, t);
    return submit(call, std::move(b), std::move(held));
  }

  /// Copies root's `buf` to every rank.
  template <detail::tensor_output T>
  void broadcast(T&& buf, int root = 0) {
    exec_single(detail::Coll::broadcast, buf, ReduceOp::sum, root);
  }
  /// broadcast(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_output T>
  [[nodiscard]] Work broadcast_async(T&& buf, int root = 0) {
    return submit(detail::prepare_single(detail::Coll::broadcast, arg(buf, "broadcast", "buf"),
                                         ReduceOp::sum, root, caller()),
                  {}, detail::hold(buf));
  }

  /// Reduces `buf` over all ranks into root's `buf`; the other ranks' buffers are unchanged.
  template <detail::tensor_output T>
  void reduce(T&& buf, int root = 0, Reduction op = ReduceOp::sum) {
    exec_single(detail::Coll::reduce, buf, op, root);
  }
  /// reduce(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_output T>
  [[nodiscard]] Work reduce_async(T&& buf, int root = 0, Reduction op = ReduceOp::sum) {
    return submit(
        detail::prepare_single(detail::Coll::reduce, arg(buf, "reduce", "buf"), op, root, caller()),
        {}, detail::hold(buf));
  }

  /// out[r*n .. r*n+n) = rank r's `in` (n = in's size); out.size() == in.size() * size().
  /// In place when `in` is exactly this rank's block of `out`.
  template <detail::tensor_input In, detail::tensor_output Out>
  void all_gather(In&& in, Out&& out) {
    exec(prepare_gather(in, out, -1));
  }
  /// all_gather(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work all_gather_async(In&& in, Out&& out) {
    return submit(prepare_gather(in, out, -1), {}, detail::hold(in, out));
  }

  /// Like all_gather, into root's `out` only (`out` is not used on the other ranks).
  template <detail::tensor_input In, detail::tensor_output Out>
  void gather(In&& in, Out&& out, int root = 0) {
    exec(prepare_gather(in, out, root));
  }
  /// gather(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work gather_async(In&& in, Out&& out, int root = 0) {
    return submit(prepare_gather(in, out, root), {}, detail::hold(in, out));
  }

  /// Rank r receives root's in[r*n .. r*n+n) into `out` (n = out's size; `in` used on root only).
  template <detail::tensor_input In, detail::tensor_output Out>
  void scatter(In&& in, Out&& out, int root = 0) {
    exec(prepare_scatter(in, out, root));
  }
  /// scatter(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work scatter_async(In&& in, Out&& out, int root = 0) {
    return submit(prepare_scatter(in, out, root), {}, detail::hold(in, out));
  }

  /// out = block r of the reduction of every rank's `in`; in.size() == out.size() * size().
  template <detail::tensor_input In, detail::tensor_output Out>
  void reduce_scatter(In&& in, Out&& out, Reduction op = ReduceOp::sum) {
    exec(detail::prepare_reduce_scatter(arg(in, "reduce_scatter", "in"),
                                        arg(out, "reduce_scatter", "out"), op, caller()));
  }
  /// reduce_scatter(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work reduce_scatter_async(In&& in, Out&& out, Reduction op = ReduceOp::sum) {
    return submit(detail::prepare_reduce_scatter(arg(in, "reduce_scatter", "in"),
                                                 arg(out, "reduce_scatter", "out"), op, caller()),
                  {}, detail::hold(in, out));
  }

  /// Block j of `in` goes to rank j, which stores it as its block r of `out`.
  template <detail::tensor_input In, detail::tensor_output Out>
  void all_to_all(In&& in, Out&& out) {
    exec(detail::prepare_all_to_all(arg(in, "all_to_all", "in"), arg(out, "all_to_all", "out"),
                                    caller()));
  }
  /// all_to_all(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work all_to_all_async(In&& in, Out&& out) {
    return submit(detail::prepare_all_to_all(arg(in, "all_to_all", "in"),
                                             arg(out, "all_to_all", "out"), caller()),
                  {}, detail::hold(in, out));
  }

  // ---- uneven sizes: a count per rank (backend/uneven.hpp) ------------------------------------
  // Every rank's counts must match the others' (what rank i sends to rank j is what rank j
  // expects from rank i): checked on every rank before any data moves, failing with
  // Errc::mismatch naming the pair. Blocks lie in rank order, each right after the one before.

  /// all_to_all with split sizes (torch's all_to_all_single with split sizes, MPI_Alltoallv):
  /// in_counts[j] elements of `in` go to rank j; out_counts[j] elements from rank j land in `out`.
  template <detail::tensor_input In, detail::tensor_output Out>
  void all_to_all(In&& in, Out&& out, Counts in_counts, Counts out_counts) {
    const auto counts = joined(in_counts, out_counts);
    exec(prepare_uneven(detail::Coll::all_to_all_v, in, out, counts, -1));
  }
  /// all_to_all() with split sizes, run asynchronously (the counts are copied).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work all_to_all_async(In&& in, Out&& out, Counts in_counts, Counts out_counts) {
    return uneven_async(detail::Coll::all_to_all_v, in, out, joined(in_counts, out_counts), -1);
  }
  /// all_gather with a count per rank (MPI_Allgatherv): rank j's `in` (counts[j] elements) into
  /// every rank's `out`.
  template <detail::tensor_input In, detail::tensor_output Out>
  void all_gather(In&& in, Out&& out, Counts counts) {
    exec(prepare_uneven(detail::Coll::all_gather_v, in, out, counts, -1));
  }
  /// The same, run asynchronously (the counts are copied).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work all_gather_async(In&& in, Out&& out, Counts counts) {
    return uneven_async(detail::Coll::all_gather_v, in, out, counts.span(), -1);
  }
  /// gather with a count per rank (MPI_Gatherv): `out` and `counts` are read on the root only.
  template <detail::tensor_input In, detail::tensor_output Out>
  void gather(In&& in, Out&& out, Counts counts, int root = 0) {
    exec(prepare_uneven(detail::Coll::gather_v, in, out, counts, root));
  }
  /// The same, run asynchronously (the counts are copied).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work gather_async(In&& in, Out&& out, Counts counts, int root = 0) {
    return uneven_async(detail::Coll::gather_v, in, out, counts.span(), root);
  }
  /// scatter with a count per rank (MPI_Scatterv): counts[j] elements of root's `in` into rank
  /// j's `out`; `in` and `counts` are read on the root only.
  template <detail::tensor_input In, detail::tensor_output Out>
  void scatter(In&& in, Out&& out, Counts counts, int root = 0) {
    exec(prepare_uneven(detail::Coll::scatter_v, in, out, counts, root));
  }
  /// The same, run asynchronously (the counts are copied).
  template <detail::tensor_input In, detail::tensor_output Out>
  [[nodiscard]] Work scatter_async(In&& in, Out&& out, Counts counts, int root = 0) {
    return uneven_async(detail::Coll::scatter_v, in, out, counts.span(), root);
  }

  /// Point-to-point. Between a pair, sends and receives match in issue order; the receiver checks
  /// the tag, dtype and count.
  template <detail::tensor_input T>
  void send(T&& buf, int peer, int tag = 0) {
    exec(detail::prepare_p2p(detail::Coll::send, arg(buf, "send", "buf"), peer, tag, caller()));
  }
  /// send(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_input T>
  [[nodiscard]] Work send_async(T&& buf, int peer, int tag = 0) {
    return submit(
        detail::prepare_p2p(detail::Coll::send, arg(buf, "send", "buf"), peer, tag, caller()), {},
        detail::hold(buf));
  }
  /// Receives into `buf` the next send() from `peer`; its tag, dtype and count must match.
  template <detail::tensor_output T>
  void recv(T&& buf, int peer, int tag = 0) {
    exec(detail::prepare_p2p(detail::Coll::recv, arg(buf, "recv", "buf"), peer, tag, caller()));
  }
  /// recv(), run asynchronously: returns at once; the buffers must outlive the Work (see
  /// all_reduce_async).
  template <detail::tensor_output T>
  [[nodiscard]] Work recv_async(T&& buf, int peer, int tag = 0) {
    return submit(
        detail::prepare_p2p(detail::Coll::recv, arg(buf, "recv", "buf"), peer, tag, caller()), {},
        detail::hold(buf));
  }

  /// torch's batch_isend_irecv: the sends and receives of `ops` as one operation, run
  /// asynchronously (the Work completes when all have). They run pair by pair in an order that
  /// cannot deadlock whatever the peers' batches hold (each op needs its match on the peer, in
  /// a batch or a plain send/recv); they are not overlapped. Each op is checked as send and
  /// recv are, before anything is sent.
  [[nodiscard]] Work batch_isend_irecv(std::span<const P2POp> ops) {
    auto b = detail::prepare_batch_args<Backend>(ops, caller());
    return submit(b.call, std::move(b.bufs), {}, std::move(b.specs));
  }

  /// Returns once every rank has entered barrier().
  void barrier() { exec(detail::prepare_barrier()); }
  /// barrier(), run asynchronously: the Work completes once every rank has entered it.
  [[nodiscard]] Work barrier_async() { return submit(detail::prepare_barrier()); }

  /// A barrier that names the ranks that did not reach it within `timeout` (default:
  /// Options::timeout): torch's monitored_barrier. Rank 0 waits for every rank and fails with
  /// Errc::timeout naming the first missing rank (every one with `wait_all_ranks`); the others
  /// fail quoting it. Goes through the rendezvous store (backend::Host and backend::Nccl); on
  /// backend::Mpi, through MPI point-to-point messages.
  void monitored_barrier(std::chrono::milliseconds timeout = {}, bool wait_all_ranks = false);

  // ---- layered on the collectives (comm/objects.hpp) ------------------

  /// all_reduce of a few host values on any backend (through a device copy on a backend that moves
  /// device memory only).
  template <Scalar E>
  void all_reduce_host(std::span<E> values, ReduceOp op = ReduceOp::sum) {
    detail::all_reduce_host(*this, values, op);
  }
  /// broadcast of a few host values on any backend (see all_reduce_host).
  template <Scalar E>
  void broadcast_host(std::span<E> values, int root) {
    detail::broadcast_host(*this, values, root);
  }
  /// Every rank's value, in rank order.
  template <Encodable T>
  [[nodiscard]] std::vector<T> all_gather_object(const T& value) {
    return detail::all_gather_object(*this, value);
  }
  /// Every rank's value on root (in rank order); an empty vector on the other ranks.
  template <Encodable T>
  [[nodiscard]] std::vector<T> gather_object(const T& value, int root = 0) {
    return detail::gather_object(*this, value, root);
  }
  /// Replaces `value` on every rank with root's.
  template <Encodable T>
  void broadcast_object(T& value, int root = 0) {
    detail::broadcast_object(*this, value, root);
  }
  /// Rank j gets objects[j] of root's `objects` (one per rank; read on the root only): torch's
  /// scatter_object_list.
  template <Encodable T>
  [[nodiscard]] T scatter_object(const std::vector<T>& objects, int root = 0) {
    return detail::scatter_object(*this, objects, root);
  }

  // ---- groups and failure ------------------------------------------------------------------

  /// MPI_Comm_split: ranks passing the same color form a communicator, ordered by (key, rank).
  /// Ranks passing no_color get an invalid communicator. Collective over this communicator. The
  /// new communicator has this one's Options.
  [[nodiscard]] Communicator split(int color, int key = 0) { return split(color, key, options()); }

  /// split() with the new communicator's own `options` (torch's new_group(timeout=...)): its
  /// timeout, verify_collectives, flight recorder and, on backend::Host, its transport settings;
  /// DDP_* settings apply to the fields left at their defaults, as at init(). Group, token and
  /// store are this communicator's. Every member should pass the same options
  /// (verify_collectives must agree: it is checked).
  [[nodiscard]] Communicator split(int color, int key, const Options& given);

  /// Fault tolerance: after a failure (Errc::peer_lost, or a timeout the caller treats as a
  /// loss), the surviving ranks each call shrink() and get a communicator of themselves, ranked
  /// 0..n-1 in the order of their old ranks, at the next membership epoch; its previous_ranks()
  /// maps them back. The survivors agree through the rendezvous store (membership/agreement.hpp):
  /// a rank that died is left out at once, one that neither arrives nor dies within
  /// ShrinkOptions::wait_for_ranks is left out and fenced (on waking, each of its calls fails
  /// with Errc::aborted naming the epoch), and a member that fails while they connect costs one
  /// more round. This communicator fails every call afterwards. Needs a store that outlives the
  /// lost rank (ddprun's, spawn's, etcd's; rank 0's while rank 0 lives). backend::Host and
  /// backend::Nccl (a new NCCL communicator); backend::Mpi with ULFM (MPIX_Comm_shrink: the
  /// library decides who is lost, `options` are not used), Errc::unsupported without it.
  [[nodiscard]] Communicator shrink(const ShrinkOptions& options = {});
  /// Admits the processes waiting to enter (enter()), at a step boundary: every member calls it,
  /// and gets the communicator of the members (ranks 0..n-1, in their order) and the newcomers
  /// (n.., in the order they asked), at the next membership epoch; or, when none was admitted,
  /// this one. Rank 0 answers each request: refused when its ticket differs from
  /// `options.ticket` (Errc::mismatch) or it claims a live rank's place (Errc::invalid_argument),
  /// the refusal reaching the newcomer alone. A failure meanwhile (a newcomer or member died)
  /// leaves this communicator as it was: shrink() it. backend::Host and backend::Nccl;
  /// Errc::unsupported on backend::Mpi (MPI cannot add processes to a running job here).
  [[nodiscard]] Communicator grow(const GrowOptions& options = {});
  /// A process enters a running job (a restarted worker, or an added one): asks to be admitted
  /// as world rank env.rank (its own, after a restart: refused while that rank's process lives),
  /// waits until the members' next grow() admits it (EnterOptions::wait), and returns its
  /// communicator with them. Then it receives their state (TrainingState::restore). Refusals
  /// and a wrong token fail this process alone. (`join` is its older name; ddp::Join is uneven
  /// inputs.)
  [[nodiscard]] static Communicator enter(const Environment& env = Environment::detect(),
                                          const Options& options = {}, const EnterOptions& e = {});
  /// enter()'s older name.
  [[deprecated(
      "renamed Communicator::enter (ddp::Join is uneven "
      "inputs)")]] [[nodiscard]] static Communicator
  join(const Environment& env = Environment::detect(), const Options& options = {},
       const EnterOptions& e = {}) {
    return enter(env, options, e);
  }
  /// How many processes wait to enter (one store read; not collective: for an agreed decision
  /// use TrainingState::entering()). 0 without a store.
  [[nodiscard]] int waiting_to_enter() const { return checked().waiting_to_enter(); }
  /// waiting_to_enter()'s older name.
  [[deprecated("renamed Communicator::waiting_to_enter()")]] [[nodiscard]] int waiting_to_join()
      const {
    return waiting_to_enter();
  }
  /// Membership epoch: 0 for a communicator from init() or split(), one more for each change.
  [[nodiscard]] std::uint64_t epoch() const { return checked().epoch; }
  /// After shrink() or grow(): each rank's number in the communicator it was made from (-1: a
  /// newcomer); empty before.
  [[nodiscard]] const std::vector<int>& previous_ranks() const { return checked().previous; }

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
  void abort(const std::string& why = "Communicator::abort() was called");

 private:
  /// The communicator's state (comm/runner.hpp).
  using State = detail::CommRunner<Backend, Communicator>;

  explicit Communicator(std::shared_ptr<State> s) : state_(std::move(s)) {}

  /// checked(), and that this is the process that created the communicator: a fork() child
  /// shares its peers' shared memory and sockets, and using them would corrupt the parent's job.
  State& same_process(const char* what) const {
    State& s = checked();
    s.check_process(s.backend->rank(), what);
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

  /// Synchronous.
  void exec(const detail::Call& c);

  /// Synchronous all_reduce, broadcast and reduce without a Call (dispatch()'s checks and code,
  /// minus a 150-byte description where the library's own cost shows most: small messages).
  template <class T>
  void exec_single(detail::Coll coll, T& buf, Reduction op, int root) {
    exec_single_buf(coll, arg(buf, detail::single_name(coll), "buf"), op, root);
  }
  /// exec_single's part that does not depend on the tensor type: compiled once per backend in
  /// the separate-compilation mode (ddp/instances.hpp).
  void exec_single_buf(detail::Coll coll, const detail::Buf& b, Reduction op, int root);

  /// Asynchronous (CommRunner::submit).
  Work submit(const detail::Call& c, std::vector<detail::Buf> many = {}, detail::Holds held = {},
              std::vector<std::size_t> counts = {});

  /// An operation that is not a collective call (split).
  template <class F>
  void exec_fn(const char* name, const F& body) {
    same_process(name).run_in_order(name, 0, body);
  }

  // ---- arguments -----------------------------------------------------------------------------

  [[nodiscard]] detail::Caller caller() const { return detail::caller_of(backend()); }

  /// A typed argument as a checked type-erased buffer (comm/arguments.hpp).
  template <class T>
  detail::Buf arg(T& t, const char* what, const char* name) const {
    return detail::to_buf<Backend>(t, rank(), what, name);
  }

  detail::Call prepare_all_reduce_as(const detail::Buf& b, Reduction op, DType wire) const {
    return detail::prepare_all_reduce_as(
        b, op, wire, b.device.is_cuda() && !detail::staged<Backend>(b), Backend::name, caller());
  }

  /// all_to_all's in_counts then out_counts, one per rank each.
  std::vector<std::size_t> joined(std::span<const std::size_t> a,
                                  std::span<const std::size_t> b) const {
    return detail::joined_counts(a, b, caller());
  }
  template <class In, class Out>
  detail::Call prepare_uneven(detail::Coll coll, In& in, Out& out,
                              std::span<const std::size_t> counts, int root) const {
    return detail::prepare_uneven_args<Backend>(coll, in, out, counts, root, caller());
  }
  template <class In, class Out>
  Work uneven_async(detail::Coll coll, In& in, Out& out, std::span<const std::size_t> counts,
                    int root) {
    return submit(prepare_uneven(coll, in, out, counts, root), {}, detail::hold(in, out),
                  {counts.begin(), counts.end()});
  }
  template <class In, class Out>
  detail::Call prepare_gather(In& in, Out& out, int root) const {
    return detail::prepare_gather_args<Backend>(in, out, root, caller());
  }
  template <class In, class Out>
  detail::Call prepare_scatter(In& in, Out& out, int root) const {
    return detail::prepare_scatter_args<Backend>(in, out, root, caller());
  }

  std::shared_ptr<State> state_;
};

// Outside the class, so that `extern template` (ddp/instances.hpp) keeps them out of other units.
template <CommBackend Backend>
Communicator<Backend>& Communicator<Backend>::operator=(Communicator&&) noexcept = default;
template <CommBackend Backend>
Communicator<Backend>::~Communicator() = default;
template <CommBackend Backend>
Communicator<Backend> Communicator<Backend>::init(const Environment& env, Options options) {
  return Communicator(detail::init_state<State>(env, std::move(options)));
}
template <CommBackend Backend>
void Communicator<Backend>::monitored_barrier(std::chrono::milliseconds timeout,
                                              bool wait_all_ranks) {
  if (timeout.count() <= 0) timeout = options().timeout;
  exec_fn("monitored_barrier", [&](Backend& be, State& st) {
    detail::run_monitored_barrier(be, st, timeout, wait_all_ranks);
  });
}
template <CommBackend Backend>
Communicator<Backend> Communicator<Backend>::split(int color, int key, const Options& given) {
  const Options options = given.with_env();
  if (color < no_color) {
    detail::fail(Errc::invalid_argument, "rank ", rank(), ": split: color ", color,
                 " is negative (use no_color)");
  }
  if constexpr (backend_traits<Backend>::splits)
    return Communicator(detail::split_backend(same_process("split"), color, key, options));
  const auto all = all_gather_object(std::pair<int, int>{color, key});
  const std::uint64_t n = checked().splits++;
  if (color == no_color) return Communicator(nullptr);
  std::shared_ptr<State> sub;
  exec_fn("split", [&](Backend&, State& s) {
    sub = detail::split_state(s, all, color, rank(), n, options);
  });
  return Communicator(std::move(sub));
}
template <CommBackend Backend>
Communicator<Backend> Communicator<Backend>::shrink(const ShrinkOptions& options) {
  State& s = same_process("shrink");
  if constexpr (backend_traits<Backend>::shrinks) {
    (void)options;
    return Communicator(detail::shrink_backend(s, rank()));
  } else {
    detail::refuse_membership<Backend>(rank(), "shrink");
    return Communicator(detail::shrink_state(s, rank(), size(), options));
  }
}
template <CommBackend Backend>
Communicator<Backend> Communicator<Backend>::grow(const GrowOptions& options) {
  State& s = same_process("grow");
  detail::refuse_membership<Backend>(rank(), "grow");
  auto grown = detail::grow_state(s, rank(), options);
  return grown ? Communicator(std::move(grown)) : Communicator(state_);
}
template <CommBackend Backend>
Communicator<Backend> Communicator<Backend>::enter(const Environment& env, const Options& options,
                                                   const EnterOptions& e) {
  detail::refuse_membership<Backend>(env.rank, "enter");
  return Communicator(detail::enter_state<State>(env, options, e));
}
template <CommBackend Backend>
void Communicator<Backend>::abort(const std::string& why) {
  auto& s = same_process("abort");
  s.poison_with(detail::concat("rank ", s.backend->rank(), ": aborted: ", why), Errc::aborted);
  s.backend->abort(Errc::aborted, why);
}
template <CommBackend Backend>
void Communicator<Backend>::exec(const detail::Call& c) {
  same_process(c.name).run_in_order(
      c.name, c.bytes, [&](Backend& be, State& st) { detail::dispatch(be, st, c); }, c.root);
}
template <CommBackend Backend>
void Communicator<Backend>::exec_single_buf(detail::Coll coll, const detail::Buf& b, Reduction op,
                                            int root) {
  const char* name = detail::check_single(coll, b, op, root, caller());
  same_process(name).run_in_order(
      name, b.bytes(),
      [&](Backend& be, State& st) { detail::run_single(be, st, coll, b, op, root); }, root);
}
template <CommBackend Backend>
Work Communicator<Backend>::submit(const detail::Call& c, std::vector<detail::Buf> many,
                                   detail::Holds held, std::vector<std::size_t> counts) {
  return same_process(c.name).submit(c, std::move(many), std::move(held), std::move(counts));
}

DDP_END_NAMESPACE
