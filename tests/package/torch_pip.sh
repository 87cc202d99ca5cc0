#!/usr/bin/env bash
# Builds tests/package/torch_pip against an installed ddp and pip's libtorch (PyPI `torch`), the
# recipe README's "Using libtorch" gives, and runs it.
#   torch_pip.sh SOURCE_DIR WORK_DIR DDP_PREFIX CXX
# The Python with pip's torch: $DDP_TORCH_PYTHON (default ~/.cache/ddp/torch-venv/bin/python).
# Exits 77 (skipped) when that Python or its torch is missing.
set -euo pipefail
src=$1 work=$2 prefix=$3 cxx=$4
py=${DDP_TORCH_PYTHON:-$HOME/.cache/ddp/torch-venv/bin/python}
# README's three lines, verbatim but for the ddp prefix (no build type: this checks that it
# builds and runs; torch's headers compile much faster without optimization):
if ! torch_dir=$("$py" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null); then
  echo "skipped: no pip torch at $py (set DDP_TORCH_PYTHON)"
  exit 77
fi
nccl_dir=$("$py" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
rm -rf "$work"
mkdir -p "$work"
cmake -S "$src/tests/package/torch_pip" -B "$work" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE= "-DCMAKE_PREFIX_PATH=$prefix;$torch_dir;$torch_dir/share/cmake" \
  ${nccl_dir:+"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$nccl_dir/lib"} >"$work/configure.log" 2>&1 \
  || { tail -40 "$work/configure.log"; exit 1; }
cmake --build "$work" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
OMP_NUM_THREADS=1 "$work/consumer"
