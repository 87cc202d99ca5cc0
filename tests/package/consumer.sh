#!/usr/bin/env bash
# Builds and runs one tiny consumer project against ddp, the way a user would.
#   consumer.sh KIND SOURCE_DIR WORK_DIR PREFIX VERSION CXX
# KIND: meson (subproject), pkgconfig (installed ddp.pc), conan (conan create + test_package).
# Exits 77 (skipped) when the tool is missing, unless DDP_REQUIRE_PACKAGING_TOOLS=1.
set -euo pipefail
kind=$1 src=$2 work=$3 prefix=$4 version=$5 cxx=$6

need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    if [ "${DDP_REQUIRE_PACKAGING_TOOLS:-0}" = 1 ]; then
      echo "error: $1 is required for the $kind consumer test but is not installed" >&2
      exit 1
    fi
    echo "skipped: $1 is not installed"
    exit 77
  fi
}
check_output() {  # the consumer must print exactly the version it was built against
  grep -qx "ddp $version (3 x bfloat16)" <<<"$1" || { echo "unexpected output: $1" >&2; exit 1; }
  echo "$1"
}

rm -rf "$work"
mkdir -p "$work"
case $kind in
  meson)
    need meson
    need ninja
    cp "$src/tests/package/meson_subproject/meson.build" "$src/tests/package/common/main.cpp" \
      "$src/tests/package/common/compiled_main.cpp" "$src/tests/package/common/compiled_sum.cpp" "$work/"
    cp "$src/tests/package/cmake_components/main.cpp" "$work/components.cpp"
    mkdir -p "$work/subprojects/ddp"
    cp -r "$src/meson.build" "$src/meson_options.txt" "$src/single_include" "$src/include" \
      "$src/cmake" "$work/subprojects/ddp/"
    CXX=$cxx meson setup "$work/build" "$work" >"$work/setup.log" 2>&1 || { cat "$work/setup.log"; exit 1; }
    meson test -C "$work/build" --print-errorlogs
    # dependency('ddp-mpi') / ('ddp-nccl') must exist wherever their libraries are installed.
    if command -v mpicxx >/dev/null 2>&1; then
      grep -q "components ok" <<<"$("$work/build/consumer-mpi")" || { echo "no ddp-mpi consumer" >&2; exit 1; }
      echo "dependency('ddp-mpi'): $("$work/build/consumer-mpi" | head -1)"
    fi
    if [ -e "${CUDA_PATH:-/usr/local/cuda}/include/nccl.h" ]; then
      grep -q "components ok" <<<"$("$work/build/consumer-nccl")" || { echo "no ddp-nccl consumer" >&2; exit 1; }
      echo "dependency('ddp-nccl'): $("$work/build/consumer-nccl" | head -1)"
    fi
    grep -q "compiled mode: all_reduce over 1 rank(s): 2.5" <<<"$("$work/build/consumer-compiled")" ||
      { echo "the ddp-compiled consumer failed" >&2; exit 1; }
    echo "dependency('ddp-compiled'): $("$work/build/consumer-compiled")"
    check_output "$("$work/build/consumer")"
    ;;
  pkgconfig)
    need pkg-config
    export PKG_CONFIG_PATH="$prefix/share/pkgconfig"
    [ "$(pkg-config --modversion ddp)" = "$version" ] || { echo "pkg-config reports $(pkg-config --modversion ddp)" >&2; exit 1; }
    cflags=$(pkg-config --cflags ddp)
    libs=$(pkg-config --libs ddp)
    # One command line of both must not repeat a flag (it once said -pthread twice).
    repeated=$(pkg-config --cflags --libs ddp | tr ' ' '\n' | grep . | sort | uniq -d)
    [ -z "$repeated" ] || { echo "pkg-config --cflags --libs repeats: $repeated" >&2; exit 1; }
    echo "pkg-config --cflags ddp: $cflags"
    [[ "$cflags" == *"-I$prefix/share/pkgconfig/../../include"* || "$cflags" == *"-I$prefix/include"* ]] \
      || { echo "cflags do not point into the prefix" >&2; exit 1; }
    # shellcheck disable=SC2086
    "$cxx" -std=c++20 $cflags "$src/tests/package/common/main.cpp" -o "$work/consumer" $libs
    # ddp-compiled: the separate-compilation mode, the implementation unit compiled by hand.
    printf '#include <ddp/impl/src.hpp>\n' >"$work/ddp_impl.cpp"
    # shellcheck disable=SC2046
    "$cxx" -std=c++20 $(pkg-config --cflags ddp-compiled) "$src/tests/package/common/compiled_main.cpp" \
      "$src/tests/package/common/compiled_sum.cpp" "$work/ddp_impl.cpp" -o "$work/consumer-compiled" \
      $(pkg-config --libs ddp-compiled)
    grep -q "compiled mode: all_reduce over 1 rank(s): 2.5" <<<"$("$work/consumer-compiled")" ||
      { echo "the ddp-compiled consumer failed" >&2; exit 1; }
    echo "pkg-config ddp-compiled: $("$work/consumer-compiled")"
    check_output "$("$work/consumer")"
    ;;
  conan)
    need conan
    export CONAN_HOME="$work/conan-home"
    conan profile detect >/dev/null 2>&1
    # The profile's default is the compiler's default standard; ddp needs C++20. Debug: the test
    # package checks that the recipe's targets build, link and run, not their speed (the
    # profile's Release would compile the implementation unit and libtorch's headers at -O3).
    # Work on a copy, so the test package's build folder never lands in the source tree.
    mkdir -p "$work/src/tests/package"
    mkdir -p "$work/src/cmake"
    cp -r "$src/conanfile.py" "$src/LICENSE" "$src/include" "$src/test_package" "$work/src/"
    cp "$src/cmake/ddp-conan-torch.cmake" "$src/cmake/ddp-conan-compiled.cmake" \
      "$src/cmake/ddpCompiled.cmake" "$src/cmake/ddp_compiled.cpp" "$work/src/cmake/"
    cp -r "$src/tests/package/common" "$src/tests/package/cmake_components" \
      "$src/tests/package/torch_pip" "$work/src/tests/package/"
    CXX=$cxx CC=${cxx/++/cc} conan create "$work/src" --no-remote --build=missing -s compiler.cppstd=20 \
      -s build_type=Debug >"$work/conan.log" 2>&1 || { tail -60 "$work/conan.log"; exit 1; }
    out=$(grep -E '^ddp [0-9]' "$work/conan.log" | tail -1)
    # The backend options, each where its library is installed: ddp::mpi / ddp::nccl link and
    # define what the headers need.
    options=(-o "ddp/*:compiled=True")  # ddp::compiled: the separate-compilation mode
    command -v mpicxx >/dev/null 2>&1 && options+=(-o "ddp/*:with_mpi=True")
    [ -e "${CUDA_HOME:-/usr/local/cuda}/include/nccl.h" ] && options+=(-o "ddp/*:with_nccl=True")
    # with_torch where a libtorch CMake finds by default is installed (Debian's libtorch-dev)
    compgen -G "/usr/lib/*/cmake/Torch/TorchConfig.cmake" >/dev/null \
      || compgen -G "/usr/share/cmake/Torch/TorchConfig.cmake" >/dev/null \
      && options+=(-o "ddp/*:with_torch=True")
    if [ ${#options[@]} -gt 0 ]; then
      CXX=$cxx CC=${cxx/++/cc} conan create "$work/src" --no-remote --build=missing -s compiler.cppstd=20 \
        -s build_type=Debug "${options[@]}" >"$work/conan-options.log" 2>&1 || { tail -60 "$work/conan-options.log"; exit 1; }
      if [[ " ${options[*]} " == *with_mpi=True* || " ${options[*]} " == *with_nccl=True* ]]; then
        grep -q "^components ok: ddp $version" "$work/conan-options.log" \
          || { tail -40 "$work/conan-options.log"; echo "the components consumer did not run" >&2; exit 1; }
      fi
      grep -q "compiled mode: all_reduce over 1 rank(s): 2.5" "$work/conan-options.log" \
        || { tail -40 "$work/conan-options.log"; echo "the ddp::compiled consumer did not run" >&2; exit 1; }
      if [[ " ${options[*]} " == *with_torch=True* ]]; then
        grep -q "^libtorch [0-9.]* with ddp $version: all_reduce and GradientAverager ok" \
          "$work/conan-options.log" \
          || { tail -40 "$work/conan-options.log"; echo "the ddp::torch consumer did not run" >&2; exit 1; }
      fi
      echo "conan create ${options[*]}: $(grep -E '^(mpi|nccl) linked|^libtorch|^compiled mode' "$work/conan-options.log" | tr '\n' ' ')"
    fi
    check_output "$out"
    ;;
  *)
    echo "unknown consumer kind $kind" >&2
    exit 2
    ;;
esac
