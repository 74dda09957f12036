"""Prefix-chained block hashes in both canonical forms."""

from __future__ import annotations

import hashlib
import struct

import pytest

from connector.engine.hashing import block_hashes, hash_block, hash_to_int, root_hash


@pytest.mark.parametrize("algorithm,length", [("sha256", 32), ("hash64", 8)])
def test_lengths_and_full_blocks_only(algorithm: str, length: int) -> None:
    tokens = list(range(23))
    hashes = block_hashes(tokens, 4, algorithm)  # type: ignore[arg-type]
    assert len(hashes) == 5
    assert all(isinstance(h, bytes) and len(h) == length for h in hashes)
    assert len(set(hashes)) == 5
    assert block_hashes(tokens[:3], 4, algorithm) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["sha256", "hash64"])
def test_chaining(algorithm: str) -> None:
    tokens = list(range(40))
    base = block_hashes(tokens, 8, algorithm)  # type: ignore[arg-type]
    changed = list(tokens)
    changed[9] += 1  # inside block 1
    other = block_hashes(changed, 8, algorithm)  # type: ignore[arg-type]
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:]))
    # a prefix's hashes are the prefix of the hashes; the tail does not matter
    assert block_hashes(tokens[:17], 8, algorithm) == base[:2]  # type: ignore[arg-type]
    # another seed changes every hash
    seeded = block_hashes(tokens, 8, algorithm, seed=1)  # type: ignore[arg-type]
    assert all(a != b for a, b in zip(base, seeded))


def test_definition() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    first = hashlib.sha256(bytes(32) + struct.pack("<4i", 1, 2, 3, 4)).digest()
    second = hashlib.sha256(first + struct.pack("<4i", 5, 6, 7, 8)).digest()
    assert block_hashes(tokens, 4) == [first, second]
    h64 = hashlib.blake2b(bytes(8) + struct.pack("<4i", 1, 2, 3, 4), digest_size=8).digest()
    assert block_hashes(tokens, 4, "hash64")[0] == h64
    assert hash_to_int(h64).to_bytes(8, "big") == h64
    assert root_hash("hash64", 5) == (5).to_bytes(8, "big")
    assert hash_block(first, [5, 6, 7, 8]) == second


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 2, "md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        block_hashes([2**31, 1], 2)
    with pytest.raises(ValueError):
        root_hash("hash64", 2**64)
