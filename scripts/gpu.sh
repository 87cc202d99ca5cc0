#!/usr/bin/env bash
# Builds and runs everything that needs a GPU: the CUDA suites (CudaBuffer, backend::Nccl on one
# device: every collective, stream ordering behind a slow producer, timeout and abort, the
# averagers, fully sharded units on the device or offloaded; NcclClique; backend::Host with CUDA
# buffers in 2 and 4 processes, fully sharded units on the GPU bitwise the host's) and, where the Fashion-MNIST files are
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
# doctest: Debian's package where apt-get can reach a mirror; elsewhere a doctest install prefix
# in CMAKE_PREFIX_PATH (CMake reads that variable from the environment).
if ! dpkg -s doctest-dev >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq doctest-dev >/dev/null) ||
    echo "scripts/gpu.sh: could not install doctest-dev; using CMAKE_PREFIX_PATH" >&2
fi
# NCCL: the CUDA toolkit's, a system one, or (machines with only PyTorch's) the pip wheel's.
if [ -z "${NCCL_ROOT:-}" ] && [ ! -e "$cuda/include/nccl.h" ] && [ ! -e /usr/include/nccl.h ]; then
  h="$(find /usr /opt -name nccl.h -path '*/include/*' 2>/dev/null | head -n 1 || true)"
  if [ -n "$h" ]; then export NCCL_ROOT="$(dirname "$(dirname "$h")")"; fi
fi
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_WITH_NCCL=ON \
  -DDDP_BUILD_TOOLS=ON -DDDP_INSTALL=OFF -DDDP_WERROR="${DDP_WERROR:-ON}" \
  -DDDP_FASHION_MNIST_DIR="${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
cmake --build build/gpu --target ddp-cuda-test ddp-cuda-staging-test data_parallel \
  fashion_mnist_gpu cuda-bench memcpy-bench
rc=0
ctest --test-dir build/gpu -L cuda --output-on-failure || rc=$?
scripts/cuda_torch_test.sh || rc=$?  # TorchFullyShard on CUDA modules, where torch has CUDA
# The GPU figures for bench/README.md (scripts/gpu.sh --bench), measured even when a test failed.
if [ "${1:-}" = "--bench" ]; then
  build/gpu/bench/cuda-bench nccl || rc=$?
  build/gpu/bench/memcpy-bench || rc=$?  # the host's own copy rate, for the staged figures
  for n in 2 4; do build/gpu/bench/cuda-bench staged -n "$n" || rc=$?; done
fi
exit "$rc"
