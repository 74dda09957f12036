"""The reference engine: drives a KV connector the way a serving engine's KV cache manager does.

One request at a time (:meth:`Engine.generate`):

1. Hash the prompt's full blocks. A hit may cover at most ``(len(prompt) - 1) //
   block_size`` blocks, so the last prompt token is always computed (its logits
   give the first generated token).
2. Pick a replica (:meth:`Engine.choose_replica`: ``probe``, else a ``lookup``
   per replica), then take the longest device prefix hit there and ``touch``
   its root-anchored chain.
3. Ask the connector about the rest -- ``start_lookup`` + polling when
   ``defers_lookup(replica)``, else ``lookup`` -- reconcile the masks
   (:mod:`connector.engine.prefix`), then ``load_lookup``/``load`` into fresh
   pages and poll the transfer until it lands; nothing to load means
   ``abandon_lookup``. ``KVLoadRefused``/``KVLoadFailed`` free those pages and
   the blocks are recomputed.
4. Compute the remaining prompt blocks one block per model call, then the
   partial tail; ``offload`` the computed full blocks, keeping the transfer's
   ``g0_blocks_per_leaf`` pinned until ``is_complete()``; decode greedily, one
   token per model call.

Every step (model call, and every polling round) first calls
``connector.poll_transfers()`` and then polls the in-flight offloads.

Bit-exactness: every model call gathers its past KV from the pages with shapes
that depend only on the position, so whether a block's KV was computed here or
loaded as bytes, the logits are bit-identical (see :mod:`connector.engine.model`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from connector.engine.hashing import HashAlgorithm, block_hashes, hash_length
from connector.engine.layout import PageLayout
from connector.engine.model import KV, ModelConfig, TinyTransformer
from connector.engine.null import NullConnector
from connector.engine.paged import NULL_PAGE, OutOfPages, ReplicaKV
from connector.engine.prefix import longest_hit, needed_range, reconcile, window_blocks
from connector.engine.protocol import Connector, KVLookup, Masks
from connector.types import (
    KVCacheMetrics,
    KVLoadFailed,
    KVLoadRefused,
    KVTransfer,
    LeafSpec,
    full_attention,
    sliding_window,
)

FULL_LEAF = "full"
SWA_LEAF = "swa"


@dataclass
class GenerationStats:
    """What one request did. ``device_hit_blocks + connector_hit_blocks + computed_blocks == prompt_blocks``."""

    prompt_tokens: int = 0
    prompt_blocks: int = 0  # full blocks of the prompt (the hashed ones)
    device_hit_blocks: int = 0
    connector_hit_blocks: int = 0
    computed_blocks: int = 0  # full prompt blocks run through the model (the partial tail is not counted)
    loaded_bytes: int = 0  # bytes the connector moved in, all leaves and shards
    refused: int = 0  # KVLoadRefused seen (the blocks were recomputed)
    failed: int = 0  # KVLoadFailed seen (the blocks were recomputed)
    lookup_timeouts: int = 0  # deferred lookups that did not answer in time (treated as a miss)
    no_space: int = 0  # connector hits dropped because pages could not be allocated
    offloaded_blocks: int = 0
    lookup_seconds: float = 0.0
    load_seconds: float = 0.0
    prefill_seconds: float = 0.0  # from arrival to the first token's logits, lookups and loads included
    decode_seconds: float = 0.0


@dataclass
class GenerationResult:
    """Greedy tokens, the logits each was chosen from (``[len(tokens), vocab]``, float32), and stats."""

    tokens: list[int]
    logits: torch.Tensor
    replica: int
    stats: GenerationStats
    metrics: KVCacheMetrics  # the connector's take_metrics() after the request


@dataclass
class _Request:
    replica: int
    rows: dict[str, list[int]]  # leaf -> page per block index (NULL_PAGE where not held); one reference each


@dataclass
class _PendingOffload:
    replica: int
    transfer: Any
    pinned: dict[str, list[int]]


@dataclass
class _Timing:
    lookup_timeout: float
    transfer_timeout: float
    poll_interval: float


class Engine:
    """A paged KV cache manager + greedy generation loop over :class:`TinyTransformer`.

    Leaves: ``"full"`` (the full-attention layers) and ``"swa"`` (the windowed
    layers), each present only when it has layers; group ids 0 and 1.
    ``device_blocks[replica][leaf][shard]`` is that leaf's pool, a contiguous
    ``[num_pages, bytes_per_page]`` uint8 tensor (layout:
    :mod:`connector.engine.layout`); build a connector over
    ``(leaf_specs, device_blocks)`` and hand it to :meth:`attach_connector`.
    Without one the engine runs a :class:`NullConnector`.

    On a small shared CPU, ``torch.set_num_threads(1)`` avoids OpenMP workers
    spinning against other busy threads (such as a UCX progress thread).
    """

    def __init__(
        self,
        model: TinyTransformer | ModelConfig,
        *,
        block_size: int = 4,
        num_pages: int = 64,
        tp: int = 1,
        replicas: int = 1,
        hash_algorithm: HashAlgorithm = "sha256",
        hash_seed: int = 0,
        device: str | torch.device | None = None,
        connector: Connector | None = None,
        lookup_timeout: float = 10.0,
        transfer_timeout: float = 30.0,
        poll_interval: float = 1e-4,
    ) -> None:
        """``num_pages`` counts rows per pool, the null page included; ``tp`` must divide ``n_kv_heads``."""
        if isinstance(model, ModelConfig):
            model = TinyTransformer(model, device or "cpu")
        elif device is not None and torch.device(device) != model.device:
            raise ValueError(f"model is on {model.device}, engine asked for {device}")
        self.model = model
        cfg = model.config
        if block_size <= 0 or replicas <= 0 or tp <= 0:
            raise ValueError("block_size, replicas and tp must be positive")
        if cfg.n_kv_heads % tp:
            raise ValueError(f"tp={tp} must divide n_kv_heads={cfg.n_kv_heads}")
        hash_length(hash_algorithm)
        self.block_size = block_size
        self.num_pages = num_pages
        self.tp = tp
        self.hash_algorithm: HashAlgorithm = hash_algorithm
        self.hash_seed = hash_seed
        self.device = model.device
        self._timing = _Timing(lookup_timeout, transfer_timeout, poll_interval)

        specs: dict[str, LeafSpec] = {}
        layer_sets: dict[str, tuple[int, ...]] = {}
        if cfg.full_layers:
            specs[FULL_LEAF] = full_attention(0, tp)
            layer_sets[FULL_LEAF] = cfg.full_layers
        if cfg.window_layers:
            assert cfg.sliding_window is not None
            specs[SWA_LEAF] = sliding_window(1, cfg.sliding_window, tp)
            layer_sets[SWA_LEAF] = cfg.window_layers
        self.leaf_specs: dict[str, LeafSpec] = specs
        self.layouts: dict[str, PageLayout] = {
            leaf: PageLayout(leaf, layers, block_size, cfg.n_kv_heads // tp, cfg.head_dim)
            for leaf, layers in layer_sets.items()
        }
        self.replicas: list[ReplicaKV] = [ReplicaKV(self.layouts, tp, num_pages, self.device) for _ in range(replicas)]
        self.connector: Connector = NullConnector(self.leaf_specs)
        self._pending: list[_PendingOffload] = []
        self.offload_errors: list[BaseException] = []
        self.last_replica_scores: list[int] = []
        if connector is not None:
            self.attach_connector(connector)

    # ---- what a connector is built over -------------------------------------------------------

    @property
    def device_blocks(self) -> list[dict[str, list[torch.Tensor]]]:
        """``[replica][leaf][shard]`` -> the ``[num_pages, bytes_per_page]`` uint8 pool (the live tensors)."""
        return [dict(rep.tensors) for rep in self.replicas]

    def bytes_per_page(self, leaf: str) -> int:
        """``len(layers of leaf) * 2 * block_size * (n_kv_heads // tp) * head_dim * 4``."""
        return self.layouts[leaf].bytes_per_page

    def layout_descriptor(self) -> dict[str, Any]:
        """Everything two engines must agree on to share blocks (for deriving a namespace)."""
        cfg = self.model.config
        return {
            "model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            "dtype": "float32",
            "block_size": self.block_size,
            "tp": self.tp,
            "hash": {"algorithm": self.hash_algorithm, "seed": self.hash_seed},
            "leaves": {
                leaf: {"layers": list(lay.layers), "bytes_per_page": lay.bytes_per_page,
                       "heads_per_shard": lay.heads_per_shard, "window": self.leaf_specs[leaf].window}
                for leaf, lay in self.layouts.items()
            },
        }

    def attach_connector(self, connector: Connector) -> None:
        """Drive ``connector`` from now on. Its ``leaves`` must be this engine's leaves and group ids."""
        expected = {leaf: spec.group_id for leaf, spec in self.leaf_specs.items()}
        if dict(connector.leaves) != expected:
            raise ValueError(f"connector leaves {dict(connector.leaves)} differ from the engine's {expected}")
        self.drain()
        self.connector = connector

    # ---- public loop --------------------------------------------------------------------------

    def generate(
        self,
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        hint: bytes | None = None,
        *,
        replica: int | None = None,
    ) -> GenerationResult:
        """Prefill ``prompt_tokens`` (reusing device and connector KV) and decode greedily.

        ``replica`` forces a replica instead of :meth:`choose_replica`. The
        result's logits stay on the engine's device.
        """
        prompt = [int(t) for t in prompt_tokens]
        cfg = self.model.config
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if any(not 0 <= t < cfg.vocab for t in prompt):
            raise ValueError("token id outside the vocabulary")
        if len(prompt) + max_new_tokens > cfg.max_positions:
            raise ValueError("prompt + max_new_tokens exceeds the model's max_positions")
        bs = self.block_size
        start = time.perf_counter()
        hashes = block_hashes(prompt, bs, self.hash_algorithm, self.hash_seed)
        usable = (len(prompt) - 1) // bs
        stats = GenerationStats(prompt_tokens=len(prompt), prompt_blocks=len(hashes))
        self._step()
        r = self.choose_replica(hashes[:usable], hint) if replica is None else replica
        if not 0 <= r < len(self.replicas):
            raise ValueError(f"no replica {r}")
        req = _Request(r, {leaf: [] for leaf in self.leaf_specs})
        tokens: list[int] = []
        step_logits: list[torch.Tensor] = []
        try:
            device_hit = self._take_device_hit(req, hashes[:usable])
            stats.device_hit_blocks = device_hit
            if device_hit:
                self.connector.touch(self._touch_chain(hashes, device_hit), r)
            loaded = self._connector_hit(req, hashes, device_hit, usable, hint, stats)
            stats.connector_hit_blocks = loaded
            first = device_hit + loaded
            logits: torch.Tensor | None = None
            for b in range(first, len(hashes)):
                logits = self._run_chunk(req, prompt[b * bs : (b + 1) * bs], b * bs)
                for leaf, pool in self.replicas[r].pools.items():
                    pool.register(hashes[b], req.rows[leaf][b])
            stats.computed_blocks = len(hashes) - first
            if len(prompt) % bs:
                tail_start = len(hashes) * bs
                logits = self._run_chunk(req, prompt[tail_start:], tail_start)
            assert logits is not None
            current = logits[-1]
            self._offload(req, list(range(first, len(hashes))), hashes, stats)
            decode_start = time.perf_counter()
            stats.prefill_seconds = decode_start - start
            position = len(prompt)
            for step in range(max_new_tokens):
                token = int(torch.argmax(current).item())
                tokens.append(token)
                step_logits.append(current)
                if step + 1 < max_new_tokens:
                    current = self._run_chunk(req, [token], position)[-1]
                    position += 1
            stats.decode_seconds = time.perf_counter() - decode_start
        finally:
            self._release(req)
            self._step()
        return GenerationResult(tokens, torch.stack(step_logits), r, stats, self.connector.take_metrics())

    def recompute_reference(self, prompt_tokens: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """The same request on a fresh engine (same model, layout and TP) with a :class:`NullConnector`.

        Nothing is reused, so every block is computed: the bit-exactness reference.
        """
        blocks = math.ceil((len(prompt_tokens) + max_new_tokens) / self.block_size)
        ref = Engine(self.model, block_size=self.block_size, num_pages=blocks + 2, tp=self.tp,
                     hash_algorithm=self.hash_algorithm, hash_seed=self.hash_seed)
        return ref.generate(prompt_tokens, max_new_tokens)

    def choose_replica(self, hashes: Sequence[bytes], hint: bytes | None = None) -> int:
        """The replica with the longest loadable prefix of ``hashes`` (device hit + connector); ties go low.

        Prices the connector part with ``probe``; when it answers ``None``, with a
        ``lookup`` per replica. One replica: 0, nothing asked.
        """
        if len(self.replicas) == 1:
            self.last_replica_scores = [0]
            return 0
        device = [self._device_hit_length(rep, hashes) for rep in self.replicas]
        scores = list(device)
        if hashes:
            idxs = list(range(len(self.replicas)))
            answers = self.connector.probe(hashes, idxs, hint)
            if answers is not None and len(answers) != len(idxs):
                raise ValueError(f"probe answered {len(answers)} replicas, asked about {len(idxs)}")
            for r, dev in enumerate(device):
                if dev == len(hashes):
                    continue
                if answers is not None:
                    rest: Masks = {leaf: list(mask)[dev:] for leaf, mask in answers[r].items()}
                    extra = reconcile(rest, self.leaf_specs, self.block_size, dev, require_all_leaves=False)
                else:
                    extra = reconcile(self.connector.lookup(hashes[dev:], r, hint), self.leaf_specs,
                                      self.block_size, dev)
                scores[r] = dev + extra
        self.last_replica_scores = scores
        return max(range(len(scores)), key=lambda i: (scores[i], -i))

    def drain(self, timeout: float | None = None) -> bool:
        """Poll until every in-flight offload lands (then ``synchronize`` the rest); True if none is left."""
        deadline = time.monotonic() + (self._timing.transfer_timeout if timeout is None else timeout)
        while self._pending and time.monotonic() < deadline:
            self._step()
            if self._pending:
                time.sleep(self._timing.poll_interval)
        for pending in list(self._pending):
            pending.transfer.synchronize()
        self._step()
        return not self._pending

    def poll(self) -> int:
        """One step while idle, as a serving loop's between requests: let the connector reclaim and
        unpin the offloads that landed. Returns how many are still in flight."""
        self._step()
        return len(self._pending)

    def reset_device_cache(self) -> None:
        """Forget the device prefix cache on every replica (held and pinned pages stay until released)."""
        for rep in self.replicas:
            for pool in rep.pools.values():
                pool.clear_cache()

    def referenced_pages(self) -> int:
        """Pages referenced on any replica and leaf (0 when idle and drained)."""
        return sum(pool.referenced_pages for rep in self.replicas for pool in rep.pools.values())

    @property
    def pending_offloads(self) -> int:
        """Offloads posted and not yet landed (their sources stay pinned)."""
        return len(self._pending)

    @property
    def connector_metrics(self) -> KVCacheMetrics:
        """The connector's running ``metrics`` (not cleared; each result carries ``take_metrics()``)."""
        return self.connector.metrics

    # ---- steps and transfers ------------------------------------------------------------------

    def _step(self) -> None:
        """Once per step: let the connector reclaim, then poll in-flight offloads (unpin what landed)."""
        self.connector.poll_transfers()
        still: list[_PendingOffload] = []
        for pending in self._pending:
            try:
                done = pending.transfer.is_complete()
            except Exception as exc:  # noqa: BLE001 - a failed offload stores nothing; unpin and note it
                self.offload_errors.append(exc)
                done = True
            if done:
                pools = self.replicas[pending.replica].pools
                for leaf, pages in pending.pinned.items():
                    for page in pages:
                        pools[leaf].release(page)
            else:
                still.append(pending)
        self._pending = still

    def _wait(self, is_done: Callable[[], bool], timeout: float) -> bool:
        """Poll ``is_done`` (one step per round) until True or ``timeout``; returns whether it is done."""
        deadline = time.monotonic() + timeout
        while True:
            self._step()
            if is_done():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self._timing.poll_interval)

    def _wait_transfer(self, transfer: KVTransfer) -> None:
        """Until the transfer lands; ``KVLoadFailed`` from it propagates."""
        if not self._wait(transfer.is_complete, self._timing.transfer_timeout):
            transfer.synchronize()
            if not transfer.is_complete():
                raise RuntimeError("transfer not complete after synchronize()")

    # ---- prefix hits --------------------------------------------------------------------------

    def _device_hit_length(self, rep: ReplicaKV, hashes: Sequence[bytes]) -> int:
        def holds(leaf: str, i: int) -> bool:
            return rep.pools[leaf].cached_page(hashes[i]) is not None

        return longest_hit(self.leaf_specs, self.block_size, len(hashes), holds)

    def _take_device_hit(self, req: _Request, hashes: Sequence[bytes]) -> int:
        rep = self.replicas[req.replica]
        hit = self._device_hit_length(rep, hashes)
        for leaf, spec in self.leaf_specs.items():
            row = [NULL_PAGE] * hit
            pool = rep.pools[leaf]
            for i in needed_range(spec, self.block_size, hit):
                page = pool.cached_page(hashes[i])
                assert page is not None
                pool.acquire(page)
                row[i] = page
            req.rows[leaf] = row
        return hit

    def _touch_chain(self, hashes: Sequence[bytes], hit: int) -> list[bytes]:
        """Root-anchored chain of the device-served blocks: the whole prefix if any leaf is full
        attention, else the widest active window."""
        if FULL_LEAF in self.leaf_specs:
            return list(hashes[:hit])
        widest = max(window_blocks(spec, self.block_size) or hit for spec in self.leaf_specs.values())
        return list(hashes[max(0, hit - widest) : hit])

    def _connector_hit(
        self, req: _Request, hashes: Sequence[bytes], device_hit: int, usable: int, hint: bytes | None,
        stats: GenerationStats,
    ) -> int:
        """Look up ``hashes[device_hit:usable]`` and load what reconciles; returns blocks loaded."""
        ask = list(hashes[device_hit:usable])
        if not ask:
            return 0
        conn, r = self.connector, req.replica
        t0 = time.perf_counter()
        handle: KVLookup | None = None
        if conn.defers_lookup(r):
            handle = conn.start_lookup(ask, r, hint)
            if not self._wait(handle.is_complete, self._timing.lookup_timeout):
                conn.abandon_lookup(handle)
                stats.lookup_timeouts += 1
                stats.lookup_seconds = time.perf_counter() - t0
                return 0
            masks = handle.result()
        else:
            masks = conn.lookup(ask, r, hint)
        stats.lookup_seconds = time.perf_counter() - t0
        for leaf, mask in masks.items():
            if len(mask) != len(ask):
                raise ValueError(f"lookup mask of leaf {leaf!r} has {len(mask)} entries for {len(ask)} hashes")
        n = reconcile(masks, self.leaf_specs, self.block_size, device_hit)
        rep = self.replicas[r]
        hit = device_hit + n
        wanted = {leaf: [i for i in needed_range(spec, self.block_size, hit) if i >= device_hit]
                  for leaf, spec in self.leaf_specs.items()}
        if n and not all(rep.pools[leaf].can_allocate(len(idx)) for leaf, idx in wanted.items()):
            stats.no_space += 1
            n = 0
        if n == 0:
            if handle is not None:
                conn.abandon_lookup(handle)
            return 0
        t1 = time.perf_counter()
        block_ids: dict[str, list[int]] = {}
        load_hashes: dict[str, list[bytes]] = {}
        for leaf, idx in wanted.items():
            row = req.rows[leaf]
            row.extend([NULL_PAGE] * n)
            for i in idx:
                row[i] = rep.pools[leaf].allocate()
            block_ids[leaf] = [row[i] for i in idx]
            load_hashes[leaf] = [hashes[i] for i in idx]
        try:
            if handle is not None:
                transfer = conn.load_lookup(handle, block_ids, load_hashes, r, hint)
            else:
                transfer = conn.load(block_ids, load_hashes, r, hint)
            self._wait_transfer(transfer)
        except (KVLoadRefused, KVLoadFailed) as exc:
            if isinstance(exc, KVLoadRefused):
                stats.refused += 1
            else:
                stats.failed += 1
            self._truncate(req, device_hit)
            stats.load_seconds = time.perf_counter() - t1
            return 0
        stats.load_seconds = time.perf_counter() - t1
        for leaf, idx in wanted.items():
            for i in idx:
                rep.pools[leaf].register(hashes[i], req.rows[leaf][i])
        stats.loaded_bytes = sum(len(ids) * self.layouts[leaf].bytes_per_page * self.tp
                                 for leaf, ids in block_ids.items())
        return n

    # ---- model steps --------------------------------------------------------------------------

    def _page_for(self, req: _Request, leaf: str, block: int) -> int:
        """The request's page for ``block`` of ``leaf``, allocating it if the row ends right before it."""
        row = req.rows[leaf]
        if block < len(row):
            if row[block] == NULL_PAGE:
                raise RuntimeError(f"leaf {leaf!r} block {block} is the null page")
            return row[block]
        if block != len(row):
            raise RuntimeError("blocks must be filled in order")
        row.append(self._allocate(req.replica, leaf))
        return row[block]

    def _allocate(self, replica: int, leaf: str) -> int:
        pool = self.replicas[replica].pools[leaf]
        try:
            return pool.allocate()
        except OutOfPages:
            if not any(p.replica == replica for p in self._pending):
                raise
            self._wait(lambda: pool.can_allocate(1), self._timing.transfer_timeout)
            return pool.allocate()

    def _past(self, req: _Request, offset: int) -> list[KV]:
        """Each layer's past KV for a chunk at ``offset``; its shape depends only on ``offset``."""
        bs = self.block_size
        rep = self.replicas[req.replica]
        past: list[KV | None] = [None] * self.model.config.n_layers
        for leaf, spec in self.leaf_specs.items():
            nw = window_blocks(spec, bs)
            first = 0 if nw is None else max(0, offset // bs - nw)
            pages = req.rows[leaf][first : math.ceil(offset / bs)]
            if NULL_PAGE in pages:
                raise RuntimeError(f"leaf {leaf!r}: the past of position {offset} reaches a null page")
            kv = rep.gather(leaf, pages, offset - first * bs)
            for li, layer in enumerate(self.layouts[leaf].layers):
                past[layer] = kv[li]
        assert all(p is not None for p in past)
        return past  # type: ignore[return-value]

    def _run_chunk(self, req: _Request, tokens: Sequence[int], offset: int) -> torch.Tensor:
        """One step: run ``tokens`` at ``offset`` (within one block) and store their KV; returns logits."""
        self._step()
        bs = self.block_size
        block, slot = divmod(offset, bs)
        pages = {leaf: self._page_for(req, leaf, block) for leaf in self.leaf_specs}
        logits, kv = self.model.forward_block(tokens, offset, self._past(req, offset))
        rep = self.replicas[req.replica]
        for leaf, layout in self.layouts.items():
            rep.write(leaf, pages[leaf], slot, [kv[layer] for layer in layout.layers])
        return logits

    # ---- offload and release ------------------------------------------------------------------

    def _offload(self, req: _Request, blocks: list[int], hashes: Sequence[bytes], stats: GenerationStats) -> None:
        """Offload the computed full ``blocks``; pin the transfer's ``g0_blocks_per_leaf`` until it lands."""
        if not blocks:
            return
        ids = {leaf: [req.rows[leaf][b] for b in blocks] for leaf in self.leaf_specs}
        hs = {leaf: [hashes[b] for b in blocks] for leaf in self.leaf_specs}
        transfer = self.connector.offload(ids, hs, req.replica)
        stats.offloaded_blocks = len(blocks)
        pinned: dict[str, list[int]] = {}
        pools = self.replicas[req.replica].pools
        for leaf, pages in transfer.g0_blocks_per_leaf.items():
            if leaf not in ids or not set(pages) <= set(ids[leaf]):
                raise ValueError(f"offload pins {leaf!r} pages {list(pages)} it was not given")
            for page in pages:
                pools[leaf].acquire(page)
            pinned[leaf] = list(pages)
        self._pending.append(_PendingOffload(req.replica, transfer, pinned))
        self._step()

    def _truncate(self, req: _Request, length: int) -> None:
        """Drop the request's pages for blocks ``length..`` (never cached: fresh load targets)."""
        pools = self.replicas[req.replica].pools
        for leaf, row in req.rows.items():
            for page in row[length:]:
                if page != NULL_PAGE:
                    pools[leaf].release(page)
            del row[length:]

    def _release(self, req: _Request) -> None:
        self._truncate(req, 0)
