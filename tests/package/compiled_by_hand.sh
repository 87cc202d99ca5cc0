#!/usr/bin/env bash
# The separate-compilation mode by hand, without CMake (as a Makefile or pkg-config user builds):
#   compiled_by_hand.sh SOURCE_DIR WORK_DIR CXX DDPRUN
# For include/ (<ddp/impl/src.hpp> in the implementation unit) and for the single header
# (DDP_IMPLEMENTATION defined before it): the program's two units are compiled with
# DDP_SEPARATE_COMPILATION and must define none of ddp's non-template functions themselves; the
# three objects link, and the program runs under ddprun on 3 ranks; without the implementation
# unit the link fails naming it, a unit compiled header-only does not link with the others, and
# units of both modes that meet only through a class of the program's are refused at init().
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
  # The implementation unit at -O0: what is checked is which unit defines what, and that it runs.
  "$cxx" "${flags[@]}" -O0 -c "$out/impl.cpp" -o "$out/impl.o"
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
  host_comm='Communicator<ddp::v[0-9a-z_]*::backend::Host>::(init|exec_single_buf|exec|submit)\('
  for o in main sum; do
    if nm -C --defined-only "$out/$o.o" | grep -Eq " [TW] ddp::v[0-9a-z_]*::$host_comm"; then
      echo "$mode: $o.o instantiates Communicator<backend::Host>'s members itself" >&2
      exit 1
    fi
  done
  impl_symbols=$(nm -C --defined-only "$out/impl.o")
  grep -q 'ddp::v[0-9a-z_]*::StoreServer::run()' <<<"$impl_symbols" ||
    { echo "$mode: the implementation unit does not define StoreServer::run()" >&2; exit 1; }
  [ "$(grep -Ec " [TW] ddp::v[0-9a-z_]*::$host_comm" <<<"$impl_symbols")" -ge 4 ] ||
    { echo "$mode: the implementation unit does not instantiate Communicator<backend::Host>" >&2; exit 1; }
  # Without the implementation unit, the link fails naming it.
  if "$cxx" "$out/main.o" "$out/sum.o" -o "$out/no_impl" -pthread -lrt 2>"$out/no_impl.log"; then
    echo "$mode: the program linked without its implementation unit" >&2
    exit 1
  fi
  grep -q 'separate_compilation_needs_one_unit_that_includes_ddp_impl_src_hpp' "$out/no_impl.log" ||
    { echo "$mode: the link error does not name the implementation unit:" >&2; head "$out/no_impl.log" >&2; exit 1; }
  # A unit compiled header-only does not meet the others: passing a communicator to it fails to
  # link (its symbols are in another inline namespace) instead of running two copies of ddp.
  "$cxx" "${flags[@]}" -c "$common/compiled_sum.cpp" -o "$out/sum_header_only.o"
  if "$cxx" "$out/main.o" "$out/sum_header_only.o" "$out/impl.o" -o "$out/mixed" -pthread -lrt \
    2>"$out/mixed.log"; then
    echo "$mode: a header-only unit linked with the separate-compilation mode's units" >&2
    exit 1
  fi
  grep -q 'undefined reference to .*sum_over_ranks' "$out/mixed.log" ||
    { echo "$mode: unexpected link error for the mixed program:" >&2; head "$out/mixed.log" >&2; exit 1; }
  # Units that meet only through the program's own type (a class holding a Communicator, no
  # ddp type in a signature) link across the modes; init() then refuses, naming both modes.
  "$cxx" "${flags[@]}" -c "$common/mixed_trainer.cpp" -o "$out/mixed_trainer.o"
  "$cxx" "${flags[@]}" -DDDP_SEPARATE_COMPILATION -c "$common/mixed_main.cpp" -o "$out/mixed_main.o"
  "$cxx" "$out/mixed_main.o" "$out/mixed_trainer.o" "$out/impl.o" -o "$out/mixed_by_class" \
    -pthread -lrt
  rc=0
  said=$("$out/mixed_by_class") || rc=$?
  [ "$rc" = 3 ] && grep -q "compiled in both of ddp's modes, some header-only and some with DDP_SEPARATE_COMPILATION" <<<"$said" ||
    { echo "$mode: a program mixing the modes through its own class was not refused (rc $rc): $said" >&2; exit 1; }
  echo "$mode: units of both modes meeting through a class: init() refuses, naming both modes"
  "$cxx" "$out/main.o" "$out/sum.o" "$out/impl.o" -o "$out/program" -pthread -lrt
  outp=$("$ddprun" --nproc-per-node 3 "$out/program")
  n=$(grep -c "compiled mode: all_reduce over 3 rank(s): 7.5" <<<"$outp" || true)
  [ "$n" = 3 ] || { echo "$mode: unexpected output: $outp" >&2; exit 1; }
  echo "$mode: 2 units + the implementation unit, 3 ranks under ddprun: ok"
done
echo "separate compilation by hand works"
