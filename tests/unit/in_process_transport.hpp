// The Host backend's Transport contract over threads of one process, for testing its algorithms
// without forking: every round copies each rank's offer into that rank's own buffer (as the shm
// transport copies it into a slot), waits until every rank has done so, compares the
// fingerprints, and hands out pointers into the other ranks' buffers, valid until the next round.
#pragma once

#include <ddp/backend/host/transport.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace inproc {

using namespace ddp::detail;

/// What the ranks of one in-process group share.
class Group {
 public:
  explicit Group(int size)
      : size_(size),
        offers_(static_cast<std::size_t>(size)),
        fps_(static_cast<std::size_t>(size)) {}

  [[nodiscard]] int size() const { return size_; }

  /// Every rank of the group calls it; returns once all have (Errc::timeout after `timeout`,
  /// Errc::aborted once a rank aborted the group).
  void arrive(int rank, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    if (aborted_) ddp::detail::fail(ddp::Errc::aborted, "rank ", rank, ": the group was aborted");
    const std::uint64_t gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, timeout, [&] { return generation_ != gen || aborted_; }))
      ddp::detail::fail(ddp::Errc::timeout, "rank ", rank, ": in-process round timed out");
    if (aborted_ && generation_ == gen)
      ddp::detail::fail(ddp::Errc::aborted, "rank ", rank, ": the group was aborted");
  }

  void abort() {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    cv_.notify_all();
  }

  std::vector<std::vector<std::byte>>& offers() { return offers_; }
  std::vector<std::optional<Fingerprint>>& fingerprints() { return fps_; }

 private:
  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<std::vector<std::byte>> offers_;
  std::vector<std::optional<Fingerprint>> fps_;
};

/// One rank's end of a Group.
class Transport final : public ddp::detail::Transport {
 public:
  Transport(Group& g, int rank, std::size_t max_offer, std::size_t small_bytes,
            std::chrono::milliseconds timeout = std::chrono::seconds(20))
      : ddp::detail::Transport(rank, g.size(), timeout),
        group_(g),
        max_offer_(max_offer),
        small_(small_bytes),
        ptrs_(static_cast<std::size_t>(g.size())) {}

  [[nodiscard]] std::string_view name() const noexcept override { return "in-process"; }
  [[nodiscard]] std::size_t max_offer() const noexcept override { return max_offer_; }
  [[nodiscard]] std::size_t small_bytes() const noexcept override { return small_; }

  std::span<const std::byte* const> round(std::span<const Piece> offer, Want want,
                                          const Fingerprint* fp) override {
    group_.arrive(rank_, timeout_);  // every rank is done with the previous round's pointers
    std::vector<std::byte>& mine = group_.offers()[static_cast<std::size_t>(rank_)];
    mine.clear();
    for (const Piece& p : offer) {
      if (p.len > 0) mine.insert(mine.end(), p.data, p.data + p.len);
    }
    if (mine.size() > max_offer_ * static_cast<std::size_t>(size_) + max_offer_)
      ddp::detail::fail(ddp::Errc::invalid_argument, "rank ", rank_, ": offered ", mine.size(),
                        " bytes, more than a round carries");
    group_.fingerprints()[static_cast<std::size_t>(rank_)] =
        fp != nullptr ? std::optional<Fingerprint>(*fp) : std::nullopt;
    ++rounds;
    group_.arrive(rank_, timeout_);
    if (fp != nullptr && verify_fingerprints) {
      for (int j = 0; j < size_; ++j) {
        const auto& theirs = group_.fingerprints()[static_cast<std::size_t>(j)];
        if (!theirs || !(*theirs == *fp))
          ddp::detail::fail(ddp::Errc::mismatch,
                            mismatch_message(*fp, j, theirs ? *theirs : Fingerprint{}));
      }
    }
    for (int j = 0; j < size_; ++j) {
      const Range r = want(j, rank_);
      const auto& theirs = group_.offers()[static_cast<std::size_t>(j)];
      if (r.len != 0 && r.off + r.len > theirs.size())
        ddp::detail::fail(ddp::Errc::protocol, "rank ", rank_, ": wants bytes [", r.off, ", ",
                          r.off + r.len, ") of rank ", j, "'s offer of ", theirs.size());
      ptrs_[static_cast<std::size_t>(j)] = r.len != 0 ? theirs.data() + r.off : nullptr;
    }
    return ptrs_;
  }

  void send(const Buf&, int, int, std::uint64_t) override {
    ddp::detail::fail(ddp::Errc::unsupported, "in-process transport: no send");
  }
  void recv(const Buf&, int, int, std::uint64_t) override {
    ddp::detail::fail(ddp::Errc::unsupported, "in-process transport: no recv");
  }
  void abort(ddp::Errc code, const std::string&) override {
    set_local_abort(code);
    group_.abort();
  }

  int rounds = 0;  ///< rounds this rank took part in

 private:
  Group& group_;
  std::size_t max_offer_;
  std::size_t small_;
  std::vector<const std::byte*> ptrs_;
};

/// Runs body(rank) on `n` threads; returns each rank's error message ("" when it succeeded). A
/// rank that fails aborts `groups`, so that the others fail at once instead of at the timeout.
inline std::vector<std::string> run_ranks(int n, const std::function<void(int)>& body,
                                          std::vector<Group*> groups = {}) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
        for (Group* g : groups) g->abort();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace inproc
