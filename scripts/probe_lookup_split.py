#!/usr/bin/env python
"""Probe: where a same-host leased lookup's fixed cost goes, three contenders interleaved in one run.

Against one real node (started here, stopped by its PID at the end), for a
lookup of ``--hashes`` held hashes (default 1, so the fixed cost shows):

  connector    ``DKVConnector.lookup`` on the calling thread, as engines get it:
               its round trip on that thread, over the direct channel;
  conn_loop    the same with ``lookup_in_place=False`` (validation, the hop to the
               loop thread, the worker side's lease budget and lease state, the
               held-blocks memory, the hop back);
  raw_on_loop  ``NodeClient.lookup`` (leased) awaited on the loop thread itself:
               the client and the node, no hop;
  raw_direct   ``NodeClient.lookup_direct`` on the calling thread;
  hop          an empty coroutine run on the loop thread from the calling thread.

``conn_loop - raw_on_loop - hop`` is what the connector adds around the node's
round trip on the loop; ``connector - raw_direct`` what it adds in place. Each round runs every contender ``--samples`` times; the first
round is warm-up. With ``--profile``, one more pass of each path runs under
cProfile on the loop thread and prints its top functions.

Usage: probe_lookup_split.py [--hashes 1] [--samples 300] [--rounds 6] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LEAF = "a"
PAGE = 4096
TIMEOUT = 10.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hashes", type=int, default=1)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.hashes <= 4096 or args.samples < 1 or args.rounds < 2:
        parser.error("--hashes in [1, 4096], --samples >= 1, --rounds >= 2")

    import torch

    from bench_common import chained_hashes, direct_client, interleaved_rounds, latency_summary_us, store_through
    from cluster.process import start_node
    from connector.dkv_connector import DKVConnector
    from connector.types import full_attention
    from dkv.loop_thread import acquire_shared_loop, release_shared_loop

    node = start_node("--log-level", "WARNING", pool="64MiB", exit_with_parent=True)
    loop = acquire_shared_loop()
    conn: Any = None
    conn_loop: Any = None
    raw: Any = None
    try:
        hashes = chained_hashes(args.hashes)
        rows = torch.ones(args.hashes + 1, PAGE, dtype=torch.uint8)
        conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace="probe", node=str(node.address),
                            timeout=TIMEOUT)
        conn_loop = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace="probe",
                                 node=str(node.address), timeout=TIMEOUT, lookup_in_place=False)
        store_through(conn, LEAF, hashes, TIMEOUT)
        raw = direct_client(loop, str(node.address), "probe", TIMEOUT)
        conn.lookup(hashes)  # asks for its direct channel
        deadline = time.monotonic() + TIMEOUT
        while conn.counters.lookups_in_place == 0:
            if time.monotonic() > deadline:
                raise SystemExit("the connector's lookups never ran in place")
            time.sleep(0.01)
            conn.lookup(hashes)

        async def nothing() -> None:
            return None

        async def raw_lookups(n: int) -> list[int]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                result = await raw.lookup(hashes, [LEAF])
                out.append(time.perf_counter_ns() - t0)
                if not all(result.masks[LEAF]):
                    raise SystemExit("the raw lookup missed")
            return out

        def each_timed(n: int, call: Callable[[], Any], check: Callable[[Any], bool]) -> list[int]:
            """``n`` calls on this thread, each timed alone; ``check`` judges each result outside its time."""
            out = []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                result = call()
                out.append(time.perf_counter_ns() - t0)
                if not check(result):
                    raise SystemExit("a lookup through the connector missed")
            return out

        def conn_lookups(n: int) -> list[int]:
            return each_timed(n, lambda: conn.lookup(hashes), lambda masks: all(masks[LEAF]))

        def conn_loop_lookups(n: int) -> list[int]:
            return each_timed(n, lambda: conn_loop.lookup(hashes), lambda masks: all(masks[LEAF]))

        def raw_direct_lookups(n: int) -> list[int]:
            return each_timed(n, lambda: raw.lookup_direct(hashes, [LEAF]), lambda found: all(found.masks[LEAF]))

        def hops(n: int) -> list[int]:
            return each_timed(n, lambda: loop.run(nothing(), TIMEOUT), lambda _: True)

        contenders: dict[str, Callable[[int], list[int]]] = {
            "connector": conn_lookups,
            "conn_loop": conn_loop_lookups,
            "raw_on_loop": lambda n: loop.run(raw_lookups(n), 120),
            "raw_direct": raw_direct_lookups,
            "hop": hops,
        }
        samples = interleaved_rounds({name: functools.partial(run, args.samples) for name, run in contenders.items()},
                                     args.rounds)
        print(f"leased lookup of {args.hashes} hash(es), same-host, {args.rounds - 1} rounds x {args.samples}")
        summaries = {name: latency_summary_us(values) for name, values in samples.items()}
        for name, summary in summaries.items():
            print(f"  {name:12s} p50 {summary['p50_us']:8.1f} µs   p99 {summary['p99_us']:8.1f} µs")
        added = summaries["conn_loop"]["p50_us"] - summaries["raw_on_loop"]["p50_us"] - summaries["hop"]["p50_us"]
        print(f"  the connector adds (p50): {added:.1f} µs around the node's round trip and one hop on the loop")
        added = summaries["connector"]["p50_us"] - summaries["raw_direct"]["p50_us"]
        print(f"  the connector adds (p50): {added:.1f} µs around the round trip in place")
        if conn.counters.lookups_in_place < conn.counters.lookups - 5:
            print(f"  (only {conn.counters.lookups_in_place} of {conn.counters.lookups} connector lookups ran in place)")
        if args.profile:
            for name in ("conn_loop", "raw_on_loop"):
                profiler = cProfile.Profile()

                async def switch(on: bool) -> None:
                    profiler.enable() if on else profiler.disable()

                loop.run(switch(True), TIMEOUT)
                contenders[name](args.samples)
                loop.run(switch(False), TIMEOUT)
                print(f"--- loop thread under cProfile, {name}")
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)
    finally:
        if raw is not None:
            loop.run(raw.close(), TIMEOUT)
        if conn is not None:
            conn.shutdown()
        if conn_loop is not None:
            conn_loop.shutdown()
        release_shared_loop()
        node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
