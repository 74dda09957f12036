#!/usr/bin/env python
"""One connector process of the soak (``scripts/soak.py`` starts it; not meant to be run by hand).

Usage: ``python scripts/soak_worker.py CONFIG_JSON``. It imports the connector,
says ``imported`` (a JSON line on stdout), waits for ``go`` on stdin, makes a
:class:`DKVConnector` co-located with its node and a :class:`dkv.router.Router`
of its own (the hints a serving router would write), then runs operations
until ``stop`` (or the end of stdin):

* ``offload``: a new chain of its own (:func:`soak_common.chain_hashes`) from its
  device rows to its co-located node;
* ``load_local``: one of its own recent chains, no hint (the co-located node):
  ``start_lookup`` then ``load_lookup`` of the leading hits;
* ``load_hint``: a recent chain of another worker, with the hint the router
  gives for it (or none when nothing routes): ``start_lookup`` then ``load_lookup``;
* ``lookup_sync``: the same through the synchronous ``lookup`` then ``load``.

Every loaded row is first filled with a poison byte, and after the load every
byte is compared with :func:`soak_common.block_bytes` of its hash. Every
operation is bounded by ``op_bound`` seconds: waiting past it, or being stuck
in a call past it (seen by the heartbeat thread), counts one hang; the rows of
a hung operation are never used again. Each second a status line (cumulative
counters, memory) goes to stdout; the last one is ``final``. SIGINT is ignored
(the orchestrator stops it), and it dies with its parent.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402

from soak_common import (  # noqa: E402
    BLOCK_BYTES,
    CONNECTOR_TIMEOUT,
    HEARTBEAT,
    LEAF,
    NAMESPACE,
    block_bytes,
    chain_hashes,
    die_with_parent,
    leading_hits,
    malloc_info,
    proc_memory,
)

POISON = 0x5A
OP_KINDS = ("offload", "load_local", "load_hint", "lookup_sync")
RECENT_CHAINS = 48  # a load picks among a writer's last this many chains
MAX_INCIDENTS = 20
MAX_DURATIONS = 50_000


class Hang(Exception):
    """An operation exceeded its bound."""


@dataclasses.dataclass
class OpStats:
    requests: int = 0
    hits: int = 0  # requests that loaded (and verified) at least one block
    misses: int = 0  # requests that found nothing to load
    blocks_hit: int = 0
    blocks_missed: int = 0
    bytes_checked: int = 0
    wrong_bytes: int = 0
    hangs: int = 0
    failures: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    sources: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["failures"], d["sources"] = dict(self.failures), dict(self.sources)
        return d


class Rows:
    """The device tensor's rows (row 0 is the null block): taken, given back, or retired after a hang."""

    def __init__(self, count: int) -> None:
        import torch

        self.buf = np.zeros((count + 1, BLOCK_BYTES), dtype=np.uint8)
        self.tensor = torch.from_numpy(self.buf)
        self.free = list(range(1, count + 1))
        self.retired = 0

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give(self, ids: list[int]) -> None:
        self.free.extend(ids)

    def retire(self, ids: list[int]) -> None:
        self.retired += len(ids)


class Worker:
    def __init__(self, cfg: dict[str, Any], out: Any) -> None:
        self.cfg = cfg
        self.index: int = cfg["index"]
        self.run_id: str = cfg["run"]
        self.bound: float = cfg["op_bound"]
        self.pace: float = cfg["pace"]
        self.progress_dir = Path(cfg["progress_dir"])
        self.out = out
        self.out_lock = threading.Lock()
        self.lock = threading.Lock()  # stats, current op, incidents
        self.stats = {kind: OpStats() for kind in OP_KINDS}
        self.durations: dict[str, list[float]] = {kind: [] for kind in OP_KINDS}
        self.incidents: dict[str, list[dict[str, Any]]] = {"wrong_bytes": [], "hangs": [], "errors": []}
        self.current: tuple[int, str, str, float] | None = None  # op id, kind, phase, start
        self.hung: set[int] = set()
        self.op_id = 0
        self.stop = threading.Event()
        self.rng = random.Random(cfg["seed"])
        self.next_chain = 0
        self.mine: collections.deque[int] = collections.deque(maxlen=RECENT_CHAINS)
        self.others: dict[int, int] = {}
        self.others_read = 0.0
        self.conn: Any = None
        self.router: Any = None
        self.baseline_snapshot: Any = None

    # ---- reporting -------------------------------------------------------------------------------

    def say(self, msg: dict[str, Any]) -> None:
        with self.out_lock:
            try:
                self.out.write(json.dumps(msg) + "\n")
                self.out.flush()
            except (OSError, ValueError):
                pass

    def memory(self) -> dict[str, Any]:
        mem: dict[str, Any] = {**proc_memory(os.getpid()), **malloc_info()}
        if tracemalloc.is_tracing():
            mem["traced"] = tracemalloc.get_traced_memory()[0]
        return mem

    def status(self, kind: str = "hb") -> dict[str, Any]:
        with self.lock:
            ops = {k: s.as_dict() for k, s in self.stats.items()}
            incidents = {k: list(v) for k, v in self.incidents.items()}
            current = None
            if self.current is not None:
                current = {"kind": self.current[1], "phase": self.current[2],
                           "age": time.monotonic() - self.current[3]}
        counters: dict[str, Any] = {}
        if self.conn is not None:
            c = self.conn.counters
            counters = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
            counters["unusable_hints"] = dict(counters["unusable_hints"])
        return {"t": kind, "at": time.time(), "pid": os.getpid(), "ops": ops, "incidents": incidents,
                "current": current, "chains": self.next_chain, "mem": self.memory(), "connector": counters,
                "rows_retired": self.rows.retired if hasattr(self, "rows") else 0}

    def incident(self, category: str, **what: Any) -> None:
        with self.lock:
            if len(self.incidents[category]) < MAX_INCIDENTS:
                self.incidents[category].append({"at": time.time(), **what})

    def heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT):
            self.check_stuck()
            self.say(self.status())

    def check_stuck(self) -> None:
        """Heartbeat thread: an operation stuck in a call past its bound is a hang (counted once)."""
        with self.lock:
            cur = self.current
            if cur is None or time.monotonic() - cur[3] <= self.bound or cur[0] in self.hung:
                return
            self.hung.add(cur[0])
            self.stats[cur[1]].hangs += 1
        self.incident("hangs", kind=cur[1], phase=cur[2], seen_by="heartbeat", bound=self.bound)

    def stdin_reader(self) -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        self.stop.set()

    # ---- operations ------------------------------------------------------------------------------

    def phase(self, phase: str) -> None:
        with self.lock:
            if self.current is not None:
                self.current = (self.current[0], self.current[1], phase, self.current[3])

    def wait(self, item: Any, what: str) -> None:
        """Until ``item`` (lookup handle or transfer) completes; :class:`Hang` past the op's bound.

        ``is_complete`` raises a failed load's ``KVLoadFailed``.
        """
        self.phase(what)
        assert self.current is not None
        deadline = self.current[3] + self.bound
        future = getattr(item, "_future", None)
        if isinstance(future, concurrent.futures.Future) and not getattr(item, "answered_by_polling", False):
            event = threading.Event()
            future.add_done_callback(lambda _f: event.set())
            event.wait(max(0.0, deadline - time.monotonic()))
        while not item.is_complete():
            if time.monotonic() > deadline:
                raise Hang(what)
            time.sleep(0.0005)

    def pick_other(self) -> tuple[int, int] | None:
        """A recent chain of another worker, as its progress file says (re-read at most twice a second)."""
        now = time.monotonic()
        if now - self.others_read > 0.5:
            self.others_read = now
            for path in self.progress_dir.glob("chains-*"):
                writer = int(path.name.split("-")[1])
                if writer != self.index:
                    try:
                        self.others[writer] = int(path.read_text() or 0)
                    except (OSError, ValueError):
                        pass
        written = [(w, n) for w, n in self.others.items() if n > 0]
        if not written:
            return None
        writer, n = self.rng.choice(written)
        return writer, self.rng.randrange(max(0, n - RECENT_CHAINS), n)

    def publish_progress(self) -> None:
        path = self.progress_dir / f"chains-{self.index}"
        tmp = self.progress_dir / f"writing-{self.index}"
        tmp.write_text(str(self.next_chain))
        tmp.replace(path)

    def run_op(self, kind: str) -> None:
        with self.lock:
            self.op_id += 1
            op_id = self.op_id
            self.current = (op_id, kind, "start", time.monotonic())
            self.stats[kind].requests += 1
        stats = self.stats[kind]
        t0 = time.monotonic()
        rows: list[int] = []
        try:
            if kind == "offload":
                rows = self.offload()
            else:
                rows = self.load(kind)
        except Hang as exc:
            with self.lock:
                if op_id not in self.hung:
                    self.hung.add(op_id)
                    stats.hangs += 1
                    hung = True
                else:
                    hung = False
            if hung:
                self.incident("hangs", kind=kind, phase=str(exc), seen_by="wait", bound=self.bound)
            self.rows.retire(rows)  # a late copy may still land in them
            rows = []
        except Exception as exc:  # noqa: BLE001 - every failure is counted by kind, none ends the soak
            name = _failure_kind(exc)
            with self.lock:
                stats.failures[name] += 1
            if name.startswith("error:"):
                self.incident("errors", kind=kind, error=f"{type(exc).__name__}: {exc}"[:500])
        finally:
            took = time.monotonic() - t0
            with self.lock:
                if op_id in self.hung and rows:
                    self.rows.retire(rows)
                    rows = []
                self.current = None
                durations = self.durations[kind]
                if len(durations) < MAX_DURATIONS:
                    durations.append(took)
            if rows:
                self.rows.give(rows)

    def offload(self) -> list[int]:
        chain = self.next_chain
        hashes = chain_hashes(self.run_id, self.index, chain)
        ids = self.rows.take(len(hashes))
        if ids is None:
            raise RuntimeError("no free device rows")
        for row, h in zip(ids, hashes):
            self.rows.buf[row] = block_bytes(h)
        failed_before = self.conn.counters.offloads_failed
        dropped_before = getattr(self.conn.counters, "offloads_dropped", 0)
        offloaded_before = self.conn.counters.blocks_offloaded
        self.phase("offload")
        try:
            transfer = self.conn.offload({LEAF: ids}, {LEAF: hashes})
            self.wait(transfer, "offload transfer")
        except Hang:
            self.rows.retire(ids)  # the copy out of them may still run
            raise
        except BaseException:
            self.rows.give(ids)
            raise
        stats = self.stats["offload"]
        stored = self.conn.counters.blocks_offloaded - offloaded_before
        self.next_chain += 1
        self.publish_progress()
        with self.lock:
            if self.conn.counters.offloads_failed > failed_before:
                stats.failures["offload_failed"] += 1
            elif getattr(self.conn.counters, "offloads_dropped", 0) > dropped_before:
                stats.failures["offload_dropped"] += 1  # not sent: the node failed to answer recently
            else:
                stats.hits += 1
                stats.blocks_hit += stored
                self.mine.append(chain)
        return ids

    def load(self, kind: str) -> list[int]:
        stats = self.stats[kind]
        if kind == "load_local":
            if not self.mine:
                return self.offload_instead()
            writer, chain = self.index, self.rng.choice(self.mine)
        else:
            picked = self.pick_other()
            if picked is None:
                return self.offload_instead()
            writer, chain = picked
        hashes = chain_hashes(self.run_id, writer, chain)
        hint: bytes | None = None
        source = "co-located"
        if kind != "load_local":
            route = self.router.route(NAMESPACE, hashes)
            if route.peer is not None and route.hint is not None:
                hint = route.hint.encode()
                source = f"hint:{route.peer.node_id}"
            else:
                source = "unrouted"
        with self.lock:
            stats.sources[source] += 1
        if kind == "lookup_sync":
            self.phase("lookup (synchronous)")
            masks = self.conn.lookup(hashes, 0, hint)
            n = leading_hits(masks[LEAF])
            if n == 0:
                self.count_miss(stats, len(hashes))
                return []
            ids = self.rows.take(n)
            if ids is None:
                raise RuntimeError("no free device rows")
            self.rows.buf[ids] = POISON
            self.phase("load")
            try:
                transfer = self.conn.load({LEAF: ids}, {LEAF: hashes[:n]}, 0, hint)
            except BaseException:
                self.rows.give(ids)
                raise
        else:
            self.phase("start_lookup")
            handle = self.conn.start_lookup(hashes, 0, hint)
            try:
                self.wait(handle, "lookup")
            except Hang:
                self.conn.abandon_lookup(handle)
                raise
            n = leading_hits(handle.result()[LEAF])
            if n == 0:
                self.conn.abandon_lookup(handle)
                self.count_miss(stats, len(hashes))
                return []
            ids = self.rows.take(n)
            if ids is None:
                self.conn.abandon_lookup(handle)
                raise RuntimeError("no free device rows")
            self.rows.buf[ids] = POISON
            self.phase("load_lookup")
            try:
                transfer = self.conn.load_lookup(handle, {LEAF: ids}, {LEAF: hashes[:n]}, 0, hint)
            except BaseException:
                self.rows.give(ids)
                raise
        try:
            self.wait(transfer, "load transfer")
        except Hang:
            self.rows.retire(ids)
            raise
        except BaseException:
            self.rows.give(ids)
            raise
        self.phase("verify")
        wrong = 0
        for i, (row, h) in enumerate(zip(ids, hashes[:n])):
            bad = int(np.count_nonzero(self.rows.buf[row] != block_bytes(h)))
            if bad:
                wrong += bad
                self.incident("wrong_bytes", kind=kind, writer=writer, chain=chain, block=i, hash=h.hex(),
                              bytes_wrong=bad, source=source, poisoned=bool((self.rows.buf[row] == POISON).all()))
        with self.lock:
            stats.bytes_checked += n * BLOCK_BYTES
            stats.wrong_bytes += wrong
            stats.hits += 1
            stats.blocks_hit += n
            stats.blocks_missed += len(hashes) - n
        return ids

    def offload_instead(self) -> list[int]:
        """Nothing to load yet: this request is an offload (counted as one)."""
        with self.lock:
            self.stats[self.current[1]].requests -= 1  # type: ignore[index]
            self.stats["offload"].requests += 1
            self.current = (self.current[0], "offload", "start", self.current[3])  # type: ignore[index]
        return self.offload()

    def count_miss(self, stats: OpStats, blocks: int) -> None:
        with self.lock:
            stats.misses += 1
            stats.blocks_missed += blocks

    # ---- life --------------------------------------------------------------------------------------

    def start(self) -> None:
        from connector.dkv_connector import DKVConnector
        from connector.types import full_attention
        from dkv.etcd import Layout, make_client
        from dkv.loop_thread import acquire_shared_loop
        from dkv.router import Router

        cfg = self.cfg
        self.rows = Rows(cfg["rows"])
        deadline = time.monotonic() + cfg["ready_timeout"]
        while True:
            try:
                self.conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [self.rows.tensor]}], namespace=NAMESPACE,
                                         node=cfg["node"], node_id=cfg["node_id"], etcd=cfg["etcd"],
                                         cluster=cfg["cluster"], timeout=CONNECTOR_TIMEOUT, local=cfg.get("local"))
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.loop = acquire_shared_loop()

        async def start_router() -> tuple[Any, Any]:
            client = make_client(cfg["etcd"])
            await client.connect()
            router = Router(client, Layout(cfg["cluster"]))
            await router.start()
            return client, router

        self.etcd_client, self.router = self.loop.run(start_router(), cfg["ready_timeout"])

    def close(self) -> None:
        from dkv.loop_thread import release_shared_loop

        if self.conn is not None:
            self.conn.shutdown()
        if self.router is not None:
            async def stop_router() -> None:
                await self.router.stop()
                await self.etcd_client.close()

            try:
                self.loop.run(stop_router(), 10)
            except Exception:  # noqa: BLE001
                pass
            release_shared_loop()

    def run(self) -> None:
        mix = self.cfg["mix"]
        kinds, weights = list(mix), list(mix.values())
        while not self.stop.is_set():
            self.run_op(self.rng.choices(kinds, weights)[0])
            self.conn.poll_transfers()  # as an engine does every step: settled transfers leave the books
            if self.pace:
                self.stop.wait(self.pace)


def _failure_kind(exc: BaseException) -> str:
    name = type(exc).__name__
    if name in ("KVLoadRefused", "KVLoadInvalid"):
        return "load_refused"
    if name == "KVLoadFailed":
        return "load_failed"
    return f"error:{name}"


def _latency(durations: list[float]) -> dict[str, float]:
    if not durations:
        return {}
    arr = np.sort(np.asarray(durations))
    return {"p50_ms": float(arr[len(arr) // 2] * 1e3), "p99_ms": float(arr[min(len(arr) - 1, int(len(arr) * 0.99))] * 1e3),
            "max_ms": float(arr[-1] * 1e3), "count": len(arr)}


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the orchestrator stops us
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to the log, not into the status lines
    if cfg.get("log_level"):
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        for name in ("connector", "dkv"):
            logging.getLogger(name).setLevel(cfg["log_level"])
    worker = Worker(cfg, out)
    import connector.dkv_connector  # noqa: F401 - the import (torch, ucxx, MAX) is the slow part of starting

    if cfg.get("trace_memory"):  # from here on: tracing the imports would take minutes
        tracemalloc.start(cfg.get("trace_frames", 1))
    worker.say({"t": "imported", "pid": os.getpid(), "mem": worker.memory()})
    if sys.stdin.readline().strip() != "go":
        return 0
    threading.Thread(target=worker.stdin_reader, daemon=True).start()
    code = 0
    try:
        worker.start()
        worker.say({"t": "ready", "pid": os.getpid(), "mem": worker.memory()})
        if tracemalloc.is_tracing():
            worker.baseline_snapshot = tracemalloc.take_snapshot()
        threading.Thread(target=worker.heartbeat, daemon=True).start()
        worker.run()
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
        worker.say({"t": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]})
        code = 2
    finally:
        worker.stop.set()
        final = worker.status("final")
        final["latency"] = {k: _latency(v) for k, v in worker.durations.items()}
        if worker.baseline_snapshot is not None:
            top = tracemalloc.take_snapshot().compare_to(worker.baseline_snapshot, "lineno")[:15]
            final["tracemalloc_top"] = [str(s) for s in top]
        worker.close()
        final["mem_after_close"] = worker.memory()
        worker.say(final)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
