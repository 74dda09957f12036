"""Hash, namespace and size validation at the boundary."""

from __future__ import annotations

import os

import pytest

from dkv.errors import ConfigError
from dkv import keys as dkv_keys
from dkv.keys import (
    HASH_LENGTHS, BlockKey, block_keys, check_hash, check_hashes, check_namespace, derive_namespace, pack_hashes_python,
    plain_hashes_python, split_hashes_python,
)
from dkv.units import format_size, parse_address, parse_size


@pytest.mark.parametrize("length", [0, 1, 7, 9, 16, 31, 33, 64])
def test_hash_of_wrong_length_is_a_value_error(length: int) -> None:
    with pytest.raises(ValueError, match="8 bytes"):
        check_hash(b"x" * length)


def test_the_native_hash_check_is_built() -> None:
    assert dkv_keys.plain_hashes is not plain_hashes_python, (
        "dkv._hash_check was not built: install a C compiler, then `pip install -e .` again (scripts/run.sh does both)")


class _Bytes(bytes):
    pass


_FOREIGN = [bytearray(8), memoryview(bytes(8)), _Bytes(8), "x" * 8, None, 8, [bytes(8)]]


@pytest.mark.parametrize("twin", ["native", "python"])
def test_the_hash_list_check_takes_only_plain_bytes_of_a_valid_length(twin: str) -> None:
    check = dkv_keys.plain_hashes if twin == "native" else plain_hashes_python
    for length in range(65):
        for kind in (list, tuple):
            assert check(kind([bytes(32), b"h" * length])) is (length in HASH_LENGTHS)
    assert check([]) is True and check(()) is True
    for item in _FOREIGN:
        assert check([bytes(8), item]) is False and check((item,)) is False
    for values in (b"x" * 32, "x" * 8, {b"x" * 8: 1}, iter([b"x" * 8]), None, 8, [bytes(8)] * 3 + [bytes(31)]):
        assert check(values) is False


def test_the_native_packing_is_built() -> None:
    assert dkv_keys.pack_hashes is not pack_hashes_python and dkv_keys.split_hashes is not split_hashes_python


@pytest.mark.parametrize("twin", ["native", "python"])
def test_hashes_pack_only_when_all_are_plain_bytes_of_one_valid_length_and_split_back(twin: str) -> None:
    pack = dkv_keys.pack_hashes if twin == "native" else pack_hashes_python
    split = dkv_keys.split_hashes if twin == "native" else split_hashes_python
    for size in HASH_LENGTHS:
        for count in (1, 2, 255, 256, 257):
            hashes = [os.urandom(size) for _ in range(count)]
            for kind in (list, tuple):
                packed = pack(kind(hashes))
                assert packed == b"".join(hashes) and type(packed) is bytes
            got = split(packed, size)
            assert got == hashes and type(got) is list and all(type(h) is bytes for h in got)
    assert split(b"", 32) == [] and split(b"", 8) == []
    for values in ([], (), [bytes(8), bytes(32)], [bytes(32), bytes(8)], [bytes(31)], [bytes(16)] * 2,
                   b"x" * 32, "x" * 8, None, iter([bytes(8)]), {bytes(8): 1}):
        assert pack(values) is None, values
    for item in _FOREIGN:
        assert pack([bytes(8), item]) is None and pack([item]) is None
    for packed, size in ((b"x" * 33, 32), (b"x" * 9, 8), (b"x" * 32, 16), (b"x" * 32, 0), (b"x" * 32, -8),
                         (b"x" * 32, True)):
        with pytest.raises(ValueError):
            split(packed, size)
    for packed in (bytearray(32), memoryview(bytes(32)), _Bytes(32), "x" * 32):
        with pytest.raises(TypeError):
            split(packed, 32)


def test_check_hashes_copies_a_valid_run_and_names_the_first_bad_one() -> None:
    run = [bytes(8), bytes(32)]
    checked = check_hashes(run)
    assert checked == run and checked is not run
    assert check_hashes(iter(run)) == run and check_hashes(tuple(run)) == run
    assert check_hashes([bytearray(b"x" * 8)]) == [b"x" * 8]  # a bytes-like hash is taken as bytes
    with pytest.raises(ValueError, match="got 9"):
        check_hashes([bytes(8), bytes(9)])


def test_block_keys_are_the_named_keys_of_one_leaf_and_shard_in_order() -> None:
    hashes = [bytes([i]) * 8 for i in range(5)]
    keys = block_keys("leaf", 3, hashes)
    assert keys == [BlockKey("leaf", 3, h) for h in hashes]
    assert all(type(k) is BlockKey for k in keys) and keys[2].hash == hashes[2] and keys[0].leaf == "leaf"
    assert block_keys("leaf", 0, []) == []


def test_hash_must_be_bytes() -> None:
    with pytest.raises(ValueError):
        check_hash("x" * 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [8, 32])
def test_canonical_hash_lengths_pass(length: int) -> None:
    assert check_hash(bytearray(length)) == bytes(length)


def test_namespace_depends_on_every_layout_field() -> None:
    base = dict(model="m", dtype="bf16", page_size=16, num_layers=2, num_kv_heads=2, head_dim=64,
                hash_algorithm="sha256")
    ns = derive_namespace("tenant", **base)
    assert ns.startswith("tenant/")
    for field, other in [("dtype", "fp8"), ("page_size", 32), ("head_dim", 128), ("hash_algorithm", "ahash64")]:
        assert derive_namespace("tenant", **{**base, field: other}) != ns
    assert derive_namespace("other", **base) != ns


@pytest.mark.parametrize("bad", ["", " x", "a b", "x" * 200, "../etc"])
def test_malformed_namespaces_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        check_namespace(bad)


def test_sizes() -> None:
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("512mib") == 512 * 2**20
    assert parse_size("1000") == 1000
    assert format_size(1536) == "1.5 KiB"
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_addresses() -> None:
    assert parse_address("127.0.0.1:7420") == ("127.0.0.1", 7420)
    assert parse_address("[::1]:9") == ("::1", 9)
    assert parse_address("host", 7420) == ("host", 7420)
    with pytest.raises(ConfigError):
        parse_address("host:notaport")
