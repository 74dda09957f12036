#!/usr/bin/env python
"""Benchmark the KV connector: scheduler-thread cost of each call, and load/offload throughput vs the raw node path.

Usage::

    python scripts/bench_connector.py [--blocks 64,1024] [--page 64KiB] [--repeat 200] [--rounds 10]
                                      [--warmup 1] [--call-page 4KiB] [--busy 30] [--poll-us 0] [--gc-freeze]
                                      [--json out.json]

Set-up (all real processes, stopped by PID in ``finally``): one etcd, node ``a`` (the co-located
node) and node ``b`` (the peer), both cluster members (``--etcd URL --node-id ID``) so that the
connector's router has a directory index (``probe``) and can turn a hint into a peer. Every UCX
call of this process runs on the shared loop thread (:func:`dkv.loop_thread.acquire_shared_loop`):
the connectors' and the raw :class:`~dkv.client.NodeClient`'s alike. One leaf, one TP shard, so a
block is one key; device blocks are CPU ``uint8`` tensors (the copy engine's no-staging case).

1. **Scheduler-thread cost** (µs, p50/p99 over ``--repeat`` calls each, for every ``--blocks``
   count). Each call is timed on the calling thread from entry to return; before each one the
   loop thread is let go quiet (every task the connector posted has finished), and whatever the
   call started is waited for *outside* the timed interval. ``lookup`` is synchronous (it blocks
   for one round trip: reported, but engines should use ``start_lookup``); ``start_lookup``,
   ``load``, ``load_lookup``, ``offload`` and ``touch`` are return times only (validation and
   posting, not the round trip or the copy); ``probe`` answers from the etcd-fed index (hit: the
   whole chain announced; miss: nothing announced). The blocks are all present on node ``a``,
   so the offloads find them there already (their return time does not depend on that). These
   calls use ``--call-page`` pages: on CPU tensors no call touches block bytes on the calling
   thread, so the page size does not change them (the copies run on the loop thread).
   ``--busy N`` repeats the posting calls N times for the smallest block count while a real
   connector load of the largest block count (first ``--page`` size, same-host path) is copying
   on the loop thread (a sample counts only if the copy is running as the call starts): the cost
   an engine sees when it posts work while earlier transfers are moving. Every timed call also
   records whether the garbage collector ran meanwhile (in any thread), to explain tails: a
   full collection of a process that imported torch and ucxx scans ~200 k objects (tens of ms
   on a small machine); ``--gc-freeze`` freezes what each section's set-up left alive, as
   engines often do after start-up.
   The last row is the same-run baseline: posting an empty coroutine to the loop thread, the
   floor under every call that posts work (``start_lookup``, ``load*``, ``offload``, ``touch``).
   Goal: ``load``, ``load_lookup`` and ``offload`` return in <= 200 µs for 64 blocks (judged at
   p50 and at p99, loop idle).

2. **Throughput** (GB/s = 1e9 bytes/s of block payload; best and median of ``--rounds`` rounds
   after ``--warmup``; a smaller block count gets up to 4x as many rounds), for every ``--blocks``
   count and every ``--page`` size. Rounds interleave every measurement, and within a round the
   connector and the raw path run back to back (alternating which goes first), so the per-round
   ratio connector time / raw time compares numbers taken in the same time window; the goal is
   judged on the median of those paired ratios (best-vs-best is shown too).

   * ``load local``: node ``a`` over the same-host (shared-memory) path. Connector =
     ``start_lookup`` -> complete -> ``result()`` -> ``load_lookup`` -> transfer complete;
     raw = one coroutine on the loop: ``NodeClient.lookup`` (leased) + ``NodeClient.read`` of the
     same keys into the same rows (keys and row views prepared outside the timed interval).
   * ``load peer``: node ``b``, reached the way a request reaches a peer: the connector
     (``local=False``, co-located with ``a``) gets the router's hint naming ``b`` and loads from
     ``b`` over the listener path (block bytes as UCX messages, loopback here); raw =
     ``NodeClient(b, local=False)`` lookup + read.
   * ``offload shm`` / ``offload ucx``: fresh hashes to node ``a`` (the namespace is cleared,
     untimed, before each); connector = ``offload`` -> transfer complete; raw = ``NodeClient.write``.

   Every load is checked bit-exact against what was stored (the rows are zeroed before each);
   every offload must store all of its blocks. Completion is awaited through the handle's
   future (a done-callback sets an event: no polling, no GIL contention from a spinning
   waiter); ``--poll-us N`` polls ``is_complete()`` every N µs instead, as an engine's step
   loop would. Goal: connector load time <= 110 % of the raw node path's (median paired ratio).

Exit status: 0, 1 if a bit-exact check failed, 2 on an error, 130/143 on SIGINT/SIGTERM
(always after shutting the connectors down and stopping the nodes and etcd).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import gc
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `cluster` and `connector` live at the repository root
    sys.path.insert(0, str(ROOT))

from bench_common import latency_summary_us, machine_info  # noqa: E402
from dkv.errors import DKVError  # noqa: E402
from dkv.units import format_size, parse_size  # noqa: E402

LEAF = "full"
NS_CALLS = "bench/calls"
NS_LOAD = "bench/load"
NS_OFF = "bench/offload"
OP_TIMEOUT = 60.0  # per op; generous for 256 MiB over loopback UCX on a busy 2-core machine
INDEX_TIMEOUT = 30.0  # until the router has seen a dataset's directory entries
GOAL_CALL_US = 200.0
GOAL_OVERHEAD = 0.10
GOAL_CALL_OPS = ("load", "load_lookup", "offload")
SMALL_ROUNDS_FACTOR = 4  # a smaller block count gets up to this many times --rounds (its ops are short)
DEFAULT_BLOCKS = "64,1024"
DEFAULT_PAGE = "64KiB"


class BenchError(RuntimeError):
    """Something the benchmark cannot measure around (a miss, a refused load, a short write...)."""


# ---- helpers ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q * 100.0))


def rates(samples: Sequence[float], nbytes: int) -> dict[str, Any]:
    gbps = [nbytes / 1e9 / s for s in samples]
    return {"best": max(gbps), "median": statistics.median(gbps), "runs": gbps,
            "best_s": min(samples), "median_s": statistics.median(samples)}


def chain(n: int) -> list[bytes]:
    return [secrets.token_bytes(32) for _ in range(n)]


class Waiter:
    """Waits for a connector handle or transfer: via its future (default) or by polling ``is_complete()``."""

    def __init__(self, poll_us: float) -> None:
        self.poll_s = poll_us / 1e6

    def __call__(self, item: Any, what: str, timeout: float = OP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        future = getattr(item, "_future", None)
        if (self.poll_s <= 0 and isinstance(future, concurrent.futures.Future)
                and not getattr(item, "answered_by_polling", False)):  # (that one's poller reads its answer)
            event = threading.Event()
            future.add_done_callback(lambda _f: event.set())
            if not event.wait(timeout):
                raise BenchError(f"{what} did not complete within {timeout:.0f}s")
            if not item.is_complete():  # a CUDA completion could still be pending; never on CPU
                while not item.is_complete():
                    if time.monotonic() > deadline:
                        raise BenchError(f"{what} did not complete within {timeout:.0f}s")
                    time.sleep(0.0001)
            return
        while not item.is_complete():
            if time.monotonic() > deadline:
                raise BenchError(f"{what} did not complete within {timeout:.0f}s")
            time.sleep(self.poll_s if self.poll_s > 0 else 0.0001)


async def _nothing() -> None:
    """The baseline's coroutine: what posting to the loop thread costs with no work in it."""


def settle(*conns: Any, timeout: float = OP_TIMEOUT) -> None:
    """Until every task the connectors posted on the loop thread has finished (peeks at ``_tasks``)."""
    for conn in conns:
        pending = [f for f in list(conn._tasks) if not f.done()]
        if pending:
            _done, left = concurrent.futures.wait(pending, timeout)
            if left:
                raise BenchError(f"{len(left)} connector task(s) still running after {timeout:.0f}s")


class GcWatch:
    """Counts the garbage collector's runs (any thread) and their pauses, to explain tail latencies."""

    def __init__(self) -> None:
        self.count = 0
        self.pauses_ns: dict[int, list[int]] = collections.defaultdict(list)
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.count += 1
            self.pauses_ns[int(info.get("generation", -1))].append(time.perf_counter_ns() - self._t0)

    def summary(self) -> dict[str, Any]:
        return {f"gen{g}": {"collections": len(v), "p50_us": percentile(v, 0.5) / 1e3, "max_us": max(v) / 1e3}
                for g, v in sorted(self.pauses_ns.items()) if v}


GC = GcWatch()


class Samples:
    """Timed calls of one op: nanoseconds, and whether a garbage collection ran during each."""

    def __init__(self) -> None:
        self.ns: list[int] = []
        self.gc: list[bool] = []

    def add(self, ns: int, gc_ran: bool) -> None:
        self.ns.append(ns)
        self.gc.append(gc_ran)

    def summary(self) -> dict[str, Any]:
        out = latency_summary_us(self.ns)
        out["with_gc"] = sum(self.gc)
        quiet = [ns for ns, g in zip(self.ns, self.gc) if not g]
        out["p50_us_without_gc"] = percentile([q / 1e3 for q in quiet], 0.5) if quiet else None
        return out


def timed_ns(fn: Callable[[], Any]) -> tuple[int, Any, bool]:
    """``fn()``'s wall time on this thread, its result, and whether a GC ran meanwhile (any thread)."""
    gcs = GC.count
    t0 = time.perf_counter_ns()
    result = fn()
    elapsed = time.perf_counter_ns() - t0
    return elapsed, result, GC.count != gcs


class Rows:
    """The device tensor ``[pages, page]`` (row 0 unused: block ids start at 1) and a reference copy."""

    def __init__(self, count: int, page: int, seed: int) -> None:
        import torch

        self.count, self.page = count, page
        self.tensor = torch.zeros(count + 1, page, dtype=torch.uint8)
        self.np = self.tensor.numpy()
        self.ref = np.empty((count, page), dtype=np.uint8)
        words = np.random.default_rng(seed).bit_generator.random_raw((self.ref.nbytes + 7) // 8)
        self.ref.reshape(-1)[:] = words.view(np.uint8)[: self.ref.nbytes]
        self.views = [self.np[i] for i in range(1, count + 1)]  # row views of block ids 1..count

    def ids(self, n: int) -> list[int]:
        return list(range(1, n + 1))

    def load_ref(self, n: int) -> None:
        np.copyto(self.np[1 : n + 1], self.ref[:n])

    def zero(self, n: int) -> None:
        self.np[1 : n + 1].fill(0)

    def matches(self, n: int) -> bool:
        a, b = self.np[1 : n + 1], self.ref[:n]
        if self.page % 8 == 0:
            a, b = a.view(np.uint64), b.view(np.uint64)
        return bool(np.array_equal(a, b))


# ---- processes ----------------------------------------------------------------------------------


class Cluster:
    """etcd and nodes ``a``/``b``, started here and stopped by PID in :meth:`stop`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.etcd: Any = None
        self.nodes: dict[str, Any] = {}
        self.prefix = f"/dkv-bench/{uuid.uuid4().hex[:12]}"

    def start(self, pools: dict[str, int], log: Callable[[str], None]) -> None:
        from cluster.etcd_process import start_etcd
        from cluster.process import start_node

        log("starting etcd")
        self.etcd = start_etcd()
        for node_id, pool in pools.items():
            log(f"starting node {node_id} (pool {format_size(pool)})")
            self.nodes[node_id] = start_node(
                "--etcd", self.etcd.url, "--etcd-prefix", self.prefix, "--node-id", node_id, "--log-level", "WARNING",
                pool=str(pool), listen="127.0.0.1:0", workdir=self.workdir / f"node-{node_id}", exit_with_parent=True)

    def address(self, node_id: str) -> str:
        return str(self.nodes[node_id].address)

    def check_alive(self) -> None:
        for node_id, node in self.nodes.items():
            if not node.alive():
                raise BenchError(f"node {node_id} exited with {node.proc.returncode}:\n{node.log_tail()}")

    def log_tails(self) -> str:
        return "\n".join(f"--- node {i} log tail:\n{n.log_tail()}" for i, n in self.nodes.items())

    def stop(self) -> None:
        for node in self.nodes.values():
            try:
                node.stop()
            except Exception:  # noqa: BLE001 - keep stopping the rest
                pass
        if self.etcd is not None:
            self.etcd.stop()


class Bench:
    """Connectors and raw clients on the process's shared UCX loop; everything closed in :meth:`close`."""

    def __init__(self, cluster: Cluster, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        from dkv.loop_thread import acquire_shared_loop

        self.cluster = cluster
        self.args = args
        self.log = log
        self.wait = Waiter(args.poll_us)
        self.loop = acquire_shared_loop()  # this script's own reference: released last, in close()
        self.connectors: list[Any] = []
        self.clients: list[Any] = []
        self.verified = True

    # -- construction

    def connector(self, node: str, rows: Rows, namespace: str, *, etcd: bool = False, local: bool | None = None) -> Any:
        from connector.dkv_connector import DKVConnector
        from connector.types import full_attention

        kwargs: dict[str, Any] = {"etcd": self.cluster.etcd.url, "etcd_prefix": self.cluster.prefix} if etcd else {}
        conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows.tensor]}], namespace=namespace,
                            node=self.cluster.address(node), timeout=OP_TIMEOUT, local=local, **kwargs)
        self.connectors.append(conn)
        return conn

    def client(self, node: str, namespace: str, *, local: bool) -> Any:
        from dkv.client import NodeClient

        client = NodeClient(self.cluster.address(node), namespace, local=local, timeout=OP_TIMEOUT)
        self.clients.append(client)
        self.run(client.connect())
        if client.uses_shared_memory != local:
            raise BenchError(f"the raw client to {node} did not get the {'same-host' if local else 'listener'} path")
        return client

    def run(self, coro: Any, timeout: float = OP_TIMEOUT) -> Any:
        return self.loop.run(coro, timeout)

    def freeze(self) -> None:
        """With ``--gc-freeze``: what is alive after a section's set-up is never scanned again."""
        if self.args.gc_freeze:
            gc.collect()
            gc.freeze()

    def close(self) -> None:
        from dkv.loop_thread import release_shared_loop

        for conn in self.connectors:
            conn.shutdown()  # never raises; releases its reference on the shared loop
        try:
            self.run(_close_all(self.clients), 30.0)
        except Exception:  # noqa: BLE001
            pass
        release_shared_loop()

    def store(self, client: Any, hashes: list[bytes], rows: Rows) -> None:
        """Write rows 1..len(hashes)'s reference bytes under ``hashes`` (untimed set-up)."""
        from dkv.keys import BlockKey

        n = len(hashes)
        keys = [BlockKey(LEAF, 0, h) for h in hashes]
        result = self.run(client.write(keys, list(rows.ref[:n])))
        if result.stored + result.statuses.count("exists") != n:
            raise BenchError(f"set-up write stored {result.stored}/{n}: {collections.Counter(result.statuses)}")

    def wait_indexed(self, conn: Any, hashes: list[bytes], holder: str) -> str:
        """Until the connector's router routes ``hashes`` wholly to ``holder``; returns that hint."""
        deadline = time.monotonic() + INDEX_TIMEOUT
        while True:
            route = conn._router.route(conn.namespace, hashes)
            if route.peer is not None and route.peer.node_id == holder and route.depth == len(hashes):
                return str(route.hint)
            if time.monotonic() > deadline:
                raise BenchError(f"the router never saw {len(hashes)} blocks on {holder} (depth {route.depth})")
            time.sleep(0.05)

    # -- 1. scheduler-thread cost

    def call_costs(self, blocks: list[int]) -> dict[str, Any]:
        args = self.args
        nmax = max(blocks)
        rows = Rows(nmax, args.call_page, seed=1)
        self.call_rows = rows
        conn = self.connector("a", rows, NS_CALLS, etcd=True)
        self.calls_conn = conn
        writer = self.client("a", NS_CALLS, local=True)
        hashes = chain(nmax)
        self.calls_hashes = hashes
        self.store(writer, hashes, rows)
        hints = {n: self.wait_indexed(conn, hashes[:n], "a").encode() for n in blocks}
        self.freeze()
        out: dict[str, Any] = {}
        for n in blocks:
            self.log(f"call costs: {n} blocks x {args.repeat} calls per op")
            hs, ids = hashes[:n], rows.ids(n)
            miss = chain(n)
            samples: dict[str, Samples] = collections.defaultdict(Samples)
            for i in range(args.repeat + 5):  # the first 5 rounds warm up (connections, caches)
                t: dict[str, tuple[int, bool]] = {}

                def call(op: str, fn: Callable[[], Any]) -> Any:
                    ns, result, gc_ran = timed_ns(fn)
                    t[op] = (ns, gc_ran)
                    return result

                settle(conn)
                masks = call("lookup", lambda: conn.lookup(hs))
                if not all(masks[LEAF]):
                    raise BenchError(f"lookup found {sum(masks[LEAF])}/{n} blocks")
                settle(conn)
                self.wait(call("load", lambda: conn.load({LEAF: ids}, {LEAF: hs})), "load")
                settle(conn)
                handle = call("start_lookup", lambda: conn.start_lookup(hs))
                self.wait(handle, "start_lookup")
                settle(conn)
                self.wait(call("load_lookup", lambda: conn.load_lookup(handle, {LEAF: ids}, {LEAF: hs})), "load_lookup")
                settle(conn)
                handle = call("start_lookup_hint", lambda: conn.start_lookup(hs, hint=hints[n]))
                self.wait(handle, "start_lookup (hint)")
                conn.abandon_lookup(handle)
                settle(conn)
                self.wait(call("offload", lambda: conn.offload({LEAF: ids}, {LEAF: hs})), "offload")
                settle(conn)
                call("touch", lambda: conn.touch(hs))
                settle(conn)
                answer = call("probe_hit", lambda: conn.probe(hs, [0]))
                if answer is None or not all(answer[0][LEAF]):
                    raise BenchError(f"probe did not see the {n} stored blocks")
                call("probe_miss", lambda: conn.probe(miss, [0]))
                call("poll_transfers", conn.poll_transfers)
                call("take_metrics", conn.take_metrics)
                settle(conn)
                posted = call("post_baseline", lambda: conn._loop.submit(_nothing()))
                posted.result(OP_TIMEOUT)
                if i >= 5:
                    for op, (ns, gc_ran) in t.items():
                        samples[op].add(ns, gc_ran)
            out[str(n)] = {op: v.summary() for op, v in samples.items()}
        return out

    # -- 1b. the same posting calls while a big load copies on the loop thread

    def busy_costs(self, n: int, bg_conn: Any, bg_rows: Rows, bg_hashes: list[bytes]) -> dict[str, Any]:
        """The posting calls while ``bg_conn`` copies a same-host load on the loop thread.

        The background rows are zeroed first; the same-host read fills them in order, so
        "row 1 is filled and the last row is still zero" means the copy is running right now.
        A sample counts only when that holds as the timed call starts.
        """
        conn, rows, hashes = self.calls_conn, self.call_rows, self.calls_hashes[:n]
        ids, nbg = rows.ids(n), len(bg_hashes)
        first, last = bg_rows.np[1], bg_rows.np[nbg]
        self.log(f"call costs under a concurrent {nbg}-block load: {n} blocks x {self.args.busy} calls per op")
        samples: dict[str, Samples] = collections.defaultdict(Samples)
        overlapped: collections.Counter[str] = collections.Counter()
        ops = ("start_lookup", "load_lookup", "offload", "touch", "poll_transfers")
        calls: dict[str, Callable[[Any], Any]] = {
            "start_lookup": lambda _h: conn.start_lookup(hashes),
            "load_lookup": lambda h: conn.load_lookup(h, {LEAF: ids}, {LEAF: hashes}),
            "offload": lambda _h: conn.offload({LEAF: ids}, {LEAF: hashes}),
            "touch": lambda _h: conn.touch(hashes),
            "poll_transfers": lambda _h: conn.poll_transfers(),
        }
        for i in range(self.args.busy + 1):
            for op in ops:
                handle = None
                if op == "load_lookup":
                    handle = conn.start_lookup(hashes)
                    self.wait(handle, "start_lookup")
                settle(conn, bg_conn)
                bg_rows.zero(nbg)
                bg_handle = bg_conn.start_lookup(bg_hashes)
                self.wait(bg_handle, "background start_lookup")
                bg = bg_conn.load_lookup(bg_handle, {LEAF: bg_rows.ids(nbg)}, {LEAF: bg_hashes})
                deadline = time.monotonic() + OP_TIMEOUT
                while not first.any() and not bg._future.done() and time.monotonic() < deadline:
                    time.sleep(0.0001)
                copying = not last.any()
                ns, result, gc_ran = timed_ns(lambda: calls[op](handle))
                still = not last.any()
                self.wait(bg, "background load")
                if op == "start_lookup":
                    self.wait(result, "start_lookup")
                    conn.abandon_lookup(result)
                elif op in ("load_lookup", "offload"):
                    self.wait(result, op)
                if i >= 1 and copying:  # round 0 warms up
                    samples[op].add(ns, gc_ran)
                    overlapped[op] += still
        out = {}
        for op, v in samples.items():
            out[op] = v.summary()
            out[op]["copy_outlived_call"] = overlapped[op]
        return out

    # -- 2. throughput

    def throughput(self, page: int, blocks: list[int],
                   busy_n: int | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from dkv.keys import BlockKey

        args = self.args
        nmax = max(blocks)
        self.log(f"throughput set-up: {nmax} blocks of {format_size(page)}")
        rows = Rows(nmax, page, seed=page)
        c_local = self.connector("a", rows, NS_LOAD)
        c_peer = self.connector("a", rows, NS_LOAD, etcd=True, local=False)
        c_off_shm = self.connector("a", rows, NS_OFF)
        c_off_ucx = self.connector("a", rows, NS_OFF, local=False)
        r_local = self.client("a", NS_LOAD, local=True)
        r_peer = self.client("b", NS_LOAD, local=False)
        r_off_shm = self.client("a", NS_OFF, local=True)
        r_off_ucx = self.client("a", NS_OFF, local=False)
        local_hashes, peer_hashes = chain(nmax), chain(nmax)
        self.store(r_local, local_hashes, rows)
        self.store(r_peer, peer_hashes, rows)
        hints = {n: self.wait_indexed(c_peer, peer_hashes[:n], "b").encode() for n in blocks}
        group = iter(range(1, 1 << 30))
        self.freeze()

        def conn_load(conn: Any, hs: list[bytes], n: int, hint: bytes | None) -> float:
            t0 = time.perf_counter()
            handle = conn.start_lookup(hs, hint=hint)
            self.wait(handle, "start_lookup")
            masks = handle.result()
            if not all(masks[LEAF]):
                conn.abandon_lookup(handle)
                raise BenchError(f"connector lookup found {sum(masks[LEAF])}/{n} blocks")
            transfer = conn.load_lookup(handle, {LEAF: rows.ids(n)}, {LEAF: hs}, hint=hint)
            self.wait(transfer, "load")
            return time.perf_counter() - t0

        def raw_load(client: Any, hs: list[bytes], keys: list[Any], views: list[Any]) -> float:
            async def go() -> None:
                found = await client.lookup(hs, [LEAF], 1, lease=True, group=next(group))
                if not all(found.masks.get(LEAF, [])) or found.lease_id is None:
                    raise BenchError(f"raw lookup found {sum(found.masks.get(LEAF, []))}/{len(hs)} blocks")
                await client.read(found.lease_id, keys, views)

            t0 = time.perf_counter()
            self.run(go())
            return time.perf_counter() - t0

        def conn_offload(conn: Any, n: int) -> float:
            hs = chain(n)
            before = conn.counters.blocks_offloaded
            t0 = time.perf_counter()
            transfer = conn.offload({LEAF: rows.ids(n)}, {LEAF: hs})
            self.wait(transfer, "offload")
            elapsed = time.perf_counter() - t0
            if conn.counters.blocks_offloaded - before != n:
                raise BenchError(f"offload stored {conn.counters.blocks_offloaded - before}/{n} blocks "
                                 f"({conn.counters.offloads_failed} offloads failed)")
            return elapsed

        def raw_offload(client: Any, n: int, views: list[Any]) -> float:
            keys = [BlockKey(LEAF, 0, h) for h in chain(n)]
            t0 = time.perf_counter()
            result = self.run(client.write(keys, views))
            elapsed = time.perf_counter() - t0
            if result.stored != n:
                raise BenchError(f"raw write stored {result.stored}/{n}: {collections.Counter(result.statuses)}")
            return elapsed

        results = []
        for n in blocks:
            self.log(f"throughput: {n} x {format_size(page)}: {args.warmup} warm-up + "
                     f"{args.rounds * max(1, min(SMALL_ROUNDS_FACTOR, nmax // n))} rounds")
            views = rows.views[:n]
            lkeys = [BlockKey(LEAF, 0, h) for h in local_hashes[:n]]
            pkeys = [BlockKey(LEAF, 0, h) for h in peer_hashes[:n]]
            samples: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
            verified: dict[str, bool] = collections.defaultdict(lambda: True)

            def load_pair(path: str, first_conn: bool, conn_fn: Callable[[], float], raw_fn: Callable[[], float],
                          measured: dict[tuple[str, str], float]) -> None:
                for who in (("connector", "raw") if first_conn else ("raw", "connector")):
                    rows.zero(n)
                    settle(*self.connectors)
                    measured[(path, who)] = conn_fn() if who == "connector" else raw_fn()
                    verified[f"{path}/{who}"] &= rows.matches(n)

            def offload_pair(path: str, first_conn: bool, conn: Any, client: Any,
                             measured: dict[tuple[str, str], float]) -> None:
                rows.load_ref(n)
                for who in (("connector", "raw") if first_conn else ("raw", "connector")):
                    self.run(client.clear())
                    settle(*self.connectors)
                    measured[(path, who)] = (conn_offload(conn, n) if who == "connector"
                                             else raw_offload(client, n, views))

            rounds = args.rounds * max(1, min(SMALL_ROUNDS_FACTOR, nmax // n))
            for round_no in range(args.warmup + rounds):
                self.cluster.check_alive()
                first = round_no % 2 == 0
                measured: dict[tuple[str, str], float] = {}
                load_pair("load_local", first, lambda: conn_load(c_local, local_hashes[:n], n, None),
                          lambda: raw_load(r_local, local_hashes[:n], lkeys, views), measured)
                load_pair("load_peer", first, lambda: conn_load(c_peer, peer_hashes[:n], n, hints[n]),
                          lambda: raw_load(r_peer, peer_hashes[:n], pkeys, views), measured)
                offload_pair("offload_shm", first, c_off_shm, r_off_shm, measured)
                offload_pair("offload_ucx", first, c_off_ucx, r_off_ucx, measured)
                if round_no >= args.warmup:
                    for key, value in measured.items():
                        samples[key].append(value)
            self.run(r_off_shm.clear())
            if c_peer.counters.hits_peer == 0 or sum(c_peer.counters.unusable_hints.values()):
                raise BenchError(f"the peer loads did not go to node b: {c_peer.counters}")
            entry: dict[str, Any] = {"page": page, "page_label": format_size(page), "blocks": n,
                                     "bytes_per_op": n * page}
            for (path, who), values in samples.items():
                entry.setdefault(path, {})[who] = rates(values, n * page)
            for path in ("load_local", "load_peer", "offload_shm", "offload_ucx"):
                e = entry[path]
                paired = [c / r for c, r in zip(samples[(path, "connector")], samples[(path, "raw")])]
                e["rounds"] = len(paired)
                e["paired_ratios"] = paired
                e["overhead_paired"] = statistics.median(paired) - 1.0
                e["overhead_best"] = e["connector"]["best_s"] / e["raw"]["best_s"] - 1.0
                e["overhead_median"] = e["connector"]["median_s"] / e["raw"]["median_s"] - 1.0
                if path.startswith("load"):
                    e["verified"] = verified[f"{path}/connector"] and verified[f"{path}/raw"]
                    self.verified &= e["verified"]
            results.append(entry)

        busy: dict[str, Any] = {}
        if busy_n is not None:
            busy = {"blocks": busy_n, "background": f"connector load of {nmax} x {format_size(page)} (same-host path)",
                    "ops": self.busy_costs(busy_n, c_local, rows, local_hashes)}
        self.run(r_local.clear())
        self.run(r_peer.clear())
        for conn in (c_local, c_peer, c_off_shm, c_off_ucx):  # free this page size's connectors and clients now
            conn.shutdown()
            self.connectors.remove(conn)
        raw = [r_local, r_peer, r_off_shm, r_off_ucx]
        self.run(_close_all(raw), 30.0)
        self.clients = [c for c in self.clients if c not in raw]
        return results, busy


async def _close_all(clients: list[Any]) -> None:
    import asyncio

    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


# ---- goals and report ---------------------------------------------------------------------------


def call_goals(calls: dict[str, Any]) -> dict[str, Any]:
    n = "64" if "64" in calls else min(calls, key=int)
    goals = {}
    for op in GOAL_CALL_OPS:
        s = calls[n][op]
        goals[f"{op}_{n}_blocks_p50_le_{GOAL_CALL_US:.0f}us"] = s["p50_us"] <= GOAL_CALL_US
        goals[f"{op}_{n}_blocks_p99_le_{GOAL_CALL_US:.0f}us"] = s["p99_us"] <= GOAL_CALL_US
    return goals


def throughput_goals(results: list[dict[str, Any]]) -> dict[str, bool]:
    goals = {}
    for e in results:
        for path in ("load_local", "load_peer"):
            goals[f"{path}_{e['blocks']}x{e['page_label']}_overhead_le_{GOAL_OVERHEAD:.0%}"] = (
                e[path]["overhead_paired"] <= GOAL_OVERHEAD)
    return goals


CALL_ROWS = [
    ("lookup", "lookup (sync: blocks one round trip)"),
    ("start_lookup", "start_lookup (return)"),
    ("start_lookup_hint", "start_lookup with a hint (return)"),
    ("load", "load (return: validate + post)"),
    ("load_lookup", "load_lookup (return: validate + post)"),
    ("offload", "offload (return: validate + post)"),
    ("touch", "touch (return)"),
    ("probe_hit", "probe, chain announced"),
    ("probe_miss", "probe, nothing announced"),
    ("poll_transfers", "poll_transfers"),
    ("take_metrics", "take_metrics"),
    ("post_baseline", "baseline: post an empty coroutine to the loop"),
]


def print_report(doc: dict[str, Any], load_start: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if console.width < 150:
        console = Console(width=150)
    cfg = doc["config"]

    def us_cell(value: float, goal: bool) -> str:
        text = f"{value:,.0f}" if value >= 10 else f"{value:.1f}"
        if not goal:
            return text
        return f"[green]{text}[/]" if value <= GOAL_CALL_US else f"[red]{text}[/]"

    calls = doc["calls"]
    table = Table(title=f"Scheduler-thread cost per call, µs (p50 / p99 of {cfg['repeat']} calls, loop thread idle; "
                        f"{format_size(cfg['call_page'])} pages)")
    table.add_column("call")
    for n in calls:
        table.add_column(f"{n} blocks\np50", justify="right")
        table.add_column(f"{n} blocks\np99", justify="right")
    for op, label in CALL_ROWS:
        cells = []
        for n, per_op in calls.items():
            s = per_op[op]
            goal = op in GOAL_CALL_OPS and n == "64"
            cells += [us_cell(s["p50_us"], goal), us_cell(s["p99_us"], goal)]
        table.add_row(label, *cells)
    console.print(table)

    busy = doc.get("busy") or {}
    if busy and not busy.get("ops"):
        console.print(f"(--busy: no call caught the background {busy['background']} still copying: it is too short "
                      "here; use a larger block count or page)")
    if busy.get("ops"):
        table = Table(title=f"Same calls, {busy['blocks']} blocks, while a {busy['background']} copies on the loop "
                            f"thread, µs")
        for col in ("call", "samples", "p50", "p99", "max", "idle p50", "copy outlived\nthe call", "GC ran\nduring"):
            table.add_column(col, justify="right" if col != "call" else "left")
        idle = calls.get(str(busy["blocks"]), {})
        for op, s in busy["ops"].items():
            table.add_row(op, str(s["n"]), us_cell(s["p50_us"], False), us_cell(s["p99_us"], False),
                          us_cell(s["max_us"], False), us_cell(idle[op]["p50_us"], False) if op in idle else "-",
                          str(s["copy_outlived_call"]), str(s["with_gc"]))
        console.print(table)

    table = Table(title=f"Throughput through the connector vs the raw node path, GB/s (best and median of "
                        f"{cfg['rounds']}+ rounds after {cfg['warmup']} warm-up; connector time / raw time)")
    for col in ("page", "blocks", "path", "rounds", "connector\nbest", "raw\nbest", "connector\nmedian", "raw\nmedian",
                "time ratio\npaired median", "time ratio\nbest / best", "bit-exact"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for e in doc["throughput"]:
        for path, label in (("load_local", "load, local (shm)"), ("load_peer", "load, peer via hint (ucx)"),
                            ("offload_shm", "offload (shm)"), ("offload_ucx", "offload (ucx)")):
            p = e[path]
            paired = f"{1 + p['overhead_paired']:.0%}"
            if path.startswith("load"):
                paired = f"[green]{paired}[/]" if p["overhead_paired"] <= GOAL_OVERHEAD else f"[red]{paired}[/]"
            exact = "-" if "verified" not in p else ("[green]yes[/]" if p["verified"] else "[bold red]NO[/]")
            table.add_row(e["page_label"], str(e["blocks"]), label, str(p["rounds"]),
                          f"{p['connector']['best']:.2f}", f"{p['raw']['best']:.2f}",
                          f"{p['connector']['median']:.2f}", f"{p['raw']['median']:.2f}",
                          paired, f"{1 + p['overhead_best']:.0%}", exact)
    console.print(table)

    console.print(
        f"Goals: load, load_lookup and offload return in <= {GOAL_CALL_US:.0f} µs for 64 blocks (judged at p50 and "
        f"p99, loop idle); connector load time <= {1 + GOAL_OVERHEAD:.0%} of the raw node path's (median of the "
        "per-round paired ratios: each round times both back to back, alternating which goes first).\n"
        "Connector load = start_lookup -> complete -> result() -> load_lookup -> complete; raw = one coroutine on "
        "the same loop thread: NodeClient.lookup (leased) + read of the same keys into the same rows. Peer = node b, "
        "named by the router's hint, over the listener path (loopback UCX; connector local=False). Offload = fresh "
        "hashes to node a: connector offload -> complete vs NodeClient.write. Completion is awaited "
        + ("through the handle's future (no polling)." if cfg["poll_us"] <= 0
           else f"by polling is_complete() every {cfg['poll_us']:g} µs.")
        + (" gc.freeze() after set-up." if cfg["gc_freeze"] else "")
    )
    gc_info = doc.get("gc", {})
    if gc_info:
        idle = doc["calls"].get("64") or next(iter(doc["calls"].values()))
        with_gc = sum(v["with_gc"] for v in idle.values())
        total = sum(v["n"] for v in idle.values())
        pauses = "; ".join(f"{g}: {v['collections']} runs, p50 {v['p50_us']:,.0f} µs, max {v['max_us']:,.0f} µs"
                           for g, v in gc_info.items())
        console.print(f"Garbage collector (any thread, whole run): {pauses}. {with_gc} of {total} timed calls at "
                      f"{'64' if '64' in doc['calls'] else 'the smallest count'} blocks overlapped a collection "
                      "(JSON: with_gc, p50_us_without_gc).")
    for name, met in doc["goals_met"].items():
        console.print(f"  {name}: {'[green]met[/]' if met else '[red]missed[/]'}")
    console.print(f"Machine: {os.cpu_count()} CPUs; load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} "
                  "at end (this run keeps ~2 processes busy while it measures; more means other work skewed it).")


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default=DEFAULT_BLOCKS,
                        help=f"comma-separated block counts (default {DEFAULT_BLOCKS})")
    parser.add_argument("--page", default=DEFAULT_PAGE,
                        help=f"comma-separated page sizes for throughput (default {DEFAULT_PAGE}; e.g. 64KiB,256KiB)")
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per op for the call costs (default 200)")
    parser.add_argument("--rounds", type=int, default=10,
                        help=f"timed throughput rounds for the largest block count (default 10; smaller counts get "
                             f"up to {SMALL_ROUNDS_FACTOR}x as many)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed throughput rounds before them (default 1)")
    parser.add_argument("--call-page", default="4KiB", help="page size for the call-cost connector (default 4KiB)")
    parser.add_argument("--busy", type=int, default=30,
                        help="calls per op under a concurrent load (default 30; 0 skips)")
    parser.add_argument("--poll-us", type=float, default=0.0,
                        help="poll is_complete() every N µs instead of waiting on the handle's future (default 0)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() after each section's set-up, as engines often do after start-up "
                             "(default off)")
    parser.add_argument("--json", type=Path, default=None, help="write every number to this JSON file")
    args = parser.parse_args(argv)
    try:
        args.block_list = sorted({int(b) for b in args.blocks.split(",") if b.strip()})
        args.page_list = [parse_size(s) for s in args.page.split(",") if s.strip()]
        args.call_page = parse_size(args.call_page)
    except (DKVError, ValueError) as exc:
        parser.error(str(exc))
    if not args.block_list or any(not 1 <= b <= 65536 for b in args.block_list):
        parser.error("--blocks must be counts in [1, 65536]")
    if not args.page_list or any(p <= 0 for p in args.page_list) or args.call_page <= 0:
        parser.error("page sizes must be positive")
    if args.repeat < 1 or args.rounds < 1 or args.warmup < 0 or args.busy < 0 or args.poll_us < 0:
        parser.error("--repeat and --rounds must be >= 1; --warmup, --busy and --poll-us >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console

    err = Console(stderr=True)
    log = lambda msg: err.log(msg)  # noqa: E731
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt even if started with SIGINT ignored
    nmax, pmax = max(args.block_list), max(args.page_list)
    margin = 64 * 2**20
    pools = {"a": int(nmax * (args.call_page + 2 * pmax) * 1.25) + margin, "b": int(nmax * pmax * 1.25) + margin}
    started = time.time()
    load_start = list(os.getloadavg())
    gc.callbacks.append(GC)
    doc: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dkv-bench-conn-") as tmp:
        cluster = Cluster(Path(tmp))
        bench: Bench | None = None
        try:
            cluster.start(pools, log)
            bench = Bench(cluster, args, log)
            calls = bench.call_costs(args.block_list)
            throughput: list[dict[str, Any]] = []
            busy: dict[str, Any] = {}
            for i, page in enumerate(args.page_list):
                busy_n = min(args.block_list) if (i == 0 and args.busy) else None
                results, b = bench.throughput(page, args.block_list, busy_n)
                throughput += results
                busy = busy or b
            goals = {**call_goals(calls), **throughput_goals(throughput)}
            doc = {
                "config": {"blocks": args.block_list, "pages": args.page_list, "call_page": args.call_page,
                           "repeat": args.repeat, "rounds": args.rounds, "warmup": args.warmup, "busy": args.busy,
                           "poll_us": args.poll_us, "gc_freeze": args.gc_freeze, "pools": pools,
                           "leaves": 1, "tp_shards": 1,
                           "device": "cpu", "unit_throughput": "GB/s (1e9 bytes/s) of block payload",
                           "connector_load_timing": "start_lookup -> complete -> result() -> load_lookup -> complete",
                           "raw_load_timing": "one loop.run of NodeClient.lookup(lease) + NodeClient.read",
                           "peer_path": "node b named by the router's hint; connector local=False (listener/UCX)",
                           "offload_timing": "connector offload -> complete vs NodeClient.write, fresh hashes"},
                "goals": {"call_return_us": GOAL_CALL_US, "call_ops": list(GOAL_CALL_OPS),
                          "load_overhead_max": GOAL_OVERHEAD},
                "calls": calls,
                "busy": busy,
                "throughput": throughput,
                "goals_met": goals,
                "verified": bench.verified,
                "gc": GC.summary(),
            }
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]: shutting down the connectors, stopping the nodes and etcd")
            return 130
        except SystemExit as exc:
            err.print("[bold red]terminated[/]: shutting down the connectors, stopping the nodes and etcd")
            return int(exc.code or 143)
        except Exception as exc:  # noqa: BLE001 - DKVError, BenchError, NodeStartError, KVLoadFailed, timeouts...
            err.print(f"[bold red]benchmark failed:[/] {type(exc).__name__}: {exc}")
            err.print(cluster.log_tails())
            return 2
        finally:
            try:
                if bench is not None:
                    bench.close()
            finally:
                cluster.stop()

    doc["machine"] = {**machine_info(), "loadavg_start": load_start}
    doc["elapsed_s"] = time.time() - started
    print_report(doc, load_start[0])
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if not doc["verified"]:
        Console(stderr=True).print("[bold red]bit-exact verification FAILED[/] (see the bit-exact column)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
