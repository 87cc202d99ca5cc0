// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What runs a Communicator's operations: detail::CommRunner, the communicator's state
/// (detail::CommState, everything that does not depend on the backend, plus the backend) and
/// how each operation runs on it: in issue order, inline when the communicator is idle, else on
/// its worker (submit), recorded in the flight recorder, poisoning the communicator when it
/// fails. And detail::hold: the tensors that share their storage an async operation keeps alive.

#include "ddp/comm/dispatch.hpp"
#include "ddp/comm/init.hpp"
#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/comm/call.hpp"
#include "ddp/comm/state.hpp"
#include "ddp/error.hpp"
#include "ddp/observe/recorder.hpp"
#include "ddp/observe/timeline.hpp"
#include "ddp/tensor.hpp"
#include "ddp/work.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <ranges>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Copies of the arguments whose type shares its storage (tensor_traits<T>::shares_storage,
/// e.g. torch::Tensor), which an asynchronous operation holds until it has finished: dropping
/// the last reference to such a tensor before wait() is allowed, as in torch.distributed.
using Holds = std::vector<std::shared_ptr<const void>>;
template <class T>
void hold_into(Holds& h, const T& t) {
  using U = std::remove_cvref_t<T>;
  if constexpr (shares_storage<U>) h.push_back(std::make_shared<const U>(t));
}
/// Whether T is a ddp::from/ddp::into of a temporary that owns its elements (a std::vector made
/// in the call): gone when the call returns, before an _async collective reads or writes it.
template <class T>
inline constexpr bool wraps_a_temporary = false;
template <class X>
inline constexpr bool wraps_a_temporary<From<X>> =
    !std::is_reference_v<X> && std::ranges::range<X> && !std::ranges::borrowed_range<X> &&
    !shares_storage<X>;
template <class X>
inline constexpr bool wraps_a_temporary<Into<X>> = wraps_a_temporary<From<X>>;

/// What an _async call keeps alive (it runs after the call returns).
template <class... T>
Holds hold(const T&... t) {
  static_assert(!(wraps_a_temporary<T> || ...),
                "ddp: ddp::from(...) or ddp::into(...) of a temporary in an _async call: the "
                "temporary is destroyed when the call returns, before the collective uses it; "
                "name the buffer (a variable that outlives the Work)");
  Holds h;
  if constexpr ((shares_storage<std::remove_cvref_t<T>> || ...)) (hold_into(h, t), ...);
  return h;
}

/// A communicator's state, and how its operations run. `Comm`: the Communicator (its local
/// group is one).
template <class Backend, class Comm>
struct CommRunner : CommState {
  CommRunner() = default;
  CommRunner(const CommRunner&) = delete;
  CommRunner& operator=(const CommRunner&) = delete;
  ~CommRunner() {
    if (inherited()) {  // a fork() child's copy: see CommState::abandon
      abandon();
      (void)backend.release();
      (void)local_group.release();
      return;
    }
    unwatch_peers();  // the heartbeat's watch touches the backend: it ends first
    local_group.reset();
    executor.reset();  // drain the queue first
    const bool connected = backend != nullptr;
    announce_leaving();  // before the backend's connections close: peers read why
    backend.reset();
    wait_for_the_others(connected);
    Timeline::get().flush();
  }

  /// Creates the backend after `before()` (checks that need the store), telling the other
  /// ranks when this rank fails (CommState::relay_failure).
  template <class Check>
  void create_backend(const BackendInit& bi, const Check& before) {
    world_rank_in_group = bi.rank;
    try {
      before();
      backend = Backend::create(bi);
    } catch (const Error& e) {
      relay_failure(bi.rank, e);
      throw;
    }
  }
  /// The heartbeat's watch of the members (CommState::watch_peers): a member that stopped
  /// answering poisons this communicator and aborts its backend, so that a collective waiting
  /// for it fails at once with Errc::peer_lost naming it.
  void watch_peers() {
    CommState::watch_peers([this](const Error& lost) {
      poison_with(lost);
      if (!backend) return;
      if constexpr (requires { backend->abort_with(lost); })
        backend->abort_with(lost);  // the peers learn the lost ranks too
      else
        backend->abort(lost.code(), lost.what());
    });
  }

  [[nodiscard]] std::string trace(std::string_view why) const {
    return format_trace(recorder.recent(), recorder.issued(), backend->rank(), backend->size(),
                        options.group, why);
  }

  /// What the timeline shows of an operation: a span on this group's track, named after the
  /// bucket whose hook issued it (`bucket`, Timeline::bucket_label), with its sequence number,
  /// bytes, time in the queue (since `issued_ns`) and root or peer.
  struct Traced {
    std::size_t bytes = 0;
    int root = -1;
    int bucket = -1;
    std::int64_t issued_ns = 0;
    /// As the issuing thread sees it (the bucket label, the time), when the timeline is on.
    static Traced at_issue(std::size_t bytes, int root) {
      return Timeline::get().on()
                 ? Traced{bytes, root, Timeline::bucket_label(), Timeline::now_ns()}
                 : Traced{bytes, root};
    }
  };

  /// Runs an operation unless the communicator is poisoned (then fails at once), and poisons it
  /// when the operation fails; keeps the flight recorder's entry `seq` up to date and dumps the
  /// recorder when the operation times out; records it in the timeline. body(backend, state).
  template <class F>
  void run_guarded(std::uint64_t seq, const char* name, const Traced& t, const F& body) {
    using St = TraceRecord::State;
    TimelineScope span(timeline_lane, name, "collective");
    if (span.on()) [[unlikely]] {
      span.arg("seq", static_cast<std::int64_t>(seq));
      span.arg("bytes", static_cast<std::int64_t>(t.bytes));
      if (t.root >= 0 && std::string_view(name) != "all_reduce") span.arg("root_or_peer", t.root);
      if (t.issued_ns != 0 && t.issued_ns < span.start())
        span.arg("queued_us", (span.start() - t.issued_ns) / 1000);
      if (t.bucket >= 0) {
        span.arg("bucket", t.bucket);
        span.label(concat(name, " (bucket ", t.bucket, ")"));
      }
    }
    try {
      run_poisoning(backend->rank(), name, [&] { body(*backend, *this); });
    } catch (const Error& e) {
      recorder.update(seq, St::failed);
      if (e.code() == Errc::timeout && !options.trace_dump.empty())
        dump_trace(options.trace_dump, trace(e.what()), options.group, backend->rank());
      throw;
    } catch (...) {
      recorder.update(seq, St::failed);
      throw;
    }
    recorder.update(seq, St::done);
  }

  /// Runs `body` in issue order: inline when the communicator is idle (recorded as running at
  /// once: no allocation, no lock, one record written), else queued behind what runs.
  template <class F>
  void run_in_order(const char* name, std::size_t bytes, const F& body, int root = -1) {
    using St = TraceRecord::State;
    // A poisoned communicator fails at once and records nothing: its recorder keeps the
    // operation that failed, not thousands of refused calls after it.
    check_poisoned(backend->rank(), name);
    check_membership_after_gap(backend->rank(), name);
    std::uint64_t seq = 0;
    const Traced traced = Traced::at_issue(bytes, root);
    executor->run(
        [&](bool now) {
          if (now)
            seq = recorder.issue(name, bytes, St::running);
          else
            recorder.update(seq, St::running);
          run_guarded(seq, name, traced, body);
        },
        [&] { return seq = recorder.issue(name, bytes, St::queued); });
  }

  /// Asynchronous: the call runs on the worker; `many` keeps all_reduce_coalesced's buffers,
  /// `counts` an uneven collective's counts, `held` the tensors that share their storage. The
  /// operation refers to this state by pointer: the destructor drains the queue first.
  Work submit(Call c, std::vector<Buf> many, Holds held, std::vector<std::size_t> counts) {
    if (poisoned.load(std::memory_order_acquire)) [[unlikely]] {  // fails on wait(), unrecorded
      auto failed = std::make_shared<WorkState>();
      try {
        check_poisoned(backend->rank(), c.name);
      } catch (...) {
        failed->finish(std::current_exception());
      }
      return Work(std::move(failed));
    }
    try {
      check_membership_after_gap(backend->rank(), c.name);
    } catch (...) {
      auto failed = std::make_shared<WorkState>();
      failed->finish(std::current_exception());
      return Work(std::move(failed));
    }
    return Work(executor->submit_recorded(
        [&] { return recorder.issue(c.name, c.bytes, TraceRecord::State::queued); },
        [&](std::uint64_t seq) {
          return std::function<void()>([this, seq, c, many = std::move(many),
                                        held = std::move(held), counts = std::move(counts),
                                        traced = Traced::at_issue(c.bytes, c.root)]() mutable {
            if (!many.empty()) c.many = many;
            if (!counts.empty()) c.counts = counts;
            recorder.update(seq, TraceRecord::State::running);
            run_guarded(seq, c.name, traced,
                        [&](Backend& be, CommRunner& st) { dispatch(be, st, c); });
          });
        }));
  }

  std::unique_ptr<Backend> backend;
  std::unique_ptr<Comm> local_group;
};

}  // namespace detail
DDP_END_NAMESPACE
