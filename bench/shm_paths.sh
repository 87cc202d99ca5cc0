#!/usr/bin/env bash
# The two paths of ddp's shared-memory all_reduce at 16 KiB-64 MiB, against Open MPI's vader and
# (2 ranks) single-copy-bench, the bound, in rotating rounds (bench/README.md, "Shared memory:
# single copy, and rank 0 choosing the path"):
#   auto    ddp-bench, the default: rank 0 times both paths per size and takes the faster
#   single  the same with DDP_SHM_SINGLE_COPY=65536: always single copy (process_vm_readv)
#   slot    the same with DDP_SHM_SINGLE_COPY=off: always through the shared-memory slots
#   mpi     Open MPI, --mca btl self,vader
#   bound   bench/single-copy-bench (2 ranks only)
# Each round runs every kind once, in an order that rotates round by round; each size reports the
# median over the rounds of that round's time ratio (bench/compare.py).
#   bench/shm_paths.sh                  2 ranks, 8 rounds
#   ROUNDS=6 NPROCS=4 bench/shm_paths.sh
# Results (CSV per run, markdown tables) go to build/bench-results/shm-paths-N/.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-8} n=${NPROCS:-2} max=${MAX_BYTES:-64M}
out=build/bench-results/shm-paths-$n
rm -rf "$out" && mkdir -p "$out"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF \
  -DDDP_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build/release --target ddp-bench mpi-bench single-copy-bench >/dev/null
sizes=(-b 16K -e "$max" -f 4)
mpirun=(mpirun --oversubscribe --mca btl self,vader)
[ "$(id -u)" -eq 0 ] && mpirun+=(--allow-run-as-root)
bench=./build/release/tools/ddp-bench
kinds=(auto single slot mpi)
[ "$n" -eq 2 ] && kinds+=(bound)
run() {  # run KIND ROUND
  local csv="$out/$1-$2.csv"
  case $1 in
    auto) "$bench" -n "$n" -t shm "${sizes[@]}" --label auto --csv "$csv" ;;
    single) DDP_SHM_SINGLE_COPY=65536 "$bench" -n "$n" -t shm "${sizes[@]}" --label single \
              --csv "$csv" ;;
    slot) DDP_SHM_SINGLE_COPY=off "$bench" -n "$n" -t shm "${sizes[@]}" --label slot --csv "$csv" ;;
    mpi) "${mpirun[@]}" -np "$n" ./build/release/bench/mpi-bench "${sizes[@]}" --label mpi \
           --csv "$csv" ;;
    bound) ./build/release/bench/single-copy-bench "$max" "$csv" bound ;;
  esac >/dev/null
}
k=${#kinds[@]}
for r in $(seq 1 "$rounds"); do
  for i in $(seq 0 $((k - 1))); do run "${kinds[$(((i + r) % k))]}" "$r"; done
done
compare() {  # compare A B: A's speed against B's
  echo "== $n ranks: $1 against $2 (median of $rounds rotating rounds)"
  python3 bench/compare.py $(for r in $(seq 1 "$rounds"); do echo "$out/$1-$r.csv"; done) -- \
    $(for r in $(seq 1 "$rounds"); do echo "$out/$2-$r.csv"; done) | tee "$out/$1-vs-$2.md"
}
echo "== $(date -u +%F) on $(nproc) CPUs"
compare auto mpi
compare single mpi
compare slot mpi
compare auto slot
compare auto single
if [ "$n" -eq 2 ]; then compare auto bound; compare mpi bound; fi
