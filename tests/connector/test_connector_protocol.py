"""The protocol, sentence by sentence, and the node's lease budget (real node processes, real etcd).

Each test names the sentence of the seed protocol (or the budget rule) it holds
the connector to.
"""

from __future__ import annotations

import asyncio

import json
import time

import pytest
import torch

from connector.types import ByteCount, CompletedTransfer, KVLoadRefused, full_attention, sliding_window
from dkv.hints import MISMATCH
from tests.conftest import wait_for_stats
from tests.connector.conftest import device_blocks, routed_hint, two_leaves
from tests.connector.test_connector import answered, chain, fill, offload_chain, wait

MAX_LEASES = 4


# ---- the node's lease budget ------------------------------------------------------------------


def _offloaded_and_a_reader(node, connectors):
    """A writer offloads a 2-block chain; returns its rows, a reader's rows, the hashes and the reader."""
    src = device_blocks(two_leaves())
    offload_chain(connectors(node.address, blocks=src), src, hashes := chain(2))
    dst = device_blocks(two_leaves())
    return src, dst, hashes, connectors(node.address, blocks=dst)


def test_handles_beyond_the_nodes_lease_budget_are_misses_never_broken_loads(node_factory, connectors) -> None:
    """More outstanding handles than ``--max-leases``: the node would end the oldest lease silently."""
    node = node_factory("--max-leases", str(MAX_LEASES))
    src, dst, hashes, reader = _offloaded_and_a_reader(node, connectors)
    handles = [reader.start_lookup(hashes) for _ in range(MAX_LEASES + 3)]
    answers = [answered(h)["full"] for h in handles]
    assert answers.count([True, True]) == MAX_LEASES, f"exactly the budget is leased: {answers}"
    loaded = 0
    for handle, found in zip(handles, answers):
        if found != [True, True]:
            reader.abandon_lookup(handle)
            continue
        wait(reader.load_lookup(handle, {"full": [5, 6]}, {"full": hashes}))  # never KVLoadFailed
        loaded += 1
    assert loaded == MAX_LEASES
    assert torch.equal(dst[0]["full"][0][5:7], src[0]["full"][0][1:3])
    assert reader.counters.lookups_over_lease_budget == 3
    # the budget comes back as leases end: the next handles are leased again
    again = reader.start_lookup(hashes)
    assert answered(again)["full"] == [True, True]
    reader.abandon_lookup(again)


async def test_load_whose_lease_the_node_no_longer_honours_is_refused_before_anything_moves(node_factory,
                                                                                           connectors) -> None:
    """Every connection of the reader dropped (a network blip): the node ended its leases. Refuse, do not post."""
    node = node_factory("--lease-ttl", "30")
    src, dst, hashes, reader = _offloaded_and_a_reader(node, connectors)
    handle = reader.start_lookup(hashes)
    assert answered(handle)["full"] == [True, True]

    async def drop_connections() -> None:
        client = reader._clients[node.address]  # noqa: SLF001 - what a blip does to every connection
        # the lookup asked for a direct channel in the background: one still opening at the blip would connect
        # after it, and a client with a connection open keeps its leases (a race CI's load once lost)
        opening = client._direct_opening  # noqa: SLF001
        if opening is not None:
            await asyncio.wait([opening], timeout=10)
        for session in list(client._sessions):  # noqa: SLF001 - the pool's, and the direct channel the lookup used
            session.conn.abort()

    reader._loop.run(drop_connections(), 10)  # noqa: SLF001
    assert (await wait_for_stats(node.address, lambda s: s["leases"] == 0))["leases"] == 0
    with pytest.raises(KVLoadRefused) as refused:
        reader.load_lookup(handle, {"full": [5, 6]}, {"full": hashes})
    assert refused.value.leaf_id == "full" and refused.value.block_hash == hashes[0]
    assert int(dst[0]["full"][0][5:7].sum()) == 0


# ---- the protocol's sentences -----------------------------------------------------------------


def test_offload_that_moves_nothing_returns_a_completed_transfer_pinned_nowhere(node, connectors) -> None:
    """"An offload that moved nothing returns a CompletedTransfer and is pinned nowhere.\""""
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(4)
    offload_chain(conn, blocks, hashes[:2])
    conn.take_metrics()
    again = conn.offload({"full": [1, 2]}, {"full": hashes[:2]})
    assert isinstance(again, CompletedTransfer) and not again.g0_blocks_per_leaf
    # half known, half new: only the new rows are pinned, only their bytes counted
    for leaf in blocks[0]:
        fill(blocks, leaf, [3, 4], seed=9)
    half = conn.offload({"full": [1, 2, 3, 4]}, {"full": hashes})
    assert dict(half.g0_blocks_per_leaf) == {"full": [3, 4]}
    wait(half)
    page = blocks[0]["full"][0].shape[1]
    assert conn.take_metrics().d2h_bytes_copied == 2 * page


async def test_offload_counts_only_the_bytes_the_node_took(node, connectors, clients) -> None:
    """Blocks another engine stored meanwhile (``exists``) are not D2H bytes of this offload."""
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    other = connectors(node.address, blocks=device_blocks(two_leaves()))
    hashes = chain(3)
    wait(other.offload({"full": [1]}, {"full": hashes[:1]}))
    conn.take_metrics()
    wait(conn.offload({"full": [1, 2, 3]}, {"full": hashes}))
    page = blocks[0]["full"][0].shape[1]
    assert conn.take_metrics().d2h_bytes_copied == 2 * page


def test_load_refused_for_an_expired_lease_names_a_leaf_and_a_block(node_factory, connectors) -> None:
    node = node_factory("--lease-ttl", "1")
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(2)
    offload_chain(conn, blocks, hashes)
    reader = connectors(node.address)
    handle = reader.start_lookup(hashes)
    answered(handle)
    time.sleep(1.5)
    with pytest.raises(KVLoadRefused) as refused:
        reader.load_lookup(handle, {"full": [3, 4]}, {"full": hashes})
    assert refused.value.leaf_id == "full" and refused.value.block_hash == hashes[0]


def test_probe_answers_leaf_by_leaf_as_lookup_does(etcd, node_factory, connectors) -> None:
    """A windowed leaf that holds 2 of 6 blocks must not be priced as holding all 6."""
    (a,) = [node_factory(*etcd.node_args("w"))]
    leaves = {"full": full_attention(0), "swa": sliding_window(1, 8)}
    blocks = device_blocks(leaves)
    conn = connectors(a.address, leaves=leaves, blocks=blocks, etcd=etcd.url, etcd_prefix=etcd.prefix)
    hashes = chain(6)
    for leaf in leaves:
        fill(blocks, leaf, list(range(1, 7)), seed=3)
    wait(conn.offload({"full": list(range(1, 7)), "swa": [5, 6]}, {"full": hashes, "swa": hashes[4:]}))
    routed_hint(conn, hashes)
    looked_up = conn.lookup(hashes)
    assert looked_up["swa"] == [False] * 4 + [True] * 2
    answers = conn.probe(hashes, [0])
    assert answers is not None
    for leaf, mask in answers[0].items():
        assert list(mask) == looked_up[leaf], f"probe's {leaf} answer differs from lookup's"
    assert "full" in answers[0]


def test_host_byte_count_is_the_nodes_from_construction(node, connectors) -> None:
    conn = connectors(node.address)
    host = conn.host_byte_count
    assert isinstance(host, ByteCount) and host.total == 64 * 2**20, "not 0 of 0 until a refresh"


def test_kvlookup_is_exported_beside_the_other_protocol_types() -> None:
    from connector import types

    assert hasattr(types, "KVLookup") and "KVLookup" in types.__all__


def test_hint_whose_peer_holds_less_than_the_device_is_not_a_rejected_hint(etcd, node_factory, connectors) -> None:
    a, b = (node_factory(*etcd.node_args(i)) for i in ("a", "b"))
    src = device_blocks(two_leaves())
    engine_a = connectors(a.address, blocks=src, etcd=etcd.url, etcd_prefix=etcd.prefix)
    hashes = chain(6)
    offload_chain(engine_a, src, hashes[:3])
    engine_b = connectors(b.address, etcd=etcd.url, etcd_prefix=etcd.prefix)
    hint = routed_hint(engine_b, hashes, depth=3)  # the router saw the whole request: 6 blocks
    engine_b.take_metrics()
    engine_b.lookup(hashes[4:], hint=hint)  # the device already holds blocks 0..3
    assert engine_b.counters.unusable_hints[MISMATCH] == 0
    assert engine_b.counters.hints_behind_device == 1
    metrics = engine_b.take_metrics()
    assert getattr(metrics, "dkv_hints_rejected", 0) == 0
    assert json.loads(hint)["actions"][0]["payload"]["dkv"]["blocks"] == 6

