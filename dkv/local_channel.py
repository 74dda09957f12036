"""Same-host control channel: the node's protocol over an abstract Unix stream socket.

A same-host client's block bytes never cross a transport (it copies them out
of, or into, its mapped namespace segment), so what its loads and offloads
wait on is the control path. Over UCX a round trip costs several times a
plain socket's (each completion hops between UCX's threads and the event
loop); here a control message is one ``send`` of header and body, and a
reply wakes the loop directly.

A node listens on an abstract socket whose random name it announces only in
the authenticated UCX handshake (``shm.control``), so a client learns it from
the node it meant to reach. On this channel the protocol is unchanged: the
same challenge, hello, mutual proof and limits, then the same ops (a client
checks that the node id and epoch match the ones it met over UCX). Abstract
sockets belong to the network namespace: a client in another one cannot
reach it and stays on UCX.

:class:`StreamConnection` offers the interface of
:class:`dkv.transport.Connection` (framed messages, raw payloads, bounded
awaits, abort-before-raise), so the node's connection handler serves both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dkv.errors import OpTimeout, TransportError
from dkv.wire import HEADER_SIZE, MAX_FRAME, decode_body, decode_header, encode_body, encode_header

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
CONNECT_TIMEOUT = 2.0
BACKLOG = 128
MAPPED_BODY_MIN = 256 * 1024  # as dkv.transport: large bodies in a mapping of their own
SOCKET_BUFFER = 1 << 20  # kernel buffers big enough that a message of a few hundred KiB is one write


class StreamConnection:
    """One Unix stream connection: framed messages plus raw payloads, one exchange at a time."""

    def __init__(self, sock: socket.socket, peer: str, max_frame: int = MAX_FRAME) -> None:
        sock.setblocking(False)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        self._sock: socket.socket | None = sock
        self.peer = peer
        self.max_frame = max_frame
        self._header = bytearray(HEADER_SIZE)
        self._loop = asyncio.get_running_loop()

    @property
    def closed(self) -> bool:
        """True once aborted here, or once the node closed its end (seen without reading: safe from any thread)."""
        sock = self._sock
        if sock is None:
            return True
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""  # b"": the peer's end is closed
        except BlockingIOError:
            return False
        except OSError:
            return True

    async def _bounded(self, awaitable: Awaitable[Any], timeout: float, what: str) -> Any:
        try:
            async with asyncio.timeout(timeout):
                return await awaitable
        except TimeoutError as exc:
            self.abort()
            raise OpTimeout(f"{what} to {self.peer} timed out after {timeout:.1f}s") from exc
        except asyncio.CancelledError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise TransportError(f"{what} with {self.peer} failed: {exc}") from exc

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise TransportError(f"connection to {self.peer} is closed")
        return self._sock

    async def _recv_into(self, buffer: Any) -> None:
        view = memoryview(buffer).cast("B")
        sock, got = self._socket(), 0
        while got < view.nbytes:
            n = await self._loop.sock_recv_into(sock, view[got:])
            if n == 0:
                raise ConnectionResetError("the peer closed the connection")
            got += n

    async def send_message(self, message: dict[str, Any], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send one framed msgpack message (header and body in one write)."""
        body = encode_body(message)
        frame = encode_header(len(body)) + body
        await self._bounded(self._loop.sock_sendall(self._socket(), frame), timeout, "send")

    async def recv_message(self, timeout: float = DEFAULT_TIMEOUT, max_frame: int | None = None) -> dict[str, Any]:
        """Receive one framed message; the header is validated before the body is allocated (see transport)."""
        await self._bounded(self._recv_into(self._header), timeout, "receive")
        length = decode_header(self._header, self.max_frame if max_frame is None else max_frame)
        body: bytearray | mmap.mmap = bytearray(length) if length < MAPPED_BODY_MIN else mmap.mmap(-1, length)
        if length:
            await self._bounded(self._recv_into(body), timeout, "receive")
        return decode_body(body)

    async def send_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send each buffer's bytes, in order (the stream needs no per-buffer framing)."""

        async def send_all() -> None:
            sock = self._socket()
            for buffer in buffers:
                await self._loop.sock_sendall(sock, memoryview(buffer).cast("B"))

        await self._bounded(send_all(), timeout, "payload send")

    async def recv_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Fill each buffer, in order."""

        async def recv_all() -> None:
            for buffer in buffers:
                await self._recv_into(buffer)

        await self._bounded(recv_all(), timeout, "payload receive")

    async def send_raw(self, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send bytes with no framing (tests of the node's defences use this)."""
        await self._bounded(self._loop.sock_sendall(self._socket(), data), timeout, "send")

    def abort(self) -> None:
        """Close at once. Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    async def close(self) -> None:
        self.abort()


def listen_abstract(name: str, backlog: int) -> socket.socket:
    """A non-blocking Unix stream socket listening on the abstract address ``name`` (no file left behind)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def connect_local(name: str, timeout: float = CONNECT_TIMEOUT) -> StreamConnection:
    """Connect to a node's control socket ``name`` (abstract) within ``timeout``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await asyncio.get_running_loop().sock_connect(sock, "\0" + name)
    except (TimeoutError, OSError) as exc:
        sock.close()
        raise TransportError(f"cannot reach the node's control socket: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return StreamConnection(sock, f"local:{name}")


class LocalListener:
    """The node's control socket: hands each accepted connection to ``handler`` as a :class:`StreamConnection`.

    Admission is the handler's (the node bounds unauthenticated connections
    as it does on UCX); this only accepts. Every handler task is owned and
    cancelled by :meth:`close`.
    """

    def __init__(self, label: str, handler: Callable[[StreamConnection], Awaitable[None]]) -> None:
        self.name = f"dkv-ctl-{label}-{secrets.token_hex(8)}"
        self._handler = handler
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._count = 0

    async def start(self) -> None:
        self._sock = listen_abstract(self.name, BACKLOG)
        self._accepting = asyncio.create_task(self._accept_forever(), name="dkv-control")

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # out of descriptors, say: back off rather than spin
                log.warning("control socket accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._count += 1
            task = asyncio.create_task(self._handler(StreamConnection(conn, f"local#{self._count}")))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop accepting and end every connection's task. Idempotent."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
