"""Prefix-chained block hashes of token ids, in the protocol's two canonical byte forms.

Block ``i``'s hash covers blocks ``0..i``: it digests the previous block's hash
(or, for block 0, the *root* derived from ``seed``) followed by the block's
token ids as little-endian int32.

* ``"sha256"``: the 32-byte SHA-256 digest; the root is ``seed`` as 32 big-endian bytes.
* ``"hash64"``: a 64-bit hash (BLAKE2b with an 8-byte digest) as 8 big-endian
  bytes -- the digest read as a big-endian integer and written back, which is
  the digest itself; the root is ``seed`` as 8 big-endian bytes.

Only full blocks are hashed; a trailing partial block has no hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import numpy as np

HashAlgorithm = Literal["sha256", "hash64"]

HASH_LENGTHS: dict[str, int] = {"sha256": 32, "hash64": 8}

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1


def hash_length(algorithm: HashAlgorithm) -> int:
    """Bytes in one canonical hash of ``algorithm`` (32 or 8)."""
    try:
        return HASH_LENGTHS[algorithm]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; expected 'sha256' or 'hash64'") from None


def root_hash(algorithm: HashAlgorithm, seed: int = 0) -> bytes:
    """The parent of block 0: ``seed`` as big-endian bytes of the algorithm's hash length."""
    n = hash_length(algorithm)
    if not 0 <= seed < 2 ** (8 * n):
        raise ValueError(f"seed {seed} does not fit in {n} bytes")
    return seed.to_bytes(n, "big")


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (``ValueError`` outside the int32 range)."""
    arr = np.asarray(list(tokens), dtype=np.int64)
    if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4").tobytes()


def hash_block(parent: bytes, tokens: Sequence[int], algorithm: HashAlgorithm = "sha256") -> bytes:
    """The hash of one block given its parent's hash (or the root for block 0)."""
    payload = parent + token_bytes(tokens)
    if algorithm == "sha256":
        return hashlib.sha256(payload).digest()
    if algorithm == "hash64":
        value = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")
        return value.to_bytes(8, "big")
    raise ValueError(f"unknown hash algorithm {algorithm!r}; expected 'sha256' or 'hash64'")


def block_hashes(
    tokens: Sequence[int], block_size: int, algorithm: HashAlgorithm = "sha256", seed: int = 0
) -> list[bytes]:
    """Hashes of the full blocks of ``tokens``, in prefix order (``len(tokens) // block_size`` of them)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    parent = root_hash(algorithm, seed)
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], algorithm)
        out.append(parent)
    return out


def hash_to_int(block_hash: bytes) -> int:
    """A canonical hash read as a big-endian unsigned integer."""
    return int.from_bytes(block_hash, "big")
