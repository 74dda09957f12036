"""The client keeps to the limits the node announces: splits what it may, refuses before sending what it may not."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dkv.keys import BlockKey
from dkv.wire import MAX_FRAME, MAX_KEYS, MAX_LEAVES

OVER = MAX_KEYS + 7  # hashes: more than one request may carry


def _hashes(n: int, length: int = 8) -> list[bytes]:
    # distinct and cheap: a counter, not urandom (65 k of them)
    return [i.to_bytes(length, "big") for i in range(1, n + 1)]


async def _ops(client, op: str) -> int:
    return (await client.stats())["ops"].get(op, 0)


async def _errors(client) -> dict[str, int]:
    return (await client.stats())["errors"]


async def test_the_node_announces_max_leaves_beside_max_keys_and_max_frame(node, clients) -> None:
    client = clients(node.address)
    info = await client.connect()
    assert info.limits["max_leaves"] == MAX_LEAVES
    assert (info.limits["max_keys"], info.limits["max_frame"]) == (MAX_KEYS, MAX_FRAME)
    assert client.limit("max_leaves") == MAX_LEAVES


async def test_probe_of_more_hashes_than_max_keys_is_split(node_factory, clients) -> None:
    node = node_factory("--max-cost", str(OVER))  # max_keys is what splits here (max_cost: test_node_exhaustion)
    client = clients(node.address)
    hashes = _hashes(OVER)
    held = [0, MAX_KEYS - 1, MAX_KEYS, OVER - 1]  # both sides of the split
    await client.write([BlockKey("L", 0, hashes[i]) for i in held], [b"x"] * len(held))
    before = await _ops(client, "probe")
    masks = await client.probe(hashes, ["L"])
    assert [i for i, present in enumerate(masks["L"]) if present] == held
    assert len(masks["L"]) == OVER
    assert await _ops(client, "probe") - before == 2
    assert await _errors(client) == {}


async def test_probe_of_more_hashes_than_one_frame_holds_is_split(node, clients) -> None:
    client = clients(node.address)
    await client.connect()
    client.info.limits["max_frame"] = 16 * 1024  # a node that takes smaller frames than the wire allows
    hashes = [os.urandom(32) for _ in range(1500)]  # ~51 KiB of hashes: four frames of 16 KiB at least
    await client.write([BlockKey("L", 0, hashes[i]) for i in (0, 1499)], [b"x", b"y"])
    before = await _ops(client, "probe")
    masks = await client.probe(hashes, ["L"])
    assert [i for i, present in enumerate(masks["L"]) if present] == [0, 1499]
    assert await _ops(client, "probe") - before >= 4


async def test_probe_over_max_leaves_is_split_by_leaves(node, clients) -> None:
    client = clients(node.address)
    leaves = [f"leaf{i}" for i in range(MAX_LEAVES + 3)]
    hashes = _hashes(3)
    await client.write([BlockKey(leaves[0], 0, hashes[0]), BlockKey(leaves[-1], 0, hashes[2])], [b"a", b"b"])
    masks = await client.probe(hashes, leaves)
    assert set(masks) == set(leaves)
    assert masks[leaves[0]] == [True, False, False]
    assert masks[leaves[-1]] == [False, False, True]
    assert all(masks[leaf] == [False] * 3 for leaf in leaves[1:-1])
    assert await _errors(client) == {}


async def test_unleased_lookup_of_more_hashes_than_max_keys_is_split(node, clients) -> None:
    client = clients(node.address)
    hashes = _hashes(OVER)
    await client.write([BlockKey("L", 0, hashes[-1])], [b"x"])
    found = await client.lookup(hashes, ["L"], lease=False)
    assert found.lease_id is None
    assert [i for i, present in enumerate(found.masks["L"]) if present] == [OVER - 1]


async def test_touch_of_more_hashes_than_max_keys_is_split(node_factory, clients) -> None:
    node = node_factory("--max-cost", str(OVER))  # max_keys is what splits here (max_cost: test_node_exhaustion)
    client = clients(node.address)
    hashes = _hashes(OVER)
    held = [0, MAX_KEYS, OVER - 1]
    await client.write([BlockKey("L", 0, hashes[i]) for i in held], [b"x"] * len(held))
    before = await _ops(client, "touch")
    assert await client.touch(hashes, ["L"]) == len(held)
    assert await _ops(client, "touch") - before == 2
    assert await _errors(client) == {}


async def test_split_touch_still_evicts_its_chain_deepest_first_and_root_last(node_factory, clients) -> None:
    block, slots = 64 * 1024, 16
    node = node_factory(pool=str(slots * block))
    client = clients(node.address)
    await client.connect()
    client.info.limits["max_keys"] = 2  # the chain of 4 takes two touches
    chain = [os.urandom(32) for _ in range(4)]
    await client.write([BlockKey("L", 0, h) for h in chain], [np.ones(block, np.uint8)] * 4)
    await client.write([BlockKey("O", 0, os.urandom(32)) for _ in range(4)], [np.ones(block, np.uint8)] * 4)
    before = await _ops(client, "touch")
    assert await client.touch(chain, ["L"]) == 4
    assert await _ops(client, "touch") - before == 2
    gone: list[int] = []
    for _ in range(slots + 4):
        await client.write([BlockKey("F", 0, os.urandom(32))], [np.zeros(block, np.uint8)])
        mask = (await client.probe(chain, ["L"]))["L"]
        gone += [i for i, present in enumerate(mask) if not present and i not in gone]
    assert gone == [3, 2, 1, 0], "a split touch must not leave the root's run older than the rest of its chain"


async def test_leased_lookup_of_more_hashes_than_max_keys_is_refused_before_sending(node, clients) -> None:
    client = clients(node.address)
    await client.connect()
    before = await _ops(client, "lookup")
    with pytest.raises(ValueError, match="max_keys"):
        await client.lookup(_hashes(OVER), ["L"])
    assert await _ops(client, "lookup") == before
    assert await _errors(client) == {}
    assert (await client.stats())["leases"] == 0


async def test_lookup_over_max_leaves_is_refused_before_sending(node, clients) -> None:
    client = clients(node.address)
    await client.connect()
    before = await _ops(client, "lookup")
    with pytest.raises(ValueError, match="max_leaves"):
        await client.lookup(_hashes(4), [f"leaf{i}" for i in range(MAX_LEAVES + 1)])
    assert await _ops(client, "lookup") == before
    assert await _errors(client) == {}
    # within the limits it still goes through, on the same client
    await client.write([BlockKey("leaf0", 0, _hashes(1)[0])], [b"x"])
    found = await client.lookup(_hashes(4), [f"leaf{i}" for i in range(MAX_LEAVES)])
    assert len(found.masks) == MAX_LEAVES and found.masks["leaf0"] == [True, False, False, False]
    assert found.lease_id is not None
    await client.release(found.lease_id)


async def test_leased_lookup_over_the_announced_max_frame_is_refused_before_sending(node, clients) -> None:
    client = clients(node.address)
    await client.connect()
    client.info.limits["max_frame"] = 4096
    before = await _ops(client, "lookup")
    with pytest.raises(ValueError, match="max_frame"):
        await client.lookup([os.urandom(32) for _ in range(500)], ["L"])
    assert await _ops(client, "lookup") == before


def test_chunks_are_bounded_by_count_and_by_bytes() -> None:
    from dkv.client import chunk_ranges

    assert chunk_ranges(0, max_count=4, max_bytes=100, item_bytes=10) == [range(0)]
    assert chunk_ranges(10, max_count=4, max_bytes=1000, item_bytes=10) == [range(0, 4), range(4, 8), range(8, 10)]
    assert chunk_ranges(10, max_count=100, max_bytes=50, item_bytes=10, fixed_bytes=20) == [
        range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
    sizes = [10, 30, 10, 10, 40, 5]
    ranges = chunk_ranges(len(sizes), max_count=3, max_bytes=50, item_bytes=sizes)
    assert ranges == [range(0, 3), range(3, 5), range(5, 6)]
    assert all(len(r) <= 3 and sum(sizes[i] for i in r) <= 50 for r in ranges)
    with pytest.raises(ValueError, match="max_frame"):
        chunk_ranges(1, max_count=4, max_bytes=50, item_bytes=60)
