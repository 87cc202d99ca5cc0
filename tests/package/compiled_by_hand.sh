#!/usr/bin/env bash
# The separate-compilation mode by hand, without CMake (as a Makefile or pkg-config user builds):
#   compiled_by_hand.sh SOURCE_DIR WORK_DIR CXX DDPRUN
# For include/ (<ddp/impl/src.hpp> in the implementation unit) and for the single header
# (DDP_IMPLEMENTATION defined before it): the program's two units are compiled with
# DDP_SEPARATE_COMPILATION and must define none of ddp's non-template functions themselves; the
# three objects link, and the program runs under ddprun on 3 ranks.
set -euo pipefail
src=$1 work=$2 cxx=$3 ddprun=$4
rm -rf "$work"
mkdir -p "$work"
common="$src/tests/package/common"
for mode in include single_include; do
  out="$work/$mode"
  mkdir -p "$out"
  if [ "$mode" = include ]; then
    printf '#include <ddp/impl/src.hpp>\n' >"$out/impl.cpp"
  else
    printf '#define DDP_IMPLEMENTATION\n#include <ddp/ddp.hpp>\n' >"$out/impl.cpp"
  fi
  flags=(-std=c++20 -O1 -I "$src/$mode")
  "$cxx" "${flags[@]}" -DDDP_SEPARATE_COMPILATION -c "$common/compiled_main.cpp" -o "$out/main.o"
  "$cxx" "${flags[@]}" -DDDP_SEPARATE_COMPILATION -c "$common/compiled_sum.cpp" -o "$out/sum.o"
  "$cxx" "${flags[@]}" -c "$out/impl.cpp" -o "$out/impl.o"
  # The user's units call ddp's store, transports and communicator state; they must not carry
  # their code: no non-template function of ddp is defined in them (a symbol without template
  # arguments), but for the implicit destructors of plain structs (Options, Environment, ...).
  # A body left in a class, or an out-of-line one outside DDP_BODIES, shows up here.
  for o in main sum; do
    nm -C --defined-only "$out/$o.o" | grep -E ' [TW] ddp::' | grep -v '<' |
      grep -Ev '::~[A-Za-z_]+\(\)$' >"$out/$o.own" || true
    if [ -s "$out/$o.own" ]; then
      echo "$mode: $o.o defines ddp's non-template functions itself:" >&2
      head "$out/$o.own" >&2
      exit 1
    fi
  done
  # Nor Communicator<backend::Host>'s machinery (init, the type-erased part of each collective):
  # ddp/instances.hpp declares it `extern template`, and the implementation unit defines it.
  host_comm='Communicator<ddp::v[0-9]*::backend::Host>::(init|exec_single_buf|exec|submit)\('
  for o in main sum; do
    if nm -C --defined-only "$out/$o.o" | grep -Eq " [TW] ddp::v[0-9]*::$host_comm"; then
      echo "$mode: $o.o instantiates Communicator<backend::Host>'s members itself" >&2
      exit 1
    fi
  done
  impl_symbols=$(nm -C --defined-only "$out/impl.o")
  grep -q 'ddp::v[0-9]*::StoreServer::run()' <<<"$impl_symbols" ||
    { echo "$mode: the implementation unit does not define StoreServer::run()" >&2; exit 1; }
  [ "$(grep -Ec " [TW] ddp::v[0-9]*::$host_comm" <<<"$impl_symbols")" -ge 4 ] ||
    { echo "$mode: the implementation unit does not instantiate Communicator<backend::Host>" >&2; exit 1; }
  "$cxx" "$out/main.o" "$out/sum.o" "$out/impl.o" -o "$out/program" -pthread -lrt
  outp=$("$ddprun" --nproc-per-node 3 "$out/program")
  n=$(grep -c "compiled mode: all_reduce over 3 rank(s): 7.5" <<<"$outp" || true)
  [ "$n" = 3 ] || { echo "$mode: unexpected output: $outp" >&2; exit 1; }
  echo "$mode: 2 units + the implementation unit, 3 ranks under ddprun: ok"
done
echo "separate compilation by hand works"
