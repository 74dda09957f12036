"""``dkv demo``: three reference engines on a 3-node dKV cluster, with dKV on and off, compared.

The workload is a multi-turn chat: every conversation shares a system prompt,
each turn appends the user's tokens and the model's reply, and conversations
move between engines the way a load balancer moves them. For each request the
router (fed by etcd) writes the ``dkv_cache_hint`` naming the peer that holds
the longest prefix; the engine's connector loads from that peer, or from its
co-located node without a usable hint, and recomputes the rest.

The same workload runs first with dKV off (every prompt recomputed): that run
is the baseline for time, and the reference every loaded continuation must
match bit for bit (tokens and logits).

Model size: a real 8B model spends roughly 1e5 FLOPs of prefill per byte of
KV it produces. The demo model (d_model 768, 2 layers, 24 query heads sharing
one 32-wide KV head, so grouped-query attention) spends about 6.6e4, within
the 10x asked for, so loading a block is worth what it is worth in serving.
The tests run a far smaller model (``DemoConfig.small``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cluster import local
from connector.dkv_connector import DKVConnector
from connector.engine.engine import Engine, GenerationResult
from connector.engine.hashing import block_hashes
from connector.engine.model import ModelConfig, prefill_flops_per_kv_byte
from dkv.etcd import Layout, make_client
from dkv.keys import derive_namespace
from dkv.loop_thread import acquire_shared_loop, release_shared_loop
from dkv.router import Router


@dataclass
class DemoConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        vocab=256, d_model=768, n_layers=2, n_heads=24, n_kv_heads=1, head_dim=32, mlp_hidden=3072,
        window_layers=(1,), sliding_window=64, seed=1))
    block_size: int = 16
    num_pages: int = 96
    conversations: int = 12
    turns: int = 4
    system_tokens: int = 64
    user_tokens: int = 48
    new_tokens: int = 8
    engines: int = 3
    pool: str = "256MiB"
    seed: int = 0

    @classmethod
    def small(cls) -> DemoConfig:
        return cls(model=ModelConfig(window_layers=(1, 3), sliding_window=8, seed=1), block_size=4, num_pages=64,
                   conversations=6, turns=3, system_tokens=8, user_tokens=10, new_tokens=4, pool="64MiB")


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    engine: int
    prompt_blocks: int
    device_hit_blocks: int = 0
    local_hit_blocks: int = 0
    peer_hit_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    prefill_seconds: float = 0.0
    baseline_prefill_seconds: float = 0.0
    hinted_peer: str | None = None
    bit_exact: bool | None = None


def _workload(config: DemoConfig) -> list[tuple[int, int, int, list[int]]]:
    """(conversation, turn, engine, user tokens) in arrival order; deterministic."""
    rng = random.Random(config.seed)
    requests = []
    for turn in range(config.turns):
        for conv in range(config.conversations):
            # half the conversations stay on one engine for a while, the others move every turn
            engine = (conv + (turn if conv % 2 else turn // 2)) % config.engines
            user = [rng.randrange(config.model.vocab) for _ in range(config.user_tokens)]
            requests.append((conv, turn, engine, user))
    return requests


def _system_prompt(config: DemoConfig) -> list[int]:
    rng = random.Random(config.seed + 1)
    return [rng.randrange(config.model.vocab) for _ in range(config.system_tokens)]


class _Progress:
    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=False)
        self.total = total

    def __enter__(self) -> _Progress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def task(self, description: str) -> Any:
        return self.progress.add_task(description, total=self.total)

    def advance(self, task: Any) -> None:
        self.progress.advance(task)


def _run_baseline(config: DemoConfig, progress: _Progress) -> dict[tuple[int, int], GenerationResult]:
    """Every prompt recomputed: the time baseline and the bit-exactness reference."""
    engines = [Engine(config.model, block_size=config.block_size, num_pages=config.num_pages)
               for _ in range(config.engines)]
    system = _system_prompt(config)
    history = {c: list(system) for c in range(config.conversations)}
    results: dict[tuple[int, int], GenerationResult] = {}
    task = progress.task("dKV off (recompute)")
    for conv, turn, engine_idx, user in _workload(config):
        prompt = history[conv] + user
        engines[engine_idx].reset_device_cache()  # the baseline keeps nothing: every prompt is prefilled
        result = engines[engine_idx].generate(prompt, config.new_tokens)
        results[(conv, turn)] = result
        history[conv] = prompt + result.tokens
        progress.advance(task)
    return results


def _run_dkv(config: DemoConfig, progress: _Progress, nodes: list[tuple[str, str]], etcd_url: str,
             cluster: str, baseline: dict[tuple[int, int], GenerationResult]) -> tuple[list[RequestRecord], dict]:
    namespace = derive_namespace(
        "demo", model=f"tiny-{config.model.d_model}x{config.model.n_layers}-seed{config.model.seed}",
        dtype="float32", page_size=config.block_size, num_layers=config.model.n_layers,
        num_kv_heads=config.model.n_kv_heads, head_dim=config.model.head_dim, hash_algorithm="sha256",
        extra=[("window", config.model.sliding_window), ("window_layers", config.model.window_layers)])
    engines: list[Engine] = []
    connectors: list[DKVConnector] = []
    ucx = acquire_shared_loop()
    router = None
    etcd_client = None
    try:
        for i in range(config.engines):
            node_id, address = nodes[i % len(nodes)]
            engine = Engine(config.model, block_size=config.block_size, num_pages=config.num_pages)
            token = os.environ.get("DKV_TOKEN")
            conn = DKVConnector(engine.leaf_specs, engine.device_blocks, namespace=namespace, node=address,
                                node_id=node_id, etcd=etcd_url, cluster=cluster,
                                token=token.encode() if token else None)
            engine.attach_connector(conn)
            engines.append(engine)
            connectors.append(conn)

        async def start_router() -> tuple[Any, Router]:
            client = make_client(etcd_url)
            await client.connect()
            r = Router(client, Layout(cluster))
            await r.start()
            return client, r

        etcd_client, router = ucx.run(start_router(), 30)
        system = _system_prompt(config)
        history = {c: list(system) for c in range(config.conversations)}
        records: list[RequestRecord] = []
        task = progress.task("dKV on  (load + recompute the rest)")
        for conv, turn, engine_idx, user in _workload(config):
            prompt = history[conv] + user
            hashes = block_hashes(prompt, config.block_size)
            route = router.route(namespace, hashes)
            own = nodes[engine_idx % len(nodes)][0]
            hint = route.hint.encode() if route.peer is not None else None
            engine = engines[engine_idx]
            result = engine.generate(prompt, config.new_tokens, hint=hint)
            engine.drain(30)
            reference = baseline[(conv, turn)]
            stats = result.stats
            from_peer = route.peer is not None and route.peer.node_id != own
            record = RequestRecord(
                conv, turn, engine_idx, stats.prompt_blocks, stats.device_hit_blocks,
                0 if from_peer else stats.connector_hit_blocks, stats.connector_hit_blocks if from_peer else 0,
                stats.loaded_bytes, stats.load_seconds, stats.prefill_seconds,
                reference.stats.prefill_seconds, route.peer.node_id if route.peer else None,
                result.tokens == reference.tokens and torch.equal(result.logits, reference.logits))
            records.append(record)
            history[conv] = prompt + result.tokens
            _wait_published(router, namespace, hashes)
            progress.advance(task)
        counters = {
            "unusable_hints": sum(sum(c.counters.unusable_hints.values()) for c in connectors),
            "hints_behind_device": sum(c.counters.hints_behind_device for c in connectors),
            "loads_refused": sum(c.counters.loads_refused for c in connectors),
            "loads_failed": sum(c.counters.loads_failed for c in connectors),
            "blocks_offloaded": sum(c.counters.blocks_offloaded for c in connectors),
        }
        return records, {"namespace": namespace, **counters}
    finally:
        for conn in connectors:
            conn.shutdown()
        if router is not None:
            async def stop_router() -> None:
                await router.stop()
                await etcd_client.close()
            with contextlib.suppress(Exception):
                ucx.run(stop_router(), 10)
        release_shared_loop()


def _wait_published(router: Router, namespace: str, hashes: list[bytes], bound: float = 2.0) -> None:
    """Give the batched directory (flushed every 50 ms) a moment to show this request's blocks."""
    deadline = time.monotonic() + bound
    covered = len(hashes) - 1  # the last block may be the hit-capped one that is always recomputed
    while router.route(namespace, hashes).depth < covered and time.monotonic() < deadline:
        time.sleep(0.01)


def _summary(config: DemoConfig, records: list[RequestRecord], extra: dict) -> dict[str, Any]:
    blocks = sum(r.prompt_blocks for r in records)
    local_hits = sum(r.local_hit_blocks for r in records)
    peer_hits = sum(r.peer_hit_blocks for r in records)
    device_hits = sum(r.device_hit_blocks for r in records)
    loaded = sum(r.loaded_bytes for r in records)
    load_s = sum(r.load_seconds for r in records)
    dkv_s = sum(r.prefill_seconds for r in records)
    base_s = sum(r.baseline_prefill_seconds for r in records)
    return {
        "requests": len(records),
        "prompt_blocks": blocks,
        "device_hit_blocks": device_hits,
        "local_hit_blocks": local_hits,
        "peer_hit_blocks": peer_hits,
        "peer_hits": sum(1 for r in records if r.peer_hit_blocks),
        "hit_rate": (local_hits + peer_hits + device_hits) / blocks if blocks else 0.0,
        "dkv_hit_rate": (local_hits + peer_hits) / blocks if blocks else 0.0,
        "blocks_loaded": local_hits + peer_hits,
        "bytes_loaded": loaded,
        "prefill_tokens_saved": (local_hits + peer_hits + device_hits) * config.block_size,
        "load_throughput_gbps": loaded / load_s / 1e9 if load_s else 0.0,
        "prefill_seconds_dkv": dkv_s,
        "prefill_seconds_baseline": base_s,
        "prefill_seconds_saved": base_s - dkv_s,
        "speedup": base_s / dkv_s if dkv_s else 0.0,
        "bit_exact": all(r.bit_exact for r in records),
        "flops_per_kv_byte": prefill_flops_per_kv_byte(config.model, 128),
        **extra,
    }


def _chart(records: list[RequestRecord], config: DemoConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = range(config.turns)
    base = [sum(r.baseline_prefill_seconds for r in records if r.turn == t) for t in turns]
    dkv = [sum(r.prefill_seconds for r in records if r.turn == t) for t in turns]
    local_hits = [sum(r.local_hit_blocks for r in records if r.turn == t) for t in turns]
    peer_hits = [sum(r.peer_hit_blocks for r in records if r.turn == t) for t in turns]
    device_hits = [sum(r.device_hit_blocks for r in records if r.turn == t) for t in turns]
    computed = [sum(r.prompt_blocks - r.local_hit_blocks - r.peer_hit_blocks - r.device_hit_blocks
                    for r in records if r.turn == t) for t in turns]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = list(turns)
    ax1.bar([x - 0.2 for x in xs], base, width=0.4, label="dKV off (recompute)")
    ax1.bar([x + 0.2 for x in xs], dkv, width=0.4, label="dKV on")
    ax1.set_xticks(xs)
    ax2.set_xticks(xs)
    ax1.set_xlabel("turn")
    ax1.set_ylabel("prefill seconds (all conversations)")
    ax1.set_title("Prefill time per turn")
    ax1.legend()
    bottom = [0] * len(xs)
    for values, label in ((device_hits, "device hit"), (local_hits, "co-located node"), (peer_hits, "peer (hint)"),
                          (computed, "recomputed")):
        ax2.bar(xs, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prompt blocks")
    ax2.set_title("Where each prompt block came from")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dKV demo", show_header=False)
    rows = [
        ("requests", summary["requests"]),
        ("prompt blocks", summary["prompt_blocks"]),
        ("hit rate (device + dKV)", f"{summary['hit_rate']:.1%}"),
        ("dKV hits: co-located / peer blocks", f"{summary['local_hit_blocks']} / {summary['peer_hit_blocks']}"),
        ("requests served from a peer", summary["peer_hits"]),
        ("blocks / bytes loaded", f"{summary['blocks_loaded']} / {summary['bytes_loaded'] / 2**20:.1f} MiB"),
        ("prefill tokens saved", summary["prefill_tokens_saved"]),
        ("load throughput", f"{summary['load_throughput_gbps']:.2f} GB/s"),
        ("prefill time: dKV off / on", f"{summary['prefill_seconds_baseline']:.2f} s / {summary['prefill_seconds_dkv']:.2f} s"),
        ("time saved against recompute", f"{summary['prefill_seconds_saved']:.2f} s ({summary['speedup']:.2f}x)"),
        ("model FLOPs of prefill per KV byte", f"{summary['flops_per_kv_byte']:.3g}"),
        ("every loaded continuation bit-exact", "yes" if summary["bit_exact"] else "NO"),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    Console().print(table)
    print(f"report: {out / 'report.json'}   chart: {out / 'chart.png'}")


def run_demo(config: DemoConfig, out: Path, *, etcd: str | None = None, cluster: str = "default") -> dict[str, Any]:
    """Run the demo; returns (and writes) the report. Tears down the cluster it started, Ctrl-C included."""
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engines share 2 cores with the nodes and UCX
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    workdir = None
    try:
        if etcd is None:
            workdir = Path(tempfile.mkdtemp(prefix="dkv-demo-"))
            print(f"starting a local cluster (etcd + {config.engines} nodes) in {workdir}")
            record = local.up(workdir / "cluster", config.engines, pool=config.pool, cluster=cluster)
            nodes = [(n.node_id, n.address) for n in record.nodes]
            etcd_url = record.etcd_url
        else:
            nodes = _members(etcd, cluster)
            etcd_url = etcd
            if not nodes:
                raise RuntimeError(f"no live dKV node in cluster {cluster!r} at {etcd}")
        total = config.conversations * config.turns
        with _Progress(total) as progress:
            baseline = _run_baseline(config, progress)
            records, extra = _run_dkv(config, progress, nodes, etcd_url, cluster, baseline)
        summary = _summary(config, records, extra)
        report = {**summary, "config": {k: v for k, v in asdict(config).items() if k != "model"},
                  "model": asdict(config.model), "nodes": [n for n, _ in nodes],
                  "requests_detail": [asdict(r) for r in records]}
        (out / "report.json").write_text(json.dumps(report, indent=2))
        _chart(records, config, out / "chart.png")
        _print_summary(summary, out)
        return report
    finally:
        if workdir is not None:
            local.down(workdir / "cluster")
            shutil.rmtree(workdir, ignore_errors=True)
            print("local cluster stopped and removed")
        signal.signal(signal.SIGTERM, previous)
        torch.set_num_threads(threads)


def _raise_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _members(etcd: str, cluster: str) -> list[tuple[str, str]]:
    ucx = acquire_shared_loop()
    try:
        async def read() -> list[tuple[str, str]]:
            client = make_client(etcd)
            await client.connect()
            try:
                r = Router(client, Layout(cluster))
                await r.start(follow=False)
                return sorted((m.node_id, m.address) for m in r.members.values())
            finally:
                await client.close()
        return ucx.run(read(), 30)
    finally:
        release_shared_loop()
