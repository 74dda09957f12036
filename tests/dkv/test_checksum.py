"""Block checksums: bound to the block's identity, deterministic, and sensitive to every byte."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dkv.checksum import (CHECKSUM_SIZE, all_checksums, block_checksum, block_prefix, block_prefixes, is_checksum, verify,
                          verify_prefixed)
from dkv.errors import ProtocolError
from dkv.wire import check_request

H8, H32 = os.urandom(8), os.urandom(32)
DATA = os.urandom(65536)


def test_same_block_same_checksum_whatever_the_buffer_type() -> None:
    want = block_checksum("L", 0, H32, DATA)
    assert isinstance(want, bytes) and len(want) == CHECKSUM_SIZE
    as_numpy = np.frombuffer(DATA, dtype=np.uint8).copy()
    assert block_checksum("L", 0, H32, bytearray(DATA)) == want
    assert block_checksum("L", 0, H32, memoryview(DATA)) == want
    assert block_checksum("L", 0, H32, as_numpy) == want
    assert block_checksum("L", 0, H32, torch.from_numpy(as_numpy).numpy()) == want
    assert block_checksum("L", 0, H32, as_numpy.view(np.uint64)) == want  # wide words: the same bytes
    assert block_checksum("L", 0, H32, as_numpy.reshape(16, -1)) == want  # rows of a 2-D page table


@pytest.mark.parametrize("other", [("M", 0, H32), ("L", 1, H32), ("L", 0, os.urandom(32)), ("L", 0, H32[:8]),
                                   ("LL", 0, H32), ("", 0, H32)])
def test_the_same_bytes_under_another_key_do_not_verify(other: tuple[str, int, bytes]) -> None:
    checksum = block_checksum("L", 0, H32, DATA)
    assert block_checksum(*other, DATA) != checksum
    assert not verify(*other, DATA, checksum)


def test_the_prefix_is_self_delimiting() -> None:
    """A key's bytes cannot slide into the data (or the data's into the key) and hash the same."""
    assert block_checksum("La", 0, H8, b"bc") != block_checksum("L", 0, H8, b"abc")
    assert block_checksum("L", 0, H8, H32 + b"x") != block_checksum("L", 0, H8 + H32[:24], H32[24:] + b"x")


def test_every_bit_flip_truncation_and_extension_is_detected() -> None:
    checksum = block_checksum("L", 3, H8, DATA)
    assert verify("L", 3, H8, DATA, checksum)
    data = bytearray(DATA)
    for position in (0, 1, 4095, 4096, 32768, len(DATA) - 1):
        for bit in (0, 7):
            data[position] ^= 1 << bit
            assert not verify("L", 3, H8, data, checksum), (position, bit)
            data[position] ^= 1 << bit
    assert verify("L", 3, H8, data, checksum)
    assert not verify("L", 3, H8, DATA[:-1], checksum)
    assert not verify("L", 3, H8, DATA + b"\0", checksum)
    assert not verify("L", 3, H8, bytes(len(DATA)), checksum)


def test_a_missing_or_malformed_checksum_never_verifies() -> None:
    checksum = block_checksum("L", 0, H32, DATA)
    assert not verify("L", 0, H32, DATA, None)
    assert not verify("L", 0, H32, DATA, checksum[:8])
    assert not verify("L", 0, H32, DATA, bytearray(checksum))
    assert not verify("L", 0, H32, DATA, checksum.hex())


def test_deterministic_and_stable_across_processes() -> None:
    """The digest is a wire format: a node and a client of another build must agree on it.

    XXH3-128 over ``b"dKV-sum1"``, u16 leaf length, leaf, u16 shard, u64 size, u8 hash length, hash, bytes.
    """
    assert block_checksum("L", 0, b"\x01" * 8, b"") == block_checksum("L", 0, b"\x01" * 8, b"")
    assert block_checksum("full", 1, bytes(range(8)), b"abc").hex() == "3c0450479e9bf3bb04c2069c184461cb"


def test_an_empty_block_has_a_checksum_of_its_own() -> None:
    assert verify("L", 0, H8, b"", block_checksum("L", 0, H8, b""))
    assert block_checksum("L", 0, H8, b"") != block_checksum("L", 0, H8, b"\0")


def test_write_sums_are_optional_and_checked_when_present() -> None:
    base = {"op": "write", "keys": [["L", 0, H8]], "sizes": [4], "shm": False}
    assert check_request(dict(base)) == "write"  # absent: an old client
    assert check_request({**base, "sums": [block_checksum("L", 0, H8, b"abcd")]}) == "write"
    for bad in (None, [b"short"], [None], "x" * 16, [b"x" * 17]):
        with pytest.raises(ProtocolError, match="sums"):
            check_request({**base, "sums": bad})
    with pytest.raises(ProtocolError, match="missing field 'shm'"):  # the other fields stay required
        check_request({"op": "write", "keys": [], "sizes": [], "sums": []})


def test_remembered_key_heads_change_no_checksum_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from dkv import checksum

    golden = "3c0450479e9bf3bb04c2069c184461cb"
    monkeypatch.setattr(checksum, "_HEADS", {})
    monkeypatch.setattr(checksum, "_MAX_HEADS", 2)
    for _ in range(2):  # built, then remembered: the same digest
        assert block_checksum("full", 1, bytes(range(8)), b"abc").hex() == golden
    sums = {leaf: block_checksum(leaf, 0, H32, DATA) for leaf in ("a", "b", "c", "d")}  # past the bound
    assert len(checksum._HEADS) == 2
    assert {leaf: block_checksum(leaf, 0, H32, DATA) for leaf in sums} == sums
    assert block_checksum("full", 1, bytes(range(8)), b"abc").hex() == golden


def test_a_strided_buffer_is_refused() -> None:
    strided = memoryview(np.frombuffer(DATA, dtype=np.uint8))[::2]
    with pytest.raises(ValueError, match="contiguous"):
        block_checksum("L", 0, H32, strided)
    with pytest.raises(ValueError, match="contiguous"):
        block_checksum("L", 0, H32, np.frombuffer(DATA, dtype=np.uint8).reshape(16, -1)[:, ::2])


def test_prefixes_of_a_run_equal_each_keys_own_prefix_whether_or_not_the_run_is_uniform() -> None:
    uniform = [("L", 0, bytes([i]) * 32) for i in range(40)]
    cases = [
        (uniform, [4096] * 40),
        (uniform[:1], [4096]),
        ([], []),
        (uniform, [4096] * 39 + [8192]),  # one size differs
        (uniform[:5] + [("M", 0, b"\x07" * 32)], [4096] * 6),  # one leaf differs
        (uniform[:5] + [("L", 1, b"\x07" * 32)], [4096] * 6),  # one shard differs
        (uniform[:5] + [("L", 0, b"\x07" * 8)], [4096] * 6),  # one hash length differs
    ]
    for keys, sizes in cases:
        assert block_prefixes(keys, sizes) == [block_prefix(k[0], k[1], k[2], n) for k, n in zip(keys, sizes)]


def test_a_prefixed_check_answers_as_verify_does_for_every_block_of_a_run() -> None:
    """The listener read's per-block check: its prefixes built for the whole run, then each block checked."""
    keys = [("L", 0, os.urandom(32)) for _ in range(8)] + [("M", 1, os.urandom(8))]
    blocks = [os.urandom(4096 * (1 + i % 3)) for i in range(len(keys))]
    sums = [block_checksum(*key, block) for key, block in zip(keys, blocks)]
    prefixes = block_prefixes(keys, [len(b) for b in blocks])
    for key, block, prefix, checksum in zip(keys, blocks, prefixes, sums):
        view = memoryview(bytearray(block))
        assert verify_prefixed(prefix, view, checksum) is verify(*key, view, checksum) is True
        view[len(block) // 2] ^= 1
        assert verify_prefixed(prefix, view, checksum) is verify(*key, view, checksum) is False
        view[len(block) // 2] ^= 1
        for bad in (None, checksum[:8], bytearray(checksum), checksum.hex()):
            assert verify_prefixed(prefix, view, bad) is verify(*key, view, bad) is False
    # a block checked under another block's prefix (another key, or another length) never verifies
    assert not verify_prefixed(prefixes[1], memoryview(blocks[0]), sums[0])
    assert not verify_prefixed(prefixes[0], memoryview(blocks[0])[:-1], sums[0])


class _Bytes(bytes):
    pass


_SUM_LISTS = {
    "none": [], "one": [bytes(16)], "256": [bytes(16)] * 256, "one short": [bytes(16), bytes(15)],
    "one long": [bytes(17)], "None": [None], "a None after one": [bytes(16), None], "bytearray": [bytearray(16)],
    "memoryview": [memoryview(bytes(16))], "bytes subclass": [_Bytes(bytes(16))], "str": ["x" * 16],
    "a str after one": [bytes(16), "x" * 16], "int": [16], "8 and 24": [bytes(8), bytes(24)],
    "nested": [[bytes(16)]],
}


@pytest.mark.parametrize("values", list(_SUM_LISTS.values()), ids=list(_SUM_LISTS))
def test_all_checksums_answers_as_is_checksum_of_each_does(values: list) -> None:
    """The C-speed check of a read's checksums agrees with the per-item one (a bytes subclass aside: refused)."""
    expected = all(is_checksum(v) and type(v) is bytes for v in values)
    assert all_checksums(values) is expected
