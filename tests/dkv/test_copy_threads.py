"""The copy threads (dkv.copy_threads): chunks of one copy taken once each, failures and cancels that settle only when idle;
native copies posted to the native threads, settled by whoever sees them end first."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from array import array
from typing import Any

import pytest

import dkv.native as dkv_native
from dkv import copy_threads
from dkv.checksum import block_checksum, block_head
from dkv.copy_threads import ChunkedCopy, PostedCopy, chunk_bounds
from tests.copy_hooks import watcher_held_off

WAIT = 30.0


def test_chunks_hold_consecutive_blocks_of_at_least_the_chunk_size_and_are_at_most_so_many(monkeypatch) -> None:
    monkeypatch.setattr(copy_threads, "CHUNK_BYTES", 100)
    monkeypatch.setattr(copy_threads, "CHUNKS", 4)
    assert chunk_bounds(10, 10 * 50) == [0, 3, 6, 9, 10]  # 2 blocks make a chunk size, but 4 chunks at most
    assert chunk_bounds(10, 10 * 10) == [0, 10]  # 10 blocks to make a chunk size
    assert chunk_bounds(4, 4 * 500) == [0, 1, 2, 3, 4]  # a block over the chunk size is a chunk of its own
    assert chunk_bounds(1, 5) == [0, 1]
    assert chunk_bounds(0, 0) == [0]
    for count, nbytes in ((7, 7000), (256, 256 << 16), (5, 1), (1000, 10 ** 9)):
        bounds = chunk_bounds(count, nbytes)
        assert bounds[0] == 0 and bounds[-1] == count and len(bounds) - 1 <= 4
        assert all(a < b for a, b in zip(bounds, bounds[1:]))


def _run(copy: ChunkedCopy, threads: int) -> None:
    for _ in range(threads - 1):
        copy_threads.submit(copy.work)
    copy.work()


def test_every_chunk_is_copied_once_by_whichever_thread_takes_it() -> None:
    taken: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def copy_chunk(start: int, stop: int) -> bool:
        time.sleep(0.01)
        with lock:
            taken.append((start, stop, threading.get_ident()))
        return True

    copy = ChunkedCopy()
    bounds = list(range(0, 41, 2))
    copy.start(bounds, copy_chunk)
    _run(copy, 3)
    assert copy.done.result(timeout=WAIT) is True
    assert sorted((a, b) for a, b, _ in taken) == list(zip(bounds, bounds[1:]))
    assert len({t for _, _, t in taken}) > 1, "one thread copied every chunk"


def test_a_chunk_that_does_not_verify_fails_the_copy_and_stops_it() -> None:
    taken: list[int] = []

    def copy_chunk(start: int, _stop: int) -> bool:
        taken.append(start)
        return start != 3

    copy = ChunkedCopy()
    copy.start(list(range(11)), copy_chunk)
    copy.work()
    assert copy.done.result(timeout=WAIT) is False
    assert taken == [0, 1, 2, 3], "chunks were copied after one failed"


def test_a_chunk_that_raises_reports_its_error() -> None:
    def copy_chunk(start: int, _stop: int) -> bool:
        if start == 1:
            raise OSError("bad slot")
        return True

    copy = ChunkedCopy()
    copy.start([0, 1, 2, 3], copy_chunk)
    copy.work()
    with pytest.raises(OSError, match="bad slot"):
        copy.done.result(timeout=WAIT)


def test_a_copy_with_no_chunks_is_done_and_one_given_up_is_not() -> None:
    empty = ChunkedCopy()
    empty.start([0], lambda a, b: True)
    assert empty.done.result(timeout=WAIT) is True
    given_up = ChunkedCopy()
    given_up.give_up()
    assert given_up.done.result(timeout=WAIT) is False
    failed = ChunkedCopy()
    failed.give_up(ValueError("no plan"))
    with pytest.raises(ValueError, match="no plan"):
        failed.done.result(timeout=WAIT)


def test_a_copy_cancelled_before_it_starts_copies_nothing() -> None:
    copy = ChunkedCopy()
    copy.cancel()
    assert copy.done.result(timeout=WAIT) is False
    taken: list[int] = []
    copy.start([0, 1, 2], lambda a, b: taken.append(a) or True)
    copy.work()
    assert taken == []


def test_a_cancelled_copy_settles_only_once_the_chunk_being_copied_ends() -> None:
    inside, release = threading.Event(), threading.Event()
    taken: list[int] = []

    def copy_chunk(start: int, _stop: int) -> bool:
        taken.append(start)
        inside.set()
        assert release.wait(WAIT)
        return True

    copy = ChunkedCopy()
    copy.start([0, 1, 2, 3], copy_chunk)
    worker = copy_threads.submit(copy.work)
    assert inside.wait(WAIT)
    copy.cancel()
    time.sleep(0.2)
    assert not copy.done.done(), "the copy settled while a chunk was still being copied"
    release.set()
    assert copy.done.result(timeout=WAIT) is False
    worker.result(timeout=WAIT)
    assert taken == [0]


def _submit_in_child(answer: "multiprocessing.Queue[int]") -> None:
    answer.put(copy_threads.submit(lambda: 42).result(timeout=WAIT))


def test_a_forked_child_gets_copy_threads_of_its_own() -> None:
    assert copy_threads.submit(lambda: 1).result(timeout=WAIT) == 1  # the parent's pool exists before the fork
    context = multiprocessing.get_context("fork")
    answer = context.Queue()
    child = context.Process(target=_submit_in_child, args=(answer,))
    child.start()
    try:
        assert answer.get(timeout=WAIT) == 42
    finally:
        child.join(WAIT)
        if child.is_alive():
            child.kill()
            child.join(WAIT)
    assert child.exitcode == 0


def _native_copy(blocks: int, size: int) -> tuple[Any, bytearray, bytes]:
    """A native copy of ``blocks`` blocks into rows (see tests/dkv/test_checked_copy.py), its rows, and their source."""
    from dkv._checked_copy import rows_copy

    segment = os.urandom(blocks * size)
    hashes = [os.urandom(32) for _ in range(blocks)]
    sums = b"".join(block_checksum("L", 0, h, segment[i * size:(i + 1) * size]) for i, h in enumerate(hashes))
    rows = bytearray(blocks * size)
    copy = rows_copy(memoryview(segment), rows, size, list(range(blocks)),
                     array("q", [i * size for i in range(blocks)]).tobytes(), array("q", [size] * blocks).tobytes(),
                     sums, block_head("L", 0, size, 32), hashes)
    return copy, rows, segment


@pytest.fixture
def native() -> None:
    if dkv_native.CheckedCopy is None:
        pytest.skip("the native checked copy is not built (tests/dkv/test_checked_copy.py fails for that)")


def test_a_posted_copy_is_settled_by_the_watcher_with_no_one_polling(native: None) -> None:
    copy, rows, segment = _native_copy(64, 16 * 1024)
    posted = PostedCopy(copy, 2)
    assert posted.done.result(timeout=WAIT) is True
    assert bytes(rows) == segment


def test_a_posted_copy_is_settled_by_the_thread_that_polls_it_without_waiting_for_the_watcher(
        native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    copy, rows, segment = _native_copy(64, 16 * 1024)
    settled_on: list[threading.Thread] = []
    with watcher_held_off(monkeypatch, WAIT) as handed:  # the watcher cannot settle the copy meanwhile
        posted = PostedCopy(copy, 2)
        posted.done.add_done_callback(lambda _f: settled_on.append(threading.current_thread()))
        deadline = time.monotonic() + WAIT
        while not posted.poll():
            assert time.monotonic() < deadline, "the native threads never ended the copy"
            time.sleep(0.0005)
        assert posted.done.result(timeout=0) is True and bytes(rows) == segment
        while not handed:  # the watcher is handed the ended copy too, and is held there
            assert time.monotonic() < deadline, "the watcher was never handed the ended copy"
            time.sleep(0.001)
    assert settled_on == [threading.current_thread()]
    time.sleep(0.2)  # the watcher sees it end too: it settles it no second time
    assert settled_on == [threading.current_thread()] and posted.poll()


def test_a_cancelled_posted_copy_resolves_false_and_writes_nothing_after(native: None) -> None:
    copy, rows, _ = _native_copy(512, 128 * 1024)  # 64 MiB: still copying when it is cancelled
    posted = PostedCopy(copy, 2)
    posted.cancel()
    assert posted.done.result(timeout=WAIT) is False
    after = bytes(rows)
    time.sleep(0.3)
    assert bytes(rows) == after, "bytes landed after the cancelled copy settled"


def _post_in_child(answer: "multiprocessing.Queue[object]") -> None:
    copy, rows, segment = _native_copy(16, 4096)
    answer.put(PostedCopy(copy, 2).done.result(timeout=WAIT) and bytes(rows) == segment)


def test_a_forked_child_gets_native_copy_threads_and_a_watcher_of_its_own(native: None) -> None:
    copy, _, _ = _native_copy(16, 4096)
    assert PostedCopy(copy, 2).done.result(timeout=WAIT) is True  # the parent's pool and watcher exist
    context = multiprocessing.get_context("fork")
    answer = context.Queue()
    child = context.Process(target=_post_in_child, args=(answer,))
    child.start()
    try:
        assert answer.get(timeout=WAIT) is True
    finally:
        child.join(WAIT)
        if child.is_alive():
            child.kill()
