"""dkv.held_gil: system calls that cannot block, made holding the GIL, answer as their socket/os counterparts."""

from __future__ import annotations

import ctypes
import os
import socket

import pytest

from dkv import held_gil

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["native", "libc", "fallback"])
def calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Each test runs through the native receive, through libc (holding the GIL) and through the socket/os fallback."""
    if request.param == "native":
        assert held_gil._recv_native is not None, "dkv._spin is not built"  # noqa: SLF001 - (run.sh builds it)
        return held_gil
    monkeypatch.setattr(held_gil, "_recv_native", None)
    if request.param == "fallback":
        monkeypatch.setattr(held_gil, "_recv", None)
        monkeypatch.setattr(held_gil, "_write", None)
    elif not held_gil.HOLDS_GIL:
        pytest.skip("no libc reachable through ctypes here")
    return held_gil


def test_recv_into_now_reads_what_arrived_and_no_more_than_the_view(calls) -> None:  # noqa: ANN001
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"hello world")
        buffer = bytearray(8)
        assert calls.recv_into_now(ours, memoryview(buffer)) == 8 and buffer == b"hello wo"
        view = memoryview(buffer)[2:]
        assert calls.recv_into_now(ours, view) == 3 and bytes(buffer[2:5]) == b"rld"


def test_recv_into_now_answers_minus_1_when_nothing_arrived_and_0_once_the_peer_closed(  # noqa: ANN001
        calls) -> None:
    ours, theirs = socket.socketpair()
    with ours:
        ours.setblocking(True)  # (a blocking socket: the call itself must not wait)
        assert calls.recv_into_now(ours, memoryview(bytearray(4))) == -1
        theirs.sendall(b"ab")
        buffer = bytearray(4)
        assert calls.recv_into_now(ours, memoryview(buffer)) == 2 and buffer[:2] == b"ab"
        assert calls.recv_into_now(ours, memoryview(buffer)) == -1
        theirs.close()
        assert calls.recv_into_now(ours, memoryview(bytearray(4))) == 0


def test_recv_into_now_on_a_socket_that_cannot_read_is_an_os_error(calls) -> None:  # noqa: ANN001
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as unconnected, pytest.raises(OSError) as raised:
        calls.recv_into_now(unconnected, memoryview(bytearray(4)))
    assert not isinstance(raised.value, BlockingIOError)  # ENOTCONN, as socket.recv_into says


def test_recv_into_now_on_a_closed_socket_is_an_os_error(calls) -> None:  # noqa: ANN001
    ours, theirs = socket.socketpair()
    theirs.close()
    ours.close()  # (its fileno() is -1 now)
    with pytest.raises(OSError):
        calls.recv_into_now(ours, memoryview(bytearray(4)))


def test_write_writes_and_a_full_pipe_raises_blocking(calls) -> None:  # noqa: ANN001
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK)
    try:
        assert calls.write(write_fd, b"abc") == 3 and os.read(read_fd, 10) == b"abc"
        with pytest.raises(BlockingIOError):
            while True:
                calls.write(write_fd, b"x" * 65536)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_the_calls_go_through_a_library_loaded_to_keep_the_gil() -> None:
    """ctypes lets go of the GIL around a CDLL's functions and keeps it around a PyDLL's: these must be PyDLL's."""
    if not held_gil.HOLDS_GIL:
        pytest.skip("no libc reachable through ctypes here")
    assert type(held_gil._libc) is ctypes.PyDLL  # noqa: SLF001
    assert held_gil._recv._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # noqa: SLF001 - the flag that keeps the GIL
    assert held_gil._write._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # noqa: SLF001
