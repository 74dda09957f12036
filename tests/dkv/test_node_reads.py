"""A read's bytes never change under it: real node processes, both paths.

The lease that let a read start can end while the read's bytes are still
moving (the client's next lookup of the same group, the TTL, the lease limit,
a release). Each test starts a multi-MiB read, holds it in flight, ends its
lease from another request, refills the pool with other writes, then lets
the read finish: the bytes must be exact (or the read must fail), never
another block's.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from dkv.arena import SegmentMapping
from dkv.client import handshake as handshake_as_client
from dkv.errors import LeaseExpired, ReadNotIntact
from dkv.handover import redeem
from dkv.keys import BlockKey
from dkv.transport import connect
from dkv.units import parse_address
from tests.conftest import NAMESPACE, OnUcx, node_stats, on_ucx

BLOCK = 4 * 2**20
POOL = "64MiB"  # 16 blocks
HELD = 8


async def _raw_session(address: str, client: str) -> tuple[Any, dict[str, Any]]:
    """A raw connection past the handshake as client id ``client``; returns it and the node's hello reply."""

    async def handshake() -> tuple[Any, dict[str, Any]]:
        conn = await connect(*parse_address(address))
        reply = await handshake_as_client(conn, NAMESPACE, client_id=client)  # the tokenless node's local credential
        return conn, reply

    conn, reply = await on_ucx(handshake())
    return OnUcx(conn), reply


async def _segment(hello: dict[str, Any]) -> SegmentMapping:
    """Redeem a raw session's ticket for its namespace's segment, as a same-host client does."""
    fd = await redeem(hello["shm"]["socket"], hello["shm"]["ticket"])
    try:
        return SegmentMapping(fd, os.fstat(fd).st_size, writable=hello["shm"]["access"] == "write")
    finally:
        os.close(fd)


async def _request(conn: Any, message: dict[str, Any]) -> dict[str, Any]:
    await conn.send_message(message)
    reply = await conn.recv_message()
    assert reply["ok"] is True, reply
    return reply


async def _stored_blocks(writer: Any) -> tuple[list[bytes], list[bytes]]:
    hashes = [os.urandom(32) for _ in range(HELD)]
    data = [os.urandom(BLOCK) for _ in range(HELD)]
    result = await writer.write([BlockKey("L", 0, h) for h in hashes], data)
    assert result.stored == HELD
    return hashes, data


async def _start_read(node_address: str, hashes: list[bytes], *, shm: bool) -> tuple[Any, Any, dict]:
    """A raw reader's read in flight; returns the reader, its segment mapping (same-host path) and the reply."""
    reader, hello = await _raw_session(node_address, client="reader")
    mapping = await on_ucx(_segment(hello)) if shm else None  # the same-host path needs the handed segment
    found = await _request(reader, {"op": "lookup", "hashes": hashes, "leaves": ["L"], "shards": 1,
                                    "lease": True, "group": 0})
    assert found["masks"]["L"] == b"\x01" * HELD
    reply = await _request(reader, {"op": "read", "lease": found["lease"], "keys": [["L", 0, h] for h in hashes],
                                    "end": False, "shm": shm})
    return reader, mapping, reply


async def _end_lease_and_refill(node_address: str, writer: Any) -> list[str]:
    """The reader's next lookup of the same group ends its lease; then another client fills the whole pool."""
    other, _ = await _raw_session(node_address, client="reader")
    await _request(other, {"op": "lookup", "hashes": [os.urandom(32)], "leaves": ["L"], "shards": 1,
                           "lease": True, "group": 0})
    await other.close()
    filler = [BlockKey("L", 0, os.urandom(32)) for _ in range(16)]
    return (await writer.write(filler, [b"\xee" * BLOCK] * len(filler))).statuses


async def test_listener_read_keeps_its_bytes_when_its_lease_ends_and_the_pool_refills(node_factory, clients) -> None:
    node = node_factory("--pool", POOL)
    writer = clients(node.address, local=False)
    hashes, data = await _stored_blocks(writer)
    reader, _, reply = await _start_read(node.address, hashes, shm=False)
    assert reply["sizes"] == [BLOCK] * HELD
    statuses = await _end_lease_and_refill(node.address, writer)  # the node is sending meanwhile
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.recv_payloads(dests)
    await reader.close()
    torn = [i for i, (got, want) in enumerate(zip(dests, data)) if got != want]
    assert not torn, f"blocks {torn} of the read changed under it (refill statuses {statuses})"


async def test_same_host_read_keeps_its_bytes_until_done_whatever_its_lease_does(node_factory, clients) -> None:
    node = node_factory("--pool", POOL)
    writer = clients(node.address, local=False)
    hashes, data = await _stored_blocks(writer)
    reader, mapping, reply = await _start_read(node.address, hashes, shm=True)
    await _end_lease_and_refill(node.address, writer)
    try:
        copied = [bytes(mapping.slot(off, size)) for off, size in zip(reply["offsets"], reply["sizes"])]
    finally:
        mapping.close()
    torn = [i for i, (got, want) in enumerate(zip(copied, data)) if got != want]
    assert not torn, f"blocks {torn} were rewritten while the same-host client was still copying them"
    done = await _request(reader, {"op": "done", "read": reply["read"]})
    assert done["intact"] is True
    await reader.close()


async def test_same_host_copy_that_outlives_its_read_is_failed_not_delivered(node_factory, clients) -> None:
    node = node_factory("--pool", POOL, "--read-ttl", "1")
    writer = clients(node.address, local=False)
    hashes, data = await _stored_blocks(writer)
    reader = clients(node.address, local=True, checksums=False)  # without checksums: the two-step read, then done
    found = await reader.lookup(hashes, ["L"])
    assert reader.uses_shared_memory
    mapping = reader._target._mapping  # noqa: SLF001 - slow the copy down past the read's TTL
    real_slot = mapping.slot
    calls = []

    def slow_slot(offset: int, nbytes: int) -> memoryview:
        if not calls:
            import time
            time.sleep(2.5)  # on the client's loop: the node's read TTL (1 s) passes meanwhile
        calls.append(offset)
        return real_slot(offset, nbytes)

    mapping.slot = slow_slot
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    with pytest.raises(ReadNotIntact):
        await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
    mapping.slot = real_slot


async def test_reading_connection_that_closes_mid_read_leaves_no_pin(node_factory, clients) -> None:
    node = node_factory("--pool", POOL)
    writer = clients(node.address, local=False)
    hashes, _ = await _stored_blocks(writer)
    reader, _, reply = await _start_read(node.address, hashes, shm=True)
    assert "read" in reply
    reader.abort()  # never sends done: the node drops the read's pins with the connection
    # node_factory's teardown requires no lease, reservation or pinned block left


async def test_same_host_load_takes_one_round_trip_and_ends_its_lease_without_one(node_factory, clients) -> None:
    node = node_factory("--pool", POOL)
    writer = clients(node.address, local=False)
    hashes, data = await _stored_blocks(writer)
    reader = clients(node.address, local=True)
    found = await reader.lookup(hashes, ["L"])
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
    assert [bytes(d) for d in dests] == data
    assert reader.fast_reads == 1  # copied under the lookup's lease, proven by the checksums
    stats = await node_stats(node.address)
    assert "read" not in stats["ops"] and "done" not in stats["ops"], stats["ops"]
    for _ in range(100):  # no lookup follows: the client ends the lease with an "end" request shortly
        stats = await node_stats(node.address)
        if stats["leases"] == 0:
            break
        await asyncio.sleep(0.1)
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0, stats
    assert stats["ops"].get("end") == 1


async def test_same_host_load_ends_its_lease_with_the_next_lookup(node_factory, clients, monkeypatch) -> None:
    monkeypatch.setattr("dkv.client.END_FLUSH_DELAY", 600.0)  # no "end" request of its own: only the lookup's
    node = node_factory("--pool", POOL)
    writer = clients(node.address, local=False)
    hashes, data = await _stored_blocks(writer)
    reader = clients(node.address, local=True)
    found = await reader.lookup(hashes, ["L"], group=1)
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
    again = await reader.lookup(hashes[:1], ["L"], group=2)  # another group: only the carried end ends it
    stats = await node_stats(node.address)
    assert stats["leases"] == 1 and stats["pinned_blocks"] == 1, stats  # only the new lookup's lease
    assert "end" not in stats["ops"], stats["ops"]
    await reader.release(again.lease_id)


async def test_a_same_host_load_counts_as_use_once_the_next_lookup_ends_its_lease(node_factory, clients,
                                                                                 monkeypatch) -> None:
    """The lookup answers before the node stamps the loaded blocks; the stamp still lands, before any other request."""
    monkeypatch.setattr("dkv.client.END_FLUSH_DELAY", 600.0)  # no "end" request of its own: only the lookup's
    node = node_factory("--pool", POOL)
    writer = clients(node.address, local=False)
    loaded, data = await _stored_blocks(writer)
    others, _ = await _stored_blocks(writer)  # the pool is full, and the loaded blocks are the older half
    reader = clients(node.address, local=True)
    found = await reader.lookup(loaded, ["L"], group=1)
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in loaded], dests)
    assert [bytes(d) for d in dests] == data and reader.fast_reads == 1
    again = await reader.lookup(others[:1], ["L"], group=2)  # carries the loaded lease's end
    await reader.release(again.lease_id)
    stats = await node_stats(node.address)
    assert stats["bytes"]["out"]["local"] == HELD * BLOCK, stats["bytes"]
    fresh = [BlockKey("L", 0, os.urandom(32)) for _ in range(HELD)]
    assert (await writer.write(fresh, [b"\xee" * BLOCK] * HELD)).stored == HELD  # evicts the oldest half
    present = await writer.lookup(loaded + others, ["L"], lease=False)
    assert present.masks["L"] == [True] * HELD + [False] * HELD, "the loaded blocks must count as just used"


async def test_same_host_copy_of_reused_slots_fails_its_checksum_and_falls_back_never_delivering(
        node_factory, clients) -> None:
    node = node_factory("--pool", POOL)
    writer = clients(node.address, local=False)
    hashes, data = await _stored_blocks(writer)
    reader = clients(node.address, local=True)
    found = await reader.lookup(hashes, ["L"])
    assert await reader.release(found.lease_id)  # the lease ends before the load: its slots may be reused
    assert await writer.clear() == HELD
    filler = [BlockKey("L", 0, os.urandom(32)) for _ in range(16)]
    assert (await writer.write(filler, [b"\xee" * BLOCK] * 16)).stored == 16  # the whole pool: every slot reused
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    with pytest.raises(LeaseExpired):  # the copy failed its checksums; the two-step read found no lease
        await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
    assert reader.fast_reads == 0
