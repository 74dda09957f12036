"""End to end on a local 3-node cluster: router hints, peer loads, and a node killed mid-workload."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cluster import local
from connector.dkv_connector import DKVConnector
from connector.engine.engine import Engine
from connector.engine.hashing import block_hashes
from connector.engine.model import ModelConfig
from dkv.etcd import Layout, make_client
from dkv.router import Router
from tests.conftest import on_ucx

MODEL = ModelConfig(window_layers=(1, 3), sliding_window=8, seed=5)
NS = "e2e/ns"
PROMPT = [(5 * i + 1) % MODEL.vocab for i in range(33)]


@pytest.fixture
def cluster3(tmp_path: Path) -> Iterator[local.ClusterRecord]:
    record = local.up(tmp_path / "c", 3, pool="32MiB", extra_node_args=("--etcd-ttl", "2"))
    try:
        yield record
    finally:
        local.down(tmp_path / "c")


@pytest.fixture
def engines(cluster3: local.ClusterRecord) -> Iterator[list[Engine]]:
    torch.set_num_threads(1)
    made: list[Engine] = []
    conns: list[DKVConnector] = []
    for node in cluster3.nodes:
        engine = Engine(MODEL, block_size=4, num_pages=64)
        conn = DKVConnector(engine.leaf_specs, engine.device_blocks, namespace=NS, node=node.address,
                            node_id=node.node_id, etcd=cluster3.etcd_url, timeout=2.0)
        engine.attach_connector(conn)
        made.append(engine)
        conns.append(conn)
    yield made
    for conn in conns:
        conn.shutdown()


@pytest.fixture
async def router(cluster3: local.ClusterRecord):
    async def start():
        client = make_client(cluster3.etcd_url)
        await client.connect()
        r = Router(client, Layout())
        await r.start()
        return client, r

    client, r = await on_ucx(start())
    yield r

    async def stop():
        await r.stop()
        await client.close()

    await on_ucx(stop())


async def _route(router: Router, hashes: list[bytes], predicate, bound: float = 20.0):
    deadline = time.monotonic() + bound
    while True:
        route = router.route(NS, hashes)
        if predicate(route):
            return route
        assert time.monotonic() < deadline, f"route never satisfied the condition: {route.peer} {route.depth}"
        await _sleep(0.05)


async def _until(condition, message: str, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, message
        await _sleep(0.05)


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


async def test_prefix_offloaded_by_engine_a_is_loaded_by_engine_c_via_the_hint_bit_exact(engines, router) -> None:
    a, _b, c = engines
    a.generate(PROMPT, 5)
    assert a.drain(20)
    hashes = block_hashes(PROMPT, 4)
    route = await _route(router, hashes, lambda r: r.peer is not None and r.depth >= len(hashes) - 1)
    assert route.peer.node_id == "node-0"
    result = c.generate(PROMPT, 5, hint=route.hint.encode())
    assert result.stats.connector_hit_blocks > 0
    assert c.connector.counters.hits_peer == 1
    reference = c.recompute_reference(PROMPT, 5)
    assert result.tokens == reference.tokens and torch.equal(result.logits, reference.logits)


async def test_a_node_killed_mid_workload_costs_misses_not_failures(cluster3, engines, router) -> None:
    a, b, c = engines
    a.generate(PROMPT, 5)
    assert a.drain(20)
    hashes = block_hashes(PROMPT, 4)
    stale = await _route(router, hashes, lambda r: r.peer is not None and r.peer.node_id == "node-0")
    import os
    import signal

    os.kill(cluster3.nodes[0].pid, signal.SIGKILL)
    # a request routed before the death: the hint names a dead peer, the load is a miss, recomputed
    result = c.generate(PROMPT, 5, hint=stale.hint.encode())
    reference = c.recompute_reference(PROMPT, 5)
    assert result.tokens == reference.tokens and torch.equal(result.logits, reference.logits)
    assert result.stats.connector_hit_blocks == 0
    # after the TTL the router stops naming it; the request now finds engine C's own offload. Engine C's
    # offload can make the router prefer node-2 while node-0 is still a member, so wait for the
    # membership change itself (its lease TTL is 2 s), then for a route that follows it.
    await _until(lambda: "node-0" not in router.members, "node-0 never left the router's members")
    fresh = await _route(router, hashes, lambda r: r.peer is None or r.peer.node_id != "node-0")
    again = b.generate(PROMPT, 5, hint=fresh.hint.encode() if fresh.hint else None)
    assert again.tokens == reference.tokens and torch.equal(again.logits, reference.logits)
