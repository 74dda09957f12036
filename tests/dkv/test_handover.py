"""The segment handover: one-time tickets traded for a descriptor on the node's abstract Unix socket."""

from __future__ import annotations

import os

import pytest

from dkv.arena import PAGE, Arena
from dkv.errors import TransportError
from dkv.handover import HandoverServer, redeem


@pytest.fixture
async def handover():
    arena = Arena(4 * PAGE, label="unit")
    granted: list[tuple[str, bool]] = []

    def share(namespace: str, writable: bool) -> int | None:
        segment = arena.segment(namespace)
        return segment.share(writable) if segment is not None else None

    server = HandoverServer("unit", share, lambda owner, writable: granted.append((owner, writable)))
    await server.start()
    try:
        yield server, arena, granted
    finally:
        await server.close()
        arena.close()


async def test_a_ticket_is_traded_once_for_its_own_namespaces_segment(handover) -> None:
    server, arena, granted = handover
    offset = arena.allocate("ns/a", 5)
    arena.slot("ns/a", offset, 5)[:] = b"hello"
    ticket = server.issue("conn:1", "ns/a", writable=False)
    fd = await redeem(server.name, ticket)
    try:
        assert os.pread(fd, 5, offset) == b"hello"
        with pytest.raises(OSError):
            os.pwrite(fd, b"evil", offset)  # a read-only grant is a read-only descriptor
    finally:
        os.close(fd)
    assert granted == [("conn:1", False)]
    with pytest.raises(TransportError, match="refused"):
        await redeem(server.name, ticket)  # used once
    assert server.granted == 1 and server.refused == 1


async def test_unknown_forgotten_or_garbled_tickets_are_refused(handover) -> None:
    server, _, granted = handover
    with pytest.raises(TransportError, match="refused"):
        await redeem(server.name, os.urandom(32))
    ticket = server.issue("conn:2", "ns/a", writable=True)
    server.forget("conn:2")  # the connection ended before redeeming
    with pytest.raises(TransportError, match="refused"):
        await redeem(server.name, ticket)
    with pytest.raises(TransportError):
        await redeem(server.name, b"short", timeout=1.0)  # never completes a ticket: the node gives up
    assert granted == []


async def test_an_unreachable_socket_is_a_transport_error(handover) -> None:
    with pytest.raises(TransportError):
        await redeem("dkv-no-such-node", os.urandom(32), timeout=1.0)
