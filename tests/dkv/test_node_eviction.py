"""Prefix-aware eviction in a real node: the seed's partial-touch scenario, and pinned blocks."""

from __future__ import annotations

import os

import numpy as np

from dkv.keys import BlockKey

BLOCK = 64 * 1024
SLOTS = 16


def _chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


async def _fill_and_watch(client, chain: list[bytes], fillers: int) -> list[int]:
    """Write fillers one by one; return the chain positions in the order they disappeared."""
    gone: list[int] = []
    for _ in range(fillers):
        await client.write([BlockKey("F", 0, os.urandom(32))], [np.zeros(BLOCK, np.uint8)])
        mask = (await client.probe(chain, ["L"]))["L"]
        gone += [i for i, present in enumerate(mask) if not present and i not in gone]
    return gone


async def _setup(client) -> list[bytes]:
    chain = _chain(4)
    await client.write([BlockKey("L", 0, h) for h in chain], [np.ones(BLOCK, np.uint8)] * 4)
    await client.write([BlockKey("O", 0, h) for h in _chain(4)], [np.ones(BLOCK, np.uint8)] * 4)
    return chain


async def test_touch_of_the_whole_chain_evicts_deepest_first_and_root_last(node_factory, clients) -> None:
    node = node_factory(pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    chain = await _setup(client)
    assert await client.touch(chain, ["L"]) == 4
    gone = await _fill_and_watch(client, chain, SLOTS + 4)
    assert gone == [3, 2, 1, 0], "the root must be the last of its chain to go"


async def test_partial_touch_inverts_the_chain_as_the_seed_warns(node_factory, clients) -> None:
    """Guards the test above: without the whole chain, the root does go first."""
    node = node_factory(pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    chain = await _setup(client)
    await client.touch(chain[1:], ["L"])
    gone = await _fill_and_watch(client, chain, SLOTS + 4)
    assert gone[0] == 0


async def test_leased_blocks_are_never_evicted(node_factory, clients) -> None:
    node = node_factory(pool=str(SLOTS * BLOCK))
    client = clients(node.address, local=False)
    chain = _chain(4)
    keys = [BlockKey("L", 0, h) for h in chain]
    payload = [np.full(BLOCK, i, np.uint8) for i in range(4)]
    await client.write(keys, payload)
    found = await client.lookup(chain, ["L"])
    gone = await _fill_and_watch(client, chain, 3 * SLOTS)
    assert gone == []
    dests = [np.empty(BLOCK, np.uint8) for _ in keys]
    await client.read(found.lease_id, keys, dests)
    assert all(np.array_equal(a, b) for a, b in zip(payload, dests))
    assert (await client.stats())["counters"]["evictions"] >= 2 * SLOTS


async def test_disk_tier_keeps_evicted_blocks_readable(node_factory, clients, tmp_path) -> None:
    node = node_factory("--disk", str(tmp_path / "spill"), "--disk-size", str(8 * BLOCK), pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    chain = _chain(4)
    keys = [BlockKey("L", 0, h) for h in chain]
    payload = [np.full(BLOCK, 10 + i, np.uint8) for i in range(4)]
    await client.write(keys, payload)
    for _ in range(SLOTS):
        await client.write([BlockKey("F", 0, os.urandom(32))], [np.zeros(BLOCK, np.uint8)])
    stats = await client.stats()
    assert stats["blocks_on_disk"] >= 4 and stats["disk"]["used"] > 0
    found = await client.lookup(chain, ["L"])
    assert found.masks == {"L": [True] * 4}
    dests = [np.empty(BLOCK, np.uint8) for _ in keys]
    await client.read(found.lease_id, keys, dests)
    assert all(np.array_equal(a, b) for a, b in zip(payload, dests))
    assert (await client.stats())["counters"]["disk_hits"] == 4
