#!/usr/bin/env python
"""Probe: what one leased lookup costs cold against hot, on the listener path, and where inside.

Against one real node (started here, stopped by its PID at the end), a
connector on the listener path (``local=False``) looks up ``--hashes`` held
hashes with ``lookup()`` on the calling thread: one round trip over the
node's TCP direct channel, each lookup ending the one before it, no block
bytes asked for with the answer (``lookup_payload_bytes=0``). Three
contenders, interleaved round by round, each ``--samples`` lookups a round:

  back to back   each right after the one before;
  asleep         each after ``--sleep-ms`` asleep: every process idle, the
                 CPUs free to run anything else (another tenant, on a VM);
  evicted        each after a ``--evict-mib`` copy on this thread: the CPU
                 busy, its caches filled with other bytes (a bench contender
                 runs after one that moved 16-64 MiB).

For each, the p50 of the whole lookup and of three steps inside it, timed
by wrappers installed here for this process only: the exchange
(``DirectChannel.exchange_with``: the request sent, the node's work, the
answer in), the request built (``NodeClient._leased_request``) and the
answer taken (``NodeClient._leased_answer``). The last columns divide each
by its back-to-back p50: the same code, run cold. The wrappers cost the
same in every contender. A lookup that did not run on the calling thread
(its direct channel not yet open) is not counted; the line under the table
says how many did.

Usage: probe_cold_lookup.py [--hashes 256] [--samples 40] [--rounds 5] [--sleep-ms 5] [--evict-mib 64]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LEAF = "a"
BLOCK = 4096
TIMEOUT = 30.0
WHOLE = "lookup()"
STEPS = {"DirectChannel.exchange_with": "exchange", "NodeClient._leased_request": "request built",
         "NodeClient._leased_answer": "answer taken"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hashes", type=int, default=256)
    parser.add_argument("--samples", type=int, default=40, help="lookups per contender and round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one warm-up round comes first)")
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--evict-mib", type=int, default=64)
    args = parser.parse_args(argv)
    if not 1 <= args.hashes <= 1024 or args.samples < 1 or args.rounds < 1 or args.sleep_ms < 0 or args.evict_mib < 1:
        parser.error("--hashes in [1, 1024], --samples and --rounds >= 1, --sleep-ms >= 0, --evict-mib >= 1")

    import numpy as np
    import torch

    from bench_common import chained_hashes, rotate, store_through, timed_methods
    from cluster.process import start_node
    from connector.dkv_connector import DKVConnector
    from connector.types import full_attention
    from dkv.client import NodeClient
    from dkv.direct_channel import DirectChannel

    node = start_node("--log-level", "WARNING", pool=str(max(64 << 20, 4 * args.hashes * BLOCK)), exit_with_parent=True)
    conn: Any = None
    try:
        hashes = chained_hashes(args.hashes)
        rows = torch.zeros((args.hashes + 1, BLOCK), dtype=torch.uint8)
        conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace="probe-cold-lookup",
                            node=str(node.address), timeout=TIMEOUT, local=False, lookup_payload_bytes=0)
        store_through(conn, LEAF, hashes, TIMEOUT)
        source = np.ones(args.evict_mib << 20, dtype=np.uint8)
        target = np.empty_like(source)
        inside: dict[str, list[float]] = {}
        steps: dict[str, dict[str, list[float]]] = {}  # contender -> step -> seconds
        counted = {"in place": 0, "of": 0}

        def contender(name: str, prelude: Callable[[], Any]) -> Callable[[], None]:
            mine = steps.setdefault(name, {WHOLE: [], **{label: [] for label in STEPS.values()}})

            def run() -> None:
                for _ in range(args.samples):
                    prelude()
                    for samples in inside.values():
                        samples.clear()
                    before = conn.counters.lookups_in_place
                    t0 = time.perf_counter()
                    masks = conn.lookup(hashes)
                    took = time.perf_counter() - t0
                    if not all(masks[LEAF]):
                        raise SystemExit("the lookup missed a held block")
                    counted["of"] += 1
                    if conn.counters.lookups_in_place == before:
                        continue  # asked on the loop thread: another path, not this probe's
                    counted["in place"] += 1
                    mine[WHOLE].append(took)
                    for method, label in STEPS.items():
                        mine[label] += inside.get(method, [])

            return run

        contenders = {
            "back to back": contender("back to back", lambda: None),
            "asleep": contender("asleep", lambda: time.sleep(args.sleep_ms / 1e3)),
            "evicted": contender("evicted", lambda: np.copyto(target, source)),
        }
        deadline = time.monotonic() + TIMEOUT
        while conn.counters.lookups_in_place == 0:  # until the direct channel (opened in the background) answers
            if time.monotonic() > deadline:
                raise SystemExit("no lookup ran on the calling thread: the direct channel never opened")
            conn.lookup(hashes)
            time.sleep(0.001)
        with timed_methods([(DirectChannel, "exchange_with"), (NodeClient, "_leased_request"),
                            (NodeClient, "_leased_answer")], inside):
            for round_no in range(1 + args.rounds):  # the first round is warm-up
                if round_no == 1:
                    for mine in steps.values():
                        for samples in mine.values():
                            samples.clear()
                    counted["in place"] = counted["of"] = 0
                for name in rotate(list(contenders), round_no):
                    contenders[name]()
        for name, mine in steps.items():
            if not mine[WHOLE]:
                raise SystemExit(f"no timed lookup of '{name}' ran on the calling thread: the direct channel closed")

        def p50_us(samples: list[float]) -> float:
            return statistics.median(samples) * 1e6

        labels = [WHOLE, *STEPS.values()]
        hot = {label: p50_us(steps["back to back"][label]) for label in labels}
        print(f"leased lookup of {args.hashes} hashes on the listener path (lookup() over the direct channel), "
              f"{args.rounds} rounds x {args.samples}; p50 µs; load average {os.getloadavg()[0]:.2f}")
        print(f"  {'contender':14s}" + "".join(f"{label:>15s}" for label in labels) + "   x back to back (whole)")
        for name, mine in steps.items():
            values = [p50_us(mine[label]) for label in labels]
            print(f"  {name:14s}" + "".join(f"{v:15.1f}" for v in values) + f"   {values[0] / hot[WHOLE]:.2f}")
        print("  cold / hot per step: " + "; ".join(
            f"{label} {p50_us(steps[name][label]) / hot[label]:.1f} x ({name})"
            for name in ("asleep", "evicted") for label in labels[1:]))
        print(f"  on the calling thread: {counted['in place']} of {counted['of']} timed lookups "
              f"(asleep {args.sleep_ms:g} ms, evicted by {args.evict_mib} MiB copied)")
    finally:
        if conn is not None:
            conn.shutdown()
        node.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
