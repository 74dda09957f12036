"""Handing a same-host client its namespace segment by file descriptor, after authentication.

The node listens on an abstract Unix socket (no file to leave behind; reachable
from this host's network namespace only). A client that completed the UCX
handshake got a one-time ``ticket`` in the node's hello reply; it connects
here, sends the ticket, and receives one status byte with the segment's
descriptor attached (``SCM_RIGHTS``): read-write for a credential that
writes, a read-only descriptor (which cannot be mapped writable) otherwise.
Only then does the node let that connection use the same-host path.

Tickets are 32 random bytes, bound to one connection, valid for
:data:`TICKET_TTL` seconds and used once. Every exchange is bounded in time,
and at most :data:`MAX_EXCHANGES` run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from dkv.errors import TransportError
from dkv.stream_channel import listen_abstract

log = logging.getLogger(__name__)

TICKET_SIZE = 32
TICKET_TTL = 10.0
EXCHANGE_TIMEOUT = 2.0
MAX_EXCHANGES = 64
GRANTED, REFUSED = b"\x01", b"\x00"


@dataclass
class _Ticket:
    conn_owner: str
    namespace: str
    writable: bool
    expires_at: float


class HandoverServer:
    """The node's side: issues tickets and answers redemptions on its abstract Unix socket.

    ``share(namespace, writable)`` returns a fresh descriptor of the
    namespace's segment (closed here once sent) or ``None`` when there is
    none; ``on_granted(conn_owner, writable)`` marks the connection as holding
    the mapping. Both run on the node's loop.
    """

    def __init__(self, label: str, share: Callable[[str, bool], int | None],
                 on_granted: Callable[[str, bool], None]) -> None:
        self.name = f"dkv-{label}-{os.getpid()}-{secrets.token_hex(6)}"
        self._share = share
        self._on_granted = on_granted
        self._tickets: dict[bytes, _Ticket] = {}
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._exchanges: set[asyncio.Task[None]] = set()
        self.granted = 0
        self.refused = 0

    async def start(self) -> None:
        self._sock = listen_abstract(self.name, MAX_EXCHANGES)
        self._accepting = asyncio.create_task(self._accept_forever(), name="dkv-handover")

    def issue(self, conn_owner: str, namespace: str, writable: bool) -> bytes:
        """A one-time ticket for ``conn_owner`` to fetch ``namespace``'s segment."""
        now = time.monotonic()
        for ticket, held in list(self._tickets.items()):  # bounded by connections: drop the stale ones
            if held.expires_at < now:
                del self._tickets[ticket]
        ticket = secrets.token_bytes(TICKET_SIZE)
        self._tickets[ticket] = _Ticket(conn_owner, namespace, writable, now + TICKET_TTL)
        return ticket

    def forget(self, conn_owner: str) -> None:
        """Void the tickets of a connection that ended."""
        for ticket, held in list(self._tickets.items()):
            if held.conn_owner == conn_owner:
                del self._tickets[ticket]

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        tasks = [t for t in (self._accepting, *self._exchanges) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._tickets.clear()

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            if len(self._exchanges) >= MAX_EXCHANGES:
                conn.close()
                self.refused += 1
                continue
            task = asyncio.create_task(self._exchange(conn), name="dkv-handover-exchange")
            self._exchanges.add(task)
            task.add_done_callback(self._exchanges.discard)

    async def _exchange(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fd = None
        try:
            conn.setblocking(False)
            async with asyncio.timeout(EXCHANGE_TIMEOUT):
                ticket = b""
                while len(ticket) < TICKET_SIZE:
                    chunk = await loop.sock_recv(conn, TICKET_SIZE - len(ticket))
                    if not chunk:
                        return
                    ticket += chunk
            held = self._tickets.pop(ticket, None)
            if held is None or held.expires_at < time.monotonic():
                self.refused += 1
                await loop.sock_sendall(conn, REFUSED)
                return
            fd = self._share(held.namespace, held.writable)
            if fd is None:
                self.refused += 1
                await loop.sock_sendall(conn, REFUSED)
                return
            self._on_granted(held.conn_owner, held.writable)  # before the client can use it
            socket.send_fds(conn, [GRANTED], [fd])  # one byte into an empty socket buffer: never blocks
            self.granted += 1
        except (OSError, TimeoutError) as exc:
            log.debug("segment handover failed: %s", exc)
        finally:
            if fd is not None:
                os.close(fd)
            conn.close()


async def redeem(name: str, ticket: bytes, timeout: float = EXCHANGE_TIMEOUT) -> int:
    """The client's side: trade ``ticket`` for a segment descriptor (the caller closes it).

    :class:`TransportError` when the socket is unreachable (another host or
    network namespace), the ticket is refused, or the exchange runs past
    ``timeout``.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, "\0" + name)
            await loop.sock_sendall(sock, ticket)
            readable = loop.create_future()
            loop.add_reader(sock.fileno(), lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(sock.fileno())
            status, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    except (OSError, TimeoutError) as exc:
        raise TransportError(f"segment handover on {name!r} failed: {exc}") from exc
    finally:
        sock.close()
    if status != GRANTED or not fds:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise TransportError(f"segment handover on {name!r} refused")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]
