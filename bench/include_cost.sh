#!/usr/bin/env bash
# What `#include <ddp/ddp.hpp>` costs a user's translation unit: an empty program that includes
# the umbrella header, and the 10-line program that calls init() and one all_reduce, each
# header-only and in the separate-compilation mode (-DDDP_SEPARATE_COMPILATION: the unit's own
# cost; the implementation unit is compiled once per program), against a program that includes
# only <vector>, compiled with -O2 -c (CPU seconds, user + system, best of $ROUNDS, default 3,
# alternating with the <vector> program), for g++ and clang++; prints seconds, peak memory and
# the ratio; then, for g++, the floor: the standard and POSIX headers that ddp's headers include
# themselves (found with g++ -H), compiled alone, and where the first translation unit's time
# goes (g++ -ftime-report: parsing, template instantiation, code generation). Usage:
# bench/include_cost.sh [header[+header...] ...] (default: ddp/ddp.hpp, and the communicator
# with the Host backend alone: ddp/communicator.hpp+ddp/backend/host.hpp)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
headers=("$@")
[ ${#headers[@]} -eq 0 ] && headers=(ddp/ddp.hpp ddp/communicator.hpp+ddp/backend/host.hpp)
source_of() {  # source_of HEADER[+HEADER...]: a program that includes them
  local IFS=+ one
  for one in $1; do printf '#include <%s>\n' "$one"; done
  printf 'int main() { return 0; }\n'
}
collective_program() {  # init() and one all_reduce
  cat <<'CPP'
#include <ddp/ddp.hpp>

#include <vector>

int main() {
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
  std::vector<float> grad(1024, 1.0f);
  comm.all_reduce(grad, ddp::ReduceOp::avg);
  return grad[0] == 1.0f ? 0 : 1;
}
CPP
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '#include <vector>\nint main() { return 0; }\n' >"$work/vector.cpp"

once() {  # once CXX SOURCE [FLAGS...]: "cpu_seconds peak_kb"
  local cxx=$1 src=$2
  shift 2
  { /usr/bin/time -f '%U %S %M' "$cxx" -std=c++20 -O2 -Iinclude "$@" -c "$src" -o "$work/o.o"; } 2>&1 |
    tail -1 | awk '{ printf "%.2f %d\n", $1 + $2, $3 }'
}
lower() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }

printf '%-10s %-52s %9s %9s %9s %8s %8s\n' compiler program "cpu (s)" "<vector>" ratio "MB" lines
row() {  # row CXX LABEL SOURCE [FLAGS...]
  local cxx=$1 label=$2 src=$3
  shift 3
  lines=$("$cxx" -std=c++20 -Iinclude "$@" -E "$src" | wc -l)
  t=999 m=0 v=999
  for _ in $(seq "$rounds"); do  # alternate, keep the best of each
    read -r s k < <(once "$cxx" "$src" "$@")
    if lower "$s" "$t"; then t=$s m=$k; fi
    read -r s _ < <(once "$cxx" "$work/vector.cpp")
    if lower "$s" "$v"; then v=$s; fi
  done
  ratio=$(awk -v a="$t" -v b="$v" 'BEGIN { printf "%.1f", a / b }')
  printf '%-10s %-52s %9s %9s %9s %8d %8d\n' "$cxx" "$label" "$t" "$v" "${ratio}x" $((m / 1024)) "$lines"
}
collective_program >"$work/collective.cpp"
for cxx in g++ clang++; do
  command -v "$cxx" >/dev/null || continue
  for h in "${headers[@]}"; do
    source_of "$h" >"$work/ddp-$cxx.cpp"
    row "$cxx" "empty, $h" "$work/ddp-$cxx.cpp"
  done
  source_of ddp/ddp.hpp >"$work/umbrella.cpp"
  row "$cxx" "empty, ddp/ddp.hpp, separate compilation" "$work/umbrella.cpp" -DDDP_SEPARATE_COMPILATION
  row "$cxx" "init + all_reduce, header-only" "$work/collective.cpp"
  row "$cxx" "init + all_reduce, separate compilation" "$work/collective.cpp" -DDDP_SEPARATE_COMPILATION
done
# The implementation unit, compiled once per program in the separate-compilation mode.
printf '#include <ddp/impl/src.hpp>\n' >"$work/impl.cpp"
read -r s k < <(once g++ "$work/impl.cpp")
echo "g++: the implementation unit (<ddp/impl/src.hpp>, once per program): $s s, $((k / 1024)) MB"

# The floor (g++): what the system headers ddp's headers include directly cost by themselves.
source_of "${headers[0]}" >"$work/ddp.cpp"
g++ -std=c++20 -Iinclude -H -fsyntax-only "$work/ddp.cpp" 2>&1 | grep -E '^\.+ ' |
  awk '{ print length($1), $2 }' | python3 -c '
import sys
direct, stack = set(), []
for line in sys.stdin:
    depth, path = line.split()
    depth = int(depth)
    while stack and stack[-1][0] >= depth:
        stack.pop()
    if stack and "include/ddp/" in stack[-1][1] and "include/ddp/" not in path:
        direct.add(path)
    stack.append((depth, path))
print("".join(f"#include \"{p}\"\n" for p in sorted(direct)) + "int main() { return 0; }")
' >"$work/floor.cpp"
f=999
for _ in $(seq "$rounds"); do
  read -r s _ < <(once g++ "$work/floor.cpp")
  if lower "$s" "$f"; then f=$s; fi
done
echo "floor (g++): the $(grep -c '#include' "$work/floor.cpp") system headers ddp's headers include: $f s"
# Where the time of the first one goes.
g++ -std=c++20 -O2 -Iinclude -c "$work/ddp.cpp" -o "$work/o.o" -ftime-report 2>&1 |
  grep -E '^ (phase parsing|phase lang. deferred|phase opt and generate|template instantiation) ' |
  awk -F: '{ split($2, a, " "); printf "g++ -ftime-report, %s: %s s (user)\n", $1, a[1] }' |
  sed 's/  */ /g'
