"""The connector's own event-loop thread: where every network round trip runs.

The engine's scheduler thread never awaits a network. It submits coroutines
here and gets ``concurrent.futures.Future`` handles back (``submit``); only
drain and shutdown paths block on one, always with a bound (``run``). UCX is
initialised inside this thread, so its progress is driven by this loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from dkv.transport import init_transport, stop_progress

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread, owned by one connector."""

    def __init__(self, name: str = "dkv-connector") -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the connector's event loop did not start")

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        loop.run_until_complete(self._init())
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._drain())
            loop.close()

    async def _init(self) -> None:
        init_transport()

    async def _drain(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await stop_progress()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._loop is not None and not self._loop.is_closed()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns at once. Raises ``RuntimeError`` once stopped."""
        if not self.alive:
            coro.close()
            raise RuntimeError("the connector's event loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds (then ``TimeoutError``)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"connector call did not finish within {timeout}s") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what runs, stop UCX progress, stop the loop, join the thread. Idempotent."""
        if self._loop is not None and not self._loop.is_closed() and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
