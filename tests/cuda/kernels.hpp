// Kernels for the CUDA tests (kernels.cu, compiled by nvcc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

/// Spins about `spin_cycles` GPU clock cycles, then sets data[0..n) to value, on `stream`.
void launch_slow_fill(float* data, std::size_t n, float value, cudaStream_t stream,
                      long long spin_cycles);
