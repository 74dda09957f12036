"""Frame header and message validation: everything is checked before allocation."""

from __future__ import annotations

import msgpack
import pytest

from dkv.errors import FrameTooLarge, ProtocolError
from dkv.wire import (
    FLAG_INLINE,
    FLAG_TRAILING,
    HEADER,
    MAGIC,
    MAX_FRAME,
    MAX_KEYS,
    PROTOCOL_VERSION,
    check_request,
    decode_body,
    decode_frame_header,
    decode_header,
    encode_body,
    encode_header,
    client_proof,
    node_proof,
    proof_equals,
)


def test_header_round_trip() -> None:
    assert decode_header(encode_header(1234)) == 1234


def test_a_header_announces_trailing_bytes_only_after_an_inline_body_and_only_to_who_takes_them() -> None:
    header = encode_header(100, FLAG_INLINE | FLAG_TRAILING, 5000)
    assert decode_frame_header(header) == (100, FLAG_INLINE | FLAG_TRAILING, 5000)
    assert decode_frame_header(encode_header(100, FLAG_INLINE)) == (100, FLAG_INLINE, 0)
    assert decode_frame_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, FLAG_INLINE, 100, 77)) == (100, FLAG_INLINE, 0)
    with pytest.raises(ProtocolError, match="trailing"):
        decode_header(header)  # a receiver that made no room for them
    with pytest.raises(ProtocolError, match="inline body"):
        decode_frame_header(encode_header(100, FLAG_TRAILING, 5000))
    with pytest.raises(ProtocolError, match="inline body"):
        decode_frame_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, FLAG_INLINE | FLAG_TRAILING, 100, MAX_FRAME + 1))
    with pytest.raises(FrameTooLarge):
        encode_header(100, FLAG_INLINE | FLAG_TRAILING, MAX_FRAME + 1)


def test_oversized_frame_is_refused_before_allocation() -> None:
    with pytest.raises(FrameTooLarge):
        decode_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, MAX_FRAME + 1, 0))
    with pytest.raises(FrameTooLarge):
        encode_header(MAX_FRAME + 1)


def test_garbage_header_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode_header(b"GET / HTTP/1.1\r\n")


def test_other_protocol_version_is_refused() -> None:
    with pytest.raises(ProtocolError, match="version"):
        decode_header(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, 0, 10, 0))


@pytest.mark.parametrize("body", [b"\xc1\xc1\xc1", msgpack.packb([1, 2, 3]), msgpack.packb({1: 2})])
def test_bodies_that_are_not_string_keyed_maps_are_refused(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_body(body)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_extension_types_and_raw_strings_never_come_out_of_a_body(large: bool) -> None:
    """Bodies small and large (decoded two ways) give plain values only: an ext type is refused, strings are str."""
    pad = "p" * (600 if large else 8)
    assert decode_body(msgpack.packb({"op": "x", "pad": pad})) == {"op": "x", "pad": pad}
    for ext in (msgpack.ExtType(5, b"abc"), msgpack.Timestamp(1)):
        with pytest.raises(ProtocolError):
            decode_body(msgpack.packb({"op": "x", "pad": pad, "v": ext}))


def test_a_small_body_claiming_more_elements_than_it_has_bytes_is_refused() -> None:
    claim = b"\x81\xa1k\xdd" + (60_000).to_bytes(4, "big") + b"\x01"  # {"k": array32 of 60 000}, one element sent
    with pytest.raises(ProtocolError):
        decode_body(claim)


def test_valid_lookup_passes() -> None:
    msg = decode_body(encode_body({"op": "lookup", "hashes": [b"x" * 32, b"y" * 8], "leaves": ["L"],
                                   "shards": 2, "lease": True, "group": 0}))
    assert check_request(msg) == "lookup"
    assert check_request({**msg, "send": 1 << 20}) == "lookup"  # the blocks' bytes with the answer, up to so many
    assert check_request({**msg, "send": 1 << 20, "inline_sent": True}) == "lookup"  # ...in the answer's message
    with pytest.raises(ProtocolError, match="inline_sent"):
        check_request({**msg, "inline_sent": 1})


@pytest.mark.parametrize("send", [-1, True, 1.5, "1MiB", MAX_FRAME + 1])
def test_a_lookup_asking_for_its_bytes_with_a_bad_bound_is_refused(send: object) -> None:
    with pytest.raises(ProtocolError, match="send"):
        check_request({"op": "lookup", "hashes": [b"x" * 32], "leaves": ["L"], "shards": 1, "lease": True,
                       "group": 0, "send": send})


def test_packed_hashes_become_the_list_before_the_schema_checks_them() -> None:
    hashes = [bytes([i]) * 32 for i in range(5)]
    for op, extra in (("lookup", {"lease": True, "group": 0}), ("probe", {}), ("touch", {})):
        msg = decode_body(encode_body({"op": op, "hashes": b"".join(hashes), "hash_size": 32, "leaves": ["L"],
                                       "shards": 1, **extra}))
        assert check_request(msg) == op
        assert msg["hashes"] == hashes and "hash_size" not in msg  # the handler sees the list, as if sent so
    other = {"op": "write", "keys": [], "sizes": [], "shm": False, "hashes": b"x" * 32, "hash_size": 32}
    assert check_request(other) == "write" and other["hashes"] == b"x" * 32  # other ops: no packing is read
    with pytest.raises(ProtocolError, match="packed hashes"):
        check_request({"op": "probe", "hashes": b"x" * 40, "hash_size": 32, "leaves": ["L"], "shards": 1})


def test_a_read_names_its_blocks_by_keys_or_by_runs_of_places() -> None:
    base = {"op": "read", "lease": 1, "end": True, "shm": False}
    assert check_request({**base, "keys": [["L", 0, b"x" * 8]]}) == "read"
    assert check_request({**base, "runs": [["L", 0, 0, 256], ["M", 3, 7, 8]]}) == "read"
    assert check_request({**base, "runs": [["L", 0, 0, MAX_KEYS]]}) == "read"
    # (neither, or both: the schema lets the node say which it takes; the node refuses them: test_node_read_runs)


@pytest.mark.parametrize("runs", [
    [["L", 0, 5, 5]],  # empty
    [["L", 0, 6, 5]],  # backwards
    [["L", 0, -1, 2]],
    [["L", 0, 0, MAX_KEYS + 1]],
    [["L", 0, 0, MAX_KEYS], ["L", 0, 0, 1]],  # more blocks in all than one read may name
    [["L", 64, 0, 1]],  # a shard out of bounds
    [["", 0, 0, 1]],
    [["L", 0, 0]],
    [["L", 0, 0, 1, 2]],
    [["L", False, 0, 1]],
    [["L", 0, 0.0, 1]],
    [("L", 0, 0, 1)],  # (msgpack decodes arrays as lists: a tuple never arrives, and is not taken)
    ["L", 0, 0, 1],
    "runs",
], ids=lambda r: repr(r)[:40])
def test_a_read_with_malformed_runs_is_refused(runs: object) -> None:
    with pytest.raises(ProtocolError, match="runs"):
        check_request({"op": "read", "lease": 1, "runs": runs, "end": True, "shm": False})


@pytest.mark.parametrize(
    "message",
    [
        {"op": "lookup", "hashes": [b"x" * 7], "leaves": ["L"], "shards": 1, "lease": True, "group": 0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": [], "shards": 1, "lease": True, "group": 0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": ["L"], "shards": 0, "lease": True, "group": 0},
        {"op": "read", "lease": 1, "keys": [["L", 0, b"x" * 9]], "end": True, "shm": False},
        {"op": "write", "keys": [["L", 99, b"x" * 8]], "sizes": [1], "shm": False},
        {"op": "write", "keys": [["L", 0, b"x" * 8]], "sizes": [-1], "shm": False},
        {"op": "nope"},
        {"op": "commit"},
        {"hashes": []},
        # one-item lists (checked without the passes a longer list takes) and scalars, each wrong one way
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": [""], "shards": 1, "lease": True, "group": 0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": ["L" * 65], "shards": 1, "lease": True, "group": 0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": [b"L"], "shards": 1, "lease": True, "group": 0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": ["L"], "shards": 1, "lease": 1, "group": 0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": ["L"], "shards": True, "lease": True, "group": 0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": ["L"], "shards": 1, "lease": True, "group": 1.0},
        {"op": "lookup", "hashes": [b"x" * 8], "leaves": ["L"], "shards": 1, "lease": True, "group": 0, "slots": 1},
        {"op": "end", "ends": [True]},
        {"op": "end", "ends": [-1]},
        {"op": "end", "ends": [2**63 + 1]},
        {"op": "end", "ends": ["1"]},
        {"op": "end", "ends": 1},
        {"op": "read", "lease": 1, "keys": [["L", True, b"x" * 8]], "end": True, "shm": False},
        {"op": "read", "lease": 1, "keys": [["", 0, b"x" * 8]], "end": True, "shm": False},
    ],
)
def test_malformed_requests_are_refused(message: dict) -> None:
    with pytest.raises(ProtocolError):
        check_request(message)


def test_client_proof_is_bound_to_both_nonces_the_namespace_and_the_tenant() -> None:
    secret = b"secret-token-123456"
    proof = client_proof(secret, b"n" * 16, b"c" * 16, "a/b", None)
    assert proof_equals(client_proof(secret, b"n" * 16, b"c" * 16, "a/b", None), proof)
    for other in (client_proof(secret, b"m" * 16, b"c" * 16, "a/b", None),
                  client_proof(secret, b"n" * 16, b"d" * 16, "a/b", None),
                  client_proof(secret, b"n" * 16, b"c" * 16, "a/c", None),
                  client_proof(secret, b"n" * 16, b"c" * 16, "a/b", "acme"),
                  client_proof(b"other-token-1234567", b"n" * 16, b"c" * 16, "a/b", None)):
        assert not proof_equals(other, proof)
    assert not proof_equals(proof, None)
    assert client_proof(None, b"n" * 16, b"c" * 16, "a/b", None) is None


def test_node_proof_differs_from_the_client_proof_and_names_the_node() -> None:
    secret = b"secret-token-123456"
    proof = node_proof(secret, b"n" * 16, b"c" * 16, "node-a")
    assert proof != node_proof(secret, b"n" * 16, b"c" * 16, "node-b")
    assert proof != client_proof(secret, b"n" * 16, b"c" * 16, "node-a", None), "a reflected proof is no proof"
