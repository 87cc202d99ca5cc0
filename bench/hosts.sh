#!/usr/bin/env bash
# ddp's all_reduce across two "hosts" against Open MPI's, each host a network namespace on this
# machine (its own network stack, host name and /dev/shm) joined to the other by a veth pair,
# 2 ranks per host, all started by Open MPI's mpirun (tests/launch/netns_rsh.sh is the rsh agent
# that enters the second namespace). In alternating rounds (the order rotates), every round runs:
#   ddp        ddp-bench, backend::Host, hierarchical all_reduce (automatic: slices)
#   leaders    the same with DDP_HIERARCHY=leaders
#   flat       the same with DDP_HIERARCHY=flat: every rank on the TCP mesh
#   tuned      mpi-bench, --mca btl self,vader,tcp, Open MPI's default collectives (tuned); like
#              every Open MPI run here with mpi_yield_when_idle (4 ranks on 2 cores: without it
#              its busy-polling ranks starve each other, 4 ms for 4 bytes)
#   han        mpi-bench, the same with the hierarchical HAN collectives (coll_han_priority 100;
#              without vader's single-copy, with which HAN crashes in vader here)
# and reports, per size, the median over the rounds of each round's time ratio (compare.py).
#   bench/hosts.sh                   8 rounds, 4 B-64 MiB
#   ROUNDS=4 MAX_BYTES=4M bench/hosts.sh
# Needs root (ip netns, mount), iproute2, Open MPI (openmpi-bin, libopenmpi-dev), cmake, ninja.
# Results (CSV per run, markdown tables, an SVG plot) go to build/bench-results/hosts/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/bench-results/hosts
mkdir -p "$out"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF \
  -DDDP_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build/release --target ddp-bench mpi-bench >/dev/null
rounds=${ROUNDS:-8}
sizes=(-b "${MIN_BYTES:-4}" -e "${MAX_BYTES:-64M}" -f 4)

a=ddpbench$$a b=ddpbench$$b addr_a=10.232.0.1 addr_b=10.232.0.2
# shellcheck source=bench/netns_pair.sh
. bench/netns_pair.sh
netns_pair "$a" "$b" "$addr_a" "$addr_b"

export DDP_NETNS_HOSTS="$addr_a=$a,$addr_b=$b"
port=29700
mpirun() {  # mpirun across the two namespaces, 2 ranks each; then mpirun's own arguments
  ip netns exec "$a" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$a" \
    mpirun --allow-run-as-root --host "$addr_a:2,$addr_b:2" -np 4 \
    --mca plm_rsh_agent "$PWD/tests/launch/netns_rsh.sh" --mca btl self,vader,tcp \
    --mca btl_tcp_if_include "$addr_a/24" --mca oob_tcp_if_include "$addr_a/24" "$@"
}
run_ddp() {  # run_ddp LABEL HIERARCHY CSV
  port=$((port + 1))
  mpirun -x MASTER_ADDR="$addr_a" -x MASTER_PORT="$port" -x DDP_HIERARCHY="$2" \
    "$PWD/build/release/tools/ddp-bench" "${sizes[@]}" --label "$1" --csv "$3" >/dev/null
}
run_mpi() {  # run_mpi LABEL CSV [mpirun arguments]
  local label=$1 csv=$2
  shift 2
  mpirun --mca mpi_yield_when_idle 1 "$@" "$PWD/build/release/bench/mpi-bench" "${sizes[@]}" --label "$label" --csv "$csv" \
    >/dev/null
}
kinds=(ddp leaders flat tuned ${HAN:+han})  # HAN=1: also HAN (it crashed here, bench/README.md)
run_kind() {  # run_kind KIND ROUND
  local csv="$out/$1-$2.csv"
  case $1 in
    ddp) run_ddp "ddp slices" auto "$csv" ;;
    leaders) run_ddp "ddp leaders" leaders "$csv" ;;
    flat) run_ddp "ddp flat" flat "$csv" ;;
    tuned) run_mpi "Open MPI tuned" "$csv" ;;
    han) run_mpi "Open MPI HAN" "$csv" --mca coll_han_priority 100 \
           --mca btl_vader_single_copy_mechanism none ;;  # HAN with CMA crashes in vader here
  esac
}
echo "== $(date -u +%F) on $(nproc) CPUs, 2 hosts x 2 ranks (network namespaces), $rounds rounds"
for round in $(seq 1 "$rounds"); do
  n=${#kinds[@]}
  for i in $(seq 0 $((n - 1))); do run_kind "${kinds[$(((i + round) % n))]}" "$round"; done
done
files() { for r in $(seq 1 "$rounds"); do echo "$out/$1-$r.csv"; done; }
for peer in flat leaders tuned ${HAN:+han}; do
  echo "== all_reduce, float32 sum, 2 hosts x 2 ranks: ddp (slices) against $peer"
  # shellcheck disable=SC2046
  python3 bench/compare.py $(files ddp) -- $(files "$peer") | tee "$out/compare-$peer.md"
done
plot_with=()
for peer in flat tuned; do plot_with+=(--compare "$out/$peer-1.csv"); done
mpirun -x MASTER_ADDR="$addr_a" -x MASTER_PORT=$((port + 1)) \
  "$PWD/build/release/tools/ddp-bench" "${sizes[@]}" --iters 5 --label "ddp slices" \
  --plot "$out/busbw-hosts.svg" "${plot_with[@]}" >/dev/null
