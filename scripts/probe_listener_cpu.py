#!/usr/bin/env python
"""Probe: what a listener load costs in CPU on both ends, against a plain TCP stream of the same bytes.

Against one real node (started here), a connector on the listener path
(``local=False``) loads ``--blocks`` blocks of ``--block-size`` the way
``scripts/bench.py`` times a load (``start_lookup`` -> complete ->
``load_lookup`` -> complete), in three contenders, interleaved round by round:

  dkv checked      the connector as shipped: every block checked against the
                   writer's checksum as it lands (:mod:`dkv.checksum`);
  dkv unchecked    a second connector with ``checksums=False`` (the same
                   blocks, the same node): what the checks cost;
  tcp stream       the bench's limit: a helper process (started here) sends
                   the same number of bytes over one loopback socket, which
                   this process receives with ``recv_into``.

For each: the wall time of a load (p50), and the CPU time it took in this
process (every thread: the calling thread, the connector's loop thread, copy
threads) and in the serving process (the node, or the TCP helper), summed
from each thread's ``/proc/.../schedstat`` over the timed window only, per
load (mean). ``cores busy`` is both processes' CPU over the wall time: near
the machine's core count, a contender is bound by the CPU, not by waiting.
It also prints the share of that CPU spent in the kernel (system time over
user and system time, from ``/proc/.../stat``: clock ticks, so summed over
every timed load). Every dKV load is checked bit-exact outside its timed
window.

The unchecked connector opens no direct channel and asks for no blocks with
its lookups (both need checksums): compare loads over
``lookup_payload_bytes`` (256 KiB), whose lookups and reads take the same
path either way.

``--pause`` times each contender after a pause instead of right after the
one before it, as a load that follows other work (the bench's contenders
run between each other's turns): ``idle`` (40 ms asleep: every process
idle), ``evict`` (256 MiB written on this thread first: the caches filled
with other bytes, the serving process idle meanwhile). The line under the
header says how long the pauses took.

``--pin`` puts the servers (the node and the TCP helper, every thread) on
the last CPU this process may use and this process on the others, before
any connector starts its threads: the layout of a deployment that gives its
node cores of its own. Unpinned, a load that follows a pause can run with
both ends on one CPU (the reader's threads follow the node that wakes
them); pinned, it cannot. The line under the header names the CPUs, as
each process reads them back.

Usage: probe_listener_cpu.py [--blocks 256] [--block-size 64KiB] [--rounds 20] [--pause none|idle|evict] [--pin]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LEAF = "a"
PAGE = 4096
TIMEOUT = 30.0
WARMUP = 2
HELPER_READY = 30.0  # seconds the TCP helper has to announce its port
IDLE_PAUSE = 0.04  # seconds asleep before each contender with --pause idle
EVICT_BYTES = 256 << 20  # bytes written before each contender with --pause evict


def cpu_seconds(pid: int) -> float:
    """Seconds on a CPU so far, summed over every thread of ``pid`` (``schedstat``: nanoseconds, not ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def user_system(pid: int) -> tuple[float, float]:
    """``pid``'s user and system seconds so far, every thread (``/proc/PID/stat``, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def share(part: float, rest: float) -> str:
    """``part`` as a percentage of ``part + rest``; a dash when no tick fell in either."""
    whole = part + rest
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def pin(pid: int, cpus: set[int]) -> str:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it); its CPU list as it reads back."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list:"))


def serve_tcp(portfile: Path) -> int:
    """The helper: on one connection, answer each 8-byte length with that many bytes, until it closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(HELPER_READY)
    tmp = portfile.with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": listener.getsockname()[1]}))
    tmp.rename(portfile)
    conn, _ = listener.accept()
    listener.close()
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytearray(0)
    header = bytearray(8)
    while True:
        got = 0
        while got < 8:
            n = conn.recv_into(memoryview(header)[got:])
            if n == 0:
                return 0
            got += n
        want = int.from_bytes(header, "little")
        if len(payload) < want:
            payload = bytearray(want)
        conn.sendall(memoryview(payload)[:want])


class TcpStream:
    """This process's end of the helper's stream."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def receive(self, into: memoryview) -> None:
        self.sock.sendall(len(into).to_bytes(8, "little"))
        got = 0
        while got < len(into):
            n = self.sock.recv_into(into[got:])
            if n == 0:
                raise SystemExit("the TCP helper closed the stream")
            got += n


def start_helper(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    portfile = workdir / "tcp.json"
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-tcp", str(portfile)],
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + HELPER_READY
    while not portfile.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit("the TCP helper did not start")
        time.sleep(0.02)
    return proc, int(json.loads(portfile.read_text())["port"])


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-size", default="64KiB")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pause", choices=("none", "idle", "evict"), default="none",
                        help="before each contender: nothing, 40 ms asleep, or 256 MiB written on this thread")
    parser.add_argument("--pin", action="store_true",
                        help="the node and the TCP helper on the last CPU, this process on the others")
    parser.add_argument("--serve-tcp", type=Path, default=None, help=argparse.SUPPRESS)  # the helper's own mode
    args = parser.parse_args(argv)
    if args.serve_tcp is not None:
        return serve_tcp(args.serve_tcp)

    import numpy as np
    import torch

    from bench_common import chained_hashes
    from bench_common import wait_done as wait_until_done
    from cluster.process import start_node
    from connector.dkv_connector import DKVConnector
    from connector.types import full_attention
    from dkv.units import format_size, parse_size

    def wait_done(item: Any, what: str) -> None:
        wait_until_done(item, what, TIMEOUT, SystemExit)

    size, count = parse_size(args.block_size), args.blocks
    if size < 1 or size % PAGE or not 1 <= count <= 4096 or args.rounds < 1:
        parser.error("--block-size a multiple of 4 KiB, --blocks in [1, 4096], --rounds >= 1")
    usable = sorted(os.sched_getaffinity(0))
    if args.pin and len(usable) < 2:
        parser.error(f"--pin needs at least two CPUs this process may use, not {len(usable)}")
    pool = max(64 << 20, 2 * size * count + (16 << 20))
    workdir = Path(tempfile.mkdtemp(prefix="dkv-probe-cpu-"))
    node = start_node("--log-level", "WARNING", pool=str(pool), workdir=workdir / "node", exit_with_parent=True)
    helper: subprocess.Popen[bytes] | None = None
    conns: list[Any] = []
    try:
        helper, port = start_helper(workdir)
        pinned = ""
        if args.pin:  # before any connector starts its threads (they inherit this thread's CPUs)
            servers, here_cpus = {usable[-1]}, set(usable[:-1])
            pinned = (f"  pinned: the node on CPU {pin(node.pid, servers)}, the TCP helper on CPU "
                      f"{pin(helper.pid, servers)}, this process on CPU {pin(os.getpid(), here_cpus)} (as read back)")
        stream = TcpStream(port)
        hashes = chained_hashes(count)
        rows = torch.randint(0, 256, (count + 1, size), dtype=torch.uint8)
        ids = list(range(1, count + 1))

        def connector(checksums: bool) -> Any:
            conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace="probe-cpu",
                                node=str(node.address), timeout=TIMEOUT, local=False, checksums=checksums)
            conns.append(conn)
            return conn

        checked, unchecked = connector(True), connector(False)
        wait_done(checked.offload({LEAF: ids}, {LEAF: hashes}), "the offload")
        row_bytes, expected = rows.numpy()[1:], rows[1:].clone().numpy()  # (numpy: no torch threads spinning)
        received = np.empty(size * count, dtype=np.uint8)
        evict = np.empty(EVICT_BYTES if args.pause == "evict" else 0, dtype=np.uint8)
        pauses: list[float] = []
        me = os.getpid()

        def dkv_load(conn: Any) -> Callable[[], None]:
            def load() -> None:
                handle = conn.start_lookup(hashes)
                wait_done(handle, "start_lookup")
                if not all(handle.result()[LEAF]):
                    raise SystemExit("the lookup missed")
                wait_done(conn.load_lookup(handle, {LEAF: ids}, {LEAF: hashes}), "the load")
            return load

        contenders: dict[str, tuple[Callable[[], None], int]] = {
            "dkv checked": (dkv_load(checked), node.pid),
            "dkv unchecked": (dkv_load(unchecked), node.pid),
            "tcp stream": (lambda: stream.receive(memoryview(received)), helper.pid),
        }
        wall: dict[str, list[float]] = {name: [] for name in contenders}
        here: dict[str, list[float]] = {name: [] for name in contenders}
        there: dict[str, list[float]] = {name: [] for name in contenders}
        splits = {name: [0.0, 0.0, 0.0, 0.0] for name in contenders}  # user, system: here, then the server
        names = list(contenders)
        for round_no in range(WARMUP + args.rounds):
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                run, server = contenders[name]
                if name.startswith("dkv"):
                    row_bytes.fill(0)
                paused = time.perf_counter()
                if args.pause == "idle":
                    time.sleep(IDLE_PAUSE)
                elif args.pause == "evict":
                    evict.fill(round_no & 0xFF)
                pauses.append(time.perf_counter() - paused)
                u0, k0 = user_system(me), user_system(server)
                c0, s0, t0 = cpu_seconds(me), cpu_seconds(server), time.perf_counter()
                run()
                t1, c1, s1 = time.perf_counter(), cpu_seconds(me), cpu_seconds(server)
                u1, k1 = user_system(me), user_system(server)
                if name.startswith("dkv") and not np.array_equal(row_bytes, expected):
                    raise SystemExit(f"{name}: the loaded rows are not the offloaded bytes")
                if round_no >= WARMUP:
                    wall[name].append(t1 - t0)
                    here[name].append(c1 - c0)
                    there[name].append(s1 - s0)
                    split = splits[name]
                    for i, delta in enumerate((u1[0] - u0[0], u1[1] - u0[1], k1[0] - k0[0], k1[1] - k0[1])):
                        split[i] += delta

        nbytes = size * count
        print(f"listener load of {count} x {format_size(size)} ({format_size(nbytes)}), {args.rounds} rounds; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
        if pinned:
            print(pinned)
        if args.pause != "none":
            what = "asleep" if args.pause == "idle" else f"writing {format_size(EVICT_BYTES)} on this thread"
            print(f"  each contender timed after a pause ({args.pause}): {statistics.median(pauses) * 1e3:.1f} ms "
                  f"{what} (median)")
        print(f"  {'contender':14s} {'wall p50 ms':>11s} {'GB/s':>6s} {'CPU here ms':>11s} {'CPU server ms':>13s} "
              f"{'cores busy':>10s}")
        for name in names:
            p50 = statistics.median(wall[name])
            cpu_here, cpu_there = statistics.mean(here[name]), statistics.mean(there[name])
            busy = (cpu_here + cpu_there) / statistics.mean(wall[name])
            print(f"  {name:14s} {p50 * 1e3:11.3f} {nbytes / p50 / 1e9:6.2f} {cpu_here * 1e3:11.3f} "
                  f"{cpu_there * 1e3:13.3f} {busy:10.2f}")
        print("  of that CPU, the share in the kernel (system time; clock ticks summed over the timed loads):")
        for name in names:
            user_here, system_here, user_there, system_there = splits[name]
            print(f"    {name:14s} here {share(system_here, user_here):>4s}   server {share(system_there, user_there):>4s}")
        checks_ms = (statistics.mean(here["dkv checked"]) - statistics.mean(here["dkv unchecked"])) * 1e3
        print(f"  the checks: {checks_ms:.3f} ms of CPU here per load; "
              f"checked / tcp stream {statistics.median(wall['tcp stream']) / statistics.median(wall['dkv checked']):.2f}, "
              f"unchecked / tcp stream "
              f"{statistics.median(wall['tcp stream']) / statistics.median(wall['dkv unchecked']):.2f} (throughput)")
    finally:
        for conn in conns:
            conn.shutdown()
        if helper is not None:
            stop(helper)
        node.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
