"""The connector keeps to the node's limits: a lookup names every leaf in one request, so leaves are bounded."""

from __future__ import annotations

import pytest
import torch

from connector.types import full_attention
from dkv.wire import MAX_LEAVES
from tests.connector.conftest import device_blocks


def test_more_leaves_than_the_node_accepts_are_refused_by_the_constructor(node, connectors) -> None:
    leaves = {f"leaf{i}": full_attention(i) for i in range(MAX_LEAVES + 1)}
    with pytest.raises(ValueError, match="max_leaves"):
        connectors(node.address, leaves, device_blocks(leaves, pages=2, page_bytes=64))


def test_as_many_leaves_as_the_node_accepts_are_fine(node, connectors) -> None:
    leaves = {f"leaf{i}": full_attention(i) for i in range(MAX_LEAVES)}
    conn = connectors(node.address, leaves, device_blocks(leaves, pages=2, page_bytes=64))
    masks = conn.lookup([b"\x01" * 8])
    assert masks == {leaf: [False] for leaf in leaves}


def test_a_lookup_longer_than_one_lease_may_cover_reports_its_prefix_and_misses_the_rest(node_factory,
                                                                                         connectors) -> None:
    from tests.connector.conftest import two_leaves
    from tests.connector.test_connector import answered, chain, offload_chain, wait

    node = node_factory("--max-cost", "64")  # 2 leaves x 1 shard: one lease covers 32 hashes
    blocks = device_blocks(two_leaves(), pages=80)
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(34)
    offload_chain(conn, blocks, hashes)
    assert conn.lookup(hashes)["full"] == [True] * 32 + [False] * 2
    handle = conn.start_lookup(hashes)
    assert answered(handle)["full"] == [True] * 32 + [False] * 2
    wait(conn.load_lookup(handle, {"full": list(range(40, 72))}, {"full": hashes[:32]}))
    assert torch.equal(blocks[0]["full"][0][40:72], blocks[0]["full"][0][1:33])
    assert conn.counters.lookups_truncated == 2


def test_an_engine_that_never_polls_transfers_keeps_a_bounded_book_of_them(node, connectors, monkeypatch) -> None:
    import connector.worker_side as worker_side
    from tests.connector.test_connector import chain, offload_chain

    booked = 8
    monkeypatch.setattr(worker_side, "MAX_BOOKED", booked, raising=False)  # 1 024 in service
    conn = connectors(node.address)
    blocks = conn._blocks  # noqa: SLF001 - the connector's own device rows
    for _ in range(5 * booked):  # each waited until it settled, and never polled
        offload_chain(conn, blocks, chain(1))
    kept = len(conn._worker.transfers)  # noqa: SLF001
    assert kept <= booked, f"{kept} settled transfers kept for an engine that never polls (bound {booked})"
