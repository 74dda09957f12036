"""Helpers shared by the benchmark and soak scripts."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import hashlib
import inspect
import os
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from cluster.process import die_with_parent, pid_alive  # noqa: F401 - the benchmark and the soak import them from here


def wait_done(item: Any, what: str, timeout: float, error: type[BaseException] = TimeoutError) -> None:
    """Until a connector handle or transfer completes; ``error`` when it does not within ``timeout`` seconds.

    A failed load raises (``is_complete`` does). Waits on the handle's future
    when it has one (no polling, no GIL contention from a spinning waiter);
    otherwise, and for a lookup whose answer its poller reads
    (``answered_by_polling``), polls the public ``is_complete()`` every 50 µs.
    """
    deadline = time.monotonic() + timeout
    future = getattr(item, "_future", None)
    if isinstance(future, concurrent.futures.Future) and not getattr(item, "answered_by_polling", False):
        event = threading.Event()
        future.add_done_callback(lambda _f: event.set())
        if not event.wait(timeout):
            raise error(f"{what} did not complete within {timeout:.0f}s")
    while not item.is_complete():
        if time.monotonic() > deadline:
            raise error(f"{what} did not complete within {timeout:.0f}s")
        time.sleep(0.00005)


SCHEDULER_STEP_ADDITIONS = 500  # pure-Python additions between two polls of a busy caller (tens of µs)


def scheduler_step(additions: int = SCHEDULER_STEP_ADDITIONS) -> int:
    """Pure Python for tens of µs, holding the GIL: what a scheduler does between two polls of a transfer."""
    total = 0
    for i in range(additions):
        total += i
    return total


ROUND_ORDER_SEED = 11  # round_order's draws: fixed, so that every run interleaves its contenders alike


def round_order(items: Sequence[Any], round_no: int) -> list[Any]:
    """Round ``round_no``'s order of ``items``: each once, shuffled by a draw from a fixed seed (the same every run).

    Who goes first and who follows whom change from round to round, so what
    a contender leaves behind (its bytes in the caches, work still ending)
    falls on each of the others alike. A rotation keeps every contender
    behind the same one: in ``bench.py`` the TCP stream always followed
    memcpy, which had just written the rows it receives into, and the
    listener load always followed the same-host load; the listener load /
    TCP stream ratio at 64 KiB read 0.77-0.80 rotated and 0.82-0.90 shuffled
    (the throughput section alone, 40 rounds, three runs each, alternated;
    shuffled there with the round's number as the seed).
    """
    order = list(items)
    random.Random(ROUND_ORDER_SEED * 1_000_003 + round_no).shuffle(order)
    return order


def rotate(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated left by ``k``: round ``k`` of an interleaved run starts with a different contender."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def interleaved_rounds(contenders: dict[str, Callable[[], list[int]]], rounds: int) -> dict[str, list[int]]:
    """Run every contender once a round, rotating who goes first; the first round is warm-up (dropped).

    Each contender returns its samples of that round; the result has every
    contender's samples of the timed rounds, in the contenders' order.
    """
    samples: dict[str, list[int]] = {name: [] for name in contenders}
    for round_no in range(rounds):
        for name in rotate(list(contenders), round_no):
            got = contenders[name]()
            if round_no:
                samples[name] += got
    return samples


@contextlib.contextmanager
def timed_methods(targets: list[tuple[type, str]], into: dict[str, list[float]]) -> Iterator[None]:
    """Wrap each ``cls.name`` (plain or async) so that every call's seconds go into ``into["Cls.name"]``."""
    saved = []
    for cls, name in targets:
        original = cls.__dict__[name]
        label = f"{cls.__name__}.{name}"
        samples = into.setdefault(label, [])
        if inspect.iscoroutinefunction(original):
            @functools.wraps(original)
            async def wrapper(*a: Any, _f: Any = original, _s: list[float] = samples, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await _f(*a, **k)
                finally:
                    _s.append(time.perf_counter() - t0)
        else:
            @functools.wraps(original)
            def wrapper(*a: Any, _f: Any = original, _s: list[float] = samples, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    _s.append(time.perf_counter() - t0)
        saved.append((cls, name, original))
        setattr(cls, name, wrapper)
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


def chained_hashes(n: int) -> list[bytes]:
    """``n`` prefix-chained SHA-256 block hashes (each over the one before it), the same on every call."""
    hashes, h = [], b"\0" * 32
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        hashes.append(h)
    return hashes


def store_through(conn: Any, leaf: str, hashes: Sequence[bytes], timeout: float) -> None:
    """Offload rows ``1..len(hashes)`` of ``conn``'s ``leaf`` under ``hashes`` and wait until it landed."""
    stored = conn.offload({leaf: list(range(1, len(hashes) + 1))}, {leaf: list(hashes)})
    deadline = time.monotonic() + timeout
    while not stored.is_complete():
        if time.monotonic() > deadline:
            raise SystemExit("the offload did not complete")
        time.sleep(0.001)


def direct_client(loop: Any, address: str, namespace: str, timeout: float) -> Any:
    """A same-host :class:`dkv.client.NodeClient` of the node at ``address`` with its direct channel open."""
    from dkv.client import NodeClient

    client = NodeClient(address, namespace, local=True, timeout=timeout)
    loop.run(client.connect(), timeout)
    if not loop.run(client.open_direct(), timeout):
        loop.run(client.close(), timeout)
        raise SystemExit("no direct channel: the node is not on the same-host path")
    return client


def open_direct_channels(conn: Any, count: int, timeout: float) -> None:
    """Open direct channels to ``conn``'s co-located node until ``count`` are (a connector grows them on demand).

    A connector opens one more only when a lookup found every open one
    busy, one a second at most; a measurement of several lookups per step
    opens them first, so that it measures the steady state.
    """
    client = conn._clients.get(conn.node_address)  # noqa: SLF001 - the connector's own client of its node
    if client is None:
        raise SystemExit(f"no client of {conn.node_address}")
    while client.direct_open < count:
        if not conn._worker.loop.run(client.open_direct(another=True), timeout):  # noqa: SLF001
            raise SystemExit(f"only {client.direct_open} direct channels opened to {conn.node_address}, not {count}")


@contextlib.contextmanager
def frozen_heap(on_gc: Callable[[str, dict[str, Any]], None]) -> Iterator[None]:
    """Within: the heap set up so far frozen (as engines do after start-up) and ``on_gc`` told of each collection.

    The calling-thread measurements (``bench.py``'s scheduler section,
    ``probe_scheduler_calls.py``) run in it, so the collector only walks what
    the calls themselves leave behind.
    """
    gc.collect()
    gc.freeze()
    gc.callbacks.append(on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()


def run_queue_ns() -> int | None:
    """Nanoseconds this thread has spent runnable but waiting for a CPU (Linux schedstat), or None where unreadable.

    The difference over a call tells a call that waited on the run queue
    (another thread or process had the CPU) from one that ran long.
    """
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def latency_summary_us(samples_ns: Sequence[int]) -> dict[str, Any]:
    """Latency samples in ns as µs: count, p50 and p99 (linear interpolation), mean, min and max."""
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {"n": len(us), "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": statistics.fmean(us.tolist()), "min_us": float(us.min()), "max_us": float(us.max())}


def machine_info() -> dict[str, Any]:
    """What a benchmark ran on: CPUs, memory, versions, UCX settings, load average at the end."""
    import numpy as np
    import torch
    import ucxx

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "ucxx": getattr(ucxx, "__version__", "?"),
        "ucx_progress_mode": os.environ.get("DKV_UCX_PROGRESS", "loop"),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "loadavg_end": list(os.getloadavg()),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except (OSError, ValueError, IndexError):
        pass
    return info
