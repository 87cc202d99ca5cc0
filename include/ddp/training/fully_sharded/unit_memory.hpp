// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Parts of the fully sharded engine (ddp/training/fully_sharded/fully_sharded.hpp): where it keeps
/// its arrays (a shard's blocks, a gathered unit, a unit's gradients), in pages of their own on the
/// host (returned to the system when freed, so a released unit never stays resident in malloc's
/// heap) or in a CUDA device's memory, ordered on the stream the program computes on (builds
/// with CUDA); FullyShardedOptions, where the program asks for which; UnitOrder, the order check.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/backend/backend.hpp"
#include "ddp/comm/dispatch.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"
#if DDP_HAS_CUDA
#include "ddp/cuda.hpp"
#endif

#include <sys/mman.h>

#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Where FullyShardedAverager gathers units and keeps the shard.
struct FullyShardedOptions {
  /// Where units are gathered and their gradients written: the host, or a CUDA device (by
  /// default the host, or on a backend that moves device memory only, backend::Nccl, the
  /// communicator's device). The shard lives there too, unless `offload`.
  std::optional<Device> device{};
  /// Keep the shard (its values, their averaged gradients and so the optimizer's state) in host
  /// memory while units are gathered on the CUDA device, as FSDP2's CPUOffloadPolicy: each
  /// gather copies this rank's block in, each reduce copies the averaged block out, and the
  /// optimizer runs on the host. (With units on the host too it changes nothing.)
  bool offload = false;
  /// Check at each synchronize(), in one all_reduce of 16 bytes, that every rank issued the
  /// same units' gathers and reduces in the same order this step (units of one size gathered
  /// in different orders would otherwise mix their values up silently): Errc::mismatch.
  bool check_order = true;
  /// The CUDA stream the program computes on with gathered units (nullptr: the legacy default
  /// stream). The engine copies and communicates on a stream of its own, ordered against this
  /// one by events (a prefetch or a reduce runs beside the program's kernels), and the shard's
  /// views carry this stream for the optimizer.
  void* stream = nullptr;
};

namespace detail {

/// A zero-filled array of n T's in pages of its own, returned to the system when it goes: a
/// unit's gathered parameters or gradients never stay resident in the heap after release (as
/// freed blocks of malloc's heap would, raising the peak), and zeros cost nothing until written.
template <class T>
class PageArray {
  static_assert(std::is_trivially_copyable_v<T>, "PageArray holds plain numbers");

 public:
  PageArray() = default;
  /// Errc::system naming `what` when the pages cannot be had (a memory limit, say).
  PageArray(std::size_t n, int rank, const char* what) : size_(n) {
    if (n == 0) return;
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      fail(Errc::invalid_argument, "rank ", rank, ": FullyShardedAverager: ", what, " of ", n,
           " elements is more than memory can address");
    void* p =
        ::mmap(nullptr, n * sizeof(T), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      fail_errno(errno, "rank ", rank, ": FullyShardedAverager: no memory for ", what, " (",
                 n * sizeof(T),
                 " bytes); shard the model over more ranks or cut its units smaller");
    data_ = static_cast<T*>(p);
  }
  PageArray(PageArray&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PageArray& operator=(PageArray&& o) noexcept {
    PageArray(std::move(o)).swap(*this);
    return *this;
  }
  ~PageArray() {
    if (data_ != nullptr) ::munmap(data_, size_ * sizeof(T));
  }
  void swap(PageArray& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
  }
  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Where an array lives: the host, or a CUDA device with the stream its work is ordered on.
struct Place {
  Device device = Device::cpu();
  void* stream = nullptr;
  [[nodiscard]] bool cuda() const noexcept { return device.is_cuda(); }
};

/// n T's at a Place, zero-filled when made: host pages (PageArray), or CUDA memory (zeroed on
/// the place's stream). view() is the TensorView a collective takes (device and stream).
template <class T>
class UnitArray {
 public:
  UnitArray() = default;
  /// Errc::system (host) or Errc::backend (device) naming `what` when the memory cannot be had.
  UnitArray(std::size_t n, Place at, int rank, const char* what) : at_(at) {
    if (!at.cuda()) {
      host_ = PageArray<T>(n, rank, what);
      return;
    }
#if DDP_HAS_CUDA
    try {
      dev_ = CudaBuffer<T>(n, at.device.index, static_cast<cudaStream_t>(at.stream));
    } catch (const Error& e) {
      fail(Errc::backend, "rank ", rank, ": FullyShardedAverager: no memory on ",
           to_string(at.device), " for ", what, " (", n * sizeof(T), " bytes): ", e.what(),
           "; shard the model over more ranks, cut its units smaller or offload the shard");
    }
    zero();
#else
    fail(Errc::unsupported, "rank ", rank, ": FullyShardedAverager: ", what, " on ",
         to_string(at.device),
         " but ddp was built without CUDA (link the ddp::cuda target, or compile with "
         "-DDDP_HAS_CUDA=1 and the CUDA headers and link cudart)");
#endif
  }

  [[nodiscard]] T* data() const noexcept {
#if DDP_HAS_CUDA
    if (at_.cuda()) return const_cast<T*>(dev_.data());
#endif
    return host_.data();
  }
  [[nodiscard]] std::size_t size() const noexcept {
#if DDP_HAS_CUDA
    if (at_.cuda()) return dev_.size();
#endif
    return host_.size();
  }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  [[nodiscard]] const Place& place() const noexcept { return at_; }

  /// Elements [at, at + n) as a TensorView on the array's device, with its stream.
  [[nodiscard]] TensorView<T> view(std::size_t at, std::size_t n) const noexcept {
    return {data() + at, n, at_.device, at_.stream};
  }
  [[nodiscard]] TensorView<T> view() const noexcept { return view(0, size()); }

  /// Every element zero (on a device: ordered on the stream, asynchronously).
  void zero() {
    if (empty()) return;
#if DDP_HAS_CUDA
    if (at_.cuda()) {
      DDP_CUDA_CHECK(
          cudaMemsetAsync(dev_.data(), 0, dev_.bytes(), static_cast<cudaStream_t>(at_.stream)));
      return;
    }
#endif
    std::memset(static_cast<void*>(host_.data()), 0, host_.size() * sizeof(T));
  }

  /// The elements in host memory: the array's own, or copied into `scratch` from the device.
  [[nodiscard]] std::span<const T> on_host(std::vector<T>& scratch) const {
    if (!at_.cuda()) return std::span<const T>(data(), size());
    scratch.resize(size());
    to_host(0, scratch);
    return scratch;
  }
  /// fn(the elements in host memory): the array's own, or a copy put back on the device.
  template <class F>
  void edit(F&& fn) {
    if (!at_.cuda()) {
      fn(std::span<T>(data(), size()));
      return;
    }
    std::vector<T> h(size());
    to_host(0, h);
    fn(std::span<T>(h));
    from_host(0, h);
  }

  /// Copies elements [at, at + out.size()) into host memory; returns when they are there.
  void to_host(std::size_t at, std::span<T> out) const {
    copy(out.data(), data() + at, out.size());
  }
  /// Copies host elements into [at, at + in.size()); returns when they are there.
  void from_host(std::size_t at, std::span<const T> in) { copy(data() + at, in.data(), in.size()); }

 private:
  void copy(T* dst, const T* src, std::size_t n) const {
    if (n == 0) return;
#if DDP_HAS_CUDA
    if (at_.cuda()) {
      const auto s = static_cast<cudaStream_t>(at_.stream);
      DDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDefault, s));
      DDP_CUDA_CHECK(cudaStreamSynchronize(s));
      return;
    }
#endif
    std::memcpy(static_cast<void*>(dst), src, n * sizeof(T));
  }

  PageArray<T> host_;
#if DDP_HAS_CUDA
  CudaBuffer<T> dev_;
#endif
  Place at_;
};

/// For units on a CUDA device: the engine's own stream, on which its copies and collectives run,
/// and the program's (FullyShardedOptions::stream), on which it computes with the units; each
/// waits for the other (an event) where one touches what the other wrote or still reads, so
/// that a prefetch or a reduce runs beside the program's kernels. Nothing on the host.
class UnitStreams {
 public:
  UnitStreams() = default;
  UnitStreams(Device d, void* compute) : compute_(compute) {
#if DDP_HAS_CUDA
    if (d.is_cuda()) own_ = std::make_unique<CudaStream>(d.index);
#else
    (void)d;
#endif
  }
  /// The engine's stream (nullptr on the host).
  [[nodiscard]] void* own() const noexcept {
#if DDP_HAS_CUDA
    if (own_) return own_->get();
#endif
    return nullptr;
  }
  /// The program's stream.
  [[nodiscard]] void* compute() const noexcept { return compute_; }
  /// Later work on the engine's stream waits for the program's work queued so far.
  void own_after_compute() const {
#if DDP_HAS_CUDA
    if (own_) cuda_join_streams(own_->get(), compute_);
#endif
  }
  /// Later work on the program's stream waits for the engine's work queued so far.
  void compute_after_own() const {
#if DDP_HAS_CUDA
    if (own_) cuda_join_streams(compute_, own_->get());
#endif
  }

 private:
#if DDP_HAS_CUDA
  std::unique_ptr<CudaStream> own_;
#endif
  void* compute_ = nullptr;
};

/// The order in which a step issued its units' gathers and reduces (FNV-1a over them, and the
/// list itself for messages), checked to be every rank's at the step's end: units of one size
/// gathered or reduced in different orders would otherwise mix their values up without a
/// mismatched collective to show it. Units of different sizes show it sooner, in the first
/// mismatched collective; either way the error names the units each rank ran.
class UnitOrder {
 public:
  /// Unit u's gather (reduce = false) or reduce was issued.
  void note(std::size_t u, bool reduce) {
    h_ = (h_ ^ (u * 2 + (reduce ? 2 : 1))) * 1099511628211ull;
    ops_.push_back(u * 2 + (reduce ? 1 : 0));
  }
  /// Collective (one all_reduce of 16 bytes; when they differ, an all_gather of each rank's
  /// list): Errc::mismatch on every rank, naming `who` and the units each rank ran, when the
  /// ranks' orders differ. Starts the next step's order either way.
  template <class Comm>
  void check(Comm& comm, const char* who) {
    const std::uint64_t h = std::exchange(h_, kStart);
    std::array<std::uint64_t, 2> seen{h, ~h};  // the largest order and the smallest
    comm.all_reduce_host(std::span<std::uint64_t>(seen), ReduceOp::max);
    std::vector<std::size_t> ops = std::exchange(ops_, {});
    ops_.reserve(ops.size());
    if (seen[0] == h && ~seen[1] == h) return;
    const std::vector<std::string> all = comm.all_gather_object(ops_text(ops));
    std::string each;
    for (std::size_t r = 0; r < all.size(); ++r) each += concat("; rank ", r, " ran ", all[r]);
    fail(Errc::mismatch, "rank ", comm.rank(), ": ", who,
         ": the ranks gathered and reduced their units in different orders this step (the "
         "gathers and reduces are collectives, matched by their order: units of one size were "
         "mixed up)",
         each,
         ". Every rank must run the same units' forwards and backwards in the same order. The "
         "step's averages are wrong: the shard must not be updated with them");
  }
  void clear() noexcept {
    h_ = kStart;
    ops_.clear();
  }
  /// fn(), waiting for unit u's gather (reduce = false) or reduce on rank `rank`: a mismatched
  /// collective (Errc::mismatch) rethrown with the units this rank ran this step named (each
  /// rank's message names its own), any other failure as it was.
  template <class F>
  void named(int rank, std::size_t u, bool reduce, F&& fn) const {
    try {
      fn();
    } catch (const Error& e) {
      rethrow(e, rank, "FullyShardedAverager", u, reduce);
    }
  }

 private:
  [[noreturn]] void rethrow(const Error& e, int rank, const char* who, std::size_t u,
                            bool reduce) const {
    if (e.code() != Errc::mismatch ||
        std::string_view(e.what()).find("in different orders") != std::string_view::npos)
      throw;  // called in a handler: the error as it was
    DDP_THROW(Error(Errc::mismatch,
                    concat("rank ", rank, ": ", who, ": unit ", u, "'s ",
                           reduce ? "reduce (reduce_scatter)" : "gather (all_gather)",
                           " met another collective: the ranks run their units in different "
                           "orders; every rank must run the same units' forwards and backwards in "
                           "the same order. This step, this rank ran ",
                           ops_text(ops_), ". The collective's error: "),
                    e.origin_rank(), e.what(), e.lost_ranks()));
  }

  /// "gather 0, gather 1, reduce 1" (at most 64 named, then how many more).
  [[nodiscard]] static std::string ops_text(const std::vector<std::size_t>& ops) {
    if (ops.empty()) return "no gather or reduce";
    std::string out;
    for (std::size_t i = 0; i < ops.size() && i < 64; ++i)
      out += concat(i == 0 ? "" : ", ", (ops[i] & 1) != 0 ? "reduce " : "gather ", ops[i] / 2);
    if (ops.size() > 64) out += concat(" and ", ops.size() - 64, " more");
    return out;
  }

  static constexpr std::uint64_t kStart = 1469598103934665603ull;
  std::uint64_t h_ = kStart;
  std::vector<std::size_t> ops_;
};

/// Where a FullyShardedAverager over `comm` gathers its units: `o.device`, or by default the host
/// (the communicator's CUDA device on a backend that moves device memory only). Errc::unsupported
/// for a device the build or the backend cannot move.
template <class Backend, class Comm>
Device unit_device(Comm& comm, const FullyShardedOptions& o) {
  Device d = Device::cpu();
  if (o.device) {
    d = *o.device;
  } else if constexpr (backend_traits<Backend>::device_only) {
    d = Device::cuda(comm.backend().device());
  }
  if (d.is_cuda() && !DDP_HAS_CUDA)
    fail(Errc::unsupported, "rank ", comm.rank(), ": FullyShardedAverager: units on ", to_string(d),
         " but ddp was built without CUDA (link the ddp::cuda target, or compile with "
         "-DDDP_HAS_CUDA=1 and the CUDA headers and link cudart)");
#if DDP_HAS_CUDA
  if (const int n = d.is_cuda() ? cuda_device_count() : 0; d.is_cuda() && d.index >= n)
    fail(Errc::invalid_argument, "rank ", comm.rank(), ": FullyShardedAverager: units on ",
         to_string(d), " but this process sees ", n,
         " CUDA device(s) (none: no driver or no device; CUDA_VISIBLE_DEVICES renumbers them)");
#endif
  if (!usable_device<Backend>(d))
    fail(Errc::unsupported, "rank ", comm.rank(), ": FullyShardedAverager: backend ", Backend::name,
         " cannot move memory on ", to_string(d),
         d.is_cpu() ? "; gather units on the CUDA device (FullyShardedOptions::device) and keep "
                      "the shard on the host with offload = true"
                    : "; gather units on the host");
  return d;
}

/// Freed unit buffers kept for the next unit of the same size: at most two, as many of a kind
/// as a step holds at once (the unit computed and the one prefetched; the gradients written and
/// the ones being reduced), so that the peak stays what it was while a step stops mapping and
/// faulting in fresh pages (or allocating device memory) for every gather and every unit's
/// gradients.
template <class T>
class PageCache {
 public:
  /// An array of n T's at `at`: a kept one (zero-filled again when `zeros`), or a new one.
  UnitArray<T> take(std::size_t n, Place at, int rank, const char* what, bool zeros) {
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->size() != n) continue;
      UnitArray<T> a = std::move(*it);
      kept_.erase(it);
      if (zeros) a.zero();
      return a;
    }
    return UnitArray<T>(n, at, rank, what);
  }
  /// Keeps `a` (the oldest kept one is freed when two are kept).
  void give(UnitArray<T>& a) {
    if (a.empty()) return;
    if (kept_.size() >= 2) kept_.erase(kept_.begin());
    kept_.push_back(std::move(a));
    a = UnitArray<T>();
  }
  void clear() noexcept { kept_.clear(); }

 private:
  std::vector<UnitArray<T>> kept_;
};

/// `x` as a To (through float for ddp::half and ddp::bfloat16, which convert only to and from
/// arithmetic types).
template <class To, class From>
[[nodiscard]] constexpr To convert_value(From x) noexcept {
  if constexpr (std::is_same_v<To, From>)
    return x;
  else if constexpr (std::is_arithmetic_v<From>)
    return static_cast<To>(x);
  else
    return static_cast<To>(static_cast<float>(x));
}

/// Converts `in` into `out` (as many elements), element by element.
template <class To, class From>
void convert_values(std::span<const From> in, std::span<To> out) noexcept {
  for (std::size_t k = 0; k < in.size(); ++k) out[k] = convert_value<To>(in[k]);
}

}  // namespace detail
DDP_END_NAMESPACE
