"""The native checked copy (dkv._checked_copy): the same bytes and the same checksums as the Python copy.

It is built at install (a C compiler and ``xxhash.h``: Debian's gcc and
libxxhash-dev, which ``scripts/run.sh`` installs); this suite requires it, so
a build that silently fell back to the Python copy fails here rather than
passing with the fast path untested. The Python fallback is tested too.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from typing import Any

import pytest

import dkv.lease_slots as lease_slots
import dkv.native as dkv_native
from dkv.checksum import block_checksum, block_head, block_prefix
from dkv.lease_slots import LeaseSlots



def test_the_native_checked_copy_is_built() -> None:
    assert dkv_native.NATIVE and lease_slots._native_copy_and_checksum is not None, (
        "dkv._checked_copy was not built: install gcc and libxxhash-dev, then `pip install -e .` again "
        "(scripts/run.sh does both)")


def _copy_and_checksum():
    from dkv._checked_copy import copy_and_checksum

    return copy_and_checksum


def _kernels() -> list[str]:
    """The builds of the kernel this CPU runs: the generic one always, AVX2 where the CPU has it."""
    import dkv._checked_copy as native

    chosen, usable = native.KERNEL, []
    for name in ("generic", "avx2"):
        try:
            native.use_kernel(name)
        except ValueError:
            continue
        usable.append(name)
    native.use_kernel(chosen)
    return usable


@pytest.fixture(params=["generic", "avx2"])
def kernel(request: pytest.FixtureRequest):
    """Each build in turn; the one chosen at import again afterwards. AVX2 is compared only where it runs."""
    import dkv._checked_copy as native

    if request.param not in _kernels():
        pytest.skip("this CPU has no AVX2: its build cannot run here")
    chosen = native.KERNEL
    native.use_kernel(request.param)
    yield request.param
    native.use_kernel(chosen)


@pytest.fixture(params=["streamed", "cached"])
def stream(request: pytest.FixtureRequest):
    """Every block streamed out through the staging buffer, or none: both ways of writing a destination."""
    import dkv._checked_copy as native

    before = native.set_stream_min(0 if request.param == "streamed" else 1 << 62)
    yield request.param
    native.set_stream_min(before)


def test_the_avx2_build_is_chosen_where_the_cpu_has_it() -> None:
    import dkv._checked_copy as native

    has_avx2 = "avx2" in open("/proc/cpuinfo").read().split()  # noqa: SIM115 - Linux, read once
    assert native.KERNEL == ("avx2" if has_avx2 else "generic")
    with pytest.raises(ValueError):
        native.use_kernel("neon")


@pytest.mark.parametrize("size", [0, 1, 4095, 16 * 1024 + 1, 64 * 1024, (1 << 20) + 7])
@pytest.mark.parametrize("hash_length", [8, 32])
def test_each_copy_gets_the_slots_bytes_and_the_checksum_block_checksum_gives(size: int, hash_length: int,
                                                                             kernel: str, stream: str) -> None:
    copy_and_checksum = _copy_and_checksum()
    n = 5
    segment = os.urandom(n * size + 4096)
    offsets = [4096 + i * size for i in range(n)][::-1]  # in any order
    keys = [("full" if i % 2 else "a-longer-leaf-name", i % 3, os.urandom(hash_length)) for i in range(n)]
    dests = [bytearray(size) for _ in range(n)]
    sums = copy_and_checksum(memoryview(segment), [memoryview(d) for d in dests], offsets,
                             [block_prefix(leaf, shard, h, size) for leaf, shard, h in keys])
    assert [bytes(d) for d in dests] == [segment[o:o + size] for o in offsets]
    assert sums == b"".join(block_checksum(leaf, shard, h, d) for (leaf, shard, h), d in zip(keys, dests))


def test_large_blocks_are_streamed_by_default() -> None:
    import dkv._checked_copy as native

    before = native.set_stream_min(native.STREAM_MIN)
    assert before == native.STREAM_MIN == 64 * 1024, "the size a block is streamed from moved without the docs"


@pytest.mark.parametrize("size", [1, 15, 16, 17, 63, 64, 65, 16 * 1024 - 1, 16 * 1024 + 17, 3 * 16 * 1024 + 5])
def test_a_streamed_copy_lands_whole_at_any_alignment_and_length(size: int, kernel: str, stream: str) -> None:
    """Destinations at every alignment in 16 bytes, lengths around the stores' 16- and 64-byte steps and the
    stage's 16 KiB: each copy is exactly its slot, its neighbours untouched, its checksum the slot's."""
    copy_and_checksum = _copy_and_checksum()
    n = 16
    segment = os.urandom(n * size)
    offsets = [i * size for i in range(n)]
    keys = [("L", 0, os.urandom(32)) for _ in range(n)]
    pad = 64
    arena = bytearray(b"\xa5" * (n * (size + 2 * pad) + 64))
    view = memoryview(arena)
    starts = [pad + i * (size + 2 * pad) + i % 16 for i in range(n)]  # misaligned by 0..15 bytes
    sums = copy_and_checksum(memoryview(segment), [view[a:a + size] for a in starts], offsets,
                             [block_prefix(leaf, shard, h, size) for leaf, shard, h in keys])
    for i, a in enumerate(starts):
        assert arena[a:a + size] == segment[offsets[i]:offsets[i] + size], f"block {i} landed wrong"
        assert arena[a - pad:a] == b"\xa5" * pad and arena[a + size:a + size + pad] == b"\xa5" * pad, (
            f"block {i} wrote outside its destination")
    assert sums == b"".join(block_checksum(leaf, shard, h, segment[o:o + size]) for (leaf, shard, h), o
                            in zip(keys, offsets))


def test_a_block_outside_the_segment_is_refused_before_anything_is_copied() -> None:
    copy_and_checksum = _copy_and_checksum()
    segment = memoryview(bytes(range(256)) * 64)  # 16 KiB, read-only (a read-only credential's mapping)
    dests = [bytearray(4096), bytearray(4096)]
    prefixes = [block_prefix("L", 0, b"\1" * 8, 4096)] * 2
    for bad in (len(segment) - 4095, -1, 1 << 62):
        with pytest.raises(ValueError, match="outside the segment"):
            copy_and_checksum(segment, [memoryview(d) for d in dests], [0, bad], prefixes)
        assert dests == [bytearray(4096)] * 2, "a refused copy wrote into a destination"


def test_malformed_arguments_are_errors_not_crashes() -> None:
    copy_and_checksum = _copy_and_checksum()
    segment = memoryview(bytearray(8192))
    prefix = block_prefix("L", 0, b"\1" * 8, 4096)
    with pytest.raises(ValueError, match="one offset and one prefix"):
        copy_and_checksum(segment, [bytearray(4096)], [0, 4096], [prefix])
    with pytest.raises(TypeError):
        copy_and_checksum(segment, [bytearray(4096)], [0], ["not bytes"])
    with pytest.raises(TypeError):
        copy_and_checksum(segment, [bytearray(4096)], [0.5], [prefix])
    with pytest.raises((TypeError, BufferError)):
        copy_and_checksum(segment, [bytes(4096)], [0], [prefix])  # a read-only destination
    assert copy_and_checksum(segment, [], [], []) == b""


def _shared_batch(n: int, size: int) -> tuple[bytes, list[int], list[bytes], list[bytearray], bytes]:
    """A segment of ``n`` blocks in reverse order, their prefixes, empty destinations, and the writers' sums."""
    segment = os.urandom(n * size)
    offsets = [(n - 1 - i) * size for i in range(n)]
    keys = [("L", i % 2, os.urandom(32)) for i in range(n)]
    prefixes = [block_prefix(leaf, shard, h, size) for leaf, shard, h in keys]
    sums = b"".join(block_checksum(leaf, shard, h, segment[o:o + size]) for (leaf, shard, h), o in zip(keys, offsets))
    return segment, offsets, prefixes, [bytearray(size) for _ in range(n)], sums


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_shared_copy_gets_every_block_once_however_many_threads_work_on_it(threads: int, kernel: str) -> None:
    from dkv._checked_copy import CheckedCopy

    n, size = 97, 20 * 1024  # not a multiple of a claim
    segment, offsets, prefixes, dests, sums = _shared_batch(n, size)
    shared = CheckedCopy(memoryview(segment), [memoryview(d) for d in dests], offsets, prefixes, sums)
    assert shared.blocks == n
    answers: list[bool] = []
    workers = [threading.Thread(target=lambda: answers.append(shared.work())) for _ in range(threads - 1)]
    for worker in workers:
        worker.start()
    answers.append(shared.work())
    for worker in workers:
        worker.join(30)
    assert answers == [True] * threads
    assert [bytes(d) for d in dests] == [segment[o:o + size] for o in offsets]
    assert shared.work() is True  # nothing left to claim: a late thread finds the copy whole


def test_a_shared_copy_stops_claiming_at_a_block_that_fails_its_checksum(kernel: str) -> None:
    from dkv._checked_copy import CheckedCopy

    n, size = 64, 64 * 1024  # 4 blocks a claim
    segment, offsets, prefixes, dests, sums = _shared_batch(n, size)
    bad = bytearray(sums)
    bad[16 * 2] ^= 1  # the third block's: in the first claim
    shared = CheckedCopy(memoryview(segment), [memoryview(d) for d in dests], offsets, prefixes, bytes(bad))
    assert shared.work() is False
    assert shared.work() is False, "a thread after the failure was told the copy is whole"
    assert all(d == bytearray(size) for d in dests[8:]), "blocks were claimed after one failed"


def test_a_stopped_shared_copy_copies_nothing_more() -> None:
    from dkv._checked_copy import CheckedCopy

    segment, offsets, prefixes, dests, sums = _shared_batch(8, 4096)
    shared = CheckedCopy(memoryview(segment), [memoryview(d) for d in dests], offsets, prefixes, sums)
    shared.stop()
    assert shared.work() is False
    assert dests == [bytearray(4096)] * 8


def test_a_shared_copy_with_malformed_arguments_is_refused_when_made() -> None:
    from dkv._checked_copy import CheckedCopy

    segment, offsets, prefixes, dests, sums = _shared_batch(2, 4096)
    views = [memoryview(d) for d in dests]
    with pytest.raises(ValueError, match="16 bytes a block"):
        CheckedCopy(memoryview(segment), views, offsets, prefixes, sums[:-1])
    with pytest.raises(ValueError, match="outside the segment"):
        CheckedCopy(memoryview(segment), views, [0, len(segment)], prefixes, sums)
    with pytest.raises(TypeError):
        CheckedCopy(memoryview(segment), views, offsets, ["not bytes"] * 2, sums)
    with pytest.raises(RuntimeError, match="not made"):
        CheckedCopy.__new__(CheckedCopy).work()
    assert CheckedCopy(memoryview(segment), [], [], [], b"").work() is True
    assert dests == [bytearray(4096)] * 2


def _rows_batch(n: int, size: int) -> dict[str, Any]:
    """A slot map of ``n`` blocks (packed as a node sends it), rows to load them into, and what they should hold."""
    segment = os.urandom((n + 2) * size)
    hashes = [os.urandom(32) for _ in range(n)]
    offsets = [(n - i) * size for i in range(n)]  # in any order, none at 0
    sums = b"".join(block_checksum("L", 0, h, segment[o:o + size]) for h, o in zip(hashes, offsets))
    return {"segment": segment, "hashes": hashes, "ids": [2 * i + 1 for i in range(n)], "size": size,
            "offsets": array("q", offsets).tobytes(), "sizes": array("q", [size] * n).tobytes(), "sums": sums,
            "rows": bytearray((2 * n + 1) * size), "expected": [segment[o:o + size] for o in offsets]}


def _rows_copy(b: dict[str, Any], **change: Any) -> Any:
    from dkv._checked_copy import rows_copy

    b = {**b, **change}
    return rows_copy(memoryview(b["segment"]), b["rows"], b["size"], b["ids"], b["offsets"], b["sizes"], b["sums"],
                     block_head("L", 0, b["size"], 32), b["hashes"])


@pytest.mark.parametrize("hold_gil", [False, True])
def test_a_rows_copy_puts_each_slot_in_its_row_and_checks_it_as_the_keyed_copy_does(hold_gil: bool,
                                                                                     kernel: str) -> None:
    b = _rows_batch(37, 12 * 1024)
    copy = _rows_copy(b)
    assert copy.blocks == 37 and copy.work(hold_gil=hold_gil) is True
    size = b["size"]
    assert [bytes(b["rows"][i * size:(i + 1) * size]) for i in b["ids"]] == b["expected"]
    assert all(b["rows"][i * size:(i + 1) * size] == bytearray(size) for i in range(0, 2 * 37 + 1, 2)), (
        "a row no block was for was written")
    bad = bytearray(b["sums"])
    bad[-1] ^= 1  # the last block's checksum: the copy does not verify
    assert _rows_copy(b, sums=bytes(bad)).work(hold_gil=hold_gil) is False


def test_a_slot_a_rows_copy_cannot_take_makes_no_copy() -> None:
    b = _rows_batch(4, 4096)
    for at, offset, size in ((1, -1, 4096), (2, 0, 8192), (3, len(b["segment"]) - 4095, 4096)):
        offsets, sizes = array("q", b["offsets"]), array("q", b["sizes"])
        offsets[at], sizes[at] = offset, size  # no checksum (-1), another size, past the segment's end
        assert _rows_copy(b, offsets=offsets.tobytes(), sizes=sizes.tobytes()) is None
    assert b["rows"] == bytearray(len(b["rows"]))


def test_a_rows_copy_with_malformed_arguments_is_refused_when_made() -> None:
    b = _rows_batch(3, 4096)
    with pytest.raises(ValueError, match="outside the"):
        _rows_copy(b, ids=[1, 3, 7])  # 7 rows of 4 KiB in the buffer: row 7 is past its end
    with pytest.raises(ValueError, match="one id per hash"):
        _rows_copy(b, ids=[1, 3])
    with pytest.raises(ValueError, match="as long as the first"):
        _rows_copy(b, hashes=[*b["hashes"][:2], b"\1" * 8])
    with pytest.raises(ValueError, match="does not cover"):
        _rows_copy(b, sums=b["sums"][:-16])
    with pytest.raises((TypeError, BufferError)):
        _rows_copy(b, rows=bytes(len(b["rows"])))  # read-only rows
    assert b["rows"] == bytearray(len(b["rows"]))


@pytest.mark.parametrize("path", ["native", "python"])
async def test_a_lease_copy_is_delivered_and_a_reused_slot_is_caught_on_either_path(path: str, monkeypatch) -> None:
    if path == "python":
        monkeypatch.setattr(lease_slots, "_native_copy_and_checksum", None)
        monkeypatch.setattr(lease_slots, "_native_shared_copy", None)
    block, n = 64 * 1024, 80  # 5 MiB of 64 KiB blocks: off the loop, and split across threads on the native path
    assert n * block >= lease_slots.PARALLEL_COPY_MIN
    data = bytearray(os.urandom(n * block))
    hashes = [os.urandom(32) for _ in range(n)]
    sums = [block_checksum("L", 0, h, memoryview(data)[i * block:(i + 1) * block]) for i, h in enumerate(hashes)]

    class Mapping:
        view = memoryview(data)
        size = len(data)

    raw = {"L": [array("q", [i * block for i in range(n)]).tobytes(), array("q", [block] * n).tobytes(),
                 b"".join(sums)]}
    slots = LeaseSlots(Mapping(), hashes, 1, raw, live_until=time.monotonic() + 60)  # type: ignore[arg-type]
    keys = [("L", 0, h) for h in hashes]
    dests = [bytearray(block) for _ in range(n)]
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is True
    assert b"".join(dests) == bytes(data)
    data[(n - 1) * block + 3] ^= 0xFF  # the last slot reused meanwhile
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is False


def _ended_within(copy: Any, seconds: float = 30.0) -> bool | None:
    deadline = time.monotonic() + seconds
    while copy.result() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return copy.result()


@pytest.mark.parametrize("shares", [1, 2, 4])
def test_a_copy_posted_to_the_native_threads_gets_every_block_once(shares: int) -> None:
    b = _rows_batch(97, 20 * 1024)
    copy = _rows_copy(b)
    assert copy.result() is None  # not posted: never ended
    copy.post(shares)
    assert _ended_within(copy) is True
    size = b["size"]
    assert [bytes(b["rows"][i * size:(i + 1) * size]) for i in b["ids"]] == b["expected"]
    with pytest.raises(RuntimeError, match="posted once"):
        copy.post(1)


def test_copies_posted_from_many_threads_at_once_each_end_once_with_every_block() -> None:
    """Posting pushes onto the pool's queue without a lock: many posters at once, shares 1 to 4 each, lose,
    duplicate and reorder nothing (every copy ends True, every row is its slot)."""
    b = _rows_batch(12, 4 * 1024)
    posters, per_poster = 4, 40
    copies: list[list[Any]] = [[] for _ in range(posters)]
    start = threading.Barrier(posters)

    def poster(k: int) -> None:
        start.wait(timeout=30)
        for i in range(per_poster):
            copy = _rows_copy({**b, "rows": bytearray(len(b["rows"]))})
            copy.post(1 + (k + i) % 4)
            copies[k].append(copy)

    threads = [threading.Thread(target=poster, args=(k,)) for k in range(posters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    every = [c for per in copies for c in per]
    assert len(every) == posters * per_poster
    deadline = time.monotonic() + 30
    while any(c.result() is None for c in every) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [c.result() for c in every] == [True] * len(every)


def test_a_posted_copy_that_fails_its_checksums_or_is_stopped_ends_false() -> None:
    b = _rows_batch(40, 16 * 1024)
    bad = bytearray(b["sums"])
    bad[16 * 39] ^= 1  # the last block's
    failing = _rows_copy(b, sums=bytes(bad))
    failing.post(2)
    assert _ended_within(failing) is False
    stopped = _rows_copy({**b, "rows": bytearray(len(b["rows"]))})
    stopped.stop()
    stopped.post(2)
    assert _ended_within(stopped) is False
    with pytest.raises(ValueError, match="1 to 8 shares"):
        _rows_copy(b).post(0)


def test_each_ended_copy_is_handed_out_once_and_one_freed_while_copying_is_waited_for() -> None:
    from dkv._checked_copy import wait_ended

    b = _rows_batch(64, 64 * 1024)
    copies = [_rows_copy({**b, "rows": bytearray(len(b["rows"]))}) for _ in range(3)]
    for copy in copies:
        copy.post(2)
    seen: list[Any] = []
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:  # the process's watcher may take some (posted copies)
        seen += [c for c in wait_ended(0.05) if any(c is copy for copy in copies)]
        if all(copy.result() is not None for copy in copies):
            break
    assert all(copy.result() is True for copy in copies)
    assert len(seen) == len({id(c) for c in seen}), "a copy was handed out twice"
    rows = bytearray(len(b["rows"]))
    freed = _rows_copy({**b, "rows": rows})
    freed.post(2)
    del freed  # the dealloc stops it and waits for its shares: no native thread writes after it
    after = bytes(rows)
    time.sleep(0.3)
    assert bytes(rows) == after


def test_the_native_copy_threads_run_as_niced_batch_work_so_they_never_preempt_the_poster() -> None:
    import dkv._checked_copy as checked_copy

    poster = threading.get_native_id()
    poster_nice = os.getpriority(os.PRIO_PROCESS, poster)
    b = _rows_batch(64, 16 * 1024)
    for _ in range(3):  # each post wakes at least one thread; two shares start the pool's first two
        copy = _rows_copy({**b, "rows": bytearray(len(b["rows"]))})
        copy.post(2)
        assert _ended_within(copy) is True
    python_threads = {t.native_id for t in threading.enumerate()}
    native = [int(tid) for tid in os.listdir("/proc/self/task") if int(tid) not in python_threads]
    threads = {}
    for tid in native:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            threads[tid] = (name, os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
        except OSError:  # it ended meanwhile (a thread of another library)
            continue
    copiers = [tid for tid, (name, _, _) in threads.items() if name == "dkv-native-copy"]
    assert len(copiers) >= 2, f"no two native copy threads: {threads}"
    for tid in copiers:
        _, policy, nice = threads[tid]
        assert policy == os.SCHED_BATCH, threads
        assert nice == max(checked_copy.THREAD_NICE, poster_nice), threads  # (never below the process's own)
    assert checked_copy.THREAD_NICE == 10
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the posting thread's own policy is left as it was"
    assert os.getpriority(os.PRIO_PROCESS, poster) == poster_nice, "and its nice value"
