// The GPU examples' MLP kernels (see mlp_kernels.hpp). Plain and readable rather than tuned: one
// thread per output element, sums in a fixed order, so a run is deterministic.
#include <cfloat>

#include "mlp_kernels.hpp"

namespace gpu_mlp {
namespace {

constexpr int kIn = 784;
constexpr int kOut = 10;
constexpr int kThreads = 256;

unsigned blocks_for(std::size_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// h[b][j] = relu(b1[j] + sum_i x_b[i] W1[i][j]); one thread per (b, j), grid.y = b.
__global__ void hidden_kernel(Weights w, Batch bt, float* h) {
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int b = static_cast<int>(blockIdx.y);
  if (j >= w.hidden) return;
  const float* x = bt.images + static_cast<std::size_t>(bt.idx[b]) * kIn;
  float acc = w.b1[j];
  for (int i = 0; i < kIn; ++i) acc += x[i] * w.w1[static_cast<std::size_t>(i) * w.hidden + j];
  h[static_cast<std::size_t>(b) * w.hidden + j] = acc > 0.0f ? acc : 0.0f;
}

// Logits, softmax and cross-entropy of sample b; one thread per sample.
__global__ void output_kernel(Weights w, Batch bt, const float* h, float* dz, float scale,
                              float* stats) {
  const int b = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (b >= bt.count) return;
  const float* hb = h + static_cast<std::size_t>(b) * w.hidden;
  float z[kOut];
  for (int c = 0; c < kOut; ++c) z[c] = w.b2[c];
  for (int j = 0; j < w.hidden; ++j) {
    const float v = hb[j];
    if (v == 0.0f) continue;
    for (int c = 0; c < kOut; ++c) z[c] += v * w.w2[j * kOut + c];
  }
  const int label = bt.labels[bt.idx[b]];
  int best = 0;
  float m = -FLT_MAX;
  for (int c = 0; c < kOut; ++c) {
    if (z[c] > m) {
      m = z[c];
      best = c;
    }
  }
  float sum = 0.0f;
  for (int c = 0; c < kOut; ++c) sum += (z[c] = expf(z[c] - m));
  for (int c = 0; c < kOut; ++c) z[c] /= sum;
  atomicAdd(&stats[0], -logf(fmaxf(z[label], 1e-30f)));
  if (best == label) atomicAdd(&stats[1], 1.0f);
  if (dz == nullptr) return;
  for (int c = 0; c < kOut; ++c) dz[b * kOut + c] = (z[c] - (c == label ? 1.0f : 0.0f)) * scale;
}

// g2[j][c] = sum_b h[b][j] dz[b][c] for t = j * 10 + c < H * 10; gb2[c] for the last 10 threads.
__global__ void last_grad_kernel(Weights w, int count, const float* h, const float* dz, float* g2,
                                 float* gb2) {
  const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int hk = w.hidden * kOut;
  if (t >= hk + kOut) return;
  float acc = 0.0f;
  if (t < hk) {
    const int j = t / kOut, c = t % kOut;
    for (int b = 0; b < count; ++b)
      acc += h[static_cast<std::size_t>(b) * w.hidden + j] * dz[b * kOut + c];
    g2[t] = acc;
  } else {
    const int c = t - hk;
    for (int b = 0; b < count; ++b) acc += dz[b * kOut + c];
    gb2[c] = acc;
  }
}

// dh[b][j] = h[b][j] > 0 ? sum_c W2[j][c] dz[b][c] : 0; one thread per (b, j), grid.y = b.
__global__ void hidden_grad_kernel(Weights w, const float* h, const float* dz, float* dh) {
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int b = static_cast<int>(blockIdx.y);
  if (j >= w.hidden) return;
  const std::size_t at = static_cast<std::size_t>(b) * w.hidden + j;
  float acc = 0.0f;
  if (h[at] > 0.0f) {
    for (int c = 0; c < kOut; ++c) acc += w.w2[j * kOut + c] * dz[b * kOut + c];
  }
  dh[at] = acc;
}

// g1[i][j] = sum_b x_b[i] dh[b][j] for t = i * H + j < 784 * H; gb1[j] for the last H threads.
__global__ void first_grad_kernel(Weights w, Batch bt, const float* dh, float* g1, float* gb1) {
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t H = static_cast<std::size_t>(w.hidden);
  const std::size_t ih = kIn * H;
  if (t >= ih + H) return;
  float acc = 0.0f;
  if (t < ih) {
    const std::size_t i = t / H, j = t % H;
    for (int b = 0; b < bt.count; ++b) {
      const float x = bt.images[static_cast<std::size_t>(bt.idx[b]) * kIn + i];
      if (x != 0.0f) acc += x * dh[static_cast<std::size_t>(b) * H + j];
    }
    g1[t] = acc;
  } else {
    const std::size_t j = t - ih;
    for (int b = 0; b < bt.count; ++b) acc += dh[static_cast<std::size_t>(b) * H + j];
    gb1[j] = acc;
  }
}

__global__ void sgd_kernel(float* value, const float* grad, std::size_t n, float lr) {
  const std::size_t k = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < n) value[k] -= lr * grad[k];
}

}  // namespace

cudaError_t forward(const Weights& w, const Batch& b, float* h, float* dz, float scale,
                    float* stats, cudaStream_t stream) {
  if (b.count == 0) return cudaSuccess;
  const dim3 grid(blocks_for(static_cast<std::size_t>(w.hidden)), static_cast<unsigned>(b.count));
  hidden_kernel<<<grid, kThreads, 0, stream>>>(w, b, h);
  output_kernel<<<blocks_for(static_cast<std::size_t>(b.count)), kThreads, 0, stream>>>(
      w, b, h, dz, scale, stats);
  return cudaGetLastError();
}

cudaError_t backward_last(const Weights& w, const Batch& b, const float* h, const float* dz,
                          float* g2, float* gb2, cudaStream_t stream) {
  const auto n = static_cast<std::size_t>(w.hidden) * kOut + kOut;
  last_grad_kernel<<<blocks_for(n), kThreads, 0, stream>>>(w, b.count, h, dz, g2, gb2);
  return cudaGetLastError();
}

cudaError_t backward_first(const Weights& w, const Batch& b, const float* h, const float* dz,
                           float* dh, float* g1, float* gb1, cudaStream_t stream) {
  if (b.count > 0) {
    const dim3 grid(blocks_for(static_cast<std::size_t>(w.hidden)), static_cast<unsigned>(b.count));
    hidden_grad_kernel<<<grid, kThreads, 0, stream>>>(w, h, dz, dh);
  }
  const auto n = (static_cast<std::size_t>(kIn) + 1) * static_cast<std::size_t>(w.hidden);
  first_grad_kernel<<<blocks_for(n), kThreads, 0, stream>>>(w, b, dh, g1, gb1);
  return cudaGetLastError();
}

cudaError_t sgd(float* value, const float* grad, std::size_t n, float lr, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  sgd_kernel<<<blocks_for(n), kThreads, 0, stream>>>(value, grad, n, lr);
  return cudaGetLastError();
}

}  // namespace gpu_mlp
