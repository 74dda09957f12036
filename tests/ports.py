"""Test helper for options that take a fixed port: pick one free, and pick again if it was taken before the bind.

A port free when picked can be bound by another process (a node's UCX
listener, an outgoing connection) before the process under test binds it; the
tests run beside others, so that happens. Where a test can, it lets the
process pick (port 0) and reads the port back; this is for options whose point
is the port given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

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
