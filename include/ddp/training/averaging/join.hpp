// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Uneven inputs (torch's Join context, Horovod's hvd.join): ranks whose data runs out early keep
/// answering the collectives of the ranks still training, with contributions that change nothing,
/// so that a job whose ranks have different numbers of batches finishes without a hang.
///
///     ddp::GradientAverager avg(comm, model);
///     {
///       ddp::Join join(comm, {&avg});          // collective: every rank
///       for (auto batch : my_batches) {        // as many as this rank has
///         join.step();                         // before each optimizer step's backward
///         forward_backward(model, batch);
///         avg.synchronize();                   // the average over the ranks still training
///         sgd_step(model);
///       }
///       join.finish();                         // (or the destructor) answers the others
///     }
///
/// Each step() is one small all_reduce that counts the ranks still training. A rank that called
/// finish() takes part in that count with 0 and, while the count is not 0, runs each Joinable's
/// join_step(): the collectives one step issues, with zeros. GradientAverager is a Joinable: in a
/// Join it sums the gradients and divides by the number of ranks that trained the step, so the
/// average is over the ranks that contributed (torch's divide_by_initial_world_size=False), and
/// a rank that finished shadows each bucket's all_reduce and the buffers' broadcast; once every
/// rank has finished, every rank gets the parameters of the rank that trained longest. Your own
/// per-step collectives join the same way: derive from Joinable and issue them, with neutral
/// contributions, in join_step(). Collectives a step issues that no Joinable shadows (e.g. a
/// found_nonfinite() call) would meet a finished rank's count instead: Errc::mismatch on backends
/// that compare fingerprints (backend::Host), so make them Joinables too.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/error.hpp"
#include "ddp/process_group.hpp"
#include "ddp/types.hpp"

#include <cmath>
#include <exception>
#include <initializer_list>
#include <span>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Something whose per-step collectives a Join shadows on ranks that have finished.
class Joinable {
 public:
  virtual ~Joinable() = default;
  /// On a finished rank, once per step of the ranks still training (`active` of them): issue
  /// the collectives one step issues, with contributions that change nothing (zeros for a sum).
  virtual void join_step(int active) = 0;
  /// On a rank still training, at each Join::step(): `active` ranks train this step.
  virtual void join_active(int /*active*/) {}
  /// The Join begins (true, at its construction) or ends (false), on every rank.
  virtual void join_attach(bool /*on*/) {}
  /// Every rank has finished (collective, on every rank, before join_attach(false)). `last`:
  /// the rank that trained the most steps (the highest such rank), the same on every rank, whose
  /// state the others may want (GradientAverager copies its parameters to every rank).
  virtual void join_done(int /*last*/) {}
};

/// Uneven inputs: see the file comment. Comm is any ProcessGroup (a Communicator<Backend>).
template <ProcessGroup Comm>
class Join {
 public:
  /// Collective: every rank makes it, with the same Joinables in the same order; they (and
  /// `comm`) must outlive the Join.
  Join(Comm& comm, std::initializer_list<Joinable*> joinables)
      : comm_(&comm), joinables_(joinables) {
    for (Joinable* j : joinables_) {
      if (j == nullptr)
        detail::fail(Errc::invalid_argument, "rank ", comm.rank(), ": Join: a Joinable is null");
    }
    std::size_t attached = 0;
    try {
      for (Joinable* j : joinables_) {
        j->join_attach(true);
        ++attached;
      }
    } catch (...) {
      for (std::size_t i = 0; i < attached; ++i) detach(joinables_[i]);
      throw;
    }
  }
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;
  /// finish(), unless an exception is on its way out (then only the Joinables are released: the
  /// other ranks learn of the failure from the communicator).
  ~Join() noexcept(false) {
    if (finished_) return;
    if (std::uncaught_exceptions() > uncaught_) {
      for (Joinable* j : joinables_) detach(j);
      return;
    }
    finish();
  }

  /// Collective with the finished ranks: a step begins on this rank. Returns how many ranks
  /// train it (this one included). Call it once per optimizer step, before its backward pass.
  int step() {
    if (finished_)
      detail::fail(Errc::invalid_argument, "rank ", comm_->rank(),
                   ": Join::step() after finish(): this rank said its inputs were done");
    active_ = count(1.0);
    ++steps_;
    for (Joinable* j : joinables_) j->join_active(active_);
    return active_;
  }

  /// This rank's inputs are done: answers the steps of the ranks still training until every
  /// rank has finished. Collective.
  void finish() {
    if (finished_) return;
    finished_ = true;
    try {
      for (;;) {
        const int n = count(0.0);
        if (n == 0) break;
        ++shadowed_;
        for (Joinable* j : joinables_) j->join_step(n);
      }
      // The rank that trained longest: steps * size + rank, the largest over the ranks.
      double key = static_cast<double>(steps_) * comm_->size() + comm_->rank();
      comm_->all_reduce_host(std::span<double>(&key, 1), ReduceOp::max);
      last_ = static_cast<int>(std::fmod(key, static_cast<double>(comm_->size())));
      for (Joinable* j : joinables_) j->join_done(last_);
    } catch (...) {
      for (Joinable* j : joinables_) detach(j);
      throw;
    }
    for (Joinable* j : joinables_) j->join_attach(false);
  }

  /// How many ranks trained this rank's last step.
  [[nodiscard]] int active() const noexcept { return active_; }
  /// Steps this rank trained.
  [[nodiscard]] std::size_t steps() const noexcept { return steps_; }
  /// Steps of the others this rank answered after it finished.
  [[nodiscard]] std::size_t shadowed() const noexcept { return shadowed_; }
  /// After finish(): the rank that trained the most steps (see Joinable::join_done).
  [[nodiscard]] int last() const noexcept { return last_; }

 private:
  int count(double mine) {
    double v = mine;
    comm_->all_reduce_host(std::span<double>(&v, 1), ReduceOp::sum);
    if (!(v >= 0) || v > comm_->size())
      detail::fail(Errc::protocol, "rank ", comm_->rank(), ": Join: ", v,
                   " ranks said they train this step, of ", comm_->size());
    return static_cast<int>(v);
  }
  static void detach(Joinable* j) noexcept {
    try {
      j->join_attach(false);
    } catch (...) {  // releasing must not fail on top of the failure in flight
    }
  }

  Comm* comm_;
  std::vector<Joinable*> joinables_;
  int uncaught_ = std::uncaught_exceptions();
  int active_ = 0;
  int last_ = -1;
  std::size_t steps_ = 0, shadowed_ = 0;
  bool finished_ = false;
};

DDP_END_NAMESPACE
