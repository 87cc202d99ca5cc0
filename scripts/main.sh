#!/usr/bin/env bash
# The main job on a fresh Debian/Ubuntu machine: installs what is missing (as root), builds the
# examples in Release and runs the main example.
# (The training issue replaces this with the Fashion-MNIST DDP run under ddprun.)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/deps.sh
. scripts/lib/deps.sh
ensure_debs g++ cmake ninja-build
cmake -S . -B build/main -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_INSTALL=OFF >/dev/null
cmake --build build/main
./build/main/examples/quickstart
