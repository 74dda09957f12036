"""End-to-end block checksums: a block's bytes bound to the key they are stored under.

Contract:

* **What.** A block's checksum is XXH3-128 (``xxhash``) over a prefix that
  names the block — ``b"dKV-sum1"``, the leaf id (length-prefixed UTF-8), the
  TP shard, the block hash (length-prefixed) and the block's byte length —
  followed by the block's bytes. 16 bytes, big-endian digest. The namespace
  is not in it: a connection binds one namespace and a node never lets a
  namespace see another's blocks (README, *Contracts the node keeps*).
* **Why the prefix.** The same bytes under another key give another
  checksum, so a block served under the wrong key (a stale or reused slot, a
  mixed-up offset) fails verification just as a flipped bit does. The prefix
  is self-delimiting, so no two different (key, bytes) pairs hash the same
  input.
* **Where.** The writing client computes it from its source bytes right
  before they leave and sends it with ``write``; the node checks the bytes
  that arrived in the slot before the block becomes visible (a mismatch is
  not committed), keeps it beside the block (through spills to disk and
  back) and returns it with every ``read``; the reading client checks the
  bytes in its destination after they arrived. A block stored without one
  (an old client) is read back with ``None``, which a checking reader treats
  as a failure.
* **What it is not.** XXH3 is not a MAC: it detects corruption, truncation
  and substitution, not a forger who can compute checksums (the cluster
  token and namespaces keep strangers out).
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

CHECKSUM_SIZE = 16
_TAG = b"dKV-sum1"
_SHARD_SIZE = struct.Struct(">HQ")  # TP shard, block length


def block_prefix(leaf: str, shard: int, block_hash: bytes, size: int) -> bytes:
    """The identity prefix hashed before a block's bytes (see the module docstring)."""
    leaf_bytes = leaf.encode()
    return b"".join((_TAG, len(leaf_bytes).to_bytes(2, "big"), leaf_bytes, _SHARD_SIZE.pack(shard, size),
                     len(block_hash).to_bytes(1, "big"), block_hash))


def block_checksum(leaf: str, shard: int, block_hash: bytes, data: Any) -> bytes:
    """The 16-byte checksum of ``data`` (any contiguous buffer) stored as ``(leaf, shard, block_hash)``."""
    view = memoryview(data)
    if not view.contiguous:
        raise ValueError("block_checksum needs a contiguous buffer")
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    hasher = xxhash.xxh3_128(block_prefix(leaf, shard, block_hash, view.nbytes))
    hasher.update(view)
    return hasher.digest()


def verify(leaf: str, shard: int, block_hash: bytes, data: Any, checksum: object) -> bool:
    """True when ``checksum`` is the checksum of ``data`` stored as ``(leaf, shard, block_hash)``.

    A missing (``None``) or malformed checksum never verifies.
    """
    if not isinstance(checksum, bytes) or len(checksum) != CHECKSUM_SIZE:
        return False
    return block_checksum(leaf, shard, block_hash, data) == checksum


def is_checksum(value: object) -> bool:
    """True for a well-formed checksum (16 bytes)."""
    return isinstance(value, bytes) and len(value) == CHECKSUM_SIZE


__all__ = ["CHECKSUM_SIZE", "block_checksum", "block_prefix", "is_checksum", "verify"]
