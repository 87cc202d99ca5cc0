// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How a communicator runs a collective on CUDA buffers its backend cannot use (backend::Host, a
/// backend::Mpi that is not CUDA-aware): detail::CudaStager (slots of pinned memory, copies in
/// both directions on their own streams) and detail::CudaStaging (one stager per communicator,
/// made on first use for the buffers' device). The pipeline itself is comm/staging.hpp.

#include "ddp/config.hpp"
#if !DDP_HAS_CUDA
#error "ddp/comm/cuda_staging.hpp needs DDP_HAS_CUDA=1 (the ddp::cuda target)"
#endif
#include "ddp/backend/collective.hpp"
#include "ddp/comm/staging.hpp"
#include "ddp/cuda.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <array>
#include <cstddef>
#include <memory>

DDP_BEGIN_NAMESPACE
namespace detail {

/// The copies of a host-memory backend staging CUDA buffers (see comm/staging.hpp): slots of
/// pinned memory, kept between collectives; device-to-host copies on one stream and
/// host-to-device copies on another, so the two directions overlap; copies ordered after the
/// tensor's stream with an event. One per communicator and device; used with its device current.
class CudaStager {
 public:
  CudaStager(int device, std::chrono::milliseconds timeout)
      : previous_(make_current(device)), device_(device), timeout_(timeout) {
    (void)cudaSetDevice(previous_);
  }
  CudaStager(const CudaStager&) = delete;
  CudaStager& operator=(const CudaStager&) = delete;
  ~CudaStager() {
    const CudaDeviceScope scope(device_);
    (void)cudaStreamSynchronize(fetches_.get());  // nothing may still copy into freed memory
    (void)cudaStreamSynchronize(stores_.get());
  }

  [[nodiscard]] int device() const noexcept { return device_; }

  std::byte* slot(int s, std::size_t bytes) {
    auto& b = slots_.at(static_cast<std::size_t>(s));
    if (b.size() < bytes) {
      b = PinnedBuffer<std::byte>();  // free first: at most one copy of a large slot at a time
      b = PinnedBuffer<std::byte>(bytes);
    }
    return b.data();
  }
  void after(void* stream) {  // copies in read what it produced; copies back overwrite it after
    produced_.record(static_cast<cudaStream_t>(stream));
    produced_.block(fetches_.get());
    produced_.block(stores_.get());
  }
  void fetch(int s, std::byte* host, const std::byte* dev, std::size_t n) {
    DDP_CUDA_CHECK(cudaMemcpyAsync(host, dev, n, cudaMemcpyDeviceToHost, fetches_.get()));
    fetched_.at(static_cast<std::size_t>(s)).record(fetches_.get());
  }
  void wait_fetch(int s) {
    cuda_wait(fetched_.at(static_cast<std::size_t>(s)), timeout_,
              "staging: the copy of a CUDA buffer into host memory");
  }
  void store(int s, std::byte* dev, const std::byte* host, std::size_t n) {
    DDP_CUDA_CHECK(cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, stores_.get()));
    const auto i = static_cast<std::size_t>(s);
    stored_.at(i).record(stores_.get());
    pending_.at(i) = true;
  }
  void wait_store(int s) {
    const auto i = static_cast<std::size_t>(s);
    if (!pending_.at(i)) return;
    cuda_wait(stored_[i], timeout_, "staging: the copy of a result back into a CUDA buffer");
    pending_[i] = false;
  }

 private:
  static int make_current(int device) {
    int previous = 0;
    DDP_CUDA_CHECK(cudaGetDevice(&previous));
    DDP_CUDA_CHECK(cudaSetDevice(device));
    return previous;
  }

  static constexpr std::size_t slots = 5;  // 3 pipeline slots + 2 whole-buffer slots
  int previous_;  // first: the streams and events below are made on `device`
  int device_;
  std::chrono::milliseconds timeout_;
  CudaStream fetches_, stores_;
  CudaEvent produced_;
  std::array<CudaEvent, slots> fetched_, stored_;
  std::array<bool, slots> pending_{};
  std::array<PinnedBuffer<std::byte>, slots> slots_;
};

/// How a communicator runs a collective on CUDA buffers its backend cannot use (backend::Host, a
/// backend::Mpi that is not CUDA-aware): through pinned host memory, with a CudaStager made on
/// first use for the buffers' device (see comm/staging.hpp for the pipeline).
class CudaStaging {
 public:
  CudaStaging(std::chrono::milliseconds timeout, std::size_t piece_bytes)
      : timeout_(timeout), piece_bytes_(piece_bytes) {}

  /// Runs f(host piece) over device buffer `b`, an elementwise collective, piece by piece.
  template <class F>
  void elementwise(const Buf& b, bool fetch, bool store, const F& f) {
    const CudaDeviceGuard current(b.device.index);
    stage_elementwise(for_device(b.device.index), b, fetch, store, piece_bytes_, f);
  }

  /// Runs f(buffers...) with every CUDA buffer among `args` (StagedArgs; `staged` says which)
  /// staged whole. They must be on one device.
  template <class F, class... A>
  void whole(int rank, const char* what, const F& f, bool (*staged)(const Buf&), A... args) {
    int device = -1;
    for (const StagedArg& a : {args...}) {
      if (!staged(a.buf)) continue;
      if (device >= 0 && a.buf.device.index != device) {
        fail(Errc::invalid_argument, "rank ", rank, ": ", what,
             ": the buffers are on cuda:", device, " and cuda:", a.buf.device.index,
             "; staged collectives need them on one device");
      }
      device = a.buf.device.index;
    }
    const CudaDeviceGuard current(device);
    stage_whole(for_device(device), std::array<StagedArg, sizeof...(A)>{args...}, f);
  }

 private:
  CudaStager& for_device(int device) {
    if (!stager_ || stager_->device() != device) {
      stager_.reset();
      stager_ = std::make_unique<CudaStager>(device, timeout_);
    }
    return *stager_;
  }

  std::chrono::milliseconds timeout_;
  std::size_t piece_bytes_;
  std::unique_ptr<CudaStager> stager_;
};

}  // namespace detail
DDP_END_NAMESPACE
