#!/usr/bin/env bash
# Runs every test of ddp on a fresh Debian/Ubuntu machine, installing what is missing first
# (as root; otherwise it prints the apt-get line to run).
#
#   scripts/test.sh          everything: format, single-header freshness, the API reference
#                            (Doxygen, warnings are errors), g++ Release with every test
#                            (+ packaging: install, find_package, add_subdirectory, meson,
#                            pkg-config, conan; the launchers for real: PyPI's torchrun, a
#                            one-node Slurm cluster, mpirun across two network namespaces),
#                            the CUDA libtorch test built against PyPI's torch (where the
#                            CUDA toolkit is; it runs on a GPU only: scripts/gpu.sh),
#                            clang++ against the single header, header-only (the fast and
#                            compile-fail tests, the fuzzers),
#                            ASan+UBSan (every test but the main job and packaging), TSan (the
#                            multi-threaded parts), meson
#   scripts/test.sh --fast   g++, the tests labelled fast (the development loop; not the
#                            compile-fail tests)
# Tests run two at a time (the presets' jobs); those that measure time windows run alone.
# Modes: the g++, sanitizer and --fast stages build ddp's tests, examples, tools and benchmarks
# in the separate-compilation mode (against ddp::compiled), except the header checks, the MPI,
# CUDA and libtorch programs and the fuzzers, which are header-only; the clang stage and meson
# build everything header-only.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
# shellcheck source=scripts/lib/deps.sh
. scripts/lib/deps.sh

fast=0
[ "${1:-}" = "--fast" ] && fast=1

ensure_debs build-essential g++ clang clang-format cmake ninja-build pkg-config python3 python3-venv \
  doctest-dev meson git libopenmpi-dev openmpi-bin libcli11-dev libfmt-dev iproute2 \
  zlib1g-dev libeigen3-dev libclang-rt-dev dataset-fashion-mnist doxygen etcd-server nftables
mkdir -p build
[ $fast -eq 0 ] && ensure_conan "$root/build"  # the conan consumer test: not in --fast
# libtorch (CPU) for the torch adapter's tests and examples, PyTorch for the benchmark's peer and
# OpenBLAS under both (Debian's libtorch uses whatever libblas.so.3 points at; the reference BLAS
# is ~10x slower), Gloo's headers for bench/torch/reducer-bench (c10d::Reducer): the g++ stage only
# (the --fast, clang and sanitizer presets build without them).
[ $fast -eq 0 ] && ensure_debs libtorch-dev python3-torch libopenblas0-pthread libgloo-dev
# The real launchers the launch tests run programs under: PyPI's torchrun (Debian's 1.13 torchrun
# does not start on Python 3.11) and a one-node Slurm cluster (slurm-wlm, munge) started here.
if [ $fast -eq 0 ]; then
  ensure_debs slurm-wlm munge
  ensure_torch_venv || exit 1
  ensure_ulfm_mpi || exit 1  # Open MPI 5 with ULFM: backend::Mpi's shrink() on a real library
  if [ "$(id -u)" -eq 0 ]; then
    slurm_env=$(scripts/slurm.sh start build/slurm) || exit 1
    eval "$slurm_env"  # export SLURM_CONF=...
    trap 'scripts/slurm.sh stop build/slurm' EXIT
  else
    echo "note: not root: the Slurm tests are skipped (scripts/slurm.sh needs root)"
  fi
fi

passed=0
failed=0
failures=()
stage() {  # stage NAME COMMAND...: runs one stage, records the outcome, keeps going
  local name=$1
  shift
  echo
  echo "==> $name"
  local start=$SECONDS
  if "$@"; then
    passed=$((passed + 1))
    echo "==> $name: ok ($((SECONDS - start)) s)"
  else
    failed=$((failed + 1))
    failures+=("$name")
    echo "==> $name: FAILED ($((SECONDS - start)) s)"
  fi
}

build_tree() {  # build_tree PRESET: configure from scratch (a stale cache can never hide a problem), build
  rm -rf "build/$1"
  cmake --preset "$1" && cmake --build --preset "$1"
}

test_tree() {  # test_tree PRESET: its tests, and the slowest of them
  ctest --preset "$1" 2>&1 | tee "build/$1-tests.log"
  local rc=${PIPESTATUS[0]}
  slowest "build/$1-tests.log"
  return "$rc"
}

logged_build() {  # logged_build PRESET: build_tree, its output also in build/PRESET.log
  mkdir -p build
  build_tree "$1" 2>&1 | tee "build/$1.log"
  return "${PIPESTATUS[0]}"
}

fresh_workflow() {  # fresh_workflow PRESET: build_tree, then test_tree
  logged_build "$1" && test_tree "$1"
}

slowest() {  # the 15 slowest tests of a stage's ctest output, slowest first
  local lines
  lines=$(grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: ' "$1" |
    sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: (.*[^ .]) *\.+ *[*A-Za-z ]*[A-Za-z] +([0-9.]+) sec.*$/\2 \1/' |
    sort -rn | head -15)
  [ -n "$lines" ] || return 0
  echo "--- the 15 slowest tests of this stage (seconds):"
  echo "$lines" | awk '{ printf "%8.1f  %s\n", $1, substr($0, index($0, " ") + 1) }'
}

meson_build() {
  rm -rf build/meson
  meson setup build/meson -Dtests=enabled && meson compile -C build/meson
}

# The builds of the later stages run in the background, one after another, while the g++ stage's
# tests run: most of those tests wait (on processes, sockets, timeouts, launchers), and a build
# under the idle scheduling class (SCHED_IDLE: any other task that wakes takes the core at once)
# takes only the CPU they leave. Each later stage then waits for its build (its log is printed)
# and runs its tests alone in the foreground, beside what is left of the background builds.
background_builds() {
  local job
  for job in "$@"; do
    local start=$SECONDS rc=0
    case $job in
      meson) meson_build >"build/$job.log" 2>&1 || rc=$? ;;
      cuda-torch)
        scripts/cuda_torch_test.sh "${DDP_TORCH_VENV:-$HOME/.cache/ddp/torch-venv}/bin/python" check \
          >"build/$job.log" 2>&1 || rc=$? ;;
      *) build_tree "$job" >"build/$job.log" 2>&1 || rc=$? ;;
    esac
    echo "$rc $((SECONDS - start))" >"build/$job.done"
  done
}

await_build() {  # await_build JOB: waits for a background build, prints its log, returns its status
  local start=$SECONDS
  while [ ! -e "build/$1.done" ]; do
    if ! kill -0 "$background_pid" 2>/dev/null && [ ! -e "build/$1.done" ]; then
      echo "the background builds ended before $1's" >&2
      return 1
    fi
    sleep 2
  done
  cat "build/$1.log"
  local rc took
  read -r rc took <"build/$1.done"
  echo "--- $1: built in the background in $took s; waited $((SECONDS - start)) s for it here"
  return "$rc"
}

sanitized_tests() { await_build clang-asan-ubsan && test_tree clang-asan-ubsan; }
tsan_tests() { await_build tsan && test_tree tsan; }
meson_tests() { await_build meson && meson test -C build/meson --print-errorlogs; }

# Seconds, in both modes: where a file and its bodies belong.
stage "include/ddp's layout (no circle, <= 10 floors, bodies in .ipp files, file lengths)" python3 tools/check_layout.py
stage "the layout rules catch a body in the wrong place" python3 tools/check_layout.py --self-test
if [ $fast -eq 0 ]; then
  stage "clang-format (every C++ file)" scripts/format.sh --check
  stage "single_include is regenerated from include/" python3 tools/amalgamate.py --check
  stage "API reference (Doxygen, warnings are errors)" scripts/docs.sh
fi
if [ $fast -eq 1 ]; then
  stage "g++: the fast tests" fresh_workflow fast
else
  stage "g++ Release: the build (tests, examples, tools, benchmarks, header checks)" logged_build ci
  rm -f build/*.done
  idle=(nice -n 19)  # where SCHED_IDLE is not allowed, the lowest priority
  chrt --idle 0 true 2>/dev/null && idle=(chrt --idle 0)
  "${idle[@]}" bash -c "$(declare -f build_tree meson_build background_builds); background_builds clang-asan-ubsan tsan meson cuda-torch" &
  background_pid=$!
  trap 'kill "$background_pid" 2>/dev/null; [ -z "${SLURM_CONF:-}" ] || scripts/slurm.sh stop build/slurm' EXIT
  stage "g++ Release: every test (unit, launch, examples, the main job, MPI, libtorch, packaging)" test_tree ci
  stage "clang++ against single_include/, ASan + UBSan: every test but the main job and packaging, compile-fail, the fuzzers" \
    sanitized_tests
  stage "ThreadSanitizer (the multi-threaded parts)" tsan_tests
  stage "meson: build and tests (both dependencies)" meson_tests
  stage "TorchFullyShard on CUDA modules: built against PyPI's torch (skipped without a GPU)" \
    await_build cuda-torch
fi

echo
echo "total: $((SECONDS / 60)) min $((SECONDS % 60)) s"
if [ $failed -ne 0 ]; then
  printf 'failed stage: %s\n' "${failures[@]}"
fi
echo "stages: $passed passed, $failed failed"
[ $failed -eq 0 ]
