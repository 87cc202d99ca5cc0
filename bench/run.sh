#!/usr/bin/env bash
# Reproduces the transport tables in bench/README.md: ddp's Host backend against Open MPI's
# MPI_Allreduce, float32 sum, 4 B-64 MiB, on this host, over shared memory (ddp's shm transport
# against Open MPI's vader BTL) and over loopback TCP (DDP_HOST_TRANSPORT=tcp against
# `--mca btl self,tcp`), 2 and 4 ranks. This machine's speed drifts by up to 3x between minutes,
# so the two run in alternating rounds (which of them goes first alternates too) and each size
# reports the median over the rounds of that round's time ratio (bench/compare.py). Over shared
# memory with 2 ranks every round also runs single-copy-bench, the bound (process_vm_readv,
# bandwidth-optimal bytes), and both are compared with it.
#   bench/run.sh                        every transport, 2 and 4 ranks, 8 rounds
#   ROUNDS=4 TRANSPORTS=tcp NPROCS=2 bench/run.sh
#   (needs: cmake, ninja, g++, libopenmpi-dev, openmpi-bin, libcli11-dev, libfmt-dev)
# Results (CSV per run, markdown tables, SVG plots) go to build/bench-results/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/bench-results
mkdir -p "$out"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF \
  -DDDP_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build/release --target ddp-bench mpi-bench memcpy-bench single-copy-bench >/dev/null
rounds=${ROUNDS:-8}
sizes=(-b "${MIN_BYTES:-4}" -e "${MAX_BYTES:-64M}" -f 4)
mpirun=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpirun+=(--allow-run-as-root)
echo "== $(date -u +%F) on $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
./build/release/bench/memcpy-bench $((64 << 20)) | tee "$out/memcpy.txt"
for transport in ${TRANSPORTS:-shm tcp}; do
  case $transport in
    shm) btl=(--mca btl self,vader) ;;
    tcp) btl=(--mca btl self,tcp) ;;
    *) echo "run.sh: unknown transport $transport (shm or tcp)" >&2; exit 2 ;;
  esac
  for n in ${NPROCS:-2 4}; do
    ddp=() mpi=() single=()
    # Shared memory, 2 ranks: each round also runs single-copy-bench, the bound (bench/README.md).
    bound=$([ "$transport" = shm ] && [ "$n" -eq 2 ] && echo 1 || true)
    for round in $(seq 1 "$rounds"); do
      d="$out/ddp-$transport-$n-$round.csv" m="$out/mpi-$transport-$n-$round.csv"
      s="$out/single-copy-$round.csv"
      run_ddp() { ./build/release/tools/ddp-bench -n "$n" -t "$transport" "${sizes[@]}" \
                    --label ddp --csv "$d" >/dev/null; }
      run_mpi() { "${mpirun[@]}" "${btl[@]}" -np "$n" ./build/release/bench/mpi-bench "${sizes[@]}" \
                    --label "Open MPI" --csv "$m" >/dev/null; }
      run_single() { [ -z "$bound" ] || ./build/release/bench/single-copy-bench \
                       "${MAX_BYTES:-64M}" "$s" "single copy" >/dev/null; }
      if [ $((round % 2)) -eq 1 ]; then run_ddp; run_mpi; run_single; else run_single; run_mpi; run_ddp; fi
      ddp+=("$d") mpi+=("$m") single+=("$s")
    done
    echo "== all_reduce, float32 sum, $n ranks, $transport (median of $rounds alternating rounds)"
    python3 bench/compare.py "${ddp[@]}" -- "${mpi[@]}" | tee "$out/compare-$transport-$n.md"
    if [ -n "$bound" ]; then
      echo "== the same rounds: ddp, then Open MPI, against single-copy-bench (the bound)"
      python3 bench/compare.py "${ddp[@]}" -- "${single[@]}" | tee "$out/compare-ddp-single.md"
      python3 bench/compare.py "${mpi[@]}" -- "${single[@]}" | tee "$out/compare-mpi-single.md"
    fi
    ./build/release/tools/ddp-bench -n "$n" -t "$transport" "${sizes[@]}" --iters 5 --label ddp \
      --plot "$out/busbw-$transport-$n.svg" --compare "${mpi[0]}" >/dev/null
  done
done
./build/release/bench/memcpy-bench $((64 << 20)) | tee -a "$out/memcpy.txt"
