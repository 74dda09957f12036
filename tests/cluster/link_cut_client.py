"""Engine side of the link-cut fault test; runs inside the cluster's client namespace (root).

Usage: link_cut_client.py CLUSTER_DIR. A writer offloads a chain to node-0; a
reader co-located with node-1 looks it up and loads it from node-0, named by
the router's hint, over node-0's link slowed to ``RATE`` so the load takes
seconds. Once its first bytes have landed, node-0's link is taken down
(``ip link set eth0 down`` in node-0's namespace); later it is brought back
and the reader loads again. ``max`` is made unimportable: dKV's own protocol
types stand in (the fault does not depend on them, and MAX takes seconds to
import). Prints one JSON line of what happened (see ``test_faults.py`` for
what it must say).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.modules["max"] = None  # type: ignore[assignment] - dKV's own protocol types: MAX costs seconds to import here

import torch  # noqa: E402

from cluster.local import ClusterRecord  # noqa: E402
from connector.dkv_connector import DKVConnector  # noqa: E402
from connector.types import KVLoadFailed, full_attention  # noqa: E402
from dkv.client import NodeClient  # noqa: E402
from dkv.errors import OpTimeout  # noqa: E402
from dkv.loop_thread import acquire_shared_loop, release_shared_loop  # noqa: E402
from dkv.server import ADMIN_NAMESPACE  # noqa: E402
from tests.cluster.load_faults import (  # noqa: E402
    BLOCK,
    SETTLE_BOUND,
    chain,
    nonzero_rows,
    promptly,
    settle,
    wait_for_first_bytes,
)
from tests.connector.conftest import device_blocks, routed_hint  # noqa: E402

NS = "netns/faults"
BLOCKS = 24  # 24 MiB at RATE: about a second on the wire
RATE = "200mbit"
TIMEOUT = 3.0
LEAVES = {"full": full_attention(0)}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], check=True, capture_output=True, timeout=30)


def _answered(handle: Any) -> dict[str, list[bool]]:
    deadline = time.monotonic() + SETTLE_BOUND
    while not promptly(handle.is_complete):
        assert time.monotonic() < deadline, "a lookup never answered"
        time.sleep(0.01)
    return handle.result()


def main(directory: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    record = ClusterRecord.load(directory)
    layout = record.netns_layout()
    assert layout is not None, "the cluster must run in network namespaces"
    token = Path(record.token_file).read_text().strip().encode() if record.token_file else None
    peer, home = record.nodes[0], record.nodes[-1]
    peer_ns = layout.namespace(peer.node_id)
    ucx = acquire_shared_loop()
    made: list[DKVConnector] = []
    report: dict[str, Any] = {"blocks": BLOCKS, "timeout": TIMEOUT, "phases": {}}
    began = time.monotonic()

    def phase(name: str) -> None:
        report["phases"][name] = round(time.monotonic() - began, 2)
    try:
        src = device_blocks(LEAVES, pages=BLOCKS + 1, page_bytes=BLOCK)
        src[0]["full"][0][1:] = nonzero_rows(BLOCKS)
        writer = DKVConnector(LEAVES, src, namespace=NS, node=peer.address, node_id=peer.node_id, token=token,
                              local=False, timeout=10.0)
        made.append(writer)
        hashes = chain(BLOCKS)
        assert settle(writer.offload({"full": list(range(1, BLOCKS + 1))}, {"full": hashes}))[0] == "completed"
        writer.shutdown()
        phase("offloaded")

        dst = device_blocks(LEAVES, pages=BLOCKS + 1, page_bytes=BLOCK)
        rows = dst[0]["full"][0]
        reader = DKVConnector(LEAVES, dst, namespace=NS, node=home.address, node_id=home.node_id,
                              etcd=record.etcd_url, cluster=record.cluster, token=token, local=False,
                              timeout=TIMEOUT)
        made.append(reader)
        hint = routed_hint(reader, hashes, holder=peer.node_id)
        phase("routed")
        ids = {"full": list(range(1, BLOCKS + 1))}
        _tc(peer_ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", RATE, "burst", "256kb", "latency", "2s")
        cut = False
        try:
            assert reader.lookup(hashes, hint=hint)["full"] == [True] * BLOCKS
            transfer = promptly(reader.load, ids, {"full": hashes}, hint=hint)
            report["landed_before_cut"] = wait_for_first_bytes(rows[1], transfer)
            _ip("-n", peer_ns, "link", "set", "eth0", "down")
            cut, cut_at = True, time.monotonic()
            phase("cut")
            report["in_flight_at_cut"] = not transfer._future.done()  # noqa: SLF001
            # the scheduler is not held up: a lookup asking the peer behind the cut link is posted at once
            promptly(reader.abandon_lookup, promptly(reader.start_lookup, hashes, hint=hint))
            promptly(reader.poll_transfers)
            outcome, err = settle(transfer)
            report["settled_within"] = round(time.monotonic() - cut_at, 2)
            report["outcome"] = outcome
            cause = err.__cause__ if err is not None else None
            report["cause"] = f"{type(cause).__name__}: {cause}"[:200]
            report["cause_is_timeout"] = isinstance(cause, OpTimeout)
            try:
                promptly(transfer.is_complete)
                report["polls_after_failure_fail"] = False
            except KVLoadFailed:
                report["polls_after_failure_fail"] = True
            backed_off = promptly(reader.start_lookup, hashes, hint=hint)  # the peer is backed off: a counted miss
            report["lookup_after_failure"] = _answered(backed_off)["full"]
            promptly(reader.abandon_lookup, backed_off)
            snapshot = rows.clone()
        finally:
            if cut:
                _ip("-n", peer_ns, "link", "set", "eth0", "up")
            _tc(peer_ns, "qdisc", "del", "dev", "eth0", "root")
        counters = reader.counters
        report["counters"] = {"loads_failed": counters.loads_failed, "blocks_loaded_before_recovery":
                              counters.blocks_loaded, "unusable_hints": dict(counters.unusable_hints),
                              "lookup_failures": counters.lookup_failures}
        metrics = reader.metrics
        report["metrics"] = {"dkv_peer_load_failures": getattr(metrics, "dkv_peer_load_failures", None)}

        phase("link back")
        report["peer_stats_after"] = _settled_stats(ucx, peer.address, token)
        phase("peer settled")
        time.sleep(0.3)
        report["late_writes"] = not torch.equal(rows, snapshot)

        reader._unreachable.clear()  # noqa: SLF001 - end the backoff early: the link is back
        hint = routed_hint(reader, hashes, holder=peer.node_id)  # the peer may have re-registered meanwhile
        rows.zero_()
        assert reader.lookup(hashes, hint=hint)["full"] == [True] * BLOCKS
        outcome, _ = settle(promptly(reader.load, ids, {"full": hashes}, hint=hint))
        phase("recovered")
        report["recovered_exact"] = outcome == "completed" and torch.equal(rows[1:], src[0]["full"][0][1:])
        return report
    finally:
        for conn in made:
            conn.shutdown()
        release_shared_loop()


def _settled_stats(ucx: Any, address: str, token: bytes | None) -> dict[str, int]:
    """The peer's leases, pins and reads once they are back to 0 (or after a bound), over a fresh admin connection."""

    async def fetch() -> dict[str, int]:
        admin = NodeClient(address, ADMIN_NAMESPACE, token=token, local=False, pool_size=1)
        try:
            deadline = time.monotonic() + SETTLE_BOUND
            while True:
                stats = await admin.stats()
                held = {key: stats[key] for key in ("leases", "pinned_blocks", "reads")}
                if not any(held.values()) or time.monotonic() > deadline:
                    return held
                await asyncio.sleep(0.2)
        finally:
            await admin.close()

    return ucx.run(fetch(), SETTLE_BOUND + 15)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
