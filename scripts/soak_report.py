"""The soak's report: the table (rich) and the chart (matplotlib) drawn from ``soak.json``'s document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 2**20
KIND_LABELS = {"offload": "offload (co-located node)", "load_local": "load, own chain (co-located node)",
               "load_hint": "load, another's chain (router hint)", "lookup_sync": "lookup() + load() (router hint)"}


def print_table(doc: dict[str, Any], file: Any = None) -> None:
    """The summary table, then one table of memory (RSS of every process, the connectors' heap)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file)
    if console.width < 120:
        console = Console(file=file, width=120)
    totals = doc.get("totals", {})
    cfg = doc.get("config", {})
    title = (f"dKV soak, {cfg.get('minutes', 0):g} min ({doc.get('started_at', '?')}): 3 nodes, 3 connector processes, "
             f"{doc.get('kills', 0)} node kills, {doc.get('etcd_restarts', 0)} etcd restarts")
    table = Table(title=title, title_justify="left")
    for col in ("operation", "requests", "hits", "misses", "blocks loaded / missed", "failures", "wrong bytes", "hangs",
                "p50 / p99 / max ms"):
        table.add_column(col, justify="left" if col in ("operation", "failures") else "right")
    for kind, acc in doc.get("by_kind", {}).items():
        lat = doc.get("latency", {}).get(kind, {})
        worst = max((v.get("max_ms", 0.0) for v in lat.values()), default=0.0)
        p50 = max((v.get("p50_ms", 0.0) for v in lat.values()), default=0.0)
        p99 = max((v.get("p99_ms", 0.0) for v in lat.values()), default=0.0)
        failures = ", ".join(f"{k} {v}" for k, v in sorted(acc["failures"].items())) or "-"
        table.add_row(KIND_LABELS.get(kind, kind), str(acc["requests"]), str(acc["hits"]), str(acc["misses"]),
                      f"{acc['blocks_hit']} / {acc['blocks_missed']}", failures, _flag(acc["wrong_bytes"]),
                      _flag(acc["hangs"]), f"{p50:.1f} / {p99:.1f} / {worst:.0f}")
    table.add_row("[bold]all", f"[bold]{totals.get('requests', 0)}", f"[bold]{totals.get('hits', 0)}",
                  f"[bold]{totals.get('misses', 0)}", f"{totals.get('blocks_hit', 0)} / {totals.get('blocks_missed', 0)}",
                  f"{totals.get('failures', 0)}", _flag(totals.get("wrong_bytes", 0)), _flag(totals.get("hangs", 0)),
                  "")
    console.print(table)
    checked = totals.get("bytes_checked", 0)
    console.print(f"bytes loaded and compared with what was written: {checked / MiB:.1f} MiB; "
                  f"wrong: {totals.get('wrong_bytes', 0)}; hangs (an operation past {cfg.get('op_bound_s', 0):g} s): "
                  f"{totals.get('hangs', 0)}; crashes: {len(doc.get('crashes', []))}")

    restarts = [e for e in doc.get("events", []) if e["kind"] == "node_restart"]
    if restarts:
        console.print("node restarts (same port, same id): " + "; ".join(
            f"{e['node']} at {e['t']:.0f} s, its connector offloading again after "
            + (f"{e['offloading_again_after_s']:.0f} s" if e.get("offloading_again_after_s") is not None else "[red]never[/]")
            for e in restarts)
            + f"; failed restart attempts: {doc.get('restart_failures', 0)}")
    mem = Table(title="memory (RSS, MiB; sampled every second)", title_justify="left")
    for col in ("process", "first", "at 60 s", "end", "max", "end: anon / shmem / file", "threads"):
        mem.add_column(col, justify="left" if col == "process" else "right")
    for name, s in doc.get("rss_summary", {}).items():
        mem.add_row(name, f"{s['start_mib']:.0f}", f"{s['at_60s_mib']:.0f}", f"{s['end_mib']:.0f}", f"{s['max_mib']:.0f}",
                    f"{s['end_anon_mib']:.0f} / {s['end_shmem_mib']:.0f} / {s['end_file_mib']:.0f}",
                    str(s["end_threads"]))
    console.print(mem)
    segs = doc.get("segments", {})
    if segs:
        worst = {name: max(v, key=lambda s: s[2]) for name, v in segs.items() if v}
        console.print("node pool segments mapped by the connectors (same-host path; shared memory, counted in the "
                      "nodes' RSS too): most resident " + ", ".join(f"{n} {s[2] / MiB:.0f} MiB in {s[1]}"
                                                                   for n, s in sorted(worst.items()))
                      + f"; of killed nodes, most at once: {doc.get('dead_segments_max_mib', 0):.0f} MiB")
    for client in doc.get("clients", []):
        ready, end = client.get("mem_ready", {}), client.get("mem_end", {})
        if ready and end:
            console.print(f"{client['name']}: glibc heap in use {ready.get('heap_in_use', 0) / MiB:.0f} -> "
                          f"{end.get('heap_in_use', 0) / MiB:.0f} MiB, kept free {ready.get('heap_free', 0) / MiB:.0f} -> "
                          f"{end.get('heap_free', 0) / MiB:.0f} MiB"
                          + (f", Python (tracemalloc) {ready.get('traced', 0) / MiB:.0f} -> {end.get('traced', 0) / MiB:.0f} MiB"
                             if "traced" in end else ""))
    for kind in ("wrong_bytes", "hangs", "errors"):
        for item in doc.get("incidents", {}).get(kind, [])[:5]:
            console.print(f"[red]{kind}[/]: {item}")
    for crash in doc.get("crashes", []):
        console.print(f"[red]crash[/]: {crash}")
    if doc.get("error"):
        console.print(f"[red]error[/]: {doc['error']}")


def _flag(n: int) -> str:
    return f"[red bold]{n}[/]" if n else "0"


def draw_chart(doc: dict[str, Any], path: Path) -> None:
    """Three panels over time: connector RSS (and heap), node RSS, requests and failures per second; faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    ax_client, ax_node, ax_rate = axes
    for name, samples in sorted(doc.get("rss", {}).items()):
        ax = ax_client if name.startswith("client") else ax_node
        ts = [s[0] for s in samples]
        ax.plot(ts, [s[1] / MiB for s in samples], label=f"{name} RSS")
        if name.startswith("client"):
            ax.plot(ts, [s[2] / MiB for s in samples], linestyle=":", label=f"{name} anon")
    for client in doc.get("clients", []):
        heap = client.get("heap", [])
        if heap:
            ax_client.plot([h[0] for h in heap], [h[1] / MiB for h in heap], linestyle="--",
                           label=f"{client['name']} glibc heap in use")
    ax_client.set_ylabel("MiB")
    ax_client.set_title("connector processes: RSS, anonymous RSS, glibc heap in use")
    ax_node.set_ylabel("MiB")
    ax_node.set_title("nodes: RSS")
    series = doc.get("series", [])
    if len(series) > 1:
        ts = [s["t"] for s in series]
        for key, label in (("requests", "requests/s"), ("hits", "hits/s"), ("failures", "failures/s")):
            vals = [s.get(key, 0) for s in series]
            rates = [max(0.0, (vals[i] - vals[i - 1]) / max(1e-6, ts[i] - ts[i - 1])) for i in range(1, len(vals))]
            ax_rate.plot(ts[1:], rates, label=label)
    ax_rate.set_ylabel("per second")
    ax_rate.set_xlabel("seconds into the soak")
    ax_rate.set_title("operations")
    colors = {"node_kill": "red", "node_restart": "green", "etcd_kill": "purple", "etcd_restart": "blue"}
    for event in doc.get("events", []):
        color = colors.get(event["kind"])
        if color:
            for ax in axes:
                ax.axvline(event["t"], color=color, alpha=0.4, linewidth=1)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle("dKV soak (red: node killed, green: restarted, purple/blue: etcd killed/restarted)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
