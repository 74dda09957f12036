"""The direct channel (dkv.direct_channel.DirectChannel): one blocking exchange at a time, on the calling thread.

The other end of a real Unix socket pair plays the node, on a thread of its
own. These pin the contract the connector's lookups in place rely on: a reply
arrives whole however it is cut; every exchange is bounded; a channel the node
closed is found out before anything is sent (so the caller may ask the other
way); a second thread is turned away at once, never made to wait; any failure
closes the channel; and an abort from another thread wakes a blocked exchange.
A reply that names block bytes after it (a listener lookup's ``sent``) brings
exactly those, only when asked and within what was asked, or fails and closes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dkv.direct_channel import BEGIN_MAX_BYTES, ChannelBusy, ChannelClosed, DirectChannel
from dkv.polling import REPLY_SPIN
from dkv.errors import FrameTooLarge, OpTimeout, ProtocolError, TransportError
from dkv.stream_channel import StreamConnection
from dkv.wire import HEADER_SIZE, decode_body, decode_header, encode_body, encode_header

pytestmark = pytest.mark.timeout(60)


def _frame(message: dict) -> bytes:
    body = encode_body(message)
    return encode_header(len(body)) + body


def _read_frame(sock: socket.socket) -> dict:
    header = _read_exactly(sock, HEADER_SIZE)
    return decode_body(_read_exactly(sock, decode_header(header)))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    return data


class FakeNode:
    """The node's end of the pair: answers each request with ``answer(request)`` (raw bytes), on its own thread."""

    def __init__(self, sock: socket.socket, answer: Callable[[dict], bytes]) -> None:
        self.sock = sock
        self.answer = answer
        self.requests: list[dict] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                request = _read_frame(self.sock)
                self.requests.append(request)
                reply = self.answer(request)
                if reply:
                    self.sock.sendall(reply)
        except OSError:
            pass


@pytest.fixture(params=[REPLY_SPIN, 0.0], ids=["reply-polled-first", "reply-waited-for"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[DirectChannel, socket.socket]]:
    """Our channel and the node's end; every test runs with the reply polled for first and without."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = DirectChannel(ours, "test", spin=request.param)
    yield channel, theirs
    channel.abort()
    theirs.close()


def _echo(request: dict) -> bytes:
    return _frame({"ok": True, "echo": request["n"]})


def test_an_exchange_returns_the_reply_however_its_bytes_are_cut(pair) -> None:
    channel, theirs = pair

    def in_pieces(request: dict) -> bytes:
        frame = _frame({"ok": True, "blob": os.urandom(100_000), "n": request["n"]})
        for i in range(0, len(frame) - 1, 7919):  # header split, body split, a large reply (its own buffer)
            theirs.sendall(frame[i:i + 7919])
            time.sleep(0.001)
        return b""

    FakeNode(theirs, in_pieces)
    for n in range(3):
        reply = channel.exchange({"op": "x", "n": n}, 10.0)
        assert reply["n"] == n and len(reply["blob"]) == 100_000
    assert channel.exchanges == 3 and not channel.closed


def test_a_second_thread_is_turned_away_at_once_while_an_exchange_runs(pair) -> None:
    channel, theirs = pair
    release = threading.Event()

    def late(request: dict) -> bytes:
        release.wait(10)
        return _echo(request)

    FakeNode(theirs, late)
    first: dict = {}
    worker = threading.Thread(target=lambda: first.update(channel.exchange({"op": "x", "n": 1}, 10.0)))
    worker.start()
    deadline = time.monotonic() + 10
    while not channel._lock.locked():  # noqa: SLF001 - the exchange is under way
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(ChannelBusy):
        channel.exchange({"op": "x", "n": 2}, 10.0)
    release.set()
    worker.join(10)
    assert first == {"ok": True, "echo": 1}
    assert not channel.closed  # the busy caller sent nothing: the stream is in step
    assert channel.exchange({"op": "x", "n": 3}, 10.0)["echo"] == 3


def test_a_channel_the_node_closed_is_found_out_before_anything_is_sent(pair) -> None:
    channel, theirs = pair
    theirs.close()
    with pytest.raises(ChannelClosed):
        channel.exchange({"op": "x", "n": 1}, 10.0)
    assert channel.closed
    with pytest.raises(ChannelClosed):  # and stays closed
        channel.exchange({"op": "x", "n": 2}, 10.0)


def test_a_node_that_does_not_answer_times_the_exchange_out_and_closes_it(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: b"")
    started = time.monotonic()
    with pytest.raises(OpTimeout):
        channel.exchange({"op": "x", "n": 1}, 0.3)
    assert time.monotonic() - started < 5.0  # bounded by the timeout (generously: a noisy machine)
    assert channel.closed


def test_a_reply_cut_short_by_the_node_closing_fails_and_closes(pair) -> None:
    channel, theirs = pair

    def half(request: dict) -> bytes:
        frame = _frame({"ok": True, "blob": b"x" * 1000})
        theirs.sendall(frame[:40])
        theirs.shutdown(socket.SHUT_RDWR)
        return b""

    FakeNode(theirs, half)
    with pytest.raises(TransportError) as raised:
        channel.exchange({"op": "x", "n": 1}, 10.0)
    assert not isinstance(raised.value, ChannelClosed)  # the node saw the request: not "never sent"
    assert channel.closed


def test_bytes_past_the_reply_mean_the_stream_is_out_of_step(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: _echo(request) + _echo(request))
    with pytest.raises(ProtocolError):
        channel.exchange({"op": "x", "n": 1}, 10.0)
    assert channel.closed


def test_a_header_over_the_bound_is_refused_before_its_body(pair) -> None:
    channel, theirs = pair
    channel.max_frame = 1024
    FakeNode(theirs, lambda request: encode_header(1 << 20))  # over the channel's 1 KiB, and no body
    with pytest.raises(FrameTooLarge):
        channel.exchange({"op": "x", "n": 1}, 10.0)
    assert channel.closed


def test_an_abort_from_another_thread_wakes_a_blocked_exchange(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: b"")
    failed: list[BaseException] = []

    def exchange() -> None:
        try:
            channel.exchange({"op": "x", "n": 1}, 30.0)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            failed.append(exc)

    worker = threading.Thread(target=exchange)
    worker.start()
    deadline = time.monotonic() + 10
    while not channel._lock.locked():  # noqa: SLF001
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.05)
    channel.abort()
    worker.join(10)
    assert not worker.is_alive(), "the abort did not wake the exchange"
    assert failed and isinstance(failed[0], TransportError) and not isinstance(failed[0], OpTimeout)
    assert channel.closed and channel._sock is None  # noqa: SLF001 - the exchanging thread closed the descriptor


async def test_a_stream_connection_hands_its_socket_over_only_between_exchanges() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn = StreamConnection(ours, "handed")
        theirs.sendall(_frame({"ok": True, "n": 0}))
        assert (await conn.recv_message(5.0))["n"] == 0
        channel = DirectChannel(conn.detach(), conn.peer)
        assert conn.closed
        FakeNode(theirs, _echo)
        assert channel.exchange({"op": "x", "n": 5}, 10.0)["echo"] == 5
        channel.abort()
    finally:
        theirs.close()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn = StreamConnection(ours, "mid")
        theirs.sendall(_frame({"ok": True, "n": 1}))  # read ahead, asked for by nobody: out of step if handed over
        deadline = time.monotonic() + 10
        while not conn._inbox:  # noqa: SLF001
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        with pytest.raises(TransportError):
            conn.detach()
        assert conn.closed
    finally:
        theirs.close()


def _with_blocks(blocks: list[bytes], **reply: object) -> bytes:
    """A lookup's answer naming ``blocks`` (``sent``), then their bytes, as a node sends them on a stream."""
    return _frame({"ok": True, **reply, "sent": {"sizes": [len(b) for b in blocks], "sums": []}}) + b"".join(blocks)


@pytest.mark.parametrize("cut", [None, 7919], ids=["one-write", "in-pieces"])
def test_the_bytes_a_reply_names_come_back_with_it_exactly(pair, cut: int | None) -> None:
    channel, theirs = pair
    sizes = [64 * 1024, 0, 3, 200 * 1024]  # the first read takes the reply and part of them; an empty block

    def answer(request: dict) -> bytes:
        blocks = [bytes([request["n"]]) * size for size in sizes]
        data = _with_blocks(blocks, n=request["n"])
        if cut is None:
            return data
        for i in range(0, len(data), cut):
            theirs.sendall(data[i:i + cut])
            time.sleep(0.0005)
        return b""

    FakeNode(theirs, answer)
    for n in range(1, 4):
        reply, payload = channel.exchange_with({"op": "lookup", "n": n}, 10.0, room=sum(sizes))
        assert reply["n"] == n and payload is not None
        assert bytes(payload) == bytes([n]) * sum(sizes)
    reply, payload = channel.exchange_with({"op": "lookup", "n": 9}, 10.0, room=sum(sizes) + 1)  # room to spare
    assert payload is not None and len(payload) == sum(sizes)
    assert channel.exchanges == 4 and not channel.closed


def test_the_rest_of_a_reply_that_comes_after_the_polling_bound_is_waited_for(pair) -> None:
    """Each part after the first is polled for up to the bound, then waited for: a late one still comes whole."""
    channel, theirs = pair
    blocks = [os.urandom(64 * 1024), os.urandom(5000)]

    def late_parts(request: dict) -> bytes:
        data = _with_blocks(blocks, n=request["n"])
        for cut in (3, 70_000, len(data)):  # inside the header; inside the blocks; the end
            theirs.sendall(data[:cut])
            data = data[cut:]
            time.sleep(20 * REPLY_SPIN)  # well past the polling bound
        return b""

    FakeNode(theirs, late_parts)
    reply, payload = channel.exchange_with({"op": "lookup", "n": 5}, 10.0, room=80_000)
    assert reply["n"] == 5 and payload is not None and bytes(payload) == b"".join(blocks)
    assert not channel.closed


def test_a_reply_without_sent_to_a_request_that_made_room_brings_no_bytes(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, _echo)
    assert channel.exchange_with({"op": "x", "n": 1}, 10.0, room=1 << 20) == ({"ok": True, "echo": 1}, None)
    assert not channel.closed


def _polled(pending, bound: float = 10.0):  # noqa: ANN001, ANN202
    """Poll ``pending`` until it answers (each poll returns at once), within ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while True:
        got = pending.poll()
        if got is not None:
            return got
        assert time.monotonic() < deadline, "the pending reply never settled"
        time.sleep(0.0005)


def _exchanged(channel: DirectChannel, how: str, message: dict, room: int, timeout: float = 10.0):  # noqa: ANN202
    """One exchange, ``how``: in one blocking call (``exchange_with``), or begun and then polled for (``begin``)."""
    if how == "exchange_with":
        return channel.exchange_with(message, timeout, room=room)
    return _polled(channel.begin(message, timeout, room=room))


BOTH_WAYS = pytest.mark.parametrize("how", ["exchange_with", "begin"])


@BOTH_WAYS
@pytest.mark.parametrize("reply, room", [
    (_with_blocks([b"x" * 10]), 0),  # bytes the request did not ask for
    (_with_blocks([b"x" * 10]), 9),  # more than it asked for
    (_frame({"ok": True, "sent": {"sizes": [-1], "sums": []}}), 100),  # not byte counts
    (_frame({"ok": True, "sent": {"sizes": [True], "sums": []}}), 100),
    (_frame({"ok": True, "sent": {"sizes": "10", "sums": []}}), 100),
    (_frame({"ok": True, "sent": [10]}), 100),
    (_with_blocks([b"x" * 10]) + b"more", 100),  # past what it names
    (_frame({"ok": True}) + b"x" * 10, 100),  # bytes after a reply that names none
    (_frame({"ok": True}) + b"x", 0),  # bytes past the frame of a request that asked for none
], ids=["unasked", "over-the-room", "negative", "bool", "not-a-list", "sent-not-a-map", "past-the-blocks",
        "none-named", "past-the-frame"])
def test_a_reply_whose_bytes_do_not_match_what_was_asked_is_a_protocol_error_and_closes(pair, reply: bytes,
                                                                                         room: int, how: str) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: reply)
    with pytest.raises(ProtocolError):
        _exchanged(channel, how, {"op": "lookup", "n": 1}, room)
    assert channel.closed


@BOTH_WAYS
def test_blocks_cut_short_by_the_node_closing_fail_and_close(pair, how: str) -> None:
    channel, theirs = pair

    def short(request: dict) -> bytes:
        theirs.sendall(_with_blocks([b"x" * 100_000])[:-10])
        theirs.shutdown(socket.SHUT_RDWR)
        return b""

    FakeNode(theirs, short)
    with pytest.raises(TransportError) as raised:
        _exchanged(channel, how, {"op": "lookup", "n": 1}, 100_000)
    assert not isinstance(raised.value, (ChannelClosed, ProtocolError, OpTimeout))
    assert channel.closed


def test_blocks_that_never_come_time_the_exchange_out(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: _with_blocks([b"x" * 1000])[:-1])
    with pytest.raises(OpTimeout):
        channel.exchange_with({"op": "lookup", "n": 1}, 0.3, room=1000)
    assert channel.closed


# ---- an exchange split in two: begin() sends, poll() reads what arrived, never blocking ------------------------


def test_a_begun_exchange_is_read_by_polls_that_never_block_however_its_bytes_are_cut(pair) -> None:
    channel, theirs = pair
    blocks = [os.urandom(64 * 1024), b"", os.urandom(3), os.urandom(200 * 1024)]
    go = threading.Event()

    def in_pieces(request: dict) -> bytes:
        go.wait(10)
        data = _with_blocks(blocks, n=request["n"])
        for cut in (3, 5, 7919, 70_000, len(data)):  # inside the header, the body, the blocks; the end
            theirs.sendall(data[:cut])
            data = data[cut:]
            time.sleep(0.002)
        return b""

    FakeNode(theirs, in_pieces)
    pending = channel.begin({"op": "lookup", "n": 4}, 10.0, room=sum(map(len, blocks)))
    t0 = time.monotonic()
    assert pending.poll() is None and not pending.settled  # nothing there yet: answered at once
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(ChannelBusy):  # held until the reply settles
        channel.exchange({"op": "x", "n": 1}, 10.0)
    go.set()
    reply, payload = _polled(pending)
    assert reply["n"] == 4 and payload is not None and bytes(payload) == b"".join(blocks)
    assert pending.poll() == (reply, payload)  # the same answer every time after
    assert not channel.closed and channel.exchanges == 1


def test_a_begun_exchange_without_room_reads_a_reply_larger_than_the_inbox(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: _frame({"ok": True, "blob": b"z" * 150_000, "n": request["n"]}))
    reply, payload = _polled(channel.begin({"op": "x", "n": 7}, 10.0))
    assert reply["n"] == 7 and reply["blob"] == b"z" * 150_000 and payload is None
    assert channel.exchange({"op": "x", "n": 8}, 10.0)["n"] == 8  # let go of: the next exchange runs


def test_a_begun_exchange_the_node_never_answers_fails_its_first_poll_past_the_deadline(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: b"")
    pending = channel.begin({"op": "x", "n": 1}, 0.2)
    assert pending.poll() is None
    time.sleep(0.3)
    with pytest.raises(OpTimeout):
        pending.poll()
    with pytest.raises(OpTimeout):  # every poll after says the same
        pending.poll()
    assert channel.closed and pending.settled
    with pytest.raises(ChannelClosed):
        channel.begin({"op": "x", "n": 2}, 1.0)


def test_aborting_a_begun_exchange_or_its_channel_settles_it_failed_and_lets_go(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, lambda request: b"")
    pending = channel.begin({"op": "x", "n": 1}, 10.0)
    pending.abort()
    with pytest.raises(TransportError):
        pending.poll()
    assert channel.closed and not channel._lock.locked()  # noqa: SLF001
    pending.abort()  # idempotent

    ours, node_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    other = DirectChannel(ours, "test")
    try:
        FakeNode(node_end, lambda request: b"")
        pending = other.begin({"op": "x", "n": 1}, 10.0)
        other.abort()  # from "another thread": the holder closes the descriptor as it lets go
        with pytest.raises(TransportError):
            pending.poll()
        assert other.closed and other._sock is None  # noqa: SLF001 - the descriptor is closed
    finally:
        other.abort()
        node_end.close()


def test_a_request_too_large_to_begin_without_waiting_is_not_sent(pair) -> None:
    channel, theirs = pair
    FakeNode(theirs, _echo)
    with pytest.raises(ChannelBusy):
        channel.begin({"op": "x", "n": 1, "blob": b"b" * BEGIN_MAX_BYTES}, 10.0)
    assert not channel.closed and not channel._lock.locked()  # noqa: SLF001 - nothing sent, in step
    assert _polled(channel.begin({"op": "x", "n": 2, "blob": b"b" * (BEGIN_MAX_BYTES - 100)}, 10.0))[0]["echo"] == 2


def test_a_begin_that_cannot_send_says_the_node_never_saw_it(pair) -> None:
    channel, theirs = pair
    theirs.close()
    with pytest.raises(ChannelClosed):
        channel.begin({"op": "x", "n": 1}, 1.0)
    assert channel.closed and not channel._lock.locked()  # noqa: SLF001


@BOTH_WAYS
def test_bytes_that_come_with_the_last_of_the_blocks_mean_the_stream_is_out_of_step(pair, how: str) -> None:
    """The reply and most blocks first; the rest of the blocks and more bytes later, in one write: found out."""
    channel, theirs = pair
    data = _with_blocks([b"x" * 1000])

    def extra_with_the_rest(request: dict) -> bytes:
        theirs.sendall(data[:-100])
        time.sleep(0.2)  # the reply is read and judged meanwhile; the rest comes in a read of its own
        return data[-100:] + b"more"

    FakeNode(theirs, extra_with_the_rest)
    with pytest.raises(ProtocolError):
        _exchanged(channel, how, {"op": "lookup", "n": 1}, 1000)
    assert channel.closed
