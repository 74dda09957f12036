#!/usr/bin/env python
"""Probe: where a connector load's time goes, against memcpy and copy+checksum in the same run.

Against one real node (started here, stopped by its PID at the end), a
connector co-located with it loads ``--blocks`` blocks of ``--block-size``
(one leaf, one shard, CPU ``uint8`` rows) the way ``scripts/bench.py`` times a
load: ``start_lookup`` -> complete -> ``load_lookup`` -> complete. Each round
also times, on the calling thread, two limits over the same bytes:

  memcpy          ``np.copyto`` block by block between page-aligned buffers
                  (the bench's baseline);
  copy+checksum   the same copies, each block then checksummed (XXH3-128 of
                  its key prefix and bytes, :mod:`dkv.checksum`): what a
                  checked same-host copy cannot do without.

Inside the load, timing wrappers (installed here, on the classes, for this
process only) split it: the node round trip of the lookup on the loop thread
(``NodeClient.lookup``), or, where the handle's lookup runs in place (the
direct channel is open), its send on the calling thread
(``NodeClient.start_lookup_direct``) and the judging of its answer once a
poll found it whole (``NodeClient._direct_answer``); then, on the same-host path, the making of the
native copy from the slot map on the calling thread (``LeaseSlots.rows_copy``;
the native copy threads that run it take no Python, so nothing times them
here), or, for a load planned key by key (``--loop-path``, or without the
native build), the copy threads' work (``LeaseSlots._plan_and_copy`` on the
thread that plans the copy: its keys, views and plan, and its share), the
plan (``LeaseSlots._plan``) and, in Python, each chunk's checked copy
(``LeaseSlots._copy_and_verify``); a load small enough to be copied on the
calling thread shows ``NodeClient.read_here`` instead. Whatever the table does not name is wake-ups, hops and the
connector's bookkeeping. ``--loop-path`` also times, interleaved, the same
load the way a same-host load over 256 KiB went before the copy threads took
it: posted to the loop thread (``WorkerSide._read``, ``NodeClient.read``),
which then handed the copy on. ``--busy-caller`` also times, interleaved, the lookup and the load with the
calling thread busy in Python meanwhile (polling ``is_complete()`` between short runs of
pure Python, as a scheduler does between its steps): every hand-off of the
GIL to the thread doing the load then waits for the caller's switch
interval (``sys.getswitchinterval()``, printed: the connector's
``gil_switch_interval`` while it lives, see :mod:`dkv.gil`;
``--gil-switch-interval off`` leaves CPython's 5 ms). ``--listener`` loads over the node's UCX
listener instead (``local=False``), and also times the read on the loop
thread and its payload receive (``Connection.recv_payloads``), the checks of
landed blocks included; a load small enough for its blocks to come with the
lookup's answer (the connector's ``lookup_payload_bytes``) shows their
receipt (``NodeClient._receive_sent``, inside ``NodeClient.lookup``) and the
copy on the calling thread (``LeaseSlots.rows_copy``) instead of a read.
Where the connector reads over a direct channel (``direct_reads``: UCX has no
RDMA here), the read is ``NodeClient.read_rows_direct`` on a read thread
instead of the loop's, and the probe also prints that read's timeline, per
load, from ``load_lookup``'s return on the calling thread to the load seen
complete there: the hand-off to the read thread (to its
``DirectChannel.exchange_into_rows``), the request sent and the node's answer
read (``_receive_frame``), the answer judged (until ``_recv_rows`` begins),
the blocks received into the rows (``_recv_rows``) and the completion seen.

``memcpy / copy+checksum`` is the highest ``load / memcpy`` ratio a checked
load could reach if everything but its copy cost nothing.

Usage: probe_load_phases.py [--blocks 256] [--block-size 64KiB] [--rounds 30] [--listener | --loop-path]
       [--busy-caller] [--gil-switch-interval SECONDS|off]
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LEAF = "a"
PAGE = 4096
TIMEOUT = 30.0
WARMUP = 3


DIRECT_READ_STEPS = ("to the read thread", "request and the node's answer", "the answer judged",
                     "the blocks received", "completion seen")


@contextlib.contextmanager
def timed_direct_read(module: Any, stamps: dict[str, float]) -> Iterator[None]:
    """Stamp the steps of each direct read (``module`` is :mod:`dkv.direct_channel`) into ``stamps``.

    ``entered``: its ``exchange_into_rows`` began; ``answer``: the node's
    answer was read; ``rows``: the blocks' receive began; ``received``: it
    ended. Only the reading thread's calls count (a lookup's exchange on
    another thread reads frames too).
    """
    channel = module.DirectChannel
    originals = (channel.exchange_into_rows, module._receive_frame, module._recv_rows)
    reader: list[int] = [0]

    def exchange_into_rows(self: Any, *a: Any, **k: Any) -> Any:
        stamps.clear()
        reader[0] = threading.get_ident()
        stamps["entered"] = time.perf_counter()
        return originals[0](self, *a, **k)

    def receive_frame(*a: Any, **k: Any) -> Any:
        try:
            return originals[1](*a, **k)
        finally:
            if threading.get_ident() == reader[0] and "entered" in stamps:
                stamps["answer"] = time.perf_counter()

    def recv_rows(*a: Any, **k: Any) -> Any:
        stamps["rows"] = time.perf_counter()
        try:
            return originals[2](*a, **k)
        finally:
            stamps["received"] = time.perf_counter()

    channel.exchange_into_rows = exchange_into_rows
    module._receive_frame = receive_frame
    if originals[2] is not None:  # (not built: no read goes over a direct channel)
        module._recv_rows = recv_rows
    try:
        yield
    finally:
        channel.exchange_into_rows, module._receive_frame, module._recv_rows = originals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-size", default="64KiB")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--listener", action="store_true", help="load over the UCX listener (local=False)")
    parser.add_argument("--loop-path", action="store_true",
                        help="also time the same-host load posted to the loop thread (as before the copy threads)")
    parser.add_argument("--busy-caller", action="store_true",
                        help="also time the load while the calling thread runs Python (polling is_complete)")
    parser.add_argument("--gil-switch-interval", default=None,
                        help="the connector's gil_switch_interval: seconds, or 'off' (default: dkv.gil's)")
    args = parser.parse_args(argv)
    if args.listener and args.loop_path:
        parser.error("--loop-path is a same-host contender: not with --listener")

    import numpy as np
    import torch

    from bench_common import scheduler_step, timed_methods
    from bench_common import wait_done as wait_until_done
    from cluster.process import start_node
    from connector.dkv_connector import DKVConnector
    from connector.types import full_attention
    from connector import worker_side
    from connector.worker_side import WorkerSide
    from dkv import direct_channel
    from dkv.checksum import block_checksum
    from dkv.errors import ConfigError
    from dkv.gil import parse_switch_interval
    from dkv.client import NodeClient
    from dkv.lease_slots import LeaseSlots
    from dkv.transport import Connection
    from dkv.units import format_size, parse_size

    def wait_done(item: Any, what: str) -> None:
        wait_until_done(item, what, TIMEOUT, SystemExit)

    try:
        switch_interval = parse_switch_interval(args.gil_switch_interval, "--gil-switch-interval")
    except ConfigError as exc:
        parser.error(str(exc))
    size, count = parse_size(args.block_size), args.blocks
    if size < 1 or size % PAGE or not 1 <= count <= 4096 or args.rounds < 1:
        parser.error("--block-size a multiple of 4 KiB, --blocks in [1, 4096], --rounds >= 1")
    pool = max(64 << 20, 2 * size * count + (16 << 20))
    node = start_node("--log-level", "WARNING", pool=str(pool), exit_with_parent=True)
    conn: Any = None
    try:
        hashes, h = [], b"\0" * 32
        for i in range(count):
            h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
            hashes.append(h)
        rows = torch.randint(0, 256, (count + 1, size), dtype=torch.uint8)
        ids = list(range(1, count + 1))
        conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace="probe-phases",
                            node=str(node.address), timeout=TIMEOUT, local=False if args.listener else None,
                            gil_switch_interval=switch_interval)
        wait_done(conn.offload({LEAF: ids}, {LEAF: hashes}), "the offload")
        expected = rows[1:].clone()
        # the harness zeroes and checks the rows with numpy: a torch op over them runs on torch's
        # intra-op threads, which then spin for a while and, on a small machine, take the CPU the
        # node needs (that inflated the next lookup 2-5x in about a third of the rounds)
        row_bytes, expected_bytes = rows.numpy()[1:], expected.numpy()

        def aligned(nbytes: int) -> Any:
            raw = np.empty(nbytes + PAGE, dtype=np.uint8)
            start = (-raw.ctypes.data) % PAGE
            return raw[start:start + nbytes]

        src, dst = aligned(size * count), aligned(size * count)
        src[:] = np.frombuffer(expected.numpy().tobytes(), dtype=np.uint8)

        def memcpy() -> float:
            t0 = time.perf_counter()
            for i in range(count):
                np.copyto(dst[i * size:(i + 1) * size], src[i * size:(i + 1) * size])
            return time.perf_counter() - t0

        def copy_and_checksum() -> float:
            t0 = time.perf_counter()
            for i in range(count):
                block = dst[i * size:(i + 1) * size]
                np.copyto(block, src[i * size:(i + 1) * size])
                block_checksum(LEAF, 0, hashes[i], block)
            return time.perf_counter() - t0

        phases: dict[str, list[float]] = {"lookup (start_lookup -> complete)": [], "load_lookup call": [],
                                          "load (load_lookup -> complete)": [], "whole load": []}
        limits: dict[str, list[float]] = {"memcpy": [], "copy+checksum": []}
        inside: dict[str, list[float]] = {}
        wrapped = [(NodeClient, "lookup"), (NodeClient, "start_lookup_direct"), (NodeClient, "_direct_answer"),
                   (NodeClient, "_receive_sent"), (NodeClient, "read"), (NodeClient, "read_rows_direct"),
                   (NodeClient, "read_here"), (LeaseSlots, "rows_copy"),
                   (LeaseSlots, "_plan_and_copy"), (LeaseSlots, "_plan"), (LeaseSlots, "_copy_and_verify"),
                   (WorkerSide, "_read"), (Connection, "recv_payloads")]
        in_place = WorkerSide.load_in_place

        def through_the_loop(self: WorkerSide, state: Any, plan: Any) -> Any:
            """:meth:`WorkerSide.load_in_place` as before the copy threads: a load over its bound is posted."""
            return None if plan.nbytes > worker_side.IN_PLACE_LOAD_BYTES else in_place(self, state, plan)

        def dkv_load_through_the_loop() -> None:
            WorkerSide.load_in_place = through_the_loop  # type: ignore[method-assign]
            try:
                row_bytes.fill(0)
                t0 = time.perf_counter()
                handle = conn.start_lookup(hashes)
                wait_done(handle, "start_lookup")
                wait_done(conn.load_lookup(handle, {LEAF: ids}, {LEAF: hashes}), "the load")
                loop_path.append(time.perf_counter() - t0)
            finally:
                WorkerSide.load_in_place = in_place  # type: ignore[method-assign]
            if not np.array_equal(row_bytes, expected_bytes):
                raise SystemExit("the loaded rows are not the offloaded bytes")

        loop_path: list[float] = []
        if args.loop_path:
            phases["whole load, posted to the loop thread"] = loop_path
        busy_caller: list[float] = []
        busy_lookup: list[float] = []
        if args.busy_caller:
            phases["lookup, the caller busy in Python"] = busy_lookup
            phases["load, the caller busy in Python"] = busy_caller

        def dkv_load_busy_caller() -> None:
            row_bytes.fill(0)
            t0 = time.perf_counter()
            handle = conn.start_lookup(hashes)
            while not handle.is_complete():  # the lookup's steps on the loop thread wait for the GIL too
                scheduler_step()
                if time.perf_counter() - t0 > TIMEOUT:
                    raise SystemExit("the lookup did not complete while the calling thread was busy")
            busy_lookup.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            transfer = conn.load_lookup(handle, {LEAF: ids}, {LEAF: hashes})
            while not transfer.is_complete():
                scheduler_step()
                if time.perf_counter() - t0 > TIMEOUT:
                    raise SystemExit("the load did not complete while the calling thread was busy")
            busy_caller.append(time.perf_counter() - t0)
            if not np.array_equal(row_bytes, expected_bytes):
                raise SystemExit("the loaded rows are not the offloaded bytes")

        direct_read: dict[str, list[float]] = {name: [] for name in DIRECT_READ_STEPS}
        read_stamps: dict[str, float] = {}  # the latest direct read's, on its read thread (see timed_direct_read)

        def dkv_load() -> None:
            row_bytes.fill(0)
            read_stamps.clear()
            t0 = time.perf_counter()
            handle = conn.start_lookup(hashes)
            wait_done(handle, "start_lookup")
            t1 = time.perf_counter()
            if not all(handle.result()[LEAF]):
                raise SystemExit("the lookup missed")
            transfer = conn.load_lookup(handle, {LEAF: ids}, {LEAF: hashes})
            t2 = time.perf_counter()
            wait_done(transfer, "the load")
            t3 = time.perf_counter()
            if not np.array_equal(row_bytes, expected_bytes):
                raise SystemExit("the loaded rows are not the offloaded bytes")
            for name, seconds in zip(list(phases)[:4], (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[name].append(seconds)
            if len(read_stamps) == 4:  # (a load read over a direct channel)
                marks = (t2, read_stamps["entered"], read_stamps["answer"], read_stamps["rows"],
                         read_stamps["received"], t3)
                for name, begin, end in zip(DIRECT_READ_STEPS, marks, marks[1:]):
                    direct_read[name].append(end - begin)

        contenders: list[tuple[str, Callable[[], Any]]] = [
            ("dkv", dkv_load), ("memcpy", lambda: limits["memcpy"].append(memcpy())),
            ("copy+checksum", lambda: limits["copy+checksum"].append(copy_and_checksum()))]
        if args.loop_path:
            contenders.append(("dkv through the loop", dkv_load_through_the_loop))
        if args.busy_caller:
            contenders.append(("dkv, the caller busy", dkv_load_busy_caller))
        with timed_methods(wrapped, inside), timed_direct_read(direct_channel, read_stamps):
            for round_no in range(WARMUP + args.rounds):
                if round_no == WARMUP:
                    for samples in (*phases.values(), *limits.values(), *inside.values(), *direct_read.values()):
                        samples.clear()
                shift = round_no % len(contenders)
                for _, run in contenders[shift:] + contenders[:shift]:
                    run()
        if conn.counters.blocks_loaded < count * args.rounds * (1 + args.loop_path + args.busy_caller):
            raise SystemExit("the loads did not all load every block")

        def p50_ms(samples: list[float]) -> float:
            return statistics.median(samples) * 1e3

        memcpy_ms = p50_ms(limits["memcpy"])
        path = "listener" if args.listener else "same-host"
        print(f"{path} load of {count} x {format_size(size)}, {args.rounds} rounds, p50 (ms); "
              f"load average {os.getloadavg()[0]:.2f}; switch interval {sys.getswitchinterval() * 1e3:g} ms")
        for name, samples in (*limits.items(), *phases.items()):
            print(f"  {name:36s} {p50_ms(samples):8.3f}   {p50_ms(samples) / memcpy_ms:5.2f} x memcpy")
        print("  inside (the loop thread, the copy threads; read_here, rows_copy: on the calling thread):")
        for label, samples in ((label, samples) for label, samples in inside.items() if samples):
            print(f"    {label:34s} {p50_ms(samples):8.3f}   ({len(samples)} calls)")
        if direct_read[DIRECT_READ_STEPS[0]]:
            print(f"  the direct read, from load_lookup's return ({len(direct_read[DIRECT_READ_STEPS[0]])} loads):")
            for name, samples in direct_read.items():
                print(f"    {name:34s} {p50_ms(samples):8.3f}")
        whole = p50_ms(phases["whole load"])
        print(f"  load / memcpy {memcpy_ms / whole:.2f}; at most {memcpy_ms / p50_ms(limits['copy+checksum']):.2f} "
              "for a checked copy that costs nothing else")
    finally:
        if conn is not None:
            conn.shutdown()
        node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
