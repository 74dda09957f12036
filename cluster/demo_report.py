"""The demo's numbers: per-configuration summaries, the headline (dKV against the engines' own caches),
the printed table and the chart."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from connector.engine.model import ModelConfig, prefill_flops_per_kv_byte

CONFIGURATIONS = {
    "recompute": "no prefix caching (reference)",
    "device": "device caches, dKV off (baseline)",
    "dkv": "device caches + dKV",
}


@dataclass
class RequestRecord:
    """One request as one configuration served it."""

    configuration: str
    conversation: int
    turn: int
    engine: int
    arrival: float  # seconds since the configuration's start
    ttft_seconds: float  # arrival to the first token's logits, queueing included
    prompt_blocks: int
    device_hit_blocks: int
    local_hit_blocks: int
    peer_hit_blocks: int
    computed_blocks: int
    loaded_bytes: int
    load_seconds: float
    prefill_seconds: float
    hint: str  # none / used / behind_device / no_gain / unusable:<reason>
    hinted_peer: str | None
    loads_refused: int
    loads_failed: int
    bit_exact: bool | None = None  # against the recompute configuration (None for it)


SOURCES = (("device_hit_blocks", "device"), ("local_hit_blocks", "co-located node"),
           ("peer_hit_blocks", "peer (hint)"), ("computed_blocks", "recomputed"))


def _ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) * 1e3 if values else 0.0


def summarize_configuration(records: Sequence[RequestRecord], wall_seconds: float) -> dict[str, Any]:
    """One configuration's figures: TTFT, where prompt blocks came from, bytes and rate of loads, hints."""
    ttft = [r.ttft_seconds for r in records]
    blocks = {field: sum(getattr(r, field) for r in records) for field, _ in SOURCES}
    prompt = sum(r.prompt_blocks for r in records)
    loaded = sum(r.loaded_bytes for r in records)
    load_s = sum(r.load_seconds for r in records)
    checked = [r.bit_exact for r in records if r.bit_exact is not None]
    return {
        "requests": len(records),
        "wall_seconds": wall_seconds,
        "ttft_p50_ms": _ms(ttft, 50),
        "ttft_p99_ms": _ms(ttft, 99),
        "ttft_mean_ms": float(np.mean(ttft)) * 1e3 if ttft else 0.0,
        "prefill_seconds": sum(r.prefill_seconds for r in records),
        "prompt_blocks": prompt,
        **blocks,
        "split": {name: blocks[field] / prompt if prompt else 0.0 for field, name in SOURCES},
        "peer_hits": sum(1 for r in records if r.peer_hit_blocks),
        "local_hits": sum(1 for r in records if r.local_hit_blocks),
        "bytes_loaded": loaded,
        "load_seconds": load_s,
        "load_gbps": loaded / load_s / 1e9 if load_s else 0.0,
        "hints": dict(sorted(Counter(r.hint for r in records).items())),
        "loads_refused": sum(r.loads_refused for r in records),
        "loads_failed": sum(r.loads_failed for r in records),
        "bit_exact": all(checked) if checked else None,
        "bit_exact_checked": len(checked),
    }


def summarize(model: ModelConfig, block_size: int, records: dict[str, list[RequestRecord]],
              walls: dict[str, float]) -> dict[str, Any]:
    """The report's figures: every configuration, the headline (``dkv`` against ``device``) and what a
    block costs to recompute and to load in this run."""
    per = {name: summarize_configuration(records[name], walls[name]) for name in records}
    base, dkv, ref = per["device"], per["dkv"], per["recompute"]

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    recompute_ms = ratio(ref["prefill_seconds"] * 1e3, ref["computed_blocks"])
    loaded_blocks = dkv["local_hit_blocks"] + dkv["peer_hit_blocks"]
    load_ms = ratio(dkv["load_seconds"] * 1e3, loaded_blocks)
    return {
        "configurations": per,
        "headline": {
            "ttft_p50_speedup": ratio(base["ttft_p50_ms"], dkv["ttft_p50_ms"]),
            "ttft_p99_speedup": ratio(base["ttft_p99_ms"], dkv["ttft_p99_ms"]),
            "recomputed_blocks_baseline": base["computed_blocks"],
            "recomputed_blocks_dkv": dkv["computed_blocks"],
            "recompute_avoided": 1 - ratio(dkv["computed_blocks"], base["computed_blocks"]),
            "wall_speedup": ratio(base["wall_seconds"], dkv["wall_seconds"]),
        },
        "block_costs": {
            "kv_bytes_per_block": model.kv_bytes_per_token() * block_size,
            "recompute_ms_per_block": recompute_ms,  # prefill time over computed blocks, no cache at all
            "load_ms_per_block": load_ms,  # load time over loaded blocks, with dKV
            "recompute_over_load": ratio(recompute_ms, load_ms),
            "flops_per_kv_byte": prefill_flops_per_kv_byte(model, 8 * block_size),
        },
        "bit_exact": all(per[name]["bit_exact"] is not False for name in ("device", "dkv")),
        "requests": sum(p["requests"] for p in per.values()),
    }


def chart(records: dict[str, list[RequestRecord]], turns: int, path: Path) -> None:
    """Left: TTFT distributions (CDF) of the three configurations. Right: per turn, where each prompt
    block came from, the baseline beside dKV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, label in CONFIGURATIONS.items():
        ttft = np.sort(np.asarray([r.ttft_seconds * 1e3 for r in records.get(name, ())]))
        if ttft.size:
            cdf.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=label)
    cdf.set_xscale("log")
    cdf.set_xlabel("time to first token (ms, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT: arrival to first token, queueing included")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(loc="lower right", fontsize=8)

    turns = list(range(turns))
    colors = {"device": "#4c72b0", "co-located node": "#55a868", "peer (hint)": "#dd8452", "recomputed": "#c44e52"}
    width = 0.38
    for offset, name, hatch in ((-width / 2, "device", ""), (width / 2, "dkv", "//")):
        bottom = np.zeros(len(turns))
        for field, source in SOURCES:
            values = np.asarray([sum(getattr(r, field) for r in records.get(name, ()) if r.turn == t) for t in turns])
            bars.bar([t + offset for t in turns], values, width=width, bottom=bottom, color=colors[source],
                     hatch=hatch, edgecolor="white", label=source if name == "device" else None)
            bottom += values
    bars.set_xticks(turns, [f"turn {t + 1}\nbase | dKV" for t in turns])
    bars.set_ylabel("prompt blocks (all conversations)")
    bars.set_title("Where each prompt block came from (hatched: with dKV)")
    bars.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(summary: dict[str, Any], out: Path) -> None:
    """The table a person reads: one column per configuration, then the headline."""
    from rich.console import Console
    from rich.table import Table

    per = summary["configurations"]
    names = [n for n in CONFIGURATIONS if n in per]
    table = Table(title="dKV demo: the same workload, three configurations")
    table.add_column("")
    for name in names:
        table.add_column(CONFIGURATIONS[name], justify="right")

    def row(label: str, render) -> None:
        table.add_row(label, *(render(per[n]) for n in names))

    row("requests", lambda p: str(p["requests"]))
    row("TTFT p50 / p99", lambda p: f"{p['ttft_p50_ms']:.0f} / {p['ttft_p99_ms']:.0f} ms")
    row("wall time", lambda p: f"{p['wall_seconds']:.1f} s")
    for field, source in SOURCES:
        row(f"prompt blocks: {source}", lambda p, f=field, s=source: f"{p[f]} ({p['split'][s]:.0%})")
    row("loaded", lambda p: f"{p['bytes_loaded'] / 2**20:.1f} MiB at {p['load_gbps']:.2f} GB/s"
        if p["bytes_loaded"] else "-")
    row("hints by outcome", lambda p: ", ".join(f"{k} {v}" for k, v in p["hints"].items()) if any(
        k != "none" for k in p["hints"]) else "-")
    row("loads refused / failed", lambda p: f"{p['loads_refused']} / {p['loads_failed']}")
    row("bit-exact against recompute", lambda p: "-" if p["bit_exact"] is None else (
        f"yes ({p['bit_exact_checked']})" if p["bit_exact"] else "NO"))
    console = Console(width=140)
    console.print(table)
    head, cost = summary["headline"], summary["block_costs"]
    base, dkv = per["device"], per["dkv"]
    console.print(
        f"dKV against the engines' own caches: TTFT p50 {base['ttft_p50_ms']:.0f} -> {dkv['ttft_p50_ms']:.0f} ms "
        f"({head['ttft_p50_speedup']:.2f}x), p99 {base['ttft_p99_ms']:.0f} -> {dkv['ttft_p99_ms']:.0f} ms "
        f"({head['ttft_p99_speedup']:.2f}x); recomputed blocks {head['recomputed_blocks_baseline']} -> "
        f"{head['recomputed_blocks_dkv']} ({head['recompute_avoided']:.0%} fewer).")
    console.print(
        f"a block ({cost['kv_bytes_per_block'] / 1024:.0f} KiB of KV) costs {cost['recompute_ms_per_block']:.1f} ms "
        f"to recompute and {cost['load_ms_per_block']:.2f} ms to load here ({cost['recompute_over_load']:.0f}x).")
    print("every loaded continuation bit-exact" if summary["bit_exact"] else "SOME CONTINUATION DIFFERED")
    print(f"report: {out / 'report.json'}   chart: {out / 'chart.png'}")
