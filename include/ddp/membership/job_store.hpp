// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// detail::JobStore: a communicator's connections to the job's rendezvous store: hosting it
/// (rank 0, unless a launcher or etcd does), connecting and claiming this rank, the newcomer's
/// connection, the records that tell the others when this process leaves or dies, the heartbeat's
/// lease, and the store host's wait for the others before it goes.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/env.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/membership/rendezvous.hpp"
#include "ddp/membership/store_location.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"
#include "ddp/store/server.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

struct JobStore {
  Options options;
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
  /// Each rank's number in the communicator init() made (its process), and that communicator's
  /// prefix, under which the store marks a process gone (process_exit_key()): how shrink()
  /// knows that a member of any communicator of the job died.
  std::vector<int> world_ranks;
  std::string job_prefix;
  /// "ddp/<restart>/": where the launcher reads which of its workers the job left out
  /// ("left/<world rank>": stalled past the heartbeat, or excluded by the others' shrink()), to
  /// end them (a stopped process can never act again, and would hold the launcher open).
  std::string launcher_prefix;
  /// When the rendezvous must be done: Options::timeout after init() began.
  Clock::time_point rendezvous_deadline = Clock::time_point::max();

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

  /// The store key that marks this process gone: "<init prefix>gone/<rank in init()'s
  /// communicator>", written only by the store as the process's connection closes (never by a
  /// communicator that is destroyed: its process may live on in another); "" before init().
  [[nodiscard]] std::string process_exit_key() const;

  /// Leaving, first step (the communicator is destroyed, its executor drained, its backend not
  /// yet): this rank says in the store that it left ("exit/<rank>") and how, before its
  /// connections close, so that a peer still waiting for it reports why at once: "done/<rank>"
  /// with the number of operations it ran (`issued`) when it finished without a failure (the
  /// ranks ran different numbers of collectives), "left/<rank>" with its failure `why` otherwise.
  void announce_leaving(const std::optional<Error>& why, std::uint64_t issued);

  /// Leaving, last step (the backend is gone): rank 0 keeps the store up until every rank has
  /// left, so none loses it mid-call, and after a failed rendezvous too, so the others can read
  /// why it failed. A rank whose process died counts as left (its connection's on-close record).
  /// Only the last communicator holding the store waits (another, made from this one by
  /// shrink() or grow(), goes on using it). `failed`: this communicator failed.
  void wait_for_the_others(bool connected, bool failed);

  /// The rendezvous failed here, and this process hosts the store: keep it up until every rank
  /// that claimed its place has left (and has so read why), for at most `limit`; ranks that
  /// never claimed one get a second to appear. Nobody waits for a rank that was never started.
  void linger_after_failed_rendezvous(Store& plain, std::chrono::milliseconds limit) const;
};

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/membership/impl/job_store.ipp"
#endif
