"""A listener-path client's control requests over the node's TCP control socket (real node processes).

Lookups (with the blocks they ask for), releases and lease ends take a small
pool of connections to the node's TCP control socket; reads and writes stay
on UCX. These pin where each goes, that the pool stays small, that a control
socket the client cannot reach costs nothing but the way (UCX carries them),
and that a same-host client is left as it was.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from dkv import client as client_module
from dkv.errors import TransportError
from dkv.keys import BlockKey
from dkv.stream_channel import StreamConnection
from dkv.transport import Connection
from tests.conftest import node_stats, on_ucx

BLOCK = 16 * 1024

pytestmark = pytest.mark.timeout(120)


async def _stored(node_address: str, clients, n: int) -> tuple[list[bytes], list[bytes]]:
    hashes = [os.urandom(32) for _ in range(n)]
    data = [os.urandom(BLOCK) for _ in range(n)]
    writer = clients(node_address)
    assert (await writer.write([BlockKey("L", 0, h) for h in hashes], data)).stored == n
    return hashes, data


async def test_lookups_and_releases_take_the_tcp_control_socket_and_reads_take_ucx(node_factory, clients) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, data = await _stored(node.address, clients, 4)
    reader = clients(node.address, local=False)
    raw = reader._target  # noqa: SLF001
    await reader.connect()  # over UCX: the node announces its control port there
    assert raw._control_usable()  # noqa: SLF001

    found = await reader.lookup(hashes, ["L"], group=1)  # asks for no bytes: a lease
    assert found.masks == {"L": [True] * 4} and not found.received
    [control] = raw._control_idle  # noqa: SLF001
    assert isinstance(control.conn, StreamConnection) and control.conn.peer.startswith("tcp:")
    dests = [bytearray(BLOCK) for _ in hashes]
    await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
    assert [bytes(d) for d in dests] == data
    assert raw._idle and all(isinstance(s.conn, Connection) for s in raw._idle)  # noqa: SLF001 - reads: UCX

    again = await reader.lookup(hashes, ["L"], group=2, send=4 * BLOCK)  # its blocks follow on the stream
    assert again.received and raw.lookups_with_payload == 1
    held = await reader.lookup(hashes[:1], ["L"], group=3)
    assert await reader.release(held.lease_id)
    assert raw._control_idle == [control]  # noqa: SLF001 - one connection served them all, in turn
    stats = await node_stats(node.address)
    assert stats["leases"] == 0 and stats["ops"]["lookup"] == 3 and stats["ops"]["release"] == 1, stats


async def test_concurrent_lookups_keep_at_most_a_small_pool_of_control_connections(node_factory, clients) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, _ = await _stored(node.address, clients, 2)
    reader = clients(node.address, local=False, pool_size=4)
    raw = reader._target  # noqa: SLF001
    await reader.connect()

    async def many() -> list[object]:
        return await asyncio.gather(*(raw.lookup(hashes, ["L"], lease=False) for _ in range(12)))

    for answer in await on_ucx(many()):  # (on the client's own loop)
        assert answer.masks == {"L": [True, True]}
    assert 1 <= len(raw._control_idle) <= client_module.CONTROL_POOL  # noqa: SLF001


async def test_a_control_socket_the_client_cannot_reach_sends_control_requests_over_ucx(node_factory, clients,
                                                                                        monkeypatch) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, _ = await _stored(node.address, clients, 2)
    reader = clients(node.address, local=False)
    raw = reader._target  # noqa: SLF001
    await reader.connect()
    tried: list[int] = []

    async def firewalled(host: str, port: int, timeout: float) -> None:  # as a firewall that drops the port
        tried.append(port)
        raise TransportError(f"cannot reach the node's control socket: {host}:{port} timed out")

    monkeypatch.setattr(client_module, "connect_tcp", firewalled)
    found = await reader.lookup(hashes, ["L"], group=1)
    assert found.masks == {"L": [True, True]}
    assert not raw._control_idle and not raw._control_usable()  # noqa: SLF001 - UCX for a while
    assert await reader.release(found.lease_id)
    assert (await reader.lookup(hashes, ["L"], lease=False)).masks == {"L": [True, True]}
    assert tried == [raw._peer_control[0]]  # noqa: SLF001 - tried once, not again on every request


async def test_a_same_host_client_keeps_its_control_requests_on_its_own_control_socket(node_factory, clients) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, _ = await _stored(node.address, clients, 2)
    reader = clients(node.address, local=True)
    raw = reader._target  # noqa: SLF001
    found = await reader.lookup(hashes, ["L"], group=1)
    assert found.masks == {"L": [True, True]}
    assert not raw._control_usable() and not raw._control_idle  # noqa: SLF001
    assert all(s.conn.peer.startswith("local:") for s in raw._idle)  # noqa: SLF001
    assert await reader.release(found.lease_id)


async def test_a_restarted_node_s_new_control_socket_is_used_as_soon_as_a_handshake_announces_it(
        node_factory, clients) -> None:
    first = node_factory("--pool", "16MiB")
    port = int(first.ready["port"])
    hashes, _ = await _stored(first.address, clients, 2)
    reader = clients(first.address, local=False)
    raw = reader._target  # noqa: SLF001
    await reader.connect()
    assert (await reader.lookup(hashes, ["L"], lease=False)).masks == {"L": [True, True]}
    old_control = raw._peer_control[0]  # noqa: SLF001
    assert raw._control_idle  # noqa: SLF001

    first.kill()
    node_factory("--pool", "16MiB", listen=f"127.0.0.1:{port}", ready_timeout=20.0)  # another control port
    # the old control port is gone: this one goes over UCX, whose handshake announces the new one
    assert (await reader.lookup(hashes, ["L"], lease=False)).masks == {"L": [False, False]}
    new_control = raw._peer_control[0]  # noqa: SLF001
    assert new_control != old_control
    assert (await reader.lookup(hashes, ["L"], lease=False)).masks == {"L": [False, False]}
    assert [s.conn.peer for s in raw._control_idle] == [f"tcp:127.0.0.1:{new_control}"]  # noqa: SLF001
