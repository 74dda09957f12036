"""The same-host control channel's stream (dkv.stream_channel.StreamConnection) over a real Unix socket pair.

The reader watches the socket once for the connection's life and answers
receives from what it read ahead, so these pin what that must never change:
messages and payloads arrive whole and in order however the bytes are cut,
read-ahead is bounded, and every way a stream ends wakes a waiting receive.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from dkv.errors import FrameTooLarge, OpTimeout, ProtocolError, TransportError
from dkv.stream_channel import _INBOX_MAX, MAPPED_BODY_MIN, StreamConnection
from dkv.wire import encode_body, encode_header

pytestmark = pytest.mark.timeout(60)


def _frame(message: dict) -> bytes:
    body = encode_body(message)
    return encode_header(len(body)) + body


@pytest.fixture
async def pair():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(True)
    conn = StreamConnection(ours, "test")
    yield conn, theirs
    conn.abort()
    theirs.close()


async def _send_slowly(sock: socket.socket, data: bytes, step: int) -> None:
    for i in range(0, len(data), step):
        sock.sendall(data[i:i + step])
        await asyncio.sleep(0)  # let the reader see each piece on its own


async def test_messages_cut_anywhere_or_sent_together_arrive_whole_and_in_order(pair) -> None:
    conn, theirs = pair
    first, second = {"op": "a", "n": 1}, {"op": "b", "blob": os.urandom(3000)}
    sender = asyncio.ensure_future(_send_slowly(theirs, _frame(first), 1))
    assert await conn.recv_message(5.0) == first
    await sender
    theirs.sendall(_frame(first) + _frame(second))  # two in one write: the second is answered from what was read
    assert await conn.recv_message(5.0) == first
    assert await conn.recv_message(5.0) == second


async def test_a_large_body_and_the_payloads_after_it_land_whole(pair) -> None:
    conn, theirs = pair
    big = {"op": "x", "blob": os.urandom(MAPPED_BODY_MIN + 12345)}
    payloads = [os.urandom(100_000), b"", os.urandom(7)]
    data = _frame(big) + b"".join(payloads)
    sender = asyncio.get_running_loop().run_in_executor(None, theirs.sendall, data)
    assert await conn.recv_message(10.0) == big
    dests = [bytearray(len(p)) for p in payloads]
    await conn.recv_payloads(dests, 10.0)
    await sender
    assert [bytes(d) for d in dests] == payloads


async def test_read_ahead_with_no_receive_posted_is_bounded_and_nothing_is_lost(pair) -> None:
    conn, theirs = pair
    data = os.urandom(4 * 2**20)
    sender = asyncio.get_running_loop().run_in_executor(None, theirs.sendall, data)
    for _ in range(100):
        await asyncio.sleep(0.01)
        assert len(conn._inbox) <= _INBOX_MAX
    dest = bytearray(len(data))
    await conn.recv_payloads([dest], 10.0)
    await sender
    assert dest == data


async def test_the_peer_closing_mid_message_fails_the_receive(pair) -> None:
    conn, theirs = pair
    frame = _frame({"op": "a", "blob": b"x" * 100})
    theirs.sendall(frame[:30])
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(TransportError):
        await conn.recv_message(5.0)
    assert conn.closed


async def test_an_abort_wakes_a_waiting_receive_and_a_timeout_aborts(pair) -> None:
    conn, _theirs = pair
    waiting = asyncio.ensure_future(conn.recv_message(30.0))
    await asyncio.sleep(0.05)
    conn.abort()
    with pytest.raises(TransportError):
        await asyncio.wait_for(waiting, 5.0)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        quiet = StreamConnection(ours, "quiet")
        with pytest.raises(OpTimeout):
            await quiet.recv_message(0.2)
        assert quiet.closed
    finally:
        theirs.close()


async def test_a_cancelled_wait_aborts_the_connection_and_stays_a_cancellation(pair) -> None:
    """A receive or a send left half done leaves the stream out of step: cancelling either aborts it."""
    conn, theirs = pair
    waiting = asyncio.ensure_future(conn.recv_message(30.0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert conn.closed
    ours, theirs2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        stuck = StreamConnection(ours, "stuck")
        sending = asyncio.ensure_future(stuck.send_payloads([os.urandom(4 << 20)], 30.0))  # nobody reads
        await asyncio.sleep(0.05)
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        assert stuck.closed
    finally:
        theirs2.close()


async def test_a_header_claiming_more_than_the_bound_is_refused_before_its_body(pair) -> None:
    conn, theirs = pair
    conn.max_frame = 1024
    theirs.sendall(encode_header(4 * 2**20))  # and no body: the refusal cannot have waited for one
    with pytest.raises(FrameTooLarge):
        await conn.recv_message(5.0)


async def test_each_receive_keeps_its_own_bound_under_the_one_timer(pair) -> None:
    """The connection's one timer serves every receive: a long bound never lets a later, shorter one wait longer,
    and a receive answered in time leaves the next one its full bound."""
    conn, theirs = pair
    theirs.sendall(_frame({"op": "a"}))
    assert await conn.recv_message(30.0) == {"op": "a"}  # the timer is now set for ~30 s from here
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(OpTimeout):
        await conn.recv_message(0.2)  # shorter than what the timer was set for: it is moved
    assert loop.time() - started < 20.0  # (a generous bound: failing it means the 30 s timer was kept)
    assert conn.closed
    assert conn._bound is None  # the abort let go of the timer


async def test_a_receive_after_a_shorter_one_was_answered_waits_its_full_bound(pair) -> None:
    conn, theirs = pair
    theirs.sendall(_frame({"op": "a"}))
    assert await conn.recv_message(0.3) == {"op": "a"}  # the timer stays set for ~0.3 s from then
    waiting = asyncio.ensure_future(conn.recv_message(30.0))
    await asyncio.sleep(1.0)  # well past the first receive's deadline: the timer fired and was set again
    assert not waiting.done() and not conn.closed
    theirs.sendall(_frame({"op": "b"}))
    assert await asyncio.wait_for(waiting, 10.0) == {"op": "b"}


async def test_a_message_the_kernel_cannot_take_at_once_is_sent_whole(pair) -> None:
    """A reply is written with one send; what the kernel did not take is waited for, and arrives whole."""
    conn, theirs = pair
    conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    message = {"op": "x", "blob": os.urandom(2 << 20)}
    sending = asyncio.ensure_future(conn.send_message(message, 30.0))
    await asyncio.sleep(0.05)
    assert not sending.done()  # the kernel took part of it: the rest waits for the reader
    frame = _frame(message)
    got = await asyncio.get_running_loop().run_in_executor(None, _recv_exactly, theirs, len(frame))
    await asyncio.wait_for(sending, 10.0)
    assert got == frame


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(left)
        assert part, "the stream ended early"
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


async def test_a_body_that_does_not_decode_is_taken_whole_and_the_next_message_still_arrives(pair) -> None:
    """Alone in the read-ahead or followed by the next message, a garbled body fails its receive and nothing else."""
    conn, theirs = pair
    garbled = encode_header(3) + b"\xc1\xc1\xc1"
    for after in (b"", _frame({"op": "b"})):
        theirs.sendall(garbled + after)
        with pytest.raises(ProtocolError):
            await conn.recv_message(5.0)
        if after:
            assert await conn.recv_message(5.0) == {"op": "b"}
        assert not conn._inbox
    theirs.sendall(_frame({"op": "c"}))
    assert await conn.recv_message(5.0) == {"op": "c"}
