#!/usr/bin/env bash
# PowerSGD where the wire is the bottleneck: two "hosts" (network namespaces on this machine,
# joined by a veth pair whose both ends tc limits to RATE, default 1gbit), one rank each,
# running torch-bench's libtorch MLP step with fp32 all_reduce and with ddp::PowerSGDHook, in
# alternating rounds; prints the median ms/step of each and the median of the per-round ratios.
#   bench/torch/powersgd_wire.sh build/default/bench/torch-bench
#   RATE=10gbit ROUNDS=5 STEPS=20 HIDDEN=2048 PSGD_RANK=4 bench/torch/powersgd_wire.sh BENCH
# Needs root (ip netns, tc) and iproute2.
set -euo pipefail
bench=$(realpath "${1:?usage: powersgd_wire.sh TORCH_BENCH}")
rate=${RATE:-1gbit} rounds=${ROUNDS:-5} steps=${STEPS:-20} hidden=${HIDDEN:-2048}
psgd_rank=${PSGD_RANK:-4}
a=psgd$$a b=psgd$$b addr_a=10.233.0.1 addr_b=10.233.0.2
# shellcheck source=bench/netns_pair.sh
. "$(dirname "$0")/../netns_pair.sh"
netns_pair "$a" "$b" "$addr_a" "$addr_b"
for ns in "$a" "$b"; do
  ip netns exec "$ns" tc qdisc add dev "${ns}v" root tbf rate "$rate" burst 256kb latency 50ms
done

one() {  # one run of hook $1: prints its ms/step
  local port=$((20000 + RANDOM % 20000)) out
  local envs=(MASTER_ADDR=$addr_a MASTER_PORT=$port WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 LOCAL_RANK=0
              OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1)
  ip netns exec "$b" env "${envs[@]}" RANK=1 "$bench" --model mlp --mode hooks --hidden "$hidden" \
    --steps "$steps" --hook "$1" --psgd-rank "$psgd_rank" >/dev/null &
  out=$(ip netns exec "$a" env "${envs[@]}" RANK=0 "$bench" --model mlp --mode hooks \
    --hidden "$hidden" --steps "$steps" --hook "$1" --psgd-rank "$psgd_rank")
  wait
  echo "$out" | sed -n 's/.*ms\/step \([0-9.]*\).*/\1/p'
  echo "$out" | grep '^wire:' >&2
}

fp32=() psgd=()
for ((r = 0; r < rounds; r++)); do
  if ((r % 2 == 0)); then
    fp32+=("$(one fp32 2>/dev/null)") psgd+=("$(one powersgd 2>/dev/null)")
  else
    psgd+=("$(one powersgd 2>/dev/null)") fp32+=("$(one fp32 2>/dev/null)")
  fi
  echo "round $((r + 1)): fp32 ${fp32[-1]} ms/step, powersgd ${psgd[-1]} ms/step"
done
one powersgd 2>&1 >/dev/null | sed 's/^/powersgd /'
python3 - "$rate" "$hidden" "$psgd_rank" "${fp32[*]}" "${psgd[*]}" <<'EOF'
import statistics, sys
rate, hidden, rank = sys.argv[1:4]
f = [float(x) for x in sys.argv[4].split()]
p = [float(x) for x in sys.argv[5].split()]
print(f"MLP 784-{hidden}-{hidden}-10, 2 hosts joined at {rate}, one rank each:")
print(f"  fp32 all_reduce {statistics.median(f):.1f} ms/step, PowerSGD rank {rank} "
      f"{statistics.median(p):.1f} ms/step, ratio (median of rounds) "
      f"{statistics.median(a / b for a, b in zip(p, f)):.2f}")
EOF
