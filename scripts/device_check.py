#!/usr/bin/env python
"""One prepared check of the connector's device paths, for a machine with a GPU (it runs on the CPU too).

Usage::

    python scripts/device_check.py [--device cuda] [--size 4x64KiB --size 256x64KiB --size 32x1MiB ...] [--rounds 5] [--json out.json]

1. A node (``dkv serve``, a real process, stopped by PID at the end).
2. For each path, same-host (shared memory) and listener (UCX), and each layout of the device rows
   (``contiguous``: block ids that run on, one slice copy each run; ``scattered``: shuffled ids, one
   DMA of the staging and one scatter/gather on the device): a DKVConnector over device tensors
   ``[pages, page]`` on ``--device``. Random rows are written on the device, offloaded (device-to-host
   into one pinned staging tensor on the copy stream), looked up, and loaded into other rows (pinned
   staging, host-to-device on the copy stream, completion by a blocking-sync CUDA event); the rows are
   compared on the device, bit for bit, every round. On the listener path, a load of at most 256 KiB
   (the default 4 x 64 KiB) copies the blocks its lookup's answer brought (dkv.wire, ``send``) through
   the staging, without a read.
3. Offload and load rates (GB/s = 1e9 B/s of payload, median of the rounds) beside torch's own copy of
   the same bytes between the device and pinned host memory, measured in the same run, and the time the
   ``offload`` and ``load`` calls themselves take on the calling thread (the scheduler's cost: on CUDA
   the device-to-host copies are queued there).

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
               rounds: int, scattered: bool) -> dict[str, Any]:
    pages = 2 * blocks + 1
    rows = torch.zeros(pages, page, dtype=torch.uint8, device=device)
    conn = DKVConnector({LEAF: full_attention(0)}, [{LEAF: [rows]}], namespace=f"check/{device.type}/{local}",
                        node=node_address, local=local)
    sources, targets = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    if scattered:  # shuffled ids: no two neighbours run on, so every transfer takes the scatter/gather path
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks)).tolist()
        sources, targets = [sources[i] for i in order], [targets[i] for i in reversed(order)]
    offload_gbps, load_gbps, offload_call, load_call, exact = [], [], [], [], True
    try:
        for _ in range(rounds):
            hashes = [os.urandom(32) for _ in range(blocks)]
            rows[1:blocks + 1] = torch.randint(0, 256, (blocks, page), dtype=torch.uint8, device=device)
            rows[blocks + 1:] = 0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            offload = conn.offload({LEAF: sources}, {LEAF: hashes})
            offload_call.append(time.perf_counter() - t0)
            settle(offload)
            offload_gbps.append(blocks * page / (time.perf_counter() - t0) / 1e9)
            masks = conn.lookup(hashes)
            if not all(masks[LEAF]):
                raise RuntimeError(f"the node holds {sum(masks[LEAF])}/{blocks} offloaded blocks")
            t0 = time.perf_counter()
            load = conn.load({LEAF: targets}, {LEAF: hashes})
            load_call.append(time.perf_counter() - t0)
            settle(load)
            load_gbps.append(blocks * page / (time.perf_counter() - t0) / 1e9)
            exact &= bool(torch.equal(rows[sources], rows[targets]))
    finally:
        conn.shutdown()
    return {"path": "same-host" if local else "listener", "layout": "scattered" if scattered else "contiguous",
            "blocks": blocks, "page": page, "bit_exact": exact,
            "offload_gbps": statistics.median(offload_gbps), "load_gbps": statistics.median(load_gbps),
            "offload_call_us": statistics.median(offload_call) * 1e6,
            "load_call_us": statistics.median(load_call) * 1e6}


def per_row_offload_call(device: torch.device, tensor: torch.Tensor, ids: list[int], stream: Any) -> Any:
    """The baseline: the copy engine before 2026-12-04, which queued each row's device-to-host copy on the
    calling thread into a pinned tensor of its own. Returns an event to wait on."""
    staging = [torch.empty(tensor[i].numel(), dtype=torch.uint8, pin_memory=True) for i in ids]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i, host in zip(ids, staging):
            host.copy_(tensor[i], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event, staging


def engine_call_costs(device: torch.device, blocks: int, page: int, rounds: int = 30) -> dict[str, Any]:
    """The copy engine alone, no node: p50/p99 µs of an offload's call (the scheduler thread's share),
    of queuing its device copies (the loop thread's) and of a load's finisher (the loop thread's), per layout."""
    from connector.copy_engine import CopyEngine

    engine = CopyEngine(device)
    tensor = torch.zeros(2 * blocks + 1, page, dtype=torch.uint8, device=device)
    out: dict[str, Any] = {}
    try:
        for layout in ("contiguous", "scattered"):
            ids = list(range(1, blocks + 1))
            if layout == "scattered":
                ids = [ids[i] for i in torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()]
            groups = [(tensor, ids)]
            offload, start_copy, load = [], [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                start = engine.offload_sources(lambda: groups)
                t1 = time.perf_counter()
                done, _sources = start()
                t2 = time.perf_counter()
                offload.append(t1 - t0)
                start_copy.append(t2 - t1)
                done.wait()
                _targets, finish = engine.load_targets(groups)
                t0 = time.perf_counter()
                done = finish()
                load.append(time.perf_counter() - t0)
                done.wait()
            per_row = []
            if device.type == "cuda":
                stream = torch.cuda.Stream(device=device)
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    event, _staging = per_row_offload_call(device, tensor, ids, stream)
                    per_row.append(time.perf_counter() - t0)
                    event.synchronize()
            for name, times in (("offload_call", offload), ("offload_start", start_copy), ("load_finish", load),
                                ("per_row_offload_call", per_row)):
                if not times:
                    continue
                times_us = sorted(t * 1e6 for t in times)
                out[f"{layout}_{name}_us"] = {"p50": statistics.median(times_us),
                                              "p99": times_us[min(len(times_us) - 1, int(len(times_us) * 0.99))]}
    finally:
        engine.close()
    return out


def parse_shape(text: str) -> tuple[int, int]:
    """``256x64KiB`` -> (256, 65536)."""
    blocks, _, page = text.partition("x")
    return int(blocks), parse_size(page)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", action="append", type=parse_shape, default=None,
                        help="BLOCKSxPAGE, repeatable (default: 4x64KiB, 256x64KiB and 32x1MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device, shapes = torch.device(args.device), args.size or [(4, 64 << 10), (256, 64 << 10), (32, 1 << 20)]
    pool = 4 * max(b * p for b, p in shapes) + (64 << 20)
    node = start_node(pool=str(pool), exit_with_parent=True)
    acquire_shared_loop()  # one UCX loop for every path
    try:
        results = [check_path(node.address, local, device, blocks, page, args.rounds, scattered)
                   for blocks, page in shapes for local in (True, False) for scattered in (False, True)]
        costs = {f"{b}x{format_size(p)}": engine_call_costs(device, b, p) for b, p in shapes}
        doc = {"device": str(device), "date": time.strftime("%Y-%m-%d"), "paths": results, "engine_calls": costs,
               "torch_copy": {f"{b}x{format_size(p)}": torch_copy_rates(device, b * p, args.rounds)
                              for b, p in shapes},
               "machine": machine_info()}
        if device.type == "cuda":
            doc["gpu"] = torch.cuda.get_device_name(device)
    except Exception as exc:  # noqa: BLE001 - reported, then a distinct exit status
        print(f"device check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        release_shared_loop()
        node.stop()
    print(f"on {doc['device']} {doc.get('gpu', '')}")
    for r in results:
        copy = doc["torch_copy"][f"{r['blocks']}x{format_size(r['page'])}"]
        print(f"  {r['blocks']:>4} x {format_size(r['page']):>7} {r['path']:>9} {r['layout']:>10}: "
              f"bit-exact {r['bit_exact']}, offload {r['offload_gbps']:.2f} GB/s "
              f"({r['offload_gbps'] / copy['d2h_gbps']:.2f}x torch D2H), load {r['load_gbps']:.2f} GB/s "
              f"({r['load_gbps'] / copy['h2d_gbps']:.2f}x torch H2D); calls: offload {r['offload_call_us']:.0f} us, "
              f"load {r['load_call_us']:.0f} us")
    for shape, costs in doc["engine_calls"].items():
        print(f"  copy engine alone {shape}: " + ", ".join(
            f"{name[:-3]} p50 {v['p50']:.0f} / p99 {v['p99']:.0f} us" for name, v in costs.items()))
    for shape, copy in doc["torch_copy"].items():
        print(f"  torch copy {shape}: device->host {copy['d2h_gbps']:.2f} GB/s, host->device {copy['h2d_gbps']:.2f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    ok = all(r["bit_exact"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
