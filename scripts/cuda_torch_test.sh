#!/usr/bin/env bash
# Builds and runs ddp-cuda-torch-test (tests/cuda/test_torch_cuda.cpp: TorchFullyShard over CUDA
# modules) against PYTHON's torch, a CUDA build of it (PyPI's); Debian's libtorch is CPU-only.
# Without a GPU the test reports itself skipped, so this checks that the CUDA path compiles.
#
#   scripts/cuda_torch_test.sh [PYTHON [BUILD]]   PYTHON: default python3 (scripts/test.sh gives
#                                            the torch venv's, scripts/gpu.sh the machine's);
#                                            BUILD: Release (default) or check (-O0, what
#                                            scripts/test.sh builds where it cannot run it)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-python3}"
build="${2:-Release}"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  echo "scripts/cuda_torch_test.sh: $py has no CUDA build of torch; nothing to build" >&2
  exit 0
fi
tdir=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)
if [ "$build" = check ]; then
  build_args=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0)
else
  build_args=("-DCMAKE_BUILD_TYPE=$build")
fi
args=("${build_args[@]}" "-DCMAKE_PREFIX_PATH=$tdir/share/cmake"
  # a system libtorch (Debian's libtorch-dev) has libraries find_library would prefer
  "-Dc10_LIBRARY=$tdir/lib/libc10.so" "-DTORCH_LIBRARY=$tdir/lib/libtorch.so")
# A CUDA build of torch links NCCL from its own wheel.
if nccl=$("$py" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null); then
  args+=("-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$nccl/lib")
fi
export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
if ! command -v nvcc >/dev/null; then  # torch's CMake config looks for the toolkit
  echo "scripts/cuda_torch_test.sh: no CUDA toolkit (nvcc); nothing to build" >&2
  exit 0
fi
cmake -S tests/cuda/torch -B build/cuda-torch "${args[@]}" >build/cuda-torch.log 2>&1 ||
  { cat build/cuda-torch.log; exit 1; }
cmake --build build/cuda-torch
build/cuda-torch/ddp-cuda-torch-test
