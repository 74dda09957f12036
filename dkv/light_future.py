"""A ``concurrent.futures.Future`` whose condition is one native lock: cheap to make and to touch on hot paths.

``concurrent.futures.Future`` makes a :class:`threading.Condition` (a Python
object over a native ``RLock``, with five bound methods and a deque of its
own) and enters it through two Python-level calls at every ``done()``,
``add_done_callback()`` and ``set_result()``. A load posted to the copy
threads makes two futures on the engine's scheduler thread and touches them
five times: a few µs of a ~60 µs ``load()`` on an idle machine, and three
times that while another connector in the process is loading, since every
fresh object then comes from memory another core wrote last (measured with
``scripts/probe_scheduler_calls.py``: ``Future()`` 2.4 µs idle, 7.8 µs so).

:class:`LightFuture` is a ``Future`` in every respect that callers see
(``isinstance``, ``result(timeout)``, ``add_done_callback``,
``concurrent.futures.wait`` and ``as_completed``, ``asyncio.wrap_future``).
Only its condition differs: :class:`NativeCondition`, a subclass of the
native ``RLock`` whose ``with`` block costs no Python frame. Its ``wait`` and
``notify_all`` are Python, as :class:`threading.Condition`'s are, and run
only when a thread blocks in ``result()``/``exception()`` or wakes one that
did. It relies on ``Future``'s documented-by-code attributes (``_condition``,
``_state``, ``_result``, ``_exception``, ``_waiters``, ``_done_callbacks``),
unchanged from Python 3.8 to 3.13; ``tests/dkv/test_light_future.py`` holds
it to the behaviour of the standard one.
"""

from __future__ import annotations

import _thread
import concurrent.futures
from concurrent.futures._base import LOGGER as _LOGGER, PENDING
from typing import TypeVar

T = TypeVar("T")

_allocate_lock = _thread.allocate_lock


class NativeCondition(_thread.RLock):  # type: ignore[misc,valid-type]
    """A condition variable that is its own re-entrant lock: ``with`` it is a native call.

    ``wait`` and ``notify_all`` behave as :class:`threading.Condition`'s (the
    caller holds the lock; ``wait`` lets go of it, however deeply held, while
    it waits, and takes it back before it returns). No ``notify(n)``: a
    future wakes every waiter.
    """

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[_thread.LockType] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Until :meth:`notify_all`, or ``timeout`` seconds: whether it was notified. ``RuntimeError`` unless held."""
        if not self._is_owned():
            raise RuntimeError("cannot wait on an un-acquired condition")
        waiter = _allocate_lock()
        waiter.acquire()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        saved = self._release_save()
        notified = False
        try:
            if timeout is None:
                notified = waiter.acquire()
            elif timeout > 0:
                notified = waiter.acquire(True, timeout)
            else:
                notified = waiter.acquire(False)
            return notified
        finally:
            self._acquire_restore(saved)
            if not notified and self._waiters is not None:
                try:
                    self._waiters.remove(waiter)
                except ValueError:  # notified after its wait ran out: nothing left to remove
                    pass

    def notify_all(self) -> None:
        """Wake every thread waiting in :meth:`wait` (they run once the caller lets go). ``RuntimeError`` unless held."""
        if not self._is_owned():
            raise RuntimeError("cannot notify on an un-acquired condition")
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            waiter.release()


class LightFuture(concurrent.futures.Future[T]):
    """A :class:`concurrent.futures.Future` over a :class:`NativeCondition` (see the module docstring)."""

    def __init__(self) -> None:  # Future.__init__ without its threading.Condition
        self._condition = NativeCondition()  # type: ignore[assignment]
        self._state = PENDING
        self._result = None
        self._exception = None
        self._waiters = []
        self._done_callbacks = []

    def _invoke_callbacks(self) -> None:
        """Call each callback once, then let go of them, on the thread that settled it.

        A settled ``Future`` keeps its callbacks (their closures, what they
        hold: a plan's hashes, a finished task) for as long as it lives, and
        a transfer's future lives on the connector's books and in the engine
        until the engine drops it: freeing all that then fell to the
        scheduler thread, inside a later ``load()`` (``_book`` read 15 µs with
        another connector loading). Once settled no callback is added to the
        list (``add_done_callback`` calls it at once), so it can go.
        """
        callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                _LOGGER.exception("exception calling callback for %r", self)


def resolved(value: T) -> LightFuture[T]:
    """A :class:`LightFuture` that already holds ``value``."""
    future: LightFuture[T] = LightFuture()
    future.set_result(value)
    return future
