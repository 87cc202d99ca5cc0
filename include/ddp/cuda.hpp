// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// CUDA resources with RAII, for the CUDA backends and for programs that want a ready-made CUDA
/// tensor: ddp::CudaBuffer<T> (device memory that ddp knows, at compile time, to be on a CUDA
/// device), ddp::CudaStream, ddp::CudaEvent, ddp::PinnedBuffer<T> (page-locked host memory) and
/// ddp::CudaDeviceGuard. Every CUDA call is checked: a failure raises Errc::backend naming the
/// call and cudaGetErrorString's text. Host code only (the CUDA runtime API): compiles with any
/// C++20 compiler given the CUDA headers; link CUDA::cudart (the `ddp::cuda` target does both
/// and defines DDP_HAS_CUDA=1).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <utility>

DDP_BEGIN_NAMESPACE

namespace detail {

/// Throws Errc::backend for a failed CUDA runtime call.
DDP_INLINE void cuda_check(cudaError_t rc, const char* call);

/// Makes `device` current until the end of the scope, never throwing (for destructors).
struct CudaDeviceScope {
  int previous = 0;
  explicit CudaDeviceScope(int device) noexcept;
  ~CudaDeviceScope() { (void)cudaSetDevice(previous); }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;
};

}  // namespace detail

/// Checks a CUDA runtime call: DDP_CUDA_CHECK(cudaMemcpy(...)).
#define DDP_CUDA_CHECK(call) ::ddp::detail::cuda_check((call), #call)

/// The number of CUDA devices this process can use; 0 when there is no driver or no device
/// (never throws: this is how tests decide to skip).
[[nodiscard]] DDP_INLINE int cuda_device_count() noexcept;

/// cuda_device_count() asked in a forked child, so that this process creates no CUDA context: a
/// context does not survive fork(), so a program that forks its ranks (ddp::spawn) asks this way
/// before spawning. 0 when the child cannot be made.
[[nodiscard]] DDP_INLINE int cuda_device_count_before_fork() noexcept;

/// Makes `device` current for the guard's lifetime, then restores the previous one.
class CudaDeviceGuard {
 public:
  /// Makes `device` current (remembering the current one).
  explicit CudaDeviceGuard(int device);
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  ~CudaDeviceGuard() { (void)cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

/// An owned, non-blocking CUDA stream (it does not synchronize with the legacy default stream).
class CudaStream {
 public:
  /// A new stream on the current device.
  CudaStream() { DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  /// A new stream on `device`.
  explicit CudaStream(int device);
  /// Takes over `o`'s stream; `o` is left empty.
  CudaStream(CudaStream&& o) noexcept;
  /// Destroys this stream and takes over `o`'s; `o` is left empty.
  CudaStream& operator=(CudaStream&& o) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream() { reset(); }

  /// The stream handle (owned by this object; nullptr once moved from).
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }
  /// Blocks until every operation queued on the stream has finished.
  void synchronize() const { DDP_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  void reset() noexcept;
  cudaStream_t s_ = nullptr;
};

/// An owned CUDA event without timing (the cheap kind), for ordering streams and for polling.
class CudaEvent {
 public:
  /// A new event on the current device.
  CudaEvent() { DDP_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
  /// Takes over `o`'s event; `o` is left empty.
  CudaEvent(CudaEvent&& o) noexcept;
  /// Destroys this event and takes over `o`'s; `o` is left empty.
  CudaEvent& operator=(CudaEvent&& o) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() { reset(); }

  /// The event handle (owned by this object; nullptr once moved from).
  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }
  /// Captures the work queued on `stream` so far.
  void record(cudaStream_t stream) { DDP_CUDA_CHECK(cudaEventRecord(e_, stream)); }
  /// Makes later work on `stream` wait for the captured work (no host blocking).
  void block(cudaStream_t stream) const { DDP_CUDA_CHECK(cudaStreamWaitEvent(stream, e_, 0)); }
  /// Whether the captured work has finished; throws if it failed.
  [[nodiscard]] bool ready() const;
  /// Blocks until the captured work has finished.
  void synchronize() const { DDP_CUDA_CHECK(cudaEventSynchronize(e_)); }

 private:
  void reset() noexcept;
  cudaEvent_t e_ = nullptr;
};

/// `size` elements of T in device memory (cudaMalloc), on `device`, associated with `stream`
/// (the stream whose work produces its contents; nullptr: the legacy default stream). Moves, never
/// copies. ddp::view(buffer) is a TensorView on Device::cuda(device) carrying the stream, and its
/// type says DeviceKind::cuda, so CUDA-only backends accept it when the program is compiled.
template <Scalar T>
class CudaBuffer {
 public:
  /// Tells ddp's tensor_traits that this type is device memory, when the program is compiled.
  static constexpr DeviceKind ddp_device_kind = DeviceKind::cuda;
  using value_type = T;  ///< The element type.

  /// An empty buffer (no memory).
  CudaBuffer() = default;
  /// Uninitialized memory for n elements on `device` (-1: the current device).
  explicit CudaBuffer(std::size_t n, int device = -1, cudaStream_t stream = nullptr)
      : size_(n), stream_(stream) {
    if (device < 0) DDP_CUDA_CHECK(cudaGetDevice(&device));
    device_ = device;
    if (n == 0) return;
    CudaDeviceGuard g(device);
    void* p = nullptr;
    DDP_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    data_ = static_cast<T*>(p);
  }
  /// A device copy of host elements.
  explicit CudaBuffer(std::span<const T> host, int device = -1, cudaStream_t stream = nullptr)
      : CudaBuffer(host.size(), device, stream) {
    copy_from(host);
  }
  /// Takes over `o`'s memory; `o` is left empty.
  CudaBuffer(CudaBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        device_(o.device_),
        stream_(o.stream_) {}
  /// Frees this buffer's memory and takes over `o`'s; `o` is left empty.
  CudaBuffer& operator=(CudaBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      device_ = o.device_;
      stream_ = o.stream_;
    }
    return *this;
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  ~CudaBuffer() { release(); }

  /// The device pointer to the first element (nullptr when empty).
  ///@{
  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] const T* data() const noexcept { return data_; }
  ///@}
  /// The number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// size() * sizeof(T).
  [[nodiscard]] std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  /// Whether size() is 0.
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// The CUDA device the memory is on.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The stream the buffer is associated with (nullptr: the legacy default stream).
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  /// Associates the buffer with another stream (collectives then order after that stream's work).
  void set_stream(cudaStream_t s) noexcept { stream_ = s; }

  /// Copies host elements in (host.size() must equal size()), ordered on the buffer's stream;
  /// returns when the copy is done.
  void copy_from(std::span<const T> host) {
    check_size(host.size(), "copy_from");
    if (size_ == 0) return;
    DDP_CUDA_CHECK(cudaMemcpyAsync(data_, host.data(), bytes(), cudaMemcpyHostToDevice, stream_));
    DDP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  /// Copies the elements out to host memory, after the work queued on the buffer's stream.
  void copy_to(std::span<T> host) const {
    check_size(host.size(), "copy_to");
    if (size_ == 0) return;
    DDP_CUDA_CHECK(cudaMemcpyAsync(host.data(), data_, bytes(), cudaMemcpyDeviceToHost, stream_));
    DDP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  /// Sets every byte to `byte`, on the buffer's stream (asynchronous).
  void fill_bytes(int byte) {
    if (size_ != 0) DDP_CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes(), stream_));
  }

  /// The buffer as a TensorView on Device::cuda(device()) with its stream; what ddp::view uses.
  ///@{
  [[nodiscard]] TensorView<T> ddp_view() noexcept {
    return {data_, size_, Device::cuda(device_), stream_};
  }
  [[nodiscard]] TensorView<const T> ddp_view() const noexcept {
    return {data_, size_, Device::cuda(device_), stream_};
  }
  ///@}

 private:
  void check_size(std::size_t n, const char* what) const {
    if (n != size_) {
      detail::fail(Errc::invalid_argument, "CudaBuffer::", what, ": the host range has ", n,
                   " elements but the buffer has ", size_);
    }
  }
  void release() noexcept {
    if (data_ != nullptr) {
      const detail::CudaDeviceScope scope(device_);
      (void)cudaFree(data_);
    }
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

/// `size` elements of page-locked host memory (cudaMallocHost): host memory that the GPU's copy
/// engines reach at full speed. A contiguous range, so ddp sees it as host memory.
template <class T>
class PinnedBuffer {
 public:
  /// An empty buffer (no memory).
  PinnedBuffer() = default;
  /// Uninitialized page-locked memory for `n` elements.
  explicit PinnedBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    DDP_CUDA_CHECK(cudaMallocHost(&p, n * sizeof(T)));
    data_ = static_cast<T*>(p);
  }
  /// Takes over `o`'s memory; `o` is left empty.
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  /// Frees this buffer's memory and takes over `o`'s; `o` is left empty.
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { release(); }

  /// The first element (nullptr when empty).
  ///@{
  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] const T* data() const noexcept { return data_; }
  ///@}
  /// The number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The elements as a contiguous range.
  ///@{
  [[nodiscard]] T* begin() noexcept { return data_; }
  [[nodiscard]] T* end() noexcept { return data_ + size_; }
  [[nodiscard]] const T* begin() const noexcept { return data_; }
  [[nodiscard]] const T* end() const noexcept { return data_ + size_; }
  ///@}
  /// Element `i` (unchecked).
  ///@{
  [[nodiscard]] T& operator[](std::size_t i) noexcept { return data_[i]; }
  [[nodiscard]] const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  ///@}

 private:
  void release() noexcept {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

namespace detail {

/// Waits for a CUDA event, polling, for at most `timeout`; Errc::timeout names `what`.
DDP_INLINE void cuda_wait(const CudaEvent& e, std::chrono::milliseconds timeout, const char* what);

/// Copies `n` bytes between host memory and CUDA devices, in either direction, ordered on
/// `stream` (a cudaStream_t as void*).
DDP_INLINE void cuda_copy_async(void* dst, const void* src, std::size_t n, void* stream);

/// Sets `n` bytes of device memory to zero, ordered on `stream`.
inline void cuda_zero_async(void* dst, std::size_t n, void* stream) {
  DDP_CUDA_CHECK(cudaMemsetAsync(dst, 0, n, static_cast<cudaStream_t>(stream)));
}

/// Blocks until the work queued on `stream` is done.
inline void cuda_sync(void* stream) {
  DDP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

/// Later work on `waiter` starts after the work queued on `producer` so far.
DDP_INLINE void cuda_join_streams(void* waiter, void* producer);

// The copies between a model's parameters and the averagers' buckets (ddp/training/), host or
// CUDA memory alike; ddp/training/averaging/parameters.hpp has their host-only twins for builds
// without CUDA.

/// Copies `n` bytes between host memory and CUDA devices (`cuda`: either side is on a device),
/// ordered on `stream`.
DDP_INLINE void copy_bytes(void* dst, const void* src, std::size_t n, bool cuda, void* stream);

/// Sets `n` bytes to zero, on a CUDA device (ordered on `stream`) or on the host.
DDP_INLINE void zero_bytes(void* dst, std::size_t n, bool cuda, void* stream);

/// Blocks until the work queued on a CUDA stream is done (nothing for host memory).
inline void sync_stream(bool cuda, void* stream) {
  if (cuda) cuda_sync(stream);
}

/// Later work on `waiter` starts after the work queued on `producer` so far (CUDA streams).
inline void join_streams(bool cuda, void* waiter, void* producer) {
  if (cuda) cuda_join_streams(waiter, producer);
}

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/cuda.ipp"
#endif
