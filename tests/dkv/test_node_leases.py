"""Leases against a real node: expiry, abandon, back-to-back lookups, disconnect, bound."""

from __future__ import annotations

import asyncio
import os

import pytest

from dkv.errors import LeaseExpired
from dkv.keys import BlockKey
from tests.conftest import node_stats, wait_for_stats

TTL = 1.0


async def _stored(client, n: int = 3) -> tuple[list[bytes], list[BlockKey]]:
    hashes = [os.urandom(32) for _ in range(n)]
    keys = [BlockKey("L", 0, h) for h in hashes]
    await client.write(keys, [b"z" * 4096] * n)
    return hashes, keys


async def test_lease_expires_before_read_and_the_read_is_refused(node_factory, clients) -> None:
    node = node_factory("--lease-ttl", str(TTL))
    client = clients(node.address)
    hashes, keys = await _stored(client)
    found = await client.lookup(hashes, ["L"])
    await asyncio.sleep(TTL + 1.5)  # well past the TTL, then the read must be refused
    with pytest.raises(LeaseExpired):
        await client.read(found.lease_id, keys, [bytearray(4096) for _ in keys])
    stats = await client.stats()
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0
    assert stats["counters"]["reads_refused"] == 1


async def test_abandon_releases_the_lease(node, clients) -> None:
    client = clients(node.address)
    hashes, _ = await _stored(client)
    found = await client.lookup(hashes, ["L"])
    assert (await client.stats())["pinned_blocks"] == 3
    assert await client.release(found.lease_id) is True
    assert await client.release(found.lease_id) is False  # idempotent
    stats = await client.stats()
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0


async def test_back_to_back_lookups_hold_one_lease(node, clients) -> None:
    client = clients(node.address)
    hashes, keys = await _stored(client)
    first = await client.lookup(hashes, ["L"])
    second = await client.lookup(hashes, ["L"])
    assert (await client.stats())["leases"] == 1
    with pytest.raises(LeaseExpired):
        await client.read(first.lease_id, keys, [bytearray(4096) for _ in keys])
    await client.read(second.lease_id, keys, [bytearray(4096) for _ in keys])
    assert (await client.stats())["leases"] == 0, "a completed load ends its lease"


async def test_a_client_that_disconnects_loses_its_leases(node, clients) -> None:
    client = clients(node.address)
    hashes, _ = await _stored(client)
    await client.lookup(hashes, ["L"], group=0)
    await client.lookup(hashes, ["L"], group=1)
    assert (await node_stats(node.address))["leases"] == 2
    await client.close()
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0


async def test_lease_count_is_bounded_per_client(node_factory, clients) -> None:
    node = node_factory("--max-leases", "8")
    client = clients(node.address)
    hashes, _ = await _stored(client, 1)
    for group in range(12):
        await client.lookup(hashes, ["L"], group=group)
    stats = await client.stats()
    assert stats["leases"] == 8
    assert stats["counters"]["leases_dropped_over_limit"] == 4


async def test_unleased_lookup_takes_no_lease(node, clients) -> None:
    client = clients(node.address)
    hashes, _ = await _stored(client)
    found = await client.lookup(hashes, ["L"], lease=False)
    assert found.lease_id is None and found.masks == {"L": [True] * 3}
    assert (await client.stats())["leases"] == 0
