"""The connector as the reference engine calls it: a structural type of the seed protocol.

Any object with these members can drive the engine -- ``DKVConnector``, the
:class:`~connector.engine.null.NullConnector`, or a test double.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from connector.types import ByteCount, KVCacheMetrics, KVConnectorTransfer, KVTransfer

Masks = Mapping[str, Sequence[bool]]


@runtime_checkable
class KVLookup(Protocol):
    """A started lookup: ``is_complete()`` never blocks; ``result()`` gives the masks once complete."""

    def is_complete(self) -> bool: ...

    def result(self) -> Masks: ...


@runtime_checkable
class Connector(Protocol):
    """Every member of the seed's ``KVConnector`` protocol."""

    @property
    def name(self) -> str: ...

    @property
    def leaves(self) -> Mapping[str, int]: ...

    @property
    def host_byte_count(self) -> ByteCount: ...

    @property
    def disk_byte_count(self) -> ByteCount: ...

    @property
    def metrics(self) -> KVCacheMetrics: ...

    def defers_lookup(self, replica_idx: int = 0) -> bool: ...

    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None) -> Masks: ...

    def start_lookup(
        self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None
    ) -> KVLookup: ...

    def abandon_lookup(self, lookup: KVLookup) -> None: ...

    def probe(
        self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int], hint: bytes | None = None
    ) -> Sequence[Masks] | None: ...

    def load(
        self,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
        hint: bytes | None = None,
    ) -> KVTransfer: ...

    def load_lookup(
        self,
        lookup: KVLookup,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
        hint: bytes | None = None,
    ) -> KVTransfer: ...

    def offload(
        self,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, Sequence[bytes]],
        replica_idx: int = 0,
    ) -> KVConnectorTransfer: ...

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None: ...

    def poll_transfers(self) -> None: ...

    def take_metrics(self) -> KVCacheMetrics: ...

    def reset_prefix_cache(self) -> None: ...

    def shutdown(self) -> None: ...


PROTOCOL_MEMBERS: tuple[str, ...] = (
    "name", "leaves", "host_byte_count", "disk_byte_count", "metrics", "defers_lookup", "lookup",
    "start_lookup", "abandon_lookup", "probe", "load", "load_lookup", "offload", "touch",
    "poll_transfers", "take_metrics", "reset_prefix_cache", "shutdown",
)
"""Names of every protocol member (for conformance checks)."""
