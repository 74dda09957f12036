"""Hash, namespace and size validation at the boundary."""

from __future__ import annotations

import pytest

from dkv.errors import ConfigError
from dkv.keys import BlockKey, block_keys, check_hash, check_namespace, derive_namespace
from dkv.units import format_size, parse_address, parse_size


@pytest.mark.parametrize("length", [0, 1, 7, 9, 16, 31, 33, 64])
def test_hash_of_wrong_length_is_a_value_error(length: int) -> None:
    with pytest.raises(ValueError, match="8 bytes"):
        check_hash(b"x" * length)


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
