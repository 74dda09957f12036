"""Bad input gets a clear error; the node keeps serving a good client afterwards."""

from __future__ import annotations

import os

import pytest

from dkv.errors import AuthError, DKVError, TransportError
from dkv.keys import BlockKey
from dkv.client import handshake as handshake_as_client
from dkv.transport import connect
from dkv.units import parse_address
from tests.conftest import OnUcx, on_ucx
from dkv.wire import HEADER, MAGIC, MAX_FRAME, PROTOCOL_VERSION, encode_header

TOKEN = b"cluster-token-0123456789"


async def _good_round_trip(clients, address: str, **kwargs) -> None:
    client = clients(address, **kwargs)
    key = BlockKey("L", 0, os.urandom(32))
    await client.write([key], [b"ok" * 100])
    found = await client.lookup([key.hash], ["L"])
    dest = bytearray(200)
    await client.read(found.lease_id, [key], [dest])
    assert dest == b"ok" * 100
    await client.close()


async def _raw_session(address: str, namespace: str = "test/ns0"):
    """A raw connection past the handshake (no token on the node), driven on the UCX loop."""

    async def handshake():
        conn = await connect(*parse_address(address))
        await handshake_as_client(conn, namespace, host="elsewhere")  # the tokenless node's local credential
        return conn

    return OnUcx(await on_ucx(handshake()))


async def _expect_closed_with_error(conn) -> str:
    reply = await conn.recv_message(5)
    assert reply["ok"] is False
    with pytest.raises(TransportError):
        await conn.recv_message(5)  # then the node closes the connection
    conn.abort()
    return reply["code"]


async def test_wrong_hash_length_is_a_value_error_at_the_client(node, clients) -> None:
    client = clients(node.address)
    with pytest.raises(ValueError, match="8 bytes"):
        await client.lookup([b"x" * 7], ["L"])
    with pytest.raises(ValueError):
        await client.write([BlockKey("L", 0, b"x" * 31)], [b"data"])


async def test_wrong_hash_length_on_the_wire_is_refused_by_the_node(node, clients) -> None:
    conn = await _raw_session(node.address)
    await conn.send_message({"op": "lookup", "hashes": [b"x" * 7], "leaves": ["L"], "shards": 1,
                             "lease": True, "group": 0})
    assert await _expect_closed_with_error(conn) == "protocol"
    await _good_round_trip(clients, node.address)


async def test_oversized_frame_is_refused_before_allocation(node, clients) -> None:
    conn = await _raw_session(node.address)
    await conn.send_raw(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, MAX_FRAME + 1, 0))
    assert await _expect_closed_with_error(conn) == "protocol"
    await _good_round_trip(clients, node.address)


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n", os.urandom(16), os.urandom(1000), b"\x00"],
    ids=["http-like", "random-header", "long-garbage", "short-garbage"],
)
async def test_garbage_bytes_close_the_connection_only(node, clients, garbage: bytes) -> None:
    conn = await _raw_session(node.address)
    await conn.send_raw(garbage)
    with pytest.raises(DKVError):
        reply = await conn.recv_message(5)
        assert reply["ok"] is False  # an error reply is fine too, then the close
        await conn.recv_message(5)
    conn.abort()
    await _good_round_trip(clients, node.address)


async def test_undecodable_body_is_refused(node, clients) -> None:
    conn = await _raw_session(node.address)
    body = b"\xc1" * 20
    await conn.send_raw(encode_header(len(body)))
    await conn.send_raw(body)
    assert await _expect_closed_with_error(conn) == "protocol"
    await _good_round_trip(clients, node.address)


async def test_unknown_op_and_missing_fields_are_refused(node, clients) -> None:
    for message in ({"op": "drop_tables"}, {"op": "read", "lease": 1}, {"op": "hello", "v": 1}):
        conn = await _raw_session(node.address)
        await conn.send_message(message)
        assert await _expect_closed_with_error(conn) == "protocol"
    await _good_round_trip(clients, node.address)


async def test_wrong_token_is_refused_and_the_node_serves_the_right_one(node_factory, clients) -> None:
    node = node_factory(token=TOKEN)
    for bad in (None, b"wrong-token-0123456789"):
        with pytest.raises(AuthError, match="token"):
            await clients(node.address, token=bad).connect()
    await _good_round_trip(clients, node.address, token=TOKEN)


async def test_wrong_namespace_is_refused(node_factory, clients) -> None:
    node = node_factory("--namespace", "tenant/allowed")
    with pytest.raises(AuthError, match="namespace"):
        await clients(node.address, namespace="tenant/other").connect()
    with pytest.raises(ValueError, match="namespace"):
        clients(node.address, namespace="bad namespace!")
    await _good_round_trip(clients, node.address, namespace="tenant/allowed")


async def test_namespaces_do_not_share_blocks(node, clients) -> None:
    a, b = clients(node.address, namespace="tenant/a"), clients(node.address, namespace="tenant/b")
    h = os.urandom(32)
    await a.write([BlockKey("L", 0, h)], [b"secret"])
    assert await b.probe([h], ["L"]) == {"L": [False]}
    assert await a.probe([h], ["L"]) == {"L": [True]}


async def test_admin_namespace_may_only_read_stats(node, clients) -> None:
    from dkv.server import ADMIN_NAMESPACE

    conn = await _raw_session(node.address, namespace=ADMIN_NAMESPACE)
    await conn.send_message({"op": "clear"})
    assert await _expect_closed_with_error(conn) == "protocol"
