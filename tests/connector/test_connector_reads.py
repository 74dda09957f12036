"""The connector's loads hold their bytes whatever happens to their lease (real node processes).

An engine calls lookup -> load -> lookup on one replica: the second lookup ends
the first one's lease on the node while the load may still be reading. With
another engine refilling the pool at once, every load must deliver exactly
the bytes that were offloaded, or fail with ``KVLoadFailed`` — never another
block's bytes.
"""

from __future__ import annotations

import os

import pytest
import torch

from connector.types import KVLoadFailed, full_attention
from dkv.keys import BlockKey
from tests.connector.conftest import NAMESPACE, device_blocks
from tests.connector.test_connector import wait

BLOCK = 4 * 2**20
PAGES = 8
ROUNDS = 6


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
async def test_load_then_next_lookup_on_one_replica_never_delivers_other_bytes(node_factory, clients, connectors,
                                                                               local: bool) -> None:
    node = node_factory("--pool", "64MiB")
    leaves = {"full": full_attention(0)}
    writer_blocks = device_blocks(leaves, pages=PAGES + 1, page_bytes=BLOCK)
    writer = connectors(node.address, leaves=leaves, blocks=writer_blocks, timeout=10.0)
    reader_blocks = device_blocks(leaves, pages=PAGES + 1, page_bytes=BLOCK)
    reader = connectors(node.address, leaves=leaves, blocks=reader_blocks, timeout=10.0, local=local)
    filler = clients(node.address, namespace=NAMESPACE, local=False)
    ids = list(range(1, PAGES + 1))  # row 0 is the null page
    outcomes = []
    for round_ in range(ROUNDS):
        hashes = [os.urandom(32) for _ in ids]
        writer_blocks[0]["full"][0][1:].copy_(torch.randint(0, 256, (PAGES, BLOCK), dtype=torch.uint8))
        wait(writer.offload({"full": ids}, {"full": hashes}))
        assert reader.lookup(hashes)["full"] == [True] * PAGES
        transfer = reader.load({"full": ids}, {"full": hashes})
        reader.lookup([os.urandom(32)])  # ends the load's lease on the node
        fill = [BlockKey("full", 0, os.urandom(32)) for _ in range(16)]
        await filler.write(fill, [bytes([round_]) * BLOCK] * len(fill))
        try:
            wait(transfer)
        except KVLoadFailed:
            outcomes.append("failed")
            continue
        same = torch.equal(reader_blocks[0]["full"][0][1:], writer_blocks[0]["full"][0][1:])
        outcomes.append("exact" if same else "OTHER BYTES")
    assert "OTHER BYTES" not in outcomes, f"loads delivered another block's bytes: {outcomes}"
