#!/usr/bin/env python3
# ddp — header-only C++20 distributed data-parallel toolkit
# SPDX-License-Identifier: MIT
"""ddprun across real processes: DDPRUN=path/to/ddprun WORKER=path/to/ddp-launch-worker
python3 tests/launch/test_ddprun.py [-v] [TestCase.test_name ...]

The multi-node cases run two ddprun "nodes" in two network namespaces joined by a veth pair; they
need root (ip netns) and are skipped with a message otherwise."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

DDPRUN = os.environ.get("DDPRUN", "build/default/tools/ddprun")
WORKER = os.environ.get("WORKER", "build/default/tools/ddp-launch-worker")
TRACE_TOOL = os.environ.get("DDP_TRACE_TOOL", "build/default/tools/ddp-trace")
LIMIT = 60  # seconds any single ddprun may take before the test fails (instead of hanging)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    """Whether pid is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ddprun(*args, timeout=LIMIT, **kw):
    return subprocess.run([DDPRUN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def read_int(path):
    with open(path) as f:
        return int(f.read())


def wait_for_files(paths, proc=None, timeout=20):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if all(os.path.exists(p) and os.path.getsize(p) > 0 for p in paths):
            return [read_int(p) for p in paths]
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"ddprun ended early ({proc.returncode}): {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {paths}")


def listening_addresses(pids):
    """The local addresses of the TCP sockets the processes `pids` listen on, read from
    /proc/net/tcp and /proc/net/tcp6 (state 0A) and matched to the processes by socket inode."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    address, port = cols[1].split(":")
                    found.append((family, address, int(port, 16)))
    return found


def tmpfs_unavailable(path):
    """Why a small tmpfs cannot be mounted on `path` in a private mount namespace here (unshare -m
    needs root, or a kernel and container that allow it), or None when it can."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k none "$0"', path],
                       capture_output=True, text=True, timeout=LIMIT)
    if r.returncode != 0:
        return f"cannot mount a tmpfs under unshare -m: {r.stderr.strip() or r.returncode}"
    return None


def ddprun_on_small_tmpfs(mount, saved, *args):
    """ddprun *args with a 64 KiB tmpfs mounted on `mount` (visible to ddprun and its workers
    only); what it holds at the end is copied to `saved`."""
    script = ('m=$1 s=$2; shift 2; mount -t tmpfs -o size=64k none "$m" || exit 99; "$@"; rc=$?; '
              'cp -R "$m"/. "$s"; exit $rc')
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", mount, saved, DDPRUN,
                           *map(str, args)], capture_output=True, text=True, timeout=LIMIT)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def sha256(data):
    import hashlib
    return f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}"


class Base(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ddprun-test-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def assertGone(self, pids, within=5.0):
        until = time.monotonic() + within
        while any(alive(p) for p in pids) and time.monotonic() < until:
            time.sleep(0.05)
        self.assertEqual([p for p in pids if alive(p)], [], "processes left behind")


class SingleNode(Base):
    def test_workers_1_2_4(self):
        for n in (1, 2, 4):
            r = ddprun("--standalone", "--nproc-per-node", n, WORKER, "allreduce")
            self.assertEqual(r.returncode, 0, r.stderr)
            lines = sorted(r.stdout.splitlines())
            self.assertEqual(len(lines), n, r.stdout)
            for rank, line in enumerate(lines):
                m = re.fullmatch(rf"\[r{rank}\] rank {rank}/{n} local {rank}/{n} node 0 launcher "
                                 r"ddprun transport (\w+) restart 0 sum ok", line)
                self.assertIsNotNone(m, line)
                self.assertEqual(m.group(1), "self" if n == 1 else "shm")

    def test_torch_style_flags_and_fixed_port(self):
        port = free_port()
        r = ddprun(f"--nproc_per_node=2", f"--master_port={port}", "--master_addr", "127.0.0.1",
                   "--node_rank=0", WORKER, "allreduce")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(r.stdout.splitlines()), 2)

    def test_environment_of_the_workers(self):
        r = ddprun("--standalone", "--nproc-per-node", 2, "sh", "-c",
                   "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $NODE_RANK $GROUP_RANK "
                   "$MASTER_ADDR $DDP_RESTART_COUNT $DDP_STORE_HOSTED $DDP_LAUNCHER "
                   "$DDP_OUTPUT_PREFIXED")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()),
                         ["[r0] 0 2 0 2 0 0 127.0.0.1 0 1 ddprun 1",
                          "[r1] 1 2 1 2 0 0 127.0.0.1 0 1 ddprun 1"])
        # Without the prefix, ddp::Logger is told nothing: it prefixes its lines itself.
        r = ddprun("--standalone", "--no-prefix", "sh", "-c", "echo x${DDP_OUTPUT_PREFIXED}x")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.splitlines(), ["xx"])

    def test_torchrun_worker_variables(self):
        r = ddprun("--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "sh", "-c",
                   "echo $GROUP_WORLD_SIZE $ROLE_NAME $ROLE_RANK $ROLE_WORLD_SIZE "
                   "$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_RUN_ID")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()),
                         ["[r0] 1 default 0 2 0 1 none", "[r1] 1 default 1 2 0 1 none"])

    def test_python_programs_as_torchrun_runs_them(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "prog.py"), "w") as f:  # not executable: run with python
                f.write("import os\nprint('py', os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
            r = ddprun("--standalone", "--nproc-per-node", 2, os.path.join(d, "prog.py"))
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(sorted(r.stdout.splitlines()), ["[r0] py 0 2", "[r1] py 1 2"])
            # -m runs a module; --rdzv-endpoint is --master-addr and --master-port in one.
            r = ddprun("--nproc_per_node", 2, "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
                       "-m", "prog", cwd=d)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(sorted(r.stdout.splitlines()), ["[r0] py 0 2", "[r1] py 1 2"])
            # --no-python runs the file itself (not executable here: the exec fails, named).
            r = ddprun("--standalone", "--no-python", os.path.join(d, "prog.py"))
            self.assertEqual(r.returncode, 127)
            self.assertIn("Permission denied", r.stderr)

    def test_nproc_cpu(self):
        r = ddprun("--standalone", "--nproc-per-node", "cpu", "sh", "-c", "echo $WORLD_SIZE")
        self.assertEqual(r.returncode, 0, r.stderr)
        n = len(os.sched_getaffinity(0))
        self.assertEqual(sorted(r.stdout.splitlines()), [f"[r{i}] {n}" for i in range(n)])

    def test_nproc_gpu_without_gpus(self):
        r = ddprun("--standalone", "--nproc-per-node", "gpu", "true",
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        self.assertEqual(r.returncode, 2)
        self.assertIn("no CUDA device is visible", r.stderr)
        r = ddprun("--standalone", "--nproc-per-node", "gpu", "sh", "-c", "echo $LOCAL_RANK",
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(r.stdout.splitlines()), 3)

    def test_lines_are_prefixed_and_never_interleaved(self):
        n_lines = 400
        r = ddprun("--standalone", "--nproc-per-node", 4, WORKER, "lines", n_lines)
        self.assertEqual(r.returncode, 0, r.stderr)
        for stream, parity in ((r.stdout, 0), (r.stderr, 1)):
            counts = {}
            for line in stream.splitlines():
                m = re.fullmatch(r"\[r(\d)\] rank (\d) line (\d+) (x+) end", line)
                self.assertIsNotNone(m, f"mangled line: {line[:120]}")
                self.assertEqual(m.group(1), m.group(2))
                i = int(m.group(3))
                self.assertEqual(i % 2, parity)
                self.assertEqual(len(m.group(4)), 100 + i % 900)
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
            self.assertEqual(counts, {str(k): n_lines // 2 for k in range(4)})

    def test_no_prefix_and_log_dir(self):
        logs = os.path.join(self.dir, "logs")
        r = ddprun("--standalone", "--nproc-per-node", 2, "--no-prefix", "--log-dir", logs,
                   "sh", "-c", "echo out $RANK; echo err $RANK >&2; printf tail")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()), ["out 0", "out 1", "tail", "tail"])
        for rank in (0, 1):
            with open(os.path.join(logs, "attempt_0", f"rank_{rank}.log")) as f:
                self.assertEqual(sorted(f.read().splitlines()),
                                 sorted([f"out {rank}", f"err {rank}", "tail"]))
        # A last line without its newline waits for the other stream's end, never glued to it.
        r = ddprun("--standalone", "--nproc-per-node", 1, "--no-prefix", "--log-dir", logs,
                   "sh", "-c", "printf tail; exec 1>&-; sleep 0.3; echo err >&2; echo more >&2")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(logs, "attempt_0", "rank_0.log")) as f:
            self.assertEqual(f.read(), "err\nmore\ntail")
        # Without --log-dir or a prefix, the workers write to ddprun's own stdout.
        r = ddprun("--standalone", "--nproc-per-node", 2, "--no-prefix", "sh", "-c", "echo $RANK")
        self.assertEqual(sorted(r.stdout.splitlines()), ["0", "1"])

    def test_redirects_tee_and_local_ranks_filter(self):
        prog = ["sh", "-c", "echo out $RANK; echo err $RANK >&2"]
        logs = os.path.join(self.dir, "logs")

        def log(rank, attempt=0, where=logs):
            path = os.path.join(where, f"attempt_{attempt}", f"rank_{rank}.log")
            if not os.path.exists(path):
                return None
            with open(path) as f:
                return sorted(f.read().splitlines())

        # -r 1: stdout to the log file only, stderr to the console only (as torchrun).
        r = ddprun("--standalone", "--nproc-per-node", 2, "-r", 1, "--log-dir", logs, *prog)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertEqual(sorted(line for line in r.stderr.splitlines() if line.startswith("[r")),
                         ["[r0] err 0", "[r1] err 1"])
        self.assertEqual([log(0), log(1)], [["out 0"], ["out 1"]])
        # -t 3 with a filter: both streams to console and log, rank 1 only in its log.
        r = ddprun("--standalone", "--nproc-per-node", 2, "--tee", 3, "--log-dir", logs,
                   "--local-ranks-filter", 0, *prog)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.splitlines(), ["[r0] out 0"])
        self.assertNotIn("[r1]", r.stderr)
        self.assertEqual([log(0), log(1)], [["err 0", "out 0"], ["err 1", "out 1"]])
        # Per local rank, without --log-dir: a directory is made and named.
        r = ddprun("--standalone", "--nproc-per-node", 2, "--redirects", "0:3,1:0", *prog)
        self.assertEqual(r.returncode, 0, r.stderr)
        m = re.search(r"worker logs in (\S+)", r.stderr)
        self.assertIsNotNone(m, r.stderr)
        try:
            self.assertEqual(r.stdout.splitlines(), ["[r1] out 1"])
            self.assertEqual(log(0, where=m.group(1)), ["err 0", "out 0"])
            self.assertIsNone(log(1, where=m.group(1)))  # rank 1: console only
        finally:
            shutil.rmtree(m.group(1), ignore_errors=True)
        # A filter alone: the other ranks' output is dropped from the console.
        r = ddprun("--standalone", "--nproc-per-node", 3, "--local-ranks-filter", "0,2", *prog)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()), ["[r0] out 0", "[r2] out 2"])

    def test_logs_are_the_bytes_the_workers_wrote(self):
        # 3 MiB without a newline (binary, \r and \0 included), a line, and a last line without
        # its newline: the log file holds exactly those bytes, whatever sends it there.
        prog = os.path.join(self.dir, "raw.py")
        with open(prog, "w") as f:
            f.write("import os, random, sys\n"
                    "rank = int(os.environ['RANK'])\n"
                    "data = random.Random(rank).randbytes(3 << 20).replace(b'\\n', b'\\r')\n"
                    "data = data.replace(b'E', b'\\0') + b'a line\\n'\n"
                    "data += b'\\0\\r last, no newline'\n"
                    "open(os.path.join(sys.argv[1], f'expected.{rank}'), 'wb').write(data)\n"
                    "both = len(sys.argv) > 2\n"
                    "for k, at in enumerate(range(0, len(data), 100000)):\n"
                    "    sys.stdout.buffer.write(data[at:at + 100000]); sys.stdout.flush()\n"
                    "    if both:\n"
                    "        sys.stderr.write(f'E-line {k}\\n'); sys.stderr.flush()\n")
        for n, flags in ((2, ["-r", 1]), (1, ["-t", 1]), (1, [])):
            logs = os.path.join(self.dir, f"logs{flags}")
            r = subprocess.run([DDPRUN, "--standalone", "--nproc-per-node", str(n), "--log-dir",
                                logs, *map(str, flags), prog, self.dir], capture_output=True,
                               timeout=LIMIT)
            self.assertEqual(r.returncode, 0, r.stderr[-2000:])
            for rank in range(n):
                expected = read_bytes(os.path.join(self.dir, f"expected.{rank}"))
                got = read_bytes(os.path.join(logs, "attempt_0", f"rank_{rank}.log"))
                self.assertEqual(sha256(got), sha256(expected), (flags, rank))
            if flags == ["-t", 1]:  # the console has every byte too, in lines of at most ~1 MiB
                console = re.sub(rb"(?m)^\[r0\] ", b"", r.stdout)
                self.assertEqual(sha256(console.replace(b"\n", b"")),
                                 sha256(expected.replace(b"\n", b"")))
        # Both streams in one log: each stream's bytes in order, whole lines never split.
        logs = os.path.join(self.dir, "logs-both")
        r = subprocess.run([DDPRUN, "--standalone", "--log-dir", logs, "-r", "3", prog, self.dir,
                            "both"], capture_output=True, timeout=LIMIT)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        got = read_bytes(os.path.join(logs, "attempt_0", "rank_0.log"))
        expected = read_bytes(os.path.join(self.dir, "expected.0"))
        lines = re.findall(rb"E-line \d+\n", got)
        self.assertEqual(lines, [b"E-line %d\n" % k for k in range(len(lines))])
        self.assertEqual(len(lines), (len(expected) + 99999) // 100000)
        self.assertEqual(sha256(re.sub(rb"E-line \d+\n", b"", got)), sha256(expected))

    def test_a_log_that_cannot_be_written_is_reported(self):
        # The log directory is a 64 KiB tmpfs: rank 1 writes 400 KB, rank 0 one line. ddprun says
        # once which log failed and why, shows what rank 1 writes from then on on the console (its
        # stdout went to the log only, -r 1), and exits 1 although every worker succeeded.
        mount = os.path.join(self.dir, "logs")
        saved = os.path.join(self.dir, "saved")
        os.mkdir(mount)
        os.mkdir(saved)
        why = tmpfs_unavailable(mount)
        if why is not None:
            self.skipTest(why)
        prog = os.path.join(self.dir, "spill.py")
        with open(prog, "w") as f:
            f.write("import os, time\n"
                    "if os.environ['RANK'] == '1':\n"
                    "    # rank 0's line first, so that its log is the one that fits\n"
                    "    logs = os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE'])\n"
                    "    first = os.path.join(logs, 'rank_0.log')\n"
                    "    until = time.monotonic() + 20\n"
                    "    while time.monotonic() < until and not (os.path.exists(first) and\n"
                    "                                            os.path.getsize(first)):\n"
                    "        time.sleep(0.01)\n"
                    "    for i in range(400):\n"
                    "        print(f'{i:04d} ' + 'x' * 995)\n"
                    "print('last line of rank', os.environ['RANK'])\n")
        expected = "".join(f"{i:04d} {'x' * 995}\n" for i in range(400)) + "last line of rank 1\n"
        for flags in (["-r", 1], []):
            shutil.rmtree(saved)
            os.mkdir(saved)
            r = ddprun_on_small_tmpfs(mount, saved, "--standalone", "--nproc-per-node", 2,
                                      "--log-dir", mount, *flags, prog)
            self.assertNotEqual(r.returncode, 99, r.stderr)  # the mount worked
            self.assertEqual(r.returncode, 1, (flags, r.stderr[-2000:]))
            path = f"{mount}/attempt_0/rank_1.log"
            said = (f"ddprun: writing rank 1's log {path} failed: No space left on device; its "
                    "output from here on goes to the console only")
            self.assertEqual(r.stderr.count(said), 1, r.stderr[-2000:])
            self.assertEqual(r.stderr.count("failed: "), 1, r.stderr[-2000:])  # rank 0's: whole
            self.assertTrue(r.stderr.endswith(
                "ddprun: every worker succeeded, but a log could not be written in full: rank 1's "
                f"log {path} (No space left on device); exit status 1\n"), r.stderr[-2000:])
            self.assertEqual(read_bytes(f"{saved}/attempt_0/rank_0.log"), b"last line of rank 0\n")
            log = read_bytes(f"{saved}/attempt_0/rank_1.log").decode()
            self.assertTrue(expected.startswith(log))
            self.assertLess(len(log), len(expected))
            # Nothing lost: the console has the rest of rank 1's output, from where the log ends.
            console = "".join(line[5:] + "\n" for line in r.stdout.splitlines()
                              if line.startswith("[r1] "))
            self.assertTrue(expected.endswith(console), console[:200])
            self.assertGreaterEqual(len(log) + len(console), len(expected))
            if not flags:
                self.assertEqual(console, expected)  # the console had all of it anyway

    def test_error_files_as_torchrun_writes_and_reads_them(self):
        # A worker that writes torchrun's error file has its message in the report; ddprun's own
        # TORCHELASTIC_ERROR_FILE gets the root cause in the same format.
        own = os.path.join(self.dir, "launcher_error.json")
        write = ('if [ "$RANK" = 1 ]; then printf \'{"message": {"message": "ValueError: bad '
                 'shard \\\\"7\\\\"", "extraInfo": {"timestamp": "1"}}}\' > '
                 '"$TORCHELASTIC_ERROR_FILE"; exit 3; fi; sleep 30')
        r = ddprun("--standalone", "--nproc-per-node", 2, "--grace", 1, "sh", "-c", write,
                   env={**os.environ, "TORCHELASTIC_ERROR_FILE": own})
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn('rank 1 (local_rank 1, pid', r.stderr)
        self.assertIn('exited with status 3 after', r.stderr)
        self.assertIn(': ValueError: bad shard "7"', r.stderr)
        with open(own) as f:
            data = json.load(f)
        self.assertEqual(data["message"]["errorCode"], 3)
        self.assertIn('rank 1 (local_rank 1', data["message"]["message"])
        self.assertIn('ValueError: bad shard "7"', data["message"]["message"])
        self.assertTrue(data["message"]["extraInfo"]["timestamp"].isdigit())
        # Each worker's file is its own, in the log directory when there is one; a success
        # leaves ddprun's own file alone.
        os.unlink(own)
        logs = os.path.join(self.dir, "logs")
        r = ddprun("--standalone", "--nproc-per-node", 2, "--log-dir", logs, "sh", "-c",
                   "echo $TORCHELASTIC_ERROR_FILE", env={**os.environ,
                                                         "TORCHELASTIC_ERROR_FILE": own})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()),
                         [f"[r{k}] {logs}/attempt_0/rank_{k}.error.json" for k in (0, 1)])
        self.assertFalse(os.path.exists(own))
        # A relative --log-dir becomes absolute, as torchrun's: a worker that changes directory
        # still writes its error file there.
        r = ddprun("--standalone", "--log-dir", "rel-logs", "sh", "-c",
                   'cd / && echo "$TORCHELASTIC_ERROR_FILE"', cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(),
                         f"[r0] {os.path.realpath(self.dir)}/rel-logs/attempt_0/rank_0.error.json")
        # A malformed file is not a message.
        r = ddprun("--standalone", "sh", "-c", 'echo "{\\"message\\": 12" > '
                   '"$TORCHELASTIC_ERROR_FILE"; exit 5')
        self.assertEqual(r.returncode, 5, r.stderr)
        self.assertRegex(r.stderr, r"exited with status 5 after [0-9.]+ s\n")

    def test_master_port_is_left_to_the_program(self):
        # ddprun's store is on DDP_STORE_PORT; MASTER_PORT is free for the program's rank 0.
        port = free_port()
        r = ddprun("--nproc-per-node", 2, "--master-port", port, "sh", "-c",
                   "echo $MASTER_PORT $DDP_STORE_PORT")
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = sorted(r.stdout.splitlines())
        self.assertEqual(len(lines), 2, r.stdout)
        worker_port, store_port = (int(v) for v in lines[0].split()[1:])
        self.assertEqual(store_port, port)
        self.assertNotEqual(worker_port, port)
        self.assertEqual(lines[1], f"[r1] {worker_port} {port}")
        self.assertLess(worker_port, 32768)  # below the ephemeral range: no self-connect
        code = ("import os, socket\n"
                "if os.environ['RANK'] == '0':\n"
                "    s = socket.socket(); s.bind((os.environ['MASTER_ADDR'], "
                "int(os.environ['MASTER_PORT']))); print('bound')\n")
        prog = os.path.join(self.dir, "bind.py")
        with open(prog, "w") as f:
            f.write(code)
        r = ddprun("--standalone", "--nproc-per-node", 2, prog)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.splitlines(), ["[r0] bound"])

    def test_exit_status_is_propagated_and_the_rest_stopped(self):
        t0 = time.monotonic()
        r = ddprun("--standalone", "--nproc-per-node", 3, WORKER, "exit", 1, 7)
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertRegex(r.stderr, r"ddprun: rank 1 \(local_rank 1, pid \d+\) exited with status 7 "
                                   r"after \d+\.\d s; stopping the other workers")
        self.assertRegex(r.stderr, r"root cause: rank 1 \(local_rank 1")
        self.assertLess(time.monotonic() - t0, 30)

    def test_on_failure_shrink_lets_the_others_go_on(self):
        # Rank 0 or 2 dies after three all_reduces; the other three shrink and finish, rank 0's
        # loss included (ddprun's store outlives every worker): the job succeeds.
        for dead in (0, 2):
            r = ddprun("--standalone", "--nproc-per-node", 4, "--on-failure", "shrink", WORKER,
                       "shrink", dead)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertRegex(r.stderr, rf"ddprun: rank {dead} \(local_rank {dead}, pid \d+\) exited "
                                       rf"with status 7 after \d+\.\d s; the other workers go on "
                                       rf"without it \(--on-failure shrink\)")
            self.assertIn(f"lost during the run: rank {dead}", r.stderr)
            survivors = [x for x in range(4) if x != dead]
            for new, old in enumerate(survivors):
                self.assertIn(f"rank {old} is rank {new} of 3 (epoch 1), sum of old ranks "
                              f"{sum(survivors)}", r.stdout)
        # Without it, the same failure stops every worker and fails the job.
        r = ddprun("--standalone", "--nproc-per-node", 4, WORKER, "shrink", 2)
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertIn("stopping the other workers", r.stderr)
        # Every worker lost: the job fails, naming the first.
        r = ddprun("--standalone", "--nproc-per-node", 2, "--on-failure", "shrink", WORKER,
                   "shrink", "all")
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertIn("root cause: rank", r.stderr)

    def test_a_stopped_worker_left_out_is_ended_and_ddprun_exits(self):
        # Rank 1 stops itself (SIGSTOP) in epoch 0: after the heartbeat (2 s) the job counts it
        # lost and goes on. ddprun ends it (it could never act again), then exits as it does
        # for a lost worker under shrink (0, the others having finished), or restarts it to
        # rejoin under rejoin, the job ending with every rank.
        env = {**os.environ, "DDP_HEARTBEAT": "2", "WORKER_STEP_MS": "20"}
        for policy in ("shrink", "rejoin"):
            t0 = time.monotonic()
            r = ddprun("--standalone", "--nproc-per-node", 3, "--on-failure", policy,
                       "--max-restarts", 1, WORKER, "elastic", "1:0:3:stop", env=env)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertRegex(r.stderr, r"ddprun: rank 1 \(local_rank 1, pid \d+\) was left out "
                                       r"of the job \(its heartbeat stopped\): ending it")
            found = elastic_results(r.stdout)
            if policy == "shrink":
                self.assertIn("lost during the run: rank 1", r.stderr)
                self.assertEqual([(w, n, once) for w, n, _, once in found],
                                 [("0", "2", "yes"), ("2", "2", "yes")], r.stdout + r.stderr)
            else:
                self.assertIn("restarting it alone to rejoin the job", r.stderr)
                self.assertEqual([(w, n, once) for w, n, _, once in found],
                                 [("0", "3", "yes"), ("1", "3", "yes"), ("2", "3", "yes")],
                                 r.stdout + r.stderr)
            self.assertEqual(len({h for _, _, h, _ in found}), 1, r.stdout)
            self.assertLess(time.monotonic() - t0, 45)

    def test_on_failure_rejoin_restarts_the_worker_alone(self):
        # Rank 2 dies after three all_reduces; ddprun restarts it alone with DDP_REJOIN=1; the
        # other three shrink, then grow() admits it back (Communicator::enter): 4 ranks again.
        r = ddprun("--standalone", "--nproc-per-node", 4, "--on-failure", "rejoin",
                   "--max-restarts", 1, WORKER, "rejoin", 2)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stderr, r"ddprun: rank 2 \(local_rank 2, pid \d+\) exited with status 7 "
                                   r"after \d+\.\d s; restarting it alone to rejoin the job "
                                   r"\(--on-failure rejoin, restart 1 of 1\)")
        self.assertIn("rank 2 rejoined as rank 3 of 4 (epoch 2), sum of world ranks 6", r.stdout)
        for old, new in ((0, 0), (1, 1), (3, 2)):
            self.assertIn(f"rank {old} is rank {new} of 4 (epoch 2), sum of world ranks 6",
                          r.stdout)
        self.assertNotIn("lost during the run", r.stderr)
        # No restart left: as shrink, and the job fails only if nobody is left.
        r = ddprun("--standalone", "--nproc-per-node", 2, "--on-failure", "rejoin", WORKER,
                   "shrink", "all")
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertIn("(--on-failure rejoin: no restart left)", r.stderr)

    def test_on_failure_rejoin_never_restarts_into_a_finished_job(self):
        # The last rank fails after every other worker has finished: there is no running job to
        # rejoin, so it is not restarted (it would wait for an admission that cannot come).
        start = time.monotonic()
        r = ddprun("--standalone", "--nproc-per-node", 3, "--on-failure", "rejoin",
                   "--max-restarts", 3, WORKER, "fail_last")
        self.assertLess(time.monotonic() - start, 20)
        self.assertRegex(r.stderr, r"ddprun: rank 2 \(local_rank 2, pid \d+\) exited with status 5 "
                                   r"after \d+\.\d s; not restarting it: every other worker of the "
                                   r"job has ended, so there is no running job to rejoin")
        self.assertNotIn("restarting it alone", r.stderr)
        self.assertNotIn("rejoined", r.stdout)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)  # the others finished
        self.assertIn("lost during the run: rank 2", r.stderr)

    def test_nnodes_range_adds_a_late_node_to_the_running_job(self):
        # --nnodes 1:2: node 0 starts the job alone (2 workers) after the last call; node 1
        # comes later and its worker joins the running job as rank 2 (DDP_REJOIN=1).
        port = free_port()
        common = ["--nnodes", "1:2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                  "--on-failure", "shrink", "--rdzv-conf", "last_call_timeout=0.2"]
        p0 = subprocess.Popen([DDPRUN, *common, "--node-rank", "0", "--nproc-per-node", "2",
                               WORKER, "grow", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        p1 = subprocess.Popen([DDPRUN, *common, "--node-rank", "1", "--nproc-per-node", "1",
                               WORKER, "grow", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        out0, err0 = p0.communicate(timeout=LIMIT)
        out1, err1 = p1.communicate(timeout=LIMIT)
        self.assertEqual((p0.returncode, p1.returncode), (0, 0), err0 + err1)
        self.assertIn("node 1 came after the job started: its workers (ranks 2 to 2) join the "
                      "running job", err1)
        self.assertIn("rank 2 joined as rank 2 of 3 (epoch 1), sum of world ranks 3", out1)
        for r in (0, 1):
            self.assertIn(f"rank {r} is rank {r} of 3 (epoch 1), sum of world ranks 3", out0)
        # No second node: the job starts after the last call, and ddprun ends with it.
        start = time.monotonic()
        r = ddprun(*common[:5], str(free_port()), *common[6:], "--node-rank", 0,
                   "--nproc-per-node", 2, WORKER, "allreduce")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(len(r.stdout.splitlines()), 2, r.stdout)
        self.assertLess(time.monotonic() - start, 10)

    def test_nnodes_range_without_on_failure_restarts_every_worker_as_torchrun_does(self):
        # torchrun's elastic line as it is: --nnodes 1:2, no --on-failure. Node 0 starts alone
        # (2 workers); node 1 comes later: every worker is restarted with it, 3 ranks (a
        # membership change: not counted in --max-restarts, which is 0 here).
        port = free_port()
        common = ["--nnodes", "1:2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                  "--rdzv-conf", "last_call_timeout=0.2"]
        env = {**os.environ, "WORKER_HOLD_MS": "4000"}
        p0 = subprocess.Popen([DDPRUN, *common, "--node-rank", "0", "--nproc-per-node", "2",
                               WORKER, "allreduce"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
        wait_for_output = time.monotonic() + LIMIT
        time.sleep(1.5)
        p1 = subprocess.Popen([DDPRUN, *common, "--node-rank", "1", "--nproc-per-node", "1",
                               WORKER, "allreduce"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ})
        out0, err0 = p0.communicate(timeout=max(1, wait_for_output - time.monotonic()))
        out1, err1 = p1.communicate(timeout=LIMIT)
        self.assertEqual((p0.returncode, p1.returncode), (0, 0), err0 + err1)
        self.assertIn("a node is waiting to enter: restarting every worker with it (a membership "
                      "change, not counted in --max-restarts)", err0)
        self.assertIn("node 1 came after the job started: the running workers are restarted "
                      "with this node's", err1)
        for r in (0, 1):
            self.assertRegex(out0, rf"rank {r}/2 local {r}/2 node 0 launcher ddprun transport shm "
                                   r"restart 0 sum ok")
            self.assertRegex(out0, rf"rank {r}/3 .* node 0 launcher ddprun .*restart 1 sum ok")
        self.assertRegex(out1, r"rank 2/3 .* node 1 launcher ddprun .*restart 1 sum ok")

    def test_nnodes_range_a_node_that_lost_its_workers_leaves_and_another_takes_its_place(self):
        # --nnodes 1:2, one worker per node: node 1 comes late, its worker dies; its ddprun
        # leaves at once, freeing node rank 1; a c10d launcher (no --node-rank) takes it and its
        # worker joins the running job as a newcomer; a further node is refused, the job full.
        port = free_port()
        common = ["--nnodes", "1:2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                  "--on-failure", "shrink", "--rdzv-conf", "last_call_timeout=0.2",
                  "--nproc-per-node", "1"]
        p0 = subprocess.Popen([DDPRUN, *common, "--node-rank", "0", WORKER, "replace"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        start = time.monotonic()
        r1 = ddprun(*common, "--node-rank", 1, WORKER, "replace")
        self.assertEqual(r1.returncode, 9, r1.stderr)
        self.assertLess(time.monotonic() - start, 15)  # it left; it did not wait for the job
        self.assertIn("node 1 lost all its workers (rank 1); the job goes on without it", r1.stderr)
        p2 = subprocess.Popen([DDPRUN, *common, "--rdzv-backend", "c10d", WORKER, "replace"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out2, err2 = p2.communicate(timeout=LIMIT)
        out0, err0 = p0.communicate(timeout=LIMIT)
        self.assertEqual((p0.returncode, p2.returncode), (0, 0), err0 + err2)
        self.assertIn("node 1 came after the job started: its workers (ranks 2 to 2) join the "
                      "running job", err2)
        self.assertIn("rank 2 joined as rank 1 of 2 (epoch 3), sum of world ranks 2", out2)
        self.assertIn("rank 0 is rank 0 of 2 (epoch 3), sum of world ranks 2", out0)
        # A node for a job that is full is refused, saying so.
        full = [*common[:5], str(free_port()), *common[6:]]
        p0 = subprocess.Popen([DDPRUN, *full, "--node-rank", "0", "sleep", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        p1 = subprocess.Popen([DDPRUN, *full, "--node-rank", "1", "sleep", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        r = ddprun(*full, "--rdzv-backend", "c10d", WORKER, "allreduce")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("already has its maximum of 2 nodes (--nnodes 1:2)", r.stderr)
        p1.communicate(timeout=LIMIT)
        p0.communicate(timeout=LIMIT)

    def test_killed_worker_is_named(self):
        for sig, name in ((signal.SIGKILL, "SIGKILL"), (signal.SIGSEGV, "SIGSEGV")):
            r = ddprun("--standalone", "--nproc-per-node", 3, WORKER, "signal", 2, int(sig))
            self.assertEqual(r.returncode, 128 + sig, r.stderr)
            self.assertRegex(r.stderr, rf"root cause: rank 2 \(local_rank 2, pid \d+\) was killed "
                                       rf"by {name} \(signal {int(sig)}\) after \d+\.\d s")

    def test_crash_is_the_root_cause_not_the_peers_that_noticed(self):
        # rank 1 crashes while all ranks loop in all_reduce: the others fail with peer_lost at
        # once, yet the summary names the crash.
        p = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "3", WORKER, "loop",
                              self.dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pids = wait_for_files([f"{self.dir}/pid.{r}" for r in range(3)], p)
        os.kill(pids[1], signal.SIGKILL)
        out, err = p.communicate(timeout=LIMIT)
        self.assertEqual(p.returncode, 137, err)
        self.assertRegex(err, r"root cause: rank 1 \(local_rank 1, pid \d+\) was killed by SIGKILL")
        self.assertGone(pids)

    def test_timeout_dumps_flight_recorders_and_names_the_lagging_rank(self):
        # Rank 2 sleeps while the others call a fourth all_reduce: they time out after 1 s and
        # write their flight recorders; ddprun and ddp-trace compare them and name rank 2.
        env = dict(os.environ, DDP_TIMEOUT="1", DDP_TRACE_DUMP=self.dir)
        t0 = time.monotonic()
        r = ddprun("--standalone", "--nproc-per-node", 4, WORKER, "lag", 2, env=env)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertLess(time.monotonic() - t0, 20)  # not the sleeper's 30 s
        self.assertRegex(r.stderr, r"timed out after 1000 ms waiting for rank 2")
        self.assertEqual(sorted(os.listdir(self.dir)),
                         [f"ddp-trace-default-rank{k}.txt" for k in (0, 1, 3)])
        self.assertIn(f"ddprun: flight recorders in {self.dir}", r.stderr)
        self.assertIn("  lagging: rank 2", r.stderr)
        t = subprocess.run([TRACE_TOOL, self.dir], capture_output=True, text=True, timeout=LIMIT)
        self.assertEqual(t.returncode, 0, t.stderr)
        self.assertIn('group "default": dumps from 3 of 4 ranks', t.stdout)
        self.assertRegex(t.stdout, r"rank 0: at #3 all_reduce \(1024 B, failed\), 4 issued")
        self.assertIn("no dump: rank 2", t.stdout)
        self.assertIn("lagging: rank 2", t.stdout)
        # Nothing to read: a clear message and a non-zero status.
        empty = tempfile.mkdtemp(dir=self.dir)
        t = subprocess.run([TRACE_TOOL, empty], capture_output=True, text=True, timeout=LIMIT)
        self.assertEqual(t.returncode, 1)
        self.assertIn("no flight recorder dump", t.stderr)
        # A file that is not a dump, and one that does not exist: named, non-zero status.
        for path, why in ((WORKER, "not a ddp flight recorder dump"),
                          (f"{self.dir}/missing.txt", "cannot open the flight recorder dump")):
            t = subprocess.run([TRACE_TOOL, path], capture_output=True, text=True, timeout=LIMIT)
            self.assertEqual(t.returncode, 1, t.stdout)
            self.assertIn(f"{path}: {why}", t.stderr)

    def test_timeline_merged_and_drawn(self):
        """DDP_TIMELINE: every rank writes its timeline; ddp-trace merges them into one trace
        (one process per rank, every bucket's all_reduce inside the step that issued it) and
        draws the last step of every rank."""
        tl = os.path.join(self.dir, "timeline")
        env = dict(os.environ, DDP_TIMELINE=tl, WORKER_CHECKPOINT_DIR=self.dir)
        r = ddprun("--standalone", "--nproc-per-node", 4, WORKER, "train", 5, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        files = sorted(f for f in os.listdir(tl) if f.startswith("ddp-timeline-rank"))
        self.assertEqual([f.split("-")[2] for f in files], ["rank0", "rank1", "rank2", "rank3"])
        t = subprocess.run([TRACE_TOOL, tl], capture_output=True, text=True, timeout=LIMIT)
        self.assertEqual(t.returncode, 0, t.stderr)
        self.assertIn(f"4 ranks' timelines merged into {tl}/ddp-timeline.json", t.stdout)
        self.assertRegex(t.stdout, r"rank 3: 5 steps, [0-9.]+ ms each: collectives [0-9.]+ ms "
                                   r"\([0-9]+% overlapped")
        with open(os.path.join(tl, "ddp-timeline.json")) as f:
            events = json.load(f)["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        self.assertEqual({e["pid"] for e in events}, {0, 1, 2, 3})
        for rank in range(4):
            mine = [e for e in spans if e["pid"] == rank]
            steps = [e for e in mine if e["cat"] == "step" and e["name"].startswith("step ")]
            self.assertEqual(len(steps), 5)
            buckets = [e for e in mine if e["cat"] == "collective" and "bucket" in e.get("args", {})]
            self.assertGreaterEqual(len(buckets), 5 * 4)
            for b in buckets:
                self.assertTrue(any(s["ts"] <= b["ts"] + 0.001 and
                                    b["ts"] + b["dur"] <= s["ts"] + s["dur"] + 0.001
                                    for s in steps), f"rank {rank}: {b} is in no step")
            self.assertEqual(len([e for e in mine if e["name"] == "checkpoint save"]), 1)
            self.assertEqual(len([e for e in mine if e["name"] == "forward"]), 5)
        # The ranks' clocks are one: the same step starts within a few ms on every rank.
        last = [next(e for e in spans if e["pid"] == k and e["name"] == "step 4") for k in range(4)]
        self.assertLess(max(e["ts"] for e in last) - min(e["ts"] for e in last), 50000)
        with open(os.path.join(tl, "ddp-timeline-step.svg")) as f:
            svg = f.read()
        self.assertTrue(svg.startswith("<svg "), svg[:100])
        self.assertIn("step 4,", svg)
        for rank in range(4):
            self.assertIn(f'<g id="rank-{rank}">', svg)
        self.assertGreaterEqual(svg.count('class="bucket"'), 4 * 4)
        self.assertEqual(svg.count('class="step"'), 4)
        self.assertEqual(svg.count('class="wait"'), 4)
        # Perfetto's trace processor, where it is installed, loads the merged trace: one process
        # track per rank and no import errors.
        tp = shutil.which("trace_processor_shell") or os.environ.get("TRACE_PROCESSOR")
        if tp:
            q = ("select count(distinct upid) from process where pid between 0 and 3; "
                 "select count(*) from stats where severity = 'error' and value > 0;")
            p = subprocess.run([tp, "-q", "/dev/stdin", os.path.join(tl, "ddp-timeline.json")],
                               input=q, capture_output=True, text=True, timeout=LIMIT)
            self.assertEqual(p.returncode, 0, p.stderr)
        # A step no rank ran: named, non-zero status; a truncated file is read up to its last
        # complete event.
        t = subprocess.run([TRACE_TOOL, tl, "--step", "99"], capture_output=True, text=True,
                           timeout=LIMIT)
        self.assertEqual(t.returncode, 1)
        self.assertIn("no rank's timeline has step 99", t.stdout)
        path = os.path.join(tl, files[0])
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text[: len(text) * 2 // 3])
        t = subprocess.run([TRACE_TOOL, path, "-o", os.path.join(self.dir, "one.json"), "--svg",
                            os.path.join(self.dir, "one.svg")], capture_output=True, text=True,
                           timeout=LIMIT)
        self.assertEqual(t.returncode, 0, t.stderr)
        self.assertIn("ends mid-event (its process was killed)", t.stderr)
        with open(os.path.join(self.dir, "one.json")) as f:
            self.assertGreater(len(json.load(f)["traceEvents"]), 10)
        # The merged trace and a pretty-printed copy read back as the ranks' files do.
        pretty = os.path.join(self.dir, "pretty.json")
        with open(os.path.join(tl, "ddp-timeline.json")) as f, open(pretty, "w") as g:
            json.dump(json.load(f), g, indent=2)
        for again in (os.path.join(tl, "ddp-timeline.json"), pretty):
            t = subprocess.run([TRACE_TOOL, again, "-o", os.path.join(self.dir, "again.json"),
                                "--svg", os.path.join(self.dir, "again.svg")],
                               capture_output=True, text=True, timeout=LIMIT)
            self.assertEqual(t.returncode, 0, t.stderr)
            self.assertIn("4 ranks' timelines merged", t.stdout)
        # An empty rank file is left out, named; a second run in the same directory is told
        # apart from the first: only the latest is merged and drawn.
        with open(os.path.join(tl, "ddp-timeline-rank7-1.json"), "w"):
            pass
        r = ddprun("--standalone", "--nproc-per-node", 2, WORKER, "train", 3, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        svg_path = os.path.join(tl, "ddp-timeline-step.svg")
        t = subprocess.run([TRACE_TOOL, tl, "--step", "99"], capture_output=True, text=True,
                           timeout=LIMIT)
        self.assertEqual(t.returncode, 1)
        self.assertGreater(os.path.getsize(svg_path), 1000)  # a failed draw keeps the old one
        t = subprocess.run([TRACE_TOOL, tl], capture_output=True, text=True, timeout=LIMIT)
        self.assertEqual(t.returncode, 0, t.stderr)
        self.assertIn("ddp-timeline-rank7-1.json: empty", t.stderr)
        self.assertIn("timelines of several runs here; the latest only", t.stderr)
        self.assertIn("2 ranks' timelines merged", t.stdout)
        self.assertIn("rank 1: 3 steps", t.stdout)
        for bad in ("-1", "abc", "99999999999999999999"):
            t = subprocess.run([TRACE_TOOL, tl, "--step", bad], capture_output=True, text=True,
                               timeout=LIMIT)
            self.assertNotEqual(t.returncode, 0)
            self.assertIn("is not a step number", t.stdout + t.stderr)

    def test_bad_timeout_variable_is_named(self):
        for value in ("abc", "-1", "0", "2147483648", "1e400", "nan"):
            r = ddprun("--standalone", "--nproc-per-node", 2, WORKER, "allreduce",
                       env=dict(os.environ, DDP_TIMEOUT=value))
            self.assertEqual(r.returncode, 1, (value, r.stderr))
            self.assertIn(f'DDP_TIMEOUT="{value}" is not a timeout', r.stderr)

    def test_signals_are_forwarded(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            d = tempfile.mkdtemp(dir=self.dir)
            p = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "3", WORKER, "wait",
                                  d], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            pids = wait_for_files([f"{d}/pid.{r}" for r in range(3)], p)
            p.send_signal(sig)
            out, err = p.communicate(timeout=LIMIT)
            self.assertEqual(p.returncode, 128 + sig, err)
            for r in range(3):  # each worker saw the signal itself
                with open(f"{d}/got.{r}") as f:
                    self.assertEqual(int(f.read()), int(sig))
            self.assertGone(pids)

    def test_grace_then_sigkill(self):
        p = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "2", "--grace", "0.5",
                              WORKER, "wait", self.dir, "ignore-term"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pids = wait_for_files([f"{self.dir}/pid.{r}" for r in range(2)], p)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=LIMIT)
        self.assertEqual(p.returncode, 128 + signal.SIGTERM, err)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertGone(pids)

    def test_max_restarts_recovers(self):
        r = ddprun("--standalone", "--nproc-per-node", 3, "--max-restarts", 2, WORKER, "exit", 1, 3,
                   "once")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("restarting the workers in 0.1 s (restart 1 of 2)", r.stderr)
        self.assertIn("every worker succeeded after 1 restart", r.stderr)
        self.assertEqual(sorted(re.findall(r"rank (\d)/3 .* restart 1 sum ok", r.stdout)),
                         ["0", "1", "2"])

    def test_max_restarts_gives_up(self):
        logs = os.path.join(self.dir, "logs")
        r = ddprun("--standalone", "--nproc-per-node", 2, "--max-restarts", 2, "--log-dir", logs,
                   WORKER, "exit", 1, 3)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertEqual(len(re.findall(r"exited with status 3", r.stderr)), 6)  # 3 attempts
        self.assertIn("attempt 3 failed", r.stderr)
        self.assertEqual(sorted(os.listdir(logs)), ["attempt_0", "attempt_1", "attempt_2"])

    def test_restarts_back_off(self):
        # A worker that always fails, --max-restarts 1000: ddprun waits 0.1 s before the first
        # restart, doubling up to 5 s, and SIGTERM ends it at once while it waits.
        logs = os.path.join(self.dir, "logs")
        p = subprocess.Popen([DDPRUN, "--standalone", "--max-restarts", "1000", "--log-dir", logs,
                              "sh", "-c", "exit 3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        t0 = time.monotonic()
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
        reader.start()
        waits = []
        try:
            while time.monotonic() < t0 + LIMIT:
                waits = [float(w) for w in re.findall(
                    r"restarting the workers in ([0-9.]+) s \(restart \d+ of 1000\)",
                    "".join(lines))]
                restarts = sum("restarting the workers" in line for line in list(lines))
                self.assertLessEqual(restarts, 6, f"{restarts} restarts in "
                                     f"{time.monotonic() - t0:.1f} s:\n{''.join(lines[-6:])}")
                if 3.2 in waits or p.poll() is not None:
                    break
                time.sleep(0.05)
            self.assertEqual(waits, [0.1, 0.2, 0.4, 0.8, 1.6, 3.2], "".join(lines))
            self.assertGreaterEqual(time.monotonic() - t0, 0.1 + 0.2 + 0.4 + 0.8 + 1.6)
            signalled = time.monotonic()
            p.send_signal(signal.SIGTERM)  # during the 3.2 s wait
            p.wait(timeout=LIMIT)
            self.assertLess(time.monotonic() - signalled, 2.5)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            reader.join(timeout=LIMIT)
            p.stdout.close()
            p.stderr.close()
        self.assertEqual(p.returncode, 128 + signal.SIGTERM, "".join(lines))
        self.assertEqual(sorted(os.listdir(logs)), [f"attempt_{k}" for k in range(6)])
        self.assertIn("ddprun: received SIGTERM while waiting to restart: not restarting\n", lines)

    def test_nothing_left_behind(self):
        r = ddprun("--standalone", "--nproc-per-node", 2, WORKER, "grandchild", self.dir)
        self.assertEqual(r.returncode, 5, r.stderr)
        pids = [read_int(f"{self.dir}/grandchild.{k}") for k in range(2)]
        self.assertGone(pids)

    def test_nothing_listens_on_every_interface(self):
        # MASTER_ADDR=127.0.0.1: nothing ddprun or a worker listens on is bound to 0.0.0.0 or ::.
        env = dict(os.environ, DDP_HOST_TRANSPORT="tcp")
        p = subprocess.Popen([DDPRUN, "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
                              "--master-port", str(free_port()), WORKER, "loop", self.dir],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            pids = wait_for_files([f"{self.dir}/pid.{r}" for r in range(3)], p)
            found = listening_addresses([p.pid, *pids])
        finally:
            p.terminate()
            p.communicate(timeout=LIMIT)
        loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
        # The store; the ranks' transport listeners are bound the same way and closed once their
        # connections are made, so they may be gone by now.
        self.assertGreaterEqual(len(found), 1, found)
        self.assertEqual([f for f in found if f[0] != 4 or f[1] != loopback], [], found)

    def test_workers_die_with_ddprun(self):
        p = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "2", WORKER, "wait",
                              self.dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        pids = wait_for_files([f"{self.dir}/pid.{r}" for r in range(2)], p)
        p.kill()  # SIGKILL cannot be forwarded: the workers must not be orphaned anyway
        p.communicate(timeout=LIMIT)
        self.assertGone(pids)

    def test_an_uncaught_exception_reaches_the_summary_and_the_error_file(self):
        # As torch's @record: the message is in ddprun's root cause line even with -r 3 (nothing
        # of the workers on the console) and in the worker's TORCHELASTIC_ERROR_FILE.
        logs = os.path.join(self.dir, "logs")
        for kind, message in (
                ("ddp", "ddp::Error (invalid_argument): rank 1: the model has no parameters "
                        "(on purpose)"),
                ("std", "std::runtime_error: bad batch shape (on purpose)")):
            with self.subTest(kind=kind):
                r = ddprun("--standalone", "--nproc-per-node", 2, "-r", 3, "--log-dir", logs,
                           WORKER, "uncaught", 1, kind)
                self.assertEqual(r.returncode, 128 + signal.SIGABRT, r.stderr)
                self.assertRegex(r.stderr, r"root cause: rank 1 \(local_rank 1, pid \d+\) was "
                                           r"killed by SIGABRT \(signal 6\)[^\n]*: " +
                                 re.escape(message))
                with open(os.path.join(logs, "attempt_0", "rank_1.error.json")) as f:
                    self.assertEqual(json.load(f)["message"]["message"], message)

    def test_bad_arguments(self):
        cases = [
            (["--nnodes", 2, "--node-rank", 2, "true"], "--node-rank 2 is out of range"),
            (["--nproc-per-node", "abc", "true"], 'expected a number from 1 to 4096'),
            (["--nproc-per-nod", 2, "true"], "unknown option --nproc-per-nod"),
            (["--standalone", "--nnodes", 2, "true"], "--standalone runs a single node"),
            (["--nproc-per-node", 2], "no program given"),
            (["--rdzv-endpoint", ":29500", "true"], 'expected HOST[:PORT], got ":29500"'),
            (["--rdzv_endpoint", "h:99999", "true"], "expected HOST[:PORT]"),
            (["--no-python", "-m", "mod"], "--module runs python3 -m: drop --no-python"),
            (["--standalone", "-r", "4", "true"], '--redirects: expected 0 (none), 1 (stdout)'),
            (["--standalone", "--nproc-per-node", 2, "--tee", "2:1", "true"],
             "with local ranks 0 to 1; got \"2:1\""),
            (["--standalone", "-r", "0:1,x", "true"], "--redirects: expected"),
            (["--standalone", "--local-ranks-filter", "3", "true"],
             "--local-ranks-filter: local rank 3 does not exist"),
            (["--standalone", "--local_ranks_filter", "0,a", "true"],
             'expected local ranks like 0 or 0,2; got "0,a"'),
            (["--nnodes", "3:2", "--on-failure", "shrink", "true"],
             "--nnodes 3:2: MIN is larger than MAX"),
            (["--rdzv-conf", "last_call_timeout=x", "true"], 'expected seconds, got "x"'),
            (["--nnodes", "0", "true"], 'expected a number of nodes from 1 to 65536, or MIN:MAX'),
            (["--rdzv_backend=etcd", "true"], "--rdzv-backend etcd needs --rdzv-endpoint"),
            (["--rdzv_backend=etcd", "--rdzv_endpoint=h:2379", "true"],
             "--rdzv-backend etcd needs --rdzv-id NAME, new for each job"),
            (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379,:5", "--rdzv-id", "x", "true"],
             "every endpoint needs a host and a port"),
            (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h", "--rdzv-id", "j", "--standalone",
              "true"], "--standalone hosts its own store: drop --rdzv-backend etcd"),
            (["--rdzv-backend", "zk", "true"], "--rdzv-backend zk: unknown rendezvous backend"),
            (["--rdzv-conf", "join_timeout", "true"], 'expected key=value,...; got "join_timeout"'),
            (["--rdzv-conf", "join_timeout=-1", "true"], 'expected seconds, got "-1"'),
            (["--on-failure", "bogus", "true"], "--on-failure: bogus not in {restart,shrink,rejoin}"),
            (["--on-failure", "shrink", "--on-failure", "restart", "true"], "--on-failure"),
            (["--max-restarts", "-1", "true"], "--max-restarts: -1 is negative: give 0 or more"),
            (["--grace", "soon", "true"], "--grace: soon is not a number"),
            (["--join-timeout", "0", "true"], "--join-timeout: 0 is not positive"),
        ]
        for args, message in cases:
            r = ddprun(*args)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            self.assertIn(message, r.stderr)
            self.assertLess(len(r.stderr), 400, r.stderr)  # said in a line, not 300 digits
        # The same from torchrun's PET_ variables, and a flag's value that is not a boolean.
        for name, value, message in [("PET_MAX_RESTARTS", "-1", "-1 is negative"),
                                     ("PET_STANDALONE", "maybe", "--standalone = maybe")]:
            r = ddprun("--nproc-per-node", 1, "true", env={**os.environ, name: value})
            self.assertEqual(r.returncode, 2, (name, r.stderr))
            self.assertIn(message, r.stderr)
            self.assertLess(len(r.stderr), 400, r.stderr)
        r = ddprun("--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("Usage:"), 1, r.stdout)  # one usage line, naming PROGRAM
        self.assertIn("Usage: ddprun [OPTIONS] PROGRAM [ARGS...]\n", r.stdout)
        r = ddprun("--standalone", "--nproc-per-node", 2, "/nonexistent/program")
        self.assertEqual(r.returncode, 127)
        self.assertIn('cannot run "/nonexistent/program": No such file or directory', r.stderr)
        self.assertEqual(r.stderr.count("cannot run"), 1, r.stderr)  # once, not per worker

    def test_port_in_use(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            r = ddprun("--nproc-per-node", 1, "--master-port", port, "true")
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"127.0.0.1:{port}", r.stderr)
        self.assertIn("in use", r.stderr)
        self.assertIn("--standalone", r.stderr)

    def test_a_signal_ends_the_wait_for_the_other_nodes(self):
        # Node 0 (static) and a c10d agent wait for a node that never comes: SIGINT and SIGTERM
        # end the wait at once with 128 + N, not at --join-timeout.
        for extra, sig in ((["--node-rank", 0], signal.SIGINT),
                           (["--rdzv-backend", "c10d"], signal.SIGTERM)):
            with self.subTest(extra=extra):
                p = subprocess.Popen([DDPRUN, *map(str, ["--nnodes", 2, "--master-port",
                                                         free_port(), "--join-timeout", 30,
                                                         *extra, "true"])],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                time.sleep(1)
                t0 = time.monotonic()
                p.send_signal(sig)
                _, err = p.communicate(timeout=LIMIT)
                self.assertLess(time.monotonic() - t0, 5, err)
                self.assertEqual(p.returncode, 128 + sig, err)
                self.assertIn(f"received {signal.Signals(sig).name} while waiting for the nodes "
                              "to join: stopping", err)

    def test_missing_node_times_out(self):
        r = ddprun("--nnodes", 2, "--node-rank", 0, "--master-port", free_port(), "--join-timeout",
                   1, "true")
        self.assertEqual(r.returncode, 1)
        self.assertIn("1/2 nodes joined within 1.0 s; missing node 1 (start ddprun on every node", r.stderr)


class TorchrunCommandLines(Base):
    """Launch lines written for torchrun 2.x, run unchanged but for the program: torchrun's every
    flag is taken, honoured where it means something here and noted on stderr where not."""

    LINES = [
        "--standalone --nnodes=1 --nproc-per-node=2",
        "--nnodes=1 --nproc_per_node=2 --rdzv_id=job42 --rdzv_backend=c10d "
        "--rdzv_endpoint=127.0.0.1:{port}",
        "--nnodes 1:1 --nproc-per-node 2 --rdzv-backend static --master-addr 127.0.0.1 "
        "--master-port {port} --node-rank 0",
        "--nnodes=1 --node_rank=0 --master_addr=127.0.0.1 --master_port={port} "
        "--nproc_per_node=2 --max_restarts=0 --monitor_interval=5 --start_method=spawn",
        "--standalone --nproc-per-node 2 --role trainer --rdzv-conf join_timeout=60,read_timeout=120 "
        "--local-addr 127.0.0.1 --logs-specs default --shutdown-timeout 5 "
        "--signals-to-handle SIGTERM,SIGINT,SIGUSR1 --virtual-local-rank "
        "--event-log-handler null --numa-binding node --run-path",
        "--standalone --nproc_per_node=2 --log_dir={dir}/logs --tee=3 --local_ranks_filter=0,1 "
        "--duplicate-stdout-filters=x --duplicate_stderr_filters=y",
    ]

    def check_two_ranks(self, r, line):
        self.assertEqual(r.returncode, 0, (line, r.stderr))
        lines = sorted(r.stdout.splitlines())
        self.assertEqual(len(lines), 2, (line, r.stdout))
        for rank, out in enumerate(lines):
            self.assertRegex(out, rf"^\[r{rank}\] rank {rank}/2 local {rank}/2 node 0 launcher "
                                  r"ddprun transport shm restart 0 sum ok$")

    def test_real_world_lines_run_unchanged(self):
        for line in self.LINES:
            args = line.format(port=free_port(), dir=self.dir).split()
            r = ddprun(*args, WORKER, "allreduce")
            self.check_two_ranks(r, line)
            for flag in ("--monitor-interval", "--start-method", "--local-addr", "--logs-specs",
                         "--signals-to-handle", "--virtual-local-rank", "--event-log-handler",
                         "--numa-binding", "--run-path", "--duplicate-stdout-filters",
                         "--duplicate-stderr-filters"):
                if flag in line or flag.replace("-", "_")[2:] in line:
                    self.assertIn(f"ddprun: note: {flag}", r.stderr, (line, flag))
            if "read_timeout" in line:
                self.assertIn("ddprun: note: --rdzv-conf read_timeout=120", r.stderr)

    def test_role_run_id_and_line_prefix_reach_the_workers(self):
        r = ddprun("--standalone", "--nproc-per-node", 2, "--role", "trainer", "--rdzv-id", "job7",
                   "--log-line-prefix-template", "${role_name}/${local_rank}/${rank}@${hostname}: ",
                   "sh", "-c", 'echo "$ROLE_NAME $TORCHELASTIC_RUN_ID"')
        self.assertEqual(r.returncode, 0, r.stderr)
        host = socket.gethostname()
        self.assertEqual(sorted(r.stdout.splitlines()),
                         [f"trainer/0/0@{host}: trainer job7", f"trainer/1/1@{host}: trainer job7"])

    def test_options_from_pet_environment_variables(self):
        # torchrun takes every option left off the command line from PET_<NAME>.
        env = {**os.environ, "PET_NPROC_PER_NODE": "2", "PET_STANDALONE": "1",
               "PET_RDZV_ID": "fromenv"}
        r = ddprun(WORKER, "allreduce", env=env)
        self.check_two_ranks(r, "PET_*")
        r = ddprun("sh", "-c", 'echo "$TORCHELASTIC_RUN_ID"', env=env)
        self.assertEqual(r.stdout.splitlines(), ["[r0] fromenv", "[r1] fromenv"], r.stderr)
        # The command line wins over the environment.
        r = ddprun("--nproc-per-node", 1, WORKER, "allreduce", env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(r.stdout.splitlines()), 1, r.stdout)

    def test_rdzv_endpoint_without_a_port_is_torchruns_29400(self):
        r = ddprun("--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   "127.0.0.1", "sh", "-c", 'echo "$MASTER_ADDR $DDP_STORE_PORT"')
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "[r0] 127.0.0.1 29400", r.stdout)
        r = ddprun("--nproc-per-node", 1, "--rdzv-endpoint", "127.0.0.1:x", WORKER, "allreduce")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--rdzv-endpoint: expected HOST[:PORT]", r.stderr)

    def test_two_launchers_that_both_say_node_0_are_told_of_node_ranks(self):
        port = free_port()
        line = ["--nnodes=2", "--nproc_per_node=1", "--join-timeout", "20",
                f"--rdzv-endpoint=127.0.0.1:{port}", WORKER, "allreduce"]
        first = subprocess.Popen([DDPRUN, *line], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        time.sleep(0.3)
        second = ddprun(*line)
        first.kill()
        first.communicate(timeout=LIMIT)
        self.assertNotEqual(second.returncode, 0)
        self.assertIn("give each node its own --node-rank or use --rdzv-backend c10d",
                      second.stderr)
        self.assertIn("port in --rdzv-endpoint", second.stderr)
        self.assertNotIn("--master-port", second.stderr)

    def test_version(self):
        r = ddprun("--version")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"^ddprun \(ddp \d+\.\d+\.\d+\)")

    def test_c10d_nodes_numbered_on_arrival(self):
        # torchrun's multi-node line has no --node-rank: the launcher that can listen at the
        # endpoint is node 0, the others are numbered as they join (here node 1 starts first).
        port = free_port()
        line = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_id=100", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}", WORKER, "allreduce"]
        first = subprocess.Popen([DDPRUN, *line], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        time.sleep(0.3)
        second = ddprun(*line)
        out, err = first.communicate(timeout=LIMIT)
        self.assertEqual((first.returncode, second.returncode), (0, 0), err + second.stderr)
        lines = sorted((out + second.stdout).splitlines())
        self.assertEqual(len(lines), 4, lines)
        for rank, text in enumerate(lines):
            # "local" is the communicator's: one machine, so 4 ranks share it.
            self.assertRegex(text, rf"^\[r{rank}\] rank {rank}/4 local {rank}/4 "
                                   rf"node {rank // 2} launcher ddprun transport shm .*sum ok$")

    def test_a_third_launcher_is_refused(self):
        port = free_port()
        line = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--join-timeout", "5",
                f"--rdzv_endpoint=127.0.0.1:{port}", WORKER, "allreduce"]
        procs = [subprocess.Popen([DDPRUN, *line], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(3)]
        results = [p.communicate(timeout=LIMIT) for p in procs]
        codes = sorted(p.returncode for p in procs)
        self.assertEqual(codes, [0, 0, 2], results)
        self.assertTrue(any("more launchers than --nnodes 2 joined the rendezvous" in e
                            for _, e in results), results)


class OtherLaunchers(Base):
    """The same worker program, unchanged, under the variables other launchers set."""

    def start_workers(self, envs):
        procs = [subprocess.Popen([WORKER, "allreduce"], env={**os.environ, **e},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for e in envs]
        results = [p.communicate(timeout=LIMIT) for p in procs]
        for p, (out, err) in zip(procs, results):
            self.assertEqual(p.returncode, 0, err)
        return "".join(out for out, _ in results)

    def test_torchrun_variables_with_its_agent_store(self):
        # torchrun's agent serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE):
        # ddp's store then listens on MASTER_PORT + 1.
        with socket.socket() as agent_store:
            while True:  # a port whose successor is free too (ddp's store goes there)
                agent_store.bind(("127.0.0.1", 0))
                port = agent_store.getsockname()[1]
                try:
                    with socket.socket() as probe:
                        probe.bind(("127.0.0.1", port + 1))
                    break
                except OSError:
                    agent_store.close()
                    agent_store = socket.socket()
            agent_store.listen()
            common = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                      "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
            out = self.start_workers([{**common, "RANK": str(r), "LOCAL_RANK": str(r)}
                                      for r in range(2)])
        self.assertEqual(len(re.findall(r"rank \d/2 local \d/2 node 0 launcher torchrun "
                                        r"transport shm restart 0 sum ok", out)), 2, out)

    def test_slurm_variables(self):
        job = str(400000 + os.getpid() % 10000)  # the port derives from the job id
        common = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0",
                  "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "localhost"}
        out = self.start_workers([{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}
                                  for r in range(2)])
        self.assertEqual(len(re.findall(r"launcher slurm transport shm", out)), 2, out)

    @unittest.skipIf(shutil.which("mpirun") is None, "needs Open MPI's mpirun")
    def test_mpirun(self):
        cmd = ["mpirun", "-np", "3", "--oversubscribe"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        r = subprocess.run([*cmd, "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
                            WORKER, "allreduce"], capture_output=True, text=True, timeout=LIMIT)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(re.findall(r"rank \d/3 local \d/3 node 0 launcher openmpi", r.stdout)),
                         3, r.stdout)


def python_with_torch():
    """A Python whose torch has torch.distributed with gloo: $DDP_TEST_TORCH_PYTHON, Debian's
    python3-torch, or pip's torch cached for the tests (~/.cache/ddp/torch-venv); None if none."""
    candidates = [os.environ.get("DDP_TEST_TORCH_PYTHON", ""), "/usr/bin/python3",
                  os.path.expanduser("~/.cache/ddp/torch-venv/bin/python")]
    for py in candidates:
        if py and os.access(py, os.X_OK) and subprocess.run(
                [py, "-c", "import torch.distributed as d; assert d.is_gloo_available()"],
                capture_output=True, timeout=LIMIT).returncode == 0:
            return py
    return None


TORCH_PYTHON = python_with_torch()

TORCH_PROGRAM = '''
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if len(sys.argv) > 1 and rank == int(sys.argv[1]):
        raise ValueError(f"rank {rank} fails on purpose")
    print("sum", int(t.item()), "world", world, "restart", os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.destroy_process_group()


main()
'''


@unittest.skipIf(TORCH_PYTHON is None, "needs a Python with torch (python3-torch or pip's torch)")
class TorchDistributedPrograms(Base):
    """torch.distributed programs under ddprun, as under torchrun: init_process_group("gloo") with
    env://, whose rank 0 hosts its TCPStore on MASTER_PORT, and @record's error files."""

    def run_program(self, *args, nproc=2, env=None, prog_args=()):
        prog = os.path.join(self.dir, "train.py")
        with open(prog, "w") as f:
            f.write(TORCH_PROGRAM)
        return ddprun("--nproc-per-node", nproc, "--master-port", free_port(), *args, prog,
                      *prog_args,
                      env={**os.environ, "PYTHON": TORCH_PYTHON, "OMP_NUM_THREADS": "1",
                           **(env or {})}, timeout=2 * LIMIT)

    def test_init_process_group_and_all_reduce(self):
        for n in (1, 3):
            r = self.run_program(nproc=n)
            self.assertEqual(r.returncode, 0, r.stderr)
            total = n * (n + 1) // 2
            self.assertEqual(sorted(r.stdout.splitlines()),
                             [f"[r{k}] sum {total} world {n} restart 0" for k in range(n)])

    def test_a_failing_rank_is_reported_with_its_exception(self):
        own = os.path.join(self.dir, "error.json")
        r = self.run_program("--grace", 2, prog_args=["1"], env={"TORCHELASTIC_ERROR_FILE": own})
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("root cause: rank 1 (local_rank 1", r.stderr)
        self.assertIn("ValueError: rank 1 fails on purpose", r.stderr)
        with open(own) as f:
            self.assertIn("ValueError: rank 1 fails on purpose", json.load(f)["message"]["message"])

    def test_restart_after_a_failure_reuses_the_port(self):
        # The first attempt's rank 0 fails; the second attempt hosts its store on the same
        # MASTER_PORT again and runs to the end.
        prog_args = ["--max-restarts", 1]
        code = TORCH_PROGRAM.replace(
            "if len(sys.argv) > 1 and rank == int(sys.argv[1]):",
            "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and rank == 0:")
        prog = os.path.join(self.dir, "flaky.py")
        with open(prog, "w") as f:
            f.write(code)
        r = ddprun("--nproc-per-node", 2, "--master-port", free_port(), *prog_args, prog,
                   env={**os.environ, "PYTHON": TORCH_PYTHON, "OMP_NUM_THREADS": "1"},
                   timeout=2 * LIMIT)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("restarting the workers in 0.1 s (restart 1 of 1)", r.stderr)
        self.assertEqual(sorted(line for line in r.stdout.splitlines() if "restart 1" in line),
                         ["[r0] sum 3 world 2 restart 1", "[r1] sum 3 world 2 restart 1"])


TORCHRUN = os.environ.get("DDP_TEST_TORCHRUN",
                          os.path.expanduser("~/.cache/ddp/torch-venv/bin/torchrun"))


@unittest.skipIf(not os.access(TORCHRUN, os.X_OK),
                 "needs PyPI's torchrun (scripts/test.sh installs it in ~/.cache/ddp/torch-venv)")
class RealTorchrun(Base):
    """The worker program, unchanged, under PyPI torch's own torchrun: one agent, two agents
    meeting through the c10d rendezvous, a failing worker, and --max-restarts."""

    def torchrun(self, *args):
        return subprocess.Popen([TORCHRUN, *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    def finish(self, *procs):
        try:
            results = [p.communicate(timeout=3 * LIMIT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, results)]

    def test_standalone_one_agent(self):
        [(code, out, err)] = self.finish(self.torchrun(
            "--standalone", "--nproc_per_node", 3, "--no-python", WORKER, "allreduce"))
        self.assertEqual(code, 0, err)
        self.assertEqual(sorted(re.findall(r"rank (\d)/3 local \d/3 node 0 launcher torchrun "
                                           r"transport shm restart 0 sum ok", out)),
                         ["0", "1", "2"], out + err)

    def test_two_agents_c10d_rendezvous(self):
        # Two "nodes" on this host: each torchrun agent starts 2 workers; they meet through the
        # c10d rendezvous store; ddp's own store goes on MASTER_PORT + 1 (the agent store).
        port = free_port()
        args = ["--nnodes", 2, "--nproc_per_node", 2, "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ddp-{os.getpid()}",
                "--no-python", WORKER, "allreduce"]
        results = self.finish(self.torchrun(*args), self.torchrun(*args))
        out = "".join(o for _, o, _ in results)
        for code, _, err in results:
            self.assertEqual(code, 0, err)
        # (ddp sees the 4 ranks on one host: local 0/4 to 3/4, over shared memory)
        found = re.findall(r"rank (\d)/4 local \d/4 node (\d) launcher torchrun transport shm "
                           r"restart 0 sum ok", out)
        self.assertEqual(sorted(rank for rank, _ in found), ["0", "1", "2", "3"], out)
        self.assertEqual(sorted({node for _, node in found}), ["0", "1"], out)

    def test_master_port_plus_one_taken_the_store_moves_to_the_next_port(self):
        # torchrun's agent serves its store on MASTER_PORT; ddp's goes on MASTER_PORT + 1, which
        # another program may hold (torchrun picks MASTER_PORT as any free port): rank 0 hosts
        # on the next free port and the others find it.
        port = free_port()
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", port + 1))
            holder.listen()
        except OSError:
            self.skipTest(f"port {port + 1} is not free")
        with holder:
            [(code, out, err)] = self.finish(self.torchrun(
                "--nnodes", 1, "--nproc_per_node", 2, "--master-addr", "127.0.0.1",
                "--master-port", port, "--no-python", WORKER, "allreduce"))
        self.assertEqual(code, 0, err)
        self.assertEqual(sorted(re.findall(r"rank (\d)/2 local \d/2 node 0 launcher torchrun "
                                           r"transport shm restart 0 sum ok", out)),
                         ["0", "1"], out + err)

    def test_a_failing_worker_fails_the_job(self):
        [(code, out, err)] = self.finish(self.torchrun(
            "--standalone", "--nproc_per_node", 2, "--no-python", WORKER, "exit", 1, 7))
        self.assertNotEqual(code, 0, out)
        self.assertIn("rank 1 fails on purpose", err)
        self.assertRegex(err, r"exitcode\s*:\s*7")

    def test_an_uncaught_exception_reaches_torchruns_summary(self):
        # torchrun reads the worker's TORCHELASTIC_ERROR_FILE, which ddp's terminate handler
        # wrote, into its failure summary, as for a Python worker under @record.
        [(code, out, err)] = self.finish(self.torchrun(
            "--standalone", "--nproc_per_node", 2, "--no-python", WORKER, "uncaught", 1, "ddp"))
        self.assertNotEqual(code, 0, out)
        self.assertRegex(err, r"traceback\s*:\s*ddp::Error \(invalid_argument\): rank 1: the "
                              r"model has no parameters \(on purpose\)")

    def test_max_restarts(self):
        # Rank 0 fails in the first attempt only: torchrun restarts the group and the second
        # attempt (TORCHELASTIC_RESTART_COUNT=1) completes, its ddp store on a fresh port.
        [(code, out, err)] = self.finish(self.torchrun(
            "--standalone", "--nproc_per_node", 2, "--max-restarts", 1, "--no-python", WORKER,
            "exit", 0, 3, "once"))
        self.assertEqual(code, 0, err)
        self.assertIn("rank 0 fails on purpose", err)
        self.assertEqual(sorted(re.findall(r"rank (\d)/2 local \d/2 node 0 launcher torchrun "
                                           r"transport shm restart 1 sum ok", out)),
                         ["0", "1"], out + err)


def elastic_results(out):
    """(world rank, final size, model hash, every sample once) of each `worker elastic` line."""
    return sorted(re.findall(r"rank (\d+) finished: (\d+) ranks, model ([0-9a-f]+), every sample "
                             r"once: (\w+)", out))


class HandStarted(Base):
    """A job started by hand, one process per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    as a pod per rank is): rank 0's process hosts the store."""

    def start(self, world, *args):
        port = free_port()
        procs = [subprocess.Popen([WORKER, *map(str, args)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                                       "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
                 for r in range(world)]
        outs = [p.communicate(timeout=LIMIT) for p in procs]
        return [p.returncode for p in procs], "".join(o for o, _ in outs), "".join(e for _, e in outs)

    def test_the_readme_loop_loses_rank_1_then_in_another_run_the_last_rank(self):
        # ddp::Elastic over 3 ranks; rank 1 (then, in another run, rank 2) dies mid-epoch: the
        # store lives in rank 0's process, which the loss leaves alone, so the two others finish
        # the 3 epochs, bitwise equal, every sample once per epoch.
        for dead, kill in ((1, "1:0:5"), (2, "2:1:3")):
            codes, out, err = self.start(3, "elastic", kill)
            self.assertEqual(codes[dead], 9, err)
            found = elastic_results(out)
            self.assertEqual([(r, n, once) for r, n, _, once in found],
                             [(str(r), "2", "yes") for r in range(3) if r != dead], out + err)
            self.assertEqual(len({h for _, _, h, _ in found}), 1, out)

    def test_losing_rank_0_loses_its_store_and_says_so(self):
        codes, out, err = self.start(3, "elastic", "0:1:3")
        self.assertEqual(codes, [9, 1, 1], err)
        self.assertIn("the rendezvous store at 127.0.0.1:", err)
        self.assertIn("is gone (its process ended or stopped answering: when rank 0 hosts it, "
                      "losing rank 0 loses it)",
                      err)


import etcd_cluster  # noqa: E402  (tests/launch/etcd_cluster.py)


@unittest.skipIf(not etcd_cluster.available(),
                 "needs etcd (apt-get install etcd-server; scripts/test.sh installs it)")
class EtcdStore(Base):
    """The rendezvous store in a real 3-member etcd cluster on loopback (DDP_STORE): no process
    of the job is a single point of failure."""

    def start(self, etcd, world, *args, namespace=None, extra_env=None):
        namespace = namespace or f"job{os.getpid()}-{time.monotonic_ns()}"
        return [subprocess.Popen([WORKER, *map(str, args)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                                      "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world),
                                      "DDP_STORE": etcd.url(namespace), "DDP_HEARTBEAT": "2",
                                      **(extra_env or {})})
                for r in range(world)]

    @staticmethod
    def finish(procs):
        outs = [p.communicate(timeout=3 * LIMIT) for p in procs]
        return [p.returncode for p in procs], "".join(o for o, _ in outs), "".join(e for _, e in outs)

    def test_the_readme_loop_loses_rank_0_or_another_and_goes_on(self):
        # No MASTER_ADDR, no MASTER_PORT: the etcd cluster is the store. Rank 0's loss is like
        # any other's; the survivors end as in a job whose store lives elsewhere (the same model
        # as by hand with rank 1 lost).
        with etcd_cluster.EtcdCluster(3) as etcd:
            models = {}
            for dead, kill in ((0, "0:1:3"), (1, "1:0:5"), (2, "2:1:3")):
                codes, out, err = self.finish(self.start(etcd, 3, "elastic", kill))
                self.assertEqual(codes[dead], 9, err)
                found = elastic_results(out)
                self.assertEqual([(r, n, once) for r, n, _, once in found],
                                 [(str(r), "2", "yes") for r in range(3) if r != dead], out + err)
                self.assertEqual(len({h for _, _, h, _ in found}), 1, out)
                models[dead] = found[0][2]
        # The same run with ddp's own store (rank 0 hosting it) gives the same bits.
        port = free_port()
        procs = [subprocess.Popen([WORKER, "elastic", "1:0:5"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": "3",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
                 for r in range(3)]
        _, out, err = self.finish(procs)
        self.assertEqual({h for _, _, h, _ in elastic_results(out)}, {models[1]}, out + err)

    def test_losing_an_etcd_member_the_job_goes_on(self):
        # A member of the cluster is killed while the job trains (and, in another run, while it
        # loses rank 0 too): the calls go on with the other two; the job finishes.
        for kill in ("", "0:2:3"):
            with etcd_cluster.EtcdCluster(3) as etcd:
                procs = self.start(etcd, 3, "elastic", kill or "9:9:9",
                                   extra_env={"WORKER_STEP_MS": "20"})
                time.sleep(1.0)
                etcd.kill(0)
                codes, out, err = self.finish(procs)
                survivors = [r for r in range(3) if not kill or r != 0]
                self.assertEqual([(r, n, once) for r, n, _, once in elastic_results(out)],
                                 [(str(r), str(len(survivors)), "yes") for r in survivors],
                                 out + err + etcd.logs())
                self.assertEqual(len({h for _, _, h, _ in elastic_results(out)}), 1, out)

    def test_an_endpoint_that_refuses_or_does_not_resolve_fails_in_seconds(self):
        # Nothing listens at the port (connection refused at once), or the host has no address:
        # the worker and ddprun give up after the store's short window for a starting cluster
        # (a quarter of their timeout, at most 10 s: here 2 s), not at their timeouts (here 8 s;
        # by default 5 min and 300 s, the window then 10 s), naming the endpoints and what to
        # check.
        for endpoint in (f"127.0.0.1:{free_port()}", "no-such-host.invalid:2379"):
            t0 = time.monotonic()
            r = subprocess.run([WORKER, "allreduce"], capture_output=True, text=True,
                               timeout=LIMIT, env={**os.environ, "RANK": "0", "WORLD_SIZE": "2",
                                                   "DDP_STORE": f"etcd://{endpoint}/j",
                                                   "DDP_TIMEOUT": "8"})
            took = time.monotonic() - t0
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(f"the rendezvous store in etcd {endpoint} (namespace j) cannot be "
                          "reached: no member accepts connections", r.stderr)
            self.assertIn("check the client URLs in DDP_STORE", r.stderr)
            self.assertLess(took, 6, r.stderr)  # the window, not the timeout
            t0 = time.monotonic()
            r = ddprun("--nnodes", "1", "--nproc-per-node", "2", "--join-timeout", "8",
                       "--rdzv-backend", "etcd",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", "refused", WORKER, "allreduce")
            took = time.monotonic() - t0
            self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("cannot be reached: no member accepts connections", r.stderr)
            self.assertLess(took, 6, r.stderr)

    def test_bad_addresses_and_a_token_are_refused_saying_why(self):
        with etcd_cluster.EtcdCluster(1) as etcd:
            for url, says in (("etcd://127.0.0.1", "every endpoint needs a host and a port"),
                              ("etcd://127.0.0.1:1/a b", "the namespace may hold"),
                              (etcd.url("x").rsplit("/", 1)[0],
                               "names no namespace and no launcher gives a run id")):
                r = subprocess.run([WORKER, "allreduce"], capture_output=True, text=True,
                                   timeout=LIMIT, env={**os.environ, "RANK": "0",
                                                       "WORLD_SIZE": "2", "DDP_STORE": url})
                self.assertNotEqual(r.returncode, 0)
                self.assertIn(says, r.stderr)
            r = subprocess.run([WORKER, "allreduce"], capture_output=True, text=True,
                               timeout=LIMIT, env={**os.environ, "RANK": "0", "WORLD_SIZE": "2",
                                                   "DDP_STORE": etcd.url("t"),
                                                   "DDP_TOKEN": "secret"})
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("an etcd store does not check ddp's token", r.stderr)


def slurm_cluster():
    """Whether srun can reach a Slurm cluster (scripts/slurm.sh start makes one here)."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and ("idle" in r.stdout or "mix" in r.stdout)


@unittest.skipIf(not slurm_cluster(),
                 "needs a Slurm cluster: scripts/slurm.sh start, then SLURM_CONF as it prints")
class RealSlurm(Base):
    """The worker program, unchanged, under the real srun of slurm-wlm."""

    def launch(self, *cmd, env=None):
        return subprocess.run(list(map(str, cmd)), capture_output=True, text=True,
                              timeout=3 * LIMIT, env={**os.environ, **(env or {})})

    def test_srun_four_tasks(self):
        r = self.launch("srun", "-N1", "-n4", WORKER, "allreduce")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(re.findall(r"rank (\d)/4 local \d/4 node 0 launcher slurm "
                                           r"transport shm restart \? sum ok", r.stdout)),
                         ["0", "1", "2", "3"], r.stdout + r.stderr)

    def test_two_steps_of_one_job_at_once(self):
        # Two job steps side by side in one allocation: each has its own store port (derived
        # from the job id and the step id), so neither joins the other's rendezvous.
        r = self.launch("salloc", "-N1", "-n4", "sh", "-c",
                     f"srun -n2 --exact {WORKER} allreduce & srun -n2 --exact {WORKER} allreduce; "
                     "wait", env={"WORKER_HOLD_MS": "1500"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(re.findall(r"rank (\d)/2 local \d/2 node 0 launcher slurm",
                                           r.stdout)), ["0", "0", "1", "1"], r.stdout + r.stderr)

    def test_the_readme_loop_loses_a_task_and_the_others_finish(self):
        # srun keeps the other tasks of a step running when one exits with an error (unless
        # --kill-on-bad-exit): the README's ddp::Elastic loop goes on with the two others, rank
        # 1 lost, then in another run the last rank; the same model as a job started by hand.
        for dead, kill in ((1, "1:0:5"), (2, "2:1:3")):
            r = self.launch("srun", "-N1", "-n3", WORKER, "elastic", kill)
            self.assertNotEqual(r.returncode, 0, r.stdout)  # srun reports the lost task
            found = elastic_results(r.stdout)
            self.assertEqual([(x, n, once) for x, n, _, once in found],
                             [(str(x), "2", "yes") for x in range(3) if x != dead],
                             r.stdout + r.stderr)
            self.assertEqual(len({h for _, _, h, _ in found}), 1, r.stdout)

    def test_a_failing_task_fails_the_step(self):
        r = self.launch("srun", "-N1", "-n2", "--kill-on-bad-exit=1", WORKER, "exit", 1, 4)
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn("rank 1 fails on purpose", r.stderr)


class Namespaces:
    """Two network namespaces joined by a veth pair: node 0 at 10.231.0.1, node 1 at 10.231.0.2."""

    def __init__(self):
        self.names = [f"ddp{os.getpid()}a", f"ddp{os.getpid()}b"]
        self.addrs = ["10.231.0.1", "10.231.0.2"]

    def sh(self, *cmd):
        subprocess.run(cmd, check=True, capture_output=True)

    def __enter__(self):
        a, b = self.names
        self.sh("ip", "netns", "add", a)
        self.sh("ip", "netns", "add", b)
        self.sh("ip", "link", "add", f"{a}v", "netns", a, "type", "veth", "peer", "name", f"{b}v",
                "netns", b)
        for ns, dev, addr in ((a, f"{a}v", self.addrs[0]), (b, f"{b}v", self.addrs[1])):
            self.sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            self.sh("ip", "-n", ns, "link", "set", dev, "up")
            self.sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc):
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def start_c10d(self, node, port, *args):
        """torchrun's multi-node line: no --node-rank, the c10d endpoint on node 0's address."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[node], DDPRUN, "--nnodes=2", "--nproc_per_node=2",
             "--rdzv_id=7", "--rdzv_backend=c10d", f"--rdzv_endpoint={self.addrs[0]}:{port}",
             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def start(self, node, port, *args):
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[node], DDPRUN, "--nnodes", "2", "--node-rank",
             str(node), "--master-addr", self.addrs[0], "--master-port", str(port),
             "--nproc-per-node", "2", *map(str, args)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def netns_unavailable():
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"ddpprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


MPI_TEST = os.environ.get("DDP_MPI_TEST", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(WORKER))), "tests", "ddp-mpi-test"))
NETNS_RSH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_rsh.sh")


@unittest.skipIf(netns_unavailable(), netns_unavailable() or "")
@unittest.skipIf(shutil.which("mpirun") is None, "needs Open MPI's mpirun")
class MpirunTwoNodes(Base):
    """Open MPI's mpirun over two "hosts" that are network namespaces (2 ranks each): mpirun runs
    in node 0's namespace and starts node 1's daemon through an rsh agent (netns_rsh.sh)."""

    def mpirun(self, ns, *args):
        # mpirun and node 0's ranks get the host name of node 0's namespace, as netns_rsh.sh gives
        # node 1 its own.
        cmd = ["ip", "netns", "exec", ns.names[0], "unshare", "--uts", "sh", "-c",
               'hostname "$0" && exec "$@"', ns.names[0], "mpirun", "--host",
               f"{ns.addrs[0]}:2,{ns.addrs[1]}:2", "-np", "4", "--mca", "plm_rsh_agent", NETNS_RSH,
               "--mca", "btl", "self,vader,tcp"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        env = {**os.environ,
               "DDP_NETNS_HOSTS": f"{ns.addrs[0]}={ns.names[0]},{ns.addrs[1]}={ns.names[1]}"}
        return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True,
                              timeout=LIMIT * 2, env=env)

    def test_backend_host_over_tcp_between_the_nodes(self):
        with Namespaces() as ns:
            r = self.mpirun(ns, "-x", f"MASTER_ADDR={ns.addrs[0]}", "-x", "MASTER_PORT=29621",
                            WORKER, "allreduce")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        lines = sorted(r.stdout.splitlines())
        self.assertEqual(len(lines), 4, r.stdout + r.stderr)
        for rank, line in enumerate(lines):
            # Shared memory inside each node, TCP between: the hierarchical all_reduce (slices).
            self.assertRegex(line, rf"^rank {rank}/4 local {rank % 2}/2 node {rank // 2} "
                                   r"launcher openmpi transport tcp hierarchy slices restart \? "
                                   r"sum ok$")

    def test_without_master_addr_backend_host_says_what_to_export(self):
        # Rank 0's host is not in Open MPI's environment: a job across hosts must name it.
        with Namespaces() as ns:
            r = self.mpirun(ns, "-x", "MASTER_PORT=29622", WORKER, "allreduce")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertRegex(r.stderr, r"rank [0-3]: Communicator::init: the job spans 2 hosts but "
                                   r"MASTER_ADDR is not set.*mpirun -x MASTER_ADDR=")

    @unittest.skipIf(not os.access(MPI_TEST, os.X_OK), f"needs {MPI_TEST} (built with ddp::mpi)")
    def test_backend_mpi_suite_across_the_nodes(self):
        with Namespaces() as ns:
            # As for the mpi tests in tests/CMakeLists.txt: in a sanitizer build, Open MPI's
            # plugins keep allocations past MPI_Finalize; ddp's leaks are checked elsewhere.
            r = self.mpirun(ns, "-x", "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1", MPI_TEST,
                            "--no-colors")
        self.assertEqual(r.returncode, 0, r.stdout[-4000:] + r.stderr[-4000:])
        # Every rank ran every case (the local group is the 2 ranks of its host, not all 4).
        passed = re.findall(r"test cases: *(\d+) \| *(\d+) passed \| *0 failed", r.stdout)
        self.assertEqual(len(passed), 4, r.stdout[-4000:])
        self.assertTrue(all(int(n) >= 10 and n == ok for n, ok in passed), passed)


@unittest.skipIf(netns_unavailable(), netns_unavailable() or "")
@unittest.skipIf(netns_unavailable() or not etcd_cluster.available(),
                 netns_unavailable() or "needs etcd (apt-get install etcd-server)")
class EtcdTwoNodes(Base):
    """Two ddprun nodes in two network namespaces with --rdzv-backend etcd: a 3-member etcd
    cluster (one member on node 0's address, two on node 1's), no node hosting the store."""

    def test_losing_node_0s_ddprun_and_its_workers_the_other_node_finishes(self):
        with Namespaces() as ns:
            wrap = lambda i: ["ip", "netns", "exec", ns.names[0 if i == 0 else 1]]  # noqa: E731
            with etcd_cluster.EtcdCluster(3, addrs=[ns.addrs[0], ns.addrs[1], ns.addrs[1]],
                                          wrap=wrap) as etcd:
                rid = f"twonodes{os.getpid()}"
                env = {**os.environ, "WORKER_STEP_MS": "30", "DDP_HEARTBEAT": "2"}
                nodes = [subprocess.Popen(
                    ["ip", "netns", "exec", ns.names[n], DDPRUN, "--nnodes", "2", "--node-rank",
                     str(n), "--nproc-per-node", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                     etcd.endpoints(), "--rdzv-id", rid, "--on-failure", "shrink", WORKER,
                     "elastic", "9:9:9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True, env=env) for n in (0, 1)]
                time.sleep(3.0)  # training
                nodes[0].send_signal(signal.SIGKILL)  # ddprun itself (ip netns exec execs it)
                out1, err1 = nodes[1].communicate(timeout=3 * LIMIT)
                nodes[0].communicate(timeout=LIMIT)
                self.assertEqual(nodes[1].returncode, 0, out1 + err1 + etcd.logs())
                found = elastic_results(out1)
                self.assertEqual([(r, n, once) for r, n, _, once in found],
                                 [("2", "2", "yes"), ("3", "2", "yes")], out1 + err1)
                self.assertEqual(len({h for _, _, h, _ in found}), 1, out1)


def nft_unavailable():
    if netns_unavailable():
        return netns_unavailable()
    if shutil.which("nft") is None:
        return "needs nftables (apt-get install nftables)"
    return None


def cut_data_links(ns, node, store_ports):
    """Node `node`'s links to the other node down but for the store's ports (its data network
    down, its store network up): every other packet between them is dropped, in both ways."""
    other = ns.addrs[1 - node]
    ports = "{ " + ", ".join(map(str, store_ports)) + " }"
    rules = f"""table inet ddpcut {{
  chain in {{ type filter hook input priority 0; policy accept;
    ip saddr {other} tcp sport {ports} accept; ip saddr {other} drop; }}
  chain out {{ type filter hook output priority 0; policy accept;
    ip daddr {other} tcp dport {ports} accept; ip daddr {other} drop; }}
}}
"""
    subprocess.run(["ip", "netns", "exec", ns.names[node], "nft", "-f", "-"], input=rules,
                   text=True, check=True, capture_output=True)


@unittest.skipIf(nft_unavailable(), nft_unavailable() or "")
class Partition(Base):
    """Two ddprun nodes of two workers under --on-failure shrink; node 1's data links to node 0
    are cut while both still reach the store (ddprun's, then etcd's): the workers cannot
    connect across the cut, and the side with rank 0 (of two equal sides) goes on alone."""

    def check_partition(self, out0, err0, out1, err1, rc0):
        self.assertEqual(rc0, 0, out0 + err0 + err1)
        found = elastic_results(out0)
        self.assertEqual([(r, n, once) for r, n, _, once in found],
                         [("0", "2", "yes"), ("1", "2", "yes")], out0 + err0 + err1)
        self.assertEqual(len({h for _, _, h, _ in found}), 1, out0)
        self.assertEqual(elastic_results(out1), [], out1)
        self.assertIn("could not connect to ranks 0, 1", err1)
        self.assertIn("was left out of the job and ends (exit status 75)", err1)

    def test_a_node_cut_from_the_others_but_not_from_the_store_is_left_out(self):
        env = {**os.environ, "WORKER_STEP_MS": "60", "DDP_TIMEOUT": "4"}
        with Namespaces() as ns:
            port = 29631
            nodes = [subprocess.Popen(
                ["ip", "netns", "exec", ns.names[n], DDPRUN, "--nnodes", "2", "--node-rank",
                 str(n), "--master-addr", ns.addrs[0], "--master-port", str(port),
                 "--nproc-per-node", "2", "--on-failure", "shrink", WORKER, "elastic", "9:9:9"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for n in (0, 1)]
            time.sleep(2.5)  # training
            cut_data_links(ns, 1, [port])
            out0, err0 = nodes[0].communicate(timeout=3 * LIMIT)
            out1, err1 = nodes[1].communicate(timeout=LIMIT)
        self.check_partition(out0, err0, out1, err1, nodes[0].returncode)

    @unittest.skipIf(not etcd_cluster.available(), "needs etcd (apt-get install etcd-server)")
    def test_the_same_with_the_store_in_etcd(self):
        env = {**os.environ, "WORKER_STEP_MS": "60", "DDP_TIMEOUT": "4"}
        with Namespaces() as ns:
            wrap = lambda i: ["ip", "netns", "exec", ns.names[0]]  # noqa: E731
            with etcd_cluster.EtcdCluster(1, addrs=[ns.addrs[0]], wrap=wrap) as etcd:
                rid = f"partition{os.getpid()}"
                nodes = [subprocess.Popen(
                    ["ip", "netns", "exec", ns.names[n], DDPRUN, "--nnodes", "2", "--node-rank",
                     str(n), "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                     "--rdzv-endpoint", etcd.endpoints(), "--rdzv-id", rid, "--on-failure",
                     "shrink", WORKER, "elastic", "9:9:9"], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, env=env) for n in (0, 1)]
                time.sleep(2.5)
                cut_data_links(ns, 1, etcd.client)
                out0, err0 = nodes[0].communicate(timeout=3 * LIMIT)
                out1, err1 = nodes[1].communicate(timeout=LIMIT)
                self.check_partition(out0, err0, out1, err1 + etcd.logs(), nodes[0].returncode)


class MultiNode(Base):
    def test_all_reduce_across_two_nodes_over_tcp(self):
        with Namespaces() as ns:
            port = 29611
            p0 = ns.start(0, port, WORKER, "allreduce")
            p1 = ns.start(1, port, WORKER, "allreduce")
            out0, err0 = p0.communicate(timeout=LIMIT)
            out1, err1 = p1.communicate(timeout=LIMIT)
        self.assertEqual((p0.returncode, p1.returncode), (0, 0), err0 + err1)
        lines = sorted((out0 + out1).splitlines())
        self.assertEqual(len(lines), 4, lines)
        for rank, line in enumerate(lines):
            self.assertRegex(line, rf"^\[r{rank}\] rank {rank}/4 local {rank % 2}/2 node {rank // 2} "
                                   r"launcher ddprun transport tcp hierarchy slices restart 0 "
                                   r"sum ok$")

    def test_fully_sharded_is_bitwise_ddp_across_two_nodes(self):
        # Two hosts of two ranks (the slices hierarchy): all_reduce adds each host's sum, and the
        # fully sharded model's reduce_scatter adds in that order, so that its parameters are
        # bitwise GradientAverager's.
        with Namespaces() as ns:
            port = 29616
            p0 = ns.start(0, port, WORKER, "sharded", 6)
            p1 = ns.start(1, port, WORKER, "sharded", 6)
            out0, err0 = p0.communicate(timeout=LIMIT)
            out1, err1 = p1.communicate(timeout=LIMIT)
        self.assertEqual((p0.returncode, p1.returncode), (0, 0), err0 + err1)
        self.assertEqual(sorted((out0 + out1).splitlines()),
                         [f"[r{r}] rank {r} hierarchy slices sharded bitwise" for r in range(4)])

    def test_torchrun_c10d_line_without_node_ranks(self):
        # Node 1 starts first: it cannot listen at node 0's address, so it joins as a client
        # and waits; node 0's launcher hosts the store and is node 0.
        with Namespaces() as ns:
            port = 29615
            p1 = ns.start_c10d(1, port, WORKER, "allreduce")
            time.sleep(0.5)
            p0 = ns.start_c10d(0, port, WORKER, "allreduce")
            out0, err0 = p0.communicate(timeout=LIMIT)
            out1, err1 = p1.communicate(timeout=LIMIT)
        self.assertEqual((p0.returncode, p1.returncode), (0, 0), err0 + err1)
        lines = sorted((out0 + out1).splitlines())
        self.assertEqual(len(lines), 4, lines)
        for rank, line in enumerate(lines):
            self.assertRegex(line, rf"^\[r{rank}\] rank {rank}/4 local {rank % 2}/2 node {rank // 2} "
                                   r"launcher ddprun transport tcp ")
        self.assertEqual([l for l in out0.splitlines() if "node 1" in l], [])

    def test_failure_on_one_node_stops_the_other(self):
        with Namespaces() as ns:
            port = 29612
            p0 = ns.start(0, port, WORKER, "loop", self.dir)
            p1 = ns.start(1, port, WORKER, "loop", self.dir)
            pids = wait_for_files([f"{self.dir}/pid.{r}" for r in range(4)], p0)
            os.kill(pids[3], signal.SIGKILL)  # rank 3 lives on node 1
            out1, err1 = p1.communicate(timeout=LIMIT)
            out0, err0 = p0.communicate(timeout=LIMIT)
        self.assertEqual(p1.returncode, 137, err1)
        self.assertRegex(err1, r"root cause: node 1: rank 3 \(local_rank 1, pid \d+\) was killed by SIGKILL")
        self.assertEqual(p0.returncode, 137, err0)
        self.assertRegex(err0, r"root cause: node 1: rank 3 \(local_rank 1, pid \d+\) was killed by "
                               r"SIGKILL")
        self.assertGone(pids[:2])

    def test_interrupt_on_one_node_stops_both(self):
        with Namespaces() as ns:
            port = 29614
            p0 = ns.start(0, port, "--max-restarts", 3, WORKER, "loop", self.dir)
            p1 = ns.start(1, port, "--max-restarts", 3, WORKER, "loop", self.dir)
            pids = wait_for_files([f"{self.dir}/pid.{r}" for r in range(4)], p0)
            p1.send_signal(signal.SIGINT)  # reaches ddprun itself (ip netns exec execs it)
            out1, err1 = p1.communicate(timeout=LIMIT)
            out0, err0 = p0.communicate(timeout=LIMIT)
        self.assertEqual(p1.returncode, 130, err1)
        self.assertEqual(p0.returncode, 130, err0)  # an interrupt is never restarted
        self.assertIn("root cause: node 1: ddprun on node 1 received SIGINT", err0)
        self.assertNotIn("restarting", err0 + err1)
        self.assertGone(pids)

    def test_restart_across_nodes(self):
        with Namespaces() as ns:
            port = 29613
            p0 = ns.start(0, port, "--max-restarts", 1, WORKER, "exit", 3, 4, "once")
            p1 = ns.start(1, port, "--max-restarts", 1, WORKER, "exit", 3, 4, "once")
            out0, err0 = p0.communicate(timeout=LIMIT)
            out1, err1 = p1.communicate(timeout=LIMIT)
        self.assertEqual((p0.returncode, p1.returncode), (0, 0), err0 + err1)
        self.assertEqual(sorted(re.findall(r"rank (\d)/4 .* restart 1 sum ok", out0 + out1)),
                         ["0", "1", "2", "3"])


if __name__ == "__main__":
    unittest.main()
