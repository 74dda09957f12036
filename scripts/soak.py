#!/usr/bin/env python
"""The soak: a 3-node cluster under concurrent connectors, node kills and an etcd restart, for M minutes.

Usage::

    python scripts/soak.py --minutes M [--out DIR]        # DIR defaults to soak-out/
    python scripts/soak.py --minutes 2 --client-env MALLOC_ARENA_MAX=2 ...   # see --help

Everything runs on this machine, started here and stopped by PID at the end
(Ctrl-C included): one etcd, three ``dkv serve`` nodes on fixed loopback
ports, and one connector process per node (``scripts/soak_worker.py``, each
with a :class:`DKVConnector` co-located with its node and a router of its
own). The connectors offload chains of blocks, look them up and load them
back, their own through the co-located node and the others' through the hint
the router (:mod:`dkv.router`) gives; every loaded byte is compared with
what was written (a block's bytes are a function of its hash).

Meanwhile, on a schedule drawn from ``--seed``: a node is killed (SIGKILL)
and restarted on the same port with the same id, every quarter of the run or
so (at most every 90 s), and etcd is killed and restarted on the same ports
and data about half-way (and every 5 minutes on long runs). The last fifth of
the run has no fault, so recovery shows.

Reports requests, hits, misses, failures by kind, wrong bytes, hangs (an
operation that outlives its bound, ``--op-bound`` seconds), and the RSS of
the nodes and of the connector processes over time (split anonymous / shared /
file, and the connectors' glibc heap): a table on stdout, ``DIR/soak.json``
and ``DIR/soak.png``.

Exit status: 0; 1 if any byte loaded was wrong, any operation hung, or a
process crashed (one the soak did not kill); 2 on an error (the cluster did not
start...); 130/143 on SIGINT/SIGTERM (always after stopping what it started).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:  # `cluster` and `dkv` live at the repository root; the soak's modules here
        sys.path.insert(0, _p)

from soak_common import HEARTBEAT, OP_BOUND, pid_alive, proc_memory, segment_mappings  # noqa: E402

WORKER = Path(__file__).resolve().parent / "soak_worker.py"
NODES = ("node-a", "node-b", "node-c")
READY_TIMEOUT = 120.0  # connector processes import torch, ucxx and MAX on a busy 2-core machine
STOP_GRACE = 20.0  # past the op bound, what a connector process gets to finish and report
SAMPLE_EVERY = 1.0
SEGMENT_EVERY = 5  # samples between two looks at the segments the connectors map (smaps is costlier)
QUIET_TAIL = 0.2  # the last fifth of the run has no fault
DEFAULT_MIX = {"offload": 3, "load_local": 3, "load_hint": 3, "lookup_sync": 1}


class SoakError(RuntimeError):
    """Something that stops the soak from running (a process did not start...)."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM: stop everything, report what ran, exit 130/143."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def log(msg: str) -> None:
    from rich.console import Console

    global _CONSOLE
    if _CONSOLE is None:
        _CONSOLE = Console(stderr=True)
    _CONSOLE.log(msg)


_CONSOLE: Any = None


# ---- the fault schedule ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    at: float  # seconds into the soak
    kind: str  # "node" or "etcd"
    down: float  # seconds it stays down
    node: str = ""


def fault_schedule(duration: float, seed: int, nodes: Sequence[str] = NODES) -> list[Fault]:
    """Node kills every quarter of the run or so (at most every 90 s), one etcd restart half-way
    (and one every 5 minutes on long runs); none overlaps another, none in the last fifth."""
    rng = random.Random(seed)
    gap = min(90.0, max(12.0, duration / 4))
    last = duration * (1 - QUIET_TAIL)
    faults: list[Fault] = []
    etcd_due = duration / 2
    cursor = duration * 0.2
    while cursor < last:
        if cursor >= etcd_due:
            down = rng.uniform(2.0, 4.0)
            faults.append(Fault(cursor, "etcd", down))
            etcd_due += 300.0
        else:
            down = rng.uniform(2.0, 5.0)
            faults.append(Fault(cursor, "node", down, rng.choice(list(nodes))))
        cursor += down + gap * rng.uniform(0.7, 1.1)
    if not any(f.kind == "etcd" for f in faults) and faults:  # short runs: the etcd restart is not skipped
        faults.append(Fault(faults[-1].at + faults[-1].down + 3.0, "etcd", 2.0))
    return faults


# ---- the cluster ---------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """etcd and the nodes, each restartable on its port; every PID it ever started is recorded."""

    workdir: Path
    pool: str
    cluster: str
    etcd: Any = None
    nodes: dict[str, Any] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    incarnations: dict[str, int] = field(default_factory=dict)
    pids: dict[str, list[int]] = field(default_factory=lambda: {"etcd": [], "nodes": [], "workers": []})
    killed: set[int] = field(default_factory=set)  # PIDs the soak killed itself
    down: dict[str, float] = field(default_factory=dict)  # killed nodes not yet restarted: when to try again

    def start_etcd(self) -> None:
        from cluster.etcd_process import start_etcd

        self.etcd = start_etcd(data_dir=Path(tempfile.mkdtemp(prefix="etcd-", dir=self.workdir)),
                               client_port=fixed_port(), peer_port=fixed_port())
        self.pids["etcd"].append(self.etcd.pid)

    def restart_etcd(self, down: float, interrupted: Callable[[], bool]) -> None:
        """SIGKILL etcd, wait ``down`` seconds, start it again on the same ports and data."""
        self.killed.add(self.etcd.pid)
        _kill(self.etcd.proc)
        _sleep(down, interrupted)
        for attempt in range(5):
            try:
                self.etcd = self.etcd.restart()
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(0.5)
        self.pids["etcd"].append(self.etcd.pid)

    def node_args(self, name: str) -> list[str]:
        return ["--etcd", self.etcd.url, "--cluster", self.cluster, "--node-id", name, "--log-level", "WARNING"]

    def start_node(self, name: str, attempts: int = 3) -> None:
        """Start ``name`` on its port (the same one every time); :class:`NodeStartError` after ``attempts``."""
        from cluster.process import NodeStartError, start_node

        port = self.ports.setdefault(name, fixed_port())
        for attempt in range(attempts):
            n = self.incarnations[name] = self.incarnations.get(name, 0) + 1
            try:
                node = start_node(*self.node_args(name), pool=self.pool, listen=f"127.0.0.1:{port}",
                                  workdir=self.workdir / f"{name}-{n}", exit_with_parent=True,
                                  ready_timeout=60.0)
                break
            except NodeStartError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5)
        self.nodes[name] = node
        self.pids["nodes"].append(node.pid)
        self.down.pop(name, None)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def kill_node(self, name: str) -> int:
        node = self.nodes[name]
        self.killed.add(node.pid)
        _kill(node.proc)
        node.stop()  # reaps it and removes what it left in /dev/shm
        return int(node.pid)

    def crashed(self) -> list[str]:
        """Nodes and etcd that exited without the soak killing them."""
        dead = [f"{name} (pid {n.pid}, exit {n.proc.returncode})" for name, n in self.nodes.items()
                if not n.alive() and n.pid not in self.killed]
        if self.etcd is not None and not self.etcd.alive() and self.etcd.pid not in self.killed:
            dead.append(f"etcd (pid {self.etcd.pid})")
        return dead

    def stop(self) -> None:
        for node in self.nodes.values():
            _quietly(lambda n=node: (os.kill(n.pid, signal.SIGCONT), n.proc.send_signal(signal.SIGTERM))
                     if n.alive() else None)
        for node in self.nodes.values():
            _quietly(node.stop)
        if self.etcd is not None:
            _quietly(self.etcd.stop)


def fixed_port(host: str = "0.0.0.0") -> int:
    """A free TCP port below the kernel's ephemeral range, so that once its process is killed no outgoing
    connection of this machine takes it as a source port before the restart binds it again (a port from
    ``bind(0)`` is in that range, and on a busy machine it is taken within seconds)."""
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise SoakError("no free port below the ephemeral range")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _sleep(seconds: float, interrupted: Callable[[], bool]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not interrupted():
        time.sleep(0.05)


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - cleanup goes on
        pass


# ---- the connector processes ---------------------------------------------------------------------------


class WorkerProc:
    """A ``soak_worker.py`` child: status lines read by a thread; ``stop`` on stdin ends it."""

    def __init__(self, index: int, cfg: dict[str, Any], log_path: Path, env: dict[str, str]) -> None:
        self.index = index
        self.name = f"client-{index}"
        self.log_path = log_path
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=logf, bufsize=0,
                                         env={**os.environ, **env})
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.latest: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None
        self.ready_mem: dict[str, Any] = {}
        self.imported = threading.Event()
        self.ready = threading.Event()
        self.error: str | None = None
        self.heap: list[list[float]] = []  # [t, heap in use, heap free, traced]
        self.offloads: list[tuple[float, int]] = []  # [t, offloads stored so far] (how fast it recovers)
        self.last_heard = time.monotonic()
        self.silent_hangs = 0
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            self.last_heard = time.monotonic()
            kind = msg.get("t")
            if kind == "imported":
                self.imported.set()
            elif kind == "ready":
                self.ready_mem = msg.get("mem", {})
                self.ready.set()
            elif kind == "error":
                self.error = msg.get("error")
                self.ready.set()
            elif kind in ("hb", "final"):
                self.latest = msg
                mem = msg.get("mem", {})
                self.heap.append([msg["at"], mem.get("heap_in_use", 0), mem.get("heap_free", 0), mem.get("traced", 0)])
                self.offloads.append((msg["at"], msg.get("ops", {}).get("offload", {}).get("hits", 0)))
                if kind == "final":
                    self.final = msg
        self.ready.set()
        self.imported.set()

    def send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float) -> bool:
        """Ask it to stop and wait for its exit; SIGKILL past ``timeout``. True if it stopped by itself."""
        self.send("stop")
        try:
            self.proc.wait(timeout)
            clean = True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _quietly(lambda: self.proc.wait(10))
            clean = False
        for stream in (self.proc.stdin, self.proc.stdout):
            _quietly(lambda s=stream: s.close() if s is not None else None)
        return clean


# ---- sampling ------------------------------------------------------------------------------------------


class Sampler:
    """Every second: RSS of every live node and connector process (and the totals the workers report)."""

    def __init__(self, cluster: Cluster, workers: list[WorkerProc], t0: float) -> None:
        self.cluster, self.workers, self.t0 = cluster, workers, t0
        self.rss: dict[str, list[list[float]]] = {}  # name -> [t, rss, anon, shmem, file, threads]
        self.totals: list[dict[str, Any]] = []
        self.segments: dict[str, list[list[float]]] = {}  # client -> [t, segments mapped, resident, of dead nodes]
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def sample(self) -> None:
        now = time.time() - self.t0
        procs = [(name, node.pid) for name, node in list(self.cluster.nodes.items())]
        procs += [(w.name, w.pid) for w in self.workers if w.proc.poll() is None]
        for name, pid in procs:
            mem = proc_memory(pid)
            if mem:
                self.rss.setdefault(name, []).append([round(now, 2), mem.get("rss", 0), mem.get("anon", 0),
                                                      mem.get("shmem", 0), mem.get("file", 0), mem.get("threads", 0)])
        self.totals.append({"t": round(now, 2), **aggregate(self.workers)["totals"]})
        self.ticks += 1
        if self.ticks % SEGMENT_EVERY == 0:
            self.sample_segments(now)

    def sample_segments(self, now: float) -> None:
        """Which node pool segments each connector maps, and how much of them is resident in it; a segment
        no live node maps any more (its node was killed) is a dead node's pool kept alive by the connector."""
        live: set[int] = set()
        for node in list(self.cluster.nodes.values()):
            if node.alive():
                live |= set(segment_mappings(node.pid))
        for w in self.workers:
            if w.proc.poll() is None:
                maps = segment_mappings(w.pid)
                dead = sum(rss for inode, (_, rss) in maps.items() if inode not in live)
                self.segments.setdefault(w.name, []).append(
                    [round(now, 2), len(maps), sum(rss for _, rss in maps.values()), dead])

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            _quietly(self.sample)


def aggregate(workers: Sequence[WorkerProc]) -> dict[str, Any]:
    """Sum the workers' latest cumulative counters: per operation kind and overall."""
    from soak_worker import OP_KINDS

    by_kind: dict[str, dict[str, Any]] = {}
    for kind in OP_KINDS:
        acc: dict[str, Any] = {"requests": 0, "hits": 0, "misses": 0, "blocks_hit": 0, "blocks_missed": 0,
                               "bytes_checked": 0, "wrong_bytes": 0, "hangs": 0, "failures": {}, "sources": {}}
        for w in workers:
            stats = (w.final or w.latest).get("ops", {}).get(kind)
            if not stats:
                continue
            for key in ("requests", "hits", "misses", "blocks_hit", "blocks_missed", "bytes_checked", "wrong_bytes",
                        "hangs"):
                acc[key] += stats[key]
            for bucket in ("failures", "sources"):
                for name, n in stats[bucket].items():
                    acc[bucket][name] = acc[bucket].get(name, 0) + n
        by_kind[kind] = acc
    totals = {key: sum(k[key] for k in by_kind.values()) for key in
              ("requests", "hits", "misses", "blocks_hit", "blocks_missed", "bytes_checked", "wrong_bytes", "hangs")}
    failures: dict[str, int] = {}
    for k in by_kind.values():
        for name, n in k["failures"].items():
            failures[name] = failures.get(name, 0) + n
    totals["failures"] = sum(failures.values())
    totals["hangs"] += sum(w.silent_hangs for w in workers)
    return {"by_kind": by_kind, "totals": totals, "failures": failures}


# ---- the run ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, required=True, help="how long the load runs (start-up not included)")
    p.add_argument("--out", default="soak-out", help="where soak.json and soak.png go (default: soak-out/)")
    p.add_argument("--seed", type=int, default=1, help="the fault schedule's and the workload's seed")
    p.add_argument("--pool", default="128MiB", help="each node's host pool (small, so that blocks are evicted)")
    p.add_argument("--rows", type=int, default=256, help="device rows of each connector (32 KiB each)")
    p.add_argument("--pace", type=float, default=0.005, help="seconds each connector process sleeps between operations")
    p.add_argument("--op-bound", type=float, default=OP_BOUND,
                   help=f"seconds an operation may take before it counts as a hang (default {OP_BOUND:.0f})")
    p.add_argument("--no-faults", action="store_true", help="no kills, no etcd restart (a baseline for memory)")
    p.add_argument("--listener", action="store_true",
                   help="connectors load and offload over the nodes' UCX listeners (local=False), not the "
                        "same-host path: small loads then take the blocks a lookup's answer brings")
    p.add_argument("--client-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the connector processes only (e.g. MALLOC_ARENA_MAX=2); repeatable")
    p.add_argument("--trace-memory", action="store_true",
                   help="tracemalloc in the connector processes: Python heap over time and its top growth")
    p.add_argument("--client-log", default="", metavar="LEVEL",
                   help="log level of the connector processes' connector and dkv loggers (e.g. DEBUG; logs in the work directory)")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error("--minutes must be positive")
    for item in args.client_env:
        if "=" not in item:
            p.error(f"--client-env wants NAME=VALUE, got {item!r}")
    return args


def _install_signals() -> dict[int, Any]:
    def handler(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Start, soak, stop; returns the report and the exit status. Stops everything it started, whatever happens."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster.process import NodeStartError
    from dkv.units import parse_size

    duration = args.minutes * 60.0
    run_id = uuid.uuid4().hex[:10]
    workdir = Path(tempfile.mkdtemp(prefix="dkv-soak-"))
    progress_dir = workdir / "progress"
    progress_dir.mkdir()
    client_env = dict(item.split("=", 1) for item in args.client_env)
    cluster = Cluster(workdir, str(parse_size(args.pool)), f"soak-{run_id}")
    workers: list[WorkerProc] = []
    events: list[dict[str, Any]] = []
    faults = [] if args.no_faults else fault_schedule(duration, args.seed)
    doc: dict[str, Any] = {
        "config": {"minutes": args.minutes, "seed": args.seed, "pool": args.pool, "rows": args.rows, "pace": args.pace,
                   "op_bound_s": args.op_bound, "nodes": list(NODES), "client_env": client_env,
                   "trace_memory": args.trace_memory, "faults_planned": [f.__dict__ for f in faults]},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workdir": str(workdir),
    }
    status = 0
    interrupted = {"signum": 0}
    t0 = time.time()
    sampler: Sampler | None = None
    crashes: list[str] = []
    try:
        log(f"starting etcd (work directory {workdir})")
        cluster.start_etcd()
        for name in NODES:  # ports first: the workers are told their node's address now
            cluster.ports[name] = fixed_port()
        log("starting 3 connector processes (importing torch, ucxx, MAX)")
        for i, name in enumerate(NODES):
            cfg = {"index": i, "run": run_id, "node": cluster.address(name), "node_id": name,
                   "etcd": cluster.etcd.url, "cluster": cluster.cluster, "rows": args.rows, "seed": args.seed * 1000 + i,
                   "op_bound": args.op_bound, "pace": args.pace, "progress_dir": str(progress_dir),
                   "ready_timeout": READY_TIMEOUT, "mix": DEFAULT_MIX, "trace_memory": args.trace_memory,
                   "log_level": args.client_log, "local": False if args.listener else None}
            worker = WorkerProc(i, cfg, workdir / f"client-{i}.log", client_env)
            workers.append(worker)
            cluster.pids["workers"].append(worker.pid)
        log("starting nodes " + ", ".join(f"{n} on {cluster.address(n)}" for n in NODES) + f", pool {args.pool} each")
        with concurrent.futures.ThreadPoolExecutor(len(NODES)) as pool:
            started = {name: pool.submit(cluster.start_node, name) for name in NODES}
        for name, future in started.items():
            try:
                future.result()
            except NodeStartError as exc:
                raise SoakError(f"{name} did not start: {exc}") from None
        for worker in workers:
            if not worker.imported.wait(READY_TIMEOUT) or worker.proc.poll() is not None:
                raise SoakError(f"{worker.name} did not start:\n{worker.log_tail()}")
            worker.send("go")
        for worker in workers:
            if not worker.ready.wait(READY_TIMEOUT) or worker.error or worker.proc.poll() is not None:
                raise SoakError(f"{worker.name} did not get ready: {worker.error}\n{worker.log_tail()}")
        log(f"soaking for {args.minutes:g} min: {len(faults)} faults planned")
        t0 = time.time()
        start = time.monotonic()
        sampler = Sampler(cluster, workers, t0)
        sampler.start()
        pending = list(faults)
        with Progress(TextColumn("[bold]soak"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                      console=_console(), transient=False, refresh_per_second=2) as bar:
            task = bar.add_task("soak", total=duration, stats="")
            while (elapsed := time.monotonic() - start) < duration:
                if pending and elapsed >= pending[0].at:
                    fault = pending.pop(0)
                    _inject(fault, cluster, events, t0, lambda: interrupted["signum"] != 0)
                for name, when in list(cluster.down.items()):
                    if time.monotonic() >= when:
                        _restart_node(name, cluster, events, t0)
                _watch(workers, cluster, events, crashes, t0, args.op_bound)
                bar.update(task, completed=min(elapsed, duration), stats=_progress_line(workers, sampler, events))
                time.sleep(0.25)
            bar.update(task, completed=duration, stats=_progress_line(workers, sampler, events))
        log("stopping the connector processes")
    except Interrupted as exc:
        interrupted["signum"] = exc.signum
        status = 128 + exc.signum
        log(f"{exc}: stopping everything")
    except SoakError as exc:
        status = 2
        doc["error"] = str(exc)
        log(f"[red]error:[/] {exc}")
    finally:
        # ignore further Ctrl-C while cleaning up: the cleanup is bounded
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            unclean = []
            for worker in workers:
                if worker.ready.is_set():
                    worker.send("stop")  # all told at once, then each waited for
                else:  # still importing or connecting: nothing to report, nothing to wait for
                    _quietly(worker.proc.kill)
            for worker in workers:
                if not worker.stop(args.op_bound + STOP_GRACE) and status == 0:
                    unclean.append(worker.name)
            if sampler is not None:
                sampler.sample()
                sampler.stop()
            if status == 0:  # after a Ctrl-C the nodes and etcd stop by themselves (same process group)
                crashes += cluster.crashed()
            cluster.stop()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    started = [*cluster.pids["etcd"], *cluster.pids["nodes"], *cluster.pids["workers"]]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    doc["pids"] = cluster.pids
    doc["pids_left"] = [p for p in started if pid_alive(p)]
    doc.update(_results(workers, cluster, sampler, events, crashes, unclean, t0, duration))
    if status == 0 and (doc["totals"]["wrong_bytes"] or doc["totals"]["hangs"] or doc["crashes"]):
        status = 1
    doc["exit_status"] = status
    return doc, status


def _console() -> Any:
    log("")  # makes the shared stderr console
    return _CONSOLE


def _inject(fault: Fault, cluster: Cluster, events: list[dict[str, Any]], t0: float,
            interrupted: Callable[[], bool]) -> None:
    if cluster.down:  # a node that did not come back yet: no second fault on top
        events.append({"t": round(time.time() - t0, 2), "kind": "fault_skipped", "fault": fault.kind,
                       "because_down": sorted(cluster.down)})
        return
    if fault.kind == "node":
        pid = cluster.kill_node(fault.node)
        events.append({"t": round(time.time() - t0, 2), "kind": "node_kill", "node": fault.node, "pid": pid})
        log(f"killed {fault.node} (pid {pid}, SIGKILL); restarting it on {cluster.address(fault.node)} "
            f"in {fault.down:.1f} s")
        _sleep(fault.down, interrupted)
        cluster.down[fault.node] = 0.0
        _restart_node(fault.node, cluster, events, t0)
    else:
        pid = cluster.etcd.pid
        events.append({"t": round(time.time() - t0, 2), "kind": "etcd_kill", "pid": pid})
        log(f"killed etcd (pid {pid}); restarting it on the same ports in {fault.down:.1f} s")
        cluster.restart_etcd(fault.down, interrupted)
        events.append({"t": round(time.time() - t0, 2), "kind": "etcd_restart", "pid": cluster.etcd.pid})


RESTART_RETRY = 3.0  # seconds between attempts to bring a killed node back on its port


def _restart_node(name: str, cluster: Cluster, events: list[dict[str, Any]], t0: float) -> None:
    """One attempt to start ``name`` again on its port; a failure is recorded (with who holds the port)
    and tried again :data:`RESTART_RETRY` seconds later from the main loop."""
    from cluster.process import NodeStartError

    began = time.monotonic()
    try:
        cluster.start_node(name, attempts=1)
    except NodeStartError as exc:
        cluster.down[name] = time.monotonic() + RESTART_RETRY
        lines = [ln for ln in str(exc).splitlines() if "in use" in ln or "Busy" in ln or "rror" in ln]
        events.append({"t": round(time.time() - t0, 2), "kind": "node_restart_failed", "node": name,
                       "error": lines[-3:], "port_sockets": _sockets_on(cluster.ports[name])})
        log(f"[yellow]{name} did not start again on {cluster.address(name)}[/]: {lines[-1] if lines else exc}")
        return
    events.append({"t": round(time.time() - t0, 2), "kind": "node_restart", "node": name,
                   "pid": cluster.nodes[name].pid, "start_s": round(time.monotonic() - began, 2)})


def _sockets_on(port: int) -> str:
    """``ss``'s view of every TCP socket on ``port`` (evidence for a restart that could not bind it)."""
    try:
        return subprocess.run(["ss", "-tanp", "state", "all", f"( sport = :{port} )"], capture_output=True,
                              text=True, timeout=10, check=False).stdout[-4000:]
    except (OSError, subprocess.SubprocessError):
        return ""


def _watch(workers: list[WorkerProc], cluster: Cluster, events: list[dict[str, Any]], crashes: list[str],
           t0: float, bound: float) -> None:
    """A connector process that died, or went silent past the op bound, is a crash or a hang; so is a node
    or etcd that exited by itself."""
    now = time.monotonic()
    for w in workers:
        if w.proc.poll() is not None and not any(c.startswith(w.name) for c in crashes):
            crashes.append(f"{w.name} (pid {w.pid}, exit {w.proc.returncode}): {w.error or ''}\n{w.log_tail()}")
            events.append({"t": round(time.time() - t0, 2), "kind": "crash", "process": w.name})
        elif now - w.last_heard > bound + 5 * HEARTBEAT and w.proc.poll() is None:
            w.silent_hangs += 1
            w.last_heard = now  # one hang per silence of a bound's length
            events.append({"t": round(time.time() - t0, 2), "kind": "silent", "process": w.name})
    for dead in cluster.crashed():
        if dead not in crashes:
            crashes.append(dead)
            events.append({"t": round(time.time() - t0, 2), "kind": "crash", "process": dead})


def _progress_line(workers: list[WorkerProc], sampler: Sampler | None, events: list[dict[str, Any]]) -> str:
    totals = aggregate(workers)["totals"]
    kills = sum(e["kind"] == "node_kill" for e in events)
    etcd = sum(e["kind"] == "etcd_kill" for e in events)
    rss = 0
    if sampler is not None:
        rss = max((s[-1][1] for name, s in sampler.rss.items() if name.startswith("client") and s), default=0)
    wrong = totals["wrong_bytes"]
    hangs = totals["hangs"]
    return (f"req {totals['requests']}  hits {totals['hits']}  miss {totals['misses']}  fail {totals['failures']}  "
            f"{'[red]' if wrong else ''}wrong B {wrong}{'[/]' if wrong else ''}  "
            f"{'[red]' if hangs else ''}hangs {hangs}{'[/]' if hangs else ''}  "
            f"kills {kills}  etcd restarts {etcd}  client RSS {rss / 2**20:.0f} MiB")


def _results(workers: list[WorkerProc], cluster: Cluster, sampler: Sampler | None, events: list[dict[str, Any]],
             crashes: list[str], unclean: list[str], t0: float, duration: float) -> dict[str, Any]:
    agg = aggregate(workers)
    totals = agg["totals"]
    totals["hangs"] += len(unclean)
    incidents: dict[str, list[Any]] = {"wrong_bytes": [], "hangs": [], "errors": []}
    latency: dict[str, dict[str, Any]] = {}
    clients = []
    for w in workers:
        doc = w.final or w.latest
        for kind, items in doc.get("incidents", {}).items():
            incidents[kind] += [{**i, "process": w.name} for i in items]
        for kind, lat in (w.final or {}).get("latency", {}).items():
            latency.setdefault(kind, {})[w.name] = lat
        clients.append({"name": w.name, "pid": w.pid, "clean_stop": w.name not in unclean,
                        "connector": doc.get("connector", {}), "rows_retired": doc.get("rows_retired", 0),
                        "mem_ready": w.ready_mem, "mem_end": doc.get("mem", {}),
                        "mem_after_close": (w.final or {}).get("mem_after_close", {}),
                        "tracemalloc_top": (w.final or {}).get("tracemalloc_top", []),
                        "heap": [[round(t - t0, 2), *rest] for t, *rest in w.heap]})
    for name in unclean:
        incidents["hangs"].append({"process": name, "phase": "did not stop within the op bound + grace"})
    rss = sampler.rss if sampler is not None else {}
    for event in events:  # how long the co-located connector took to store a block again
        if event["kind"] == "node_restart" and event["node"] in NODES:
            worker = workers[NODES.index(event["node"])]
            at = t0 + event["t"]
            before = max((n for t, n in worker.offloads if t <= at), default=0)
            after = next((t for t, n in worker.offloads if t > at and n > before), None)
            event["offloading_again_after_s"] = None if after is None else round(after - at, 1)
    return {
        "duration_s": duration,
        "events": events,
        "kills": sum(e["kind"] == "node_kill" for e in events),
        "restarts": sum(e["kind"] == "node_restart" for e in events),
        "restart_failures": sum(e["kind"] == "node_restart_failed" for e in events),
        "nodes_down_at_end": sorted(cluster.down),
        "etcd_restarts": sum(e["kind"] == "etcd_restart" for e in events),
        "totals": totals,
        "failures": agg["failures"],
        "by_kind": agg["by_kind"],
        "latency": latency,
        "incidents": incidents,
        "crashes": crashes,
        "clients": clients,
        "rss": rss,
        "rss_summary": rss_summary(rss),
        "series": sampler.totals if sampler is not None else [],
        "segments": sampler.segments if sampler is not None else {},
        "dead_segments_max_mib": max((s[3] for v in (sampler.segments if sampler else {}).values() for s in v),
                                     default=0) / 2**20,
    }


def rss_summary(rss: dict[str, list[list[float]]]) -> dict[str, dict[str, float]]:
    """Per process: RSS (MiB) at the first sample, after 60 s, at the end, and the most; anon/shmem at the end."""
    out = {}
    for name, samples in sorted(rss.items()):
        if not samples:
            continue
        at60 = next((s for s in samples if s[0] >= 60), samples[-1])
        out[name] = {"start_mib": samples[0][1] / 2**20, "at_60s_mib": at60[1] / 2**20,
                     "end_mib": samples[-1][1] / 2**20, "max_mib": max(s[1] for s in samples) / 2**20,
                     "end_anon_mib": samples[-1][2] / 2**20, "end_shmem_mib": samples[-1][3] / 2**20,
                     "end_file_mib": samples[-1][4] / 2**20, "end_threads": samples[-1][5]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = _install_signals()
    try:
        doc, status = run(args)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    from soak_report import draw_chart, print_table

    (out / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
    try:
        draw_chart(doc, out / "soak.png")
    except Exception as exc:  # noqa: BLE001 - the JSON and the table still tell
        log(f"could not draw the chart: {exc}")
    print_table(doc)
    if status == 0:
        shutil.rmtree(doc["workdir"], ignore_errors=True)  # logs and etcd data: kept only when something went wrong
    else:
        log(f"logs kept in {doc['workdir']}")
    log(f"wrote {out / 'soak.json'} and {out / 'soak.png'}; exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
