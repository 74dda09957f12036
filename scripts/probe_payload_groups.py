#!/usr/bin/env python
"""Probe: how the cut of a payload into UCX messages moves a listener transfer's rate.

Two processes on loopback. For each block size and each cut (``DIRECT_MIN:GROUP_BYTES``,
set on both sides before each transfer), the child sends N blocks that lie back to
back in one buffer (``--gap``: every other slot, so nothing can be sent without a
gather) and this process receives them into back-to-back or scattered destinations.
Rounds interleave every case; prints the median GB/s of each.

Usage: probe_payload_groups.py [--sizes 65536,262144] [--blocks 256] [--rounds 7]
       [--cuts 131072:1048576,1048576:1048576] [--gap]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dkv import transport  # noqa: E402


def _set_cut(direct_min: int, group_bytes: int) -> None:
    transport.DIRECT_MIN, transport.GROUP_BYTES = direct_min, group_bytes
    transport._staging.clear()  # noqa: SLF001 - staging of another group size must not be reused


async def serve(gap: bool) -> None:
    transport.init_transport()
    arenas: dict[tuple[int, int], memoryview] = {}

    def blocks(n: int, size: int) -> list[memoryview]:
        if (n, size) not in arenas:
            arenas[(n, size)] = memoryview(bytearray(os.urandom(2 * n * size)))
        stride = 2 * size if gap else size
        return [arenas[(n, size)][i * stride:i * stride + size] for i in range(n)]

    async def handler(conn: transport.Connection) -> None:
        try:
            while True:
                msg = await conn.recv_message(3600)
                if msg["op"] != "read":
                    conn.abort()
                    return
                _set_cut(msg["direct_min"], msg["group_bytes"])
                await conn.send_message({"ok": True})
                await conn.send_payloads(blocks(msg["n"], msg["size"]), 60)
        except Exception:  # noqa: BLE001
            conn.abort()

    listener = transport.Listener(handler)
    print(listener.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    listener.close()
    await transport.stop_progress()


async def client(args: argparse.Namespace) -> None:
    child = subprocess.Popen([sys.executable, __file__, "--serve", *(["--gap"] if args.gap else [])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(child.stdout.readline())
        transport.init_transport()
        conn = await transport.connect("127.0.0.1", port)
        cuts = [tuple(int(x) for x in c.split(":")) for c in args.cuts.split(",")]
        results: dict[tuple[Any, ...], list[float]] = {}
        n = args.blocks
        for size in (int(x) for x in args.sizes.split(",")):
            whole = memoryview(bytearray(n * size))
            layouts = {"back-to-back": [whole[i * size:(i + 1) * size] for i in range(n)],
                       "scattered": [bytearray(size) for _ in range(n)]}
            for r in range(args.rounds + 1):  # round 0 warms up
                for direct_min, group_bytes in cuts:
                    for layout, dests in layouts.items():
                        _set_cut(direct_min, group_bytes)
                        t = time.perf_counter()
                        await conn.send_message({"op": "read", "n": n, "size": size, "direct_min": direct_min,
                                                 "group_bytes": group_bytes})
                        await conn.recv_message()
                        await conn.recv_payloads(dests, 60)
                        if r:
                            results.setdefault((size, direct_min, group_bytes, layout), []).append(
                                n * size / (time.perf_counter() - t) / 1e9)
        print(f"blocks={n} rounds={args.rounds} sender={'every other slot' if args.gap else 'back to back'}")
        for (size, direct_min, group_bytes, layout), rates in results.items():
            print(f"  {size >> 10:6d} KiB  DIRECT_MIN {direct_min >> 10:5d} KiB  GROUP_BYTES {group_bytes >> 10:5d} KiB"
                  f"  into {layout:12s} {statistics.median(rates):6.2f} GB/s")
        await conn.send_message({"op": "bye"})
        conn.abort()
        await transport.stop_progress()
    finally:
        child.stdin.close()
        child.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="65536,262144")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cuts", default="131072:1048576,1048576:1048576")
    parser.add_argument("--gap", action="store_true", help="the sender's blocks lie in every other slot")
    a = parser.parse_args()
    asyncio.run(serve(a.gap) if a.serve else client(a))
