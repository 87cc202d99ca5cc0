#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests that run ddp programs under the real
# srun (Debian's slurm-wlm and munge; root). Its configuration and state live in DIR (default
# build/slurm); /etc/slurm is not touched.
#
#   scripts/slurm.sh start [DIR]   writes DIR/slurm.conf, starts munged, slurmctld and slurmd,
#                                  waits until the node is idle; prints "export SLURM_CONF=..."
#   scripts/slurm.sh stop [DIR]    stops the daemons this script started
#
# The daemons take Slurm's ports (6817, 6818) when they are free, else free ones; both are printed
# on stderr, and DDP_SLURMCTLD_PORT / DDP_SLURMD_PORT choose them.
#
# Then: SLURM_CONF=DIR/slurm.conf srun -N1 -n4 ./program
# The node (named as this host, so that SLURM_JOB_NODELIST resolves) claims 8 CPUs (whatever the machine has), so that 4-task steps fit on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
dir=$(realpath -m "${2:-build/slurm}")
conf="$dir/slurm.conf"

# A port for a daemon: $1 when set (DDP_SLURMCTLD_PORT, DDP_SLURMD_PORT), else Slurm's default
# $2 when nothing listens there, else one the kernel says is free (a cluster already running here
# keeps its ports).
pick_port() {
  if [ -n "$1" ]; then echo "$1"; return; fi
  python3 - "$2" <<'PY'
import socket, sys
for port in (int(sys.argv[1]), 0):
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            continue
        print(s.getsockname()[1])
        break
PY
}

stop() {
  for d in slurmd slurmctld; do
    [ -f "$dir/$d.pid" ] && kill "$(cat "$dir/$d.pid")" 2>/dev/null || true
  done
  [ -f "$dir/munged.pid" ] && kill "$(cat "$dir/munged.pid")" 2>/dev/null || true
  sleep 0.5
  rm -f "$dir"/*.pid
}

case "$cmd" in
  start)
    if [ "$(id -u)" -ne 0 ]; then
      echo "scripts/slurm.sh: needs root (slurmd runs jobs as their users)" >&2
      exit 1
    fi
    for tool in munged slurmctld slurmd srun sinfo; do
      command -v "$tool" >/dev/null || { echo "scripts/slurm.sh: $tool not found (apt-get install slurm-wlm munge)" >&2; exit 1; }
    done
    stop
    mkdir -p "$dir/state" "$dir/slurmd" "$dir/munge"
    # munge: a key of this cluster's own, its socket in DIR (not the system's munged).
    if [ ! -s "$dir/munge/munge.key" ]; then
      dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 700 "$dir/munge"
    chmod 400 "$dir/munge/munge.key"
    socket="$dir/munge/munge.socket"
    munged --force --key-file="$dir/munge/munge.key" --socket="$socket" \
      --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"
    ctld_port=$(pick_port "${DDP_SLURMCTLD_PORT:-}" 6817)
    slurmd_port=$(pick_port "${DDP_SLURMD_PORT:-}" 6818)
    if [ "$slurmd_port" = "$ctld_port" ]; then slurmd_port=$(pick_port "" 0); fi
    echo "scripts/slurm.sh: slurmctld on port $ctld_port, slurmd on port $slurmd_port (DDP_SLURMCTLD_PORT, DDP_SLURMD_PORT choose them)" >&2
    cat >"$conf" <<CONF
# written by scripts/slurm.sh: a one-node cluster for ddp's tests
ClusterName=ddptest
SlurmctldHost=localhost(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket=$socket
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmdSpoolDir=$dir/slurmd
StateSaveLocation=$dir/state
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$(hostname -s) NodeAddr=127.0.0.1 CPUs=8 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$(hostname -s) Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    export SLURM_CONF="$conf"
    slurmctld -f "$conf" -i
    slurmd -f "$conf"
    for _ in $(seq 1 100); do
      if sinfo -h -o %t 2>/dev/null | grep -q idle; then
        echo "export SLURM_CONF=$conf"
        exit 0
      fi
      sleep 0.2
    done
    echo "scripts/slurm.sh: the node did not come up; logs:" >&2
    tail -20 "$dir/slurmctld.log" "$dir/slurmd.log" "$dir/munged.log" >&2 || true
    stop
    exit 1
    ;;
  stop) stop ;;
  *)
    echo "usage: scripts/slurm.sh start|stop [DIR]" >&2
    exit 2
    ;;
esac
