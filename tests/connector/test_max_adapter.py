"""The MAX factory adapter: MAX's shapes in, a working DKVConnector out (and MAX itself when installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from connector.dkv_connector import DKVConnector
from connector.max_adapter import create_connector, namespace_for, view_buffer
from tests.connector.conftest import routed_hint


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


@pytest.mark.parametrize(("setting", "interval"), [(None, 0.0005), ("0.0002", 0.0002), ("off", 0.005)])
def test_the_factory_takes_the_gil_switch_interval_from_the_environment(node, monkeypatch, setting, interval) -> None:
    """DKV_GIL_SWITCH_INTERVAL: unset, the connector's default; seconds; or off (the interpreter's left alone)."""
    if setting is None:
        monkeypatch.delenv("DKV_GIL_SWITCH_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("DKV_GIL_SWITCH_INTERVAL", setting)
    found = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    memory = [{"full": FakeMemory([torch.zeros(4, 1024, dtype=torch.uint8).numpy()])}]
    try:
        conn = create_connector({"full": 0}, [], memory, FakeParams(FakeConfig(node.address)), 4 * 1024)
        try:
            assert sys.getswitchinterval() == pytest.approx(interval)
        finally:
            conn.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005), "the shutdown puts the interval back"
    finally:
        sys.setswitchinterval(found)


def test_a_garbled_gil_switch_interval_in_the_environment_is_refused(node, monkeypatch) -> None:
    from dkv.errors import ConfigError

    monkeypatch.setenv("DKV_GIL_SWITCH_INTERVAL", "fast")
    memory = [{"full": FakeMemory([torch.zeros(4, 1024, dtype=torch.uint8).numpy()])}]
    with pytest.raises(ConfigError, match="DKV_GIL_SWITCH_INTERVAL='fast'"):
        create_connector({"full": 0}, [], memory, FakeParams(FakeConfig(node.address)), 4 * 1024)


def test_namespace_follows_the_layout_of_the_params() -> None:
    a = namespace_for(FakeParams(FakeConfig("x")))
    b = namespace_for(FakeParams(FakeConfig("x"), dtype="float8"))
    assert a != b and a.startswith("max/")


# ---- Modular MAX's own KV cache manager (only where the package ``max`` is installed) ---------------------------

PAGE_TOKENS = 16
PROMPT_TOKENS = 5 * PAGE_TOKENS + 7  # five full pages and a partial one


@pytest.fixture(scope="module")
def max_kv():
    """MAX's KV cache modules with dKV installed as its ``dkv`` connector; skips with a printed reason without MAX."""
    try:
        from max.driver import CPU  # noqa: F401
        from max.pipelines.kv_cache import JengaKVCacheManager  # noqa: F401
    except ImportError as exc:
        reason = f"Modular MAX (package max) is not installed here ({exc}); install it with pip install -e .[max]"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    from connector.max_adapter import install

    assert install(), "MAX's connector factory was not found to patch"
    import max.pipelines.kv_cache as kv

    return kv


def max_manager(node_address: str):
    """MAX's Jenga KV cache manager on the CPU, configured with connector type ``dkv`` at ``node_address``."""
    from max.dtype import DType
    from max.graph import DeviceRef
    from max.nn.kv_cache import MHAKVCacheParams
    from max.nn.kv_cache.cache_params import KVConnectorType, NullKVConnectorConfig
    from max.pipelines.kv_cache import JengaKVCacheManager

    params = MHAKVCacheParams(
        dtype=DType.float32, n_kv_heads=2, head_dim=16, num_layers=2, page_size=PAGE_TOKENS,
        devices=[DeviceRef.CPU()], enable_prefix_caching=True,
        kv_connector_config=NullKVConnectorConfig(type=KVConnectorType.dkv, block_store_endpoint=node_address),
    )
    return JengaKVCacheManager.create(params=params, available_bytes=8 << 20, max_batch_size=2, max_seq_len=256)


def request(hint: bytes | None = None):
    import numpy as np
    from max.pipelines.context import TextContext, TokenBuffer

    tokens = np.arange(1000, 1000 + PROMPT_TOKENS, dtype=np.int64)
    return TextContext(max_length=1024, tokens=TokenBuffer(tokens), dkv_cache_hint=hint)


def device_rows(manager, ctx) -> dict[str, list[torch.Tensor]]:
    """Per leaf, the request's device rows of every TP shard, viewed through DLPack."""
    memory = manager.get_device_buffer(0).to_memory()
    blocks = manager.get_req_blocks_per_leaf(ctx)
    return {leaf: [torch.from_dlpack(shard)[ids] for shard in memory[leaf].buffers]
            for leaf, ids in blocks.items()}


def drain(manager) -> None:
    deadline = time.monotonic() + 30
    while manager.pending_transfers_exist(0):
        assert time.monotonic() < deadline, "MAX's manager still has transfers in flight"
        manager.poll_transfers()
        time.sleep(0.005)


def serve_prompt(manager, ctx, *, write_kv: bool) -> None:
    """One request through MAX's manager: claim, alloc (lookup + load), forward, commit, next forward (offload)."""
    manager.claim(ctx)
    manager.alloc(ctx)
    drain(manager)
    manager.runtime_inputs([[ctx]])
    if write_kv:  # the "model" writes real-looking KV into every row it was handed
        memory = manager.get_device_buffer(0).to_memory()
        generator = torch.Generator().manual_seed(7)
        for leaf, ids in manager.get_req_blocks_per_leaf(ctx).items():
            for shard in memory[leaf].buffers:
                view = torch.from_dlpack(shard)
                view[ids] = torch.randint(0, 256, (len(ids), view.shape[1]), dtype=torch.uint8, generator=generator)
    ctx.update(5)
    manager.step(ctx)
    manager.alloc(ctx)
    manager.runtime_inputs([[ctx]])  # MAX posts the offloads of what the last step committed here
    drain(manager)


def wait_offloaded(manager, blocks: int) -> None:
    deadline = time.monotonic() + 30
    while manager._connector.counters.blocks_offloaded < blocks:  # noqa: SLF001 - the transfer settles off-thread
        assert time.monotonic() < deadline, "engine A's offload never reached the node"
        time.sleep(0.01)


def test_max_buffers_are_viewed_by_torch_without_a_copy(max_kv) -> None:
    from max.driver import CPU, Buffer
    from max.dtype import DType

    buffer = Buffer.zeros(shape=(4, 64), dtype=DType.uint8, device=CPU())
    view_buffer(buffer)[2, 5] = 99
    assert buffer.to_numpy()[2, 5] == 99, "a write through the torch view must land in MAX's own buffer"


FULL_PAGES = PROMPT_TOKENS // PAGE_TOKENS


def offload_a_prompt(engine) -> tuple[object, dict[str, list[torch.Tensor]]]:
    """Engine A serves the prompt, writes its KV and offloads it; returns the request and its full pages' bytes."""
    ctx = request()
    serve_prompt(engine, ctx, write_kv=True)
    wait_offloaded(engine, FULL_PAGES)
    written = {leaf: [rows[:FULL_PAGES].clone() for rows in shards] for leaf, shards in device_rows(engine, ctx).items()}
    return ctx, written


def load_the_prompt(engine, written: dict[str, list[torch.Tensor]], hint: bytes | None = None):
    """Engine B admits the same prompt, which MAX loads through the connector; its rows must hold ``written``."""
    ctx = request(hint=hint)
    engine.claim(ctx)
    engine.alloc(ctx)
    drain(engine)
    metrics = engine.take_metrics_aggregated()
    assert metrics.cache_tokens == FULL_PAGES * PAGE_TOKENS, "engine B must take the whole prefix from dKV"
    assert metrics.h2d_bytes_copied > 0 and metrics.connector_load_failures == 0
    loaded = device_rows(engine, ctx)
    for leaf, shards in written.items():
        for shard, rows in enumerate(shards):
            assert torch.equal(loaded[leaf][shard][:FULL_PAGES], rows), f"{leaf} shard {shard}: bytes differ"
    return ctx, metrics


def test_max_manager_loads_the_prefix_another_manager_offloaded_and_holds_its_exact_bytes(max_kv, node) -> None:
    engine_a, engine_b = max_manager(node.address), max_manager(node.address)
    try:
        from max.nn.kv_cache.metrics import KVCacheMetrics
        from max.pipelines.kv_cache import ByteCount
        from max.pipelines.kv_cache.kv_connector import KVConnector

        connector = engine_a._connector  # noqa: SLF001 - built by MAX's own factory call
        assert isinstance(connector, DKVConnector) and isinstance(connector, KVConnector)
        assert type(connector.take_metrics()) is KVCacheMetrics and type(connector.metrics) is KVCacheMetrics
        assert type(connector.host_byte_count) is ByteCount and type(engine_a.disk_byte_count()) is ByteCount
        first, written = offload_a_prompt(engine_a)
        second, metrics = load_the_prompt(engine_b, written)
        assert metrics.dkv_peer_loads == 0
        engine_a.release(first)
        engine_b.release(second)
    finally:
        engine_a.shutdown()
        engine_b.shutdown()


def test_max_manager_loads_from_the_peer_its_hint_names_bit_exact(max_kv, etcd, node_factory, monkeypatch) -> None:
    from max.pipelines.kv_cache.paged_kv_cache._common import compute_block_hashes

    a = node_factory(*etcd.node_args("a"))
    b = node_factory(*etcd.node_args("b"))
    monkeypatch.setenv("DKV_ETCD", etcd.url)
    monkeypatch.setenv("DKV_ETCD_PREFIX", etcd.prefix)
    engine_a, engine_b = max_manager(a.address), max_manager(b.address)
    try:
        first, written = offload_a_prompt(engine_a)
        connector_b = engine_b._connector  # noqa: SLF001
        hashes = compute_block_hashes(request(), [], PAGE_TOKENS, engine_b.params.kv_hash_algo,
                                      engine_b.params.kv_hash_seed)
        hint = routed_hint(connector_b, hashes, holder="a", depth=FULL_PAGES)
        second, metrics = load_the_prompt(engine_b, written, hint=hint)
        assert metrics.dkv_peer_loads == 1
        engine_a.release(first)
        engine_b.release(second)
    finally:
        engine_a.shutdown()
        engine_b.shutdown()


def test_max_manager_serves_a_garbled_hint_as_a_counted_miss(max_kv, node) -> None:
    engine = max_manager(node.address)
    try:
        ctx = request(hint=b"{not json")
        engine.claim(ctx)
        engine.alloc(ctx)
        drain(engine)
        metrics = engine.take_metrics_aggregated()
        assert metrics.cache_tokens == 0 and metrics.dkv_hints_rejected == 1
        assert sum(metrics.dkv_hints_rejected_by_reason.values()) == 1
        engine.release(ctx)
    finally:
        engine.shutdown()


def test_without_max_the_connector_raises_and_returns_dkvs_own_protocol_types(node) -> None:
    script = Path(__file__).with_name("without_max.py")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script), node.address], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr


def test_a_child_python_started_after_the_connector_imported_max_keeps_its_environment() -> None:
    import connector.types  # noqa: F401 - imports MAX where it is installed, whose runtime edits the C environment

    done = subprocess.run([sys.executable, "-c", "import sys, typer, tenacity; print(sys.prefix)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == sys.prefix, "the child Python must run in this process's environment"
