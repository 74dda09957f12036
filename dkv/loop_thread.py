"""An event loop in a thread of its own, and the process-wide one that drives UCX for threaded callers.

UCX progress is bound to the event loop that drives it. A process must not
leave a second loop registered for UCX progress while it sits idle (a sync
caller's loop, a closed engine's loop): UCX then stalls, endpoints take seconds
to close. So every caller in a process that is not itself an asyncio server —
KV connectors, tests, tools — shares one loop thread, :func:`shared_loop`,
reference-counted: the first :func:`acquire_shared_loop` starts it, the last
:func:`release_shared_loop` stops it.

Threads hand coroutines to it with :meth:`LoopThread.submit` (returns a
``concurrent.futures.Future`` at once) or :meth:`LoopThread.run` (waits, with a
bound).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from dkv import polling
from dkv.event_loop import new_event_loop
from dkv.transport import drop_transport, hold_transport, stop_progress

T = TypeVar("T")


def run_as_batch_work() -> bool:
    """Linux: the calling thread runs under ``SCHED_BATCH`` from now on; False where it was not normal work or cannot be.

    The loop thread is woken for every hand-off a connector makes (an
    offload's posting, a listener load's messages). As normal work, its
    wake-up on a busy core preempts the running thread, often the engine's
    scheduler thread that just woke it, and then blocks on the GIL that
    thread holds. As batch work it takes an idle core, or waits for the
    running thread's turn to end; its share of the CPU is unchanged. See the
    README's nineteenth round for what it changed on two busy cores. A
    thread that does not run as normal work (a process started under a
    real-time or idle policy) is left as it is.
    """
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:  # 0: this thread, on Linux
            return False
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


class LoopThread:
    """An asyncio loop in a daemon thread, owned by one connector. It runs as batch work (:func:`run_as_batch_work`)."""

    def __init__(self, name: str = "dkv-ucx") -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False  # True from when the loop runs until it is closed, or its thread ends (see alive)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the connector's event loop did not start")

    def _main(self) -> None:
        run_as_batch_work()
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        loop.run_until_complete(self._init())
        self._running = True
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(self._drain())
                loop.close()
            finally:
                self._running = False

    async def _init(self) -> None:
        hold_transport()  # UCX bound to this loop, held until the loop ends (clients closing here never stop it)

    async def _drain(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        drop_transport()
        await stop_progress()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    @property
    def alive(self) -> bool:
        """Any thread: the loop's thread runs it, or is draining it, and has not closed it. One attribute read.

        Asked at every post from the engine's scheduler thread, so it reads a
        flag the loop thread clears as its loop ends (closed, or its drain
        failed), not ``Thread.is_alive()`` and ``is_closed()`` (five Python
        calls and a lock).
        """
        return self._running

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns at once. Raises ``RuntimeError`` once stopped."""
        self._refuse_when_stopped(coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _refuse_when_stopped(self, coro: Coroutine[Any, Any, Any]) -> None:
        """``RuntimeError`` (``coro`` closed, never run) once the loop is stopped."""
        if not self.alive:
            coro.close()
            raise RuntimeError("the connector's event loop is stopped")

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, *, spin: float = 0.0) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds (then ``TimeoutError``).

        Its result, or what it raised (``concurrent.futures.CancelledError``
        if the loop cancelled it, as on shutdown); ``RuntimeError`` once the
        loop is stopped. A call that times out (or whose caller is
        interrupted) cancels ``coro`` on the loop.

        The hop of a blocking call (a scheduler thread's ``lookup``): one
        callback that makes the task, and a plain lock its completion releases.
        :meth:`submit`'s ``concurrent.futures.Future``, chained to the task,
        costs about twice as much (measured by ``scripts/probe_lookup_split.py``).
        With ``spin`` (seconds), the calling thread first polls for the
        task's end without the GIL (:mod:`dkv.polling`), at most that long,
        and only then sleeps on the lock: the way back costs no wake-up.
        """
        self._refuse_when_stopped(coro)
        loop = self.loop
        finished = threading.Lock()
        finished.acquire()
        started: list[asyncio.Task[T]] = []
        spin_ns = polling.spin_ns(spin)
        ended = bytearray(1)  # set once ``finished`` is released: what a polling caller watches

        def end(_: asyncio.Task[T]) -> None:
            finished.release()
            ended[0] = 1

        def start() -> None:  # on the loop, always before cancel() below (callbacks run in order)
            task = loop.create_task(coro)
            started.append(task)
            task.add_done_callback(end)

        def cancel() -> None:
            if started:
                started[0].cancel()

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed since the check above
            coro.close()
            raise RuntimeError("the connector's event loop is stopped") from None
        try:
            done, left = False, max(timeout, 0.0)
            if spin_ns:
                polled_at = time.monotonic()
                if polling.wait_flag(ended, min(spin_ns, int(left * 1e9))):
                    done = finished.acquire(blocking=False)  # (released before the flag was set)
                left = max(left - (time.monotonic() - polled_at), 0.0)
            if not done:
                done = finished.acquire(timeout=left)
        except BaseException:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(cancel)
            raise
        if not done:
            with contextlib.suppress(RuntimeError):  # a closed loop has cancelled it already
                loop.call_soon_threadsafe(cancel)
            raise TimeoutError(f"connector call did not finish within {timeout}s")
        task = started[0]
        if task.cancelled():
            raise concurrent.futures.CancelledError()
        return task.result()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what runs, stop UCX progress, stop the loop, join the thread. Idempotent."""
        if self._loop is not None and not self._loop.is_closed() and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


_shared: LoopThread | None = None
_shared_refs = 0
_shared_lock = threading.Lock()


def acquire_shared_loop() -> LoopThread:
    """The process's shared UCX loop thread (started on first use); pair with :func:`release_shared_loop`."""
    global _shared, _shared_refs
    with _shared_lock:
        if _shared is None or not _shared.alive:
            _shared = LoopThread()
        _shared_refs += 1
        return _shared


def release_shared_loop(timeout: float = 10.0) -> None:
    """Drop one reference; the last one stops the loop (its remaining tasks are cancelled)."""
    global _shared, _shared_refs
    with _shared_lock:
        _shared_refs = max(0, _shared_refs - 1)
        if _shared_refs or _shared is None:
            return
        loop, _shared = _shared, None
    loop.stop(timeout)
