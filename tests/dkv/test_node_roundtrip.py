"""Bit-exact round trips through a real node process, over both paths."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from dkv.keys import BlockKey

SIZES = [0, 1, 8 * 1024, 64 * 1024, 2**20, 4 * 2**20]


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
async def test_round_trip_is_bit_exact_for_every_block_size(node, clients, local: bool) -> None:
    client = clients(node.address, local=local)
    await client.connect()
    assert client.uses_shared_memory is local
    rng = np.random.default_rng(7)
    hashes = [os.urandom(32) for _ in SIZES]
    keys = [BlockKey("full", 0, h) for h in hashes]
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]
    written = await client.write(keys, sources)
    assert written.statuses == ["write"] * len(SIZES)

    found = await client.lookup(hashes, ["full"])
    assert found.masks == {"full": [True] * len(SIZES)}
    dests = [np.full(n, 0xAB, dtype=np.uint8) for n in SIZES]
    await client.read(found.lease_id, keys, dests)
    for size, src, dst in zip(SIZES, sources, dests):
        assert np.array_equal(src, dst), f"block of {size} bytes differs"


async def test_a_second_client_reads_what_the_first_wrote(node, clients) -> None:
    writer, reader = clients(node.address, local=False), clients(node.address, local=True)
    hashes = [os.urandom(8) for _ in range(3)]
    keys = [BlockKey("L", s, h) for h in hashes for s in (0, 1)]
    blocks = [os.urandom(4096) for _ in keys]
    await writer.write(keys, blocks)
    found = await reader.lookup(hashes, ["L"], shards=2)
    assert found.masks == {"L": [True, True, True]}
    dests = [bytearray(4096) for _ in keys]
    await reader.read(found.lease_id, keys, dests)
    assert [bytes(d) for d in dests] == blocks


async def test_rewriting_a_held_block_is_skipped_not_duplicated(node, clients) -> None:
    client = clients(node.address)
    key = BlockKey("L", 0, os.urandom(32))
    assert (await client.write([key], [b"a" * 100])).statuses == ["write"]
    assert (await client.write([key], [b"b" * 100])).statuses == ["exists"]
    found = await client.lookup([key.hash], ["L"])
    dest = bytearray(100)
    await client.read(found.lease_id, [key], [dest])
    assert dest == b"a" * 100


async def test_probe_reports_presence_without_a_lease(node, clients) -> None:
    client = clients(node.address)
    h = [os.urandom(32) for _ in range(3)]
    await client.write([BlockKey("L", 0, h[0]), BlockKey("L", 0, h[2])], [b"x", b"y"])
    assert await client.probe(h, ["L", "W"]) == {"L": [True, False, True], "W": [False, False, False]}
    stats = await client.stats()
    assert stats["leases"] == 0


async def test_destination_of_the_wrong_size_is_refused(node, clients) -> None:
    client = clients(node.address, local=False)
    key = BlockKey("L", 0, os.urandom(32))
    await client.write([key], [b"x" * 64])
    found = await client.lookup([key.hash], ["L"])
    with pytest.raises(ValueError, match="bytes for a block of 64"):
        await client.read(found.lease_id, [key], [bytearray(10)])


async def test_listener_transfers_of_back_to_back_slots_travel_in_the_fewer_messages_the_node_cut(
        node_factory, clients, monkeypatch) -> None:
    from dkv import transport

    node = node_factory("--pool", "64MiB")
    block = transport.GROUP_BYTES // 4  # large enough to travel alone, unless its neighbours lie back to back
    client = clients(node.address, local=False)
    told: dict[str, list[Any]] = {"sent": [], "received": []}
    send, receive = transport.Connection.send_payloads, transport.Connection.recv_payloads

    def message_bytes(buffers: Any, groups: Any) -> list[int]:
        sizes = [memoryview(b).nbytes for b in buffers]
        return [sum(sizes[start:end]) for start, end in transport.plan_from_groups(groups, sizes)]

    async def sending(self: Any, buffers: Any, timeout: float = 30, groups: Any = None) -> None:
        told["sent"].append(message_bytes(buffers, groups))  # the node hands each run of its slots as one view
        await send(self, buffers, timeout, groups)

    async def receiving(self: Any, buffers: Any, timeout: float = 30, landed: Any = None, groups: Any = None) -> None:
        told["received"].append(groups)
        await receive(self, buffers, timeout, landed, groups)

    monkeypatch.setattr(transport.Connection, "send_payloads", sending)
    monkeypatch.setattr(transport.Connection, "recv_payloads", receiving)
    hashes = [os.urandom(32) for _ in range(10)]
    keys = [BlockKey("L", 0, h) for h in hashes]
    blocks = [os.urandom(block) for _ in keys]
    assert (await client.write(keys, blocks)).stored == len(keys)  # one write into a fresh pool: adjacent slots
    found = await client.lookup(hashes, ["L"])
    dests = [bytearray(block) for _ in keys]
    await client.read(found.lease_id, keys, dests)
    assert [bytes(d) for d in dests] == blocks
    assert told == {"sent": [[4 * block, 4 * block, 2 * block]], "received": [[4, 4, 2]]}, (
        "four quarter-MiB slots a message, as the node cut")


@pytest.mark.parametrize("order", ["as stored", "reversed", "every other", "swapped", "twice"])
async def test_listener_reads_of_slots_in_any_order_are_bit_exact(node_factory, clients, order: str) -> None:
    """Small blocks share messages whether or not their slots lie back to back in the order asked for.

    The node sends a run of back-to-back slots as one view of its arena and
    gathers the others; either way each message carries the blocks in the
    order of the request.
    """
    node = node_factory("--pool", "64MiB")
    client = clients(node.address, local=False)
    hashes = [os.urandom(32) for _ in range(12)]
    keys = [BlockKey("L", 0, h) for h in hashes]
    blocks = [os.urandom(4096 * (1 + i % 3)) for i in range(len(keys))]  # whole pages (slots lie back to back),
    # of sizes apart, so that a block sent from the wrong slot fails its checksum
    assert (await client.write(keys, blocks)).stored == len(keys)  # adjacent slots, in this order
    picked = {"as stored": list(range(12)), "reversed": list(range(11, -1, -1)),
              "every other": list(range(0, 12, 2)), "swapped": [0, 2, 1, 3],  # from the first slot to the last
              "twice": [3, 4, 5, 3, 4, 5]}[order]  # is as far as their sizes add up to, yet not back to back
    found = await client.lookup(hashes, ["L"])
    dests = [bytearray(len(blocks[i])) for i in picked]
    await client.read(found.lease_id, [keys[i] for i in picked], dests)
    assert [bytes(d) for d in dests] == [blocks[i] for i in picked]
