"""The publisher's costs stay bounded by its own work.

Batches do not copy the queue; resyncs read only this node's own entries.

A flush takes each batch from the front of the pending queue: the memory it
allocates per batch must not grow with the queue (the quadratic copy it
replaced allocated the whole queue for every batch of 128). A resync must read
this node's entries only (the keys attached to its lease, plus its own record),
never every node's directory entries, and still leave etcd holding exactly the
desired state, also when the lease's key list outgrows one gRPC message.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.conftest import etcd_client as _etcd_client, etcd_lease as _lease
from dkv.etcd import MAX_TXN_OPS, Layout, prefix_end
from dkv.publisher import DirectoryPublisher
from dkv.store import StoreKey

NS = "test/ns0"
NODE = "pub-node"
EPOCH = "1000-abcd"
ROOT = Path(__file__).resolve().parents[2]


def _chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _keys(hashes: Sequence[bytes]) -> list[StoreKey]:
    return [StoreKey(NS, "L", 0, h) for h in hashes]


# ---- batching: no copy of the queue per batch --------------------------------------------------


class _FakeKV:
    """Just enough of etcd3aio's KV service for a publisher: counts txns, keeps nothing."""

    def __init__(self) -> None:
        self.txns: list[int] = []

    def txn_op_put(self, key: str, value: str, lease: int = 0) -> tuple:
        return ("put", key)

    def txn_op_delete(self, key: str) -> tuple:
        return ("delete", key)

    async def txn(self, compare: list, success: list, timeout: float | None = None) -> None:
        self.txns.append(len(success))

    async def get(self, *args: Any, **kwargs: Any) -> Any:  # a full directory read finds nothing
        return SimpleNamespace(header=SimpleNamespace(revision=1), kvs=[], more=False)


class _FakeLease:
    async def time_to_live(self, lease_id: int, keys: bool = False, **kwargs: Any) -> Any:
        return SimpleNamespace(TTL=60, keys=[])


async def _measure_flush(n: int) -> dict[str, Any]:
    """Queue ``n`` deletes and flush them; what the flush allocated at its peak, and the txns it sent."""
    client = SimpleNamespace(kv=_FakeKV(), lease=_FakeLease())
    pub = DirectoryPublisher(client, Layout(), NODE, epoch=EPOCH)  # type: ignore[arg-type]
    pub.set_lease(1)
    await pub.flush()  # the first resync (nothing announced yet)
    hashes = _chain(n)
    pub.on_commit(_keys(hashes))
    await pub.flush()
    client.kv.txns.clear()
    pub.on_evict(_keys(hashes))
    pending = pub.pending
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        await pub.flush()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return {"queued": pending, "left": pub.pending, "deletes": pub.counters.deletes, "txns": client.kv.txns,
            "allocated_at_peak": peak - base}


def test_publisher_batches_in_linear_time() -> None:
    n = 20_000
    # measured in a process of its own: tracemalloc counts every thread's allocations, and this
    # process has others (the UCX loop) that may import or allocate meanwhile
    code = ("import asyncio, json; from tests.dkv.test_publisher_bounds import _measure_flush; "
            f"print(json.dumps(asyncio.run(_measure_flush({n}))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["queued"], result["left"], result["deletes"]) == (n, 0, n)
    assert len(result["txns"]) == math.ceil(n / MAX_TXN_OPS) and max(result["txns"]) <= MAX_TXN_OPS
    # a copy of the queue for a batch (a pointer and an item tuple a change) is megabytes at this
    # size; a batch of 128 taken from the front needs a few kB
    bound = n * 16
    assert result["allocated_at_peak"] < bound, (
        f"flushing {n} changes allocated {result['allocated_at_peak']} bytes at once (bound {bound}): "
        "a batch copies the queue")


# ---- resync: only this node's own entries -------------------------------------------------------




async def _entries(client: Any, layout: Layout, node_id: str) -> set[tuple[str, bytes]]:
    response = await client.kv.get(layout.blocks, range_end=prefix_end(layout.blocks), timeout=5)
    found = set()
    for item in response.kvs:
        parsed = layout.parse_block_key(item.key.decode())
        if parsed is not None and parsed[2] == node_id:
            found.add((parsed[0], parsed[1]))
    return found


class _ReadSpy:
    """Records every directory key the publisher's etcd reads return (ranges and lease key lists).

    Its wrappers keep no reference to the spy (no cycle holding the gRPC channel past the test).
    """

    def __init__(self, client: Any, layout: Layout) -> None:
        self.layout = layout
        self.keys: list[str] = []
        self.flags = {"too_large": False}
        keys, flags = self.keys, self.flags
        get, time_to_live = client.kv.get, client.lease.time_to_live

        async def spy_get(*args: Any, **kwargs: Any) -> Any:
            response = await get(*args, **kwargs)
            keys.extend(item.key.decode() for item in response.kvs)
            return response

        async def spy_time_to_live(*args: Any, **kwargs: Any) -> Any:
            if flags["too_large"]:
                raise _TooLarge()
            response = await time_to_live(*args, **kwargs)
            keys.extend(bytes(key).decode() for key in response.keys)
            return response

        self.client = SimpleNamespace(kv=SimpleNamespace(get=spy_get, txn=client.kv.txn,
                                                         txn_op_put=client.kv.txn_op_put,
                                                         txn_op_delete=client.kv.txn_op_delete),
                                      lease=SimpleNamespace(time_to_live=spy_time_to_live))

    def foreign(self) -> list[str]:
        """Directory keys read that belong to another node."""
        parsed = (self.layout.parse_block_key(k) for k in self.keys)
        return [k for k, p in zip(self.keys, parsed) if p is not None and p[2] != NODE]


class _TooLarge(Exception):
    """What gRPC raises for an answer larger than the channel accepts."""

    def code(self) -> Any:
        return SimpleNamespace(name="RESOURCE_EXHAUSTED")


async def test_resync_reads_only_own_entries(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as own, _lease(client) as others:
        # the rest of the cluster: many entries of other nodes, some for the same hashes as ours
        shared = _chain(20)
        foreign = {f"other-{i}": _chain(150) + shared for i in range(4)}
        for node_id, hashes in foreign.items():
            for start in range(0, len(hashes), MAX_TXN_OPS):
                ops = [client.kv.txn_op_put(layout.block_key(NS, h, node_id), "x", lease=others)
                       for h in hashes[start:start + MAX_TXN_OPS]]
                await client.kv.txn(compare=[], success=ops, timeout=5)

        spy = _ReadSpy(client, layout)
        pub = DirectoryPublisher(spy.client, layout, NODE, epoch=EPOCH, max_pending=10)  # type: ignore[arg-type]
        pub.set_lease(own)
        await pub.flush()
        mine = shared + _chain(40)
        pub.on_commit(_keys(mine))
        await pub.flush()  # the queue overflowed (10): a resync
        assert pub.counters.resyncs == 2 and pub.counters.dropped == len(mine) - 10
        assert await _entries(client, layout, NODE) == {(NS, h) for h in mine}

        # an entry of ours that we no longer want, on our lease (left by an earlier write): the resync finds it
        stale = os.urandom(32)
        await client.kv.put(layout.block_key(NS, stale, NODE), "old", lease=own, timeout=5)
        pub.on_evict(_keys(mine[:30]))  # overflows again: 10 queued, 20 dropped
        await pub.flush()
        assert pub.counters.resyncs == 3
        assert await _entries(client, layout, NODE) == {(NS, h) for h in mine[30:]}, "exactly the desired entries"
        for node_id, hashes in foreign.items():
            assert await _entries(client, layout, node_id) == {(NS, h) for h in hashes}, "other nodes' entries stay"

        assert spy.keys, "the resyncs read this node's entries"
        assert spy.foreign() == [], (f"a resync read {len(spy.foreign())} entries of other nodes, "
                                     f"e.g. {spy.foreign()[:2]}")

        # the lease's key list outgrows one gRPC message: the record of what this node wrote decides
        spy.flags["too_large"] = True
        pub.on_evict(_keys(mine[30:50]))  # overflows: 10 queued, 10 dropped
        await pub.flush()
        assert pub.counters.resyncs == 4 and pub.counters.resyncs_from_record == 1
        assert await _entries(client, layout, NODE) == {(NS, h) for h in mine[50:]}
        for node_id, hashes in foreign.items():
            assert await _entries(client, layout, node_id) == {(NS, h) for h in hashes}

        assert spy.foreign() == []
