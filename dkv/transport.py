"""UCX transport: the only module of dKV that imports ``ucxx``.

A :class:`Connection` is one UCX endpoint carrying framed control messages and
raw block payloads, strictly one request/response at a time (the client pool
opens more connections for concurrency). Every await here is bounded: on a
timeout or a transport error the endpoint is aborted *before* the error is
raised, so no late UCX receive can land in a buffer the caller has already
reused or freed.

Progress mode: see :func:`init_transport`. UCX progress and request
completion are bound to the loop that initialises UCX, so a process drives
all its UCX work from one loop (a node's, or :mod:`dkv.loop_thread`'s shared
one).

Lifetime: UCX runs a progress thread and a (non-daemon) notifier thread, so a
process that leaves it initialised never exits. Whoever owns the process's UCX
loop calls :func:`stop_progress` as that loop ends (a node, the shared loop
thread, a CLI command). Library users need not: clients, loop threads and
listeners count themselves as users (:func:`hold_transport`,
:func:`release_transport`), and the last user to leave, on the loop that
initialised UCX and with no connection left open, stops it. A later user
initialises it again.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx  # noqa: E402
from ucxx._lib_async.application_context import ProgressTasks  # noqa: E402

from dkv.errors import OpTimeout, TransportError  # noqa: E402
from dkv.wire import HEADER_SIZE, MAX_FRAME, decode_body, decode_header, encode_body, encode_header  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0
# How long closing an endpoint waits for UCX to confirm (ns). The close is forced, so
# UCX cancels the endpoint's outstanding requests either way; waiting longer only
# matters when another thread owns progress of the worker.
CLOSE_PERIOD_NS = 200_000_000
# Bodies at least this large are received into an anonymous mapping of their own rather than a
# bytearray: its pages cost memory only once bytes land in them (a header announcing 8 MiB and
# then nothing costs none), and unmapping gives them back to the system at once (glibc keeps
# freed heap chunks of this size, having raised its mmap threshold after the first one).
MAPPED_BODY_MIN = 256 * 1024
_initialised = False
_live: set[Connection] = set()
_owner_loop: weakref.ReferenceType[asyncio.AbstractEventLoop] | None = None  # the loop that initialised UCX
_users = 0  # see hold_transport
_users_lock = threading.Lock()


def open_connections() -> int:
    """How many connections of this process are open (a leak check reads this)."""
    return len(_live)


def init_transport(progress_mode: str | None = None) -> None:
    """Initialise UCX for this process once (idempotent).

    ``thread`` progress (the default) runs UCX progress in its own thread,
    blocked in epoll when idle, and completes requests through Python futures
    on the loop that initialised UCX: no busy-waiting. ucxx 0.52's ``blocking``
    and ``polling`` modes complete requests by yielding in a loop, which keeps
    a core busy for as long as any request is pending (an idle server always
    has one); they stay available through ``DKV_UCX_PROGRESS`` for measurement.
    """
    global _initialised, _owner_loop
    if _initialised:
        return
    try:
        _owner_loop = weakref.ref(asyncio.get_running_loop())
    except RuntimeError:  # no loop runs here: ucxx binds to one it makes; never stopped by release_transport
        _owner_loop = None
    mode = progress_mode or os.environ.get("DKV_UCX_PROGRESS", "thread")
    threaded = mode.startswith("thread")
    ucxx.init(
        progress_mode=mode,
        enable_python_future=threaded,
        enable_delayed_submission=threaded and os.environ.get("DKV_UCX_DELAYED_SUBMISSION", "0") == "1",
    )
    _initialised = True


def hold_transport() -> None:
    """Count one user of UCX in this process (initialising it if needed); pair with :func:`release_transport`.

    Users are the clients that opened a connection, the loop threads and the
    listeners: while any holds it, UCX stays up.
    """
    global _users
    init_transport()
    with _users_lock:
        _users += 1


def drop_transport() -> None:
    """Drop one user without stopping UCX (for users whose owner calls :func:`stop_progress` itself)."""
    global _users
    with _users_lock:
        _users = max(0, _users - 1)


async def release_transport() -> None:
    """Drop one user; the last one stops UCX (:func:`stop_progress`) when this is the loop that initialised it.

    UCX is left running while a connection is still open (one opened with
    :func:`connect` directly is no counted user), or when called from another
    loop than UCX's own (its threads belong to that loop's owner).
    """
    drop_transport()
    if _users or _live or not _initialised:
        return
    owner = _owner_loop() if _owner_loop is not None else None
    if owner is not None and owner is asyncio.get_running_loop():
        await stop_progress()


async def stop_progress() -> None:
    """Stop driving UCX from the running loop, and shut UCX down for this process (idempotent).

    Called by whoever owns the process's UCX loop as that loop ends (a node's
    shutdown, the shared loop thread's, a CLI command's): the progress and
    notifier threads are stopped, so the interpreter can exit.
    """
    global _initialised, _owner_loop
    orphans = list(_orphaned_handshakes)  # UCX goes down with them, so nothing of theirs lands later
    for handshake in orphans:
        handshake.cancel()
    await asyncio.gather(*orphans, return_exceptions=True)
    task = ProgressTasks.pop(asyncio.get_running_loop(), None)
    pending = [t for t in getattr(task, "_tasks", ()) if t is not None]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if _initialised:
        _initialised = False
        _owner_loop = None
        try:
            ucxx.reset()
        except Exception as exc:  # noqa: BLE001 - endpoints still referenced: threads stop anyway
            log.debug("UCX reset: %s", exc)
            ucxx.stop_notifier_thread()


class Connection:
    """One UCX endpoint: framed messages plus raw payloads, one exchange at a time."""

    def __init__(self, endpoint: Any, peer: str, max_frame: int = MAX_FRAME) -> None:
        self._ep = endpoint
        self.peer = peer
        self.max_frame = max_frame
        self._header = bytearray(HEADER_SIZE)
        self._closed = False
        _live.add(self)
        if os.environ.get("DKV_DEBUG_LEAKS"):
            import traceback

            self.created_at = "".join(traceback.format_stack(limit=12))

    @property
    def closed(self) -> bool:
        return self._closed or self._ep is None or self._ep.closed

    async def _bounded(self, awaitable: Awaitable[Any], timeout: float, what: str) -> Any:
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the inner await finishes, and a cancelled owner must always stop
            async with asyncio.timeout(timeout):
                return await awaitable
        except TimeoutError as exc:
            self.abort()
            raise OpTimeout(f"{what} to {self.peer} timed out after {timeout:.1f}s") from exc
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception as exc:  # ucxx raises its own tree; translate at the boundary
            self.abort()
            _drop_traceback(exc)  # ucxx keeps it for good: it must not keep our buffers too
            raise TransportError(f"{what} with {self.peer} failed: {type(exc).__name__}: {exc}") from exc

    async def send_message(self, message: dict[str, Any], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send one framed msgpack message."""
        body = encode_body(message)
        if self.closed:
            raise TransportError(f"connection to {self.peer} is closed")

        async def _send() -> None:
            await self._ep.send(encode_header(len(body)))
            await self._ep.send(body)

        await self._bounded(_send(), timeout, "send")

    async def recv_message(self, timeout: float = DEFAULT_TIMEOUT, max_frame: int | None = None) -> dict[str, Any]:
        """Receive one framed message; the header is validated before the body is allocated.

        ``max_frame`` bounds this message's body (default: the connection's
        :attr:`max_frame`, which a node keeps small until the peer has
        authenticated, so that nothing larger than a handshake is allocated
        for a stranger). A body whose receive is abandoned (timeout, the peer
        gone) is freed with it.

        Raises :class:`dkv.errors.ProtocolError` on a bad header or body
        (:class:`dkv.errors.FrameTooLarge` over the bound); the stream is then
        out of step, so the caller answers if it wants and must :meth:`abort`.
        """
        if self.closed:
            raise TransportError(f"connection to {self.peer} is closed")
        await self._bounded(self._ep.recv(self._header), timeout, "receive")
        length = decode_header(self._header, self.max_frame if max_frame is None else max_frame)
        body: bytearray | mmap.mmap = bytearray(length) if length < MAPPED_BODY_MIN else mmap.mmap(-1, length)
        if length:
            await self._bounded(self._ep.recv(body), timeout, "receive")
        return decode_body(body)

    async def send_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send each non-empty buffer as its own UCX message, all posted at once."""
        sends = [self._ep.send(b) for b in buffers if _nbytes(b)]
        if sends:
            await self._bounded(_gather(sends), timeout, "payload send")

    async def recv_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Receive one UCX message into each non-empty buffer, in order, all posted at once."""
        recvs = [self._ep.recv(b) for b in buffers if _nbytes(b)]
        if recvs:
            await self._bounded(_gather(recvs), timeout, "payload receive")

    async def send_raw(self, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send bytes with no framing (tests of the node's defences use this)."""
        await self._bounded(self._ep.send(data), timeout, "send")

    def abort(self) -> None:
        """Close at once; outstanding UCX requests are cancelled. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                ep.abort(period=CLOSE_PERIOD_NS)
            except Exception as exc:  # noqa: BLE001 - closing must not raise
                log.debug("abort of %s: %s", self.peer, exc)

    async def close(self) -> None:
        """Close gracefully (flush, then abort). Idempotent."""
        if self._closed:
            return
        ep = self._ep
        self._closed = True
        _live.discard(self)
        self._ep = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await ep.close(period=CLOSE_PERIOD_NS)
        except Exception as exc:  # noqa: BLE001
            log.debug("close of %s: %s", self.peer, exc)
            try:
                ep.abort(period=CLOSE_PERIOD_NS)
            except Exception:  # noqa: BLE001
                pass


def _nbytes(buffer: Any) -> int:
    return memoryview(buffer).nbytes if not hasattr(buffer, "nbytes") else int(buffer.nbytes)


# ucxx completes each request through a Python future that its C++ side keeps referenced after
# a failed request (a receive cancelled because the peer went away, say) for the life of the
# process. The exception set on that future is the one raised to us, and once raised its
# traceback holds the frames it passed through: ucxx's own ``recv``/``send`` frame, whose locals
# hold the buffer we passed in. Left alone, every receive abandoned that way kept its buffer for
# good (an 8 MiB frame body, say: 100 peers that announce one and go away kept 800 MB). So each
# such exception loses its traceback once raised to us; the message says what failed.
_CHAIN_LIMIT = 8


def _drop_traceback(exc: BaseException | None) -> None:
    """Clear the traceback of ``exc`` and of the exceptions it was raised from (its frames, their locals)."""
    for _ in range(_CHAIN_LIMIT):
        if exc is None:
            return
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _drop_task_traceback(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        _drop_traceback(task.exception())


async def _gather(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """``asyncio.gather``, whose requests that fail (even after the first failure) keep none of their buffers."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    for task in tasks:
        task.add_done_callback(_drop_task_traceback)
    return await asyncio.gather(*tasks)


# ucxx's handshake posts a stream receive into a buffer of its own and, when its own
# connect_timeout fires or the coroutine is cancelled, returns without cancelling that
# receive: a peer that answers late then writes into freed memory. So the handshake is
# never timed out or cancelled: it runs as a task of its own with an unreachable timeout,
# the caller's bound is enforced around it, and a handshake that outlives its caller is
# kept (with its buffers) until it ends; an endpoint it then yields is aborted at once.
HANDSHAKE_NEVER_TIMES_OUT = 1e9
_orphaned_handshakes: set[asyncio.Future[Any]] = set()


def orphaned_handshakes() -> int:
    """Handshakes still running after their caller gave up (each holds a few bytes and one endpoint)."""
    return len(_orphaned_handshakes)


def _orphan(handshake: asyncio.Future[Any]) -> None:
    def reap(done: asyncio.Future[Any]) -> None:
        _orphaned_handshakes.discard(done)
        if done.cancelled() or done.exception() is not None:
            return
        try:
            done.result().abort(period=CLOSE_PERIOD_NS)
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            log.debug("abort of a late endpoint: %s", exc)

    if handshake.done():
        reap(handshake)
        return
    _orphaned_handshakes.add(handshake)
    handshake.add_done_callback(reap)


async def connect(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> Connection:
    """Open a listener-path endpoint to ``host:port`` (peer-failure detection on) within ``timeout``."""
    init_transport()
    handshake = asyncio.ensure_future(
        ucxx.create_endpoint(host, port, endpoint_error_handling=True, connect_timeout=HANDSHAKE_NEVER_TIMES_OUT))
    try:
        async with asyncio.timeout(timeout):
            endpoint = await asyncio.shield(handshake)
    except TimeoutError as exc:
        _orphan(handshake)
        raise OpTimeout(f"connect to {host}:{port} timed out after {timeout:.1f}s") from exc
    except asyncio.CancelledError:
        _orphan(handshake)
        raise
    except Exception as exc:
        raise TransportError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}") from exc
    return Connection(endpoint, f"{host}:{port}")


class Listener:
    """A UCX listener handing each accepted connection to ``handler`` (peer-failure detection on).

    UCX listeners bind every interface; ``port=0`` picks a free port. An open
    listener holds the transport (:func:`hold_transport`); closing it lets go
    without stopping UCX (its server calls :func:`stop_progress` as it ends).
    """

    def __init__(self, handler: Callable[[Connection], Awaitable[None]], port: int = 0) -> None:
        init_transport()
        self._listener: Any = None
        self._handler = handler
        self._count = 0

        async def _accept(endpoint: Any) -> None:
            self._count += 1
            await handler(Connection(endpoint, f"client#{self._count}"))

        # the accepting side of the handshake has the same flaw as the connecting side (see
        # HANDSHAKE_NEVER_TIMES_OUT): a client that stalls it and then goes on would write into
        # freed memory of the node. It is never timed out; a stalled one ends when the client
        # completes it or its endpoint fails (the client died).
        self._listener = ucxx.create_listener(_accept, port=port, endpoint_error_handling=True,
                                              connect_timeout=HANDSHAKE_NEVER_TIMES_OUT)
        hold_transport()
        self.port: int = self._listener.port

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            drop_transport()
