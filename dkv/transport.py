"""UCX transport: the only module of dKV that imports ``ucxx``.

A :class:`Connection` is one UCX endpoint carrying framed control messages and
raw block payloads, strictly one request/response at a time (the client pool
opens more connections for concurrency). Every await here is bounded: on a
timeout or a transport error the endpoint is aborted *before* the error is
raised, so no late UCX receive can land in a buffer the caller has already
reused or freed.

Framing (protocol 3 and on): a control message is one UCX message, header and
msgpack body together, when the body is at most :data:`INLINE_MAX` bytes
(flag ``FLAG_INLINE``); the receiver posts one fixed-size receive
(``HEADER_SIZE + INLINE_MAX``, freshly zeroed, so a short message reads as
zeros, never as stale bytes) and takes the length from the header. A larger
body follows the header as a second message, received into a buffer
allocated only once the header has passed :func:`dkv.wire.decode_header`.
A receiver that makes room for them (:meth:`Connection.recv_message_with`)
may also take bytes after an inline body in the same message
(``FLAG_TRAILING``, :meth:`Connection.send_message_with`): the blocks a
lookup sends with its answer, in one message with it.

Payloads: :meth:`Connection.send_payloads` and :meth:`Connection.recv_payloads`
are called by the two sides with the same buffer sizes, and both cut the
same sequence of UCX messages (:func:`payload_plan`). By default the cut is
derived from the sizes alone: runs of small buffers share one message of up
to :data:`GROUP_BYTES`, a buffer of :data:`DIRECT_MIN` bytes or more (or
under 8) goes alone. A sender that knows where its buffers lie (a node: its
slots' offsets) may also join back-to-back buffers under ``GROUP_BYTES``
into one message; it then tells the other side the cut (``groups``: each
message's buffer count, see :func:`plan_groups`) before the payloads, and
each side takes it only after :func:`plan_from_groups` has checked it. A
group is sent straight from its buffers when they lie back to back in
memory (arena slots usually do), else gathered into a staging buffer; it is
received the same way, into the buffers or into staging and then scattered.

Progress mode: see :func:`init_transport`. UCX progress and request
completion are bound to the loop that initialises UCX, so a process drives
all its UCX work from one loop (a node's, or :mod:`dkv.loop_thread`'s shared
one). In the default ``loop`` mode that loop itself progresses UCX when the
worker's event descriptor is readable (:class:`_LoopProgress`): no thread of
UCX's, no hop between threads per completion.

Lifetime: in ``thread`` mode UCX runs a progress thread and a (non-daemon)
notifier thread, so a process that leaves it initialised never exits; in
``loop`` mode the loop's reader and timer go with the loop. Whoever owns the process's UCX
loop calls :func:`stop_progress` as that loop ends (a node, the shared loop
thread, a CLI command). Library users need not: clients, loop threads and
listeners count themselves as users (:func:`hold_transport`,
:func:`release_transport`), and the last user to leave, on the loop that
initialised UCX and with no connection left open, stops it. A later user
initialises it again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import logging
import mmap
import operator
import os
import struct
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# UCX's TCP transport moves a message in segments of this size (default 64 KiB): at 512 KiB a
# 1-2 MiB payload runs at or above a plain Python socket stream on loopback instead of at a
# third of it (scripts/probe_transport_pingpong.py, measured in one run). Only the TCP transport
# reads these; an operator's own setting wins.
os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "512k")
os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "512k")
# UCX sends a message of at least UCX_RNDV_THRESH bytes by rendezvous (ucxx sets 8 KiB): the
# receiver fetches the bytes once a receive matches, one more round trip. Over TCP and shared
# memory a message of up to one TCP segment goes eagerly instead, so a small listener load's
# blocks (sent with the lookup's answer, up to 256 KiB) and a 256-hash lookup's 8.8 KB request
# arrive without it: a one-block load of 64 KiB took 622-675 µs against 758-862 µs (p50,
# scripts/bench.py --quick, two runs each way, alternated); the throughput ratios moved by no
# more than between runs. Over RDMA a rendezvous is a zero-copy transfer worth its round trip, so
# where UCX may use it (UCX_TLS names an RDMA transport, or unset with an RDMA device present)
# ucxx's default stays. An operator's own setting wins.
_RDMA_TRANSPORTS = ("rc", "dc", "ud", "ib")


def rdma_possible() -> bool:
    """Whether this process's UCX may use an RDMA transport (see above)."""
    tls = [name.strip() for name in os.environ.get("UCX_TLS", "").split(",") if name.strip()]
    if tls and not tls[0].startswith("^"):  # a list of what to use (not of what to leave out)
        return any(name.split("_")[0] in _RDMA_TRANSPORTS for name in tls)
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


if not rdma_possible():
    os.environ.setdefault("UCX_RNDV_THRESH", "512k")
# SO_REUSEADDR on the listening socket (UCX's default: off). Without it a node restarted after a
# crash cannot listen on its port for about a minute: the dead node's side of each connection it
# had holds the port in TIME_WAIT. A port another process listens on stays refused (no SO_REUSEPORT).
os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")

# UCX, UCXX (ucxx's C++ layer) and UCX-Py (its Python layer) each log on their own, straight to
# the terminal (UCX and UCXX to stdout), at a level each reads from the environment once: UCX and
# UCX-Py as ucxx is imported, UCXX as UCX is initialised. They follow dKV's level (DKV_LOG_LEVEL,
# else the "dkv" logger's level), by column: UCX_LOG_LEVEL, UCXX_LOG_LEVEL, UCXPY_LOG_LEVEL.
# UCXX and UCX-Py report failures that reach dKV as errors it reports in its own words (a refused
# connect, a peer gone) and per-peer noise a stranger can cause at will (a malformed connection
# request): below debug they are silent. An operator's own setting of any of them wins.
UCX_LOG_LEVELS = {
    logging.DEBUG: ("DIAG", "DIAG", "WARNING"),
    logging.INFO: ("WARN", "FATAL", "CRITICAL"),
    logging.WARNING: ("WARN", "FATAL", "CRITICAL"),
    logging.ERROR: ("ERROR", "FATAL", "CRITICAL"),
    logging.CRITICAL: ("FATAL", "FATAL", "CRITICAL"),
}
_UCX_LOG_VARIABLES = ("UCX_LOG_LEVEL", "UCXX_LOG_LEVEL", "UCXPY_LOG_LEVEL")


def ucx_log_levels() -> dict[str, str]:
    """The UCX, UCXX and UCX-Py log levels that follow dKV's level (``DKV_LOG_LEVEL``, else the ``dkv`` logger's)."""
    name = os.environ.get("DKV_LOG_LEVEL", "").strip().upper()
    level = logging.getLevelName(name) if name else logging.getLogger("dkv").getEffectiveLevel()
    if not isinstance(level, int):  # an unknown name: dKV's own default
        level = logging.WARNING
    row = next((UCX_LOG_LEVELS[k] for k in sorted(UCX_LOG_LEVELS) if level <= k), UCX_LOG_LEVELS[logging.CRITICAL])
    return dict(zip(_UCX_LOG_VARIABLES, row))


@contextlib.contextmanager
def _ucx_log_environment() -> Iterator[None]:
    """Set the UCX log levels the operator did not set, for as long as UCX reads them, then take them back.

    Taken back so that a process started from this one (a node, a CLI
    command) derives its own from its own level instead of inheriting these.
    """
    added = {k: v for k, v in ucx_log_levels().items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


with _ucx_log_environment():
    import ucxx  # noqa: E402

import numpy as np  # noqa: E402
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402
from ucxx._lib_async.application_context import ProgressTasks  # noqa: E402
from ucxx._lib_async.endpoint import Endpoint  # noqa: E402
from ucxx._lib_async.utils import hash64bits  # noqa: E402
from ucxx.types import Tag  # noqa: E402

from dkv.errors import DKVError, OpTimeout, ProtocolError, TransportError  # noqa: E402
from dkv.stuck_connections import StuckConnectionReaper  # noqa: E402
from dkv.wire import (  # noqa: E402
    FLAG_INLINE,
    FLAG_TRAILING,
    HEADER_SIZE,
    MAX_FRAME,
    decode_body,
    decode_frame_header,
    encode_body,
    encode_header,
)

try:
    from dkv._buffer_run import buffer_run as _buffer_run
except ImportError:  # not built (no C compiler at install): ucxx's Array per buffer, the same answer
    _buffer_run = None

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
# A body of at most this many bytes travels in one UCX message with its header; the receiver
# posts a receive of HEADER_SIZE + INLINE_MAX for every control message (a protocol constant:
# both sides must agree). Measured (scripts/probe_transport_pingpong.py): one message instead
# of two halves a control message's cost; bodies up to a few KiB are the common case.
INLINE_MAX = 16 * 1024
# The most bytes a receiver makes room for after an inline body (FLAG_TRAILING: the blocks a lookup
# sends with its answer), so that one receive of HEADER_SIZE + INLINE_MAX + room takes the answer
# and its blocks. Larger sends travel as payload messages of their own.
TRAILING_MAX = 1 << 20
# Payload batching (protocol constants too: both sides derive the same messages from the sizes).
GROUP_BYTES = 1 << 20  # runs of small buffers share one UCX message of at most this many bytes
DIRECT_MIN = 128 * 1024  # a buffer this large is its own message (no copy, whatever its neighbours)
# A control message's send is not waited for by send_message (its completion would cost a wait per
# message, and in thread mode a hop through ucxx's notifier thread): the connection's next
# operation waits for it.
# An abort while one is still leaving (an error reply, then the close) lets it go for this long.
SEND_LINGER = 1.0
_CANARY = 8  # bytes at the end of each group's receive that tell a short message (see _recv_group)
STAGED_WINDOW = 4  # staged groups one call keeps in flight (bounds its staging memory)
_STAGING_KEEP = 8  # staging buffers of GROUP_BYTES kept for reuse by the process
_staging: list[bytearray] = []
_initialised = False
_live: set[Connection] = set()
_owner_loop: weakref.ReferenceType[asyncio.AbstractEventLoop] | None = None  # the loop that initialised UCX
_users = 0  # see hold_transport
_users_lock = threading.Lock()


def open_connections() -> int:
    """How many connections of this process are open (a leak check reads this)."""
    return len(_live)


PROGRESS_MODES = ("loop", "thread", "thread-polling", "blocking", "polling")
# A loop-driven worker is also progressed this often when no event came (a missed wake-up costs
# at most this much, never a hang; idle, one pass every quarter second costs nothing measurable).
PROGRESS_TICK = 0.25
# Passes of progress one wake-up makes before it lets the loop's other callbacks run (and comes
# back after them) while UCX keeps reporting work.
_PASSES_PER_WAKE = 8


class _LoopProgress:
    """UCX progress driven by the event loop (``loop`` mode), as ucx-py drove it.

    The loop watches the worker's event descriptor. Each pass progresses the
    worker, completes the futures of finished requests, and arms the worker
    (``ucp_worker_arm``) so that the descriptor wakes the loop at the next
    event. A pass also follows every request posted (:meth:`watch`), on the
    loop's next turn, so the worker is never left unarmed with work pending;
    a timer (:data:`PROGRESS_TICK`) covers a wake-up UCX might not signal.

    Requests are posted without ucxx's Python futures: completion is read on
    the loop, so no thread of UCX's takes the GIL and no completion hops
    between threads. Each watched request keeps the buffer it reads or
    writes referenced until UCX reports it complete (cancelled, when its
    endpoint was aborted), even after its waiter gave up: nothing lands in
    freed memory. Only the loop thread touches the worker.
    """

    _tasks: tuple[asyncio.Task[Any], ...] = ()  # (ucxx's progress-task interface, see stop_progress)

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        worker.init_blocking_progress_mode()
        self._fd: int = worker.epoll_file_descriptor
        self._pending: dict[Any, tuple[asyncio.Future[None], Any]] = {}
        self._queued = False
        self._closed = False
        loop.add_reader(self._fd, self._progress)
        self._timer = loop.call_later(PROGRESS_TICK, self._tick)

    @property
    def pending(self) -> int:
        """Requests posted and not yet complete (each holds its buffer)."""
        return len(self._pending)

    def watch(self, request: Any, buffer: Any) -> asyncio.Future[None]:
        """A future for ``request`` (set when UCX completes it); ``buffer`` is held until then."""
        future: asyncio.Future[None] = self.loop.create_future()
        self._pending[request] = (future, buffer)
        self.kick()
        return future

    def kick(self) -> None:
        """Progress on the loop's next turn (once, however often asked before it)."""
        if not self._queued and not self._closed:
            self._queued = True
            self.loop.call_soon(self._progress)

    def _tick(self) -> None:
        if self._closed:
            return
        self._progress()
        self._timer = self.loop.call_later(PROGRESS_TICK, self._tick)

    def _progress(self) -> None:
        self._queued = False
        if self._closed:
            return
        worker = self.worker
        try:
            for _ in range(_PASSES_PER_WAKE):
                worker.progress()
                if self._pending:
                    self._complete()
                if worker.arm():  # nothing left to do: the descriptor wakes the loop at the next event
                    return
        except Exception as exc:  # noqa: BLE001 - progress must go on: the tick retries (no spin on a fault)
            log.debug("UCX progress: %s", exc)
            return
        self.kick()  # UCX still had work after these passes: again after the loop's other callbacks

    def progress_once(self) -> None:
        """One pass now, from long work on the loop (:func:`progress_now`); the arm waits for the next turn.

        Nothing when a pass is queued already (it runs on the loop's next turn)
        or the driver is closed. A fault is logged and left to the tick, as in
        a regular pass.
        """
        if self._queued or self._closed:
            return
        try:
            self.worker.progress()
            if self._pending:
                self._complete()
        except Exception as exc:  # noqa: BLE001 - progress must go on: the tick retries
            log.debug("UCX progress: %s", exc)
            return
        self.kick()  # arm after the work, on the loop's next turn

    def _complete(self) -> None:
        pending = self._pending
        for request in [r for r in pending if r.completed]:
            future, _ = pending.pop(request)
            if future.done():  # its waiter gave up (the endpoint was aborted): only the buffer was held
                continue
            try:
                request.check_error()
            except Exception as exc:  # noqa: BLE001 - ucxx's own tree; Connection translates it
                future.set_exception(exc.with_traceback(None))  # (its frame would hold this pass's locals)
            else:
                future.set_result(None)

    def close(self) -> list[Any]:
        """Stop watching; fail every waiter. Returns the buffers of requests UCX did not complete."""
        self._closed = True
        self._timer.cancel()
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        held = []
        for future, buffer in self._pending.values():
            if not future.done():
                future.set_exception(TransportError("UCX was stopped"))
                _drop_task_traceback(future)
            held.append(buffer)
        self._pending.clear()
        return held


_driver: _LoopProgress | None = None  # this process's loop-driven progress, when in loop mode
_held_after_stop: list[Any] = []  # buffers of requests UCX never completed, when its reset failed


def _driven_here() -> _LoopProgress:
    """The loop-mode driver, when the running loop is the one that drives UCX (else TransportError)."""
    assert _driver is not None
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is not _driver.loop and here is not None and _driver.loop.is_closed():
        _driver.close()  # that loop ended without stopping UCX: this one drives it from now on
        _drive_from(here)
    if here is not _driver.loop:
        raise TransportError("UCX is driven by another event loop of this process: use that one")
    return _driver


def _drive_from(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop`` progress UCX in place of the progress task ucxx made for it (loop mode)."""
    global _driver
    ctx = ucxx.core._get_ctx()
    theirs = ProgressTasks.pop(loop, None)
    for task in getattr(theirs, "_tasks", ()):  # ucxx's polling task, not yet run: it never runs
        if task is not None:
            task.cancel()
    _driver = _LoopProgress(ctx.worker, loop)
    ProgressTasks[loop] = _driver  # ucxx then makes no progress task of its own for this loop


_mode = "loop"


def progress_now() -> None:
    """Progress UCX once, now (loop mode, on the loop that drives it; else nothing).

    Long work on the loop (checking blocks that landed while later ones
    arrive) calls this between pieces, so that transfers in flight keep
    moving: UCX answers a peer's rendezvous only when progressed.
    """
    if _driver is not None:
        _driver.progress_once()


def pending_requests() -> int:
    """UCX requests posted and not yet complete, loop mode (each holds its buffer); 0 in other modes."""
    return _driver.pending if _driver is not None else 0


def active_progress_mode() -> str | None:
    """The progress mode UCX runs in, in this process (None: not initialised)."""
    return _mode if _initialised else None


def init_transport(progress_mode: str | None = None) -> None:
    """Initialise UCX for this process once (idempotent).

    ``loop`` progress (the default) runs UCX progress on the loop that calls
    this (:class:`_LoopProgress`): the loop sleeps in its own epoll until the
    worker has an event, and completes requests itself. Called with no loop
    running, it falls back to ``thread`` mode. ``thread`` progress runs UCX
    progress in its own thread, blocked in epoll when idle, and completes
    requests through Python futures that ucxx's notifier thread hands to the
    loop: two thread hops per completion. ucxx 0.52's own ``blocking`` and
    ``polling`` modes complete requests by yielding in a loop, which keeps a
    core busy for as long as any request is pending (an idle server always
    has one); they, and ``thread``, stay available through
    ``DKV_UCX_PROGRESS`` for measurement.
    """
    global _initialised, _owner_loop, _mode
    if _initialised:
        return
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # no loop runs here: ucxx binds to one it makes; never stopped by release_transport
        loop = None
    mode = progress_mode or os.environ.get("DKV_UCX_PROGRESS", "loop")
    if mode not in PROGRESS_MODES:
        raise ValueError(f"unknown UCX progress mode {mode!r}: one of {', '.join(PROGRESS_MODES)}")
    if mode == "loop" and loop is None:
        mode = "thread"
    _owner_loop = weakref.ref(loop) if loop is not None else None
    threaded = mode.startswith("thread")
    with _ucx_log_environment():  # UCXX reads its level here
        ucxx.init(
            # loop mode starts as ucxx's polling mode (no thread, no futures), whose task is
            # replaced before it runs
            progress_mode="polling" if mode == "loop" else mode,
            enable_python_future=threaded,
            enable_delayed_submission=threaded and os.environ.get("DKV_UCX_DELAYED_SUBMISSION", "0") == "1",
        )
    if mode == "loop":
        assert loop is not None
        _drive_from(loop)
    _mode = mode
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
    notifier threads are stopped (``thread`` mode), or the loop's reader and
    timer removed (``loop`` mode), so the interpreter can exit.
    """
    global _initialised, _owner_loop, _driver
    orphans = list(_orphaned_handshakes)  # UCX goes down with them, so nothing of theirs lands later
    for handshake in orphans:
        handshake.cancel()
    await asyncio.gather(*orphans, return_exceptions=True)
    task = ProgressTasks.pop(asyncio.get_running_loop(), None)
    pending = [t for t in getattr(task, "_tasks", ()) if t is not None]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    held: list[Any] = []
    if _driver is not None:
        if _driver.loop is asyncio.get_running_loop():
            held = _driver.close()
        else:  # not the loop that drives UCX: that loop stops watching on its own turn
            _driver.loop.call_soon_threadsafe(_driver.close)
        _driver = None
    if _initialised:
        _initialised = False
        _owner_loop = None
        try:
            ucxx.reset()
        except Exception as exc:  # noqa: BLE001 - endpoints still referenced: threads stop anyway
            log.debug("UCX reset: %s", exc)
            _held_after_stop.extend(held)  # the worker lives on with them: their buffers too
            ucxx.stop_notifier_thread()


Landed = Callable[[int, int], None]  # recv_payloads' report of a run of buffers that is whole: (start, stop)


class Connection:
    """One UCX endpoint: framed messages plus raw payloads, one exchange at a time."""

    def __init__(self, endpoint: Any, peer: str, max_frame: int = MAX_FRAME) -> None:
        self._ep = endpoint
        self.peer = peer
        self.max_frame = max_frame
        self._closed = False
        self._sending: asyncio.Future[Any] | None = None  # the last control message's send, not yet waited for
        # loop mode: a ucxx endpoint's requests are posted raw and completed by the loop; any other
        # endpoint object (a test's stand-in) is driven through the send/recv awaitables it offers
        self._driver = _driver if isinstance(endpoint, Endpoint) else None
        if self._driver is not None:
            self._raw = endpoint._ep
            self._send_tag = Tag(endpoint._tags["msg_send"])
            self._recv_tag = Tag(endpoint._tags["msg_recv"])
        _live.add(self)
        if os.environ.get("DKV_DEBUG_LEAKS"):
            import traceback

            self.created_at = "".join(traceback.format_stack(limit=12))

    @property
    def closed(self) -> bool:
        return self._closed or self._ep is None or self._ep.closed

    def _post(self, buffer: Any, send: bool) -> asyncio.Future[Any]:
        """Post one UCX message of ``buffer``'s bytes, or (``send`` false) a receive of the next one into it.

        Returns a future for the request's completion.
        """
        if self._driver is None:
            return _request(self._ep.send(buffer) if send else self._ep.recv(buffer))
        if self._ep is None:
            raise TransportError(f"connection to {self.peer} is closed")
        raw = self._raw
        request = raw.tag_send(Array(buffer), self._send_tag) if send else raw.tag_recv(Array(buffer), self._recv_tag)
        return self._driver.watch(request, buffer)

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
        """Send one framed msgpack message.

        A message of up to :data:`INLINE_MAX` body bytes is one UCX message,
        and this returns once it is posted: the connection's next operation
        (any, within its own bound) or :meth:`close` waits for it to have
        left, and raises if it failed. The message's bytes are its own, so
        nothing of the caller's is held.
        """
        await self._send_body(encode_body(message), timeout)

    async def send_message_with(self, message: dict[str, Any], trailing: Sequence[Any],
                                timeout: float = DEFAULT_TIMEOUT) -> bool:
        """Send ``message`` with ``trailing``'s bytes after its body in the same UCX message, where the body is inline.

        For a peer that made room for them (:meth:`recv_message_with`):
        ``FLAG_TRAILING``, their total in the header. The bytes are copied
        into the message as it is made, so the caller's buffers are free
        once this returns. Returns False, having sent the message alone (as
        :meth:`send_message`), when its body is over :data:`INLINE_MAX` or
        the bytes over :data:`TRAILING_MAX`: the caller sends them its other way.
        """
        body = encode_body(message)
        views = [_byte_view(buffer) for buffer in trailing]
        total = sum(map(len, views))
        if len(body) > INLINE_MAX or total > TRAILING_MAX:
            await self._send_body(body, timeout)
            return False
        if self.closed:
            raise TransportError(f"connection to {self.peer} is closed")
        await self._settle(timeout)
        frame = b"".join([encode_header(len(body), FLAG_INLINE | FLAG_TRAILING, total), body, *views])
        self._sending = self._post(frame, send=True)
        return True

    async def _send_body(self, body: bytes, timeout: float) -> None:
        if self.closed:
            raise TransportError(f"connection to {self.peer} is closed")
        await self._settle(timeout)
        if len(body) <= INLINE_MAX:  # one UCX message: header and body together
            self._sending = self._post(encode_header(len(body), FLAG_INLINE) + body, send=True)
            return

        async def _send() -> None:
            await self._post(encode_header(len(body)), send=True)
            await self._post(body, send=True)

        await self._bounded(_send(), timeout, "send")

    async def _settle(self, timeout: float) -> None:
        """Wait (bounded) for the last control message's send to have left."""
        sending, self._sending = self._sending, None
        if sending is not None:
            await self._bounded(sending, timeout, "send")

    async def _after_sent(self, sending: asyncio.Future[Any] | None, awaitable: Awaitable[Any]) -> Any:
        """``awaitable`` (posted now), then the earlier send: one wait for both."""
        result = await awaitable
        if sending is not None:
            await sending
        return result

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
        message, _ = await self._recv(timeout, max_frame, 0)
        return message

    async def recv_message_with(self, room: int, timeout: float = DEFAULT_TIMEOUT) -> tuple[dict[str, Any], memoryview | None]:
        """:meth:`recv_message`, with room for up to ``room`` (at most :data:`TRAILING_MAX`) bytes after an inline body.

        Returns the message and the bytes that followed its body in the same
        UCX message (``FLAG_TRAILING``, see :meth:`send_message_with`), or
        ``None`` when none did. Only the header and body part of the receive
        is zeroed: past the message's end, the trailing view may read bytes
        this process held before, so its bytes are trusted only once checked
        (the lookup's blocks each against its checksum). A header announcing
        more than ``room`` is a :class:`ProtocolError` (the endpoint is to be
        aborted, as for any bad frame).
        """
        if not 0 <= room <= TRAILING_MAX:
            raise ValueError(f"room for {room} trailing bytes: at most {TRAILING_MAX}")
        return await self._recv(timeout, None, room)

    async def _recv(self, timeout: float, max_frame: int | None, room: int) -> tuple[dict[str, Any], memoryview | None]:
        if self._closed or self._ep is None:  # (an endpoint the peer closed may still hold its last message)
            raise TransportError(f"connection to {self.peer} is closed")
        # fresh, its header and body part zeroed each time: a message shorter than its header says
        # leaves zeros, not the bytes of an earlier message; a longer one fails the receive (UCX:
        # truncated). Room for trailing bytes is left as allocated (see recv_message_with).
        if room:
            first: Any = np.empty(HEADER_SIZE + INLINE_MAX + room, dtype=np.uint8)
            first[:HEADER_SIZE + INLINE_MAX] = 0
        else:
            first = bytearray(HEADER_SIZE + INLINE_MAX)
        sending, self._sending = self._sending, None  # the request's send completes as its reply comes
        await self._bounded(self._after_sent(sending, self._post(first, send=False)), timeout, "receive")
        view = memoryview(first)
        length, flags, trailing = decode_frame_header(view, self.max_frame if max_frame is None else max_frame)
        if flags & FLAG_INLINE:
            if length > INLINE_MAX:
                raise ProtocolError(f"inline frame of {length} bytes exceeds the {INLINE_MAX}-byte bound")
            if flags & FLAG_TRAILING and (not room or trailing > room):
                raise ProtocolError(f"a frame with {trailing} trailing bytes, where room was made for {room}")
            message = decode_body(view[HEADER_SIZE:HEADER_SIZE + length])
            if flags & FLAG_TRAILING:
                start = HEADER_SIZE + length
                return message, view[start:start + trailing]
            return message, None
        body: bytearray | mmap.mmap = bytearray(length) if length < MAPPED_BODY_MIN else mmap.mmap(-1, length)
        if length:
            await self._bounded(self._post(body, send=False), timeout, "receive")
        return decode_body(body), None

    async def send_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT,
                            groups: Any = None) -> None:
        """Send the non-empty buffers as the messages :func:`payload_plan` gives their sizes, or as ``groups`` say.

        The peer calls :meth:`recv_payloads` with buffers of the same sizes
        and the same ``groups`` (each message's count of non-empty buffers:
        :func:`plan_groups`), which one side chose and told the other. A cut
        :func:`plan_from_groups` refuses raises :class:`ProtocolError` before
        anything is sent (the endpoint is aborted: the peer's receives would
        have no messages to meet). Buffers must be C-contiguous host memory.
        """
        _, items, sizes = _nonempty(buffers)
        plan = self._plan(sizes, groups)
        sending, self._sending = self._sending, None
        if items or sending is not None:
            await self._bounded(self._after_sent(sending, self._send_groups(items, plan, sizes)), timeout,
                                "payload send")

    def _plan(self, sizes: list[int], groups: Any) -> list[tuple[int, int]]:
        try:
            return payload_plan(sizes) if groups is None else plan_from_groups(groups, sizes)
        except ProtocolError:
            self.abort()
            raise

    async def recv_payloads(self, buffers: Sequence[Any], timeout: float = DEFAULT_TIMEOUT,
                            landed: Landed | None = None, groups: Any = None) -> None:
        """Receive into the non-empty buffers, in order, the messages :func:`payload_plan` gives their sizes.

        ``groups``, where one side chose the cut and told the other (as for
        :meth:`send_payloads`), replaces that plan once
        :func:`plan_from_groups` accepts it: a cut it refuses raises
        :class:`ProtocolError` before any receive is posted (the endpoint is
        aborted: the sender's messages would have no receive to meet).

        On a failure or timeout the endpoint is aborted before the error is
        raised: nothing lands in a buffer later. A group's message shorter
        than the group never hands on bytes it did not carry (see
        :meth:`_recv_group`). ``landed(start, stop)`` is called, on the loop,
        as each run ``buffers[start:stop]`` is whole, while later messages
        are still arriving (a reader checks those blocks meanwhile); it must
        not raise. Every non-empty buffer is in a run by the time this returns.
        """
        nonempty, items, sizes = _nonempty(buffers)
        plan = self._plan(sizes, groups)
        sending, self._sending = self._sending, None
        if items or sending is not None:
            on_group = None
            if landed is not None:
                def on_group(start: int, end: int) -> None:
                    landed(nonempty[start], nonempty[end - 1] + 1)
            await self._bounded(self._after_sent(sending, self._recv_groups(items, plan, sizes, on_group)), timeout,
                                "payload receive")

    async def _send_groups(self, items: list[Any], plan: list[tuple[int, int]], sizes: list[int]) -> None:
        inflight: collections.deque[tuple[asyncio.Future[Any], bytearray | None]] = collections.deque()
        staged = 0
        try:
            for start, end in plan:
                stage = None
                if end - start == 1:
                    source: Any = items[start]
                else:
                    source = _span(items[start:end], sizes[start:end])
                    if source is None:  # gather
                        total = sum(sizes[start:end])
                        stage = _take_staging(total)
                        source = memoryview(stage)[:total]
                        offset = 0
                        for buf, n in zip(items[start:end], sizes[start:end]):
                            source[offset:offset + n] = _byte_view(buf)
                            offset += n
                inflight.append((self._post(source, send=True), stage))
                if stage is not None:
                    staged += 1
                while staged >= STAGED_WINDOW:
                    task, done = inflight.popleft()
                    await task
                    if done is not None:
                        staged -= 1
                        _give_staging(done)
                if stage is not None:
                    await asyncio.sleep(0)  # a gather held the loop: let others run between groups
            while inflight:
                task, done = inflight.popleft()
                await task
                if done is not None:
                    _give_staging(done)
        except BaseException:
            self.abort()  # before anything else: no request of this call runs on, staging is dropped
            raise

    async def _recv_groups(self, items: list[Any], plan: list[tuple[int, int]], sizes: list[int],
                           landed: Landed | None = None) -> None:
        canary = os.urandom(_CANARY)
        inflight: collections.deque[tuple[Any, ...]] = collections.deque()
        staged = 0
        try:
            for start, end in plan:
                if end - start == 1:  # alone: straight into its buffer, with a canary if it has room for one
                    target = _canary_view(items[start]) if sizes[start] >= _CANARY else None
                    if target is not None:
                        target[-_CANARY:] = canary
                    inflight.append((self._post(items[start], send=False), start, end, target, None))
                    continue
                stage = None
                span = _span(items[start:end], sizes[start:end], writable=True)
                if span is None:
                    total = sum(sizes[start:end])
                    stage = _take_staging(total)
                    target = memoryview(stage)[:total]
                    staged += 1
                else:
                    target = memoryview(span).cast("B")
                target[-_CANARY:] = canary  # (every buffer of a group holds at least _CANARY bytes: payload_plan)
                inflight.append((self._post(target, send=False), start, end, target, stage))
                while staged >= STAGED_WINDOW:
                    entry = inflight.popleft()
                    await self._recv_group(entry, items, sizes, canary, landed)
                    if entry[4] is not None:
                        staged -= 1
            while inflight:
                entry = inflight.popleft()
                await self._recv_group(entry, items, sizes, canary, landed)
        except BaseException:
            self.abort()  # first: no receive of this call lands later (staging in flight is dropped)
            raise

    async def _recv_group(self, entry: tuple[Any, ...], items: list[Any], sizes: list[int], canary: bytes,
                          landed: Landed | None = None) -> None:
        """Complete one posted receive; scatter a staged group.

        UCX does not say how long a received message was. So each group's
        receive gets a random canary in its last bytes before it is posted:
        the message fills the receive from its start, so a canary overwritten
        means the message reached the group's end, and one still there means
        it stopped short. A message that stopped short is a
        :class:`ProtocolError`: both sides derive the groups from the sizes
        (:func:`dkv.wire.payload_plan`) and a peer sends each group as one
        message, so a short one comes from a broken peer; and since UCX does
        not say where it stopped (inside a buffer, perhaps), the rest could
        not be received at the right offset. Nothing of the group is handed
        on when it is staged (a spanned group's bytes are already in the
        caller's buffers, which the caller must then treat as garbage). A
        block received alone gets a canary too when it has room for one. One
        canary a group, not one a buffer, tells the same (a message is one
        prefix of its group) for one write and one compare a message, where
        one a buffer cost ~0.1 ms of a 256-block read. Not seen: a message
        that stops within the group's last ``_CANARY - 1`` bytes (what is
        left of the canary reads as data; telling it apart would refuse one
        good group in 256): the last block's checksum catches it.
        """
        task, start, end, target, stage = entry
        await task
        if target is not None:
            if target[-_CANARY:] == canary:
                raise ProtocolError(f"a payload message from {self.peer} was shorter than its group")
            if stage is not None:
                offset = 0
                for buf, n in zip(items[start:end], sizes[start:end]):
                    _byte_view(buf)[:] = target[offset:offset + n]
                    offset += n
                _give_staging(stage)
        if landed is not None:
            landed(start, end)

    async def send_raw(self, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send bytes as one UCX message with no framing (tests of the node's defences use this).

        The node reads such a message as a frame: a header alone (flags 0)
        announces a body to follow as the next message.
        """
        await self._settle(timeout)
        await self._bounded(self._post(data, send=True), timeout, "send")

    def abort(self) -> None:
        """Close at once; outstanding UCX requests are cancelled. Idempotent.

        The one exception: a control message still leaving (a reply sent just
        before, say an error reply) is given :data:`SEND_LINGER` seconds to
        go first. No receive of this connection is outstanding then (every
        operation waits for that send), so nothing can land later.
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        ep, self._ep = self._ep, None
        sending, self._sending = self._sending, None
        if ep is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: no one could wait for the send
            loop = None
        if sending is not None and not sending.done() and loop is not None:
            later = loop.call_later(SEND_LINGER, _abort_endpoint, ep, self.peer)

            def sent(_: asyncio.Future[Any]) -> None:
                later.cancel()
                _abort_endpoint(ep, self.peer)

            sending.add_done_callback(sent)
            return
        _abort_endpoint(ep, self.peer)

    async def close(self) -> None:
        """Close gracefully (flush, then abort). Idempotent."""
        if self._closed:
            return
        sending, self._sending = self._sending, None
        if sending is not None and not sending.done():  # let the last message leave first (bounded)
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(SEND_LINGER):
                    await asyncio.shield(sending)
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
        if _driver is not None:
            _driver.kick()


def _abort_endpoint(ep: Any, peer: str) -> None:
    try:
        ep.abort(period=CLOSE_PERIOD_NS)
    except Exception as exc:  # noqa: BLE001 - closing must not raise
        log.debug("abort of %s: %s", peer, exc)
    if _driver is not None:  # the endpoint's requests were cancelled: complete their futures
        _driver.kick()


def _nbytes(buffer: Any) -> int:
    return memoryview(buffer).nbytes if not hasattr(buffer, "nbytes") else int(buffer.nbytes)


_NBYTES = operator.attrgetter("nbytes")


def _nonempty(buffers: Sequence[Any]) -> tuple[Sequence[int], list[Any], list[int]]:
    """The buffers that hold bytes: their indices in ``buffers``, themselves, and their sizes (each taken once)."""
    try:  # (memoryviews, arrays and tensors say it themselves: one C pass, not a Python call a buffer)
        sizes = list(map(int, map(_NBYTES, buffers)))
    except AttributeError:
        sizes = list(map(_nbytes, buffers))
    if all(sizes):
        return range(len(buffers)), list(buffers), sizes
    kept = [i for i, n in enumerate(sizes) if n]
    return kept, [buffers[i] for i in kept], [sizes[i] for i in kept]


def payload_plan(sizes: Sequence[int], offsets: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The UCX messages that carry buffers of ``sizes`` (none empty): ``(start, end)`` index ranges.

    From the sizes alone (``offsets`` None) the plan is deterministic, so a
    receiver derives it too: a buffer of :data:`DIRECT_MIN` bytes or more, or
    of fewer than 8, is a message of its own; consecutive others are grouped,
    up to :data:`GROUP_BYTES` a group. ``offsets``, where each buffer starts
    in one address space of one side (a node's slot offsets in one
    mapping), also joins consecutive buffers of ``DIRECT_MIN`` up to
    ``GROUP_BYTES`` that lie back to back there, up to ``GROUP_BYTES`` a
    message, so they travel without a copy in fewer messages (UCX's cost per
    message dominates below 1 MiB: scripts/probe_payload_groups.py). Such
    a plan depends on one side's memory, so that side tells the other
    (:func:`plan_groups`).

    A read's blocks are usually all one size, and a large run of them back
    to back: that plan is counted out (:func:`_uniform_plan`, the same
    answer) rather than walked buffer by buffer: 3 µs against 22 µs for 256
    blocks of 64 KiB (and a receiver takes that cut, told, in 4 µs against
    15: :func:`plan_from_groups`).
    """
    uniform = _uniform_plan(sizes, offsets)
    if uniform is not None:
        return uniform
    return _walked_plan(sizes, offsets)


def _uniform_plan(sizes: Sequence[int], offsets: Sequence[int] | None) -> list[tuple[int, int]] | None:
    """:func:`payload_plan` of buffers all of one size that groups the same way throughout; None for any other.

    Buffers of ``_CANARY`` bytes up to ``DIRECT_MIN`` group ``GROUP_BYTES // n``
    at a time whatever their offsets; larger ones under ``GROUP_BYTES`` do
    so only where every one lies right after the one before it (``offsets``);
    those of ``GROUP_BYTES`` or more, or under ``_CANARY``, go alone. Anything
    in between (a mixed run, a gap) is the walk's to plan.
    """
    count = len(sizes)
    if not count:
        return []
    n = sizes[0]
    if type(n) is not int or sizes.count(n) != count:  # noqa: E721 - (a bool or a float is the walk's)
        return None
    if n < _CANARY or n >= GROUP_BYTES:
        per = 1
    elif n < DIRECT_MIN:
        per = GROUP_BYTES // n
    elif offsets is None:
        per = 1
    else:
        first = offsets[0]
        if type(first) is not int or list(offsets) != list(range(first, first + n * count, n)):  # noqa: E721
            return None
        per = GROUP_BYTES // n
    return [(i, min(i + per, count)) for i in range(0, count, per)]


def _walked_plan(sizes: Sequence[int], offsets: Sequence[int] | None) -> list[tuple[int, int]]:
    """:func:`payload_plan` buffer by buffer: any sizes, any offsets."""
    plan: list[tuple[int, int]] = []
    start, total, joined = -1, 0, False  # the open group; joined: it is of back-to-back large buffers
    for i, n in enumerate(sizes):
        large = n >= DIRECT_MIN
        if (start >= 0 and joined and large and n < GROUP_BYTES and total + n <= GROUP_BYTES
                and offsets is not None and offsets[i - 1] + sizes[i - 1] == offsets[i]):
            total += n
            continue
        if start >= 0 and (large or n < _CANARY or joined or total + n > GROUP_BYTES):
            plan.append((start, i))
            start = -1
        if n < _CANARY or (large and (offsets is None or n >= GROUP_BYTES)):
            plan.append((i, i + 1))
            continue
        if start < 0:
            start, total, joined = i, 0, large
        total += n
    if start >= 0:
        plan.append((start, len(sizes)))
    return plan


def payload_groups(sizes: Sequence[int], offsets: Sequence[int]) -> list[int]:
    """The cut, as ``groups`` to tell the other side, of buffers of ``sizes`` starting at ``offsets`` on this side.

    Buffers that lie back to back there share messages up to :data:`GROUP_BYTES`
    (:func:`payload_plan`), sent or received in place.
    """
    return plan_groups(payload_plan(sizes, offsets))


def plan_groups(plan: Sequence[tuple[int, int]]) -> list[int]:
    """A plan as one side tells it to the other (``groups``): each message's count of buffers, in order."""
    return [end - start for start, end in plan]


def plan_from_groups(groups: Any, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The plan the other side told as ``groups`` (:func:`plan_groups`), checked against this side's ``sizes``.

    :class:`ProtocolError` unless ``groups`` is a list of positive integers
    that covers every buffer once, in order, and no message of several
    buffers exceeds :data:`GROUP_BYTES` or holds a buffer under 8 bytes (a
    group's last bytes carry its receive's canary: see :meth:`Connection._recv_group`).
    """
    if not isinstance(groups, (list, tuple)) or len(groups) > len(sizes):
        raise ProtocolError("payload groups: not a list of at most one group per block")
    if sizes and type(sizes[0]) is int and sizes[0] > 0:  # noqa: E721 - one size, cut as a node cuts back-to-back slots:
        usual = _uniform_plan(sizes, range(0, sizes[0] * len(sizes), sizes[0]))  # that plan is checked already
        if usual is not None and set(map(type, groups)) == {int} and list(groups) == plan_groups(usual):  # (4.0 == 4)
            return usual
    plan: list[tuple[int, int]] = []
    start = 0
    for count in groups:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1 or start + count > len(sizes):
            raise ProtocolError("payload groups: a count that is not a positive integer within the blocks")
        end = start + count
        if count > 1 and (sum(sizes[start:end]) > GROUP_BYTES or min(sizes[start:end]) < _CANARY):
            raise ProtocolError(f"payload groups: a message of {count} blocks beyond the group bound")
        plan.append((start, end))
        start = end
    if start != len(sizes):
        raise ProtocolError("payload groups do not cover every block")
    return plan


def _byte_view(buffer: Any) -> memoryview:
    """A flat byte view of a C-contiguous host buffer (buffer protocol or ``__array__``)."""
    try:
        view = memoryview(buffer)
    except TypeError:
        view = memoryview(np.ascontiguousarray(np.asarray(buffer)))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _span(buffers: Sequence[Any], sizes: Sequence[int], writable: bool = False) -> Any | None:
    """One buffer object covering ``buffers`` when they lie back to back in host memory, else None.

    The span borrows their memory: the caller keeps ``buffers`` referenced
    while it is in use. One native pass where ``dkv._buffer_run`` is built
    (a ucxx ``Array`` per buffer cost ~1 µs each: ~0.25 ms of a 256-block
    read on each side); buffers without the buffer protocol (device
    arrays) are asked about the other way.
    """
    if _buffer_run is not None:
        try:
            run = _buffer_run(buffers, writable)
        except (TypeError, BufferError):
            pass
        else:
            return None if run is None else _char_array(run[1]).from_address(run[0])
    return _span_python(buffers, sizes, writable)


def _span_python(buffers: Sequence[Any], sizes: Sequence[int], writable: bool = False) -> Any | None:
    """:func:`_span` through ucxx's ``Array`` of each buffer (also where the native pass is not built)."""
    first = Array(buffers[0])
    if first.cuda or not first.c_contiguous or (writable and first.readonly):
        return None
    base = end = first.ptr
    end += sizes[0]
    for buf, n in zip(buffers[1:], sizes[1:]):
        arr = Array(buf)
        if arr.ptr != end or arr.cuda or not arr.c_contiguous or (writable and arr.readonly):
            return None
        end += n
    return _char_array(end - base).from_address(base)


@functools.lru_cache(maxsize=256)
def _char_array(length: int) -> Any:
    """The ctypes array type of ``length`` chars, kept: ctypes made a new one now and then, collectable only by the GC."""
    return ctypes.c_char * length


def _canary_view(buffer: Any) -> memoryview | None:
    """A flat writable view of ``buffer`` itself (never a copy) to hold a canary; None when it has none."""
    try:
        view = memoryview(buffer)
    except TypeError:  # no buffer protocol (an array type UCX takes another way): no canary
        return None
    if view.readonly or not view.c_contiguous:
        return None
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _take_staging(nbytes: int) -> bytearray:
    if nbytes <= GROUP_BYTES:
        return _staging.pop() if _staging else bytearray(GROUP_BYTES)
    return bytearray(nbytes)


def _give_staging(stage: bytearray) -> None:
    """Keep a staging buffer whose request completed (never one that may still be written)."""
    if len(stage) == GROUP_BYTES and len(_staging) < _STAGING_KEEP:
        _staging.append(stage)


def _request(awaitable: Awaitable[Any]) -> asyncio.Future[Any]:
    """A task for one UCX request whose failure keeps none of its buffers (see _drop_traceback)."""
    task = asyncio.ensure_future(awaitable)
    task.add_done_callback(_drop_task_traceback)
    return task


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


# The tag exchange that opens every UCX connection, as ucxx's own does it (so either side may be
# ucxx's): each side streams its receive tag and a checksum of it; the listener sends first.
_PEER_INFO = struct.Struct("QQ")


async def _exchange_tags(driver: _LoopProgress, raw: Any, listener: bool) -> dict[str, int]:
    """Exchange message tags with the peer over ``raw`` (a ucxx endpoint), loop mode.

    Unbounded here: the caller bounds it, and aborting ``raw`` ends it (the
    driver holds both buffers until UCX completes their requests).
    """
    tag = hash64bits("msg_tag", os.urandom(16), raw.handle)
    mine = _PEER_INFO.pack(tag, hash64bits(tag))
    theirs = bytearray(_PEER_INFO.size)

    def send() -> asyncio.Future[None]:
        return driver.watch(raw.stream_send(Array(mine)), mine)

    def receive() -> asyncio.Future[None]:
        return driver.watch(raw.stream_recv(Array(theirs)), theirs)

    for step in (send, receive) if listener else (receive, send):
        await step()
    peer_tag, checksum = _PEER_INFO.unpack(theirs)
    if checksum != hash64bits(peer_tag):
        raise ProtocolError("the peer's UCX handshake carried a bad checksum")
    return {"msg_send": peer_tag, "msg_recv": tag}


def _close_raw(raw: Any) -> None:
    """Abort a ucxx endpoint that never became a Connection (its requests are cancelled)."""
    try:
        raw.close_blocking(period=CLOSE_PERIOD_NS)
    except Exception as exc:  # noqa: BLE001 - closing must not raise
        log.debug("abort of a half-open endpoint: %s", exc)
    if _driver is not None:
        _driver.kick()


async def _connect_loop_driven(driver: _LoopProgress, host: str, port: int, timeout: float) -> Connection:
    ctx = ucxx.core._get_ctx()
    try:
        raw = ucx_api.UCXEndpoint.create(ctx.worker, host, port, True)
    except Exception as exc:
        raise TransportError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}") from exc
    driver.kick()
    try:
        async with asyncio.timeout(timeout):
            tags = await _exchange_tags(driver, raw, listener=False)
    except TimeoutError as exc:
        _close_raw(raw)
        raise OpTimeout(f"connect to {host}:{port} timed out after {timeout:.1f}s") from exc
    except BaseException as exc:
        _close_raw(raw)
        if isinstance(exc, (asyncio.CancelledError, DKVError)) or not isinstance(exc, Exception):
            raise
        _drop_traceback(exc)
        raise TransportError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}") from exc
    return Connection(Endpoint(endpoint=raw, ctx=ctx, tags=tags), f"{host}:{port}")


async def connect(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> Connection:
    """Open a listener-path endpoint to ``host:port`` (peer-failure detection on) within ``timeout``."""
    init_transport()
    if _driver is not None:
        return await _connect_loop_driven(_driven_here(), host, port, timeout)
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

    UCX listeners bind every interface; ``port=0`` picks a free port, and a
    port another process listens on raises :class:`TransportError` (a port
    that only a dead process's closing connections hold is taken: see
    ``UCX_TCP_CM_REUSEADDR`` above). An open listener holds the transport
    (:func:`hold_transport`); closing it lets go without stopping UCX (its
    server calls :func:`stop_progress` as it ends).

    Made on a running event loop, it also resets the connections that UCX
    leaves stuck on its port when a peer sends a malformed connection request
    (:mod:`dkv.stuck_connections`): without that, each would hold a descriptor
    and keep UCX's async thread spinning for the life of the process.
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
        try:
            if _driver is not None:
                self._listener = self._listen_loop_driven(_driven_here(), _accept, port)
            else:
                self._listener = ucxx.create_listener(_accept, port=port, endpoint_error_handling=True,
                                                      connect_timeout=HANDSHAKE_NEVER_TIMES_OUT)
        except ucxx.exceptions.UCXBusyError as exc:
            raise TransportError(f"cannot listen: port {port} is in use by another process") from exc
        hold_transport()
        self.port: int = self._listener.port
        self._reaper: StuckConnectionReaper | None = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop to scan on
            return
        self._reaper = StuckConnectionReaper(self.port)
        self._reaper.start()

    def _listen_loop_driven(self, driver: _LoopProgress, accept: Callable[[Any], Awaitable[None]], port: int) -> Any:
        """A raw ucxx listener whose connections are handshaken on the loop (loop mode).

        UCX calls back from progress, so on the loop thread. Each accepted
        connection's handshake and handler run as one task, kept referenced
        until it ends.
        """
        ctx = ucxx.core._get_ctx()
        tasks: set[asyncio.Task[None]] = set()
        self._accepting = tasks

        async def handshake_then_serve(raw: Any) -> None:
            try:
                tags = await _exchange_tags(driver, raw, listener=True)
            except asyncio.CancelledError:
                _close_raw(raw)
                raise
            except Exception as exc:  # noqa: BLE001 - a peer that failed its handshake: it goes
                log.debug("UCX handshake of an incoming connection: %s", exc)
                _close_raw(raw)
                return
            try:
                await accept(Endpoint(endpoint=raw, ctx=ctx, tags=tags))
            except Exception:  # noqa: BLE001 - the handler owns its errors; one that escapes is logged
                log.exception("UCX connection handler failed")

        def accepted(raw: Any) -> None:
            task = driver.loop.create_task(handshake_then_serve(raw))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        listener = ucx_api.UCXListener.create(worker=ctx.worker, port=port, cb_func=accepted,
                                              deliver_endpoint=True)
        driver.kick()
        return listener

    @property
    def stuck_connections_reset(self) -> int:
        """Connections stuck in UCX's connection manager that this listener reset (see the class docstring)."""
        return self._reaper.resets if self._reaper is not None else 0

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None
        if self._listener is not None:
            close = getattr(self._listener, "close", None)  # ucxx's listener; a raw one stops when dropped
            if close is not None:
                close()
            self._listener = None
            drop_transport()
