"""The reference engine driving a dictionary-backed fake connector: loads are bit-exact, failures recompute."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from connector.engine import (
    FULL_LEAF,
    PROTOCOL_MEMBERS,
    SWA_LEAF,
    Connector,
    Engine,
    ModelConfig,
    NullConnector,
    TinyTransformer,
    block_hashes,
)
from connector.types import ByteCount, CompletedTransfer, KVCacheMetrics, KVLoadFailed, KVLoadRefused, LeafSpec

Key = tuple[Any, ...]


class _Polled:
    """Completes on its ``polls``-th ``is_complete()``; runs ``on_complete`` then (or raises ``fail``)."""

    def __init__(self, polls: int, on_complete: Any = None, fail: Any = None,
                 g0: Mapping[str, Sequence[int]] | None = None) -> None:
        self._left = polls
        self._on_complete = on_complete
        self._fail = fail
        self._done = False
        self._g0 = dict(g0 or {})

    @property
    def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
        return self._g0

    def is_complete(self) -> bool:
        if self._done:
            if self._fail is not None:
                raise KVLoadFailed("copy failed")
            return True
        self._left -= 1
        if self._left > 0:
            return False
        self._done = True
        if self._fail is not None:
            self._fail()
            raise KVLoadFailed("copy failed")
        if self._on_complete is not None:
            self._on_complete()
        return True

    def synchronize(self) -> None:
        while not self._done:
            try:
                self.is_complete()
            except KVLoadFailed:
                return

    # a lookup handle is the same machine with a result
    def result(self) -> Mapping[str, Sequence[bool]]:
        if not self._done:
            raise RuntimeError("not complete")
        return self._masks

    def with_masks(self, masks: Mapping[str, Sequence[bool]]) -> _Polled:
        self._masks = masks
        return self


class DictConnector:
    """The seed protocol over a dict ``(leaf, shard, hash) -> page bytes`` (``(replica, ...)`` if replica-local).

    ``refuse_next`` / ``fail_next_post`` / ``fail_next_transfer`` make the next
    load refuse, fail at posting, or fail from its transfer after scribbling
    over the destination pages. ``*_polls`` delay completions.
    """

    def __init__(self, leaves: Mapping[str, LeafSpec], device_blocks: Sequence[Mapping[str, Sequence[torch.Tensor]]],
                 store: dict[Key, torch.Tensor], *, defer: bool = False, lookup_polls: int = 1,
                 load_polls: int = 1, offload_polls: int = 0, replica_local: bool = False,
                 probe_supported: bool = True) -> None:
        self._leaves = dict(leaves)
        self._blocks = device_blocks
        self.store = store
        self.defer = defer
        self.lookup_polls = lookup_polls
        self.load_polls = load_polls
        self.offload_polls = offload_polls
        self.replica_local = replica_local
        self.probe_supported = probe_supported
        self.refuse_next = False
        self.fail_next_post = False
        self.fail_next_transfer = False
        self.calls: list[tuple[str, Any]] = []
        self._metrics = KVCacheMetrics()
        self._last_lookup: dict[int, tuple[list[bytes], bytes | None]] = {}

    # identity
    @property
    def name(self) -> str:
        return "dict"

    @property
    def leaves(self) -> Mapping[str, int]:
        return {leaf: spec.group_id for leaf, spec in self._leaves.items()}

    @property
    def host_byte_count(self) -> ByteCount:
        used = sum(t.numel() for t in self.store.values())
        return ByteCount(free=0, total=used)

    @property
    def disk_byte_count(self) -> ByteCount:
        return ByteCount(free=0, total=0)

    @property
    def metrics(self) -> KVCacheMetrics:
        return self._metrics

    def take_metrics(self) -> KVCacheMetrics:
        out, self._metrics = self._metrics, KVCacheMetrics()
        return out

    def defers_lookup(self, replica_idx: int = 0) -> bool:
        return self.defer

    # presence
    def _key(self, leaf: str, shard: int, block_hash: bytes, replica: int) -> Key:
        return (replica, leaf, shard, block_hash) if self.replica_local else (leaf, shard, block_hash)

    def holds(self, leaf: str, block_hash: bytes, replica: int = 0) -> bool:
        shards = range(self._leaves[leaf].tp_shards)
        return all(self._key(leaf, s, block_hash, replica) in self.store for s in shards)

    def _masks(self, hashes: Sequence[bytes], replica: int) -> dict[str, list[bool]]:
        return {leaf: [self.holds(leaf, h, replica) for h in hashes] for leaf in self._leaves}

    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0,
               hint: bytes | None = None) -> dict[str, list[bool]]:
        self.calls.append(("lookup", (list(block_hashes), replica_idx, hint)))
        self._last_lookup[replica_idx] = (list(block_hashes), hint)
        return self._masks(block_hashes, replica_idx)

    def start_lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None) -> _Polled:
        self.calls.append(("start_lookup", (list(block_hashes), replica_idx, hint)))
        handle = _Polled(self.lookup_polls).with_masks(self._masks(block_hashes, replica_idx))
        handle.asked = (list(block_hashes), replica_idx, hint)  # type: ignore[attr-defined]
        return handle

    def abandon_lookup(self, lookup: Any) -> None:
        self.calls.append(("abandon_lookup", lookup))

    def probe(self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int],
              hint: bytes | None = None) -> list[dict[str, list[bool]]] | None:
        self.calls.append(("probe", (list(block_hashes), list(replica_idxs), hint)))
        if not self.probe_supported:
            return None
        return [self._masks(block_hashes, r) for r in replica_idxs]

    # transfers
    def _check(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]]) -> None:
        assert set(block_ids) == set(block_hashes) <= set(self._leaves)
        for leaf in block_ids:
            assert len(block_ids[leaf]) == len(block_hashes[leaf])
            assert all(len(h) in (8, 32) for h in block_hashes[leaf])
            assert 0 not in block_ids[leaf], "the null page is never loaded or offloaded"

    def load(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
             replica_idx: int = 0, hint: bytes | None = None) -> Any:
        self.calls.append(("load", ({k: list(v) for k, v in block_ids.items()},
                                    {k: list(v) for k, v in block_hashes.items()}, replica_idx, hint)))
        self._check(block_ids, block_hashes)
        if self.refuse_next:
            self.refuse_next = False
            raise KVLoadRefused("refused on purpose")
        for leaf, hashes in block_hashes.items():
            for h in hashes:
                if not self.holds(leaf, h, replica_idx):
                    raise KVLoadRefused("block gone", leaf_id=leaf, block_hash=h)
        if self.fail_next_post:
            self.fail_next_post = False
            raise KVLoadFailed("posting failed on purpose")
        targets = [(self._blocks[replica_idx][leaf][s], page, self._key(leaf, s, h, replica_idx))
                   for leaf in block_ids for page, h in zip(block_ids[leaf], block_hashes[leaf])
                   for s in range(self._leaves[leaf].tp_shards)]
        if not targets:
            return CompletedTransfer()

        def copy() -> None:
            for tensor, page, key in targets:
                tensor[page].copy_(self.store[key])
                self._metrics.h2d_bytes_copied += tensor.shape[1]

        def scribble() -> None:  # a failed copy leaves garbage behind
            for tensor, page, _ in targets:
                tensor[page].fill_(0x7F)

        failing, self.fail_next_transfer = self.fail_next_transfer, False
        return _Polled(self.load_polls, copy, scribble if failing else None)

    def load_lookup(self, lookup: Any, block_ids: Mapping[str, Sequence[int]],
                    block_hashes: Mapping[str, Sequence[bytes]], replica_idx: int = 0,
                    hint: bytes | None = None) -> Any:
        self.calls.append(("load_lookup", lookup))
        assert lookup.is_complete()
        asked, asked_replica, asked_hint = lookup.asked
        assert (asked_replica, asked_hint) == (replica_idx, hint)
        for hashes in block_hashes.values():  # a contiguous run of what was asked
            if hashes:
                start = asked.index(hashes[0])
                assert asked[start:start + len(hashes)] == list(hashes)
        return self.load(block_ids, block_hashes, replica_idx, hint)

    def offload(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                replica_idx: int = 0) -> Any:
        self.calls.append(("offload", ({k: list(v) for k, v in block_ids.items()},
                                       {k: list(v) for k, v in block_hashes.items()}, replica_idx)))
        self._check(block_ids, block_hashes)

        def copy() -> None:  # the bytes are read when the copy lands, so the source must stay pinned
            for leaf in block_ids:
                for page, h in zip(block_ids[leaf], block_hashes[leaf]):
                    for s in range(self._leaves[leaf].tp_shards):
                        row = self._blocks[replica_idx][leaf][s][page]
                        self.store[self._key(leaf, s, h, replica_idx)] = row.clone()
                        self._metrics.d2h_bytes_copied += row.numel()

        if self.offload_polls == 0:
            copy()
            return CompletedTransfer()
        return _Polled(self.offload_polls, copy, g0={k: list(v) for k, v in block_ids.items()})

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        self.calls.append(("touch", (list(block_hashes), replica_idx)))

    def poll_transfers(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        self.store.clear()

    def shutdown(self) -> None:
        pass

    def named(self, method: str) -> list[Any]:
        return [args for name, args in self.calls if name == method]


# ---- fixtures ---------------------------------------------------------------------------------

BS = 4
SWA_CONFIG = ModelConfig(sliding_window=6, window_layers=(1, 3), seed=7)
FULL_CONFIG = ModelConfig(seed=7)
PROMPT = [(7 * i + 3) % 64 for i in range(22)]  # 5 full blocks + 2 tokens
NEW = 5


def make_engine(model: TinyTransformer, store: dict[Key, torch.Tensor], *, tp: int = 1, replicas: int = 1,
                num_pages: int = 48, algorithm: str = "sha256", **conn_kwargs: Any) -> tuple[Engine, DictConnector]:
    engine = Engine(model, block_size=BS, num_pages=num_pages, tp=tp, replicas=replicas,
                    hash_algorithm=algorithm)  # type: ignore[arg-type]
    conn = DictConnector(engine.leaf_specs, engine.device_blocks, store, **conn_kwargs)
    engine.attach_connector(conn)
    return engine, conn


def assert_same(a: Any, b: Any) -> None:
    assert a.tokens == b.tokens
    assert torch.equal(a.logits, b.logits)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Any:
    """One intra-op thread: on a small shared CPU, OpenMP workers spinning against the
    session's UCX progress thread make tiny matmuls ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def swa_model() -> TinyTransformer:
    return TinyTransformer(SWA_CONFIG)


@pytest.fixture(scope="module")
def full_model() -> TinyTransformer:
    return TinyTransformer(FULL_CONFIG)


# ---- tests ------------------------------------------------------------------------------------


def test_fakes_implement_every_member(swa_model: TinyTransformer) -> None:
    engine = Engine(swa_model, block_size=BS)
    null = NullConnector(engine.leaf_specs)
    fake = DictConnector(engine.leaf_specs, engine.device_blocks, {})
    for conn in (null, fake):
        assert all(hasattr(conn, m) for m in PROTOCOL_MEMBERS)
        assert isinstance(conn, Connector)
    assert null.lookup([b"\0" * 32] * 3) == {FULL_LEAF: [False] * 3, SWA_LEAF: [False] * 3}
    with pytest.raises(KVLoadRefused):
        null.load({FULL_LEAF: [1]}, {FULL_LEAF: [b"\0" * 32]})
    assert null.start_lookup([b"\0" * 8]).is_complete()


def test_device_blocks_shape(swa_model: TinyTransformer) -> None:
    engine = Engine(swa_model, block_size=BS, num_pages=10, tp=2, replicas=2)
    cfg = swa_model.config
    assert set(engine.leaf_specs) == {FULL_LEAF, SWA_LEAF}
    assert engine.leaf_specs[SWA_LEAF].window == 6 and engine.leaf_specs[FULL_LEAF].tp_shards == 2
    assert len(engine.device_blocks) == 2
    for replica in engine.device_blocks:
        for leaf, shards in replica.items():
            n_layers = len(cfg.window_layers) if leaf == SWA_LEAF else len(cfg.full_layers)
            bpp = n_layers * 2 * BS * (cfg.n_kv_heads // 2) * cfg.head_dim * 4
            assert engine.bytes_per_page(leaf) == bpp
            assert len(shards) == 2
            for t in shards:
                assert t.dtype == torch.uint8 and t.shape == (10, bpp) and t.is_contiguous()
    assert engine.device_blocks[0][FULL_LEAF][0].data_ptr() != engine.device_blocks[1][FULL_LEAF][0].data_ptr()


@pytest.mark.parametrize("tp,windowed,algorithm", [(1, False, "sha256"), (2, True, "hash64"), (1, True, "sha256"),
                                                   (2, False, "hash64")])
def test_second_engine_loads_prefix_bit_exact(swa_model: TinyTransformer, full_model: TinyTransformer,
                                              tp: int, windowed: bool, algorithm: str) -> None:
    model = swa_model if windowed else full_model
    store: dict[Key, torch.Tensor] = {}
    first, conn1 = make_engine(model, store, tp=tp, algorithm=algorithm)
    a = first.generate(PROMPT, NEW)
    assert a.stats.computed_blocks == 5 and a.stats.offloaded_blocks == 5
    assert a.metrics.d2h_bytes_copied > 0
    assert len(store) == 5 * tp * len(first.leaf_specs)

    second, conn2 = make_engine(model, store, tp=tp, algorithm=algorithm)
    b = second.generate(PROMPT, NEW)
    assert b.stats.device_hit_blocks == 0
    assert b.stats.connector_hit_blocks == 5 and b.stats.computed_blocks == 0
    assert_same(a, b)
    assert_same(a, second.recompute_reference(PROMPT, NEW))
    (ids, hashes, replica, hint), = conn2.named("load")
    expect_hashes = block_hashes(PROMPT, BS, algorithm)  # type: ignore[arg-type]
    assert hashes[FULL_LEAF] == expect_hashes
    assert len(ids[FULL_LEAF]) == 5
    expected_bytes = 5 * second.bytes_per_page(FULL_LEAF) * tp
    if windowed:
        assert hashes[SWA_LEAF] == expect_hashes[-2:]  # ceil(6 / 4) = 2 window blocks
        expected_bytes += 2 * second.bytes_per_page(SWA_LEAF) * tp
    assert b.stats.loaded_bytes == expected_bytes == b.metrics.h2d_bytes_copied
    assert not conn2.named("offload")  # nothing computed, nothing offloaded
    assert second.referenced_pages() == 0 and first.referenced_pages() == 0

    again = second.generate(PROMPT, NEW)  # now from the device cache
    assert again.stats.device_hit_blocks == 5 and again.stats.connector_hit_blocks == 0
    assert_same(a, again)
    (touched, _), = conn2.named("touch")
    assert touched == expect_hashes  # root-anchored, the whole chain


def test_deferred_lookup_and_delayed_transfers(swa_model: TinyTransformer) -> None:
    store: dict[Key, torch.Tensor] = {}
    first, _ = make_engine(swa_model, store, tp=2, defer=True, lookup_polls=3, load_polls=3, offload_polls=4)
    a = first.generate(PROMPT, NEW)
    assert first.drain() and first.referenced_pages() == 0
    second, conn = make_engine(swa_model, store, tp=2, defer=True, lookup_polls=3, load_polls=3)
    b = second.generate(PROMPT, NEW, hint=b'{"peer": "x"}')
    assert b.stats.connector_hit_blocks == 5
    assert_same(a, b)
    assert len(conn.named("start_lookup")) == 1 and not conn.named("lookup")
    assert len(conn.named("load_lookup")) == 1 and not conn.named("abandon_lookup")
    assert conn.named("load")[0][3] == b'{"peer": "x"}'

    miss = second.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)  # the connector has none of it
    assert miss.stats.connector_hit_blocks == 0 and len(conn.named("abandon_lookup")) == 1


def test_device_hit_then_connector_rest(swa_model: TinyTransformer) -> None:
    store: dict[Key, torch.Tensor] = {}
    first, _ = make_engine(swa_model, store)
    a = first.generate(PROMPT, NEW)
    second, conn = make_engine(swa_model, store)
    short = second.generate(PROMPT[:9], 2)  # blocks 0, 1 from the connector; the partial tail computed
    assert short.stats.connector_hit_blocks == 2
    store.clear()  # refilled below by the first engine's recompute and offload
    first.reset_device_cache()
    first.generate(PROMPT, NEW)
    b = second.generate(PROMPT, NEW)
    assert b.stats.device_hit_blocks == 2 and b.stats.connector_hit_blocks == 3 and b.stats.computed_blocks == 0
    assert_same(a, b)
    hashes = block_hashes(PROMPT, BS)
    assert conn.named("touch")[-1][0] == hashes[:2]
    asked = conn.named("lookup")[-1][0]
    assert asked == hashes[2:5]  # only the gap the device hit leaves
    _, load_hashes, _, _ = conn.named("load")[-1]
    assert load_hashes[FULL_LEAF] == hashes[2:5] and load_hashes[SWA_LEAF] == hashes[3:5]


def test_block_aligned_prompt_computes_its_last_block(full_model: TinyTransformer) -> None:
    store: dict[Key, torch.Tensor] = {}
    prompt = PROMPT[:20]  # exactly 5 blocks
    first, _ = make_engine(full_model, store)
    a = first.generate(prompt, NEW)
    second, _ = make_engine(full_model, store)
    b = second.generate(prompt, NEW)
    assert b.stats.connector_hit_blocks == 4 and b.stats.computed_blocks == 1
    assert_same(a, b)
    c = second.generate(prompt, NEW)
    assert c.stats.device_hit_blocks == 4 and c.stats.computed_blocks == 1
    assert_same(a, c)
    assert second.referenced_pages() == 0


@pytest.mark.parametrize("mode", ["refuse", "evicted", "fail_post", "fail_transfer"])
def test_refused_or_failed_load_recomputes(swa_model: TinyTransformer, mode: str) -> None:
    store: dict[Key, torch.Tensor] = {}
    first, _ = make_engine(swa_model, store, tp=2)
    a = first.generate(PROMPT, NEW)
    second, conn = make_engine(swa_model, store, tp=2, load_polls=2)
    if mode == "refuse":
        conn.refuse_next = True
    elif mode == "fail_post":
        conn.fail_next_post = True
    elif mode == "fail_transfer":
        conn.fail_next_transfer = True
    else:
        original = conn.load

        def evict_then_load(*args: Any, **kwargs: Any) -> Any:  # evicted between lookup and load
            store.pop((FULL_LEAF, 1, block_hashes(PROMPT, BS)[3]))
            return original(*args, **kwargs)

        conn.load = evict_then_load  # type: ignore[method-assign]
    b = second.generate(PROMPT, NEW)
    refused = mode in ("refuse", "evicted")
    assert (b.stats.refused, b.stats.failed) == ((1, 0) if refused else (0, 1))
    assert b.stats.connector_hit_blocks == 0 and b.stats.computed_blocks == 5
    assert_same(a, b)
    assert second.referenced_pages() == 0
    c = second.generate(PROMPT, NEW)  # failed pages were freed, never cached
    assert c.stats.device_hit_blocks == 5
    assert_same(a, c)


def test_presence_needs_every_shard_and_only_the_window(swa_model: TinyTransformer) -> None:
    store: dict[Key, torch.Tensor] = {}
    first, _ = make_engine(swa_model, store, tp=2)
    a = first.generate(PROMPT, NEW)
    hashes = block_hashes(PROMPT, BS)
    # swa blocks outside the last window are not needed: drop them, still a full hit
    for i in range(3):
        for s in range(2):
            del store[(SWA_LEAF, s, hashes[i])]
    second, _ = make_engine(swa_model, store, tp=2)
    b = second.generate(PROMPT, NEW)
    assert b.stats.connector_hit_blocks == 5
    assert_same(a, b)
    # one shard of a full-leaf block missing: the hit stops before it
    del store[(FULL_LEAF, 1, hashes[4])]
    third, _ = make_engine(swa_model, store, tp=2)
    c = third.generate(PROMPT, NEW)
    # a 4-block hit needs swa blocks 2, 3 (2 was dropped); 3 blocks need swa 1, 2 (dropped)... down to 0
    assert c.stats.connector_hit_blocks == 0
    assert_same(a, c)
    # everything back but one shard of full-leaf block 4: a 4-block hit (its window, swa 2..3, is there)
    first.reset_device_cache()
    store.clear()
    first.generate(PROMPT, NEW)
    del store[(FULL_LEAF, 0, hashes[4])]
    fourth, _ = make_engine(swa_model, store, tp=2)
    d = fourth.generate(PROMPT, NEW)
    assert d.stats.connector_hit_blocks == 4 and d.stats.computed_blocks == 1
    assert_same(a, d)


@pytest.mark.parametrize("probe_supported", [True, False])
def test_probe_picks_the_replica_that_holds_the_prefix(swa_model: TinyTransformer, probe_supported: bool) -> None:
    store: dict[Key, torch.Tensor] = {}
    engine, conn = make_engine(swa_model, store, replicas=2, replica_local=True, probe_supported=probe_supported)
    a = engine.generate(PROMPT, NEW, replica=1)
    assert a.replica == 1 and all(key[0] == 1 for key in store)
    engine.reset_device_cache()
    b = engine.generate(PROMPT, NEW)
    assert b.replica == 1 and b.stats.connector_hit_blocks == 5
    assert engine.last_replica_scores == [0, 5]
    assert_same(a, b)
    assert len(conn.named("probe")) == 1
    if not probe_supported:  # priced with a lookup per replica, then the chosen one's own lookup
        assert [args[1] for args in conn.named("lookup")[1:]] == [0, 1, 1]
    # device hit decides too: replica 0 gets the prefix on device, and the store forgets it
    engine.reset_device_cache()
    engine.generate(PROMPT, NEW, replica=0)
    store.clear()
    c = engine.generate(PROMPT, NEW)
    assert c.replica == 0 and c.stats.device_hit_blocks == 5
    assert_same(a, c)


def test_offload_sources_stay_pinned_until_landed(full_model: TinyTransformer) -> None:
    store: dict[Key, torch.Tensor] = {}
    engine, _ = make_engine(full_model, store, num_pages=14, offload_polls=40)
    prompts = [[(p * 13 + 5 * i) % 64 for i in range(14)] for p in range(6)]
    results = []
    for prompt in prompts:
        results.append(engine.generate(prompt, 3))
        assert engine.pending_offloads >= 1 and engine.referenced_pages() > 0
    assert engine.drain() and engine.referenced_pages() == 0 and not engine.offload_errors
    assert engine.replicas[0].pools[FULL_LEAF].evictions > 0
    reader, _ = make_engine(full_model, store)
    for prompt, expected in zip(prompts, results):
        got = reader.generate(prompt, 3)
        assert got.stats.connector_hit_blocks == 3
        assert_same(expected, got)


def test_device_lru_eviction_stays_exact(swa_model: TinyTransformer) -> None:
    engine = Engine(swa_model, block_size=BS, num_pages=12)
    prompts = [[(p * 11 + 3 * i) % 64 for i in range(13)] for p in range(5)]
    first = [engine.generate(p, 4) for p in prompts]
    again = [engine.generate(p, 4) for p in reversed(prompts)][::-1]
    for x, y in zip(first, again):
        assert_same(x, y)
    assert sum(r.stats.device_hit_blocks for r in again) > 0
    assert sum(r.stats.computed_blocks for r in again) > 0
    assert engine.replicas[0].pools[FULL_LEAF].evictions > 0
    assert engine.referenced_pages() == 0


def test_unanswered_lookup_is_abandoned(swa_model: TinyTransformer) -> None:
    store: dict[Key, torch.Tensor] = {}
    first, _ = make_engine(swa_model, store)
    a = first.generate(PROMPT, NEW)
    second = Engine(swa_model, block_size=BS, lookup_timeout=0.05)
    conn = DictConnector(second.leaf_specs, second.device_blocks, store, defer=True, lookup_polls=10**9)
    second.attach_connector(conn)
    b = second.generate(PROMPT, NEW)
    assert b.stats.lookup_timeouts == 1 and b.stats.connector_hit_blocks == 0
    assert len(conn.named("abandon_lookup")) == 1 and not conn.named("load_lookup")
    assert_same(a, b)
