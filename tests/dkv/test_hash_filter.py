"""The native filter of block hashes (dkv._hash_filter): never a false negative, few false positives, clear errors."""

from __future__ import annotations

import os
import random

import pytest

hash_filter = pytest.importorskip("dkv._hash_filter", reason="dkv._hash_filter was not built (no C compiler?)")


def digests(n: int, length: int = 32) -> list[bytes]:
    return [os.urandom(length) for _ in range(n)]


@pytest.mark.parametrize("length", [8, 32])
def test_every_marked_hash_is_a_maybe_in_order_and_most_others_are_not(length: int) -> None:
    bits = bytearray(1 << 14)  # 131 072 bits for 2 048 hashes: 64 per hash
    marked, others = digests(2048, length), digests(4096, length)
    hash_filter.mark(bits, marked)
    asked = marked + others
    random.Random(1).shuffle(asked)
    maybe = hash_filter.maybe(asked, bits)
    assert maybe == sorted(maybe) and len(set(maybe)) == len(maybe)
    assert {asked[i] for i in maybe} >= set(marked)  # no false negative
    false_maybes = sum(1 for i in maybe if asked[i] not in set(marked))
    assert false_maybes < len(others) * 0.02  # about 0.1 % expected


def test_structured_hashes_spread_too() -> None:
    """Counters, not digests (a test engine's hashes): their bits still spread over the filter."""
    bits = bytearray(1 << 12)
    counters = [i.to_bytes(8, "little") for i in range(512)]
    hash_filter.mark(bits, counters)
    others = [i.to_bytes(8, "little") for i in range(10_000, 14_096)]
    maybe = hash_filter.maybe(counters + others, bits)
    assert maybe[:512] == list(range(512))
    assert len(maybe) - 512 < len(others) * 0.02


def test_none_when_nothing_may_be_held_and_every_filter_is_asked() -> None:
    young, old = bytearray(1024), bytearray(1024)
    a, b = digests(3), digests(3)
    hash_filter.mark(young, a[:1])
    hash_filter.mark(old, b[1:2])
    assert hash_filter.maybe(a[1:] + b[2:]) is None  # no filter at all: nothing may be held
    assert hash_filter.maybe([], young, old) is None
    assert hash_filter.maybe(tuple(a + b), young, None, old) == [0, 4]
    assert hash_filter.maybe(a + b, None, None) is None


@pytest.mark.parametrize("bits", [bytearray(0), bytearray(3), bytearray(1000), bytes(1024), memoryview(bytearray(1024)), None],
                         ids=["empty", "3-bytes", "1000-bytes", "bytes", "memoryview", "none"])
def test_bits_of_the_wrong_kind_or_size_are_refused_with_nothing_marked(bits: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        hash_filter.mark(bits, digests(2))
    if bits is not None:  # (None is skipped by maybe(): no filter)
        with pytest.raises((TypeError, ValueError)):
            hash_filter.maybe(digests(2), bits)


@pytest.mark.parametrize("hashes", [[b"short"], [bytes(range(32)), "text"], [bytearray(32)], iter([bytes(32)]),
                                    bytes(range(32))], ids=["short", "not-bytes", "bytearray", "iterator", "one-hash"])
def test_hashes_of_the_wrong_kind_are_refused_with_nothing_marked(hashes: object) -> None:
    bits = bytearray(64)
    with pytest.raises(TypeError):
        hash_filter.mark(bits, hashes)
    assert bits == bytearray(64)
    with pytest.raises(TypeError):
        hash_filter.maybe(hashes, bits)


def test_arguments_are_counted() -> None:
    with pytest.raises(TypeError):
        hash_filter.mark(bytearray(8))
    with pytest.raises(TypeError):
        hash_filter.maybe()
    with pytest.raises(TypeError):
        hash_filter.maybe([], *[bytearray(8)] * 5)
