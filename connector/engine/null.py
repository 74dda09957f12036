"""A connector that holds nothing: every lookup misses, every offload is dropped.

It implements every member of the seed protocol, so an engine driven by it
runs the exact code path of a connector-backed engine with zero external hits
-- the recompute reference for bit-exactness checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from connector.engine.protocol import Masks
from connector.types import ByteCount, CompletedTransfer, KVCacheMetrics, KVLoadRefused, LeafSpec


class CompletedLookup:
    """A lookup handle that is already answered."""

    def __init__(self, masks: Masks) -> None:
        self._masks = {leaf: list(mask) for leaf, mask in masks.items()}

    def is_complete(self) -> bool:
        return True

    def result(self) -> Masks:
        return self._masks


class NullConnector:
    """Never hits, never stores; ``load`` of anything is refused (it was never reported)."""

    def __init__(self, leaves: Mapping[str, LeafSpec]) -> None:
        self._leaves = dict(leaves)

    @property
    def name(self) -> str:
        return "null"

    @property
    def leaves(self) -> Mapping[str, int]:
        return {leaf: spec.group_id for leaf, spec in self._leaves.items()}

    @property
    def host_byte_count(self) -> ByteCount:
        return ByteCount(free=0, total=0)

    @property
    def disk_byte_count(self) -> ByteCount:
        return ByteCount(free=0, total=0)

    @property
    def metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics()

    def defers_lookup(self, replica_idx: int = 0) -> bool:
        return False

    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None) -> Masks:
        return {leaf: [False] * len(block_hashes) for leaf in self._leaves}

    def start_lookup(
        self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None
    ) -> CompletedLookup:
        return CompletedLookup(self.lookup(block_hashes, replica_idx, hint))

    def abandon_lookup(self, lookup: object) -> None:
        return None

    def probe(
        self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int], hint: bytes | None = None
    ) -> Sequence[Masks]:
        answer = self.lookup(block_hashes)
        return [answer for _ in replica_idxs]

    def load(
        self,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
        hint: bytes | None = None,
    ) -> CompletedTransfer:
        for leaf, hashes in block_hashes.items():
            if hashes:
                raise KVLoadRefused("the null connector holds nothing", leaf_id=leaf, block_hash=hashes[0])
        return CompletedTransfer()

    def load_lookup(
        self,
        lookup: object,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
        hint: bytes | None = None,
    ) -> CompletedTransfer:
        return self.load(block_ids, block_hashes, replica_idx, hint)

    def offload(
        self,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
    ) -> CompletedTransfer:
        return CompletedTransfer()

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        return None

    def poll_transfers(self) -> None:
        return None

    def take_metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics()

    def reset_prefix_cache(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
