"""What every fault test checks about a load, shared by the in-process tests and the netns client script.

No pytest here: ``link_cut_client.py`` imports it inside a network namespace.

* :func:`promptly` — a scheduler-side connector call returns within
  :data:`CALL_BOUND`, far below the connector's network timeout, so a call
  that waited on the network would show.
* :func:`wait_for_first_bytes` — the fault is injected once the load's first
  bytes have landed in the destination rows: mid-load, not before it.
* :func:`settle` — the load completes or fails within a generous bound (no
  hang); a failure must be the protocol's ``KVLoadFailed``, raised from the
  transfer's ``is_complete()``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from connector.types import KVLoadFailed

BLOCK = 1 << 20  # bytes per block (page)
CALL_BOUND = 1.5  # s: a scheduler-side call that waited on the network would take the connector's timeout
SETTLE_BOUND = 30.0  # s: a load must complete or fail within this (generous: shared, noisy machines)

T = TypeVar("T")


def chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def nonzero_rows(n: int, width: int = BLOCK) -> torch.Tensor:
    """``n`` rows of random bytes that are never 0, so a zeroed destination row shows its first landed byte."""
    return torch.randint(1, 256, (n, width), dtype=torch.uint8)


def promptly(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, asserting it returned within :data:`CALL_BOUND` (it raised or not)."""
    started = time.monotonic()
    try:
        return call(*args, **kwargs)
    finally:
        spent = time.monotonic() - started
        assert spent < CALL_BOUND, f"{getattr(call, '__name__', call)} held the scheduler thread {spent:.2f} s"


def wait_for_first_bytes(row: torch.Tensor, transfer: Any, bound: float = SETTLE_BOUND) -> bool:
    """Spin until ``row`` (zeroed, loaded with never-0 bytes) shows a landed byte; False if the load settled first."""
    deadline = time.monotonic() + bound
    while row[0].item() == 0 and row[-1].item() == 0:
        if transfer._future.done():  # noqa: SLF001 - settled (either way) before any byte was seen
            return False
        assert time.monotonic() < deadline, "no byte of the load landed within the bound"
        time.sleep(0.0002)
    return True


def settle(transfer: Any, bound: float = SETTLE_BOUND) -> tuple[str, KVLoadFailed | None]:
    """Poll ``is_complete()`` (each poll prompt) until the load settles.

    Returns ``("completed", None)`` or ``("failed", the KVLoadFailed)``.
    """
    deadline = time.monotonic() + bound
    while True:
        try:
            if promptly(transfer.is_complete):
                return "completed", None
        except KVLoadFailed as err:
            return "failed", err
        assert time.monotonic() < deadline, f"the load neither completed nor failed within {bound} s: a hang"
        time.sleep(0.002)
