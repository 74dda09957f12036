#!/usr/bin/env python
"""Benchmark one real dKV node: PUT and READ throughput over both client paths, against baselines.

Usage::

    python scripts/bench_node.py [--sizes 64KiB,256KiB,1MiB,2MiB] [--blocks 256] [--repeat 3]
                                 [--warmup 1] [--json out.json]

For each block size this measures, in one run and on one machine:

* ``memcpy``   - aligned memcpy baseline: ``np.copyto`` of ``blocks`` blocks between two
                 page-aligned buffers (the ceiling of the same-host path).
* ``raw ucxx`` - raw UCX baseline over the listener path, with no dKV protocol, between this
                 process and a child process (this script in its hidden ``--raw-server`` mode),
                 both using :mod:`dkv.transport` (so the UCX progress mode matches the node's):
                 ``put`` = client -> server, timed from posting all sends to the server's
                 framed ack; ``read`` = server -> client, timed from sending a tiny framed
                 request to the last payload received.
* ``local``    - :class:`dkv.client.NodeClient` with ``local=True`` (same-host shared memory).
* ``listener`` - :class:`dkv.client.NodeClient` with ``local=False`` (bytes as UCX messages).
* ``local_nosum``, ``listener_nosum`` - the same two clients with ``checksums=False``: no
                 end-to-end block checksums (:mod:`dkv.checksum`; the node then has none to
                 verify). ``local``/``listener`` run with checksums on, the default, so
                 ``on / off`` is what the checksums cost each path.
* ``xxh3``     - the hash alone: ``xxhash.xxh3_128_digest`` of every source block (the same
                 buffers memcpy copies), and ``block_checksum`` (xxh3-128 with the key prefix,
                 what the clients and the node compute).

``put`` is one ``write()`` of all blocks under fresh random 32-byte hashes (the namespace is
cleared, untimed, before each one so nothing is "exists" and nothing is evicted); ``read``
is a leased ``lookup()`` followed by ``read()`` of all blocks into preallocated page-aligned
numpy buffers (both inside the timed interval). Every read (dKV and raw) is checked
bit-exact against what was written; a mismatch makes the script exit with status 1 (an
error exits 2, SIGINT/SIGTERM 130/143, always after stopping the node and the child).

Throughput is GB/s (10**9 bytes/s) of block payload; best and median of ``--repeat`` runs
(after ``--warmup`` untimed runs). Goals: same-host read >= 50% of aligned memcpy;
listener read and put >= 80% of raw ucxx.

Runs are interleaved (each round measures memcpy, raw ucxx, local, listener once) so that a
ratio compares numbers from the same time window. The server not being measured (node or raw
child) is held with SIGSTOP meanwhile, so every measurement has exactly two active processes (or
one, for memcpy), as it would on a real pair of peers; this also keeps ucxx's busy-waiting
``blocking``/``polling`` modes (``DKV_UCX_PROGRESS``) comparable with the default ``loop`` mode.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `cluster` lives at the repository root
    sys.path.insert(0, str(ROOT))

from bench_common import die_with_parent, machine_info  # noqa: E402
from dkv.errors import DKVError, ProtocolError  # noqa: E402
from dkv.transport import Connection, Listener, connect, init_transport, stop_progress  # noqa: E402
from dkv.units import format_size, parse_size  # noqa: E402

PAGE = 4096
DEFAULT_SIZES = "64KiB,256KiB,1MiB,2MiB"
NAMESPACE = "bench"
LEAF = "L0"
OP_TIMEOUT = 60.0  # per client op / raw exchange; generous for 512 MiB on a slow path
CHILD_READY_TIMEOUT = 30.0
CHILD_STOP_TIMEOUT = 5.0
RAW_IDLE_TIMEOUT = 600.0
GOAL_LOCAL_READ_VS_MEMCPY = 0.5
GOAL_LISTENER_VS_RAW = 0.8
PROGRESS_MODE = os.environ.get("DKV_UCX_PROGRESS", "loop")
DKV_PATHS = ("local", "listener", "local_nosum", "listener_nosum")  # *_nosum: checksums=False


class BenchError(RuntimeError):
    """Something the benchmark cannot measure around (the node refused a write, a miss...)."""


# ---- buffers ------------------------------------------------------------------------------------


def _align_up(n: int, alignment: int = PAGE) -> int:
    return (n + alignment - 1) // alignment * alignment


class Blocks:
    """``count`` blocks of ``size`` bytes, each starting on a page boundary of one numpy buffer."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.stride = _align_up(size)
        total = count * self.stride
        raw = np.empty(total + PAGE, dtype=np.uint8)  # over-allocate, then slice to an aligned start
        start = (-raw.ctypes.data) % PAGE
        self.buf = raw[start : start + total]
        assert self.buf.ctypes.data % PAGE == 0
        self.blocks = [self.buf[i * self.stride : i * self.stride + size] for i in range(count)]
        self.buf.fill(0)  # fault every page in now, outside any timed interval

    def fill_random(self, seed: int) -> None:
        words = np.random.default_rng(seed).bit_generator.random_raw(self.buf.nbytes // 8)
        self.buf.view(np.uint64)[:] = words

    def grid(self) -> np.ndarray:
        """The blocks as rows (padding excluded), viewed as wide words when the size allows."""
        rows = self.buf.reshape(self.count, self.stride)
        if self.size % 8 == 0:
            return rows.view(np.uint64)[:, : self.size // 8]
        return rows[:, : self.size]

    def equals(self, other: Blocks) -> bool:
        return (self.count, self.size) == (other.count, other.size) and bool(np.array_equal(self.grid(), other.grid()))

    @property
    def nbytes(self) -> int:
        return self.count * self.size


def _rates(samples: Sequence[float], nbytes: int) -> dict[str, Any]:
    rates = [nbytes / 1e9 / s for s in samples]
    return {"best": max(rates), "median": statistics.median(rates), "runs": rates,
            "best_s": min(samples)}


# ---- raw ucxx server (child process) ------------------------------------------------------------


async def _raw_server(portfile: Path) -> None:
    """Serve raw payload exchanges until SIGTERM/SIGINT or until the parent process goes away.

    Per connection, requests are framed messages ``{"op": "c2s"|"s2c", "n": N, "size": S}``:
    ``c2s`` answers ``ready``, receives N messages of S bytes into preallocated buffers
    (all recvs posted at once) and answers a framed ack; ``s2c`` sends those same buffers back.
    """
    die_with_parent()
    init_transport()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    buffers: dict[tuple[int, int], Blocks] = {}
    handlers: set[asyncio.Task[Any]] = set()
    conns: set[Connection] = set()

    def blocks_for(n: int, size: int) -> Blocks:
        if (n, size) not in buffers:
            buffers.clear()  # hold one size at a time
            buffers[(n, size)] = Blocks(n, size)
        return buffers[(n, size)]

    async def handle(conn: Connection) -> None:
        task = asyncio.current_task()
        if task is not None:
            handlers.add(task)
        conns.add(conn)
        try:
            while not conn.closed:
                req = await conn.recv_message(RAW_IDLE_TIMEOUT)
                op, n, size = req.get("op"), int(req.get("n", 0)), int(req.get("size", 0))
                if op == "bye":
                    break
                if op not in ("c2s", "s2c") or not 0 < n <= 1 << 16 or not 0 < size <= 1 << 30:
                    raise ProtocolError(f"bad raw request {req!r:.200}")
                blocks = blocks_for(n, size)
                views = [memoryview(b) for b in blocks.blocks]
                if op == "c2s":
                    await conn.send_message({"ok": True, "t": "ready"}, OP_TIMEOUT)
                    await conn.recv_payloads(views, OP_TIMEOUT)
                    await conn.send_message({"ok": True, "t": "ack", "n": n}, OP_TIMEOUT)
                else:
                    await conn.send_payloads(views, OP_TIMEOUT)
        except (DKVError, asyncio.CancelledError):
            pass
        finally:
            conn.abort()
            conns.discard(conn)
            if task is not None:
                handlers.discard(task)

    listener = Listener(handle, 0)
    try:
        tmp = portfile.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": listener.port, "pid": os.getpid()}))
        tmp.replace(portfile)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                if os.getppid() != parent:  # orphaned: never outlive the benchmark
                    break
    finally:
        listener.close()
        for conn in list(conns):
            conn.abort()
        for task in list(handlers):
            task.cancel()
        if handlers:
            await asyncio.wait(list(handlers), timeout=5.0)
        await stop_progress()


class RawChild:
    """The ``--raw-server`` child process, killed by PID on :meth:`stop`."""

    def __init__(self, workdir: Path) -> None:
        self.portfile = workdir / "raw-server.json"
        self.log_path = workdir / "raw-server.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--raw-server", str(self.portfile)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + CHILD_READY_TIMEOUT
        while not self.portfile.exists():
            if self.proc.poll() is not None:
                raise BenchError(f"raw server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"raw server not ready after {CHILD_READY_TIMEOUT}s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.port = int(json.loads(self.portfile.read_text())["port"])

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(CHILD_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(CHILD_STOP_TIMEOUT)


async def _raw_put(conn: Connection, src: Blocks) -> float:
    """Client -> server: seconds from posting all sends to the server's ack."""
    await conn.send_message({"op": "c2s", "n": src.count, "size": src.size}, OP_TIMEOUT)
    ready = await conn.recv_message(OP_TIMEOUT)
    if ready.get("t") != "ready":
        raise BenchError(f"raw server did not get ready: {ready!r:.200}")
    views = [memoryview(b) for b in src.blocks]
    t0 = time.perf_counter()
    await conn.send_payloads(views, OP_TIMEOUT)
    ack = await conn.recv_message(OP_TIMEOUT)
    elapsed = time.perf_counter() - t0
    if ack.get("t") != "ack" or ack.get("n") != src.count:
        raise BenchError(f"raw server sent a bad ack: {ack!r:.200}")
    return elapsed


async def _raw_read(conn: Connection, dst: Blocks) -> float:
    """Server -> client: seconds from sending the request to the last payload received."""
    views = [memoryview(b) for b in dst.blocks]
    t0 = time.perf_counter()
    await conn.send_message({"op": "s2c", "n": dst.count, "size": dst.size}, OP_TIMEOUT)
    await conn.recv_payloads(views, OP_TIMEOUT)
    return time.perf_counter() - t0


# ---- measurements -------------------------------------------------------------------------------


def memcpy_once(src: Blocks, dst: Blocks) -> float:
    t0 = time.perf_counter()
    for s, d in zip(src.blocks, dst.blocks):
        np.copyto(d, s)
    return time.perf_counter() - t0


def hash_once(src: Blocks) -> tuple[float, float]:
    """Seconds to hash every block: raw ``xxh3_128_digest``, then ``block_checksum`` (with the key prefix)."""
    import xxhash

    from dkv.checksum import block_checksum

    t0 = time.perf_counter()
    for b in src.blocks:
        xxhash.xxh3_128_digest(b)
    raw_s = time.perf_counter() - t0
    h = b"\x00" * 32
    t0 = time.perf_counter()
    for b in src.blocks:
        block_checksum(LEAF, 0, h, b)
    return raw_s, time.perf_counter() - t0


async def raw_once(conn: Connection, src: Blocks, dst: Blocks) -> tuple[float, float, bool]:
    """Raw put then raw read (the read sends back what the put delivered); seconds and bit-exactness."""
    put_s = await _raw_put(conn, src)
    dst.buf.fill(0)
    read_s = await _raw_read(conn, dst)
    return put_s, read_s, src.equals(dst)


async def dkv_once(client: Any, src: Blocks, dst: Blocks) -> tuple[float, float, bool]:
    """dKV put then leased lookup + read, under fresh random 32-byte hashes; seconds and bit-exactness."""
    from dkv.keys import BlockKey

    hashes = [secrets.token_bytes(32) for _ in range(src.count)]
    keys = [BlockKey(LEAF, 0, h) for h in hashes]
    await client.clear()  # untimed: room for this put without evicting inside it

    t0 = time.perf_counter()
    result = await client.write(keys, src.blocks)
    put_s = time.perf_counter() - t0
    if result.stored != src.count:
        raise BenchError(f"write stored {result.stored}/{src.count}: {collections.Counter(result.statuses)}")

    dst.buf.fill(0)
    t0 = time.perf_counter()
    found = await client.lookup(hashes, [LEAF], 1, lease=True)
    if not all(found.masks.get(LEAF, [])) or found.lease_id is None:
        raise BenchError(f"lookup found {sum(found.masks.get(LEAF, []))}/{src.count} blocks just written")
    await client.read(found.lease_id, keys, dst.blocks)
    read_s = time.perf_counter() - t0
    return put_s, read_s, src.equals(dst)


class Processes:
    """The node and the raw server child: paused while the other is measured, stopped in ``finally``.

    In ucxx's ``blocking`` progress mode (``DKV_UCX_PROGRESS=blocking``) a process keeps its
    event loop spinning even when idle; on a 2-core machine a third busy process would steal
    CPU from the pair being measured, so whichever of the two servers is not being measured is
    held with SIGSTOP (and both during memcpy).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.node: Any = None
        self.child: RawChild | None = None
        self.cleaning = False

    def _procs(self) -> dict[str, subprocess.Popen[bytes]]:
        procs = {}
        if self.node is not None:
            procs["node"] = self.node.proc
        if self.child is not None:
            procs["raw"] = self.child.proc
        return procs

    def only(self, *running: str) -> None:
        """Let the named processes run; stop the others (and wait until they are stopped)."""
        for name, proc in self._procs().items():
            if proc.poll() is not None:
                raise BenchError(f"the {name} process exited with {proc.returncode}")
            os.kill(proc.pid, signal.SIGCONT if name in running else signal.SIGSTOP)
        deadline = time.monotonic() + 2.0
        for name, proc in self._procs().items():
            if name not in running:
                while _proc_state(proc.pid) not in ("T", "t", "?") and time.monotonic() < deadline:
                    time.sleep(0.001)

    def resume_all(self) -> None:
        for proc in self._procs().values():
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def stop_all(self) -> None:
        self.resume_all()  # a stopped process would not act on SIGTERM
        if self.child is not None:
            self.child.stop()
        if self.node is not None:
            self.node.stop()


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


async def run_all(procs: Processes, sizes: list[int], blocks: int, runs: int, warmup: int, pool: int,
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Per size, ``warmup + runs`` rounds; each round runs every measurement once, back to back.

    Interleaving makes each ratio compare numbers taken in the same time window (this machine
    is shared, and its loopback throughput drifts by 2-3x between windows).
    """
    from cluster.process import start_node
    from dkv.client import NodeClient

    init_transport()
    results: list[dict[str, Any]] = []
    raw: Connection | None = None
    clients: dict[str, Any] = {}
    try:
        log("starting the raw ucxx server")
        procs.child = RawChild(procs.workdir)
        raw = await connect("127.0.0.1", procs.child.port)
        log(f"starting the node (pool {format_size(pool)})")
        procs.node = start_node(pool=str(pool), listen="127.0.0.1:0", workdir=procs.workdir / "node",
                                exit_with_parent=True)
        for name in DKV_PATHS:
            local = name.startswith("local")
            client = NodeClient(procs.node.address, NAMESPACE, local=local, timeout=OP_TIMEOUT,
                                pool_size=1, retries=1, checksums=not name.endswith("_nosum"))
            clients[name] = client
            await client.connect()
            if client.uses_shared_memory != local:
                raise BenchError(f"the {name} client did not get the {'local' if local else 'listener'} path")

        for size in sizes:
            log(f"{format_size(size)} x {blocks}: {warmup} warm-up + {runs} rounds")
            src, dst = Blocks(blocks, size), Blocks(blocks, size)
            src.fill_random(seed=size)
            samples: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
            verified = {"raw_ucxx": True, **{name: True for name in DKV_PATHS}}
            for round_no in range(warmup + runs):
                timed = round_no >= warmup
                procs.only()
                copy_s = memcpy_once(src, dst)
                xxh3_s, checksum_s = hash_once(src)
                procs.only("raw")
                raw_put, raw_read, ok = await raw_once(raw, src, dst)
                verified["raw_ucxx"] &= ok
                measured = {("memcpy", "copy"): copy_s, ("raw_ucxx", "put"): raw_put, ("raw_ucxx", "read"): raw_read,
                            ("xxh3", "raw"): xxh3_s, ("xxh3", "block_checksum"): checksum_s}
                procs.only("node")
                for name, client in clients.items():
                    put_s, read_s, ok = await dkv_once(client, src, dst)
                    verified[name] &= ok
                    measured[(name, "put")], measured[(name, "read")] = put_s, read_s
                if timed:
                    for key, value in measured.items():
                        samples[key].append(value)
            await clients["local"].clear()
            entry: dict[str, Any] = {"size": size, "size_label": format_size(size), "blocks": blocks,
                                     "bytes_per_op": src.nbytes}
            for (path, op), values in samples.items():
                entry.setdefault(path, {})[op] = _rates(values, src.nbytes)
            for path, ok in verified.items():
                entry[path]["verified"] = ok
            entry["ratios"] = _ratios(entry)
            entry["ratios_median"] = _ratios(entry, "median")
            entry["checksum_ratios"] = _checksum_ratios(entry)
            entry["checksum_ratios_median"] = _checksum_ratios(entry, "median")
            results.append(entry)
            del src, dst
        procs.only("raw", "node")
        await raw.send_message({"op": "bye"}, OP_TIMEOUT)
    finally:
        procs.cleaning = True  # no more re-cancelling by the signal watchdog: let the cleanup finish
        procs.resume_all()
        if raw is not None:
            raw.abort()
        for client in clients.values():
            await client.close()
        await stop_progress()
    return results


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while the benchmark ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def run_interruptible(procs: Processes, *args: Any) -> list[dict[str, Any]]:
    """:func:`run_all`, cancelled on SIGINT/SIGTERM; raises :class:`Interrupted` then.

    The cancellation is repeated every 0.5 s until the cleanup starts: Python 3.11's
    ``asyncio.wait_for`` (which bounds every dKV transport await) drops a cancellation that
    arrives as its inner future completes, so a single ``cancel()`` can be lost.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[int] = []
    inner = asyncio.ensure_future(run_all(procs, *args))

    def recancel() -> None:
        if not inner.done() and not procs.cleaning:
            inner.cancel()
            loop.call_later(0.5, recancel)

    def on_signal(signum: int) -> None:
        received.append(signum)
        recancel()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await inner
    except asyncio.CancelledError:
        if received:
            raise Interrupted(received[0]) from None
        raise
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


def _ratios(entry: dict[str, Any], stat: str = "best") -> dict[str, float]:
    """The goal ratios, from the ``best`` numbers (or the ``median`` ones)."""
    rate = lambda path, op: entry[path][op][stat]  # noqa: E731
    return {
        "local_read_vs_memcpy": rate("local", "read") / rate("memcpy", "copy"),
        "local_put_vs_memcpy": rate("local", "put") / rate("memcpy", "copy"),
        "listener_read_vs_raw_ucxx": rate("listener", "read") / rate("raw_ucxx", "read"),
        "listener_put_vs_raw_ucxx": rate("listener", "put") / rate("raw_ucxx", "put"),
    }


def _checksum_ratios(entry: dict[str, Any], stat: str = "best") -> dict[str, float]:
    """Checksums on / off throughput per path and op, and the hash's throughput over memcpy's."""
    rate = lambda path, op: entry[path][op][stat]  # noqa: E731
    ratios = {f"{path}_{op}_on_vs_off": rate(path, op) / rate(f"{path}_nosum", op)
              for path in ("local", "listener") for op in ("put", "read")}
    ratios["xxh3_vs_memcpy"] = rate("xxh3", "raw") / rate("memcpy", "copy")
    ratios["block_checksum_vs_memcpy"] = rate("xxh3", "block_checksum") / rate("memcpy", "copy")
    return ratios


def _goals(entry: dict[str, Any]) -> dict[str, bool]:
    r = entry["ratios"]
    return {
        "local_read_vs_memcpy": r["local_read_vs_memcpy"] >= GOAL_LOCAL_READ_VS_MEMCPY,
        "listener_read_vs_raw_ucxx": r["listener_read_vs_raw_ucxx"] >= GOAL_LISTENER_VS_RAW,
        "listener_put_vs_raw_ucxx": r["listener_put_vs_raw_ucxx"] >= GOAL_LISTENER_VS_RAW,
    }


# ---- report -------------------------------------------------------------------------------------


def print_report(results: list[dict[str, Any]], runs: int, warmup: int, blocks: int, load_start: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if console.width < 170:
        console = Console(width=170)

    def ratio_cell(value: float, goal: float | None) -> str:
        text = f"{value:.0%}"
        if goal is None:
            return text
        return f"[green]{text}[/]" if value >= goal else f"[red]{text}[/]"

    for stat in ("best", "median"):
        table = Table(title=f"dKV node throughput, GB/s ({stat} of {runs} runs after {warmup} warm-up; "
                            f"{blocks} blocks per op)")
        for col in ("block", "memcpy", "raw ucxx put\n(c→s)", "raw ucxx read\n(s→c)", "local put", "local read",
                    "listener put", "listener read", "local read\n/ memcpy", "listener read\n/ raw read",
                    "listener put\n/ raw put", "local put\n/ memcpy", "bit-exact"):
            table.add_column(col, justify="right")
        for e in results:
            g = lambda path, op: f"{e[path][op][stat]:.2f}"  # noqa: E731
            r = _ratios(e, stat)
            ok = all(e[p]["verified"] for p in ("raw_ucxx", *DKV_PATHS))
            table.add_row(e["size_label"], g("memcpy", "copy"), g("raw_ucxx", "put"), g("raw_ucxx", "read"),
                          g("local", "put"), g("local", "read"), g("listener", "put"), g("listener", "read"),
                          ratio_cell(r["local_read_vs_memcpy"], GOAL_LOCAL_READ_VS_MEMCPY),
                          ratio_cell(r["listener_read_vs_raw_ucxx"], GOAL_LISTENER_VS_RAW),
                          ratio_cell(r["listener_put_vs_raw_ucxx"], GOAL_LISTENER_VS_RAW),
                          ratio_cell(r["local_put_vs_memcpy"], None), "[green]yes[/]" if ok else "[bold red]NO[/]")
        console.print(table)

    for stat in ("best", "median"):
        table = Table(title=f"End-to-end block checksums: throughput with them on / off, GB/s ({stat}); "
                            "the hash alone beside memcpy on the same buffers")
        for col in ("block", "local put\non / off", "local read\non / off", "listener put\non / off",
                    "listener read\non / off", "memcpy", "xxh3_128", "xxh3\n/ memcpy", "block_checksum",
                    "block_checksum\n/ memcpy"):
            table.add_column(col, justify="right")
        for e in results:
            g = lambda path, op: e[path][op][stat]  # noqa: E731
            r = _checksum_ratios(e, stat)
            pair = lambda path, op: f"{g(path, op):.2f} / {g(path + '_nosum', op):.2f} ({r[f'{path}_{op}_on_vs_off']:.0%})"  # noqa: E731
            table.add_row(e["size_label"], pair("local", "put"), pair("local", "read"), pair("listener", "put"),
                          pair("listener", "read"), f"{g('memcpy', 'copy'):.2f}", f"{g('xxh3', 'raw'):.2f}",
                          f"{r['xxh3_vs_memcpy']:.0%}", f"{g('xxh3', 'block_checksum'):.2f}",
                          f"{r['block_checksum_vs_memcpy']:.0%}")
        console.print(table)

    console.print(
        f"Goals: same-host (local) read >= {GOAL_LOCAL_READ_VS_MEMCPY:.0%} of aligned memcpy; "
        f"listener read and put >= {GOAL_LISTENER_VS_RAW:.0%} of raw ucxx (best vs best).\n"
        "raw ucxx put = client→server, timed from posting all sends to the server's framed ack; "
        "raw ucxx read = server→client, timed from a tiny framed request to the last payload received.\n"
        "dKV put = one write() of all blocks (fresh hashes); dKV read = leased lookup() + read() into "
        f"page-aligned buffers. UCX progress mode: {PROGRESS_MODE}. Rounds interleave all measurements; the "
        "server not being measured is paused (SIGSTOP) so only the measured pair runs."
    )
    for e in results:
        goals = _goals(e)
        parts = [f"{name.replace('_', ' ')} {e['ratios'][name]:.1%} "
                 f"{'[green]met[/]' if met else '[red]missed[/]'}" for name, met in goals.items()]
        console.print(f"  {e['size_label']:>9}: " + "; ".join(parts))
    console.print(f"Machine: {os.cpu_count()} CPUs; load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} "
                  "at end (this run's own two busy processes count ~2; more means other work skewed the numbers).")


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated block sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per op (default 256)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before them (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="write every number to this JSON file")
    parser.add_argument("--raw-server", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server is None:
        try:
            args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        except DKVError as exc:
            parser.error(str(exc))
        if not args.size_list or any(s <= 0 for s in args.size_list):
            parser.error("--sizes needs at least one positive size")
        if not 1 <= args.blocks <= 65536:
            parser.error("--blocks must be in [1, 65536]")
        if args.repeat < 1 or args.warmup < 0:
            parser.error("--repeat must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.raw_server is not None:
        asyncio.run(_raw_server(args.raw_server))
        return 0

    from rich.console import Console

    from cluster.process import NodeStartError

    err = Console(stderr=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # outside the event loop: run the finally blocks
    max_size = max(args.size_list)
    pool = args.blocks * _align_up(max_size) * 2 + 64 * 2**20
    started = time.time()
    load_start = list(os.getloadavg())
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dkv-bench-") as tmp:
        procs = Processes(Path(tmp))
        try:
            results = asyncio.run(run_interruptible(procs, args.size_list, args.blocks, args.repeat, args.warmup,
                                                    pool, lambda msg: err.log(msg)))
        except Interrupted as exc:
            err.print(f"[bold red]interrupted[/] by {exc}: stopped the node and the raw server")
            return 128 + exc.signum
        except (DKVError, BenchError, NodeStartError) as exc:
            err.print(f"[bold red]benchmark failed:[/] {type(exc).__name__}: {exc}")
            if procs.node is not None:
                err.print(f"node log tail:\n{procs.node.log_tail()}")
            if procs.child is not None:
                err.print(f"raw server log tail:\n{procs.child.log_tail()}")
            return 2
        finally:
            procs.stop_all()

    print_report(results, args.repeat, args.warmup, args.blocks, load_start[0])
    verified = all(e[p]["verified"] for e in results for p in ("raw_ucxx", *DKV_PATHS))
    if args.json is not None:
        for e in results:
            e["goals_met"] = _goals(e)
        doc = {
            "machine": {**machine_info(), "loadavg_start": load_start},
            "config": {"sizes": args.size_list, "blocks": args.blocks, "repeat": args.repeat, "warmup": args.warmup,
                       "pool_bytes": pool, "unit": "GB/s (1e9 bytes/s) of block payload",
                       "read_timing": "leased lookup + read", "put_timing": "one write() call",
                       "checksums": "local/listener: on (default); *_nosum: off; xxh3: the hash alone",
                       "raw_ucxx": {"put": "client->server, posting sends to framed ack",
                                    "read": "server->client, framed request to last payload"}},
            "goals": {"local_read_vs_memcpy": GOAL_LOCAL_READ_VS_MEMCPY,
                      "listener_read_vs_raw_ucxx": GOAL_LISTENER_VS_RAW,
                      "listener_put_vs_raw_ucxx": GOAL_LISTENER_VS_RAW},
            "verified": verified,
            "elapsed_s": time.time() - started,
            "results": results,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if not verified:
        Console(stderr=True).print("[bold red]bit-exact verification FAILED[/] (see the bit-exact column)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
