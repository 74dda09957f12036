"""The connector keeps to the node's limits: a lookup names every leaf in one request, so leaves are bounded."""

from __future__ import annotations

import pytest

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
