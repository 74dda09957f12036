"""Test helpers for ports picked free: pick again when one was taken before the bind, and make that race certain.

A port free when picked can be bound by another process (a node's UCX
listener, an outgoing connection) before the process under test binds it; the
tests run beside others, so that happens. Where a test can, it lets the
process pick (port 0) and reads the port back; :func:`on_a_free_port` is for
options whose point is the port given. :func:`first_pick_taken` makes the
race happen, for the tests of the code that starts servers on picked ports.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from cluster.etcd_process import free_port

T = TypeVar("T")
ATTEMPTS = 5


def on_a_free_port(start: Callable[[int], T], *, attempts: int = ATTEMPTS) -> tuple[int, T]:
    """``(port, start(port))`` for a port free when picked; another port when ``start`` raised a port-in-use error.

    ``start`` raises (any exception whose text says ``in use``) when the port
    was taken; any other error, or the last attempt's, goes to the caller.
    """
    for attempt in range(attempts):
        port = free_port()
        try:
            return port, start(port)
        except Exception as exc:
            if not _pick_again(exc, attempt, attempts):
                raise
    raise AssertionError("unreachable")


async def on_a_free_port_awaited(start: Callable[[int], Awaitable[T]], *,
                                 attempts: int = ATTEMPTS) -> tuple[int, T]:
    """:func:`on_a_free_port` for a ``start`` that is awaited (a whole async test body, say)."""
    for attempt in range(attempts):
        port = free_port()
        try:
            return port, await start(port)
        except Exception as exc:
            if not _pick_again(exc, attempt, attempts):
                raise
    raise AssertionError("unreachable")


def _pick_again(exc: Exception, attempt: int, attempts: int) -> bool:
    """Whether ``exc`` says the port was taken and another attempt is left."""
    return "in use" in str(exc) and attempt < attempts - 1


@contextlib.contextmanager
def first_pick_taken(monkeypatch: pytest.MonkeyPatch, module: Any) -> Iterator[int]:
    """A listener held here on a port that ``module.free_port`` returns on its first call (free ones after); yields it.

    What another process binding a picked port before the server does: the
    server's bind fails, and a connect to the port reaches this listener.
    """
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        picks = iter([taken])
        real = module.free_port
        monkeypatch.setattr(module, "free_port", lambda *args, **kwargs: next(picks, None) or real(*args, **kwargs))
        yield taken
    finally:
        held.close()
