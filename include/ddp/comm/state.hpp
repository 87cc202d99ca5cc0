// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What a communicator holds besides its backend, and the rules around it that do not depend on
/// the backend (compiled once, not per Communicator<Backend>): its store connections and the
/// leaving protocol, the executor, the flight recorder, the poison that makes every call after a
/// failure fail at once, and the fork() check.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/monitored_barrier.hpp"
#include "ddp/backend/rendezvous.hpp"
#include "ddp/comm/error_file.hpp"
#include "ddp/comm/recorder.hpp"
#include "ddp/comm/staging.hpp"
#include "ddp/comm/store_location.hpp"
#include "ddp/detail/env.hpp"
#include "ddp/detail/fork.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"
#include "ddp/store/server.hpp"
#include "ddp/work.hpp"
#if DDP_HAS_CUDA
#include "ddp/comm/cuda_staging.hpp"
#endif

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

struct CommState {
  // Defined with the bodies: constructing and destroying the members is code of its own.
  CommState();
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;
  ~CommState();

  Options options;
  FlightRecorder recorder;
  std::uint64_t fork_generation = detail::fork_generation();  // made in this process
  int pid = static_cast<int>(::getpid());
  bool joined = false;          // this process holds its rank's claim in the store
  int world_size = 1;           // ranks in this communicator (for the store host's wait)
  int world_rank_in_group = 0;  // this rank in this communicator
  int world_rank = 0;
  int local_rank_hint = 0;  // the launcher's local rank: the default CUDA device
  /// The rendezvous store this process hosts (rank 0 without a launcher's store), shared by
  /// every communicator made from the one that started it (shrink(), grow(), split()): the store
  /// lives while any of them does, not only while the first one does.
  std::shared_ptr<StoreServer> server;
  std::shared_ptr<Store> root_store;
  std::shared_ptr<Store> store;
  std::string prefix;
  /// The prefix of the communicator that init() or split() made, which every communicator
  /// shrink() makes from it shares (their keys are "<base_prefix>e<epoch>/...").
  std::string base_prefix;
  /// Membership epoch: 0 from init() or split(), one more at each shrink().
  std::uint64_t epoch = 0;
  /// After shrink(): each rank's number in the communicator it was made from.
  std::vector<int> previous;
  /// Each rank's number in the communicator init() made (its process), and that communicator's
  /// prefix, under which the store marks a process gone (process_exit_key()): how shrink()
  /// knows that a member of any communicator of the job died.
  std::vector<int> world_ranks;
  std::string job_prefix;
  /// The membership epoch a shrink() or grow() of this communicator formed (0: none): it is
  /// replaced.
  std::uint64_t replaced_by = 0;
  /// The join requests (Communicator::enter) answered so far: every id up to this one.
  std::int64_t joins_seen = 0;
  /// grow() calls on this communicator (every member's the same): tags each decision, since a
  /// grow() that admits nobody leaves the epoch and joins_seen as they were.
  std::uint64_t grow_calls = 0;
  std::unique_ptr<Executor> executor = std::make_unique<Executor>();
  /// When the rendezvous must be done: Options::timeout after init() began.
  Clock::time_point rendezvous_deadline = Clock::time_point::max();
  std::uint64_t splits = 0;
  std::uint64_t monitored_barriers = 0;
  mutable std::mutex poison_mutex;
  std::string poison;
  Errc poison_code = Errc::aborted;
  int poison_origin = -1;             // the first failure's Error::origin_rank()
  std::vector<int> poison_lost;       // and its lost_ranks()
  std::atomic<bool> poisoned{false};  // poison is set: read without the lock on every call
#if DDP_HAS_CUDA
  std::unique_ptr<CudaStaging> staging;  // made on first use

  CudaStaging& cuda_staging() {
    if (!staging)
      staging = std::make_unique<CudaStaging>(options.timeout, options.cuda_staging_bytes);
    return *staging;
  }
#endif

  void configure(const Options& o);

  /// Joins the rendezvous store of the job `env` describes: rank 0 hosts it (unless a launcher
  /// does: Options::external_store, DDP_STORE_HOSTED=1), every rank connects, works under this
  /// communicator's prefix, watches the "failed" key and claims its rank. Returns that store,
  /// whose calls all end by `rendezvous_deadline` until end_rendezvous().
  std::shared_ptr<Store> connect_store(const Environment& env);

  /// A newcomer (Communicator::enter): connects to the running job's store, which the launcher or
  /// a member hosts (never this process), without a refusal key: a wrong token fails this
  /// process alone, not the job. Sets the job's prefixes, as init() does.
  void connect_to_job(const Environment& env);

  /// The rendezvous succeeded: later store calls (split, leaving) get their own timeouts, and
  /// should this process die, the store counts it as left (the store's host does not wait for
  /// it in wait_for_the_others).
  void end_rendezvous();

  /// Whether rank r of this communicator is known gone: it left this communicator, or its
  /// process did (the store's mark of it under init()'s prefix: how a member of a split() or a
  /// newcomer is known dead).
  [[nodiscard]] bool rank_gone(int r) const;

  /// How many processes asked to join the job (Communicator::enter) since its last growth: one
  /// store read. 0 without a store, or for a communicator that split() made.
  [[nodiscard]] int waiting_to_enter() const;

  /// The store key that marks this process gone: "<init prefix>gone/<rank in init()'s
  /// communicator>", written only by the store as the process's connection closes (never by a
  /// communicator that is destroyed: its process may live on in another); "" before init().
  [[nodiscard]] std::string process_exit_key() const;

  /// Whether this is a fork() child's copy.
  [[nodiscard]] bool inherited() const noexcept {
    return detail::fork_generation() != fork_generation;
  }

  /// A fork() child's copy: the parent owns the store, the shared memory and the peers, and
  /// this process has none of the threads. Touch nothing; keep it reachable (never destroyed).
  void abandon() noexcept;

  /// The fork() check of every call: a child shares its parent's peers' shared memory and
  /// sockets, and using them would corrupt the parent's job.
  void check_process(int rank, const char* what) const;

  /// Leaving, first step (the communicator is destroyed, its executor drained, its backend not
  /// yet): this rank says in the store that it left ("exit/<rank>") and how, before its
  /// connections close, so that a peer still waiting for it reports why at once: "done/<rank>"
  /// with the number of operations it ran when it finished without a failure (the ranks ran
  /// different numbers of collectives), "left/<rank>" with its failure otherwise.
  void announce_leaving();

  /// Leaving, last step (the backend is gone): rank 0 keeps the store up until every rank has
  /// left, so none loses it mid-call, and after a failed rendezvous too, so the others can read
  /// why it failed. A rank whose process died counts as left (its connection's on-close record).
  /// Only the last communicator holding the store waits (another, made from this one by
  /// shrink() or grow(), goes on using it).
  void wait_for_the_others(bool connected);

  /// The rendezvous failed here, and this process hosts the store: keep it up until every rank
  /// that claimed its place has left (and has so read why), for at most `limit`; ranks that
  /// never claimed one get a second to appear. Nobody waits for a rank that was never started.
  void linger_after_failed_rendezvous(Store& plain, std::chrono::milliseconds limit) const;

  /// Creating the backend failed on `rank` with `e`: tell the other ranks, which are waiting on
  /// the store for it, so that they fail at once with its reason instead of at their timeout.
  /// A failure relayed from another rank gets this rank's name in front instead.
  void relay_failure(int rank, const Error& e);

  /// Communicator::monitored_barrier over the store (backend/monitored_barrier.hpp).
  void monitored_barrier(int rank, int size, std::chrono::milliseconds timeout,
                         bool wait_all_ranks);

  /// Marks the communicator failed with `why` (the first failure wins).
  void poison_with(std::string why, Errc code);
  /// The same with `e`'s message, code, origin and lost ranks.
  void poison_with(const Error& e);

  /// Fails with Errc::aborted, quoting the first failure, when the communicator is poisoned.
  void check_poisoned(int rank, const char* name) const;

  [[noreturn, gnu::noinline, gnu::cold]] void fail_poisoned(int rank, const char* name) const {
    std::lock_guard lock(poison_mutex);
    if (replaced_by != 0)
      fail_from(poison_origin, poison_lost, Errc::aborted, "rank ", rank, ": ", name,
                ": this communicator was replaced by membership epoch ", replaced_by, " (", poison,
                "): use the communicator that shrink() or grow() returned");
    fail_from(poison_origin, poison_lost, Errc::aborted, "rank ", rank, ": ", name,
              ": this communicator failed earlier and cannot be used (", poison,
              "); the ranks still alive can go on together with shrink(), or make a new "
              "communicator with Communicator::init");
  }

  /// Runs body() unless the communicator is poisoned (then fails at once), and poisons it
  /// when body fails. A failure on a communicator that the other ranks replaced without this
  /// one (shrink) says so instead: this rank is fenced.
  template <class F>
  void run_poisoning(int rank, const char* name, const F& body) {
    check_poisoned(rank, name);
    try {
      body();
    } catch (const Error& e) {
      if (std::string why = excluded(rank, name); !why.empty()) {
        poison_with(why, Errc::aborted);
        fail(Errc::aborted, why);
      }
      if (poisoned.load(std::memory_order_acquire)) {
        // Another thread aborted the communicator meanwhile (abort(), a peer that stopped
        // answering): its reason is the failure's.
        std::lock_guard lock(poison_mutex);
        std::string_view why = poison;
        if (const std::string own = concat("rank ", rank, ": "); why.starts_with(own))
          why.remove_prefix(own.size());
        fail_from(poison_origin, poison_lost, poison_code, "rank ", rank, ": ", name, ": ", why);
      }
      poison_with(e);
      throw;
    } catch (...) {
      poison_with("an operation threw a non-ddp exception", Errc::aborted);
      throw;
    }
  }

  /// When the last call on this communicator began (CLOCK_MONOTONIC_COARSE, ns; 0: none yet).
  std::atomic<std::int64_t> last_call_ns{0};

  /// Before each call: a rank that was stopped or away for half the timeout or more may have
  /// been left out by the others' shrink() meanwhile (they waited a timeout for it first). Then
  /// its next call asks the store before acting, and fails (Errc::aborted) when the others
  /// formed a communicator without it or are forming one: so a fenced rank never completes a
  /// collective, even one whose peers' data still sits in its sockets. One clock read per call.
  void check_membership_after_gap(int rank, const char* name);

  /// After a failure: when the other ranks formed a communicator without this rank (shrink()
  /// wrote "superseded": the epoch and the members), the message that says so; else "".
  [[nodiscard]] std::string excluded(int rank, const char* name) const;

  /// When the other ranks are forming a new membership from this communicator (shrink() wrote
  /// "shrinking"), the message that says so; else "".
  [[nodiscard]] std::string shrinking(int rank, const char* name) const;

  /// Whether the store marked this process stalled (its heartbeat lease ran out).
  [[nodiscard]] bool stalled() const;

  /// The heartbeat's watch: after each sign of life, when the store counted a new stall, checks
  /// whether a member of this communicator stalled, and then calls `lost` (once) with why.
  void watch_peers(std::function<void(const Error&)> lost);
  /// Ends the watch (before the backend goes); a tick running now finishes first.
  void unwatch_peers();

 private:
  std::uint64_t stall_tick = 0;   // the watch's tick on root_store (0: none)
  std::int64_t stalls_seen = -1;  // the stall count the watch last checked (its thread only)
  bool stall_reported = false;    // (its thread only)

  /// This communicator's store key `key`, "" when absent or the store is unreachable.
  [[nodiscard]] std::string peek_membership(const char* key) const;

 public:
};

#if DDP_BODIES
DDP_INLINE CommState::CommState() = default;
DDP_INLINE CommState::~CommState() = default;

DDP_INLINE void CommState::configure(const Options& o) {
  options = o;
  recorder.resize(o.trace_entries);
  install_error_file_handler();  // an uncaught exception reaches the launcher's error file
}

DDP_INLINE std::shared_ptr<Store> CommState::connect_store(const Environment& env) {
  const EnvReader launcher;  // what the launcher that hosts the store says
  prefix = concat("ddp/", launcher.get("DDP_RESTART_COUNT", "0"), "/", options.group, "/");
  base_prefix = prefix;
  job_prefix = prefix;
  for (int r = 0; r < env.world_size; ++r) world_ranks.push_back(r);
  StoreOptions so;
  so.timeout = options.timeout;
  so.token = options.token;
  so.refusal_key = prefix + "failed";  // a wrong token fails this rendezvous at once
  so.refusal_rank = env.rank;
  int store_port = env.store_port != 0 ? env.store_port : env.master_port;
  const int ports = env.store_port != 0 ? std::max(1, env.store_ports) : 1;
  // With several candidate ports, the store says whose it is: a probing rank must not join
  // another job's store that took one of them.
  const std::string job = store_job_name(env);
  const bool hosted = options.external_store || launcher.get("DDP_STORE_HOSTED") == "1";
  if (!options.store.empty()) {  // an etcd cluster: nobody hosts it
    root_store = open_etcd_store(options.store, env.rank, options.heartbeat, so);
  } else {
    if (env.rank == 0 && !hosted) {
      store_port = host_store(server, env, store_port, ports, so);
    } else if (ports > 1) {
      store_port = find_store(env, store_port, ports, so, job, rendezvous_deadline);
    }
    root_store = std::make_shared<Store>(env.master_addr, store_port, so);
    if (server && ports > 1) root_store->set(store_job_key, job);
  }
  store = std::make_shared<Store>(
      root_store->prefixed(prefix).watching("failed").with_deadline(rendezvous_deadline));
  world_size = env.world_size;
  claim_rank(*store, env.rank, options.group);
  joined = true;
  // Should this process die before the rendezvous is over, the store tells the others at once,
  // and counts it as gone (the store's host does not wait for it to leave).
  const std::pair<std::string, std::string> on_close[] = {
      {"failed",
       Store::stop_value(Error(Errc::peer_lost,
                               concat("the rendezvous failed on rank ", env.rank, ": "), env.rank,
                               "its process closed its connection to the store (it "
                               "died or was killed) before the rendezvous was over",
                               {env.rank}))},
      {concat("exit/", env.rank), ""}};
  store->set_on_close(on_close);
  return store;
}

DDP_INLINE void CommState::connect_to_job(const Environment& env) {
  if (env.master_port == 0 && options.store.empty())
    fail(Errc::invalid_argument, "rank ", env.rank,
         ": Communicator::enter: MASTER_PORT is not set; export MASTER_ADDR and MASTER_PORT "
         "of the running job, or launch with ddprun");
  const EnvReader launcher;
  prefix = concat("ddp/", launcher.get("DDP_RESTART_COUNT", "0"), "/", options.group, "/");
  base_prefix = prefix;
  job_prefix = prefix;
  StoreOptions so;
  so.timeout = options.timeout;
  so.token = options.token;
  int store_port = env.store_port != 0 ? env.store_port : env.master_port;
  const int ports = env.store_port != 0 ? std::max(1, env.store_ports) : 1;
  if (!options.store.empty()) {
    root_store = open_etcd_store(options.store, env.rank, options.heartbeat, so);
    return;
  }
  if (ports > 1)
    store_port = find_store(env, store_port, ports, so, store_job_name(env),
                            Deadline::after(options.timeout).at);
  root_store = std::make_shared<Store>(
      env.master_addr.empty() ? std::string("127.0.0.1") : env.master_addr, store_port, so);
}

DDP_INLINE void CommState::end_rendezvous() {
  if (!store) return;
  *store = store->with_deadline(Clock::time_point::max());
  // This communicator's mark, and (for one made by shrink()) the process's mark in init()'s.
  std::vector<std::pair<std::string, std::string>> on_close{
      {concat(store->prefix(), "exit/", world_rank_in_group), ""}};
  if (const std::string mine = process_exit_key(); !mine.empty()) on_close.emplace_back(mine, "");
  Store root = root_store ? root_store->unwatched() : store->prefixed("");
  if (root_store) {
    root.set_on_close(on_close);
    // Where this process runs: a survivor on the same machine can tell that it died without
    // waiting for the store to notice (MembershipChange).
    if (!job_prefix.empty()) root.set(concat(job_prefix, "proc/", world_rank), process_identity());
    // Heartbeat: should this process stop signing (stopped, hung, cut off), the store counts
    // it gone (the records above), marks it stalled and counts the stall for the watchers.
    if (options.heartbeat.count() > 0 && !job_prefix.empty()) {
      const LeaseRecord on_expire[] = {{concat(job_prefix, "stalled/", world_rank), "", 0, false},
                                       {concat(job_prefix, "stalls"), "", 1, true}};
      root.lease(options.heartbeat, on_expire);
    }
  } else {
    const std::pair<std::string, std::string> own[] = {{concat("exit/", world_rank_in_group), ""}};
    store->set_on_close(own);
  }
}

DDP_INLINE bool CommState::rank_gone(int r) const {
  const auto seen = [&](const std::string& key) {
    const std::string k[] = {key};
    return root_store->check(k);
  };
  if (seen(concat(prefix, "exit/", r))) return true;
  const auto i = static_cast<std::size_t>(r);
  return i < world_ranks.size() && !job_prefix.empty() &&
         seen(concat(job_prefix, "gone/", world_ranks[i]));
}

DDP_INLINE int CommState::waiting_to_enter() const {
  if (!root_store || base_prefix != job_prefix) return 0;
  Store base = root_store->prefixed(base_prefix).unwatched();
  return static_cast<int>(std::max<std::int64_t>(0, base.add("join/next", 0) - joins_seen));
}

DDP_INLINE std::string CommState::process_exit_key() const {
  return job_prefix.empty() ? std::string() : concat(job_prefix, "gone/", world_rank);
}

DDP_INLINE void CommState::abandon() noexcept {
  (void)executor.release();
  (void)new std::shared_ptr<StoreServer>(std::move(server));
  (void)new std::shared_ptr<Store>(std::move(root_store));
  (void)new std::shared_ptr<Store>(std::move(store));
#if DDP_HAS_CUDA
  (void)staging.release();
#endif
}

DDP_INLINE void CommState::check_process(int rank, const char* what) const {
  if (inherited()) [[unlikely]] {
    fail(Errc::invalid_argument, "rank ", rank, ": ", what,
         ": this communicator was created by process ", pid,
         " and cannot be used by a child it fork()ed (this is process ", ::getpid(),
         "): the child would write into the parent's connections and shared memory. Create a "
         "new communicator in the child (another MASTER_PORT or Options::group), or fork "
         "before init()");
  }
}

DDP_INLINE void CommState::announce_leaving() {
  if (!store || !joined || store->lost()) return;
  try {
    Store plain = store->unwatched();
    const int r = world_rank_in_group;
    std::optional<Error> why;
    {
      std::lock_guard lock(poison_mutex);
      if (!poison.empty())
        why.emplace(poison_code, std::string_view{}, poison_origin, poison, poison_lost);
    }
    if (!why)
      plain.set(concat("done/", r), std::to_string(recorder.issued()));
    else
      (void)plain.compare_set(concat("left/", r), "", Store::stop_value(*why));
    plain.set(concat("exit/", r), "");
  } catch (...) {  // leaving anyway
  }
}

DDP_INLINE void CommState::wait_for_the_others(bool connected) {
  if (!store || !joined || store->lost() || !server || server.use_count() > 1) return;
  try {
    Store plain = store->unwatched();  // the waits below must not end at "failed"
    const auto limit =
        std::min<std::chrono::milliseconds>(options.timeout, std::chrono::seconds(10));
    if (connected && poison.empty()) {
      std::vector<std::string> keys;
      for (int r = 0; r < world_size; ++r) keys.push_back(concat("exit/", r));
      (void)plain.missing_after(keys, limit);
    } else if (!connected) {
      // Within the rendezvous's one timeout (and a moment for the others to read why).
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(rendezvous_deadline - Clock::now());
      linger_after_failed_rendezvous(plain,
                                     std::clamp(left, std::chrono::milliseconds(250), limit));
    }
  } catch (...) {  // leaving anyway
  }
}

DDP_INLINE void CommState::linger_after_failed_rendezvous(Store& plain,
                                                          std::chrono::milliseconds limit) const {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    bool all_left = true, all_claimed = true;
    for (int r = 0; r < world_size && all_left; ++r) {
      const std::string claim = concat("claim/", r);
      const std::string left = concat("exit/", r);
      if (!plain.check(std::span<const std::string>(&claim, 1)))
        all_claimed = false;
      else if (!plain.check(std::span<const std::string>(&left, 1)))
        all_left = false;
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    if ((all_left && (all_claimed || waited > std::chrono::seconds(1))) || waited > limit) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

DDP_INLINE void CommState::relay_failure(int rank, const Error& e) {
  // Leaving, this rank then records this failure ("left/<rank>"), not a finish: ranks already
  // past the rendezvous, waiting for it in a collective, read that record.
  poison_with(e);
  if (e.origin_rank() >= 0 && e.origin_rank() != rank)  // another rank's, via the store
    fail_within(e, "rank ", rank, ": ");
  std::string_view why = e.what();
  if (const std::string own = concat("rank ", rank, ": "); why.starts_with(own))
    why.remove_prefix(own.size());  // the relayed message names the rank once
  if (store && !store->lost()) {
    try {
      (void)store->compare_set(
          "failed", "",
          Store::stop_value(Error(e.code(), concat("the rendezvous failed on rank ", rank, ": "),
                                  rank, why, e.lost_ranks())));
    } catch (...) {  // the store is gone too: the peers learn from it
    }
  }
}

DDP_INLINE void CommState::monitored_barrier(int rank, int size, std::chrono::milliseconds timeout,
                                             bool wait_all_ranks) {
  detail::monitored_barrier(*store, monitored_barriers++, rank, size, timeout, wait_all_ranks);
}

DDP_INLINE void CommState::poison_with(const Error& e) {
  std::lock_guard lock(poison_mutex);
  if (poison.empty()) {
    poison = e.what();
    poison_code = e.code();
    poison_origin = e.origin_rank();
    poison_lost = e.lost_ranks();
    poisoned.store(true, std::memory_order_release);
  }
}

DDP_INLINE void CommState::poison_with(std::string why, Errc code) {
  std::lock_guard lock(poison_mutex);
  if (poison.empty()) {
    poison = std::move(why);
    poison_code = code;
    poisoned.store(true, std::memory_order_release);
  }
}

DDP_INLINE void CommState::check_poisoned(int rank, const char* name) const {
  if (poisoned.load(std::memory_order_acquire)) [[unlikely]]
    fail_poisoned(rank, name);
}

DDP_INLINE void CommState::check_membership_after_gap(int rank, const char* name) {
  timespec ts{};
  (void)::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  const std::int64_t now = std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  const std::int64_t last = last_call_ns.exchange(now, std::memory_order_relaxed);
  // Half the time after which the others may have left it out: the timeout, or the heartbeat.
  const auto limit = options.heartbeat.count() > 0 ? std::min(options.timeout, options.heartbeat)
                                                   : options.timeout;
  const std::int64_t half = std::chrono::nanoseconds(limit).count() / 2;
  if (last == 0 || now - last < half || !root_store) [[likely]]
    return;
  std::string why = excluded(rank, name);
  if (why.empty()) why = shrinking(rank, name);
  if (!why.empty()) {
    poison_with(why, Errc::aborted);
    fail(Errc::aborted, why);
  }
}

DDP_INLINE std::string CommState::excluded(int rank, const char* name) const {
  if (stalled())
    return concat("rank ", rank, ": ", name,
                  ": this process sent no sign of life to the rendezvous store for longer than "
                  "the heartbeat (",
                  options.heartbeat.count(),
                  " ms: it was stopped, hung or cut off), so the job counts it as lost and "
                  "goes on without it; it can never act on this communicator again: restart "
                  "the process (it may rejoin the job as a new rank)");
  const std::string v = peek_membership("superseded");
  if (v.empty()) return {};
  const std::size_t colon = v.find(':');
  const std::string members = v.substr(colon + 1);
  const std::vector<int> ranks = parse_ranks(members);
  if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) return {};
  return concat("rank ", rank, ": ", name,
                ": this rank was excluded from the communicator: the other ranks formed "
                "membership epoch ",
                v.substr(0, colon), " of ranks ", members,
                " without it (it was stopped or too slow to take part); it can never act on "
                "this communicator again: restart the process (it may rejoin the job as a new "
                "rank)");
}

DDP_INLINE std::string CommState::shrinking(int rank, const char* name) const {
  const std::string next = peek_membership("shrinking");
  if (next.empty()) return {};
  return concat("rank ", rank, ": ", name,
                ": the other ranks are replacing this communicator after a failure (forming "
                "membership epoch ",
                next, "): call shrink() to take part");
}

DDP_INLINE bool CommState::stalled() const {
  if (!root_store || root_store->lost() || job_prefix.empty() || options.heartbeat.count() <= 0)
    return false;
  try {
    Store plain = root_store->unwatched();
    const std::string k[] = {concat(job_prefix, "stalled/", world_rank)};
    return plain.check(k);
  } catch (...) {
    return false;
  }
}

DDP_INLINE void CommState::watch_peers(std::function<void(const Error&)> lost) {
  if (!root_store || options.heartbeat.count() <= 0 || job_prefix.empty() ||
      world_ranks.size() < 2 || stall_tick != 0)
    return;
  stall_tick = root_store->add_tick([this, lost = std::move(lost)](Store& s) {
    const std::int64_t n = s.add(concat(job_prefix, "stalls"), 0);
    if (n == stalls_seen || stall_reported) return;
    for (std::size_t r = 0; r < world_ranks.size(); ++r) {
      const std::string k[] = {concat(job_prefix, "stalled/", world_ranks[r])};
      if (static_cast<int>(r) == world_rank_in_group || !s.check(k)) continue;
      stall_reported = true;
      const int gone = static_cast<int>(r);
      lost(Error(Errc::peer_lost, concat("rank ", world_rank_in_group, ": "), -1,
                 concat("rank ", r, " (world rank ", world_ranks[r],
                        ") stopped answering: no sign of life reached the rendezvous store for ",
                        options.heartbeat.count(),
                        " ms (the heartbeat; its process is stopped, hung or cut off), so the "
                        "job counts it as lost; shrink() to go on without it"),
                 {gone}));
      return;
    }
    stalls_seen = n;
  });
}

DDP_INLINE void CommState::unwatch_peers() {
  if (stall_tick != 0 && root_store) root_store->remove_tick(stall_tick);
  stall_tick = 0;
}

DDP_INLINE std::string CommState::peek_membership(const char* key) const {
  if (!root_store || root_store->lost()) return {};
  try {
    Store plain = root_store->prefixed(prefix).unwatched();
    return peek_key(plain, key);
  } catch (...) {
    return {};
  }
}
#endif  // DDP_BODIES

}  // namespace detail
DDP_END_NAMESPACE
