"""The reference engine over real dKV nodes: loaded KV is bit-exact; refusals and failures are recomputed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from connector.dkv_connector import DKVConnector
from connector.engine.engine import Engine, GenerationResult
from connector.engine.hashing import block_hashes
from connector.engine.model import ModelConfig
from tests.connector.conftest import routed_hint

MODEL = ModelConfig(n_layers=4, window_layers=(1, 3), sliding_window=8, seed=11)
PROMPT = [(7 * i + 3) % MODEL.vocab for i in range(37)]  # 9 full blocks of 4 and a tail
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(connectors, node: str, *, tp: int = 1, hash_algorithm: str = "sha256",
                wrap: Callable[[DKVConnector], Any] | None = None, **conn_kwargs: Any) -> Engine:
    engine = Engine(MODEL, block_size=4, num_pages=64, tp=tp, hash_algorithm=hash_algorithm)  # type: ignore[arg-type]
    conn = connectors(node, leaves=engine.leaf_specs, blocks=engine.device_blocks, **conn_kwargs)
    engine.attach_connector(wrap(conn) if wrap else conn)
    return engine


def assert_bit_exact(result: GenerationResult, reference: GenerationResult) -> None:
    assert result.tokens == reference.tokens
    assert torch.equal(result.logits, reference.logits)


@pytest.mark.parametrize("tp,hash_algorithm", [(1, "sha256"), (2, "hash64")])
def test_kv_loaded_from_the_colocated_node_is_bit_exact(node, connectors, tp: int, hash_algorithm: str) -> None:
    first = make_engine(connectors, node.address, tp=tp, hash_algorithm=hash_algorithm)
    produced = first.generate(PROMPT, NEW_TOKENS)
    assert first.drain(20), "offloads must land"
    second = make_engine(connectors, node.address, tp=tp, hash_algorithm=hash_algorithm)
    loaded = second.generate(PROMPT, NEW_TOKENS)
    assert loaded.stats.connector_hit_blocks > 0 and loaded.stats.loaded_bytes > 0
    assert loaded.stats.refused == loaded.stats.failed == 0
    reference = second.recompute_reference(PROMPT, NEW_TOKENS)
    assert_bit_exact(loaded, reference)
    assert_bit_exact(produced, reference)


def test_kv_loaded_from_a_peer_named_by_the_hint_is_bit_exact(etcd, node_factory, connectors) -> None:
    a = node_factory(*etcd.node_args("a"))
    b = node_factory(*etcd.node_args("b"))
    cluster = {"etcd": etcd.url, "etcd_prefix": etcd.prefix}
    engine_a = make_engine(connectors, a.address, **cluster)
    engine_a.generate(PROMPT, NEW_TOKENS)
    assert engine_a.drain(20)
    engine_b = make_engine(connectors, b.address, **cluster)
    conn_b = engine_b.connector
    hashes = block_hashes(PROMPT, 4)
    loaded = engine_b.generate(PROMPT, NEW_TOKENS, hint=routed_hint(conn_b, hashes, holder="a"))
    assert loaded.stats.connector_hit_blocks > 0
    assert conn_b.counters.hits_peer >= 1
    assert_bit_exact(loaded, engine_b.recompute_reference(PROMPT, NEW_TOKENS))


class _DelayedLoads:
    """Wraps a connector: runs ``before_load`` right before each load is posted."""

    def __init__(self, inner: DKVConnector, before_load: Callable[[], None]) -> None:
        self._inner = inner
        self._before_load = before_load

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_lookup(self, *args: Any, **kwargs: Any) -> Any:
        self._before_load()
        return self._inner.load_lookup(*args, **kwargs)

    def load(self, *args: Any, **kwargs: Any) -> Any:
        self._before_load()
        return self._inner.load(*args, **kwargs)


def test_lease_expired_before_load_is_refused_and_the_engine_recomputes(node_factory, connectors) -> None:
    node = node_factory("--lease-ttl", "1")
    first = make_engine(connectors, node.address)
    first.generate(PROMPT, NEW_TOKENS)
    assert first.drain(20)
    late = make_engine(connectors, node.address, wrap=lambda c: _DelayedLoads(c, lambda: time.sleep(1.2)))
    result = late.generate(PROMPT, NEW_TOKENS)
    assert result.stats.refused == 1 and result.stats.connector_hit_blocks == 0
    assert_bit_exact(result, late.recompute_reference(PROMPT, NEW_TOKENS))


def test_peer_that_dies_mid_load_fails_the_transfer_and_the_engine_recomputes(node_factory, connectors) -> None:
    source = node_factory()
    first = make_engine(connectors, source.address)
    first.generate(PROMPT, NEW_TOKENS)
    assert first.drain(20)
    stalled = make_engine(connectors, source.address, wrap=lambda c: _DelayedLoads(c, source.pause), timeout=2.0,
                          local=False, lookup_payload_bytes=0)  # the load reads from the node
    started = time.monotonic()
    try:
        result = stalled.generate(PROMPT, NEW_TOKENS)
    finally:
        source.kill()
    assert result.stats.failed == 1, result.stats
    assert time.monotonic() - started < 30, "a dead peer costs a miss, never a stuck scheduler"
    assert_bit_exact(result, stalled.recompute_reference(PROMPT, NEW_TOKENS))


def test_a_peer_that_dies_after_sending_the_blocks_with_its_answer_costs_the_load_nothing(
        node_factory, connectors) -> None:
    source = node_factory()
    first = make_engine(connectors, source.address)
    first.generate(PROMPT, NEW_TOKENS)
    assert first.drain(20)
    late = make_engine(connectors, source.address, wrap=lambda c: _DelayedLoads(c, source.kill), timeout=2.0,
                       local=False)  # the prefix (9 blocks x 2 leaves) comes with the lookup's answer
    try:
        result = late.generate(PROMPT, NEW_TOKENS)
    finally:
        source.kill()
    assert result.stats.failed == result.stats.refused == 0, result.stats
    assert result.stats.connector_hit_blocks == 9 and result.stats.loaded_bytes > 0
    assert late.connector.counters.loads_in_place == 1
    assert_bit_exact(result, late.recompute_reference(PROMPT, NEW_TOKENS))
