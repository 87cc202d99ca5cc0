// Kernels for the CUDA tests: a producer that is deliberately slow, so that a collective that
// did not wait for the producer's stream would read stale data.
#include "kernels.hpp"

namespace {

__global__ void slow_fill_kernel(float* data, std::size_t n, float value, long long spin_cycles) {
  const long long start = clock64();
  while (clock64() - start < spin_cycles) {
  }
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x)
    data[i] = value;
}

}  // namespace

void launch_slow_fill(float* data, std::size_t n, float value, cudaStream_t stream,
                      long long spin_cycles) {
  slow_fill_kernel<<<64, 256, 0, stream>>>(data, n, value, spin_cycles);
}
