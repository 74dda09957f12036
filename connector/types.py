"""The seed protocol's types, named as in ``KVConnector-protocol.txt``.

When Modular MAX (package ``max``) is importable, the exception types, the byte
count, the metrics type and ``CompletedTransfer`` are MAX's own, so that MAX's
KV cache manager catches what this connector raises and reads what it returns.
Otherwise dKV's own definitions below stand in, with the same names and
fields. This module is the one place that adaptation lives.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# Variables that steer how a child Python finds its environment. Importing MAX
# starts its native runtime, which sets some of them in the process's C-level
# environment (PYTHONEXECUTABLE, PYTHONPATH) behind ``os.environ``'s back; every
# child Python started afterwards without an explicit env (``dkv`` commands,
# node processes) then loses its virtual environment. They are put back after
# the import to what ``os.environ`` says.
_PYTHON_STARTUP_VARIABLES = ("PYTHONEXECUTABLE", "PYTHONPATH", "PYTHONHOME")


def _restore_python_startup_environment() -> None:
    for name in _PYTHON_STARTUP_VARIABLES:
        if name in os.environ:
            os.putenv(name, os.environ[name])
        else:
            os.unsetenv(name)


try:  # pragma: no cover - exercised only where MAX is installed
    from max.nn.kv_cache.metrics import KVCacheMetrics as _MaxMetrics
    from max.pipelines.kv_cache.kv_connector import ByteCount as _MaxByteCount
    from max.pipelines.kv_cache.kv_connector import CompletedTransfer as _MaxCompleted
    from max.pipelines.kv_cache.kv_connector import KVLoadFailed as _MaxLoadFailed
    from max.pipelines.kv_cache.kv_connector import KVLoadRefused as _MaxLoadRefused

    MAX_AVAILABLE = True
except ImportError:
    MAX_AVAILABLE = False
finally:
    _restore_python_startup_environment()


if MAX_AVAILABLE:  # pragma: no cover
    KVLoadRefused = _MaxLoadRefused
    KVLoadFailed = _MaxLoadFailed
    ByteCount = _MaxByteCount
    KVCacheMetrics = _MaxMetrics
    CompletedTransfer = _MaxCompleted
else:

    class KVLoadRefused(Exception):  # type: ignore[no-redef]
        """A load that cannot move every block it was asked for, refused before anything moved.

        ``leaf_id`` and ``block_hash`` name the missing block when one is to blame.
        """

        def __init__(self, message: str, leaf_id: str | None = None, block_hash: bytes | None = None) -> None:
            super().__init__(message)
            self.leaf_id = leaf_id
            self.block_hash = block_hash

    class KVLoadFailed(Exception):  # type: ignore[no-redef]
        """A load whose copy failed: raised by ``load`` if posting failed, else by the transfer.

        When it is raised, nothing writes into the destination blocks any more.
        """

    @dataclass(frozen=True, slots=True)
    class ByteCount:  # type: ignore[no-redef]
        """Occupancy of a tier in bytes; percentages are 0 when ``total`` is 0."""

        free: int
        total: int

        @property
        def used(self) -> int:
            return self.total - self.free

        @property
        def used_pct(self) -> float:
            return 100.0 * self.used / self.total if self.total else 0.0

        @property
        def free_pct(self) -> float:
            return 100.0 * self.free / self.total if self.total else 0.0

    @dataclass
    class KVCacheMetrics:  # type: ignore[no-redef]
        """Transfer metrics of the connector (MAX's field names)."""

        input_tokens: int = 0
        cache_tokens: int = 0
        device_blocks_served: int = 0
        h2d_bytes_copied: int = 0
        d2h_bytes_copied: int = 0
        cross_replica_blocks_copied: int = 0
        cross_replica_bytes_copied: int = 0
        disk_bytes_written: int = 0
        disk_bytes_read: int = 0
        connector_loads_refused: int = 0
        connector_offload_blocks_dropped: int = 0  # leaf blocks an offload did not store (dKV: node backing off)
        dkv_peer_loads: int = 0
        dkv_peer_load_failures: int = 0
        dkv_hints_rejected: int = 0
        dkv_hints_rejected_by_reason: dict[str, int] = field(default_factory=dict)

    class CompletedTransfer:  # type: ignore[no-redef]
        """A transfer that left nothing in flight (nothing pinned, nothing to wait for)."""

        def __init__(self, g0_blocks_per_leaf: Mapping[str, Sequence[int]] | None = None) -> None:
            self._g0_blocks_per_leaf: Mapping[str, Sequence[int]] = g0_blocks_per_leaf or {}

        @property
        def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
            return self._g0_blocks_per_leaf

        def is_complete(self) -> bool:
            return True

        def synchronize(self) -> None:
            return None


class KVLoadInvalid(KVLoadRefused, ValueError):
    """A load refused for bad input (unknown leaf, ids and hashes of different lengths, a hash
    that is not 8 or 32 bytes, a block id outside the device tensor, an unknown replica).

    Nothing moved. It is a :class:`KVLoadRefused`, because that (or
    :class:`KVLoadFailed`) is all an engine's allocator expects out of ``load``
    (MAX serves the request as a miss), and a ``ValueError``, because the
    caller passed something wrong and the message says what.
    """


@runtime_checkable
class KVTransfer(Protocol):
    """One transfer. ``is_complete`` never blocks, may raise :class:`KVLoadFailed`, and is safe to poll again."""

    def is_complete(self) -> bool: ...

    def synchronize(self) -> None: ...


@runtime_checkable
class KVConnectorTransfer(KVTransfer, Protocol):
    """A transfer that reports the device blocks it keeps pinned until it lands."""

    @property
    def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]: ...


@runtime_checkable
class KVLookup(Protocol):
    """What ``start_lookup`` returns (the protocol names it ``KVLookup``; MAX 26.7 has no such type).

    ``is_complete`` never blocks; ``result`` gives the per-leaf masks, shaped as
    ``lookup()``'s answer, once complete.
    """

    def is_complete(self) -> bool: ...

    def result(self) -> Mapping[str, Sequence[bool]]: ...


class AttentionKind(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class LeafSpec:
    """A leaf (one KV cache group as the connector sees it): its group id, attention shape and shards.

    ``group_id`` is whatever the engine names the group by and is handed back
    unchanged by ``leaves`` (an int for the reference engine, MAX's
    ``KVCacheGroupId`` under MAX). ``window`` is the sliding window in tokens
    (``None`` for full attention); ``tp_shards`` is how many tensor-parallel
    shards hold a piece of each block.
    """

    group_id: Hashable
    kind: AttentionKind = AttentionKind.FULL
    window: int | None = None
    tp_shards: int = 1

    def __post_init__(self) -> None:
        if self.kind is AttentionKind.SLIDING_WINDOW and (self.window is None or self.window <= 0):
            raise ValueError("a sliding-window leaf needs a positive window size")
        if self.tp_shards < 1:
            raise ValueError("tp_shards must be at least 1")


def full_attention(group_id: Hashable, tp_shards: int = 1) -> LeafSpec:
    return LeafSpec(group_id, AttentionKind.FULL, None, tp_shards)


def sliding_window(group_id: Hashable, window: int, tp_shards: int = 1) -> LeafSpec:
    return LeafSpec(group_id, AttentionKind.SLIDING_WINDOW, window, tp_shards)


__all__ = [
    "MAX_AVAILABLE",
    "AttentionKind",
    "ByteCount",
    "CompletedTransfer",
    "KVCacheMetrics",
    "KVConnectorTransfer",
    "KVLoadFailed",
    "KVLoadInvalid",
    "KVLoadRefused",
    "KVLookup",
    "KVTransfer",
    "LeafSpec",
    "full_attention",
    "sliding_window",
]
