"""The main job for now: start a dKV node, round-trip blocks over both paths, show its stats, stop it.

Run through ``scripts/run.sh demo``. Exits non-zero if any byte comes back wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.process import start_node  # noqa: E402
from dkv.client import NodeClient  # noqa: E402
from dkv.keys import BlockKey  # noqa: E402
from dkv.transport import stop_progress  # noqa: E402
from dkv.units import format_size  # noqa: E402

BLOCKS = 64
BLOCK_SIZE = 256 * 1024


async def round_trip(address: str, local: bool) -> tuple[float, float]:
    client = NodeClient(address, "demo/smoke", local=local)
    try:
        hashes = [os.urandom(32) for _ in range(BLOCKS)]
        keys = [BlockKey("full", 0, h) for h in hashes]
        rng = np.random.default_rng(0)
        blocks = [rng.integers(0, 256, BLOCK_SIZE, dtype=np.uint8) for _ in keys]
        t0 = time.perf_counter()
        await client.write(keys, blocks)
        t1 = time.perf_counter()
        found = await client.lookup(hashes, ["full"])
        dests = [np.empty(BLOCK_SIZE, np.uint8) for _ in keys]
        await client.read(found.lease_id, keys, dests)
        t2 = time.perf_counter()
        if not all(np.array_equal(a, b) for a, b in zip(blocks, dests)):
            raise SystemExit("round trip returned different bytes")
        total = BLOCKS * BLOCK_SIZE
        return total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9
    finally:
        await client.close()


async def main() -> None:
    node = start_node(pool="256MiB")
    try:
        print(f"started dkv node {node.ready['node_id']} at {node.address} (pid {node.pid})")
        for local in (True, False):
            put, get = await round_trip(node.address, local)
            path = "same-host (shared arena)" if local else "listener (UCX messages)"
            print(f"  {path:26s} {BLOCKS} x {format_size(BLOCK_SIZE)}: put {put:5.2f} GB/s, "
                  f"lookup+read {get:5.2f} GB/s, bit-exact")
        admin = NodeClient(node.address, "dkv.admin")
        stats = await admin.stats()
        await admin.close()
        print(json.dumps({k: stats[k] for k in ("node_id", "blocks", "host", "leases", "ops")}, indent=2))
    finally:
        await stop_progress()
        node.stop()
        print("node stopped; nothing left behind" if not os.path.exists(f"/dev/shm/{node.shm_name}") else "")


if __name__ == "__main__":
    asyncio.run(main())
