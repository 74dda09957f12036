"""LightFuture behaves as concurrent.futures.Future does wherever callers can tell; NativeCondition as a Condition."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import weakref

import pytest

from dkv.light_future import LightFuture, NativeCondition, resolved

BOUND = 20.0  # seconds: generous, for a loaded machine; nothing here should take more than milliseconds

KINDS = [concurrent.futures.Future, LightFuture]


def _later(delay: float, fn, *args) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), fn(*args)), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", KINDS)
def test_a_result_set_from_another_thread_wakes_every_waiter(kind) -> None:
    future = kind()
    got: list[object] = []
    waiters = [threading.Thread(target=lambda: got.append(future.result(BOUND)), daemon=True) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    setter = _later(0.05, future.set_result, "value")
    for waiter in waiters + [setter]:
        waiter.join(BOUND)
    assert got == ["value"] * 3
    assert future.done() and not future.cancelled() and future.exception() is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_wait_that_runs_out_raises_timeout_and_leaves_the_future_usable(kind) -> None:
    future = kind()
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(0.01)
    with pytest.raises(concurrent.futures.TimeoutError):
        future.exception(0)
    future.set_result(7)
    assert future.result(0) == 7
    assert not future._condition._waiters  # the waits that ran out left nothing to wake


@pytest.mark.parametrize("kind", KINDS)
def test_an_exception_reaches_result_exception_and_callbacks(kind) -> None:
    future = kind()
    seen: list[BaseException | None] = []
    future.add_done_callback(lambda f: seen.append(f.exception()))
    error = ValueError("boom")
    _later(0.02, future.set_exception, error).join(BOUND)
    with pytest.raises(ValueError, match="boom"):
        future.result(BOUND)
    assert future.exception(0) is error and seen == [error]
    future.add_done_callback(lambda f: seen.append(f.exception()))  # added once done: called at once
    assert seen == [error, error]


@pytest.mark.parametrize("kind", KINDS)
def test_callbacks_run_once_in_order_and_a_failing_one_does_not_stop_the_rest(kind, caplog) -> None:
    future = kind()
    calls: list[int] = []
    future.add_done_callback(lambda f: calls.append(1))
    future.add_done_callback(lambda f: 1 / 0)
    future.add_done_callback(lambda f: calls.append(3))
    assert future.set_running_or_notify_cancel()
    assert future.running()
    future.set_result(None)
    assert calls == [1, 3]
    assert "exception calling callback" in caplog.text
    with pytest.raises(concurrent.futures.InvalidStateError):
        future.set_result(None)


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_before_running_wakes_waiters_and_calls_back(kind) -> None:
    future = kind()
    calls: list[bool] = []
    future.add_done_callback(lambda f: calls.append(f.cancelled()))
    _later(0.02, future.cancel)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(BOUND)
    assert calls == [True] and not future.set_running_or_notify_cancel()
    running = kind()
    assert running.set_running_or_notify_cancel() and not running.cancel()


@pytest.mark.parametrize("kind", KINDS)
def test_wait_and_as_completed_see_futures_finished_from_other_threads(kind) -> None:
    futures = [kind() for _ in range(4)]
    for i, future in enumerate(futures):
        _later(0.01 * (i + 1), future.set_result, i)
    done, pending = concurrent.futures.wait(futures, timeout=BOUND, return_when=concurrent.futures.FIRST_COMPLETED)
    assert done and all(f.done() for f in done)
    assert sorted(f.result() for f in concurrent.futures.as_completed(futures, timeout=BOUND)) == [0, 1, 2, 3]
    done, pending = concurrent.futures.wait(futures, timeout=BOUND)
    assert len(done) == 4 and not pending


@pytest.mark.parametrize("kind", KINDS)
def test_an_event_loop_awaits_one_through_wrap_future(kind) -> None:
    future = kind()

    async def main() -> object:
        _later(0.02, future.set_result, "from a thread")
        return await asyncio.wait_for(asyncio.wrap_future(future), BOUND)

    assert asyncio.run(main()) == "from a thread"


def test_a_light_future_is_a_future_and_resolved_holds_its_value() -> None:
    future = resolved(3)
    assert isinstance(future, concurrent.futures.Future) and future.done() and future.result(0) == 3
    assert LightFuture[int] is not None  # generic, as Future is


def test_the_condition_lets_go_of_every_level_it_holds_while_it_waits() -> None:
    condition = NativeCondition()
    with pytest.raises(RuntimeError):
        condition.wait(0)
    with pytest.raises(RuntimeError):
        condition.notify_all()
    entered = threading.Event()

    def notifier() -> None:
        with condition:  # blocks unless the waiter let go of both levels
            entered.set()
            condition.notify_all()

    with condition:
        with condition:
            thread = threading.Thread(target=notifier, daemon=True)
            thread.start()
            assert condition.wait(BOUND)
            assert entered.is_set()
            assert condition._is_owned()
        assert condition._is_owned()  # one level still held after the inner block
    assert not condition._is_owned()
    thread.join(BOUND)


def test_a_condition_wait_that_runs_out_leaves_no_waiter_behind() -> None:
    condition = NativeCondition()
    with condition:
        assert not condition.wait(0.01)
        assert not condition.wait(0)
        assert not condition._waiters
        condition.notify_all()  # nobody waits: nothing to wake


def test_a_settled_light_future_lets_go_of_its_callbacks_on_the_settling_thread() -> None:
    """What its callbacks hold is freed where it settles, not later wherever the future is dropped."""
    future: LightFuture[int] = LightFuture()
    called: list[int] = []

    class Held:  # stands for what a callback's closure holds (a plan, a task)
        def __call__(self, f: concurrent.futures.Future) -> None:
            called.append(f.result())

    held = Held()
    alive = weakref.ref(held)
    future.add_done_callback(held)
    del held
    assert alive() is not None  # kept while it may still be called
    _later(0.01, future.set_result, 5).join(BOUND)
    assert called == [5] and alive() is None and future.result(0) == 5
    future.add_done_callback(lambda f: called.append(-f.result()))  # added once settled: called at once
    assert called == [5, -5] and not future._done_callbacks


def test_a_light_future_sets_every_attribute_the_standard_one_does() -> None:
    """LightFuture.__init__ stands in for Future.__init__: a Python that adds an attribute there must fail here."""
    standard, light = concurrent.futures.Future(), LightFuture()
    assert set(vars(light)) == set(vars(standard))
    assert {name: value for name, value in vars(light).items() if name != "_condition"} == \
        {name: value for name, value in vars(standard).items() if name != "_condition"}
