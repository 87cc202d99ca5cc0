// The GPU examples' model: the MLP of examples/fashion_mnist.cpp (784 -> hidden -> 10) with its
// parameters, gradients and activations in ddp::CudaBuffer, every kernel on one stream. The
// buffers carry that stream, so ddp orders its collectives after the kernels that produce them.
#pragma once

#include <ddp/ddp.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "../fashion_mnist_common.hpp"
#include "mlp_kernels.hpp"

namespace gpu_mlp {

inline void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
}

/// One split of the dataset on a device.
struct DeviceSplit {
  ddp::CudaBuffer<float> images;
  ddp::CudaBuffer<std::uint8_t> labels;
  std::size_t size = 0;
  DeviceSplit(const fashion_mnist::Split& s, int device, cudaStream_t stream)
      : images(std::span<const float>(s.images), device, stream),
        labels(std::span<const std::uint8_t>(s.labels), device, stream),
        size(s.size()) {}
};

struct Param {
  ddp::CudaBuffer<float> value, grad;
};

class Mlp {
 public:
  /// Parameters initialized as in the CPU example (fashion_mnist::initial_parameters), on `device`.
  Mlp(int hidden, std::size_t max_batch, int device, cudaStream_t stream)
      : hidden_(hidden), stream_(stream) {
    const auto H = static_cast<std::size_t>(hidden);
    for (const auto& v : fashion_mnist::initial_parameters(hidden)) {
      params_.push_back({ddp::CudaBuffer<float>(std::span<const float>(v), device, stream),
                         ddp::CudaBuffer<float>(v.size(), device, stream)});
      params_.back().grad.fill_bytes(0);
    }
    h_ = ddp::CudaBuffer<float>(max_batch * H, device, stream);
    dh_ = ddp::CudaBuffer<float>(max_batch * H, device, stream);
    dz_ = ddp::CudaBuffer<float>(max_batch * 10, device, stream);
    idx_ = ddp::CudaBuffer<std::uint32_t>(max_batch, device, stream);
    stats_ = ddp::CudaBuffer<float>(2, device, stream);
    stats_.fill_bytes(0);
  }

  /// What ddp::GradientAverager and the clique see: a range of {value, grad} parameters.
  std::vector<Param>& parameters() { return params_; }

  /// Forward and backward of samples `idx` of `data`, the loss scaled by `scale` (1 / the global
  /// batch), with `last_ready` called between the last layer's gradients and the first's (that is
  /// where a GradientAverager's mark_ready starts the communication of the last layer).
  template <class LastReady>
  void train_step(const DeviceSplit& data, std::span<const std::uint32_t> idx, float scale,
                  LastReady&& last_ready) {
    const Batch b = batch(data, idx);
    check(forward(weights(), b, h_.data(), dz_.data(), scale, stats_.data(), stream_), "forward");
    check(backward_last(weights(), b, h_.data(), dz_.data(), params_[2].grad.data(),
                        params_[3].grad.data(), stream_),
          "backward_last");
    last_ready();
    check(backward_first(weights(), b, h_.data(), dz_.data(), dh_.data(), params_[0].grad.data(),
                         params_[1].grad.data(), stream_),
          "backward_first");
  }

  /// Forward only: adds the loss and the correct predictions to the statistics.
  void evaluate(const DeviceSplit& data, std::span<const std::uint32_t> idx) {
    check(forward(weights(), batch(data, idx), h_.data(), nullptr, 1.0f, stats_.data(), stream_),
          "forward");
  }

  void sgd_step(float lr) {
    for (auto& p : params_)
      check(sgd(p.value.data(), p.grad.data(), p.value.size(), lr, stream_), "sgd");
  }

  /// {summed loss, correct predictions} since the last call (waits for the stream), then zeroes.
  std::pair<double, double> take_stats() {
    std::vector<float> s(2);
    stats_.copy_to(s);
    stats_.fill_bytes(0);
    return {s[0], s[1]};
  }

  /// The parameters on the host (W1, b1, W2, b2), for the checkpoint.
  std::vector<std::vector<float>> host_values() const {
    std::vector<std::vector<float>> out;
    for (const auto& p : params_) {
      out.emplace_back(p.value.size());
      p.value.copy_to(out.back());
    }
    return out;
  }

 private:
  Weights weights() const {
    return {params_[0].value.data(), params_[1].value.data(), params_[2].value.data(),
            params_[3].value.data(), hidden_};
  }
  Batch batch(const DeviceSplit& data, std::span<const std::uint32_t> idx) {
    if (idx.size() > idx_.size()) throw std::invalid_argument("batch larger than max_batch");
    check(
        cudaMemcpyAsync(idx_.data(), idx.data(), idx.size_bytes(), cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync");
    return {data.images.data(), data.labels.data(), idx_.data(), static_cast<int>(idx.size())};
  }

  int hidden_;
  cudaStream_t stream_;
  std::vector<Param> params_;
  ddp::CudaBuffer<float> h_, dh_, dz_, stats_;
  ddp::CudaBuffer<std::uint32_t> idx_;
};

}  // namespace gpu_mlp
