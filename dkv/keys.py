"""Block hashes, block keys and namespaces (DESIGN contracts 1 and 2).

A block hash is 8 bytes (ahash64 family, big-endian) or 32 bytes (SHA-256),
prefix-chained: block *i*'s hash covers blocks 0..*i*. Anything else is a
``ValueError`` at the boundary. A block is stored under
``(namespace, leaf_id, tp_shard, hash)``; a connection is bound to one
namespace, so inside the node a key is ``(leaf_id, tp_shard, hash)``.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

HASH_LENGTHS = (8, 32)
MAX_LEAF_ID_LENGTH = 64
MAX_TP_SHARDS = 64
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/=+-]{0,127}$")


class BlockKey(NamedTuple):
    """A block inside one namespace: which leaf, which tensor-parallel shard, which hash."""

    leaf: str
    shard: int
    hash: bytes


def block_keys(leaf: str, shard: int, hashes: Iterable[bytes]) -> list[BlockKey]:
    """The keys of ``hashes`` in one leaf and shard, in order (unchecked: the caller validated them).

    Built by C-level passes, not a Python call per key: a load of 256 blocks
    makes its keys in half the time of ``BlockKey(...)`` per hash.
    """
    repeat = itertools.repeat
    return list(map(tuple.__new__, repeat(BlockKey), zip(repeat(leaf), repeat(shard), hashes)))  # type: ignore[arg-type]


def check_hash(block_hash: object) -> bytes:
    """Return ``block_hash`` as bytes, or raise ``ValueError`` if it is not 8 or 32 bytes."""
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise ValueError(f"block hash must be bytes, got {type(block_hash).__name__}")
    raw = bytes(block_hash)
    if len(raw) not in HASH_LENGTHS:
        raise ValueError(
            f"block hash must be 8 bytes (ahash64, big-endian) or 32 bytes (SHA-256), got {len(raw)}"
        )
    return raw


def plain_hashes_python(values: object) -> bool:
    """True when ``values`` is a list or tuple of exactly ``bytes``, each 8 or 32 long (the native check's twin)."""
    return type(values) in (list, tuple) and all(type(h) is bytes and len(h) in HASH_LENGTHS for h in values)


def pack_hashes_python(values: object) -> bytes | None:
    """``values``'s hashes back to back when all are exactly ``bytes`` of one length, 8 or 32 (the native twin)."""
    if type(values) not in (list, tuple) or not values:
        return None
    lengths = set(map(len, values)) if all(type(h) is bytes for h in values) else None  # type: ignore[attr-defined]
    if lengths is None or len(lengths) != 1 or next(iter(lengths)) not in HASH_LENGTHS:
        return None
    return b"".join(values)  # type: ignore[arg-type]


def split_hashes_python(packed: bytes, size: int) -> list[bytes]:
    """``packed`` cut into hashes of ``size`` (8 or 32) bytes each (the native twin; ``ValueError`` otherwise)."""
    if type(packed) is not bytes:
        raise TypeError("split_hashes: packed hashes must be bytes")
    if size not in HASH_LENGTHS or len(packed) % size:
        raise ValueError(f"packed hashes: {len(packed)} bytes do not cut into hashes of 8 or 32 bytes (size {size})")
    return [packed[i:i + size] for i in range(0, len(packed), size)]


try:  # one C pass; every lookup, probe, touch, read and write checks its hashes on both sides
    from dkv._hash_check import pack_hashes, plain_hashes, split_hashes
except ImportError:  # not built (no C compiler at install): the same answers in Python
    plain_hashes = plain_hashes_python
    pack_hashes = pack_hashes_python
    split_hashes = split_hashes_python


def check_hashes(block_hashes: Iterable[object]) -> list[bytes]:
    """Validate a run of hashes; every one must be 8 or 32 bytes (``ValueError`` otherwise)."""
    hashes = list(block_hashes)
    if plain_hashes(hashes):  # fast path: plain bytes of a valid length, kept as they are
        return hashes  # type: ignore[return-value]
    return [check_hash(x) for x in hashes]


def check_leaf(leaf: object) -> str:
    """Validate a leaf id: a non-empty string of at most 64 characters."""
    if not isinstance(leaf, str) or not 0 < len(leaf) <= MAX_LEAF_ID_LENGTH:
        raise ValueError(f"leaf id must be a non-empty string of at most {MAX_LEAF_ID_LENGTH} chars: {leaf!r}")
    return leaf


def check_shard(shard: object, shards: int = MAX_TP_SHARDS) -> int:
    """Validate a tensor-parallel shard index in ``[0, shards)``."""
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < shards:
        raise ValueError(f"tp shard must be an int in [0, {shards}): {shard!r}")
    return shard


def check_namespace(namespace: object) -> str:
    """Validate a namespace string (what :func:`derive_namespace` returns, or an operator's name)."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise ValueError(
            "namespace must be 1-128 characters of [A-Za-z0-9._:/=+-], starting with a letter or digit: "
            f"{namespace!r}"
        )
    return namespace


def derive_namespace(
    tenant: str,
    *,
    model: str,
    dtype: str,
    page_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    hash_algorithm: str,
    hash_seed: int | str = 0,
    extra: Sequence[tuple[str, object]] = (),
) -> str:
    """Namespace for a tenant and a KV layout: engines share blocks only when these match.

    Returns ``"<tenant>/<16 hex digits>"``; the digest covers every layout field,
    so two engines whose KV bytes could differ never meet in one namespace.
    """
    fields = [
        ("model", model),
        ("dtype", dtype),
        ("page_size", page_size),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("hash_algorithm", hash_algorithm),
        ("hash_seed", hash_seed),
        *extra,
    ]
    text = "\n".join(f"{k}={v}" for k, v in fields)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return check_namespace(f"{tenant}/{digest}")
