"""The MAX factory adapter: MAX's shapes in, a working DKVConnector out (and MAX itself when installed)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import pytest
import torch

from connector.dkv_connector import DKVConnector
from connector.max_adapter import create_connector, namespace_for


@dataclass
class FakeMemory:  # MAX's KVCacheMemory: one buffer per TP shard
    buffers: list
    replicated: bool = False


@dataclass
class FakeConfig:
    block_store_endpoint: str
    type: str = "dkv"


@dataclass
class FakeParams:
    kv_connector_config: FakeConfig
    dtype: str = "bfloat16"
    page_size: int = 16
    num_layers: int = 2
    head_dim: int = 64
    n_kv_heads: int = 4
    extra: dict = field(default_factory=dict)


def test_factory_views_dlpack_buffers_without_copy_and_round_trips(node) -> None:
    pages, page_bytes = 8, 1024
    # numpy arrays export DLPack like MAX's buffers do
    shard_buffers = [[torch.zeros(pages, page_bytes, dtype=torch.uint8).numpy() for _ in range(2)] for _ in range(2)]
    memory = [{"full": FakeMemory(shard_buffers[r])} for r in range(2)]
    params = FakeParams(FakeConfig(node.address))
    conn = create_connector({"full": 0}, [], memory, params, pages * page_bytes)
    try:
        assert isinstance(conn, DKVConnector) and conn.leaves == {"full": 0}
        view = conn._blocks[1]["full"][0]
        view[3].fill_(42)
        assert shard_buffers[1][0][3][0] == 42, "the connector must view MAX's memory, not a copy"
        h = os.urandom(8)
        t = conn.offload({"full": [3]}, {"full": [h]}, replica_idx=1)
        deadline = time.monotonic() + 20
        while not t.is_complete():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        masks = conn.lookup([h], replica_idx=0)
        assert masks == {"full": [True]} and all(type(b) is bool for b in masks["full"])
        t = conn.load({"full": [5]}, {"full": [h]}, replica_idx=0)
        while not t.is_complete():
            time.sleep(0.002)
        assert (shard_buffers[0][0][5] == 42).all() and (shard_buffers[0][1][5] == 0).all()
    finally:
        conn.shutdown()


def test_namespace_follows_the_layout_of_the_params() -> None:
    a = namespace_for(FakeParams(FakeConfig("x")))
    b = namespace_for(FakeParams(FakeConfig("x"), dtype="float8"))
    assert a != b and a.startswith("max/")


def test_drives_max_own_manager_when_max_is_installed() -> None:
    try:
        import max.pipelines.kv_cache  # noqa: F401
    except ImportError:
        print("skipped: Modular MAX (package max) is not installed here; the adapter is exercised above "
              "with MAX-shaped inputs")
        pytest.skip("Modular MAX (package max) is not installed")
    from connector.max_adapter import install

    assert install(), "MAX's connector factory was not found to patch"
