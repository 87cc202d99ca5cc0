// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/cuda.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void cuda_check(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();  // clear a sticky-free error so later calls report their own
    fail(Errc::backend, call, " failed: ", cudaGetErrorString(rc), " (", cudaGetErrorName(rc), ")");
  }
}

DDP_INLINE CudaDeviceScope::CudaDeviceScope(int device) noexcept {
  (void)cudaGetDevice(&previous);
  if (device != previous) (void)cudaSetDevice(device);
}
}  // namespace detail
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE

DDP_INLINE int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

DDP_INLINE int cuda_device_count_before_fork() noexcept {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(std::min(cuda_device_count(), 250));
  if (pid < 0) return 0;
  int status = 0;
  pid_t got = -1;
  do {
    got = ::waitpid(pid, &status, 0);
  } while (got < 0 && errno == EINTR);
  if (got != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

DDP_INLINE CudaDeviceGuard::CudaDeviceGuard(int device) {
  DDP_CUDA_CHECK(cudaGetDevice(&previous_));
  if (device != previous_) DDP_CUDA_CHECK(cudaSetDevice(device));
}

DDP_INLINE CudaStream::CudaStream(int device) {
  CudaDeviceGuard g(device);
  DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
}

DDP_INLINE CudaStream::CudaStream(CudaStream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}

DDP_INLINE CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  if (this != &o) {
    reset();
    s_ = std::exchange(o.s_, nullptr);
  }
  return *this;
}

DDP_INLINE void CudaStream::reset() noexcept {
  if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  s_ = nullptr;
}

DDP_INLINE CudaEvent::CudaEvent(CudaEvent&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}

DDP_INLINE CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  if (this != &o) {
    reset();
    e_ = std::exchange(o.e_, nullptr);
  }
  return *this;
}

DDP_INLINE bool CudaEvent::ready() const {
  const cudaError_t rc = cudaEventQuery(e_);
  if (rc == cudaErrorNotReady) return false;
  detail::cuda_check(rc, "cudaEventQuery");
  return true;
}

DDP_INLINE void CudaEvent::reset() noexcept {
  if (e_ != nullptr) (void)cudaEventDestroy(e_);
  e_ = nullptr;
}
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE void cuda_wait(const CudaEvent& e, std::chrono::milliseconds timeout, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  for (unsigned spins = 0; !e.ready(); ++spins) {
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited > timeout) {
      fail(Errc::timeout, what, " did not complete within ", timeout.count(),
           " ms (is a kernel on the tensor's stream stuck?)");
    }
    if (spins < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

DDP_INLINE void cuda_copy_async(void* dst, const void* src, std::size_t n, void* stream) {
  DDP_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

DDP_INLINE void cuda_join_streams(void* waiter, void* producer) {
  if (waiter == producer) return;
  CudaEvent done;
  done.record(static_cast<cudaStream_t>(producer));
  done.block(static_cast<cudaStream_t>(waiter));
}

DDP_INLINE void copy_bytes(void* dst, const void* src, std::size_t n, bool cuda, void* stream) {
  if (n == 0) return;
  if (cuda)
    cuda_copy_async(dst, src, n, stream);
  else
    std::memcpy(dst, src, n);
}

DDP_INLINE void zero_bytes(void* dst, std::size_t n, bool cuda, void* stream) {
  if (n == 0) return;
  if (cuda)
    cuda_zero_async(dst, n, stream);
  else
    std::memset(dst, 0, n);
}

}  // namespace detail
DDP_END_NAMESPACE
