// CUDA kernels of the GPU examples' MLP (784 -> hidden (ReLU) -> 10, softmax cross-entropy),
// compiled by nvcc in mlp_kernels.cu; this header is plain C++ so that the programs, and ddp's
// headers, are compiled by the host compiler. Every function enqueues on `stream` and returns
// the launch's error (cudaSuccess when it was queued).
//
// Layout: W1 is 784 x H (input-major), b1 H, W2 H x 10, b2 10. A batch is `count` sample numbers
// `idx` into the dataset's images (n x 784 floats in [0, 1]) and labels (n bytes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace gpu_mlp {

struct Weights {
  const float* w1;
  const float* b1;
  const float* w2;
  const float* b2;
  int hidden;
};

struct Batch {
  const float* images;
  const std::uint8_t* labels;
  const std::uint32_t* idx;  // device memory
  int count;
};

/// Forward: h = relu(x W1 + b1) (count x H); logits, softmax, cross-entropy. Adds the batch's
/// summed loss to stats[0] and its number of correct predictions to stats[1]. With dz != nullptr,
/// also writes d(loss)/d(logits) * scale (count x 10) for backward.
cudaError_t forward(const Weights& w, const Batch& b, float* h, float* dz, float scale,
                    float* stats, cudaStream_t stream);

/// Last layer's gradients: g2 = h^T dz, gb2 = column sums of dz (overwritten).
cudaError_t backward_last(const Weights& w, const Batch& b, const float* h, const float* dz,
                          float* g2, float* gb2, cudaStream_t stream);

/// First layer's gradients: dh = (dz W2^T) masked by relu, g1 = x^T dh, gb1 = column sums of dh
/// (overwritten); dh is count x H scratch.
cudaError_t backward_first(const Weights& w, const Batch& b, const float* h, const float* dz,
                           float* dh, float* g1, float* gb1, cudaStream_t stream);

/// value -= lr * grad over n elements.
cudaError_t sgd(float* value, const float* grad, std::size_t n, float lr, cudaStream_t stream);

}  // namespace gpu_mlp
