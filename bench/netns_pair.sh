# Sourced by the benchmarks that play two hosts on one machine (bench/hosts.sh,
# bench/torch/powersgd_wire.sh): netns_pair A B ADDR_A ADDR_B makes network namespaces A and B
# joined by a veth pair (A's end is "Av", B's "Bv", addresses ADDR_A/24 and ADDR_B/24) and
# removes them when the script exits. Needs root and iproute2.
netns_pair() {
  local a=$1 b=$2
  trap "ip netns del '$a' 2>/dev/null || true; ip netns del '$b' 2>/dev/null || true" EXIT
  ip netns add "$a"
  ip netns add "$b"
  ip link add "${a}v" netns "$a" type veth peer name "${b}v" netns "$b"
  ip -n "$a" addr add "$3/24" dev "${a}v"
  ip -n "$b" addr add "$4/24" dev "${b}v"
  for ns in "$a" "$b"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "${ns}v" up
  done
}
