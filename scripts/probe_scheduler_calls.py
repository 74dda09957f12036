#!/usr/bin/env python
"""Probe: what a scheduler-thread call costs while another connector keeps loading, and why the slow ones are slow.

Against one real node (started here, stopped by its PID at the end), a
connector of ``--call-blocks`` rows of ``--call-size`` (same-host, CPU) times
``lookup()`` then ``load()``, ``start_lookup()`` then ``load_lookup()``, and
``offload()`` of as many blocks under fresh hashes,
``--calls`` times each, while a second connector in the same process loads
``--bg-blocks`` x ``--bg-size`` in a loop: ``scripts/bench.py``'s scheduler
section on its own. After set-up the process is ``gc.freeze()``-d, as engines
do.

Each timed call is split from outside its timed window: the thread's CPU
time, its run-queue time (``/proc/thread-self/schedstat``: runnable, waiting
for a CPU) and the garbage collections that ran on it (``gc.callbacks``). A
call over ``--slow-us`` is put in the kind that took most of it: "run queue",
"GC" (a collection on this thread) or "on CPU" (its own work, including
cache misses).

``--bg-listener`` makes the background connector load over the node's UCX
listener instead (its blocks checked on its loop thread as they land).

Usage: probe_scheduler_calls.py [--calls 500] [--call-blocks 64] [--call-size 16KiB] [--bg-blocks 256]
       [--bg-size 256KiB] [--slow-us 300] [--no-background] [--bg-listener]
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LEAF = "a"
TIMEOUT = 30.0
WARMUP = 5


def _chain(count: int, seed: bytes) -> list[bytes]:
    hashes, h = [], seed
    for i in range(count):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        hashes.append(h)
    return hashes


class _CallSplit:
    """The timed calls of one op, and for those over the bound the kind that took most of each."""

    def __init__(self, slow_ns: int) -> None:
        self.slow_ns = slow_ns
        self.took: list[int] = []
        self.slow: collections.Counter[str] = collections.Counter()
        self.cpu: list[int] = []  # the thread's own CPU time in each call
        self.off: list[int] = []  # neither on a CPU nor queued for one: blocked (the GIL, a lock)

    def add(self, took: int, cpu: int, queued: int | None, gc_ns: int) -> None:
        self.took.append(took)
        self.cpu.append(cpu)
        if queued is not None:
            self.off.append(max(0, took - cpu - queued))
        if took <= self.slow_ns:
            return
        parts = {"run queue": queued or 0, "GC": gc_ns, "on CPU": max(0, cpu - gc_ns)}
        self.slow[max(parts, key=parts.__getitem__)] += 1

    def line(self, name: str, slow_us: float) -> str:
        us = sorted(t / 1e3 for t in self.took)
        p99 = us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]
        kinds = ", ".join(f"{kind} {self.slow[kind]}" for kind in ("run queue", "GC", "on CPU"))
        off = f"{statistics.median(self.off) / 1e3:.1f}" if self.off else "?"
        return (f"  {name:15s} p50 {statistics.median(us):8.1f} µs   p99 {p99:8.1f} µs   "
                f"over {slow_us:.0f} µs: {sum(self.slow.values())} ({kinds})\n"
                f"  {'':15s} p50 on its CPU {statistics.median(self.cpu) / 1e3:.1f} µs, "
                f"blocked (the GIL, a lock) {off} µs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--call-blocks", type=int, default=64)
    parser.add_argument("--call-size", default="16KiB")
    parser.add_argument("--bg-blocks", type=int, default=256)
    parser.add_argument("--bg-size", default="256KiB")
    parser.add_argument("--slow-us", type=float, default=300.0)
    parser.add_argument("--no-background", action="store_true", help="time the calls with nothing else loading")
    parser.add_argument("--bg-listener", action="store_true",
                        help="the background connector loads over the node's UCX listener (checked as its blocks land)")
    args = parser.parse_args(argv)

    import torch

    from bench_common import frozen_heap, run_queue_ns
    from bench_common import wait_done as wait_until_done
    from cluster.process import start_node
    from connector.dkv_connector import DKVConnector
    from connector.types import full_attention
    from dkv.units import format_size, parse_size

    call_size, bg_size = parse_size(args.call_size), parse_size(args.bg_size)
    if args.calls < 1 or not 1 <= args.call_blocks <= 4096 or not 1 <= args.bg_blocks <= 4096 or min(
            call_size, bg_size) < 1:
        parser.error("--calls >= 1, --call-blocks and --bg-blocks in [1, 4096], sizes >= 1 byte")

    def wait_done(item: Any, what: str) -> None:
        wait_until_done(item, what, TIMEOUT, SystemExit)

    offloaded = call_size * args.call_blocks * (WARMUP + args.calls + 1)  # every offload() is kept: none evicts
    pool = 2 * (call_size * args.call_blocks + bg_size * args.bg_blocks) + offloaded + (16 << 20)
    node = start_node("--log-level", "WARNING", pool=str(pool), exit_with_parent=True)
    made: list[Any] = []
    stop = threading.Event()
    background: threading.Thread | None = None
    try:
        def connector(namespace: str, rows: torch.Tensor, local: bool | None = None) -> Any:
            conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace=namespace,
                                node=str(node.address), timeout=TIMEOUT, local=local)
            made.append(conn)
            return conn

        call_rows = torch.randint(0, 256, (args.call_blocks + 1, call_size), dtype=torch.uint8)
        bg_rows = torch.randint(0, 256, (args.bg_blocks + 1, bg_size), dtype=torch.uint8)
        call_ids, bg_ids = list(range(1, args.call_blocks + 1)), list(range(1, args.bg_blocks + 1))
        call_hashes, bg_hashes = _chain(args.call_blocks, b"c" * 32), _chain(args.bg_blocks, b"b" * 32)
        conn = connector("probe-calls", call_rows)
        bg = connector("probe-background", bg_rows, local=False if args.bg_listener else None)
        wait_done(conn.offload({LEAF: call_ids}, {LEAF: call_hashes}), "the calls' offload")
        wait_done(bg.offload({LEAF: bg_ids}, {LEAF: bg_hashes}), "the background offload")

        loads = [0]
        failure: list[BaseException] = []

        def keep_loading() -> None:
            try:
                while not stop.is_set():
                    handle = bg.start_lookup(bg_hashes)
                    wait_done(handle, "a background lookup")
                    wait_done(bg.load_lookup(handle, {LEAF: bg_ids}, {LEAF: bg_hashes}), "a background load")
                    loads[0] += 1
            except BaseException as exc:  # noqa: BLE001 - reported after the calls
                failure.append(exc)

        gc_ns = [0]  # collections on the calling thread, summed
        gc_runs: collections.Counter[int] = collections.Counter()
        started: dict[int, int] = {}
        me = threading.get_ident()

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if threading.get_ident() != me:
                return
            if phase == "start":
                started[me] = time.perf_counter_ns()
            elif me in started:
                gc_ns[0] += time.perf_counter_ns() - started.pop(me)
                gc_runs[info["generation"]] += 1

        slow_ns = int(args.slow_us * 1e3)
        split = {name: _CallSplit(slow_ns) for name in ("load()", "load_lookup()", "offload()")}

        def timed(name: str, call: Callable[[], Any], record: bool) -> Any:
            queued, gc_before, cpu = run_queue_ns(), gc_ns[0], time.thread_time_ns()
            t0 = time.perf_counter_ns()
            result = call()
            took = time.perf_counter_ns() - t0
            cpu = time.thread_time_ns() - cpu
            after = run_queue_ns()
            if record:
                split[name].add(took, cpu, None if queued is None or after is None else after - queued,
                                gc_ns[0] - gc_before)
            return result

        with frozen_heap(on_gc):
            if not args.no_background:
                background = threading.Thread(target=keep_loading, name="probe-background", daemon=True)
                background.start()
            t_start = time.monotonic()
            try:
                for i in range(WARMUP + args.calls):
                    record = i >= WARMUP
                    if record and i == WARMUP:
                        gc_ns[0] = 0
                        gc_runs.clear()
                    if failure:
                        raise SystemExit(f"the background load failed: {failure[0]}")
                    if not all(conn.lookup(call_hashes)[LEAF]):
                        raise SystemExit("the lookup before load() missed")
                    wait_done(timed("load()", lambda: conn.load({LEAF: call_ids}, {LEAF: call_hashes}), record), "load()")
                    handle = conn.start_lookup(call_hashes)
                    wait_done(handle, "start_lookup()")
                    wait_done(timed("load_lookup()", lambda: conn.load_lookup(handle, {LEAF: call_ids},
                                                                              {LEAF: call_hashes}), record),
                              "load_lookup()")
                    fresh = _chain(args.call_blocks, i.to_bytes(4, "little") * 8)  # stored at once, never held before
                    wait_done(timed("offload()", lambda: conn.offload({LEAF: call_ids}, {LEAF: fresh}), record),
                              "offload()")
            finally:
                stop.set()
                if background is not None:
                    background.join(TIMEOUT)
        elapsed = time.monotonic() - t_start
        if failure:
            raise SystemExit(f"the background load failed: {failure[0]}")
        bg_client = bg._clients.get(bg.node_address)  # (the path its loads took, as the node answered)
        bg_path = "unknown" if bg_client is None else "same-host" if bg_client.uses_shared_memory else "listener"
        meanwhile = ("with nothing else loading" if args.no_background else
                     f"while {args.bg_blocks} x {format_size(bg_size)} {bg_path} loads run ({loads[0]} loads, "
                     f"{loads[0] * args.bg_blocks * bg_size / 1e9 / max(elapsed, 1e-9):.2f} GB/s)")
        print(f"scheduler-thread calls, {args.call_blocks} x {format_size(call_size)}, {args.calls} each, {meanwhile}; "
              f"load average {os.getloadavg()[0]:.2f}")
        for name, calls in split.items():
            print(calls.line(name, args.slow_us))
        generations = ", ".join(f"gen {g}: {n}" for g, n in sorted(gc_runs.items())) or "none"
        print(f"  GC on this thread during the calls: {sum(gc_runs.values())} collections ({generations}), "
              f"{gc_ns[0] / 1e6:.1f} ms")
    finally:
        stop.set()
        for conn in made:
            conn.shutdown()
        node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
