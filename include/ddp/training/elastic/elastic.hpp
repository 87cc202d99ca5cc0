// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Elastic: a fault-tolerant training loop in one object, in the spirit of Horovod's
/// `hvd.elastic.run` and torchft's Manager. It owns the communicator and a TrainingState, runs
/// the program's step function, commits after every step, and on a lost rank catches the
/// failure, shrinks, restores the newest commit on every survivor, makes the program's
/// averagers again (on_reset) and goes on; it admits the processes waiting to enter at a step
/// boundary, and deals the rest of the epoch over every new membership, the ranks stepping
/// together (as many steps as the longest shard needs).
///
///     ddp::Elastic<ddp::backend::Host> job;                    // init(), or enter() if restarted
///     job.track_model("net", net).track_sampler("sampler", sampler);
///     std::optional<ddp::GradientAverager<Net, ddp::backend::Host>> avg;
///     job.on_reset([&](auto& comm) { avg.emplace(comm, net); });
///     job.run_epochs(sampler, epochs, 64, [&](auto& comm, const ddp::ElasticBatch& b) {
///       forward_backward(net, b.indices); avg->average(); update(net);
///     });
///
/// The lower-level pieces stay available: Communicator::shrink / join / grow, TrainingState.

#include "ddp/communicator.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/data/partition.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/training/elastic/state.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// One step of Elastic::run_epochs on this rank.
struct ElasticBatch {
  /// This rank's dataset indices for the step: local_batch of them, fewer at the end of its
  /// shard, none when its shard ran out before the longest (it steps with the others).
  std::span<const std::size_t> indices;
  /// The epoch (0-based).
  int epoch = 0;
  /// The step in the epoch, counted from where its samples were last dealt (0 at its start, and
  /// again after a change of membership).
  std::size_t step = 0;
  /// This rank's full share of the global batch (the global batch over the ranks, rounded up):
  /// divide sums by it, not by indices.size(), and a short batch makes a proportionally short
  /// step.
  std::size_t local_batch = 0;
};

/// A change of membership, as Elastic::on_change reports it.
struct ElasticChange {
  /// What changed.
  enum class Kind {
    started,  ///< the job began (this process made the communicator with init())
    joined,   ///< this process joined a running job (restarted by the launcher, or added)
    lost,     ///< ranks were lost: the survivors go on (shrink, restore)
    grew,     ///< newcomers were admitted
  };
  /// What changed.
  Kind kind = Kind::started;
  int size = 0;              ///< ranks now
  int previous_size = 0;     ///< ranks before (0 when this process was not in the job)
  std::uint64_t commit = 0;  ///< the commit every member goes on from
  double ms = 0;             ///< how long the change took here, from the failure (lost) or call
  std::string why;           ///< lost: the failure that started it
};

namespace detail {
/// ElasticOptions::join_wait, enter_wait's older name: a wait set through it still counts (when
/// enter_wait is 0), and setting it is deprecated (the warning names the new name), while the
/// options' own copies and designated initializers of other fields warn of nothing.
class RenamedWait {
 public:
  RenamedWait() = default;
  template <class Rep, class Period>
  [[deprecated("renamed ElasticOptions::enter_wait")]] RenamedWait(  // NOLINT: implicit
      std::chrono::duration<Rep, Period> wait)
      : wait_(std::chrono::duration_cast<std::chrono::milliseconds>(wait)) {}
  /// The wait set through the old name.
  [[nodiscard]] std::chrono::milliseconds get() const noexcept { return wait_; }

 private:
  std::chrono::milliseconds wait_{0};
};
}  // namespace detail

/// Settings of an Elastic loop.
struct ElasticOptions {
  /// How the survivors agree (ShrinkOptions::wait_for_ranks, exclude).
  ShrinkOptions shrink{};
  /// How long a newcomer waits to be admitted (EnterOptions::wait; 0: the timeout).
  std::chrono::milliseconds enter_wait{0};
  /// enter_wait's older name (used when enter_wait is 0); setting it is deprecated.
  detail::RenamedWait join_wait{};
  /// The fewest ranks the job goes on with: a loss that leaves fewer is rethrown.
  int min_size = 1;
  /// Losses recovered from at most (-1: no limit); the next one is rethrown.
  int max_recoveries = -1;
  /// When this process was left out of the job (stopped or cut off past the heartbeat, or
  /// excluded by the others' shrink: it can never act again), end it: one line on stderr saying
  /// so and why, then exit with Elastic::left_out_exit_code (a launcher counts it lost, or
  /// restarts it to rejoin under --on-failure rejoin). False: Elastic rethrows the Errc::aborted
  /// error instead.
  bool exit_when_left_out = true;
};

/// A fault-tolerant training loop (see the file comment). Track the state first (before comm()
/// or run), then run.
template <class Backend>
class Elastic {
 public:
  /// The communicator it owns.
  using Comm = Communicator<Backend>;
  /// The exit status of a process the job left out (ElasticOptions::exit_when_left_out):
  /// EX_TEMPFAIL, a failure that a new attempt (a rejoin) may cure.
  static constexpr int left_out_exit_code = 75;

  /// Nothing is connected yet: the communicator is made (init(), or join() when the launcher
  /// restarted this process to rejoin, Environment::rejoin) on the first comm() or run.
  explicit Elastic(Environment env = Environment::detect(), Options options = {},
                   ElasticOptions elastic = {})
      : env_(std::move(env)), options_(std::move(options)), eo_(std::move(elastic)) {
    state_.track_object("ddp.elastic.epoch", epoch_);
  }
  Elastic(const Elastic&) = delete;
  Elastic& operator=(const Elastic&) = delete;

  /// What survives a loss, as TrainingState tracks it (track, track_model, track_object,
  /// track_sampler); every process of the job tracks the same, in the same order, before the
  /// communicator is made.
  template <class T>
    requires requires(T& t) { ddp::view(t); }
  Elastic& track(std::string name, T& tensor) {
    before_connect("track");
    state_.track(std::move(name), tensor);
    return *this;
  }
  /// Tracks every parameter of `model` (TrainingState::track_model).
  template <class M>
  Elastic& track_model(const std::string& name, M& model) {
    before_connect("track_model");
    state_.track_model(name, model);
    return *this;
  }
  /// Tracks an object ddp::codec encodes (TrainingState::track_object).
  template <Encodable T>
  Elastic& track_object(std::string name, T& object) {
    before_connect("track_object");
    state_.track_object(std::move(name), object);
    return *this;
  }
  /// Tracks a sampler's place in its epoch (TrainingState::track_sampler); run_epochs runs
  /// over it.
  Elastic& track_sampler(std::string name, DistributedSampler& sampler) {
    before_connect("track_sampler");
    state_.track_sampler(std::move(name), sampler);
    samplers_.push_back(&sampler);
    return *this;
  }

  /// Called with the communicator once it is made and after every change of membership, the
  /// tracked state restored: make what depends on the communicator again (GradientAverager,
  /// ShardedAverager: their constructors are collective, and a newcomer makes its own then).
  Elastic& on_reset(std::function<void(Comm&)> f) {
    reset_ = std::move(f);
    return *this;
  }
  /// Called after every change of membership (to log it, say).
  Elastic& on_change(std::function<void(const ElasticChange&)> f) {
    change_ = std::move(f);
    return *this;
  }
  /// Called with each commit's number once it is made: every member finished that step, which
  /// no loss can undo (record what the step did, write a checkpoint every N commits). A commit
  /// that this rank was still confirming when a member was lost, and to which the survivors
  /// rolled forward, is reported after the recovery.
  Elastic& on_commit(std::function<void(Comm&, std::uint64_t)> f) {
    commit_ = std::move(f);
    return *this;
  }

  /// The communicator (made on first use; the one of the current membership after a change).
  [[nodiscard]] Comm& comm() {
    connect();
    return *comm_;
  }
  /// The tracked state.
  [[nodiscard]] TrainingState& state() noexcept { return state_; }
  /// The epoch run_epochs is in (restored with the rest).
  [[nodiscard]] int epoch() const noexcept { return epoch_; }
  /// Commits made: steps, and ends of epochs (the same on every member).
  [[nodiscard]] std::uint64_t steps() const noexcept { return state_.steps(); }
  /// Losses recovered from so far on this process.
  [[nodiscard]] int recoveries() const noexcept { return recoveries_; }

  /// Runs `step(comm, n)` for n = steps() until `total` steps are committed, committing after
  /// each; a loss makes the survivors go on from the newest commit (steps() restored with it).
  void run(std::uint64_t total, const std::function<void(Comm&, std::uint64_t)>& step) {
    connect();
    for (;;) {
      try {
        while (state_.steps() < total) {
          step(*comm_, state_.steps());
          (void)commit();
        }
        return;
      } catch (const Error& e) {
        if (!recoverable(e)) throw;
        end_if_left_out(e);
        recover(e);
      }
    }
  }

  /// Runs epochs over `sampler` (tracked with track_sampler) until `epochs` are done, `step`
  /// once per batch of `global_batch` samples over all ranks (each rank an equal share), a
  /// commit after each, and `end_of_epoch(comm, epoch)` at the end of each (evaluation; it may
  /// use collectives). Every member takes as many steps as the longest shard needs; the
  /// samples the ranks have not taken are dealt again over every new membership, so that with
  /// SamplerOptions::exact every sample of an epoch is trained on exactly once, whatever is lost.
  void run_epochs(DistributedSampler& sampler, int epochs, std::size_t global_batch,
                  const std::function<void(Comm&, const ElasticBatch&)>& step,
                  const std::function<void(Comm&, int)>& end_of_epoch = {}) {
    if (std::find(samplers_.begin(), samplers_.end(), &sampler) == samplers_.end())
      detail::fail(Errc::invalid_argument, "rank ", env_.rank,
                   ": Elastic::run_epochs: the sampler is not tracked; track it with "
                   "track_sampler() before the communicator is made, so that its place in the "
                   "epoch survives a loss");
    if (global_batch == 0)
      detail::fail(Errc::invalid_argument, "rank ", env_.rank,
                   ": Elastic::run_epochs: the global batch must be at least 1 sample");
    connect();
    for (;;) {
      try {
        while (epoch_ < epochs) {
          if (!run_epoch_steps(sampler, global_batch, step)) continue;  // dealt again: go on
          if (end_of_epoch) end_of_epoch(*comm_, epoch_);
          ++epoch_;
          sampler.set_epoch(static_cast<std::uint64_t>(epoch_));
          (void)commit();
        }
        return;
      } catch (const Error& e) {
        if (!recoverable(e)) throw;
        end_if_left_out(e);
        recover(e);
      }
    }
  }

 private:
  using Clock = std::chrono::steady_clock;

  void before_connect(const char* what) const {
    if (comm_)
      detail::fail(Errc::invalid_argument, "rank ", env_.rank, ": Elastic::", what,
                   ": the communicator is made already; track the state before the first comm() "
                   "or run (every process must track the same, and a newcomer's ticket is "
                   "checked against it)");
  }

  [[nodiscard]] std::chrono::milliseconds enter_wait() const noexcept {
    return eo_.enter_wait.count() > 0 ? eo_.enter_wait : eo_.join_wait.get();
  }

  /// A process the job left out ends here (ElasticOptions::exit_when_left_out): every
  /// exclusion says it "can never act on this communicator again".
  void end_if_left_out(const Error& e) const {
    if (e.code() != Errc::aborted || !eo_.exit_when_left_out ||
        std::string_view(e.what()).find("can never act on this communicator again") ==
            std::string_view::npos)
      return;
    std::fprintf(stderr,
                 "ddp: world rank %d was left out of the job and ends (exit status %d): %s\n",
                 env_.rank, left_out_exit_code, e.what());
    std::fflush(nullptr);
    std::_Exit(left_out_exit_code);  // its threads and peers' resources are not its own now
  }

  static bool recoverable(const Error& e) noexcept {
    return e.code() == Errc::peer_lost || e.code() == Errc::aborted || e.code() == Errc::timeout;
  }

  /// Makes the communicator: init(), or (a restarted process, Environment::rejoin) enter() and
  /// the members' state. A member lost meanwhile costs one recovery here as anywhere else; a
  /// newcomer whose admission failed with it (the members then recover without it) asks again.
  void connect() {
    if (comm_) return;
    const auto t0 = Clock::now();
    const ElasticChange::Kind kind =
        env_.rejoin ? ElasticChange::Kind::joined : ElasticChange::Kind::started;
    if (env_.rejoin) {
      for (int asked = 1;; ++asked) {
        try {
          comm_.emplace(
              Comm::enter(env_, options_, {.ticket = state_.ticket(), .wait = enter_wait()}));
          break;
        } catch (const Error& e) {
          // Refused, out of time, or every member gone: final. A member lost while this
          // process was being admitted: the members recover, and it asks again.
          if (e.code() != Errc::peer_lost || asked >= max_entries) throw;
        }
      }
    } else {
      comm_.emplace(Comm::init(env_, options_));
    }
    try {
      if (kind == ElasticChange::Kind::joined) {
        state_.restore(*comm_);
      } else {
        state_.start(*comm_);
      }
      reset(kind, 0, t0, {});
    } catch (const Error& e) {
      if (!recoverable(e)) throw;
      recover(e);
    }
  }

  void reset(ElasticChange::Kind kind, int before, Clock::time_point t0, std::string why) {
    if (reset_) reset_(*comm_);
    if (change_) {
      ElasticChange c;
      c.kind = kind;
      c.size = comm_->size();
      c.previous_size = before;
      c.commit = state_.steps();
      c.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      c.why = std::move(why);
      change_(c);
    }
  }

  /// The commit after a step; admits the processes waiting to enter, when there are. Returns
  /// whether the membership grew (the epoch's rest is then dealt again).
  bool commit() {
    unreported_ = state_.steps() + 1;
    state_.commit(*comm_);
    if (commit_) commit_(*comm_, state_.steps());
    unreported_ = 0;
    if (state_.entering() <= 0) return false;
    const auto t0 = Clock::now();
    const int before = comm_->size();
    if (!state_.grow(*comm_)) return false;
    reset(ElasticChange::Kind::grew, before, t0, {});
    return true;
  }

  /// The rest of the current epoch's steps over this membership; false when the membership grew
  /// meanwhile (the rest is then dealt again over the new one).
  bool run_epoch_steps(DistributedSampler& sampler, std::size_t global_batch,
                       const std::function<void(Comm&, const ElasticBatch&)>& step) {
    const std::vector<std::size_t> mine = sampler.indices();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    const std::size_t longest = (sampler.total_size() + ranks - 1) / ranks;
    const std::size_t at = sampler.state().offset;
    const std::size_t local = (global_batch + ranks - 1) / ranks;
    for (std::size_t done = 0; at + done < longest; done += local) {
      const std::size_t count = done < mine.size() ? std::min(local, mine.size() - done) : 0;
      ElasticBatch b;
      b.indices = std::span<const std::size_t>(mine.data() + done, count);
      b.epoch = epoch_;
      b.step = (at + done) / local;
      b.local_batch = local;
      step(*comm_, b);
      sampler.advance(count);
      if (commit()) return false;
    }
    return true;
  }

  /// After a loss: shrink, restore, report the commit a loss interrupted (on_commit), reset
  /// (on_reset, on_change); all of it again when a member is lost meanwhile, in any of those
  /// (one more recovery each time). Rethrows when this rank was left out (fenced), too few
  /// remain, or no recovery is left.
  void recover(const Error& first) {
    const auto t0 = Clock::now();
    const int before = comm_->size();
    for (;;) {
      ++recoveries_;
      if (eo_.max_recoveries >= 0 && recoveries_ > eo_.max_recoveries)
        detail::fail_from(first.origin_rank(), first.lost_ranks(), first.code(), first.what(),
                          " (Elastic: ", eo_.max_recoveries,
                          " losses recovered from already: ElasticOptions::max_recoveries)");
      const int round_before = comm_->size();
      std::optional<Comm> next;
      try {
        next.emplace(comm_->shrink(eo_.shrink));
      } catch (const Error& e) {  // left out: Errc::aborted
        end_if_left_out(e);
        throw;
      }
      *comm_ = std::move(*next);
      if (comm_->size() < eo_.min_size)
        detail::fail(Errc::peer_lost, "world rank ", env_.rank, ": Elastic: ", comm_->size(),
                     " ranks are left, fewer than ElasticOptions::min_size ", eo_.min_size, " (",
                     first.what(), ")");
      std::uint64_t restored = 0;
      try {
        restored = state_.restore(*comm_);
        // The commit being confirmed or reported when the loss came, if the members completed
        // it: reported now (once its report returns).
        if (unreported_ != 0 && restored == unreported_ && commit_) commit_(*comm_, restored);
        unreported_ = 0;
      } catch (const Error& again) {
        if (!recoverable(again)) throw;  // another loss while restoring or reporting
        continue;
      }
      // A failure that comes back at the same commit after a round that lost no rank is not a
      // lost rank (a step, or on_reset, that throws Errc::timeout every time, say): recovering
      // again would repeat it forever. Every member sees the same sizes and commit, and rethrows
      // alike.
      if (comm_->size() == round_before && restored == no_loss_commit_)
        detail::fail_from(first.origin_rank(), first.lost_ranks(), first.code(), first.what(),
                          " (Elastic: the same failure came back at commit ", restored,
                          " after a recovery that lost no rank: it is not a lost rank, so it is "
                          "rethrown instead of recovered from again)");
      no_loss_commit_ = comm_->size() == round_before ? restored : ~std::uint64_t{0};
      try {
        reset(ElasticChange::Kind::lost, before, t0, first.what());
      } catch (const Error& again) {
        if (!recoverable(again)) throw;  // another loss in on_reset or on_change
        continue;
      }
      return;
    }
  }

  Environment env_;
  Options options_;
  ElasticOptions eo_;
  TrainingState state_;
  int epoch_ = 0;
  std::vector<const DistributedSampler*> samplers_;
  std::function<void(Comm&)> reset_;
  std::function<void(const ElasticChange&)> change_;
  std::function<void(Comm&, std::uint64_t)> commit_;
  static constexpr int max_entries = 5;  // a newcomer's requests, when members die meanwhile
  std::uint64_t unreported_ = 0;         // the commit being confirmed or reported (0: none)
  std::uint64_t no_loss_commit_ = ~std::uint64_t{0};  // restored by the last loss-free recovery
  std::optional<Comm> comm_;
  int recoveries_ = 0;
};

DDP_END_NAMESPACE
