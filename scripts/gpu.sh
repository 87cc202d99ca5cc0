#!/usr/bin/env bash
# Builds and runs everything that needs a GPU: the CUDA suites (CudaBuffer, backend::Nccl on one
# device: every collective, stream ordering behind a slow producer, timeout and abort; NcclClique;
# backend::Host with CUDA buffers in 2 and 4 processes) and, where the Fashion-MNIST files are
# ($FASHION_MNIST_DIR, default /usr/share/datasets/fashion-mnist), the GPU examples. Run it on a
# machine with an NVIDIA GPU, the CUDA toolkit and NCCL (CUDA_HOME, default /usr/local/cuda).
# Elsewhere the same tests build and report themselves skipped (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$cuda/bin:$PATH"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  echo "scripts/gpu.sh: no GPU visible (nvidia-smi); nothing to run" >&2
  exit 1
fi
if ! dpkg -s doctest-dev >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq doctest-dev >/dev/null
fi
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_WITH_NCCL=ON \
  -DDDP_BUILD_TOOLS=OFF -DDDP_INSTALL=OFF \
  -DDDP_FASHION_MNIST_DIR="${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
cmake --build build/gpu --target ddp-cuda-test ddp-cuda-staging-test data_parallel fashion_mnist_gpu
ctest --test-dir build/gpu -L cuda --output-on-failure
