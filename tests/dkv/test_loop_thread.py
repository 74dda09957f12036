"""``LoopThread.run``: a blocking call's hop to the loop thread returns, raises, times out and cancels as it says.

A loop thread of its own here, without UCX (its set-up and drain hold no
transport), so these pin the hop itself; every connector test crosses the
shared one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from dkv.loop_thread import LoopThread

BOUND = 10.0  # generous: these machines are noisy


class _BareLoopThread(LoopThread):
    """A LoopThread that neither holds nor stops UCX: only the loop and its thread; ``run`` polls ``spin`` by default."""

    spin = 0.0

    def run(self, coro: Any, timeout: float, *, spin: float | None = None) -> Any:
        return super().run(coro, timeout, spin=self.spin if spin is None else spin)

    async def _init(self) -> None:
        pass

    async def _drain(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(params=[0.0, 0.002], ids=["waits-asleep", "polls-first"])
def loop_thread(request: pytest.FixtureRequest) -> Iterator[LoopThread]:
    """Every test runs with the caller sleeping on its lock at once, and with it polling first (dkv.polling)."""
    thread = _BareLoopThread(name="dkv-test-loop")
    thread.spin = request.param
    yield thread
    thread.stop()
    assert not thread.alive


def test_run_returns_the_result_computed_on_the_loop_thread(loop_thread: LoopThread) -> None:
    async def where() -> tuple[str, int]:
        await asyncio.sleep(0)  # suspends once: the task goes on after the first step
        return threading.current_thread().name, 42

    for _ in range(200):  # many calls: each gets its own answer, none is lost
        assert loop_thread.run(where(), BOUND) == ("dkv-test-loop", 42)


def test_run_raises_what_the_coroutine_raised(loop_thread: LoopThread) -> None:
    class Odd(Exception):
        pass

    async def fails() -> None:
        raise Odd("from the loop")

    with pytest.raises(Odd, match="from the loop"):
        loop_thread.run(fails(), BOUND)


def test_a_run_past_its_timeout_raises_timeout_error_and_cancels_the_coroutine(loop_thread: LoopThread) -> None:
    cancelled = threading.Event()

    async def hangs() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="did not finish within 0.2s"):
        loop_thread.run(hangs(), 0.2)
    assert cancelled.wait(BOUND), "a timed-out call must not leave its coroutine running on the loop"
    assert loop_thread.run(asyncio.sleep(0, "still serving"), BOUND) == "still serving"


def test_a_coroutine_cancelled_on_the_loop_raises_the_futures_cancelled_error(loop_thread: LoopThread) -> None:
    async def cancelled_from_within() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    # an Exception (not asyncio's BaseException), as concurrent.futures has always raised: callers catch it
    with pytest.raises(concurrent.futures.CancelledError):
        loop_thread.run(cancelled_from_within(), BOUND)


def test_run_on_a_stopped_loop_raises_runtime_error_and_closes_the_coroutine(loop_thread: LoopThread) -> None:
    loop_thread.stop()

    async def never() -> None:
        raise AssertionError("must not run")

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "coroutine ... was never awaited" would be one
        with pytest.raises(RuntimeError, match="stopped"):
            loop_thread.run(never(), BOUND)


def test_a_caller_that_polls_sees_an_answer_that_comes_after_its_poll_and_one_that_comes_during_it(
        loop_thread: LoopThread) -> None:
    """Past its poll the caller sleeps on its lock as before; within it, it takes the answer as it comes."""
    async def after(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "answered"

    assert loop_thread.run(after(0.05), BOUND, spin=0.001) == "answered"  # polled 1 ms, then slept
    assert loop_thread.run(after(0.001), BOUND, spin=0.5) == "answered"  # answered while it polled
    with pytest.raises(TimeoutError, match="within 0.05s"):
        loop_thread.run(after(3600), 0.05, spin=0.01)  # the poll counts against the bound


def test_the_loop_thread_runs_as_batch_work_and_leaves_its_caller_as_it_was(loop_thread: LoopThread) -> None:
    """An offload's wake-up of the loop thread must never preempt the scheduler thread that posted it."""

    async def policy() -> int:
        return os.sched_getscheduler(0)

    assert loop_thread.run(policy(), BOUND) == os.SCHED_BATCH
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


def test_a_thread_that_is_not_normal_work_is_left_as_it_is() -> None:
    """A process started under an idle (or real-time) policy: the loop thread keeps it, not batch work."""
    from dkv.loop_thread import run_as_batch_work

    seen: list[Any] = []

    def idle_thread() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        seen.extend([run_as_batch_work(), os.sched_getscheduler(0)])

    thread = threading.Thread(target=idle_thread)
    thread.start()
    thread.join(BOUND)
    assert seen == [False, os.SCHED_IDLE]


class _FailingDrainLoopThread(_BareLoopThread):
    """Its drain raises: the loop is never closed, and its thread ends."""

    async def _drain(self) -> None:
        raise RuntimeError("the drain failed")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failing drain's, meant
def test_alive_holds_while_the_loop_runs_and_drains_and_not_once_it_ended_however_it_ended() -> None:
    draining = threading.Event()
    let_go = threading.Event()

    class _SlowDrain(_BareLoopThread):
        async def _drain(self) -> None:
            draining.set()
            await asyncio.get_running_loop().run_in_executor(None, let_go.wait, BOUND)

    for thread in (_SlowDrain(name="dkv-test-slow-drain"), _FailingDrainLoopThread(name="dkv-test-failing-drain")):
        assert thread.alive
        stopper = threading.Thread(target=thread.stop, daemon=True)
        stopper.start()
        if isinstance(thread, _SlowDrain):
            assert draining.wait(BOUND)
            assert thread.alive  # still draining: work posted now still runs, as before the flag
            let_go.set()
        stopper.join(BOUND)
        assert not thread._thread.is_alive()
        assert not thread.alive, "a loop thread that ended still reads alive"
        coro = asyncio.sleep(0)
        with pytest.raises(RuntimeError):
            thread.submit(coro)
        assert coro.cr_frame is None  # closed, never run
