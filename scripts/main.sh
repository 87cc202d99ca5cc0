#!/usr/bin/env bash
# The main job on a fresh Debian/Ubuntu machine: installs what is missing (as root), builds in
# Release, and trains an MLP on Fashion-MNIST with 4 data-parallel processes under ddprun
# (about 20 s on 2 cores; it reaches about 86% test accuracy). Extra arguments go to the
# example, e.g. scripts/main.sh --epochs 2.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/deps.sh
. scripts/lib/deps.sh
ensure_debs g++ cmake ninja-build zlib1g-dev libcli11-dev libfmt-dev dataset-fashion-mnist
cmake -S . -B build/main -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_INSTALL=OFF >/dev/null
cmake --build build/main --target ddprun fashion_mnist
./build/main/tools/ddprun --standalone --nproc-per-node 4 \
  ./build/main/examples/fashion_mnist --cache build/main/fashion-mnist-cache \
  --checkpoint build/main/fashion_mnist.ckpt "$@"
