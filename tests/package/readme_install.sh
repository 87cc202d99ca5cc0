#!/usr/bin/env bash
# README's install line, verbatim but for the prefix, on a copy of the source tree that was never
# built: cmake -S . -B build && cmake --install build --prefix PREFIX. It must install the headers
# and the CMake package (the tools too where they were built; here they were not).
#   readme_install.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src=$1 work=$2
if ! git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  echo "skipped: $src is not a git checkout"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work/src"
# The tracked tree, as a clone has it (no build directories).
git -C "$src" ls-files -z | (cd "$src" && xargs -0 cp --parents -t "$work/src")
cd "$work/src"
cmake -S . -B build >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log"; exit 1; }
cmake --install build --prefix "$work/prefix"
for f in include/ddp/ddp.hpp share/cmake/ddp/ddpConfig.cmake share/pkgconfig/ddp.pc; do
  [ -e "$work/prefix/$f" ] || { echo "the install is missing $f" >&2; exit 1; }
done
echo "README's install line works: $(find "$work/prefix" -type f | wc -l) files installed"
