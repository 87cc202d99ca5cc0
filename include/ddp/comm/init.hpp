// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How Communicator::init and split prepare a backend's start (detail::BackendInit): init reads
/// the DDP_* settings, checks the launcher's environment and joins the rendezvous store (rank 0,
/// or the launcher, hosts it); split orders the ranks of one color by (key, rank) and gives the
/// group a store prefix of its own. The backend then connects (Backend::create).

#include "ddp/backend/backend.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/comm/state.hpp"
#include "ddp/detail/env.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/membership/agreement.hpp"
#include "ddp/membership/growth.hpp"
#include "ddp/observe/timeline.hpp"
#include "ddp/options.hpp"
#include "ddp/store/client.hpp"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The first half of Communicator::init: `options` with the DDP_* settings applied, `state`
/// configured, the launcher's environment checked and, when the backend needs one, the
/// rendezvous store joined. A malformed DDP_* variable is left in `bad_setting` when the store
/// was joined (the rank fails once it has joined the rendezvous, so that the others learn why
/// at once instead of at their timeout), and thrown here otherwise.
DDP_INLINE BackendInit begin_init(CommState& state, const Environment& env, Options& options,
                                  bool needs_store, std::exception_ptr& bad_setting);

/// Where Options::timeline names a directory: starts this process's timeline there (the first
/// communicator does; later ones add their group's track, named `label`: the group, and for
/// split()'s its color). Times are CLOCK_MONOTONIC (one clock for every process of a host),
/// shifted once per process onto rank 0's: at init() (`at_init`, where every rank agreed through
/// the store that the timeline is on, rendezvous.hpp), every rank reads its clock after each of
/// three barriers, rank 0's readings reach the others through the store, and the offset is the
/// median of the three differences (the barriers' exits are microseconds apart); rank 0's first
/// reading also names the run. A process admitted later, or one without a store (backend::Mpi),
/// keeps its own clock, which is rank 0's on rank 0's host.
template <class State>
void start_timeline(State& s, bool at_init, std::string_view label) {
  if (s.options.timeline.empty()) return;
  Timeline& t = Timeline::get();
  t.open(s.options.timeline, s.world_rank);
  s.timeline_lane = t.lane_of(label, std::remove_cvref_t<decltype(*s.backend)>::name);
  if (t.aligned()) return;
  auto& be = *s.backend;
  if (!at_init || be.size() == 1 || !s.store)
    return t.align(0, 0, concat("pid ", ::getpid(), " at ", Timeline::now_ns()));
  std::int64_t mine[3] = {}, zero[3] = {};
  for (std::int64_t& m : mine) {
    be.barrier();
    m = Timeline::now_ns();
  }
  const std::string key = concat("timeline/clock/", s.epoch);
  if (be.rank() == 0) {
    s.store->set(key, std::string_view(reinterpret_cast<const char*>(mine), sizeof mine));
    std::memcpy(zero, mine, sizeof zero);
  } else if (const std::string v = s.store->get(key); v.size() == sizeof zero) {
    std::memcpy(zero, v.data(), sizeof zero);
  } else {
    std::memcpy(zero, mine, sizeof zero);
  }
  std::int64_t d[3] = {zero[0] - mine[0], zero[1] - mine[1], zero[2] - mine[2]};
  std::sort(d, d + 3);
  t.align(d[1], 0, concat("rank 0 at ", zero[0]));
}

/// Errc::invalid_argument when the program's units were compiled in both of ddp's modes
/// (ddp_program_modes, config.hpp): they would run two copies of ddp's state.
DDP_INLINE void refuse_mixed_modes(int rank, const char* what);

/// Communicator::init: the state of a new communicator, connected; every message names the rank.
template <class State>
std::shared_ptr<State> init_state(const Environment& env, Options options) {
  refuse_mixed_modes(env.rank, "init");
  try {
    auto state = std::make_shared<State>();
    std::exception_ptr bad_setting;
    using Backend = std::remove_cvref_t<decltype(*state->backend)>;
    const BackendInit bi =
        begin_init(*state, env, options, backend_traits<Backend>::needs_store, bad_setting);
    state->create_backend(bi, [&] {
      if (bad_setting) std::rethrow_exception(bad_setting);
      if (bi.store)
        agree_on_job(*bi.store, bi.rank,
                     {bi.size, std::string(Backend::name), options.verify_collectives,
                      options.heartbeat.count(), !options.timeline.empty()},
                     options.timeout, state->world_size);
    });
    state->end_rendezvous();
    state->watch_peers();
    start_timeline(*state, true, state->options.group);
    return state;
  } catch (const Error& e) {
    if (std::string_view(e.what()).starts_with("rank ")) throw;
    fail_within(e, "rank ", env.rank, ": ");
  }
}

/// A communicator made by split(): `sub` takes `options` (the parent's, or the split's own) and
/// its place in `parent`'s job.
DDP_INLINE void inherit_settings(CommState& sub, const CommState& parent, const Options& options);

/// split() on a backend that does not split itself: the group of `color` among every rank's
/// (color, key) `all`, ordered by (key, rank); `sub` configured with `options`, with a store
/// prefix of its own (the n-th split of `parent`). `rank`: this rank in `parent`.
DDP_INLINE BackendInit begin_split(CommState& sub, const CommState& parent,
                                   const std::vector<std::pair<int, int>>& all, int color, int rank,
                                   std::uint64_t n, const Options& options);

/// Why a backend without a rendezvous store (backend::Mpi) cannot `what` (shrink, grow, enter),
/// for the refusal.
DDP_INLINE const char* membership_refusal(std::string_view backend, std::string_view what);

/// Errc::unsupported for `what` (shrink, grow, enter) on a backend without a rendezvous store.
template <class Backend>
void refuse_membership(int rank, const char* what) {
  if constexpr (!backend_traits<Backend>::needs_store)
    fail(Errc::unsupported, "rank ", rank, ": ", what,
         ": not available on backend::", Backend::name, " (",
         membership_refusal(Backend::name, what), "); for fault tolerance use backend::Host");
}

/// Connects `sub` (its root store, prefix, options and rendezvous deadline set) as `rank` of
/// `size` under its prefix: the backend made, and the job agreed on as at init().
template <class State>
void connect_members(State& sub, int rank, int size, std::chrono::milliseconds reach_window = {}) {
  BackendInit bi;
  bi.rank = rank;
  bi.size = size;
  bi.reach_window = reach_window;
  bi.local_rank = sub.local_rank_hint;
  bi.options = sub.options;
  bi.store = std::make_shared<Store>(sub.root_store->prefixed(sub.prefix)
                                         .watching("failed")
                                         .with_deadline(sub.rendezvous_deadline));
  sub.store = bi.store;
  sub.world_size = size;
  sub.joined = true;
  sub.create_backend(bi, [&] {
    agree_on_job(*bi.store, rank,
                 {size, std::string(std::remove_cvref_t<decltype(*sub.backend)>::name),
                  bi.options.verify_collectives, bi.options.heartbeat.count()},
                 bi.options.timeout, sub.world_size);
  });
}

/// Errc::aborted when `old` was already replaced by an earlier shrink() or grow().
template <class State>
void refuse_replaced(const State& old, int rank, const char* what) {
  if (old.replaced_by != 0)
    fail(Errc::aborted, "rank ", rank, ": ", what,
         ": this communicator was already replaced by membership epoch ", old.replaced_by,
         " (an earlier shrink() or grow() returned it); use that communicator");
}

/// split() on a backend that splits itself (backend_traits::splits): the backend's split under
/// `s`'s runner, the new state inheriting `s`'s settings with `options`; nullptr for no_color.
template <class State>
std::shared_ptr<State> split_backend(State& s, int color, int key, const Options& options) {
  using Backend = std::remove_cvref_t<decltype(*s.backend)>;
  std::unique_ptr<Backend> made;
  s.run_in_order("split", 0, [&](Backend& b, State&) { made = b.split(color, key, options); });
  if (!made) return nullptr;
  auto sub = std::make_shared<State>();
  inherit_settings(*sub, s, options);
  sub->backend = std::move(made);
  start_timeline(*sub, false, concat(options.group, ", split color ", color));
  return sub;
}

/// Communicator::shrink on a backend that shrinks itself (backend::Mpi with ULFM): the
/// survivors' communicator at the next membership epoch; `old` fails every call afterwards.
/// A refusal (no ULFM) leaves `old` as it was.
template <class State>
std::shared_ptr<State> shrink_backend(State& old, int rank) {
  refuse_replaced(old, rank, "shrink");
  auto sub = std::make_shared<State>();
  inherit_settings(*sub, old, old.options);
  sub->backend = old.backend->shrink(sub->previous);
  sub->epoch = old.epoch + 1;
  old.poison_with(concat("rank ", rank, ": the communicator was replaced by shrink() (membership ",
                         "epoch ", sub->epoch, ")"),
                  Errc::aborted);
  old.replaced_by = sub->epoch;
  return sub;
}

/// Communicator::shrink on a backend that does not shrink itself: agree with the other
/// survivors of `old` (this rank `rank` of `size`) on the members of the next membership epoch
/// (membership/agreement.hpp), connect them, and return the new communicator's state; another
/// round when a member fails or dies meanwhile. Fails with Errc::aborted when this rank is left
/// out.
template <class State>
std::shared_ptr<State> shrink_state(State& old, int rank, int size, const ShrinkOptions& o) {
  refuse_replaced(old, rank, "shrink");
  const TimelineScope span(Lane::steps, "shrink", "membership");
  MembershipChange change(old, rank, size, o);
  change.announce();
  // Every call on the old communicator fails from now on, and ranks still waiting in it are
  // woken (shared memory), so that they come to agree sooner.
  old.poison_with(concat("rank ", rank, ": the communicator was replaced by shrink()"),
                  Errc::aborted);
  old.backend->abort(Errc::aborted,
                     concat("rank ", rank, " left this communicator to form membership epoch ",
                            change.epoch(), " with the other survivors (shrink)"));
  for (;;) {
    const std::vector<int> members = change.decide();
    auto sub = std::make_shared<State>();
    inherit_settings(*sub, old, old.options);
    sub->root_store = old.root_store;
    sub->server = old.server;  // the store this process hosts outlives `old`
    sub->prefix = change.prefix();
    sub->base_prefix = old.base_prefix;
    sub->epoch = change.epoch();
    sub->previous = members;
    sub->job_prefix = old.job_prefix;
    for (int m : members)
      if (static_cast<std::size_t>(m) < old.world_ranks.size())
        sub->world_ranks.push_back(old.world_ranks[static_cast<std::size_t>(m)]);
    sub->rendezvous_deadline = Deadline::after(old.options.timeout).at;
    bool connected = false;
    std::vector<int> cut;  // the members this rank could not reach (new ranks): a partition
    try {
      connect_members(*sub, change.new_rank(), static_cast<int>(members.size()),
                      reach_window_for(old.options.timeout));
      connected = true;
    } catch (const Error& e) {
      if (e.code() != Errc::peer_lost && e.code() != Errc::timeout && e.code() != Errc::aborted) {
        (void)change.settle(false);
        throw;
      }
      if (e.code() == Errc::peer_lost && e.origin_rank() < 0) cut = e.lost_ranks();  // its own
    }
    if (change.settle(connected, cut)) {
      sub->end_rendezvous();
      sub->watch_peers();
      start_timeline(*sub, false, sub->options.group);
      sub->timeline_lane = old.timeline_lane;  // the same group: the same track
      old.replaced_by = change.epoch();
      return sub;
    }
  }
}

/// split() on a backend that does not split itself: the group of `color` (see begin_split),
/// connected, its members agreeing on the job as at init.
template <class State>
std::shared_ptr<State> split_state(State& parent, const std::vector<std::pair<int, int>>& all,
                                   int color, int rank, std::uint64_t n, const Options& options) {
  auto sub = std::make_shared<State>();
  const BackendInit bi = begin_split(*sub, parent, all, color, rank, n, options);
  sub->create_backend(bi, [&] {
    if (bi.store)
      agree_on_job(*bi.store, bi.rank,
                   {bi.size, std::string(std::remove_cvref_t<decltype(*parent.backend)>::name),
                    options.verify_collectives, options.heartbeat.count()},
                   options.timeout, sub->world_size);
  });
  sub->watch_peers();
  start_timeline(*sub, false, concat(options.group, ", split ", n, " color ", color));
  return sub;
}

/// The communicator of epoch `epoch` under `root`'s job prefix `base`: `sub` connected as `rank`
/// of `size` (members, then newcomers). `mine`: what the store sets should this process die
/// while connecting (besides the new communicator's "failed" key).
template <class State>
void connect_grown(State& sub, const std::string& base, std::uint64_t epoch, const Growth& g,
                   int rank, int size, std::vector<std::pair<std::string, std::string>> mine) {
  sub.prefix = concat(base, growth_key(epoch, g.from, "comm/"));
  sub.base_prefix = base;
  sub.job_prefix = base;
  sub.epoch = epoch;
  sub.rendezvous_deadline = Deadline::after(sub.options.timeout).at;
  mine.emplace_back(
      concat(sub.prefix, "failed"),
      Store::stop_value(Errc::peer_lost, concat("rank ", rank, " of membership epoch ", epoch,
                                                " died while the job was admitting newcomers")));
  sub.root_store->set_on_close(mine);
  await_participants(*sub.root_store, base, epoch, rank, sub.world_ranks, g,
                     Deadline::after(sub.options.timeout).at);
  connect_members(sub, rank, size);
  sub.end_rendezvous();
  sub.watch_peers();
  start_timeline(sub, false, sub.options.group);
}

/// Communicator::grow: the members of `old` (this rank `rank` of `size`) admit the processes
/// waiting to enter (membership/growth.hpp) and connect with them; nullptr when none was admitted
/// (`old` goes on). A failure leaves `old` usable: shrink() it.
template <class State>
std::shared_ptr<State> grow_state(State& old, int rank, const GrowOptions& o) {
  refuse_replaced(old, rank, "grow");
  const TimelineScope span(Lane::steps, "grow", "membership");
  if (!old.root_store)
    fail(Errc::unsupported, "rank ", rank,
         ": grow: this communicator has no rendezvous store (a world of one started without a "
         "launcher, or a group that backend::Nccl's split() made); start the job under ddprun "
         "or ddp::spawn, and grow the communicator that init() made");
  if (old.base_prefix != old.job_prefix)
    fail(Errc::unsupported, "rank ", rank,
         ": grow: newcomers join the communicator that init() made (and those that shrink() and "
         "grow() made from it), not one that split() made");
  const std::uint64_t epoch = old.epoch + 1;
  Store base = old.root_store->prefixed(old.base_prefix).unwatched();
  const Growth g =
      rank == 0 ? decide_growth(old, base, epoch, o.ticket)
                : await_growth(old, base, epoch, rank, Deadline::after(old.options.timeout).at);
  old.joins_seen = g.upto;
  ++old.grow_calls;
  if (g.ids.empty()) return nullptr;
  auto sub = std::make_shared<State>();
  inherit_settings(*sub, old, old.options);
  sub->root_store = old.root_store;
  sub->server = old.server;
  sub->world_ranks = g.members;
  sub->world_ranks.insert(sub->world_ranks.end(), g.claims.begin(), g.claims.end());
  sub->joins_seen = g.upto;
  const int size = static_cast<int>(g.members.size());
  for (int r = 0; r < size + static_cast<int>(g.ids.size()); ++r)
    sub->previous.push_back(r < size ? r : -1);
  std::vector<std::pair<std::string, std::string>> mine{{concat(old.prefix, "exit/", rank), ""}};
  if (const std::string p = old.process_exit_key(); !p.empty()) mine.emplace_back(p, "");
  connect_grown(*sub, old.base_prefix, epoch, g, rank, size + static_cast<int>(g.ids.size()),
                std::move(mine));
  sub->timeline_lane = old.timeline_lane;  // the same group: the same track
  old.replaced_by = epoch;
  old.poison_with(concat("rank ", rank,
                         ": the communicator was replaced by grow() (membership "
                         "epoch ",
                         epoch, ")"),
                  Errc::aborted);
  return sub;
}

/// Communicator::enter: this process asks the running job of `env` to admit it, as the world rank
/// `env.rank` (its own again, after a restart, or one of its own for an added process), and,
/// once admitted at the members' next grow(), connects with them.
template <class State>
std::shared_ptr<State> enter_state(const Environment& env, Options options, const EnterOptions& j) {
  refuse_mixed_modes(env.rank, "enter");
  std::exception_ptr bad_setting;
  options = options.with_env(EnvReader(), bad_setting);
  if (bad_setting) std::rethrow_exception(bad_setting);
  if (j.wait.count() < 0)
    fail(Errc::invalid_argument, "rank ", env.rank, ": enter: EnterOptions::wait is ",
         j.wait.count(), " ms; give 0 (the communicator's timeout) or more");
  auto s = std::make_shared<State>();
  s->configure(options);
  s->world_rank = env.rank;
  s->local_rank_hint = env.local_rank;
  try {
    s->connect_to_job(env);
  } catch (const Error& e) {  // the store's words, under the rank and the call
    fail_within(e, "rank ", env.rank, ": enter: ");
  }
  Store base = s->root_store->prefixed(s->base_prefix).unwatched();
  JoinRequest request(base, env.rank, j.ticket, env.world_size);
  const auto wait = j.wait.count() > 0 ? j.wait : options.timeout;
  const std::string reply = request.await(Clock::now() + wait);
  if (reply == "ended")
    fail(Errc::peer_lost, "rank ", env.rank,
         ": enter: every member of the running job has ended (their processes are gone), so "
         "nobody is left to admit this process; the request was withdrawn");
  const auto number_at = [&](std::size_t from, std::int64_t most) {
    std::int64_t v = -1;
    const char* end = reply.data() + reply.size();
    const auto [stop, ec] = std::from_chars(reply.data() + std::min(from, reply.size()), end, v);
    if (ec != std::errc{} || v < 0 || v > most || (stop != end && *stop != ' '))
      fail(Errc::protocol, "rank ", env.rank,
           ": enter: the reply to this process's request is damaged (\"", reply.substr(0, 200),
           "\"): is another program writing into this job's store?");
    return v;
  };
  if (reply.starts_with("refuse ")) {
    const auto code = number_at(7, 255);
    const std::size_t sp = reply.find(' ', 7);
    fail(static_cast<Errc>(code), "rank ", env.rank, ": enter: the job refused this process: ",
         sp == std::string::npos ? std::string() : reply.substr(sp + 1));
  }
  if (!reply.starts_with("admit "))
    fail(Errc::timeout, "rank ", env.rank, ": enter: no member admitted this process within ",
         wait.count(),
         " ms (the request was withdrawn): the members admit newcomers when they call grow(), "
         "which a TrainingState loop does when TrainingState::entering() says so after a commit; "
         "is the job running, with the same DDP_GROUP, token and MASTER_ADDR:MASTER_PORT?");
  const auto epoch = static_cast<std::uint64_t>(number_at(6, std::int64_t{1} << 40));
  const std::size_t tag_at = reply.find(' ', 6);
  const std::int64_t from =
      number_at(tag_at == std::string::npos ? reply.size() : tag_at + 1, std::int64_t{1} << 62);
  const std::string key[] = {join_key(request.id(), "decision")};
  base.wait(key);
  Growth g = Growth::parse(base.get(key[0]), env.rank);
  g.from = from;
  const auto at = std::find(g.ids.begin(), g.ids.end(), request.id());
  if (at == g.ids.end())
    fail(Errc::protocol, "rank ", env.rank, ": enter: admitted to membership epoch ", epoch,
         " but not in its decision");
  const int members = static_cast<int>(g.members.size());
  s->world_ranks = g.members;
  s->world_ranks.insert(s->world_ranks.end(), g.claims.begin(), g.claims.end());
  s->joins_seen = g.upto;
  for (int r = 0; r < members + static_cast<int>(g.ids.size()); ++r)
    s->previous.push_back(r < members ? r : -1);
  const std::string base_prefix = s->base_prefix;
  if (join_phase_hook() != nullptr) join_phase_hook()("admitted");
  connect_grown(*s, base_prefix, epoch, g, members + static_cast<int>(at - g.ids.begin()),
                members + static_cast<int>(g.ids.size()),
                {{concat(base_prefix, join_key(request.id(), "gone")), ""},
                 {concat(base_prefix, "gone/", env.rank), ""}});
  return s;
}

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/comm/impl/init.ipp"
#endif
