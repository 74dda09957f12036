"""Control channels over stream sockets: the node's protocol over an abstract Unix socket, or TCP.

A same-host client's block bytes never cross a transport (it copies them out
of, or into, its mapped namespace segment), so what its loads and offloads
wait on is the control path. Over UCX a round trip costs several times a
plain socket's (each completion hops between UCX's threads and the event
loop); here a control message is one ``send`` of header and body, and a
reply wakes the loop directly.

Same host: a node listens on an abstract socket whose random name it
announces only in the authenticated UCX handshake (``shm.control``), so a
client learns it from the node it meant to reach. Abstract sockets belong to
the network namespace: a client in another one cannot reach it and stays on
UCX.

Other hosts: a node also listens on TCP (:class:`TcpListener`, on its UCX
listen host; its port is announced in the same handshake as
``peer_control``). A client on the listener path opens its calling-thread
channel there (:mod:`dkv.direct_channel`), so a small leased lookup, and the
blocks it may bring (at most what it asks for: the connector's
``lookup_payload_bytes``), costs one kernel round trip instead of UCX's
thread hops. UCX stays the data plane: every read, and every other request.

On these channels the protocol is unchanged: the same challenge, hello,
mutual proof and limits, then the same ops (a client checks that the node id
and epoch match the ones it met over UCX).

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


_CHUNK = 64 * 1024  # one read of control bytes (messages under MAPPED_BODY_MIN are parsed out of these)
_IOV_BATCH = 512  # buffers one sendmsg takes (under the kernel's IOV_MAX of 1024)
_INBOX_MAX = MAPPED_BODY_MIN + HEADER_SIZE + _CHUNK  # bytes read ahead with no receive posted; then reading pauses


class _Expired(Exception):
    """A bounded wait's time ran out (set on its future by its timer; never leaves this module)."""


class _Receive:
    """What the reader fills now: one framed message, or payload buffers filled in place."""

    __slots__ = ("future", "max_frame", "length", "views", "index", "got", "body", "deadline")

    def __init__(self, future: asyncio.Future[Any], max_frame: int, views: list[memoryview] | None = None) -> None:
        self.future = future
        self.deadline = 0.0  # the loop's time by which it must be answered (set as it is posted)
        self.max_frame = max_frame
        self.length: int | None = None  # a message's body length, once its header is in
        self.views = views or []  # filled straight from the socket (payloads, or a large body)
        self.index = 0
        self.got = 0
        self.body: mmap.mmap | None = None  # a large message body, filled in place

    def fill(self, data: memoryview) -> int:
        """Copy what fits of ``data`` into the views; how many bytes were taken."""
        taken = 0
        while self.index < len(self.views) and taken < len(data):
            view = self.views[self.index]
            n = min(view.nbytes - self.got, len(data) - taken)
            view[self.got:self.got + n] = data[taken:taken + n]
            taken += n
            self.got += n
            self.skip_full()
        return taken

    def skip_full(self) -> None:
        while self.index < len(self.views) and self.got == self.views[self.index].nbytes:
            self.index += 1
            self.got = 0

    @property
    def filled(self) -> bool:
        return self.index == len(self.views)


class StreamConnection:
    """One stream connection (Unix or TCP): framed messages plus raw payloads, one exchange at a time.

    The socket is watched for reads once, for the connection's life (not once
    per receive): what arrives is read into a small inbox, and a posted
    receive is answered from it, or, for payloads and bodies of at least
    ``MAPPED_BODY_MIN`` bytes, filled straight from the socket into its
    buffers. With no receive posted, at most ``_INBOX_MAX`` bytes are read
    ahead; then reading pauses until one is. A send writes at once and waits
    only for what the kernel did not take. Every wait is bounded; a wait that
    times out, is cancelled or fails aborts the connection before it raises.
    """

    def __init__(self, sock: socket.socket, peer: str, max_frame: int = MAX_FRAME) -> None:
        sock.setblocking(False)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        self._sock: socket.socket | None = sock
        self.peer = peer
        self.max_frame = max_frame
        self._loop = asyncio.get_running_loop()
        self._inbox = bytearray()
        self._chunk = bytearray(_CHUNK)
        self._chunk_view = memoryview(self._chunk)
        self._want: _Receive | None = None
        self._ended: BaseException | None = None  # what the reader met: the peer's close or a socket error
        self._reading = False
        self._bound: asyncio.TimerHandle | None = None  # the receive's bound (see _bound_receive)
        self._bound_at = 0.0  # when _bound fires
        self._watch()

    @property
    def closed(self) -> bool:
        """True once aborted here, or once the peer closed its end. Safe from any thread; never reads.

        While the reader watches the socket it notices the peer's close
        itself, as UCX's error callback does for a UCX connection, so this is
        a flag: no system call, which on the engine's scheduler thread would
        let go of the GIL to a busy loop thread (``leases_lost`` asks this
        per load). With reading paused (read-ahead full), a peek looks.
        """
        sock = self._sock
        if sock is None or self._ended is not None:
            return True
        if self._reading:
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""  # b"": the peer's end is closed
        except BlockingIOError:
            return False
        except OSError:
            return True

    # ---- the reader (loop thread) -------------------------------------------------------------

    def _watch(self) -> None:
        if not self._reading and self._sock is not None and self._ended is None:
            self._loop.add_reader(self._sock, self._readable)
            self._reading = True

    def _unwatch(self) -> None:
        if self._reading and self._sock is not None:
            with contextlib.suppress(Exception):  # the loop may be closing
                self._loop.remove_reader(self._sock)
        self._reading = False

    def _readable(self) -> None:
        sock, want = self._sock, self._want
        if sock is None:
            return
        try:
            if want is not None and want.views and not want.filled:  # payloads, or a large body: straight into place
                n = sock.recv_into(want.views[want.index][want.got:])
                if n:
                    want.got += n
                    want.skip_full()
            else:
                room = _CHUNK if want is not None else min(_CHUNK, _INBOX_MAX - len(self._inbox))
                if room <= 0:
                    self._unwatch()  # nobody is reading: leave the rest in the kernel's buffer
                    return
                n = sock.recv_into(self._chunk_view[:room])
                if n:
                    self._inbox += self._chunk_view[:n]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._end(exc)
            return
        if n == 0:
            self._end(ConnectionResetError("the peer closed the connection"))
            return
        self._progress()

    def _end(self, exc: BaseException) -> None:
        """The stream ended (the peer closed it, or the socket failed): stop reading, fail the receive."""
        self._ended = exc
        self._unwatch()
        self._progress()

    def _progress(self) -> None:
        """Answer the posted receive as far as what has arrived allows."""
        want = self._want
        if want is None or want.future.done():
            return
        inbox = self._inbox
        try:
            if want.views and not want.filled and inbox:
                taken = want.fill(memoryview(inbox))
                del inbox[:taken]
            if want.views:
                if not want.filled:
                    if self._ended is not None:
                        self._fail(want, self._ended_error())
                    return
                result: Any = decode_body(want.body) if want.body is not None else None
            else:  # a message parsed from the inbox
                if want.length is None:
                    if len(inbox) < HEADER_SIZE:
                        if self._ended is not None:
                            self._fail(want, self._ended_error())
                        return
                    want.length = decode_header(inbox, want.max_frame)  # (it reads the first HEADER_SIZE bytes)
                    del inbox[:HEADER_SIZE]
                    if want.length >= MAPPED_BODY_MIN:  # large: filled in place, out of the heap
                        want.body = mmap.mmap(-1, want.length)
                        want.views = [memoryview(want.body)]
                        self._progress()
                        return
                length = want.length
                if len(inbox) < length:
                    if self._ended is not None:
                        self._fail(want, self._ended_error())
                    return
                if len(inbox) == length:  # the usual: the message and nothing after it, decoded in place
                    try:
                        result = decode_body(inbox)
                    finally:
                        inbox.clear()  # (taken even when it does not decode, as a copied body would be)
                else:
                    body = bytes(inbox[:length])
                    del inbox[:length]
                    result = decode_body(body)
        except Exception as exc:  # noqa: BLE001 - a bad header or body: the waiter raises it
            self._fail(want, exc)
            return
        self._want = None
        want.future.set_result(result)

    def _ended_error(self) -> OSError:
        """A fresh error for how the stream ended (never the stored one raised again: its traceback would pin frames)."""
        ended = self._ended
        if isinstance(ended, OSError) and ended.errno is not None:
            return OSError(ended.errno, ended.strerror)
        return ConnectionResetError(str(ended) or "the peer closed the connection")

    def _fail(self, want: _Receive, exc: BaseException) -> None:
        """End ``want`` with ``exc``, first giving back a large body's mapping (a dead sender must cost nothing)."""
        if self._want is want:
            self._want = None
        if want.body is not None:
            for view in want.views:
                view.release()
            want.body.close()
            want.body, want.views = None, []
        if not want.future.done():
            want.future.set_exception(exc)

    # ---- waits ----------------------------------------------------------------------------------

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise TransportError(f"connection to {self.peer} is closed")
        return self._sock

    def _aborted(self, exc: BaseException, what: str, timeout: float) -> BaseException:
        """A bounded wait's failure as this connection's error, the connection aborted first.

        A timeout is :class:`OpTimeout`, an ``OSError`` a
        :class:`TransportError`; anything else (a cancellation) is itself,
        to be raised again. (A plain ``except`` in each wait: a generator
        context manager costs a few µs a wait, on every request a node serves.)
        """
        self.abort()
        if isinstance(exc, (TimeoutError, _Expired)):
            return OpTimeout(f"{what} to {self.peer} timed out after {timeout:.1f}s")
        if isinstance(exc, OSError):
            return TransportError(f"{what} with {self.peer} failed: {exc}")
        return exc

    async def _bounded(self, awaitable: Awaitable[Any], timeout: float, what: str) -> Any:
        try:
            async with asyncio.timeout(timeout):
                return await awaitable
        except (TimeoutError, _Expired, asyncio.CancelledError, OSError) as exc:
            failure = self._aborted(exc, what, timeout)
            if failure is exc:
                raise
            raise failure from exc

    def _bound_receive(self, want: _Receive, timeout: float) -> None:
        """Fail ``want`` with :class:`_Expired` if it is still waiting ``timeout`` seconds from now.

        One timer per connection, not one per receive: a timer made and
        cancelled costs a few µs (more run cold, as a node's loop runs between
        requests), paid by the node on every request it waits for. A receive
        only notes its deadline; the timer is moved only where it would fire
        too late for it (a shorter bound than the one it was set for). When it
        fires it fails the waiting receive if that one's deadline has passed,
        and otherwise is set again for it (receives answered in between cost
        nothing more).
        """
        want.deadline = deadline = self._loop.time() + timeout
        bound = self._bound
        if bound is not None:
            if self._bound_at <= deadline:
                return
            bound.cancel()
        self._bound_at = deadline
        self._bound = self._loop.call_at(deadline, self._bound_reached)

    def _bound_reached(self) -> None:
        self._bound = None
        want = self._want
        if want is None or want.future.done():
            return  # nobody waits now: the next receive sets the timer again
        if self._loop.time() >= want.deadline:
            want.future.set_exception(_Expired())
        else:
            self._bound_at = want.deadline
            self._bound = self._loop.call_at(want.deadline, self._bound_reached)

    def _unbind(self) -> None:
        bound, self._bound = self._bound, None
        if bound is not None:
            bound.cancel()

    async def _receive(self, want: _Receive, timeout: float) -> Any:
        """Post ``want`` and wait for it, for at most ``timeout`` seconds (answered at once when the inbox holds it).

        A wait that times out, is cancelled or fails aborts the connection
        (:meth:`_aborted`); a plain ``except``, with no ``asyncio.timeout``,
        as these waits come once per request a node serves.
        """
        self._socket()
        if self._want is not None:
            raise TransportError(f"connection to {self.peer}: a receive is already waiting")
        self._want = want
        self._watch()
        if self._inbox or self._ended is not None:  # (else nothing has come that could answer it yet)
            self._progress()
        future = want.future
        try:
            if future.done():
                try:
                    return future.result()
                except OSError as exc:
                    self.abort()
                    raise TransportError(f"receive with {self.peer} failed: {exc}") from exc
            self._bound_receive(want, timeout)
            try:
                return await future
            except (_Expired, asyncio.CancelledError, OSError) as exc:
                failure = self._aborted(exc, "receive", timeout)
                if failure is exc:
                    raise
                raise failure from exc
        finally:
            if self._want is want:
                self._want = None

    def _sent_now(self, write: Callable[[Any], int], data: Any, what: str) -> int:
        """The bytes the kernel took at once of ``write(data)`` (a non-blocking ``send`` or ``sendmsg``): 0 where it
        took none; a write that failed aborts the connection and raises :class:`TransportError`."""
        try:
            return write(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self.abort()
            raise TransportError(f"{what} with {self.peer} failed: {exc}") from exc

    async def _send(self, data: Any, timeout: float, what: str) -> None:
        """Write ``data``; wait (bounded) only for what the kernel did not take at once."""
        await self._send_gathered((data,), timeout, what)

    async def _send_gathered(self, buffers: Sequence[Any], timeout: float, what: str) -> None:
        """Write ``buffers`` back to back, as few system calls as the kernel takes (``sendmsg``, up to ``_IOV_BATCH`` at once).

        One write of a reply and the blocks after it wakes its reader once;
        a write each could wake it for the first and leave it to sleep
        again on the next. A wait (bounded) only for what the kernel did not
        take at once.
        """
        sock = self._socket()
        views = [view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes]
        at = 0
        while at < len(views):
            batch = views[at:at + _IOV_BATCH]
            sent = self._sent_now(sock.sendmsg, batch, what)
            for view in batch:
                at += 1
                if sent >= view.nbytes:
                    sent -= view.nbytes
                    continue
                await self._bounded(self._loop.sock_sendall(sock, view[sent:]), timeout, what)
                break

    # ---- the interface of dkv.transport.Connection ----------------------------------------------

    async def send_message(self, message: dict[str, Any], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send one framed msgpack message (header and body in one write).

        Written here with one ``send`` (a node's reply nearly always goes at
        once); only what the kernel did not take goes the way of
        :meth:`_send_gathered`.
        """
        body = encode_body(message)
        frame = encode_header(len(body)) + body
        sent = self._sent_now(self._socket().send, frame, "send")
        if sent < len(frame):
            await self._send_gathered((memoryview(frame)[sent:],), timeout, "send")

    async def recv_message(self, timeout: float = DEFAULT_TIMEOUT, max_frame: int | None = None) -> dict[str, Any]:
        """Receive one framed message; the header is validated before the body is allocated (see transport)."""
        want = _Receive(self._loop.create_future(), self.max_frame if max_frame is None else max_frame)
        message: dict[str, Any] = await self._receive(want, timeout)
        return message

    async def send_message_with(self, message: dict[str, Any], trailing: Sequence[Any],
                                timeout: float = DEFAULT_TIMEOUT) -> bool:
        """:meth:`send_message`, then ``trailing``'s bytes, in one gathered write; True (a stream carries any amount).

        The bytes on the stream are those of :meth:`send_message` then
        :meth:`send_payloads` (a stream has no message boundaries), so the
        receiver reads them the same way.
        """
        body = encode_body(message)
        await self._send_gathered([encode_header(len(body)) + body, *trailing], timeout, "send")
        return True

    async def send_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT,
                            groups: Any = None) -> None:
        """Send each buffer's bytes, in order (a stream carries no message boundaries, so ``groups`` are moot)."""
        await self._send_gathered(buffers, timeout, "payload send")

    async def recv_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT,
                            landed: Callable[[int, int], None] | None = None, groups: Any = None) -> None:
        """Fill each buffer, in order; then ``landed(0, len(buffers))`` (as :meth:`dkv.transport.Connection.recv_payloads`).

        A stream carries no message boundaries, so announced ``groups`` are moot here.
        """
        views = [view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes]
        if views:
            await self._receive(_Receive(self._loop.create_future(), self.max_frame, views), timeout)
        if landed is not None and buffers:
            landed(0, len(buffers))

    async def send_raw(self, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send bytes with no framing (tests of the node's defences use this)."""
        await self._send(data, timeout, "send")

    def detach(self) -> socket.socket:
        """Hand the socket over (it leaves the loop; this connection is closed): for :mod:`dkv.direct_channel`.

        Only between exchanges: with a receive posted, or bytes read ahead
        that nobody asked for (the stream would be out of step), it raises
        :class:`TransportError` and aborts instead.
        """
        sock = self._socket()
        if self._want is not None or self._inbox or self._ended is not None:
            self.abort()
            raise TransportError(f"connection to {self.peer} is mid-exchange: it cannot be handed over")
        self._unwatch()
        self._unbind()
        self._sock = None
        self._ended = ConnectionAbortedError("handed over")
        return sock

    def abort(self) -> None:
        """Close at once; a receive still waiting fails. Idempotent."""
        self._unwatch()
        self._unbind()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        want = self._want
        if want is not None:
            self._fail(want, ConnectionAbortedError(f"connection to {self.peer} was aborted"))

    async def close(self) -> None:
        self.abort()


def listen_abstract(name: str, backlog: int) -> socket.socket:
    """A non-blocking Unix stream socket listening on the abstract address ``name`` (no file left behind)."""
    return _listening(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), "\0" + name, backlog)


async def connect_local(name: str, timeout: float = CONNECT_TIMEOUT) -> StreamConnection:
    """Connect to a node's control socket ``name`` (abstract) within ``timeout``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    return await _connect(sock, "\0" + name, f"local:{name}", timeout)


def listen_tcp(host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port`` (port 0: a free one)."""
    return _listening(_tcp_socket(host), (host, port), backlog, reuse=True)


async def connect_tcp(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> StreamConnection:
    """Connect to a node's TCP control socket (:class:`TcpListener`) within ``timeout``; Nagle off."""
    sock = _tcp_socket(host)
    _no_delay(sock)
    return await _connect(sock, (host, port), f"tcp:{host}:{port}", timeout)


def _tcp_socket(host: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)


def _listening(sock: socket.socket, address: Any, backlog: int, *, reuse: bool = False) -> socket.socket:
    """``sock`` bound to ``address`` and listening, non-blocking; closed when a step fails."""
    try:
        if reuse:  # (a restarted node takes its port back while old connections linger in TIME_WAIT)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _no_delay(sock: socket.socket) -> None:
    """Send each control message at once (Nagle would hold a small reply back for the peer's ack)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _connect(sock: socket.socket, address: Any, peer: str, timeout: float) -> StreamConnection:
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await asyncio.get_running_loop().sock_connect(sock, address)
    except (TimeoutError, OSError) as exc:
        sock.close()
        raise TransportError(f"cannot reach the node's control socket: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return StreamConnection(sock, peer)


class StreamListener:
    """A node's control socket: hands each accepted connection to ``handler`` as a :class:`StreamConnection`.

    Admission is the handler's (the node bounds unauthenticated connections
    as it does on UCX); this only accepts. Every handler task is owned and
    cancelled by :meth:`close`. Subclasses say where it listens (:meth:`_listen`).
    """

    kind = "stream"

    def __init__(self, handler: Callable[[StreamConnection], Awaitable[None]]) -> None:
        self._handler = handler
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._count = 0

    def _listen(self) -> socket.socket:
        raise NotImplementedError

    def _accepted(self, sock: socket.socket) -> None:
        """Set up an accepted socket before it is served."""

    async def start(self) -> None:
        self._sock = self._listen()
        self._accepting = asyncio.create_task(self._accept_forever(), name=f"dkv-control-{self.kind}")

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
                self._accepted(conn)
            except OSError as exc:  # out of descriptors, say: back off rather than spin
                log.warning("%s control socket accept failed: %s", self.kind, exc)
                await asyncio.sleep(0.1)
                continue
            self._count += 1
            task = asyncio.create_task(self._handler(StreamConnection(conn, f"{self.kind}#{self._count}")))
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


class LocalListener(StreamListener):
    """The node's same-host control socket, on a random abstract name (announced only in the UCX handshake)."""

    kind = "local"

    def __init__(self, label: str, handler: Callable[[StreamConnection], Awaitable[None]]) -> None:
        super().__init__(handler)
        self.name = f"dkv-ctl-{label}-{secrets.token_hex(8)}"

    def _listen(self) -> socket.socket:
        return listen_abstract(self.name, BACKLOG)


class TcpListener(StreamListener):
    """The node's control socket for clients on other hosts: the same protocol over TCP (see the module docstring).

    ``port`` 0 takes a free one; :attr:`port` is the one bound, once started.
    """

    kind = "tcp"

    def __init__(self, host: str, port: int, handler: Callable[[StreamConnection], Awaitable[None]]) -> None:
        super().__init__(handler)
        self.host, self.port = host, port

    def _listen(self) -> socket.socket:
        """:class:`TransportError` (said plainly) when the address cannot be had: a port in use, say."""
        try:
            sock = listen_tcp(self.host, self.port, BACKLOG)
        except OSError as exc:
            raise TransportError(f"cannot listen for the TCP control socket on {self.host}:{self.port}: "
                                 f"{exc.strerror or exc} (--peer-control-port)") from exc
        self.port = sock.getsockname()[1]
        return sock

    def _accepted(self, sock: socket.socket) -> None:
        _no_delay(sock)
