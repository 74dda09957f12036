"""No client reaches what it was not granted, on any path: real node processes, hostile clients.

* freed bytes of one namespace never reach another (a write that claims the
  same-host path without holding it, a payload shorter than its block);
* a same-host client is handed only its own namespace's memory, read-only for
  a read-only credential;
* tenant credentials grant only their own namespaces;
* a tokenless node admits only clients that can read its local credential,
  whatever interface they come through (UCX listens on every one);
* a peer that cannot prove the credential gets no request answered, so it
  cannot serve a single byte.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from dkv.client import NodeClient
from dkv.client import handshake as handshake_as_client
from dkv.errors import AuthError, DKVError, PeerUnauthenticated
from dkv.keys import BlockKey
from dkv.transport import connect
from dkv.units import parse_address
from dkv.wire import NONCE_SIZE, PROTOCOL_VERSION
from tests.conftest import OnUcx, on_ucx, run_impostor

BLOCK = 64 * 1024
SECRET = 0xAB
TOKEN = b"cluster-token-0123456789"
ACME_SECRET = b"acme-secret-0123456789"
BETA_SECRET = b"beta-secret-0123456789"
READER_SECRET = b"reader-secret-012345678"


async def _raw(address: str, namespace: str) -> Any:
    """A raw session past the handshake, as a client on another host would hold it (no segment)."""

    async def open_() -> Any:
        conn = await connect(*parse_address(address))
        await handshake_as_client(conn, namespace, client_id="raw", host="elsewhere")
        return conn

    return OnUcx(await on_ucx(open_()))


async def _ask(conn: Any, message: dict[str, Any]) -> dict[str, Any]:
    await conn.send_message(message)
    return await conn.recv_message()


async def _freed_secret(clients: Any, address: str) -> None:
    """Namespace tenant/x stores blocks of SECRET bytes, then drops them: their slots are free again."""
    victim = clients(address, namespace="tenant/x", local=False)
    keys = [BlockKey("L", 0, os.urandom(32)) for _ in range(4)]
    assert (await victim.write(keys, [bytes([SECRET]) * BLOCK] * 4)).stored == 4
    assert await victim.clear() == 4


async def _read_back(clients: Any, address: str, namespace: str, key: BlockKey) -> bytes | None:
    """The block's bytes as stored (not checked against a checksum: the test looks at the slot itself)."""
    unchecked = {"checksums": False} if "checksums" in inspect.signature(NodeClient).parameters else {}
    reader = clients(address, namespace=namespace, local=False, **unchecked)
    found = await reader.lookup([key.hash], [key[0]])
    if not found.masks[key[0]][0]:
        return None
    dest = bytearray(BLOCK)
    await reader.read(found.lease_id, [key], [dest])
    return bytes(dest)


async def test_a_write_claiming_the_same_host_path_without_its_segment_publishes_nothing(node_factory, clients) -> None:
    node = node_factory("--pool", "4MiB")
    await _freed_secret(clients, node.address)
    attacker = await _raw(node.address, "tenant/y")
    key = BlockKey("L", 0, os.urandom(32))
    try:
        reply = await _ask(attacker, {"op": "write", "keys": [list(key)], "sizes": [BLOCK], "shm": True})
        if reply["ok"]:  # the node took the client's word: commit without copying anything in
            await _ask(attacker, {"op": "commit", "write": reply["write"]})
    finally:
        await attacker.close()
    leaked = await _read_back(clients, node.address, "tenant/y", key)
    assert leaked is None or bytes([SECRET]) not in leaked, "tenant/y read tenant/x's freed bytes"
    assert reply["ok"] is False and reply["code"] == "shm", reply


async def test_a_payload_shorter_than_its_block_leaks_nothing_of_a_freed_slot(node_factory, clients) -> None:
    node = node_factory("--pool", "4MiB")
    await _freed_secret(clients, node.address)
    attacker = await _raw(node.address, "tenant/y")
    key = BlockKey("L", 0, os.urandom(32))
    try:
        reply = await _ask(attacker, {"op": "write", "keys": [list(key)], "sizes": [BLOCK], "shm": False})
        assert reply["ok"] is True
        await attacker.send_raw(b"\x01")  # one byte for a 64 KiB block
        with contextlib.suppress(DKVError):  # a short payload message is a protocol error: the node hangs up
            await attacker.recv_message()
    finally:
        await attacker.close()
    leaked = await _read_back(clients, node.address, "tenant/y", key)
    assert leaked is None or bytes([SECRET]) not in leaked, "tenant/y read tenant/x's freed bytes"


async def test_a_same_host_client_maps_only_its_own_namespace_and_cannot_touch_another(node_factory,
                                                                                      clients) -> None:
    node = node_factory("--pool", "8MiB")
    victim = clients(node.address, namespace="tenant/x", local=True)
    key = BlockKey("L", 0, os.urandom(32))
    await victim.write([key], [bytes([SECRET]) * BLOCK])
    other = clients(node.address, namespace="tenant/y", local=True)
    await other.connect()
    assert other.uses_shared_memory, "the test runs on the node's host"
    mapping = other._target._mapping  # noqa: SLF001 - what a hostile same-host client can reach
    assert mapping is not None, "the test runs on the node's host"
    reachable = mapping.view
    assert reachable.nbytes > 0
    assert bytes([SECRET]) * 64 not in bytes(reachable), "tenant/y's mapping shows tenant/x's block"
    if mapping.writable:
        reachable[:] = b"\xee" * reachable.nbytes  # scribble over everything it can reach
    found = await victim.lookup([key.hash], ["L"])
    dest = bytearray(BLOCK)
    await victim.read(found.lease_id, [key], [dest])
    assert dest == bytes([SECRET]) * BLOCK, "tenant/x's block changed under another namespace's client"


def _tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(f"""
[tenants.acme]
secret = "{ACME_SECRET.decode()}"
namespaces = ["acme/*"]

[tenants.beta]
secret = "{BETA_SECRET.decode()}"
namespaces = ["beta/*"]

[tenants.reader]
secret = "{READER_SECRET.decode()}"
namespaces = ["acme/*"]
access = "read"
""")
    return path


async def test_a_tenant_credential_grants_its_own_namespaces_and_nothing_of_another(node_factory, clients,
                                                                                    tmp_path) -> None:
    node = node_factory("--tenants", str(_tenants_file(tmp_path)), token=TOKEN)
    await clients(node.address, namespace="acme/m1", tenant="acme", token=ACME_SECRET).connect()
    refused = {
        "another tenant's namespace": dict(namespace="beta/m1", tenant="acme", token=ACME_SECRET),
        "another tenant's name": dict(namespace="beta/m1", tenant="beta", token=ACME_SECRET),
        "an unknown tenant": dict(namespace="acme/m1", tenant="ghost", token=ACME_SECRET),
        "the admin namespace": dict(namespace="dkv.admin", tenant="acme", token=ACME_SECRET),
        "no secret": dict(namespace="acme/m1", tenant="acme", token=None),
    }
    for case, kwargs in refused.items():
        with pytest.raises(AuthError):
            await clients(node.address, **kwargs).connect()
            pytest.fail(f"{case} was accepted")
    for namespace in ("acme/m1", "beta/m1"):  # the operator's cluster token may claim any namespace
        await clients(node.address, namespace=namespace, token=TOKEN).connect()


async def test_a_read_only_tenant_is_handed_a_read_only_segment_and_may_not_write(node_factory, clients,
                                                                                  tmp_path) -> None:
    node = node_factory("--tenants", str(_tenants_file(tmp_path)), token=TOKEN)
    writer = clients(node.address, namespace="acme/m1", tenant="acme", token=ACME_SECRET, local=True)
    key = BlockKey("L", 0, os.urandom(32))
    await writer.write([key], [bytes([SECRET]) * BLOCK])
    reader = clients(node.address, namespace="acme/m1", tenant="reader", token=READER_SECRET, local=True)
    found = await reader.lookup([key.hash], ["L"])
    dest = bytearray(BLOCK)
    await reader.read(found.lease_id, [key], [dest])
    assert dest == bytes([SECRET]) * BLOCK
    mapping = reader._target._mapping  # noqa: SLF001
    assert mapping is not None and not mapping.writable
    with pytest.raises(TypeError):
        mapping.view[:1] = b"\x00"
    with pytest.raises(AuthError, match="forbidden"):
        await reader.write([BlockKey("L", 0, os.urandom(32))], [b"x" * BLOCK])
    with pytest.raises(AuthError, match="forbidden"):
        await reader.clear()


def _other_address_of_this_host() -> str:
    """A non-loopback address of this machine (what a client on the network would dial), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = probe.getsockname()[0]
        return address if not address.startswith("127.") else "127.0.0.1"
    except OSError:
        return "127.0.0.1"


async def test_a_tokenless_node_admits_no_client_that_cannot_read_its_local_credential(node_factory,
                                                                                      clients) -> None:
    node = node_factory()  # --listen 127.0.0.1, no token: UCX listens on every interface all the same
    _, port = parse_address(node.address)

    async def hello_without_proof() -> dict[str, Any]:
        conn = await connect(_other_address_of_this_host(), port)
        try:
            challenge = await conn.recv_message()
            assert challenge["t"] == "challenge"
            await conn.send_message({"op": "hello", "v": PROTOCOL_VERSION, "ns": "test/ns0", "client": "remote",
                                     "proof": None, "host": "elsewhere", "tenant": None,
                                     "cnonce": os.urandom(NONCE_SIZE)})
            reply = await conn.recv_message()
            if reply.get("ok"):
                await conn.send_message({"op": "write", "keys": [["L", 0, os.urandom(32)]], "sizes": [4],
                                         "shm": False})
            return reply
        finally:
            conn.abort()

    reply = await on_ucx(hello_without_proof())
    assert reply["ok"] is False and reply["code"] == "auth", reply
    assert node.ready["shm"], "the node names its local credential file"
    assert os.stat(f"/dev/shm/{node.ready['shm']}").st_mode & 0o077 == 0, "only the node's user can read it"
    await clients(node.address).connect()  # a client of this host and user reads the credential and gets in


@pytest.fixture
def impostor(tmp_path: Path):
    """A process that accepts everyone and serves 0x66 bytes, knowing no credential."""
    with run_impostor(tmp_path, BLOCK) as ready:
        yield ready


async def test_a_peer_that_cannot_prove_the_credential_is_refused_before_any_byte_moves(impostor,
                                                                                       clients) -> None:
    client = clients(impostor["address"], token=TOKEN, local=False, retries=1)
    key = BlockKey("L", 0, os.urandom(32))
    dest = bytearray(BLOCK)
    with pytest.raises(DKVError) as refused:
        found = await client.lookup([key.hash], ["L"])
        await client.read(found.lease_id, [key], [dest])
    assert isinstance(refused.value, PeerUnauthenticated), refused.value
    assert dest == bytes(BLOCK), "not one byte from the impostor"
