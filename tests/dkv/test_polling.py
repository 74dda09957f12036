"""The native polls (dkv.polling, dkv._spin): a blocking call's reply, seen without a wake-up.

``recv_spin`` on a real Unix socket pair, as the direct channel uses it:
bytes already there are read at once; nothing within the poll is -1 (the
caller then blocks); a closed peer is 0; a failure is an OSError.
``wait_flag``, as the loop thread's callers use it: True once another thread
set the byte, False when the poll ran out. Both leave the GIL free while they
poll, so the process's other threads run meanwhile.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dkv import polling

pytestmark = pytest.mark.timeout(60)

recv_spin = polling.recv_spin
wait_flag = polling.wait_flag
native = pytest.mark.skipif(not polling.NATIVE, reason="dkv._spin is not built (test_the_native_polls_are_built fails)")


def test_the_native_polls_are_built() -> None:
    assert polling.NATIVE, (
        "dkv._spin was not built: install a C compiler, then `pip install -e .` again (scripts/run.sh does both)")


def test_a_bound_is_taken_from_zero_to_its_most_and_nothing_polls_where_zero() -> None:
    assert polling.check_reply_spin(0.0) == 0.0 and polling.check_reply_spin(polling.MAX_REPLY_SPIN)
    for bad in (-1e-9, polling.MAX_REPLY_SPIN * 1.01):
        with pytest.raises(ValueError, match="reply_spin"):
            polling.check_reply_spin(bad)
    assert polling.spin_ns(0.0) == 0 and polling.spin_ns(-1.0) == 0
    assert polling.spin_ns(0.001) == (1_000_000 if polling.NATIVE else 0)


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    if recv_spin is None:
        pytest.skip("dkv._spin is not built (test_the_native_polls_are_built fails for it)")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_bytes_already_there_are_read_at_once_into_the_buffer_s_start(sockets) -> None:
    ours, theirs = sockets
    data = os.urandom(3000)
    theirs.sendall(data)
    buffer = bytearray(8192)
    got = recv_spin(ours.fileno(), buffer, 10**9)
    assert 0 < got <= len(data) and buffer[:got] == data[:got]
    assert bytes(buffer[got:]) == bytes(len(buffer) - got)  # nothing written past what was read


def test_nothing_within_the_poll_is_minus_one_and_a_closed_peer_is_zero(sockets) -> None:
    ours, theirs = sockets
    assert recv_spin(ours.fileno(), bytearray(16), 0) == -1  # one attempt
    assert recv_spin(ours.fileno(), bytearray(16), 2_000_000) == -1  # 2 ms of polling
    theirs.close()
    assert recv_spin(ours.fileno(), bytearray(16), 10**9) == 0


def test_a_failing_receive_raises_and_a_read_only_buffer_is_refused(sockets) -> None:
    ours, _ = sockets
    spare = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = spare.fileno()
    spare.close()  # a descriptor no longer open
    with pytest.raises(OSError):
        recv_spin(fd, bytearray(16), 1_000_000)
    with pytest.raises(TypeError):
        recv_spin(ours.fileno(), b"read-only", 0)


def test_other_threads_run_python_while_it_polls(sockets) -> None:
    """The reply it polls for is sent by a thread that needs the GIL: had the poll kept it, nothing would arrive."""
    ours, theirs = sockets
    started = threading.Event()

    def send_after_some_python() -> None:
        started.wait(10)
        time.sleep(0.2)  # (no GIL needed) by then the poll has most likely begun
        total = sum(range(100_000))  # pure Python: needs the GIL
        theirs.sendall(total.to_bytes(8, "little"))

    sender = threading.Thread(target=send_after_some_python)
    sender.start()
    started.set()
    buffer = bytearray(8)
    got = recv_spin(ours.fileno(), buffer, 20 * 10**9)  # bounded: -1 after 20 s if the sender never ran
    sender.join(10)
    assert got > 0 and buffer[:got] == sum(range(100_000)).to_bytes(8, "little")[:got]


@native
def test_a_flag_set_by_another_thread_ends_the_poll_and_one_never_set_runs_it_out() -> None:
    flag = bytearray(1)
    assert wait_flag(flag, 2_000_000) is False  # 2 ms, nobody sets it
    assert wait_flag(bytearray(b"\x01"), 0) is True  # set already
    with pytest.raises(ValueError):
        wait_flag(bytearray(), 0)

    def set_after_some_python() -> None:
        time.sleep(0.2)  # (no GIL needed) by then the poll has most likely begun
        total = sum(range(100_000))  # pure Python: needs the GIL
        flag[0] = 1 if total else 0

    setter = threading.Thread(target=set_after_some_python)
    setter.start()
    assert wait_flag(flag, 20 * 10**9) is True  # bounded: False after 20 s had the poll kept the GIL
    setter.join(10)


def test_peer_closed_answers_as_a_python_peek_does_and_takes_no_bytes(sockets, monkeypatch) -> None:
    """The direct channel asks before each request whether the node closed its end; natively and in Python alike."""
    from dkv import direct_channel

    ours, theirs = sockets
    native_peek = polling.peer_closed
    assert native_peek is not None and direct_channel._native_peer_closed is native_peek
    monkeypatch.setattr(direct_channel, "_native_peer_closed", None)  # the channel's own peek, in Python

    def answers() -> tuple[bool, bool]:
        return native_peek(ours.fileno()), direct_channel._peer_closed(ours)

    assert answers() == (False, False)  # nothing waiting
    theirs.sendall(b"xy")
    assert answers() == (False, False)  # bytes waiting are not an end, and the peeks took none of them
    assert ours.recv(8) == b"xy"
    theirs.close()
    assert answers() == (True, True)  # the stream's end
    assert native_peek(-1) is True  # what a closed socket's fileno() gives
    with pytest.raises(ValueError):
        native_peek(2**40)
    spare = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = spare.fileno()
    spare.close()
    assert native_peek(fd) is True  # a descriptor that is no socket any more: no use either
    assert direct_channel._peer_closed(spare) is True  # a closed socket, in Python
    monkeypatch.setattr(direct_channel, "_native_peer_closed", native_peek)
    assert direct_channel._peer_closed(spare) is True  # and natively (its fileno() is -1)
