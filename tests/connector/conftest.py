"""Fixtures for connector tests: connectors over CPU device tensors, shut down at teardown."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from connector.dkv_connector import DKVConnector
from connector.types import LeafSpec, full_attention, sliding_window

PAGES = 32
PAGE_BYTES = 4096
NAMESPACE = "test/conn"


def device_blocks(leaves: dict[str, LeafSpec], replicas: int = 1, pages: int = PAGES,
                  page_bytes: int = PAGE_BYTES) -> list[dict[str, list[torch.Tensor]]]:
    return [{leaf: [torch.zeros(pages, page_bytes, dtype=torch.uint8) for _ in range(spec.tp_shards)]
             for leaf, spec in leaves.items()} for _ in range(replicas)]


def two_leaves(tp: int = 1) -> dict[str, LeafSpec]:
    return {"full": full_attention(0, tp), "swa": sliding_window(1, 64, tp)}


@pytest.fixture
def connectors(node_factory) -> Iterator[Callable[..., DKVConnector]]:
    """Build connectors; every one is shut down at teardown (before nodes are checked and stopped)."""
    made: list[DKVConnector] = []

    def make(node: str, leaves: dict[str, LeafSpec] | None = None, blocks: Any = None, **kwargs: Any) -> DKVConnector:
        leaves = leaves or two_leaves()
        blocks = blocks if blocks is not None else device_blocks(leaves)
        kwargs.setdefault("namespace", NAMESPACE)
        kwargs.setdefault("timeout", 3.0)
        conn = DKVConnector(leaves, blocks, node=node, **kwargs)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.shutdown()


def routed_hint(conn: DKVConnector, hashes: Sequence[bytes], *, holder: str | None = None, depth: int | None = None,
                bound: float = 30.0) -> bytes:
    """The hint once ``conn``'s router routes ``depth`` (default: all) of ``hashes`` to a peer (``holder``, if named)."""
    assert conn._router is not None  # noqa: SLF001 - the connector's own directory index
    want = len(hashes) if depth is None else depth
    deadline = time.monotonic() + bound
    while True:
        route = conn._router.route(conn.namespace, hashes)  # noqa: SLF001
        if route.peer is not None and route.depth >= want and holder in (None, route.peer.node_id):
            return route.hint.encode()
        assert time.monotonic() < deadline, f"the router never routed {want} blocks to {holder or 'a peer'}"
        time.sleep(0.05)
