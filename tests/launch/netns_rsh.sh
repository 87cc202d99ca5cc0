#!/bin/sh
# ddp — header-only C++20 distributed data-parallel toolkit
# SPDX-License-Identifier: MIT
# An rsh agent for Open MPI's mpirun (--mca plm_rsh_agent) whose "hosts" are network namespaces
# on this machine: `netns_rsh.sh HOST COMMAND...` runs COMMAND in the namespace that
# DDP_NETNS_HOSTS ("ADDR=NAMESPACE,ADDR=NAMESPACE") maps HOST to. Used by the multi-node mpirun
# tests in test_ddprun.py. Needs root (ip netns, unshare, mount).
host=$1
shift
ns=$(printf '%s\n' "$DDP_NETNS_HOSTS" | tr ',' '\n' | sed -n "s/^$host=//p")
if [ -z "$ns" ]; then
  echo "netns_rsh.sh: no namespace for host $host in DDP_NETNS_HOSTS=$DDP_NETNS_HOSTS" >&2
  exit 255
fi
# A host of its own name and /dev/shm too: Open MPI tells hosts apart by name (two hosts both
# called like this machine crash its ob1 PML) and names its shared-memory segments by host name
# and local rank.
exec ip netns exec "$ns" unshare --mount --uts /bin/sh -c \
  "hostname $ns && mount -t tmpfs -o size=2g tmpfs /dev/shm && $*"
