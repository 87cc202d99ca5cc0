#!/usr/bin/env python3
# ddp — header-only C++20 distributed data-parallel toolkit
# SPDX-License-Identifier: MIT
"""A real etcd cluster for the tests: N members (etcd-server, Debian's 3.4) on loopback or on
given addresses, with short Raft timings (50 ms heartbeat, 500 ms election), so that losing a
member, the leader included, costs under a second.

    with EtcdCluster(3) as etcd:
        env["DDP_STORE"] = etcd.url("my-namespace")
        etcd.kill(0)            # SIGKILL a member

Skipped (available() is False) without the etcd binary."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request


def available():
    return shutil.which("etcd") is not None


def _free_port(addr="127.0.0.1"):
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class EtcdCluster:
    def __init__(self, members=3, addrs=None, wrap=None):
        """`addrs[i]`: member i's address (default loopback); `wrap(i)`: a command prefix for
        member i (e.g. ["ip", "netns", "exec", NAME]) to run it elsewhere."""
        self.n = members
        self.addrs = addrs or ["127.0.0.1"] * members
        self.wrap = wrap or (lambda i: [])
        self.dir = tempfile.mkdtemp(prefix="ddp-etcd-")
        self.client = [_free_port() for _ in range(members)]
        self.peer = [_free_port() for _ in range(members)]
        self.procs = [None] * members
        self.logs_open = []

    def endpoints(self, members=None):
        return ",".join(f"{self.addrs[i]}:{self.client[i]}"
                        for i in (members if members is not None else range(self.n)))

    def url(self, namespace, members=None):
        return f"etcd://{self.endpoints(members)}/{namespace}"

    def __enter__(self):
        initial = ",".join(f"m{i}=http://{self.addrs[i]}:{self.peer[i]}" for i in range(self.n))
        for i in range(self.n):
            log = open(os.path.join(self.dir, f"m{i}.log"), "w")
            self.logs_open.append(log)
            self.procs[i] = subprocess.Popen(
                [*self.wrap(i), "etcd", "--name", f"m{i}", "--data-dir",
                 os.path.join(self.dir, f"m{i}"),
                 "--listen-client-urls", f"http://{self.addrs[i]}:{self.client[i]}",
                 "--advertise-client-urls", f"http://{self.addrs[i]}:{self.client[i]}",
                 "--listen-peer-urls", f"http://{self.addrs[i]}:{self.peer[i]}",
                 "--initial-advertise-peer-urls", f"http://{self.addrs[i]}:{self.peer[i]}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", os.path.basename(self.dir),
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout=30):
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            ok = 0
            for i in range(self.n):
                if self.procs[i] is None or self.procs[i].poll() is not None:
                    continue
                url = f"http://{self.addrs[i]}:{self.client[i]}/health"
                if self.wrap(i):  # in another network namespace: ask from there
                    r = subprocess.run([*self.wrap(i), "python3", "-c",
                                        f"import urllib.request as u; print(u.urlopen('{url}', "
                                        "timeout=1).read().decode())"],
                                       capture_output=True, text=True)
                    ok += '"true"' in r.stdout
                    continue
                try:
                    with urllib.request.urlopen(url, timeout=1) as r:
                        ok += b'"true"' in r.read()
                except OSError:
                    pass
            if ok == sum(p is not None and p.poll() is None for p in self.procs) and ok > 0:
                return
            time.sleep(0.1)
        raise RuntimeError("the etcd cluster did not become healthy: " + self.logs())

    def kill(self, i, sig=signal.SIGKILL):
        os.killpg(self.procs[i].pid, sig)
        self.procs[i].wait()
        self.procs[i] = None

    def logs(self):
        out = ""
        for i in range(self.n):
            p = os.path.join(self.dir, f"m{i}.log")
            if os.path.exists(p):
                with open(p) as f:
                    out += f"--- m{i}\n" + f.read()[-2000:]
        return out

    def __exit__(self, *exc):
        for i, p in enumerate(self.procs):
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for log in self.logs_open:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
