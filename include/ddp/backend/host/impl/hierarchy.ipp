// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/hierarchy.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::optional<Transport::Left> left_record(const Store& store,
                                                      const std::vector<int>& ranks,
                                                      std::chrono::milliseconds grace) {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  try {
    Store plain = store.unwatched();
    for (;;) {
      const std::string failed = "failed";
      if (plain.check(std::span<const std::string>(&failed, 1))) {
        // CommState::relay_failure's record: its origin is the rank whose rendezvous failed
        if (const auto e = decode_stop(plain.get(failed)); e && e->origin_rank() >= 0) {
          Transport::Left left;
          left.rank = e->origin_rank();
          left.code = e->code();
          left.message = std::string(e->origin_message());
          left.lost = e->lost_ranks();
          return left;
        }
      }
      for (int j : ranks) {
        const std::string key = concat("left/", j);
        if (!plain.check(std::span<const std::string>(&key, 1))) continue;
        const auto e = decode_stop(plain.get(key));
        if (!e) fail(Errc::protocol, "the leaving record of rank ", j, " is not one");
        Transport::Left left;
        left.rank = j;
        left.code = e->code();
        left.message = e->what();
        if (e->origin_rank() >= 0 && e->origin_rank() != j) {  // it relayed another rank's
          left.origin = e->origin_rank();
          left.origin_message = std::string(e->origin_message());
        }
        left.lost = e->lost_ranks();
        return left;
      }
      for (int j : ranks) {  // one that finished (CommState::announce_leaving)
        const std::string key = concat("done/", j);
        if (!plain.check(std::span<const std::string>(&key, 1))) continue;
        Transport::Left left;
        left.rank = j;
        left.code = Errc::peer_lost;
        left.finished = true;
        left.operations = std::strtoull(plain.get(key).c_str(), nullptr, 10);
        return left;
      }
      // "exit/<rank>" without a record before it: its process died (the store wrote it as the
      // connection closed), and no record will come.
      bool all_exited = true;
      for (int j : ranks) {
        const std::string key = concat("exit/", j);
        all_exited = all_exited && plain.check(std::span<const std::string>(&key, 1));
      }
      if (all_exited || std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error&) {  // the store is gone or the record unreadable: nothing to add
    return std::nullopt;
  }
}

DDP_INLINE void Hierarchy::check_locally(const Fingerprint& f, Transport* remote) {
  if (!active() || local->size() <= 1 || !local->verify_fingerprints) return;
  local->slack = std::chrono::milliseconds(0);
  guarded([&](Transport*&) { empty_round(*local, &f); }, remote);
}

DDP_INLINE void Hierarchy::all_reduce(RoundScratch& s, SingleCopy& single, const Buf& b,
                                      ReduceOp op, const Fingerprint& fp, int size) {
  const bool avg = op == ReduceOp::avg;
  const auto fn = reduce_fn(b.dtype, avg ? ReduceOp::sum : op);
  const auto divide = [&](const Buf& x) {
    if (avg && x.count != 0) divide_fn(b.dtype)(x.data, x.count, size);
  };
  Transport& host = *local;
  const bool by_slices = kind == HostHierarchy::slices &&
                         b.bytes() > slices_from * static_cast<std::size_t>(host.size());
  // Each phase waits a little longer than the one before it (Transport::slack), so that a rank
  // waiting on one that waits on the culprit hears the culprit named before its own timeout.
  host.slack = std::chrono::milliseconds(0);
  if (across) across->slack = std::chrono::milliseconds(250);
  const auto last_phase = [&] { host.slack = std::chrono::milliseconds(500); };
  guarded(
      [&](Transport*& crossing) {
        if (!by_slices) {
          if (host.size() > 1) reduce_on(host, s, b, fn, 0, &fp);
          if (host.rank() == 0) {
            crossing = across.get();
            all_reduce_on(*across, s, b, fn, &fp, &single);
            crossing = nullptr;
            divide(b);
          }
          last_phase();
          if (host.size() > 1) broadcast_on(host, b, 0, nullptr);
          return;
        }
        const int q = host.size();
        const auto part = [&](int j) {  // in elements
          const auto [lo, hi] = split_range(b.count, q, j, b.elem());
          return Range{lo, hi - lo};
        };
        reduce_scatter_parts(host, s, b, fn, part, &fp);
        const Range mine = part(host.rank());
        Buf slice = b;
        slice.data = b.at(mine.off);
        slice.count = mine.len;
        crossing = across.get();
        all_reduce_on(*across, s, slice, fn, &fp, &single);
        crossing = nullptr;
        divide(slice);
        last_phase();
        all_gather_parts(host, b, part);
      },
      across.get());
}

DDP_INLINE void Hierarchy::reduce_scatter(Transport& t, RoundScratch& s, const Buf& in,
                                          const Buf& out, ReduceOp op, const Fingerprint& fp,
                                          int size) {
  const bool avg = op == ReduceOp::avg;
  const auto fn = reduce_fn(out.dtype, avg ? ReduceOp::sum : op);
  const int hosts = host_of.empty() ? 1 : *std::max_element(host_of.begin(), host_of.end()) + 1;
  const std::size_t es = out.elem();
  std::vector<const std::byte*> group, sums(static_cast<std::size_t>(hosts));
  exchange_blocks(t, s, in, out.count, fp, [&](std::size_t s0, std::size_t m, auto ptrs) {
    std::byte* partial = RoundScratch::at_least(s.bytes, static_cast<std::size_t>(hosts) * m * es);
    for (int h = 0; h < hosts; ++h) {
      group.clear();
      for (std::size_t j = 0; j < host_of.size(); ++j) {
        if (host_of[j] == h) group.push_back(ptrs[j]);
      }
      std::byte* sum = partial + static_cast<std::size_t>(h) * m * es;
      fn(sum, nullptr, group.data(), static_cast<int>(group.size()), m);
      sums[static_cast<std::size_t>(h)] = sum;
    }
    fn(out.at(s0), nullptr, sums.data(), hosts, m);
    if (avg && m != 0) divide_fn(out.dtype)(out.at(s0), m, size);
  });
}

DDP_INLINE void Hierarchy::record_leaving(const Error& e) noexcept {
  if (!store) return;
  try {
    store->set(concat("left/", rank), Store::stop_value(e));
  } catch (...) {  // the store is gone: the peers report a lost connection instead
  }
}

}  // namespace detail
DDP_END_NAMESPACE
