// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::TrainingState: the state a fault-tolerant training loop keeps, committed step by step, so
/// that after a membership change (Communicator::shrink) every member goes on from the same last
/// committed step: no step lost, none applied twice or half. In the spirit of Horovod Elastic's
/// State (commit, restore, sync) and torchft's per-step commit, without a separate coordinator.
///
///     ddp::TrainingState state;
///     state.track_model("model", net).track("adam.m", adam.m).track_object("done", done);
///     state.start(comm);                        // rank 0's state everywhere: committed step 0
///     for (;;) {
///       try {
///         for (; step < steps; ++step) {
///           ...; avg.average(); adam.step(net);
///           done = step + 1;                    // the steps this commit holds
///           state.commit(comm);
///         }
///         break;
///       } catch (const ddp::Error& e) {
///         comm = comm.shrink();                 // the survivors
///         state.restore(comm);                  // every member: the newest committed step
///         step = done;                          // go on after it
///       }
///     }
///
/// commit() first confirms, in one small all_reduce, that every member finished this step (and
/// is at the same commit), then copies the tracked state aside (host memory). A failure in the
/// step (before commit) leaves the previous commit; a failure inside the confirmation can leave
/// it complete on some members and not on others, but only after every member had finished the
/// step: restore() then takes the newest commit any member holds, and a member that was still
/// confirming it holds that state live. restore() sends it from the lowest member that holds it
/// to every other (broadcast), so the members end bitwise equal, and writes it back into the
/// tracked buffers and objects.

#include "ddp/checkpoint/checkpoint.hpp"
#include "ddp/codec.hpp"
#include "ddp/config.hpp"
#include "ddp/data/partition.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/process_group.hpp"
#include "ddp/tensor.hpp"
#include "ddp/training/averaging/parameters.hpp"
#include "ddp/types.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

namespace detail {
/// Test hook for fault injection: called with the phase of a state transfer reached ("transfer":
/// the members agreed who sends, before the bytes go); tests kill the process there. Null
/// outside tests.
inline void (*&state_phase_hook() noexcept)(const char*) {
  static void (*hook)(const char*) = nullptr;
  return hook;
}
}  // namespace detail

/// Named training state, committed per step (see the file comment).
class TrainingState {
 public:
  /// Tracks a tensor's values (anything ddp::view sees: a std::vector, a span, a torch::Tensor;
  /// host or CUDA memory), looked up again at every commit and restore (it may be reallocated
  /// between steps, not resized). `tensor` must outlive this object.
  template <class T>
    requires requires(T& t) { ddp::view(t); }
  TrainingState& track(std::string name, T& tensor) {
    add(std::move(name), [&tensor] { return raw(ddp::view(tensor)); });
    return *this;
  }

  /// Tracks every parameter's value of `model` (what GradientAverager averages), as one piece
  /// per parameter.
  template <class M>
  TrainingState& track_model(const std::string& name, M& model) {
    std::size_t i = 0;
    for (auto& p : detail::model_parameters(model)) {
      add(detail::concat(name, ".", i++), [&p] { return raw(ddp::view(detail::param_value(p))); });
    }
    return *this;
  }

  /// Tracks an object ddp::codec encodes (the step, an epoch, a SamplerState, a seed).
  template <Encodable T>
  TrainingState& track_object(std::string name, T& object) {
    Piece piece;
    piece.name = new_name(std::move(name));
    piece.kind = 1;
    piece.describe = [] { return detail::type_tag<T>(); };
    piece.save = [&object] { return detail::encode_object(object); };
    piece.load = [&object](const std::string& bytes) {
      object = detail::decode_object<T>(bytes.data(), bytes.size());
    };
    pieces_.push_back(std::move(piece));
    return *this;
  }

  /// Tracks a DistributedSampler's place in its epoch (advance() it after each batch): restored
  /// with the rest, then, over a new number of ranks, dealt over them
  /// (DistributedSampler::repartition), so that the samples no rank has taken in this epoch go
  /// to the ranks that remain; over as many, each rank goes on from the same place.
  TrainingState& track_sampler(std::string name, DistributedSampler& sampler);

  /// Collective, before the first step: rank 0's tracked state goes to every rank and is
  /// committed there as step 0.
  template <ProcessGroup Comm>
  void start(Comm& comm) {
    confirming_ = 0;
    steps_ = 0;
    snapshot();
    send_from(comm, 0);
    for (Piece& p : pieces_)
      if (p.regroup) p.regroup(comm.size(), comm.rank());
  }

  /// Collective, at the end of each step: every member confirms it finished this step (Errc::
  /// mismatch when the members are at different commits), then this rank's state is copied
  /// aside as the new commit. Returns the commits made since start(). A lost member makes it
  /// fail as any collective does: then shrink() and restore().
  template <ProcessGroup Comm>
  std::uint64_t commit(Comm& comm) {
    confirming_ = steps_ + 1;
    // max of the commit and of its complement: the largest and the smallest over the members
    // (three values: a commit on some ranks never pairs with a program's own all_reduce of two).
    // The third: how many processes wait to join, as rank 0 sees them (Communicator::enter).
    std::vector<double> at{static_cast<double>(confirming_), -static_cast<double>(confirming_),
                           comm.rank() == 0 ? static_cast<double>(poll_entering(comm)) : 0.0};
    comm.all_reduce_host(std::span<double>(at), ReduceOp::max);
    entering_ = static_cast<int>(at[2]);
    if (at[0] != -at[1])
      detail::fail(Errc::mismatch, "rank ", comm.rank(),
                   ": TrainingState::commit: this rank commits step ", confirming_,
                   " but the members are at ", static_cast<long long>(-at[1]), " to ",
                   static_cast<long long>(at[0]),
                   ": every member must call commit() once per step (and restore() after a "
                   "membership change)");
    snapshot();
    steps_ = confirming_;
    confirming_ = 0;
    return steps_;
  }

  /// Collective over a new membership (after shrink()): every member ends with the newest
  /// commit any member holds, written back into the tracked buffers and objects; a member that
  /// has none of its own (a newcomer, or one further behind) receives it. Returns its number.
  template <ProcessGroup Comm>
  std::uint64_t restore(Comm& comm) {
    const auto all = comm.all_gather_object(std::vector<std::uint64_t>{steps_, confirming_});
    // A member still confirming commit k had finished step k (every member had: the commit's
    // collective had begun): its live state is step k, newer than its last commit.
    std::uint64_t newest = 0;
    for (const auto& m : all) newest = std::max({newest, m[0], m[1]});
    int source = 0;
    while (all[static_cast<std::size_t>(source)][0] != newest &&
           all[static_cast<std::size_t>(source)][1] != newest)
      ++source;
    if (comm.rank() == source && steps_ != newest) snapshot();
    send_from(comm, source);
    for (Piece& p : pieces_)
      if (p.regroup) p.regroup(comm.size(), comm.rank());
    steps_ = newest;
    confirming_ = 0;
    return newest;
  }

  /// How many processes waited to join the job at the last commit(), the same on every member
  /// (rank 0 looks at most every 50 ms). When it is not 0, every member calls grow(comm).
  [[nodiscard]] int entering() const noexcept { return entering_; }
  /// entering()'s older name.
  [[deprecated("renamed TrainingState::entering()")]] [[nodiscard]] int joining() const noexcept {
    return entering_;
  }

  /// Collective over the members, after a commit() whose entering() is not 0: admits the
  /// processes waiting to enter (Communicator::grow with ticket()), replaces `comm` with the
  /// grown communicator, and sends every member the last commit (restore()), the newcomers
  /// included (they call restore() after Communicator::enter). Returns whether the membership
  /// changed: then re-create the averagers over `comm` (their constructors are collective, and
  /// the newcomers make theirs now). A failure meanwhile throws as a collective does, `comm`
  /// already the grown one: shrink() it and restore(), as after any failure.
  template <class Comm>
  bool grow(Comm& comm) {
    GrowOptions o;
    o.ticket = ticket();
    entering_ = last_waiting_ = 0;
    Comm grown = comm.grow(o);
    if (grown.epoch() == comm.epoch()) return false;
    comm = std::move(grown);
    restore(comm);
    return true;
  }

  /// What a process must track alike to be admitted to the job (GrowOptions::ticket,
  /// EnterOptions::ticket): each piece's name, kind and size (tensors: bytes; objects: a tag of
  /// their type; samplers: the dataset size), in order.
  [[nodiscard]] std::string ticket() const;

  /// Commits made since start() (after restore(): the commit restored).
  [[nodiscard]] std::uint64_t steps() const noexcept { return steps_; }
  /// Bytes of the copy kept aside (the last commit).
  [[nodiscard]] std::size_t bytes() const noexcept;

 private:
  struct Raw {
    void* data = nullptr;
    std::size_t bytes = 0;
    bool cuda = false;
    void* stream = nullptr;
  };
  struct Piece {
    std::string name;
    std::uint8_t kind = 0;                         // 0 a tensor, 1 an object, 2 a sampler
    std::function<std::uint64_t()> describe;       // what must agree: object type, dataset size
    std::function<Raw()> where;                    // a tensor: its memory now
    std::function<std::string()> save;             // an object: encoded
    std::function<void(const std::string&)> load;  // an object: decoded back
    std::function<void(int, int)> regroup;         // a sampler: dealt over (size, rank)
    std::string saved;                             // the last commit
  };

  template <class V>
  static Raw raw(const V& v) {
    if constexpr (std::is_same_v<V, DynamicView>) {
      return {v.data, v.size * size_of(v.dtype), v.device.is_cuda(), v.stream};
    } else {
      return {const_cast<void*>(static_cast<const void*>(v.data)), v.bytes(), v.device.is_cuda(),
              v.stream};
    }
  }

  std::string new_name(std::string name) const;

  void add(std::string name, std::function<Raw()> where);

  /// The tracked state now, copied aside.
  void snapshot();

  /// Rank `root`'s copy aside to every member, then written back into the tracked state on
  /// every member. The members first compare the sizes of their tensors (every member fails
  /// alike, naming the first that differs, when they do not track the same state).
  template <ProcessGroup Comm>
  void send_from(Comm& comm, int root) {
    // Every member's pieces: name, kind, what must agree, and (tensors) bytes now and at the
    // commit; every member checks them alike, so all fail together, naming the first that
    // differs.
    using Desc = std::pair<std::string, std::vector<std::uint64_t>>;
    std::vector<Desc> mine;
    for (const Piece& p : pieces_) {
      const std::uint64_t now = p.where ? p.where().bytes : p.describe();
      mine.push_back({p.name, {p.kind, now, p.saved.size()}});
    }
    const auto all = comm.all_gather_object(mine);
    const auto& theirs = all[static_cast<std::size_t>(root)];
    for (std::size_t r = 0; r < all.size(); ++r) {
      const auto differ = [&](const auto&... why) {
        detail::fail(Errc::mismatch, "rank ", comm.rank(), ": TrainingState: ", why...,
                     ": every member must track the same state (the same names, model, optimizer "
                     "and types, in the same order), and a tracked tensor must keep its size");
      };
      if (all[r].size() != theirs.size())
        differ("rank ", r, " tracks ", all[r].size(), " pieces but rank ", root, " tracks ",
               theirs.size());
      for (std::size_t i = 0; i < theirs.size(); ++i) {
        const auto& [name, d] = all[r][i];
        const auto& [root_name, rd] = theirs[i];
        if (name != root_name || d[0] != rd[0])
          differ("piece ", i, " is \"", name, "\" on rank ", r, " but \"", root_name, "\" on rank ",
                 root, " (or of another kind)");
        if (d[0] == 0 && d[1] != rd[2])
          differ("\"", name, "\" holds ", d[1], " bytes on rank ", r, " but ", rd[2],
                 " were committed on rank ", root);
        if (d[0] != 0 && d[1] != rd[1])
          differ("\"", name, "\" is ",
                 d[0] == 1 ? "an object of another type" : "a sampler of another dataset size",
                 " on rank ", r, " than on rank ", root);
      }
    }
    if (detail::state_phase_hook() != nullptr) detail::state_phase_hook()("transfer");
    for (Piece& p : pieces_) {
      std::vector<std::int64_t> size{static_cast<std::int64_t>(p.saved.size())};
      comm.broadcast_host(std::span<std::int64_t>(size), root);
      p.saved.resize(static_cast<std::size_t>(size[0]));
      if (!p.saved.empty()) {
        comm.broadcast_host(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(p.saved.data()),
                                                    p.saved.size()),
                            root);
      }
      if (p.load) {
        p.load(p.saved);
      } else {
        const Raw r = p.where();
        detail::copy_bytes(r.data, p.saved.data(), r.bytes, r.cuda, r.stream);
        detail::sync_stream(r.cuda, r.stream);
      }
    }
  }

  // Rank 0's look at the processes waiting to enter, at most every 50 ms.
  template <class Comm>
  int poll_entering(Comm& comm) {
    if constexpr (requires { comm.waiting_to_enter(); }) {
      const auto now = std::chrono::steady_clock::now();
      if (now - polled_ < std::chrono::milliseconds(50)) return last_waiting_;
      polled_ = now;
      last_waiting_ = comm.waiting_to_enter();
      return last_waiting_;
    }
    return 0;
  }

  std::vector<Piece> pieces_;
  int entering_ = 0, last_waiting_ = 0;
  std::chrono::steady_clock::time_point polled_{};
  std::uint64_t steps_ = 0;       // commits made (since start)
  std::uint64_t confirming_ = 0;  // the commit being confirmed (0: none)
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/training/elastic/impl/state.ipp"
#endif
