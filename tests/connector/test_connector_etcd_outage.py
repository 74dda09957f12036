"""The connector through an etcd outage: lookups and loads keep hitting, the directory catches up after it.

A dedicated etcd (not the session's) is hung (SIGSTOP), then killed (SIGKILL)
and restarted on the same ports and data directory. The nodes' etcd lease TTL
is 2 s, so the outage outlasts it: both nodes lose their leases and register
again with new epochs once etcd is back, as in a long outage in service.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from cluster.etcd_process import EtcdProcess, start_etcd
from connector.dkv_connector import DKVConnector
from dkv.hints import STALE_EPOCH, UNKNOWN_PEER
from tests.conftest import node_stats
from tests.connector.conftest import routed_hint
from tests.connector.test_connector import BOUND, chain, fill, wait

NODE_TTL = 2  # seconds: the nodes' etcd lease, shorter than the outage


@pytest.fixture
def own_etcd() -> Iterator[list[EtcdProcess]]:
    """A dedicated etcd this test may stop, kill and restart; every incarnation is stopped by its PID."""
    incarnations = [start_etcd()]
    yield incarnations
    *earlier, last = incarnations
    for proc in earlier:
        if proc.alive():
            proc.proc.kill()
            proc.proc.wait(10)
    if last.alive():
        os.kill(last.pid, signal.SIGCONT)  # a stopped etcd cannot handle SIGTERM
    last.stop()  # and its data directory goes with it


def offload_rows(conn: DKVConnector, ids: list[int], hashes: list[bytes], seed: int) -> None:
    blocks = conn._blocks  # noqa: SLF001 - the connector's own device rows
    for leaf in blocks[0]:
        fill(blocks, leaf, ids, seed=seed)
    wait(conn.offload({leaf: ids for leaf in blocks[0]}, {leaf: hashes for leaf in blocks[0]}))


def hit_and_load(conn: DKVConnector, hashes: list[bytes], hint: bytes | None, source: DKVConnector,
                 source_ids: list[int], into: list[int]) -> float:
    """Look up (all present), load into ``into`` and compare with ``source``'s rows bit for bit; the longest call."""
    blocks = conn._blocks  # noqa: SLF001
    for shards in blocks[0].values():
        for tensor in shards:
            tensor[into] = 0
    started = time.monotonic()
    masks = conn.lookup(hashes, hint=hint)
    looked = time.monotonic() - started
    assert all(all(mask) for mask in masks.values()), f"a miss: {masks}"
    started = time.monotonic()
    transfer = conn.load({leaf: into for leaf in blocks[0]}, {leaf: hashes for leaf in blocks[0]}, hint=hint)
    posted = time.monotonic() - started
    wait(transfer)
    for leaf, shards in blocks[0].items():
        for shard, tensor in enumerate(shards):
            assert torch.equal(tensor[into], source._blocks[0][leaf][shard][source_ids]), "loaded bytes differ"  # noqa: SLF001
    return max(looked, posted)


async def wait_for_new_epoch(address: str, old: str, bound: float) -> str:
    deadline = time.monotonic() + bound
    while (epoch := (await node_stats(address))["epoch"]) == old:
        assert time.monotonic() < deadline, f"node {address} never lost its etcd lease"
        time.sleep(0.2)
    return epoch


async def test_an_etcd_outage_costs_no_colocated_or_hinted_hit_and_the_directory_catches_up_after_it(
        own_etcd, node_factory, connectors) -> None:
    etcd = own_etcd[0]
    prefix = f"/dkv-outage/{uuid.uuid4().hex[:8]}"

    def joining(node_id: str) -> tuple[str, ...]:
        return ("--etcd", etcd.url, "--etcd-prefix", prefix, "--node-id", node_id, "--etcd-ttl", str(NODE_TTL))

    a, b = node_factory(*joining("a")), node_factory(*joining("b"))
    cluster = {"etcd": etcd.url, "etcd_prefix": prefix, "timeout": 2.0}
    writer = connectors(b.address, **cluster)  # the engine beside peer b
    reader = connectors(a.address, **cluster)  # the engine under test, beside node a
    on_peer, own = chain(4), chain(4)
    offload_rows(writer, [1, 2, 3, 4], on_peer, seed=3)
    offload_rows(reader, [1, 2, 3, 4], own, seed=5)
    hint = routed_hint(reader, on_peer, holder="b")
    epochs = {n.address: (await node_stats(n.address))["epoch"] for n in (a, b)}

    longest = 0.0
    os.kill(etcd.pid, signal.SIGSTOP)  # etcd hangs: anything that asked it would wait
    longest = max(longest, hit_and_load(reader, own, None, reader, [1, 2, 3, 4], [10, 11, 12, 13]))
    longest = max(longest, hit_and_load(reader, on_peer, hint, writer, [1, 2, 3, 4], [14, 15, 16, 17]))
    published_late = chain(3)
    offload_rows(writer, [20, 21, 22], published_late, seed=7)  # stored now, published once etcd is back

    etcd.proc.kill()  # then it dies, and the nodes' leases run out
    etcd.proc.wait(10)
    for node in (a, b):
        epochs[node.address] = await wait_for_new_epoch(node.address, epochs[node.address], BOUND)
        longest = max(longest, hit_and_load(reader, own, None, reader, [1, 2, 3, 4], [10, 11, 12, 13]))
        longest = max(longest, hit_and_load(reader, on_peer, hint, writer, [1, 2, 3, 4], [14, 15, 16, 17]))
    assert longest < reader.timeout, f"a call took {longest:.2f} s during the outage"
    assert not reader.counters.unusable_hints, reader.counters.unusable_hints

    own_etcd.append(etcd.restart())
    back = time.monotonic()
    deadline = back + BOUND
    while (reader._router.route(reader.namespace, published_late).peer is None  # noqa: SLF001
           or reader._router.members.get("b") is None  # noqa: SLF001
           or reader._router.members["b"].epoch != epochs[b.address]):  # noqa: SLF001
        assert time.monotonic() < deadline, "the directory never caught up after etcd came back"
        time.sleep(0.05)
    caught_up = time.monotonic() - back

    # a hint from before the outage names b's old epoch, live until b registered again: still used
    longest = max(longest, hit_and_load(reader, on_peer, hint, writer, [1, 2, 3, 4], [14, 15, 16, 17]))
    assert reader.counters.unusable_hints[STALE_EPOCH] == reader.counters.unusable_hints[UNKNOWN_PEER] == 0
    fresh = routed_hint(reader, published_late, holder="b")
    longest = max(longest, hit_and_load(reader, published_late, fresh, writer, [20, 21, 22], [24, 25, 26]))
    assert longest < reader.timeout
    print(f"\n[etcd outage] longest lookup/load call {longest * 1000:.0f} ms; a publication made during the "
          f"outage routable {caught_up:.2f} s after etcd was back")
