"""Same-host copies under a lease (dkv.lease_slots): parsing the node's slot map, and copies that never outlive their call."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from array import array
from types import SimpleNamespace
from typing import Any

import pytest

import dkv.lease_slots as lease_slots
from dkv.checksum import block_checksum
from dkv.errors import ProtocolError
from tests.copy_hooks import watch_copies
from dkv.lease_slots import COPY_THREADS, FEW_KEYS, OFF_LOOP_COPY_MIN, PARALLEL_COPY_MIN, LeaseSlots, RowRun

BLOCK = 1 << 20  # at OFF_LOOP_COPY_MIN: copied on a worker thread


class FakeMapping:
    """A segment mapping over a bytearray (what a same-host client maps)."""

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.size = size
        self.view = memoryview(self.data)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.data)[offset:offset + nbytes]


def _slots(mapping: FakeMapping, hashes: list[bytes], sums: list[bytes]) -> LeaseSlots:
    offsets = array("q", [i * BLOCK for i in range(len(hashes))]).tobytes()
    sizes = array("q", [BLOCK] * len(hashes)).tobytes()
    return LeaseSlots(mapping, hashes, 1, {"L": [offsets, sizes, b"".join(sums)]}, live_until=time.monotonic() + 60)


def _stored(n: int) -> tuple[FakeMapping, list[bytes], list[bytes]]:
    mapping = FakeMapping(n * BLOCK)
    hashes = [bytes([i + 1]) * 32 for i in range(n)]
    sums = []
    for i, h in enumerate(hashes):
        mapping.data[i * BLOCK:(i + 1) * BLOCK] = bytes([i + 7]) * BLOCK
        sums.append(block_checksum("L", 0, h, mapping.slot(i * BLOCK, BLOCK)))
    return mapping, hashes, sums


@pytest.fixture(params=["native", "python"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each way the copy threads copy: ``.watch(hook)`` has ``hook(blocks)`` run as each part of a copy begins.

    ``native``: one :class:`dkv._checked_copy.CheckedCopy` a copy, each
    thread's share of it a part; ``python``: without it, each chunk a part.
    """
    native = request.param == "native"
    if native and lease_slots._native_shared_copy is None:
        pytest.skip("the native checked copy is not built (test_checked_copy.py fails for that)")
    hooks = watch_copies(monkeypatch, native=native)
    return SimpleNamespace(native=native, watch=hooks.before.append)


async def test_a_copy_matching_its_checksums_is_delivered_and_a_reused_slot_is_not(copy_path: Any) -> None:
    assert BLOCK >= OFF_LOOP_COPY_MIN
    mapping, hashes, sums = _stored(2)
    slots = _slots(mapping, hashes, sums)
    keys = [("L", 0, h) for h in hashes]
    dests = [bytearray(BLOCK) for _ in hashes]
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is True
    assert [bytes(d) for d in dests] == [bytes(mapping.slot(i * BLOCK, BLOCK)) for i in range(2)]
    mapping.data[BLOCK] ^= 0xFF  # the second slot reused meanwhile
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is False
    assert await slots.copy([("L", 0, b"\x09" * 32)], [memoryview(dests[0])]) is False  # not in the lease


def test_a_slot_map_that_does_not_match_the_request_is_a_protocol_error() -> None:
    mapping, hashes, sums = _stored(2)
    with pytest.raises(ProtocolError):
        LeaseSlots(mapping, hashes, 1, {"L": [b"\0" * 8, b"\0" * 16, b"".join(sums)]}, live_until=0.0)
    with pytest.raises(ProtocolError):
        LeaseSlots(mapping, hashes, 1, {"L": "garbage"}, live_until=0.0)


async def test_a_cancelled_copy_writes_nothing_into_the_views_after_the_cancellation_is_raised(copy_path: Any) -> None:
    mapping, hashes, sums = _stored(2)
    slots = _slots(mapping, hashes, sums)
    started = threading.Event()

    def slow(_blocks: int) -> None:
        started.set()
        time.sleep(0.5)  # still copying when the caller is cancelled

    copy_path.watch(slow)
    dests = [bytearray(BLOCK) for _ in hashes]
    task = asyncio.ensure_future(slots.copy([("L", 0, h) for h in hashes], [memoryview(d) for d in dests]))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = [bytes(d) for d in dests]
    await asyncio.sleep(0.8)
    assert [bytes(d) for d in dests] == after, "bytes landed in the caller's buffers after the copy was cancelled"


async def test_a_copy_shared_by_the_copy_threads_is_delivered_whole_and_fails_when_any_block_fails(
        copy_path: Any) -> None:
    n = PARALLEL_COPY_MIN // BLOCK + 2  # over the sharing threshold: taken by both threads
    assert COPY_THREADS > 1 and n * BLOCK >= PARALLEL_COPY_MIN
    mapping, hashes, sums = _stored(n)
    slots = _slots(mapping, hashes, sums)
    keys = [("L", 0, h) for h in hashes]
    dests = [bytearray(BLOCK) for _ in hashes]
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is True
    assert [bytes(d) for d in dests] == [bytes(mapping.slot(i * BLOCK, BLOCK)) for i in range(n)]
    for reused in (0, n - 1):  # the first slot, then the last
        mapping.data[reused * BLOCK + 5] ^= 0xFF
        assert await slots.copy(keys, [memoryview(d) for d in dests]) is False
        mapping.data[reused * BLOCK + 5] ^= 0xFF


async def test_both_copy_threads_take_part_in_one_copy(copy_path: Any) -> None:
    n = PARALLEL_COPY_MIN // BLOCK + 2
    mapping, hashes, sums = _stored(n)
    slots = _slots(mapping, hashes, sums)
    threads: set[int] = set()

    def noted(_blocks: int) -> None:
        threads.add(threading.get_ident())
        time.sleep(0.05)  # long enough for the other thread to take a part meanwhile

    copy_path.watch(noted)
    dests = [bytearray(BLOCK) for _ in hashes]
    assert await slots.copy([("L", 0, h) for h in hashes], [memoryview(d) for d in dests]) is True
    assert len(threads) == COPY_THREADS and threading.get_ident() not in threads


async def test_a_cancelled_shared_copy_waits_for_every_part_being_copied_and_writes_nothing_after(
        copy_path: Any) -> None:
    n = PARALLEL_COPY_MIN // BLOCK + 2
    mapping, hashes, sums = _stored(n)
    slots = _slots(mapping, hashes, sums)
    started: list[int] = []

    def slow(_blocks: int) -> None:
        started.append(threading.get_ident())
        time.sleep(0.3 * len(started))  # the parts end at different times

    copy_path.watch(slow)
    dests = [bytearray(BLOCK) for _ in hashes]
    task = asyncio.ensure_future(slots.copy([("L", 0, h) for h in hashes], [memoryview(d) for d in dests]))
    while len(started) < COPY_THREADS:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = [bytes(d) for d in dests]
    await asyncio.sleep(0.8)
    assert [bytes(d) for d in dests] == after, "bytes landed in the caller's buffers after the copy was cancelled"
    assert len(started) == COPY_THREADS, "a part was started after the copy was cancelled"
    if copy_path.native:  # a share stops claiming blocks (a Python chunk, once begun, is copied whole)
        assert after != [bytes(mapping.slot(i * BLOCK, BLOCK)) for i in range(n)], "the cancel stopped nothing"


async def test_a_copy_whose_keys_and_views_cannot_be_made_reports_the_error_and_copies_nothing() -> None:
    mapping, hashes, sums = _stored(1)
    slots = _slots(mapping, hashes, sums)

    def broken() -> Any:
        raise RuntimeError("no views")

    copy = slots.start_copy(1, BLOCK, broken)
    with pytest.raises(RuntimeError, match="no views"):
        copy.done.result(timeout=30)
    dest = bytearray(BLOCK)
    missing = slots.start_copy(1, BLOCK, lambda: ([("L", 0, b"\x09" * 32)], [memoryview(dest)]))  # not leased
    assert missing.done.result(timeout=30) is False
    wrong_count = slots.start_copy(2, 2 * BLOCK, lambda: ([("L", 0, hashes[0])], [memoryview(dest)]))
    assert wrong_count.done.result(timeout=30) is False
    assert dest == bytearray(BLOCK)


async def test_a_load_in_any_key_order_across_leaves_and_shards_gets_each_keys_own_slot() -> None:
    small, shards = 4096, 2  # small blocks: copied and verified on the loop
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    leaves = ("A", "B")
    mapping = FakeMapping(len(leaves) * len(hashes) * shards * small)
    raw, where = {}, {}
    for n, leaf in enumerate(leaves):
        offsets, sums = [], []
        for i, h in enumerate(hashes):
            for shard in range(shards):
                offset = ((n * len(hashes) + i) * shards + shard) * small
                mapping.data[offset:offset + small] = bytes([offset // small + 3]) * small
                offsets.append(offset)
                sums.append(block_checksum(leaf, shard, h, mapping.slot(offset, small)))
                where[(leaf, shard, h)] = offset
        raw[leaf] = [array("q", offsets).tobytes(), array("q", [small] * len(offsets)).tobytes(), b"".join(sums)]
    slots = LeaseSlots(mapping, hashes, shards, raw, live_until=time.monotonic() + 60)
    keys = [("B", 1, hashes[2]), ("A", 0, hashes[0]), ("B", 0, hashes[0]), ("A", 1, hashes[2]), ("A", 1, hashes[1])]
    dests = [bytearray(small) for _ in keys]
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is True
    assert [bytes(d) for d in dests] == [bytes(mapping.slot(where[k], small)) for k in keys]

    assert await slots.copy([("A", shards, hashes[0])], [memoryview(dests[0])]) is False  # no such shard
    assert await slots.copy([("C", 0, hashes[0])], [memoryview(dests[0])]) is False  # no such leaf
    assert await slots.copy([keys[0]], [memoryview(bytearray(small - 1))]) is False  # not the slot's size
    assert await slots.copy([], []) is True
    mapping.data[where[keys[3]] + 7] ^= 0xFF  # one block among several changed under the lease
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is False


@pytest.mark.parametrize("few", [True, False], ids=["a-step-per-key", "array-passes"])
async def test_blocks_sent_with_a_lookup_s_answer_are_mapped_in_the_wire_s_order_and_a_bad_one_is_not_copied(
        few: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not few:
        monkeypatch.setattr(lease_slots, "FEW_KEYS", 0)
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    shards = 2
    masks = {"B": [True, False, True, True], "A": [False, True, True, False]}  # leaf order as asked: B, then A
    sent, sizes, sums, good = [], [], [], []
    for leaf, mask in masks.items():  # leaf by leaf, hash by hash where set, shard by shard
        for i in (i for i, held in enumerate(mask) if held):
            for shard in range(shards):
                size = 1000 + 10 * len(sent)  # every block its own size and bytes
                block = bytes([len(sent) + 1]) * size
                sent.append(((leaf, shard, hashes[i]), block))
                sizes.append(size)
                sums.append(block_checksum(leaf, shard, hashes[i], block))
                good.append(not (leaf == "B" and i == 2 and shard == 1))  # this one failed as it landed
    buffer = bytearray(b"".join(block for _, block in sent))
    slots = LeaseSlots.received_with_lookup(lease_slots.ReceivedBlocks(buffer), hashes, shards, masks, sizes, sums,
                                            good)
    assert slots.received and slots.live_until == float("inf")
    order = list(range(len(sent)))
    random.Random(3).shuffle(order)
    keys = [sent[k][0] for k in order if good[k]]
    dests = [bytearray(sizes[k]) for k in order if good[k]]
    assert await slots.copy(keys, [memoryview(d) for d in dests]) is True
    assert [bytes(d) for d in dests] == [sent[k][1] for k in order if good[k]]

    bad = good.index(False)
    assert await slots.copy([sent[bad][0]], [memoryview(bytearray(sizes[bad]))]) is False  # never copied
    assert await slots.copy([("B", 0, hashes[1])], [memoryview(bytearray(sizes[0]))]) is False  # not sent
    assert await slots.copy([("A", 0, hashes[0])], [memoryview(bytearray(sizes[0]))]) is False  # not sent


def test_the_map_of_a_few_blocks_sent_with_an_answer_is_the_array_passes_map() -> None:
    """A few blocks sent with a lookup's answer are mapped a Python step each; on any masks, sizes and verdicts, the same bytes."""
    rng = random.Random(11)
    for _ in range(2000):
        hashes, shards = rng.randint(1, 4), rng.randint(1, 2)
        leaves = rng.sample(["A", "B", "C"], rng.randint(1, 3))
        masks = {leaf: [rng.random() < 0.6 for _ in range(hashes)] for leaf in leaves}
        sent = sum(map(sum, masks.values())) * shards
        sizes = [rng.choice([0, 5, 4096, 65536]) for _ in range(sent)]
        sums = [rng.randbytes(16) for _ in range(sent)]
        good = [rng.random() < 0.8 for _ in range(sent)]
        few = lease_slots._received_map_few(hashes * shards, shards, masks, sizes, sums, good)
        passes = lease_slots._received_map_arrays(hashes * shards, shards, masks, sizes, sums, good)
        assert ({leaf: [bytes(column) for column in entry] for leaf, entry in few.items()}  # (packed bytes)
                == {leaf: [column.tobytes() for column in entry] for leaf, entry in passes.items()})


def test_a_few_keys_are_planned_one_step_each_with_the_same_answer_as_the_array_passes() -> None:
    """Small loads skip numpy (``_plan_few``); on any keys, valid or not, both plans agree."""
    rng = random.Random(7)
    small, shards = 4096, 2
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    leaves = ("A", "B")
    mapping = FakeMapping(len(leaves) * len(hashes) * shards * small)
    raw = {}
    for n, leaf in enumerate(leaves):
        offsets = [((n * len(hashes) + i) * shards + s) * small for i in range(len(hashes)) for s in range(shards)]
        offsets[3] = -1  # a block the lookup reported absent on that shard
        offsets[5] = mapping.size - small // 2  # a slot that would run past the mapping
        sums = [bytes([n, i]) * 8 for i in range(len(offsets))]
        raw[leaf] = [array("q", offsets).tobytes(), array("q", [small] * len(offsets)).tobytes(), b"".join(sums)]
    slots = LeaseSlots(mapping, hashes, shards, raw, live_until=time.monotonic() + 60)
    slots._index = {h: i for i, h in enumerate(hashes)}
    outcomes = set()
    for _ in range(3000):
        n = rng.randint(1, FEW_KEYS)
        keys = [(rng.choice(("A", "B", "A", "B", "C")), rng.choice((0, 1, 0, 1, 2, -1)), rng.choice(hashes))
                for _ in range(n)]
        sizes = [rng.choice((small, small, small, small - 1)) for _ in keys]
        rows = [slots._index[k[2]] for k in keys]
        few, arrays = slots._plan_few(keys, sizes, rows), slots._plan_arrays(keys, sizes, rows)
        assert few == arrays, (keys, sizes)
        outcomes.add(few is None)
    assert outcomes == {True, False}, "both plannable and refused loads were drawn"
    assert slots._plan([("B", 0, hashes[1])], [small]) == ([((1 * 4 + 1) * 2 + 0) * small], bytes([1, 2]) * 8)
    assert slots._plan([("B", 1, hashes[2])], [small]) is None  # its slot runs past the mapping


def test_a_load_of_the_leases_own_prefix_is_planned_by_slicing_with_the_same_answer() -> None:
    """``load_lookup``'s usual shape (one leaf, one shard, the looked-up hashes in order) skips the per-key gather.

    On random loads near that shape, valid or not, the prefix plan either
    declines (``False``: not a prefix) or agrees with the array passes.
    """
    rng = random.Random(11)
    small, count = 4096, 40
    hashes = [bytes([i + 1]) * 32 for i in range(count)]
    mapping = FakeMapping(count * small)
    offsets = [i * small for i in range(count)]
    offsets[30] = -1  # a block the lookup reported absent
    offsets[35] = mapping.size - small // 2  # a slot that would run past the mapping
    sums = [bytes([i]) * 16 for i in range(count)]
    raw = {"A": [array("q", offsets).tobytes(), array("q", [small] * count).tobytes(), b"".join(sums)]}
    slots = LeaseSlots(mapping, tuple(hashes), 1, raw, live_until=time.monotonic() + 60)
    index = {h: i for i, h in enumerate(hashes)}
    taken = {"planned": 0, "refused": 0, "declined": 0}
    for _ in range(2000):
        n = rng.randint(FEW_KEYS + 1, count)
        keys = [("A", 0, h) for h in hashes[:n]]
        sizes = [small] * n
        change = rng.choice(("none", "none", "leaf", "shard", "size", "order", "foreign"))
        at = rng.randrange(n)
        if change == "leaf":
            keys[at] = ("B", 0, keys[at][2])
        elif change == "shard":
            keys[at] = ("A", rng.choice((1, -1)), keys[at][2])
        elif change == "size":
            sizes[at] = small - 1
        elif change == "order" and n > 1:
            keys[0], keys[-1] = keys[-1], keys[0]
        elif change == "foreign":
            keys[at] = ("A", 0, b"\xee" * 32)
        prefix = slots._plan_prefix(keys, sizes)
        if prefix is False:
            taken["declined"] += 1
            assert change in ("leaf", "order", "foreign")
            continue
        rows = [index[k[2]] for k in keys]
        assert prefix == slots._plan_arrays(keys, sizes, rows), (change, n, at)
        assert slots._plan(keys, sizes) == prefix
        taken["planned" if prefix is not None else "refused"] += 1
    assert all(taken.values()), taken
    whole = slots._plan([("A", 0, h) for h in hashes[:20]], [small] * 20)
    assert whole == (offsets[:20], b"".join(sums[:20]))


def _run_of(hashes: list[bytes], ids: list[int], rows: bytearray, *, leaf: str = "L", shard: int = 0) -> RowRun:
    return RowRun(leaf, shard, hashes, ids, memoryview(rows), BLOCK)


async def test_a_load_into_rows_of_the_leases_own_prefix_is_copied_from_the_slot_map_alone() -> None:
    if lease_slots._native_rows_copy is None:
        pytest.skip("the native checked copy is not built (test_checked_copy.py fails for that)")
    mapping, hashes, sums = _stored(3)
    slots = _slots(mapping, hashes, sums)
    rows = bytearray(5 * BLOCK)
    run = _run_of(hashes[:2], [4, 1], rows)
    assert slots.copy_rows_here(run) is True
    assert rows[4 * BLOCK:5 * BLOCK] == mapping.slot(0, BLOCK) and rows[BLOCK:2 * BLOCK] == mapping.slot(BLOCK, BLOCK)

    def no_keys() -> Any:
        raise AssertionError("the keys and views were made for a load the slot map alone copies")

    copy = slots.start_copy(3, 3 * BLOCK, no_keys, _run_of(hashes, [0, 2, 3], rows))
    assert copy.done.result(timeout=30) is True
    assert rows[3 * BLOCK:4 * BLOCK] == mapping.slot(2 * BLOCK, BLOCK)
    mapping.data[BLOCK + 9] ^= 0xFF  # the second slot reused meanwhile
    assert slots.copy_rows_here(run) is False
    assert slots.start_copy(3, 3 * BLOCK, no_keys, _run_of(hashes, [0, 2, 3], rows)).done.result(timeout=30) is False


def test_a_load_into_rows_that_is_not_the_leases_own_prefix_is_left_to_the_keyed_plan() -> None:
    mapping, hashes, sums = _stored(3)
    slots = _slots(mapping, hashes, sums)
    rows = bytearray(4 * BLOCK)
    for run in (_run_of([hashes[1], hashes[0]], [1, 2], rows),  # out of order
                _run_of([hashes[0], b"\x09" * 32], [1, 2], rows),  # a hash the lease does not hold
                _run_of(hashes[:1], [1], rows, leaf="M"),  # a leaf it does not hold
                _run_of(hashes[:1], [1], rows, shard=1),
                _run_of([], [], rows)):
        assert slots.rows_copy(run) is None and slots.copy_rows_here(run) is None
    two_shards = LeaseSlots(mapping, hashes[:1], 2, {"L": [array("q", [0, BLOCK]).tobytes(),
                                                             array("q", [BLOCK] * 2).tobytes(), sums[0] + sums[1]]},
                            live_until=time.monotonic() + 60)
    assert two_shards.rows_copy(_run_of(hashes[:1], [1], rows)) is None
    assert rows == bytearray(4 * BLOCK)
