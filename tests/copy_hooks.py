"""Test hooks into every way a same-host checked copy runs (:mod:`dkv.lease_slots`), native or in Python.

A load may be copied by a native :class:`dkv._checked_copy.CheckedCopy` (made
by ``rows_copy`` from the slot map, or from keys and views and shared by the
copy threads) or, without the native build, by ``LeaseSlots._copy_and_verify``
chunk by chunk. :func:`watch_copies` hooks all of them, so a test of what
happens around a copy (a slow one, one that does not verify) holds on every path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import dkv.lease_slots as lease_slots
from dkv import copy_threads
from dkv.lease_slots import LeaseSlots


@dataclass
class CopyHooks:
    """``before`` hooks run as each part of a copy begins (given its block count); ``fail``: report it unverified."""

    before: list[Callable[[int], None]] = field(default_factory=list)
    fail: bool = False

    def begin(self, blocks: int) -> None:
        for hook in self.before:
            hook(blocks)


class _Watched:
    """A native copy whose shares run the hooks first, and answer False when the hooks say so."""

    def __init__(self, copy: Any, hooks: CopyHooks) -> None:
        self._copy, self._hooks = copy, hooks
        self.stop = copy.stop
        self.blocks = copy.blocks

    def work(self, hold_gil: bool = False) -> bool:
        self._hooks.begin(self.blocks)
        return self._copy.work(hold_gil=hold_gil) and not self._hooks.fail


def _no_native_pool(*_: Any) -> Any:
    raise RuntimeError("copies are hooked: the native copy threads run no Python, so none is posted to them")


def watch_copies(monkeypatch: pytest.MonkeyPatch, *, native: bool = True) -> CopyHooks:
    """Hook every checked copy from here on (``native=False``: turn the native copies off first).

    The native copy threads (:class:`dkv.copy_threads.PostedCopy`) run no
    Python, so a hooked copy is never posted to them: it takes the copy
    threads' path instead, which makes the same native copy and runs it in
    Python threads' shares. Tests of the native threads themselves need no
    hook (tests/dkv/test_copy_threads.py, tests/dkv/test_checked_copy.py).
    """
    hooks = CopyHooks()
    monkeypatch.setattr(lease_slots, "PostedCopy", _no_native_pool)
    for name in ("_native_shared_copy", "_native_rows_copy"):
        real = getattr(lease_slots, name)
        if not native or real is None:
            monkeypatch.setattr(lease_slots, name, None)
            continue

        def made(*args: Any, _real: Any = real) -> Any:
            copy = _real(*args)
            return None if copy is None else _Watched(copy, hooks)

        monkeypatch.setattr(lease_slots, name, made)
    real_chunk = LeaseSlots._copy_and_verify

    def chunk(self: LeaseSlots, keys: Any, *plan: Any) -> bool:
        hooks.begin(len(keys))
        return real_chunk(self, keys, *plan) and not hooks.fail

    monkeypatch.setattr(LeaseSlots, "_copy_and_verify", chunk)
    return hooks


@contextlib.contextmanager
def watcher_held_off(monkeypatch: pytest.MonkeyPatch, bound: float) -> Iterator[list[int]]:
    """While in the block, the process's copy watcher settles no posted copy (:mod:`dkv.copy_threads`).

    The watcher hands each list of ended copies to ``_settle_ended``, which
    it looks up as each turn of its loop begins, before it waits for copies
    to end: here that waits until the block is left (or ``bound`` seconds),
    then settles them as usual. A watcher already waiting holds the real one,
    so the block begins only once it has come round to this one (its idle
    wake-up, ``WATCH_WAKE``, at most a second). Yields the sizes of the lists
    it was handed meanwhile, so a test can tell that it was held.
    """
    let_go, came_round = threading.Event(), threading.Event()
    settle_ended = copy_threads._settle_ended
    handed: list[int] = []

    def held(ended: list[Any]) -> None:
        came_round.set()
        if ended:
            handed.append(len(ended))
            let_go.wait(bound)
        settle_ended(ended)

    monkeypatch.setattr(copy_threads, "_settle_ended", held)
    try:
        if copy_threads._watching:  # (one not started yet looks up this one when it starts)
            assert came_round.wait(bound), "the copy watcher never came round to the held settle"
        yield handed
    finally:
        let_go.set()
