"""The fixed-port helper: a port taken before the bind costs another pick, any other failure is the test's."""

from __future__ import annotations

import socket

import pytest

from tests.ports import on_a_free_port, on_a_free_port_awaited


def _bind(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    return sock


def test_a_port_taken_before_the_bind_is_picked_again() -> None:
    tried: list[int] = []
    others: list[socket.socket] = []

    def start(port: int) -> socket.socket:
        tried.append(port)
        if len(tried) == 1:
            others.append(_bind(port))  # another process got there first
            others[-1].listen(1)
        return _bind(port)  # the first time: EADDRINUSE, "Address already in use"

    port, sock = on_a_free_port(start)
    with sock:
        assert len(tried) == 2 and port == tried[1] == sock.getsockname()[1]
    for other in others:
        other.close()


def test_any_other_failure_and_the_last_clash_go_to_the_caller() -> None:
    with pytest.raises(ValueError, match="bad option"):
        on_a_free_port(lambda port: (_ for _ in ()).throw(ValueError("bad option")))
    calls: list[int] = []

    def always_taken(port: int) -> None:
        calls.append(port)
        raise RuntimeError(f"port {port} is in use by another process")

    with pytest.raises(RuntimeError, match="in use"):
        on_a_free_port(always_taken, attempts=3)
    assert len(calls) == 3


async def test_an_awaited_start_is_picked_again_the_same_way() -> None:
    tried: list[int] = []

    async def start(port: int) -> str:
        tried.append(port)
        if len(tried) < 3:
            raise RuntimeError(f"etcd did not start: listen tcp 127.0.0.1:{port}: bind: address already in use")
        return "started"

    port, started = await on_a_free_port_awaited(start)
    assert started == "started" and len(tried) == 3 and port == tried[-1]
    with pytest.raises(KeyError):
        await on_a_free_port_awaited(lambda port: _raise(KeyError(port)))


async def _raise(exc: Exception) -> None:
    raise exc
