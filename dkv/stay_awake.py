"""A node's event loop kept polling for a short while after a request, while requests come back to back.

A node idle between requests sleeps in ``epoll_wait``; the client's next
request then wakes it, and on a virtual machine whose idle CPU has halted
that wake-up is an interrupt to a halted vCPU: here it cost about 45 µs of a
120 µs one-block same-host load (``scripts/probe_control_floor.py``, the
node kept awake 150 µs after each request against not at all, three
alternated pairs: one-block load p50 119 / 133 / 137 µs against 70 / 75 /
74 µs). The client side does the same for its replies (:mod:`dkv.polling`).

Contract:

* **When.** Only after a request that came within ``bound`` of the end of
  the one before it (node-wide: back-to-back traffic, where the next one is
  likely soon). A request after a longer gap (a batch load's next lookup,
  milliseconds later; the first after an idle spell) is not followed by a
  spin: an idle node never spins, a node serving large loads hardly.
* **How long.** Until ``bound`` after the last request served; each request
  served in that time moves the end on. The loop polls with a zero timeout
  meanwhile (a callback that schedules itself again: the loop's other
  callbacks and I/O run between, as usual), then sleeps as before.
* **Cost.** The loop's CPU for at most ``bound`` after each request served
  back to back. ``bound`` 0 turns it off. :meth:`close` ends the polling at
  its next turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_BOUND = 300e-6  # seconds: above a one-block load's gap between requests here (~100-150 µs)
MAX_BOUND = 10e-3


class StayAwake:
    """Keeps the running event loop polling after back-to-back requests (see the module docstring). Loop thread only."""

    def __init__(self, bound: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= bound <= MAX_BOUND:
            raise ValueError(f"the stay-awake bound must be from 0 to {MAX_BOUND} s, not {bound}")
        self.bound = bound
        self._clock = clock
        self._last_served = float("-inf")  # when the last request was served
        self._soon = False  # the request being served came within bound of the one before
        self._until = 0.0  # polling goes on until then
        self._polling = False  # a polling callback is scheduled
        self._closed = False
        self.polls = 0  # turns the loop polled for this (tests and probes)

    @property
    def polling(self) -> bool:
        """Whether the loop is being kept polling now."""
        return self._polling

    def arrived(self) -> None:
        """A request arrived: note whether it came back to back."""
        self._soon = self._clock() - self._last_served <= self.bound

    def served(self) -> None:
        """A request was served: keep the loop polling for ``bound`` if it came back to back."""
        now = self._last_served = self._clock()
        if not self._soon or self._closed or self.bound <= 0:
            return
        self._until = now + self.bound
        if not self._polling:
            self._polling = True
            asyncio.get_running_loop().call_soon(self._poll)

    def _poll(self) -> None:
        if self._closed or self._clock() >= self._until:
            self._polling = False
            return
        self.polls += 1
        asyncio.get_running_loop().call_soon(self._poll)

    def close(self) -> None:
        """No more polling: a scheduled turn ends it."""
        self._closed = True


__all__ = ["DEFAULT_BOUND", "MAX_BOUND", "StayAwake"]
