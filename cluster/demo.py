"""``dkv demo``: what dKV adds to engines that already cache on their own, measured on one serving-like workload.

Three configurations run the same workload with the same seeds, each on fresh engine processes (one
per node, as in serving, each with its own connector):

* ``recompute`` -- no prefix caching at all: every prompt is prefilled. Reference only: every other
  configuration's continuations are checked bit for bit (tokens and logits) against it.
* ``device`` -- the engines with their own device prefix caches, dKV off. **The baseline.**
* ``dkv`` -- the same device caches plus dKV: offloads to the co-located node, loads from it or
  from the peer the router's ``dkv_cache_hint`` names.

The headline compares ``dkv`` with ``device``.

The workload: multi-turn chats that all begin with one shared long prefix (a system prompt or a
document), each turn appending the user's tokens and the model's reply. Conversations start
staggered and each next turn arrives after a think time, so requests overlap across the engines;
a load balancer keeps a conversation on its engine or moves it (:func:`plan_workload`). Device pools
are smaller than the working set, so engines evict prefixes they will need again: the co-located
node's host tier serves those. KV pages are a few hundred KiB per block, as in serving, so the load
figure measures bandwidth rather than round trips.

For each request the router is asked with the engine's own node as the requester: it names a peer
only when that peer holds more than the co-located node (which the connector asks anyway).

Time to first token (TTFT) is measured from the request's arrival (the moment its user sent it) to
the first token's logits in the engine, queueing included, on ``time.monotonic()`` (one clock for
all processes on the machine).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import queue
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

from cluster import local
from cluster.demo_report import CONFIGURATIONS, RequestRecord, chart, print_summary, summarize
from cluster.process import stop_process
from connector.engine.hashing import block_hashes
from connector.engine.model import ModelConfig
from dkv.etcd import Layout, make_client
from dkv.keys import derive_namespace
from dkv.loop_thread import acquire_shared_loop, release_shared_loop
from dkv.router import Router

READY_TIMEOUT = 120.0  # an engine process imports torch and builds its model (and its connector)


@dataclass
class DemoConfig:
    """The model, the engines and the workload. The default is the README's run; :meth:`small` is CI's."""

    # 4 layers (one sliding-window), 4 KV heads of 64: a 32-token block is 256 KiB of float32 KV
    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        vocab=256, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, mlp_hidden=1024,
        window_layers=(1,), sliding_window=128, seed=1))
    block_size: int = 32
    num_pages: int = 48  # device pages per leaf and engine: far fewer than the working set, so prefixes are evicted
    conversations: int = 24
    turns: int = 4
    system_tokens: int = 512  # the shared prefix every conversation begins with
    user_tokens: int = 128
    new_tokens: int = 8  # decode runs one token a model call on the CPU: short replies keep it from dominating
    engines: int = 3
    pool: str = "512MiB"  # each node's host pool
    stay: float = 0.5  # chance a conversation's next turn stays on the engine of its last turn
    stagger: float = 0.5  # seconds between conversations' first turns
    think: tuple[float, float] = (0.5, 1.5)  # seconds between a reply and the next turn (uniform)
    seed: int = 0
    request_timeout: float = 300.0  # a request not answered this long after arriving fails the demo

    @classmethod
    def small(cls) -> DemoConfig:
        return cls(model=ModelConfig(window_layers=(1, 3), sliding_window=8, seed=1), block_size=4, num_pages=20,
                   conversations=6, turns=3, system_tokens=16, user_tokens=10, new_tokens=4, pool="64MiB",
                   stagger=0.05, think=(0.1, 0.2))


@dataclass(frozen=True)
class Turn:
    engine: int
    user: list[int]
    think: float  # seconds after the previous turn's reply that this one arrives (the first: after the start)


def system_prompt(config: DemoConfig) -> list[int]:
    rng = random.Random(config.seed + 1)
    return [rng.randrange(config.model.vocab) for _ in range(config.system_tokens)]


def plan_workload(config: DemoConfig) -> list[list[Turn]]:
    """Per conversation, its turns: which engine the load balancer sends each to, the user's tokens, the
    think time before it. Deterministic for a seed; the same in every configuration.

    The load balancer keeps a conversation on the engine of its last turn with probability ``stay``,
    else sends it to the engine it has sent the fewest of that turn's requests so far (ties by seed), so
    the engines see balanced load while conversations move between them.
    """
    rng = random.Random(config.seed)
    engines = [conv % config.engines for conv in range(config.conversations)]
    plans: list[list[Turn]] = [[] for _ in range(config.conversations)]
    for turn in range(config.turns):
        sent = [0] * config.engines
        for conv in range(config.conversations):
            if turn and config.engines > 1 and rng.random() >= config.stay:
                others = [e for e in range(config.engines) if e != engines[conv]]
                rng.shuffle(others)
                engines[conv] = min(others, key=sent.__getitem__)
            sent[engines[conv]] += 1
            user = [rng.randrange(config.model.vocab) for _ in range(config.user_tokens)]
            think = conv * config.stagger if turn == 0 else rng.uniform(*config.think)
            plans[conv].append(Turn(engines[conv], user, think))
    return plans


RouteFn = Callable[[int, list[bytes]], tuple[str | None, str | None]]  # (engine, hashes) -> (hint, peer id)
Outputs = dict[tuple[int, int], tuple[list[int], str]]  # (conversation, turn) -> (tokens, logits digest)
Answers = queue.Queue[tuple[int, dict[str, Any] | None]]  # (engine index, its answer; None: it exited)


class _InFlight(NamedTuple):
    conversation: int
    turn: int
    arrival: float
    prompt: list[int]
    hinted_peer: str | None


class EngineProcess:
    """One ``python -m cluster.demo_engine`` process; its answers go to a queue shared by all engines."""

    def __init__(self, index: int, log: IO[bytes], answers: Answers) -> None:
        self.index = index
        self.log_path = Path(log.name)
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster.demo_engine"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=os.environ.copy())
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin = self.proc.stdin
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout, answers),
                                        name=f"demo-engine-{index}", daemon=True)
        self._reader.start()

    def _read(self, stdout: IO[bytes], answers: Answers) -> None:
        for line in stdout:
            with contextlib.suppress(ValueError):
                answers.put((self.index, json.loads(line)))
        answers.put((self.index, None))  # EOF: the process ended

    def submit(self, message: dict[str, Any]) -> None:
        self._stdin.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        self._stdin.flush()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self, timeout: float = 45.0) -> None:
        """EOF on its stdin (it drains its offloads and shuts its connector down), then by PID if need be."""
        with contextlib.suppress(OSError, ValueError):
            self._stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)
        self._reader.join(5)


class EngineFleet:
    """The demo's engine processes, one per node, started once and given fresh engines per configuration."""

    def __init__(self, count: int, logs: Path) -> None:
        self.answers: Answers = queue.Queue()
        self.engines: list[EngineProcess] = []
        self._files: list[IO[bytes]] = []
        try:
            for i in range(count):
                self._files.append(open(logs / f"engine-{i}.log", "wb"))  # noqa: SIM115 - closed in close()
                self.engines.append(EngineProcess(i, self._files[-1], self.answers))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [e.proc.pid for e in self.engines]

    def configure(self, settings: list[dict[str, Any]]) -> None:
        """A fresh engine in every process (within READY_TIMEOUT); one that exits instead fails the demo."""
        for engine, engine_settings in zip(self.engines, settings, strict=True):
            engine.submit({"settings": engine_settings})
        waiting = {e.index for e in self.engines}
        deadline = time.monotonic() + READY_TIMEOUT
        while waiting:
            try:
                index, message = self.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"demo engines {sorted(waiting)} not ready after {READY_TIMEOUT:.0f} s") from None
            if message is None:
                raise RuntimeError(f"demo engine {index} exited while starting:\n{self.engines[index].log_tail()}")
            if "ready" not in message:
                raise RuntimeError(f"demo engine {index} answered {message} while starting")
            waiting.discard(index)

    def close(self) -> None:
        """Every engine process gone (gracefully first), every log closed."""
        for engine in self.engines:
            engine.close()
        for file in self._files:
            file.close()


def run_configuration(name: str, config: DemoConfig, fleet: EngineFleet, settings: list[dict[str, Any]],
                      route: RouteFn | None, reference: Outputs | None,
                      advance: Callable[[], None]) -> tuple[list[RequestRecord], Outputs, float]:
    """Serve the whole workload on fresh engines; returns the records, each request's (tokens, logits
    digest), and the wall time from the first arrival to the last reply."""
    fleet.configure(settings)
    return _serve(name, config, fleet.engines, fleet.answers, route, reference, advance)


def _serve(name: str, config: DemoConfig, engines: list[EngineProcess], answers: Answers, route: RouteFn | None,
           reference: Outputs | None, advance: Callable[[], None]) -> tuple[list[RequestRecord], Outputs, float]:
    """The workload's arrivals, each sent to its engine at its time; each next turn scheduled once its
    predecessor's reply came back (closed loop: a user answers after reading)."""
    plans = plan_workload(config)
    history = {c: system_prompt(config) for c in range(len(plans))}
    start = time.monotonic()
    arrivals = [(start + plans[c][0].think, c, 0) for c in range(len(plans))]
    heapq.heapify(arrivals)
    in_flight: dict[str, _InFlight] = {}
    records: list[RequestRecord] = []
    outputs: Outputs = {}
    total = sum(len(p) for p in plans)
    last = start
    while len(records) < total:
        now = time.monotonic()
        while arrivals and arrivals[0][0] <= now:
            arrival, conv, turn = heapq.heappop(arrivals)
            step = plans[conv][turn]
            prompt = history[conv] + step.user
            hint, peer = route(step.engine, block_hashes(prompt, config.block_size)) if route else (None, None)
            request_id = f"{conv}.{turn}"
            in_flight[request_id] = _InFlight(conv, turn, arrival, prompt, peer)
            engines[step.engine].submit({"id": request_id, "prompt": prompt, "new_tokens": config.new_tokens,
                                         "hint": hint})
        wait = min(1.0, arrivals[0][0] - now) if arrivals else 1.0
        try:
            index, answer = answers.get(timeout=max(0.0, wait))
        except queue.Empty:
            _check_deadlines(in_flight, config.request_timeout)
            continue
        if answer is None:
            raise RuntimeError(f"demo engine {index} ({name}) exited:\n{engines[index].log_tail()}")
        if "error" in answer:
            raise RuntimeError(f"demo engine {index} ({name}) refused request {answer.get('id')}: {answer['error']}")
        conv, turn, arrival, prompt, peer = in_flight.pop(answer["id"])
        last = time.monotonic()
        output = (answer["tokens"], answer["logits_sha256"])
        outputs[(conv, turn)] = output
        connector = answer["connector_hit_blocks"]
        records.append(RequestRecord(
            name, conv, turn, index, arrival - start, answer["first_token"] - arrival, answer["prompt_blocks"],
            answer["device_hit_blocks"], connector if answer["source"] == "local" else 0,
            connector if answer["source"] == "peer" else 0, answer["computed_blocks"], answer["loaded_bytes"],
            answer["load_seconds"], answer["prefill_seconds"], answer["hint"], peer, answer["loads_refused"],
            answer["loads_failed"], None if reference is None else reference.get((conv, turn)) == output))
        history[conv] = prompt + answer["tokens"]
        if turn + 1 < len(plans[conv]):
            heapq.heappush(arrivals, (last + plans[conv][turn + 1].think, conv, turn + 1))
        advance()
    return records, outputs, last - start


def _check_deadlines(in_flight: dict[str, _InFlight], bound: float) -> None:
    now = time.monotonic()
    late = [rid for rid, request in in_flight.items() if now - request.arrival > bound]
    if late:
        raise TimeoutError(f"requests {late[:5]} not answered within {bound:.0f} s of arriving")


def _namespace(config: DemoConfig) -> str:
    """A namespace of this run's own (a nonce in it), so a run against a long-lived cluster starts cold."""
    m = config.model
    return derive_namespace(
        "demo", model=f"tiny-{m.d_model}x{m.n_layers}-seed{m.seed}", dtype="float32", page_size=config.block_size,
        num_layers=m.n_layers, num_kv_heads=m.n_kv_heads, head_dim=m.head_dim, hash_algorithm="sha256",
        extra=[("window", m.sliding_window), ("window_layers", m.window_layers), ("run", secrets.token_hex(8))])


def _engine_settings(config: DemoConfig, *, prefix_caching: bool,
                     dkv: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    model = asdict(config.model)
    model["window_layers"] = list(model["window_layers"])
    return [{"model": model, "block_size": config.block_size, "num_pages": config.num_pages,
             "prefix_caching": prefix_caching, "dkv": dkv[i] if dkv else None} for i in range(config.engines)]


@contextlib.contextmanager
def _router(etcd_url: str, cluster: str, *, follow: bool = True):
    """A router over the cluster's directory on the shared UCX loop (following its watch, or a snapshot)."""
    ucx = acquire_shared_loop()
    router: Router | None = None
    client = None
    try:
        async def start() -> tuple[Any, Router]:
            c = make_client(etcd_url)
            await c.connect()
            r = Router(c, Layout(cluster))
            try:
                await r.start(follow=follow)
            except BaseException:
                await c.close()
                raise
            return c, r

        client, router = ucx.run(start(), 30)
        yield router
    finally:
        if router is not None:
            async def stop() -> None:
                await router.stop()
                await client.close()

            with contextlib.suppress(Exception):
                ucx.run(stop(), 10)
        release_shared_loop()


class _Progress:
    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=False)

    def __enter__(self) -> _Progress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def task(self, description: str, total: int) -> Callable[[], None]:
        task = self.progress.add_task(description, total=total)
        return lambda: self.progress.advance(task)


def _run_all(config: DemoConfig, logs: Path, nodes: list[tuple[str, str]], etcd_url: str,
             cluster: str, pids: list[int]) -> tuple[dict[str, list[RequestRecord]], dict[str, float], str]:
    total = config.conversations * config.turns
    namespace = _namespace(config)
    dkv = [{"namespace": namespace, "node": nodes[i % len(nodes)][1], "node_id": nodes[i % len(nodes)][0],
            "etcd": etcd_url, "cluster": cluster} for i in range(config.engines)]
    records: dict[str, list[RequestRecord]] = {}
    walls: dict[str, float] = {}
    fleet = EngineFleet(config.engines, logs)
    pids.extend(fleet.pids)
    try:
        with _Progress() as progress, _router(etcd_url, cluster) as router:
            def route(engine: int, hashes: list[bytes]) -> tuple[str | None, str | None]:
                answer = router.route(namespace, hashes, requester=dkv[engine]["node_id"])
                return answer.hint, answer.peer.node_id if answer.peer else None

            reference = None
            for name, prefix_caching, with_dkv in (("recompute", False, False), ("device", True, False),
                                                   ("dkv", True, True)):
                settings = _engine_settings(config, prefix_caching=prefix_caching, dkv=dkv if with_dkv else None)
                advance = progress.task(f"{CONFIGURATIONS[name]:<34}", total)
                records[name], outputs, walls[name] = run_configuration(
                    name, config, fleet, settings, route if with_dkv else None, reference, advance)
                if reference is None:
                    reference = outputs
    finally:
        fleet.close()
    return records, walls, namespace


def run_demo(config: DemoConfig, out: Path, *, etcd: str | None = None, cluster: str = "default") -> dict[str, Any]:
    """Run the demo; returns (and writes) the report. Tears down what it started, Ctrl-C included."""
    out.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="dkv-demo-"))
    try:
        if etcd is None:
            print(f"starting a local cluster (etcd + {config.engines} nodes) in {workdir}")
            record = local.up(workdir / "cluster", config.engines, pool=config.pool, cluster=cluster)
            nodes = [(n.node_id, n.address) for n in record.nodes]
            started_pids = [record.etcd_pid, *(n.pid for n in record.nodes)]
            etcd_url = record.etcd_url
        else:
            nodes = _members(etcd, cluster)
            started_pids = []
            etcd_url = etcd
            if not nodes:
                raise RuntimeError(f"no live dKV node in cluster {cluster!r} at {etcd}")
        logs = out / "engine-logs"
        logs.mkdir(exist_ok=True)
        pids: list[int] = []
        records, walls, namespace = _run_all(config, logs, nodes, etcd_url, cluster, pids)
        summary = summarize(config.model, config.block_size, records, walls)
        report = {**summary, "namespace": namespace, "nodes": [n for n, _ in nodes], "engine_pids": pids,
                  "cluster_pids": started_pids,  # etcd and nodes this run started (none on a given etcd)
                  "config": {k: v for k, v in asdict(config).items() if k != "model"},
                  "model": asdict(config.model),
                  "requests_detail": [asdict(r) for rs in records.values() for r in rs]}
        (out / "report.json").write_text(json.dumps(report, indent=2))
        chart(records, config.turns, out / "chart.png")
        print_summary(summary, out)
        return report
    finally:
        if etcd is None and local.down(workdir / "cluster"):
            print("local cluster stopped and removed")
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _members(etcd: str, cluster: str) -> list[tuple[str, str]]:
    with _router(etcd, cluster, follow=False) as router:
        return sorted((m.node_id, m.address) for m in router.members.values())
