// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/multi_gpu.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE

DDP_INLINE NcclClique::NcclClique(std::vector<int> devices, std::chrono::milliseconds timeout)
    : devices_(std::move(devices)), timeout_(timeout) {
  const int visible = cuda_device_count();
  if (devices_.empty()) {
    for (int d = 0; d < visible; ++d) devices_.push_back(d);
    if (devices_.empty()) {
      detail::fail(Errc::invalid_argument,
                   "NcclClique: this process sees no CUDA device; check CUDA_VISIBLE_DEVICES "
                   "and the driver");
    }
  }
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    const int d = devices_[i];
    if (d < 0 || d >= visible) {
      detail::fail(Errc::invalid_argument, "NcclClique: device ", d,
                   " does not exist (this process sees ", visible, " device(s))");
    }
    if (std::find(devices_.begin(), devices_.begin() + static_cast<std::ptrdiff_t>(i), d) !=
        devices_.begin() + static_cast<std::ptrdiff_t>(i)) {
      detail::fail(Errc::invalid_argument, "NcclClique: device ", d,
                   " is listed twice; NCCL drives each device of a clique once");
    }
  }
  slots_.reserve(devices_.size());
  for (const int d : devices_) {
    const CudaDeviceGuard g(d);
    slots_.push_back(std::make_unique<Slot>(d));
  }
  comms_.assign(devices_.size(), nullptr);
  const auto rc = ncclCommInitAll(comms_.data(), size(), devices_.data());
  if (rc != ncclSuccess) {
    comms_.clear();
    detail::fail(detail::nccl_errc(rc), "NcclClique: ncclCommInitAll over ", size(),
                 " device(s) failed: ", ncclGetErrorString(rc));
  }
}

DDP_INLINE NcclClique::~NcclClique() {
  for (std::size_t i = 0; i < comms_.size(); ++i) {
    if (comms_[i] == nullptr) continue;
    const CudaDeviceGuard g(devices_[i]);
    (void)ncclCommDestroy(comms_[i]);
  }
}

DDP_INLINE int NcclClique::device(int i) const { return devices_.at(static_cast<std::size_t>(i)); }

DDP_INLINE cudaStream_t NcclClique::stream(int i) const {
  return slots_.at(static_cast<std::size_t>(i))->stream.get();
}

DDP_INLINE ncclComm_t NcclClique::comm(int i) const {
  return comms_.at(static_cast<std::size_t>(i));
}

DDP_INLINE NcclClique::Slot::Slot(int device) : stream(device) {}

DDP_INLINE void NcclClique::same_shape(const std::vector<detail::Buf>& bs, const char* what) {
  for (std::size_t i = 1; i < bs.size(); ++i) {
    if (bs[i].dtype != bs[0].dtype || bs[i].count != bs[0].count) {
      detail::fail(Errc::mismatch, "NcclClique: ", what, ": tensor ", i, " is ",
                   to_string(bs[i].dtype), " x ", bs[i].count, " but tensor 0 is ",
                   to_string(bs[0].dtype), " x ", bs[0].count,
                   "; every device's tensor must have the same dtype and size");
    }
  }
}

DDP_INLINE void NcclClique::paired(const std::vector<detail::Buf>& small,
                                   const std::vector<detail::Buf>& big, std::size_t want,
                                   const char* what, const char* rule) {
  if (big[0].dtype != small[0].dtype || big[0].count != want) {
    detail::fail(Errc::invalid_argument, "NcclClique: ", what, ": `in` is ",
                 to_string(small[0].dtype), " x ", small[0].count, " and `out` ",
                 to_string(big[0].dtype), " x ", big[0].count, ", but ", rule,
                 " elements of the same dtype are needed");
  }
}

DDP_INLINE void NcclClique::abort_all() { aborter_.abort(std::exchange(comms_, {}), devices_); }

DDP_INLINE void NcclClique::give_up(const char* what, ncclResult_t rc, const char* where) {
  std::string last;
  for (const auto c : comms_) {
    const char* text = ncclGetLastError(c);
    if (text != nullptr && *text != '\0') {
      last = detail::concat(" (", text, ")");
      break;
    }
  }
  abort_all();
  detail::fail(detail::nccl_errc(rc), "NcclClique: ", what, ": ", where,
               " failed: ", ncclGetErrorString(rc), last, "; the clique was aborted");
}

DDP_END_NAMESPACE
