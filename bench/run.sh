#!/usr/bin/env bash
# Reproduces the numbers in bench/README.md: ddp's Host backend against Open MPI's
# MPI_Allreduce (shared memory), float32 sum, 2 and 4 ranks on this host, in the same run,
# plus the single-thread memcpy reference. Results go to build/bench-results/.
#   bench/run.sh            (needs: cmake, g++, libopenmpi-dev, openmpi-bin, libcli11-dev, libfmt-dev)
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/bench-results
mkdir -p "$out"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build/release >/dev/null
mpirun=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpirun+=(--allow-run-as-root)
echo "== $(date -u +%F) on $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
./build/release/bench/memcpy-bench $((64 << 20)) | tee "$out/memcpy.txt"
reps=${REPS:-3}
for n in 2 4; do
  ddp=() mpi=()
  for rep in $(seq 1 "$reps"); do  # interleaved, so both see the same machine
    ./build/release/tools/ddp-bench -n "$n" -b 4 -e 64M -f 4 --label ddp --csv "$out/ddp-$n-$rep.csv" >/dev/null
    "${mpirun[@]}" -np "$n" ./build/release/bench/mpi-bench -b 4 -e 64M -f 4 --label "Open MPI" \
      --csv "$out/mpi-$n-$rep.csv" >/dev/null
    ddp+=("$out/ddp-$n-$rep.csv") mpi+=("$out/mpi-$n-$rep.csv")
  done
  echo "== all_reduce, float32 sum, $n ranks (median of $reps interleaved runs)"
  python3 bench/compare.py "${ddp[@]}" -- "${mpi[@]}" | tee "$out/compare-$n.md"
  ./build/release/tools/ddp-bench -n "$n" -b 4 -e 64M -f 4 --iters 5 --label ddp --plot "$out/busbw-$n.svg" \
    --compare "$out/mpi-$n-1.csv" >/dev/null
done
./build/release/bench/memcpy-bench $((64 << 20)) | tee -a "$out/memcpy.txt"
