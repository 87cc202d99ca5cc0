#!/usr/bin/env python3
# ddp — header-only C++20 distributed data-parallel toolkit
# SPDX-License-Identifier: MIT
"""What an operator gets wrong, tried across real processes started by hand (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set per process, as a user of a batch system would) or under ddprun:
disagreeing world sizes, a rank started twice, the store host killed mid-rendezvous, a bad
setting on one rank, shared memory left behind, a /dev/shm too small, ddprun killed with SIGKILL.

DDPRUN=path/to/ddprun WORKER=path/to/ddp-launch-worker python3 tests/launch/test_outsider.py"""

import glob
import os
import shutil
import signal
import socket
import subprocess
import time
import unittest

from test_ddprun import DDPRUN, LIMIT, WORKER, Base, free_port, wait_for_files


def start_rank(rank, world, port, *args, env=None, transport="tcp", timeout_s=30):
    """One worker process of a job started by hand."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("DDP_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI"))}
    e.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(port), DDP_TIMEOUT=str(timeout_s), DDP_HOST_TRANSPORT=transport)
    e.update(env or {})
    return subprocess.Popen([WORKER, *args], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs, limit=LIMIT):
    """(returncode, stdout, stderr, seconds) of each process, in order."""
    t0 = time.monotonic()
    out = []
    for p in procs:
        o, e = p.communicate(timeout=limit)
        out.append((p.returncode, o, e, time.monotonic() - t0))
    return out


def shm_entries():
    return set(glob.glob("/dev/shm/ddp-*"))


def hold_ports(first, count):
    """Listening sockets on first .. first + count - 1, or None when one of them is taken."""
    held = []
    for port in range(first, first + count):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            s.close()
            for h in held:
                h.close()
            return None
        held.append(s)
    return held


class ByHand(Base):
    def test_world_size_disagreement_fails_every_rank(self):
        # Rank 0 believes in 3 ranks, the others in 4: before, rank 0 finished "successfully"
        # with a 3-rank sum (and ranks 1, 2 sometimes with a 4-rank one).
        for transport in ("tcp", "shm"):
            with self.subTest(transport=transport):
                port = free_port()
                procs = [start_rank(r, 3 if r == 0 else 4, port, "allreduce", transport=transport)
                         for r in range(4)]
                results = finish(procs)
                for r, (code, out, err, secs) in enumerate(results):
                    self.assertNotEqual(code, 0, f"rank {r} succeeded: {out}")
                    self.assertNotIn("sum ok", out)
                    self.assertIn("the ranks disagree on the world size", err, f"rank {r}")
                    self.assertRegex(err, r"has 3\b.*has 4\b|has 4\b.*has 3\b")
                    self.assertLess(secs, 20, f"rank {r} took {secs:.1f} s")

    def test_store_host_does_not_wait_for_ranks_that_never_came(self):
        # Rank 3 believes in 5 ranks: rank 4 never exists, and rank 0 (the store) must not wait
        # for it after the rendezvous failed.
        port = free_port()
        procs = [start_rank(r, 5 if r == 3 else 4, port, "allreduce", timeout_s=20)
                 for r in range(4)]
        for r, (code, _, err, secs) in enumerate(finish(procs)):
            self.assertNotEqual(code, 0)
            self.assertIn("disagree on the world size", err)
            self.assertLess(secs, 5, f"rank {r} took {secs:.1f} s")

    def test_a_port_held_by_another_program_is_named(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            p = start_rank(1, 2, port, "allreduce", timeout_s=20)
            conn, _ = s.accept()
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + os.urandom(64))
            _, err = p.communicate(timeout=LIMIT)
            conn.close()
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("rank 1: rendezvous store at", err)
        self.assertIn("is not a ddp store", err)

    def test_a_taken_store_port_names_ddps_store_and_the_variable(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            cases = [
                ({}, port, [f"takes MASTER_PORT = {port};", "or choose another MASTER_PORT"]),
                # torchrun's agent serves its store on MASTER_PORT: ddp's takes the next port.
                ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none"},
                 port - 1, [f"takes MASTER_PORT + 1 = {port} under torchrun (torchrun's agent "
                            f"serves its own store on MASTER_PORT {port - 1})"]),
                ({"DDP_STORE_PORT": str(port)}, port - 2, [f"takes DDP_STORE_PORT = {port};"]),
            ]
            for env, master_port, needles in cases:
                with self.subTest(env=env):
                    # Under torchrun rank 0 moves on to the 7 ports after MASTER_PORT + 1: all
                    # eight taken, it fails.
                    torchrun = "TORCHELASTIC_USE_AGENT_STORE" in env
                    held = hold_ports(port + 1, 7) if torchrun else []
                    if torchrun and held is None:
                        continue  # a neighbour of the port is someone else's: nothing to test
                    try:
                        p = start_rank(0, 2, master_port, "allreduce", env=env, timeout_s=10)
                        _, err = p.communicate(timeout=LIMIT)
                    finally:
                        for h in held or []:
                            h.close()
                    self.assertNotEqual(p.returncode, 0, err)
                    self.assertIn(f"rank 0: cannot host ddp's rendezvous store at 127.0.0.1:{port}"
                                  + (" (nor on the 7 ports after it)" if torchrun else "")
                                  + ": the port is in use", err)
                    self.assertIn("Set DDP_STORE_PORT to a free port (the same on every rank)", err)
                    for needle in needles:
                        self.assertIn(needle, err)
                    if env:
                        self.assertNotIn("choose another MASTER_PORT", err)

    def test_a_rank_started_twice_is_named_and_the_job_is_unharmed(self):
        for world, ranks in ((2, [0, 1, 1]), (3, [0, 1, 1, 2])):
            with self.subTest(ranks=ranks):
                port = free_port()
                # The job holds on for a while, so the second claimant meets a running store.
                procs = [start_rank(r, world, port, "allreduce", env={"WORKER_HOLD_MS": "1500"})
                         for r in ranks]
                results = finish(procs)
                failed = [(code, err) for code, _, err, _ in results if code != 0]
                self.assertEqual(len(failed), 1, results)
                self.assertIn("rank 1 of group \"default\" is already taken by pid", failed[0][1])
                self.assertIn("started with the same RANK", failed[0][1])
                ok = [out for code, out, _, _ in results if code == 0]
                self.assertEqual(len(ok), world, results)
                for out in ok:
                    self.assertIn("sum ok", out)

    def test_store_host_killed_in_rendezvous_is_reported_at_once(self):
        # Rank 3 never starts, so 1 and 2 wait in the rendezvous; then rank 0 (the store) dies.
        port = free_port()
        procs = [start_rank(r, 4, port, "allreduce", timeout_s=30) for r in range(3)]
        wait_for_listening(port)
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for p in procs[1:]:
            _, err = p.communicate(timeout=LIMIT)
            self.assertNotEqual(p.returncode, 0)
            self.assertLess(time.monotonic() - killed, 2.0, err)
            self.assertIn("store", err)
        procs[0].communicate()

    def test_a_bad_setting_on_one_rank_fails_the_others_at_once(self):
        port = free_port()
        procs = [start_rank(r, 4, port, "allreduce", timeout_s=60,
                            env={"DDP_SEGMENT_BYTES": "-1"} if r == 2 else None)
                 for r in range(4)]
        results = finish(procs)
        for r, (code, _, err, secs) in enumerate(results):
            self.assertNotEqual(code, 0)
            self.assertIn("DDP_SEGMENT_BYTES", err, f"rank {r}")
            self.assertLess(secs, 10, f"rank {r} took {secs:.1f} s (timeout 60 s)")

    def test_segment_sizes_that_differ_are_named(self):
        port = free_port()
        procs = [start_rank(r, 2, port, "allreduce", transport="shm",
                            env={"DDP_SEGMENT_BYTES": str(65536 * (r + 1))}) for r in range(2)]
        for r, (code, _, err, _) in enumerate(finish(procs)):
            self.assertNotEqual(code, 0)
            self.assertIn("disagree on the segment size", err)
            self.assertNotRegex(err, r"rank (\d+): rank \1: ")  # a relayed reason names its rank once
            self.assertIn("65536", err)
            self.assertIn("131072", err)

    def test_largest_segment_size_starts_quickly_on_shm(self):
        port = free_port()
        t0 = time.monotonic()
        procs = [start_rank(r, 4, port, "allreduce", transport="shm",
                            env={"DDP_SEGMENT_BYTES": str(1 << 40)}) for r in range(4)]
        for r, (code, out, err, _) in enumerate(finish(procs)):
            self.assertEqual(code, 0, err)
            self.assertIn("transport shm", out)
        self.assertLess(time.monotonic() - t0, 20)


def wait_for_listening(port, within=20):
    until = time.monotonic() + within
    hexport = f":{port:04X}"
    while time.monotonic() < until:
        with open("/proc/net/tcp") as f:
            if any(hexport in line.split()[1] and line.split()[3] == "0A" for line in f
                   if len(line.split()) > 3):
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


class Leftovers(Base):
    def test_no_shared_memory_left_when_a_rank_exits_right_after_init(self):
        before = shm_entries()
        for _ in range(6):
            r = subprocess.run([DDPRUN, "--standalone", "--nproc-per-node", "4", WORKER,
                                "init-exit", "1", "1"], capture_output=True, text=True,
                               timeout=LIMIT)
            self.assertNotEqual(r.returncode, 0)
        self.assertEqual(shm_entries() - before, set())

    def test_sigkill_of_ddprun_takes_everything_the_workers_started(self):
        # An environment larger than any buffer: the job's tag comes after 70,000 bytes.
        env = dict(os.environ, AAAA="x" * 70000)
        p = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "2", WORKER,
                              "descendants", self.dir], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        names = [f"{self.dir}/{k}.{r}" for k in ("pid", "bg", "daemon") for r in range(2)]
        pids = wait_for_files(names, p)
        p.kill()
        p.communicate(timeout=LIMIT)
        self.assertGone(pids)


@unittest.skipUnless(shutil.which("unshare") and os.geteuid() == 0,
                     "needs root and unshare(1) for a private, small /dev/shm")
class SmallShm(Base):
    def run_in_small_shm(self, *args, env=None):
        e = dict(os.environ)
        e.update(env or {})
        script = ("mount -t tmpfs -o size=4m tmpfs /dev/shm && exec " +
                  " ".join([DDPRUN, "--standalone", "--nproc-per-node", "4", WORKER, *args]))
        r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                           text=True, env=e, timeout=LIMIT)
        if "mount" in r.stderr and "permission" in r.stderr.lower():
            self.skipTest("mounting a tmpfs is not permitted here")
        return r

    def test_too_small_dev_shm_falls_back_to_tcp_with_one_warning(self):
        r = self.run_in_small_shm("allreduce")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("transport tcp"), 4, r.stdout)
        self.assertEqual(r.stderr.count("using the tcp transport instead"), 1, r.stderr)
        self.assertIn("/dev/shm has", r.stderr)

    def test_too_small_dev_shm_with_shm_forced_is_a_clear_error(self):
        r = self.run_in_small_shm("allreduce", env={"DDP_HOST_TRANSPORT": "shm"})
        self.assertNotEqual(r.returncode, 0)
        self.assertNotIn("Bus error", r.stderr)
        self.assertIn("the shm transport cannot start: /dev/shm has", r.stderr)
        self.assertIn("needs", r.stderr)


if __name__ == "__main__":
    unittest.main()
