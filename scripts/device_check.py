#!/usr/bin/env python
"""One prepared check of the connector's device paths, for a machine with a GPU (it runs on the CPU too).

Usage::

    python scripts/device_check.py [--device cuda] [--blocks 64] [--page 256KiB] [--rounds 5] [--json out.json]

1. A node (``dkv serve``, a real process, stopped by PID at the end). Its namespace segments are not
   registered with CUDA (they are sparse, per namespace): the connector copies through its own pinned
   staging, which is what this check exercises.
2. For each path, same-host (shared memory) and listener (UCX): a DKVConnector over device tensors
   ``[pages, page]`` on ``--device``. Random rows are written on the device, offloaded (device-to-host
   into pinned staging on the copy stream), looked up, and loaded into other rows (pinned staging,
   host-to-device on the copy stream, completion by CUDA event); the rows are compared on the device,
   bit for bit, every round.
3. Offload and load rates (GB/s = 1e9 B/s of payload, median of the rounds) beside torch's own copy of
   the same bytes between the device and pinned host memory, measured in the same run.

Exit status: 0 when every comparison holds, 1 if any byte differs, 2 on an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `cluster` and `connector` live at the repository root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench_common import machine_info  # noqa: E402
from cluster.process import start_node  # noqa: E402
from connector.dkv_connector import DKVConnector  # noqa: E402
from connector.types import full_attention  # noqa: E402
from dkv.loop_thread import acquire_shared_loop, release_shared_loop  # noqa: E402
from dkv.units import format_size, parse_size  # noqa: E402

LEAF = "full"
WAIT = 60.0  # seconds for a node request, generous


def settle(transfer: Any) -> None:
    """Wait for a transfer without polling (``synchronize``), then read its outcome (``is_complete`` raises a failure)."""
    transfer.synchronize()
    if not transfer.is_complete():
        raise RuntimeError("a transfer was not complete after synchronize()")


def torch_copy_rates(device: torch.device, nbytes: int, rounds: int) -> dict[str, float]:
    """GB/s of torch's own device<->pinned-host copy of ``nbytes`` (the same run's baseline)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h, h2d = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        d2h.append(nbytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        src.copy_(host, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        h2d.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return {"d2h_gbps": statistics.median(d2h), "h2d_gbps": statistics.median(h2d)}


def check_path(node_address: str, local: bool, device: torch.device, blocks: int, page: int,
               rounds: int) -> dict[str, Any]:
    pages = 2 * blocks + 1
    rows = torch.zeros(pages, page, dtype=torch.uint8, device=device)
    conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace=f"check/{device.type}/{local}",
                        node=node_address, local=local)
    sources, targets = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    offload_gbps, load_gbps, exact = [], [], True
    try:
        for _ in range(rounds):
            hashes = [os.urandom(32) for _ in range(blocks)]
            rows[1:blocks + 1] = torch.randint(0, 256, (blocks, page), dtype=torch.uint8, device=device)
            rows[blocks + 1:] = 0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            settle(conn.offload({LEAF: sources}, {LEAF: hashes}))
            offload_gbps.append(blocks * page / (time.perf_counter() - t0) / 1e9)
            masks = conn.lookup(hashes)
            if not all(masks[LEAF]):
                raise RuntimeError(f"the node holds {sum(masks[LEAF])}/{blocks} offloaded blocks")
            t0 = time.perf_counter()
            settle(conn.load({LEAF: targets}, {LEAF: hashes}))
            load_gbps.append(blocks * page / (time.perf_counter() - t0) / 1e9)
            exact &= bool(torch.equal(rows[1:blocks + 1], rows[blocks + 1:]))
    finally:
        conn.shutdown()
    return {"path": "same-host" if local else "listener", "bit_exact": exact,
            "offload_gbps": statistics.median(offload_gbps), "load_gbps": statistics.median(load_gbps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--page", default="256KiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device, page = torch.device(args.device), parse_size(args.page)
    pool = 4 * args.blocks * page + (64 << 20)
    node = start_node(pool=str(pool), exit_with_parent=True)
    acquire_shared_loop()  # one UCX loop for both paths
    try:
        results = [check_path(node.address, local, device, args.blocks, page, args.rounds) for local in (True, False)]
        doc = {"device": str(device), "blocks": args.blocks, "page": page,
               "paths": results, "torch_copy": torch_copy_rates(device, args.blocks * page, args.rounds),
               "machine": machine_info()}
        if device.type == "cuda":
            doc["gpu"] = torch.cuda.get_device_name(device)
    except Exception as exc:  # noqa: BLE001 - reported, then a distinct exit status
        print(f"device check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        release_shared_loop()
        node.stop()
    print(f"{args.blocks} x {format_size(page)} on {doc['device']}")
    for r in results:
        print(f"  {r['path']:>9}: bit-exact {r['bit_exact']}, offload {r['offload_gbps']:.2f} GB/s, "
              f"load {r['load_gbps']:.2f} GB/s")
    copy = doc["torch_copy"]
    print(f"  torch copy baseline: device->host {copy['d2h_gbps']:.2f} GB/s, host->device {copy['h2d_gbps']:.2f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    ok = all(r["bit_exact"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
