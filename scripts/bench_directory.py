"""Benchmark the directory and the router against a real etcd.

* publish rate: a DirectoryPublisher fed runs of committed blocks (as an engine
  offloads them), dense (every block announced) and sparse (every k-th plus the
  run's last); entries/s, etcd transactions and writes per 1 000 blocks and per
  GB cached (for a given block size);
* router latency: p50/p99 of ``Router.route`` over 1 k and 8 k hashes, with the
  index holding every announced entry, beside a plain dict-lookup loop over the
  same hashes measured in the same run (the baseline).

    python scripts/bench_directory.py [--blocks 20000] [--run 16] [--sparse 8] [--block-size 2MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.etcd_process import start_etcd  # noqa: E402
from dkv.etcd import Layout, make_client  # noqa: E402
from dkv.publisher import DirectoryPublisher  # noqa: E402
from dkv.router import Router  # noqa: E402
from dkv.store import StoreKey  # noqa: E402
from dkv.units import parse_size  # noqa: E402

NS = "bench/ns"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def publish(url: str, prefix: str, blocks: int, run: int, every: int) -> tuple[dict, list[bytes]]:
    client = make_client(url)
    await client.connect()
    lease = await client.lease.grant(60)
    layout = Layout("default", prefix)
    pub = DirectoryPublisher(client, layout, "bench-node", epoch="e1", publish_every=every)
    pub.set_lease(lease.ID)
    await pub.flush()  # the initial resync
    base_txns, base_puts = pub.counters.txns, pub.counters.puts
    chain = [os.urandom(32) for _ in range(blocks)]
    t0 = time.perf_counter()
    for start in range(0, blocks, run):
        pub.on_commit([StoreKey(NS, "L", 0, h) for h in chain[start:start + run]])
    await pub.flush()
    elapsed = time.perf_counter() - t0
    result = {
        "publish_every": every,
        "blocks": blocks,
        "entries": pub.counters.puts - base_puts,
        "txns": pub.counters.txns - base_txns,
        "seconds": elapsed,
        "blocks_per_s": blocks / elapsed,
        "entries_per_s": (pub.counters.puts - base_puts) / elapsed,
    }
    await client.lease.revoke(lease.ID, timeout=5)
    await client.close()
    return result, chain


async def router_latency(url: str, prefix: str, chain_len: int, repeat: int) -> dict:
    client = make_client(url)
    await client.connect()
    lease = await client.lease.grant(60)
    layout = Layout("default", prefix)
    pub = DirectoryPublisher(client, layout, "holder", epoch="e1", publish_every=1)
    pub.set_lease(lease.ID)
    from dkv.etcd import MemberRecord

    record = MemberRecord("holder", "127.0.0.1:1", "e1", 1, time.time(), "h")
    await client.kv.put(layout.node_key("holder"), record.to_json(), lease=lease.ID, timeout=5)
    chain = [os.urandom(32) for _ in range(chain_len)]
    pub.on_commit([StoreKey(NS, "L", 0, h) for h in chain])
    await pub.flush()
    router = Router(client, layout)
    await router.start(follow=False)
    out = {}
    index = {h: {"holder"} for h in chain}
    cold = [os.urandom(32) for _ in range(8192)]
    for n in (1024, 8192):
        cases = {
            "full hit": chain[:n],
            "half hit": chain[: n // 2] + cold[: n - n // 2],
            "miss": cold[:n],
        }
        for case, hashes in cases.items():
            times, base = [], []
            for _ in range(repeat):
                t = time.perf_counter()
                route = router.route(NS, hashes)
                times.append(time.perf_counter() - t)
                t = time.perf_counter()
                depth = 0  # baseline: a plain Python loop of dict lookups from the root
                for h in hashes:
                    if h not in index:
                        break
                    depth += 1
                base.append(time.perf_counter() - t)
            expected = {"full hit": n, "half hit": n // 2, "miss": 0}[case]
            assert route.depth == expected and depth == expected, (case, route.depth, depth)
            out[f"{n} {case}"] = {
                "route_p50_us": percentile(times, 0.5) * 1e6,
                "route_p99_us": percentile(times, 0.99) * 1e6,
                "dict_loop_p50_us": percentile(base, 0.5) * 1e6,
                "index_entries": router.entries,
            }
    await router.stop()
    await client.lease.revoke(lease.ID, timeout=5)
    await client.close()
    return out


async def main(args: argparse.Namespace) -> dict:
    etcd = start_etcd()
    try:
        block_size = parse_size(args.block_size)
        results: dict = {"machine": {"nproc": os.cpu_count(), "python": platform.python_version()},
                         "block_size": block_size, "run": args.run, "publish": []}
        for i, every in enumerate((1, args.sparse)):
            r, _ = await publish(etcd.url, f"/bench{i}", args.blocks, args.run, every)
            gb = args.blocks * block_size / 1e9
            r["txns_per_1000_blocks"] = r["txns"] * 1000 / args.blocks
            r["entries_per_1000_blocks"] = r["entries"] * 1000 / args.blocks
            r["etcd_writes_per_gb"] = r["entries"] / gb
            r["etcd_txns_per_gb"] = r["txns"] / gb
            results["publish"].append(r)
        results["router"] = await router_latency(etcd.url, "/bench-router", 8192, args.repeat)
        return results
    finally:
        etcd.stop()


def report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"directory publication ({results['block_size'] // 1024} KiB blocks, runs of {results['run']})")
    for c in ("publish every", "entries/1000 blocks", "txns/1000 blocks", "etcd writes/GB", "blocks/s", "entries/s"):
        table.add_column(c, justify="right")
    for r in results["publish"]:
        table.add_row(str(r["publish_every"]), f"{r['entries_per_1000_blocks']:.0f}", f"{r['txns_per_1000_blocks']:.1f}",
                      f"{r['etcd_writes_per_gb']:.1f}", f"{r['blocks_per_s']:.0f}", f"{r['entries_per_s']:.0f}")
    Console().print(table)
    table = Table(title="router.route latency (index fed from etcd)")
    for c in ("hashes / case", "p50 µs", "p99 µs", "baseline loop p50 µs", "route / baseline"):
        table.add_column(c, justify="right")
    for n, r in results["router"].items():
        table.add_row(n, f"{r['route_p50_us']:.0f}", f"{r['route_p99_us']:.0f}", f"{r['dict_loop_p50_us']:.0f}",
                      f"{r['route_p50_us'] / max(r['dict_loop_p50_us'], 1e-3):.2f}")
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20000)
    parser.add_argument("--run", type=int, default=16, help="blocks per offloaded run (one commit)")
    parser.add_argument("--sparse", type=int, default=8, help="k of the sparse variant")
    parser.add_argument("--block-size", default="2MiB")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = asyncio.run(main(args))
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
