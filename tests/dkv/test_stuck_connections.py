"""The reaper of stuck listener connections, on plain sockets: what it touches, and only that."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from dkv.stuck_connections import StuckConnectionReaper, close_wait_sockets, reset_peer

WAIT_BOUND = 10.0


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock


def _accepted_then_peer_closed(listener: socket.socket) -> socket.socket:
    """A socket accepted on ``listener`` whose peer has closed: it sits in CLOSE_WAIT until its owner acts."""
    peer = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    peer.close()
    deadline = time.monotonic() + WAIT_BOUND
    while os.fstat(accepted.fileno()).st_ino not in close_wait_sockets(listener.getsockname()[1]):
        assert time.monotonic() < deadline, "the accepted socket never reached CLOSE_WAIT"
        time.sleep(0.01)
    return accepted


def _error_of(sock: socket.socket) -> int:
    """The socket's pending error (SO_ERROR), waited for within the bound."""
    deadline = time.monotonic() + WAIT_BOUND
    while not (error := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return error


def test_a_socket_stuck_in_close_wait_for_two_scans_is_reset_and_left_open_for_its_owner(listener) -> None:
    stuck = _accepted_then_peer_closed(listener)
    with stuck:
        reaper = StuckConnectionReaper(listener.getsockname()[1])
        assert reaper.scan() == 0  # seen once: not yet
        assert reaper.scan() == 1
        assert _error_of(stuck) != 0  # the peer's reset: what UCX's error path closes the socket on
        assert stuck.fileno() >= 0 and os.fstat(stuck.fileno())  # still the owner's to close
        assert reaper.scan() == 0  # each socket is reset once
        assert reaper.resets == 1


def test_an_open_connection_and_other_ports_are_left_alone(listener) -> None:
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.1", 0))
        elsewhere.listen(1)
        other = _accepted_then_peer_closed(elsewhere)
        peer = socket.create_connection(listener.getsockname())
        alive, _ = listener.accept()
        with other, peer, alive:
            reaper = StuckConnectionReaper(listener.getsockname()[1])
            assert reaper.scan() == 0 and reaper.scan() == 0
            assert other.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
            alive.sendall(b"x")
            assert peer.recv(1) == b"x"


def test_a_descriptor_number_that_is_now_another_socket_is_not_touched(listener) -> None:
    stuck = _accepted_then_peer_closed(listener)
    peer = socket.create_connection(listener.getsockname())
    unrelated, _ = listener.accept()  # a live connection a send would reach
    with stuck, peer, unrelated:
        inode = os.fstat(stuck.fileno()).st_ino
        assert not reset_peer(unrelated.fileno(), inode)
        peer.setblocking(False)
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            peer.recv(1)  # nothing was sent to it
        assert stuck.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        assert reset_peer(stuck.fileno(), inode)
