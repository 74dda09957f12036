"""A control connection driven from the calling thread: one blocking request and its reply.

A leased lookup blocks its caller for one round trip (``DKVConnector.lookup``).
Through the event loop that round trip costs two extra thread wake-ups and
the asyncio machinery on top of the node's own time: on a 2-core VM, 256
hashes took ~320 µs through the loop against ~190 µs as one ``send`` and a
blocking ``recv`` on the calling thread. So a client may open one more
control connection, handshake it on the loop as any other (the same mutual
proof, the same client id, so the node counts it among the client's
connections and its leases stay the client's), then hand its socket here
(:meth:`dkv.stream_channel.StreamConnection.detach`): the node's same-host
control socket, or on the listener path its TCP one, where a lookup that asks
for its blocks' bytes gets them right after the reply (:meth:`DirectChannel.exchange_with`).

Contract:

* One exchange at a time. A thread that finds the channel busy is told so at
  once (:class:`ChannelBusy`) and takes another path; it never waits for it.
* Every exchange is bounded by its ``timeout`` overall: the kernel's bound
  on the socket's next send or receive (``SO_SNDTIMEO``/``SO_RCVTIMEO``) is
  set to what is left before each blocking call (the send's, which starts
  the exchange, to ``timeout`` itself: set again only when that changes). A timeout raises
  :class:`~dkv.errors.OpTimeout` (the node is hung).
* Any failure closes the channel before it raises (a half-read reply leaves
  the stream out of step). A failure before the request was wholly written,
  or the node's close noticed before it (a peek at the socket, as a pool
  checks a connection that sat idle), raises :class:`ChannelClosed`: the
  node never saw the request, so the caller may ask again another way.
* Replies are framed and checked as on every other path
  (:func:`dkv.wire.decode_header`, :func:`dkv.wire.decode_body`); a bad frame
  is a :class:`~dkv.errors.ProtocolError`.
* The reply is first polled for, without the GIL, for up to ``spin``
  seconds (:mod:`dkv.polling`; nothing where it is not built), then waited
  for in a blocking receive: a thread asleep in ``recv`` pays its core's
  wake-up when the reply lands, tens of µs on a virtual machine. Once its
  first bytes are in, each next part (the node's one write of a reply and
  64 KiB of blocks arrives in two segments over loopback) is polled for
  the same way, for up to ``spin`` each.
* :attr:`closed` is a flag (no system call) and :meth:`abort` is safe from
  any thread: while an exchange runs it only shuts the socket down (which
  wakes the blocked call) and the exchanging thread closes the descriptor,
  so no descriptor is closed under a thread that is still using it.
* An exchange may also be split in two (:meth:`DirectChannel.begin`): the
  request is sent at once, and the reply is read later by whoever polls
  (:meth:`PendingReply.poll`), never blocking: each poll reads what has
  arrived (``MSG_DONTWAIT``) and answers once the reply, and the bytes it
  names, are whole. The same checks, the same bound (a poll past the
  deadline fails with :class:`~dkv.errors.OpTimeout`), and the channel is
  held from the send until the reply settles: meanwhile other exchanges
  are turned away (:class:`ChannelBusy`). A connector's ``start_lookup``
  runs this way, so that its scheduler thread, which polls its handles
  anyway, reads the answer itself instead of waiting for the loop thread
  to take the GIL from it (see :mod:`connector.worker_side`).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from dkv import held_gil, polling
from dkv.errors import OpTimeout, ProtocolError, TransportError
from dkv.polling import REPLY_SPIN
from dkv.wire import HEADER_SIZE, MAX_FRAME, decode_body, decode_header, encode_body, encode_header

_FIRST_READ = 64 * 1024  # the first read of a reply: a lookup's of a few hundred hashes, header and all
# the largest request begin() sends: far under the kernel's send buffer of a channel (1 MiB asked for by
# dkv.stream_channel, at least 208 KiB by default), which is empty when an exchange begins, so the send never waits
BEGIN_MAX_BYTES = 64 * 1024
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT  # (an enum's | costs a few µs a call: made once)
_native_peer_closed = polling.peer_closed
_TIMEVAL = struct.Struct("@ll")  # struct timeval, for SO_RCVTIMEO / SO_SNDTIMEO
# a blocking call whose kernel bound ran out fails with EAGAIN (BlockingIOError); a deadline already past
# is a TimeoutError of our own
_TIMED_OUT = (TimeoutError, BlockingIOError)

try:  # a read's blocks received straight into rows, hashed as they land, without the GIL (exchange_into_rows)
    from dkv._checked_copy import recv_rows as _recv_rows
except ImportError:  # not built: such reads go the way they always went (over UCX, on the loop)
    _recv_rows = None


class ChannelBusy(TransportError):
    """Another thread is using the channel now: take another path (nothing was sent)."""


class ChannelClosed(TransportError):
    """The channel is closed, or closed while the request was being written: the node did not see it."""


class RowsTarget(NamedTuple):
    """One run of a read's blocks for :meth:`DirectChannel.exchange_into_rows`: where they land, what they hash to.

    Block ``i`` (``row_bytes`` long) goes into row ``ids[i]`` of ``rows``
    (a writable buffer of whole rows); its checksum is XXH3-128 of ``head ||
    hashes[i] || bytes`` (:func:`dkv.checksum.block_head`). A tuple of these
    five, as :func:`dkv._checked_copy.recv_rows` takes it.
    """

    rows: Any
    row_bytes: int
    ids: Sequence[int]
    head: bytes
    hashes: Sequence[bytes]


class DirectChannel:
    """A handshaken control socket (same-host or TCP), used from the calling thread (see the module docstring)."""

    def __init__(self, sock: socket.socket, peer: str, max_frame: int = MAX_FRAME, spin: float = REPLY_SPIN) -> None:
        """``spin``: seconds each reply is polled for before a blocking receive (0: none; see the module docstring)."""
        sock.setblocking(True)
        self._sock: socket.socket | None = sock
        self.peer = peer
        self.max_frame = max_frame
        self._spin_ns = polling.spin_ns(spin)
        self._lock = threading.Lock()  # held through one exchange
        self._inbox = bytearray(_FIRST_READ)  # replies are read into this (a larger one gets its own)
        self._closed = False
        self._send_bound = -1.0  # the timeout the socket's send bound was last set for
        self.exchanges = 0

    @property
    def closed(self) -> bool:
        """True once aborted or failed. Safe from any thread; never reads the socket."""
        return self._closed

    @property
    def in_use(self) -> bool:
        """True while an exchange holds the channel (a hint: the next exchange may still find it busy). Any thread."""
        return self._lock.locked()

    def exchange(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send ``message`` and return the node's reply (decoded, not yet judged), within ``timeout`` seconds."""
        return self.exchange_with(message, timeout)[0]

    def exchange_with(self, message: dict[str, Any], timeout: float,
                      room: int = 0) -> tuple[dict[str, Any], memoryview | None]:
        """:meth:`exchange`, and the block bytes that follow a reply that names them (``sent``), within ``timeout``.

        ``room``: the most bytes the request asked to be sent (a leased
        lookup's ``send``; 0: none). A reply with ``sent`` is followed on the
        stream by exactly the total of its ``sizes``, read here (the second
        item; ``None`` without ``sent``): into the buffer the reply was read
        into, sized for the reply and ``room``, which the view keeps alive
        (account for all of it), else a buffer of their own. A ``sent``
        that is not a list of sizes, or names more than ``room``, or one
        that comes unasked, is a :class:`~dkv.errors.ProtocolError` (the
        stream is out of step: the channel is closed); whether the sizes
        match the request is the caller's to judge.
        """
        if not self._lock.acquire(blocking=False):
            raise ChannelBusy(f"the direct channel to {self.peer} is in use")
        try:
            sock, deadline = self._send_request(message, timeout)
            try:
                # with room asked, into a buffer of its own that also holds the bytes (read with the reply, if they
                # are there by then, and kept: not zeroed, as only what is read is ever looked at)
                inbox = memoryview(np.empty(_FIRST_READ + room, np.uint8)) if room > 0 else memoryview(self._inbox)
                buffer, end, got = _receive_frame(sock, inbox, deadline, self.max_frame, self._spin_ns,
                                                  bytes_may_follow=room > 0)
                reply = decode_body(buffer[HEADER_SIZE:end])
                sent = _sent_bytes(reply, room)
                if sent is None and got > end:
                    raise ProtocolError(f"{got - end} bytes past the reply's frame: the stream is out of step")
                payload = None if sent is None else _receive_bytes(sock, buffer, end, got, sent, deadline,
                                                                   self._spin_ns)
            except BaseException as exc:  # the stream may be out of step: the channel closes
                failure = self._failed(exc, timeout)
                if failure is exc:
                    raise
                raise failure from exc
            self.exchanges += 1
            return reply, payload
        finally:
            self._let_go()

    def exchange_into_rows(self, message: dict[str, Any], timeout: float,
                           expect: Callable[[dict[str, Any]], tuple[Sequence[RowsTarget], bytes] | None],
                           ) -> tuple[dict[str, Any], bytes | None]:
        """Send ``message`` (a read), then receive the blocks that follow its reply straight into rows, within ``timeout``.

        ``expect(reply)`` judges the reply before any block byte is read: it
        returns where the blocks go, run by run in the stream's order
        (:class:`RowsTarget`), with their checksums (16 bytes a block, in
        that order), ``None`` where the reply brings none (an error reply:
        nothing may follow it), or raises
        (the node is sending bytes nobody will read: the channel closes). The
        blocks are received natively, without the GIL, each hashed as its bytes
        land (:func:`dkv._checked_copy.recv_rows`). Returns the reply and one
        verdict byte a block (1: its bytes matched its checksum), or ``None``.
        Raises as :meth:`exchange_with` does; once block bytes began to arrive,
        any failure closes the channel.
        """
        if _recv_rows is None:
            raise ChannelBusy("no native receive into rows here (dkv._checked_copy is not built)")
        if not self._lock.acquire(blocking=False):
            raise ChannelBusy(f"the direct channel to {self.peer} is in use")
        try:
            sock, deadline = self._send_request(message, timeout)
            try:
                buffer, end, got = _receive_frame(sock, memoryview(self._inbox), deadline, self.max_frame,
                                                  self._spin_ns, bytes_may_follow=True)
                reply = decode_body(buffer[HEADER_SIZE:end])
                expected = expect(reply)
                if expected is None:
                    if got > end:
                        raise ProtocolError(f"{got - end} bytes past a reply that names none: the stream is out of step")
                    self.exchanges += 1
                    return reply, None
                targets, sums = expected
                verdicts = _recv_rows(sock.fileno(), targets, sums, bytes(buffer[end:got]),
                                      max(deadline - time.monotonic(), 0.0))
            except BaseException as exc:  # (a reply the caller refused, too: the node is sending bytes no one reads)
                failure = self._failed(exc, timeout)
                if failure is exc:
                    raise
                raise failure from exc
            self.exchanges += 1
            return reply, verdicts
        finally:
            self._let_go()

    def _failed(self, exc: BaseException, timeout: float) -> BaseException:
        """An exchange's receive failed with ``exc``: close the channel; what to raise (``exc`` itself, or mapped).

        A receive past its bound is :class:`~dkv.errors.OpTimeout`, another
        socket error a :class:`~dkv.errors.TransportError`; anything else (a
        :class:`~dkv.errors.ProtocolError`, say) is raised as it is.
        """
        self._fail()
        if isinstance(exc, _TIMED_OUT):
            return OpTimeout(f"receive from {self.peer} timed out after {timeout:.1f}s")
        if isinstance(exc, OSError):
            return TransportError(f"receive from {self.peer} failed: {exc}")
        return exc

    def _send_request(self, message: dict[str, Any], timeout: float,
                      most: int | None = None) -> tuple[socket.socket, float]:
        """With the channel held: send ``message``; the socket and the exchange's deadline.

        :class:`ChannelClosed` where the node cannot have seen it (the
        channel closed, by either end, or the write failed); :class:`OpTimeout`
        where the write did not finish in time. Either closes the channel
        (but not its descriptor: the holder does, as it lets go).
        """
        sock = self._sock
        if self._closed or sock is None:
            raise ChannelClosed(f"the direct channel to {self.peer} is closed")
        body = encode_body(message)
        if most is not None and HEADER_SIZE + len(body) > most:
            raise ChannelBusy(f"a request of {HEADER_SIZE + len(body)} bytes is not begun (at most {most})")
        if _peer_closed(sock):
            self._fail()
            raise ChannelClosed(f"the node closed the direct channel {self.peer}")
        deadline = time.monotonic() + timeout
        try:
            if self._send_bound != timeout:  # the send starts the exchange: its bound is the whole timeout
                _bounded(sock, deadline, socket.SO_SNDTIMEO)
                self._send_bound = timeout
            sock.sendall(encode_header(len(body)) + body)
        except OSError as exc:
            self._fail()
            if isinstance(exc, _TIMED_OUT):
                raise OpTimeout(f"send to {self.peer} timed out after {timeout:.1f}s") from exc
            raise ChannelClosed(f"send to {self.peer} failed: {exc}") from exc
        return sock, deadline

    def begin(self, message: dict[str, Any], timeout: float, room: int = 0) -> PendingReply:
        """Send ``message`` now; its reply (and the bytes it names, as :meth:`exchange_with`'s) is read by polling.

        Never waits for the reply: see :class:`PendingReply`, which holds
        the channel until the reply settles. Nor for the node to read the
        request: the channel's previous exchange was answered, so its
        socket's send buffer is empty, and a request of at most
        :data:`BEGIN_MAX_BYTES` goes into it at once (a larger one is not
        sent: :class:`ChannelBusy`, take another path). Raises as the send
        of :meth:`exchange_with` does (:class:`ChannelBusy`,
        :class:`ChannelClosed`: nothing was sent; :class:`~dkv.errors.OpTimeout`).
        """
        if not self._lock.acquire(blocking=False):
            raise ChannelBusy(f"the direct channel to {self.peer} is in use")
        try:
            sock, deadline = self._send_request(message, timeout, BEGIN_MAX_BYTES)
        except BaseException:
            self._let_go()
            raise
        return PendingReply(self, sock, deadline, timeout, room)

    def _let_go(self) -> None:
        """Release the channel (held through an exchange); a channel that failed meanwhile closes its descriptor."""
        self._lock.release()
        if self._closed:
            self._close_descriptor()

    def abort(self) -> None:
        """Close the channel. Idempotent; safe from any thread, during an exchange too (which then fails)."""
        self._closed = True
        sock = self._sock
        if sock is None:
            return
        if self._lock.acquire(blocking=False):
            try:
                self._close_descriptor()
            finally:
                self._lock.release()
        else:  # an exchange runs: wake its blocked call; it closes the descriptor as it leaves
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _fail(self) -> None:
        self._closed = True

    def _close_descriptor(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class PolledOutcome:
    """One outcome, reached by steps that any thread takes when it polls: one thread at a time, none waiting.

    :meth:`poll` takes a step (:meth:`_step`, a subclass's) unless the
    outcome is settled or another thread is taking one, then answers the
    outcome (``None`` until settled) or raises the failure, every time
    after too. A step settles it by setting ``_outcome`` or ``_failure``.
    """

    def __init__(self) -> None:
        self._outcome: Any = None
        self._failure: BaseException | None = None
        self._stepping = threading.Lock()

    @property
    def settled(self) -> bool:
        """Whether the outcome is reached, or failed (no system call)."""
        return self._outcome is not None or self._failure is not None

    def poll(self) -> Any:
        """Any thread, never blocks: a step if one is due; the outcome once settled (else ``None``), or its failure."""
        if not self.settled and self._stepping.acquire(blocking=False):
            try:
                if not self.settled:
                    self._step()
            finally:
                self._stepping.release()
        if self._failure is not None:
            raise self._failure
        return self._outcome

    def _step(self) -> None:
        raise NotImplementedError


class PendingReply(PolledOutcome):
    """A request :meth:`DirectChannel.begin` sent, whose reply is read by :meth:`poll` without ever blocking.

    Contract:

    * :meth:`poll` (any thread; one at a time: a poll while another runs
      answers ``None``) reads what has arrived and answers ``None`` until the
      reply is whole, then ``(reply, payload)`` as
      :meth:`DirectChannel.exchange_with` returns them, every time after too.
    * It fails as :meth:`DirectChannel.exchange_with` does (the same checks
      of the frame and of the bytes it names), with the channel closed: a
      poll past the deadline with :class:`~dkv.errors.OpTimeout`; a stream
      that ended, or was aborted, with :class:`~dkv.errors.TransportError`;
      the failure is raised by that poll and every later one.
    * The channel is held from the send until the reply settles, either way.
      :meth:`abort` settles it at once (failed, the channel closed).
    """

    def __init__(self, channel: DirectChannel, sock: socket.socket, deadline: float, timeout: float,
                 room: int) -> None:
        super().__init__()
        self._channel = channel
        self._sock = sock
        self._deadline = deadline
        self._timeout = timeout
        self._room = room
        # as exchange_with: the channel's inbox, or with room asked a buffer that also holds the bytes
        self._buffer = memoryview(np.empty(_FIRST_READ + room, np.uint8)) if room > 0 else memoryview(channel._inbox)
        self._got = 0  # bytes read into _buffer
        self._frame_end: int | None = None  # the reply's frame is _buffer[:_frame_end], once its header is in
        self._reply: dict[str, Any] | None = None
        self._payload_at = 0  # the sent bytes lie in _buffer from here (0 in a buffer of their own)
        self._payload_end: int | None = None  # ... to here, once the reply named them

    def poll(self) -> tuple[dict[str, Any], memoryview | None] | None:
        """Any thread, never blocks: the reply and its bytes once whole, else ``None`` (see the class)."""
        return super().poll()  # type: ignore[no-any-return]

    def abort(self) -> None:
        """Settle now, failed, closing the channel (safe from any thread; nothing once settled)."""
        with self._stepping:
            if not self.settled:
                self._fail(TransportError(f"the exchange on the direct channel {self._channel.peer} was aborted"))

    def _step(self) -> None:
        """Read what has arrived; settle when the reply is whole or the exchange failed."""
        channel = self._channel
        try:
            if channel.closed:  # aborted (the descriptor is ours to close, as we let go)
                raise ConnectionAbortedError("the channel was closed")
            while self._outcome is None:
                need = self._needed()
                if need is None:
                    continue  # the stage moved on: look again
                if need == 0:
                    break
                # holding the GIL: a poll must not hand it to a thread waiting for it (see dkv.held_gil)
                n = held_gil.recv_into_now(self._sock, self._buffer[self._got:])
                if n < 0:  # nothing has arrived yet
                    if time.monotonic() >= self._deadline:
                        raise OpTimeout(f"receive from {channel.peer} timed out after {self._timeout:.1f}s")
                    return
                if n == 0:
                    raise ConnectionResetError("the node closed the connection")
                self._got += n
        except (OpTimeout, ProtocolError) as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(TransportError(f"receive from {channel.peer} failed: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a body that does not decode, say: closed as any other failure
            self._fail(exc)

    def _needed(self) -> int | None:
        """How many more bytes the stage needs (0: settled now); ``None`` when the stage moved on without reading."""
        got, buffer = self._got, self._buffer
        if self._frame_end is None:  # the header
            if got < HEADER_SIZE:
                return HEADER_SIZE - got
            total = HEADER_SIZE + decode_header(bytes(buffer[:HEADER_SIZE]), self._channel.max_frame)
            if got > total and self._room <= 0:
                raise ProtocolError(f"{got - total} bytes past the reply's frame: the stream is out of step")
            if total > len(buffer):  # (then got < total: nothing past the frame was read)
                larger = memoryview(bytearray(total))
                larger[:got] = buffer[:got]
                self._buffer = larger
            self._frame_end = total
            return None
        if self._reply is None:  # the body
            end = self._frame_end
            if got < end:
                return end - got
            self._reply = decode_body(buffer[HEADER_SIZE:end])
            sent = _sent_bytes(self._reply, self._room)
            if sent is None:
                if got > end:
                    raise ProtocolError(f"{got - end} bytes past the reply's frame: the stream is out of step")
                return self._settle(None)
            if got - end > sent:
                raise ProtocolError(f"{got - end - sent} bytes past the reply's blocks: the stream is out of step")
            if end + sent <= len(buffer):
                self._payload_at, self._payload_end = end, end + sent
            else:  # a buffer of their own, as exchange_with's
                own = memoryview(bytearray(sent))
                own[:got - end] = buffer[end:got]
                self._buffer, self._got, self._payload_at, self._payload_end = own, got - end, 0, sent
            return None
        end = self._payload_end
        assert end is not None
        if got < end:
            return end - got
        if got > end:  # (read on into the buffer's room: the node sends nothing unasked)
            raise ProtocolError(f"{got - end} bytes past the reply's blocks: the stream is out of step")
        return self._settle(self._buffer[self._payload_at:end])

    def _settle(self, payload: memoryview | None) -> int:
        assert self._reply is not None
        self._outcome = (self._reply, payload)
        self._channel.exchanges += 1
        self._channel._let_go()  # noqa: SLF001 - the channel's own exchange
        return 0

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        self._channel._fail()  # noqa: SLF001
        self._channel._let_go()  # noqa: SLF001


def _peer_closed(sock: socket.socket) -> bool:
    """True when the node closed its end (or the socket failed); one non-blocking peek, no bytes taken.

    Asked before every request a channel sends. Natively where built
    (:data:`dkv.polling.peer_closed`): a Python peek raises and catches an
    exception each time it finds nothing, which is nearly always.
    """
    if _native_peer_closed is not None:
        return _native_peer_closed(sock.fileno())
    try:
        return sock.recv(1, _PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _bounded(sock: socket.socket, deadline: float, option: int) -> None:
    """Let the socket's next blocking send (``SO_SNDTIMEO``) or receive (``SO_RCVTIMEO``) wait only until ``deadline``.

    The kernel keeps the bound (the call then fails with ``EAGAIN``: see
    ``_TIMED_OUT``), so the socket stays blocking: with a Python timeout
    instead, every receive would first wait in ``poll`` and then read, which
    measured ~15-20 µs slower per round trip here. ``TimeoutError`` once the
    deadline has passed.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the exchange's time ran out")
    seconds = int(left)
    micros = max(1, int((left - seconds) * 1e6)) if seconds == 0 else int((left - seconds) * 1e6)  # 0, 0: no bound
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(seconds, micros))


def _receive_frame(sock: socket.socket, inbox: memoryview, deadline: float, max_frame: int,
                   spin_ns: int = 0, *, bytes_may_follow: bool = False) -> tuple[memoryview, int, int]:
    """One framed message, before ``deadline``: ``(buffer, end, got)``; ``ConnectionResetError`` when the stream ends first.

    The frame is ``buffer[:end]`` (header, then body); ``got`` bytes were
    read into ``buffer``. It is ``inbox`` (the caller's: its body is decoded
    before the next exchange), where header and body usually come in one
    read, or, for a frame larger than ``inbox``, a buffer of its own. The
    first read is polled for up to ``spin_ns`` (never past ``deadline``)
    before a blocking one, and so is each next part once the first came
    (:func:`_fill`). The node sends nothing unasked, so a byte past the
    frame means the stream is out of step (a :class:`~dkv.errors.ProtocolError`)
    unless ``bytes_may_follow`` (a request that asked for block bytes after
    its reply): then they are ``buffer[end:got]``. The header is checked (its
    bound included) before a body larger than ``inbox`` is allocated.
    """
    got = 0
    if spin_ns:
        got = _polled_read(sock, inbox, deadline, spin_ns)
        if got < 0:  # nothing within the bound: the rest is waited for, not polled for again
            got, spin_ns = 0, 0
    got = _fill(sock, inbox, got, HEADER_SIZE, deadline, spin_ns)
    length = decode_header(bytes(inbox[:HEADER_SIZE]), max_frame)
    total = HEADER_SIZE + length
    if got > total and not bytes_may_follow:
        raise ProtocolError(f"{got - total} bytes past the reply's frame: the stream is out of step")
    if total > len(inbox):  # (then got < total: nothing past the frame was read)
        larger = memoryview(bytearray(total))
        larger[:got] = inbox[:got]
        inbox = larger
    got = _fill(sock, inbox, got, total, deadline, spin_ns)
    return inbox, total, got


def _sent_bytes(reply: Any, room: int) -> int | None:
    """How many block bytes follow ``reply`` on the stream (its ``sent`` sizes' total); ``None`` when none do.

    :class:`~dkv.errors.ProtocolError` for ``sent`` in a reply to a request
    that asked for none (``room`` 0), sizes that are not byte counts, or more
    bytes than ``room``.
    """
    sent = reply.get("sent") if isinstance(reply, dict) else None
    if sent is None:
        return None
    sizes = sent.get("sizes") if isinstance(sent, dict) else None
    if (room <= 0 or not isinstance(sizes, list)
            or not all(type(size) is int and size >= 0 for size in sizes)):  # noqa: E721 - bool is no size
        raise ProtocolError("a reply names block bytes the request did not ask for, or not as sizes")
    total = sum(sizes)
    if total > room:
        raise ProtocolError(f"a reply names {total} block bytes after it; at most {room} were asked for")
    return total


def _receive_bytes(sock: socket.socket, buffer: memoryview, at: int, got: int, count: int,
                   deadline: float, spin_ns: int = 0) -> memoryview:
    """The ``count`` bytes that follow a reply ending at ``buffer[at]`` (``got`` bytes of ``buffer`` read so far).

    Read on into ``buffer`` where they fit (so nothing is copied), else into
    a buffer of their own; polled for as :func:`_fill` says.
    """
    if got - at > count:
        raise ProtocolError(f"{got - at - count} bytes past the reply's blocks: the stream is out of step")
    if at + count <= len(buffer):
        got = _fill(sock, buffer, got, at + count, deadline, spin_ns)
        if got > at + count:  # (read on into the buffer's room: the node sends nothing unasked)
            raise ProtocolError(f"{got - at - count} bytes past the reply's blocks: the stream is out of step")
        return buffer[at:at + count]
    own = memoryview(bytearray(count))
    own[:got - at] = buffer[at:got]
    _fill(sock, own, got - at, count, deadline, spin_ns)
    return own


def _polled_read(sock: socket.socket, view: memoryview, deadline: float, spin_ns: int) -> int:
    """One read into ``view``'s start, polled for up to ``spin_ns`` (never past ``deadline``): the bytes read, or -1.

    ``ConnectionResetError`` when the node closed the stream. Only where
    :mod:`dkv.polling` is built (``spin_ns`` is 0 elsewhere).
    """
    assert polling.recv_spin is not None  # (spin_ns is 0 where it is not built)
    n = polling.recv_spin(sock.fileno(), view, min(spin_ns, int((deadline - time.monotonic()) * 1e9)))
    if n == 0:
        raise ConnectionResetError("the node closed the connection")
    return n


def _fill(sock: socket.socket, view: memoryview, got: int, at_least: int, deadline: float, spin_ns: int = 0) -> int:
    """Read into ``view`` from ``got`` until at least ``at_least`` bytes are in; how many are.

    The rest of a message whose start is in is usually on its way: a reply
    and the block bytes after it leave the node in one write, which loopback
    delivers in segments of at most 64 KiB. With ``spin_ns`` each next part
    is first polled for, without the GIL, for up to that long (never past
    ``deadline``), then waited for in a blocking receive as before.
    """
    while spin_ns and got < at_least:
        n = _polled_read(sock, view[got:], deadline, spin_ns)
        if n < 0:
            break  # nothing within the bound: wait for it
        got += n
    while got < at_least:
        _bounded(sock, deadline, socket.SO_RCVTIMEO)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the node closed the connection")
        got += n
    return got
