#!/usr/bin/env bash
# The install lines of docs/guide/building.md (and README's Install), verbatim but for the prefix, on a copy of the source tree that was never
# built: cmake -S . -B build && cmake --install build --prefix PREFIX must install the headers,
# the CMake package and the pkg-config file; then (where CLI11 and fmt are found)
# cmake --build build --target ddprun ddp-trace && cmake --install ... adds bin/ddprun and
# bin/ddp-trace.
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
# The line with the tools: ddprun and ddp-trace built, then installed with the rest.
targets=$(cmake --build build --target help 2>/dev/null || true)
if grep -q 'ddprun' <<<"$targets"; then  # CLI11 and fmt were found
  cmake --build build --target ddprun ddp-trace >"$work/tools.log" 2>&1 || { tail -30 "$work/tools.log"; exit 1; }
  cmake --install build --prefix "$work/prefix" >/dev/null
  "$work/prefix/bin/ddprun" --version | grep -q '^ddprun (ddp ' || { echo "bin/ddprun does not run" >&2; exit 1; }
  [ -x "$work/prefix/bin/ddp-trace" ] || { echo "the install is missing bin/ddp-trace" >&2; exit 1; }
fi
echo "README's install line works: $(find "$work/prefix" -type f | wc -l) files installed"
