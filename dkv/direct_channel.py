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
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from dkv import polling
from dkv.errors import OpTimeout, ProtocolError, TransportError
from dkv.polling import REPLY_SPIN
from dkv.wire import HEADER_SIZE, MAX_FRAME, decode_body, decode_header, encode_body, encode_header

_FIRST_READ = 64 * 1024  # the first read of a reply: a lookup's of a few hundred hashes, header and all
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT  # (an enum's | costs a few µs a call: made once)
_TIMEVAL = struct.Struct("@ll")  # struct timeval, for SO_RCVTIMEO / SO_SNDTIMEO
# a blocking call whose kernel bound ran out fails with EAGAIN (BlockingIOError); a deadline already past
# is a TimeoutError of our own
_TIMED_OUT = (TimeoutError, BlockingIOError)


class ChannelBusy(TransportError):
    """Another thread is using the channel now: take another path (nothing was sent)."""


class ChannelClosed(TransportError):
    """The channel is closed, or closed while the request was being written: the node did not see it."""


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
            sock = self._sock
            if self._closed or sock is None:
                raise ChannelClosed(f"the direct channel to {self.peer} is closed")
            if _peer_closed(sock):
                self._fail()
                raise ChannelClosed(f"the node closed the direct channel {self.peer}")
            deadline = time.monotonic() + timeout
            body = encode_body(message)
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
            except _TIMED_OUT as exc:
                self._fail()
                raise OpTimeout(f"receive from {self.peer} timed out after {timeout:.1f}s") from exc
            except OSError as exc:
                self._fail()
                raise TransportError(f"receive from {self.peer} failed: {exc}") from exc
            except ProtocolError:
                self._fail()
                raise
            self.exchanges += 1
            return reply, payload
        finally:
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


def _peer_closed(sock: socket.socket) -> bool:
    """True when the node closed its end (or the socket failed); one non-blocking peek, no bytes taken."""
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
        _fill(sock, buffer, got, at + count, deadline, spin_ns)
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
