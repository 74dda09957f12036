"""The leased lookup's per-key run: the native build and its Python twin do the same, output for output.

Each case builds two identical stores of blocks (one per twin, since a run
changes pins), runs both twins over them, and compares everything a run
returns or changes: where it stopped, the mask, the blocks held (by position),
the depths, the tally of newly pinned blocks, the packed slot map and every
block's pins afterwards.
"""

from __future__ import annotations

import copy
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dkv.store as dkv_store
from dkv import store_runs
from dkv.arena import Arena
from dkv.disk_tier import DiskTier
from dkv.store import Block, Store, StoreKey

NS, LEAF = "ns", "L"

native = pytest.mark.skipif(not store_runs.NATIVE, reason="the native index is not built (see the test below)")


def test_the_native_store_index_is_built() -> None:
    assert store_runs.NATIVE and store_runs.pin_run is not store_runs.pin_run_python, (
        "dkv._store_index was not built: install a C compiler, then `pip install -e .` again "
        "(scripts/run.sh does both)")


def _hash(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _blocks(specs: list[tuple[int, int, int, bool]]) -> dict[Any, Block]:
    """One block per spec ``(offset, size, pins, has_checksum)``, hashed ``_hash(i)``."""
    out = {}
    for i, (offset, size, pins, summed) in enumerate(specs):
        key = StoreKey(NS, LEAF, 0, _hash(i))
        out[key] = Block(key, size, offset, pins=pins, checksum=bytes([i % 251, 7]) * 8 if summed else None)
    return out


def _column(blocks: dict[Any, Block]) -> dict[bytes, Block]:
    """``blocks`` (all of ``NS``, ``LEAF``, shard 0) as the store's column index holds them: by hash."""
    return {key.hash: block for key, block in blocks.items()}


def _run(run: Any, blocks: dict, hashes: list[bytes], start: int, slots: bool) -> dict[str, Any]:
    mask: list[bool] = []
    held: list[Block] = []
    depths: list[int] = []
    tally = [5]  # a count the caller already had: the run adds to it
    packed = (bytearray(b"o"), bytearray(b"s"), bytearray(b"c")) if slots else (None, None, None)
    stop = run(_column(blocks), hashes, start, mask, held, depths, tally, *packed)
    order = list(blocks.values())
    return {
        "stop": stop, "mask": mask, "held": [order.index(b) for b in held], "depths": depths, "tally": tally,
        "packed": [bytes(p) for p in packed] if slots else None, "pins": [b.pins for b in order],
    }


# offsets: mostly on the host tier (-1, off it, stops a run); sizes up to the store's largest block
block_specs = st.lists(st.tuples(st.sampled_from([-1, 0, 4096, 8192, 65536, 1 << 40]), st.integers(1, 1 << 28),
                                 st.integers(0, 3), st.booleans()), min_size=0, max_size=24)


@native
@settings(max_examples=300, deadline=None)
@given(specs=block_specs, picks=st.lists(st.integers(0, 30), max_size=40),
       start=st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 40)),
       slots=st.booleans())
def test_both_twins_pin_map_and_stop_alike_over_any_store(specs: list, picks: list[int], start: int,
                                                          slots: bool) -> None:
    hashes = [_hash(i) for i in picks]  # indexes past the specs are absent; repeats pin twice
    start = min(start, len(hashes))
    blocks = _blocks(specs)
    twin = copy.deepcopy(blocks)
    native_out = _run(store_runs.pin_run, blocks, hashes, start, slots)
    python_out = _run(store_runs.pin_run_python, twin, hashes, start, slots)
    assert native_out == python_out
    stop = native_out["stop"]
    assert start <= stop <= len(hashes)
    assert len(native_out["mask"]) == stop - start
    if slots:  # one entry per hash seen, after what the buffers held
        offsets, sizes, sums = native_out["packed"]
        assert (len(offsets) - 1, len(sizes) - 1, len(sums) - 1) == (8 * (stop - start),) * 2 + (16 * (stop - start),)
        assert all(o == -1 or o >= 0 for o in array("q", offsets[1:]))


def _shard_blocks(specs: list[list[tuple[int, int, bool] | None]]) -> dict[Any, Block]:
    """Per hash ``_hash(i)``, per shard: ``(offset, pins, has_checksum)``, or None where that shard is absent."""
    out = {}
    for i, shard_specs in enumerate(specs):
        for s, spec in enumerate(shard_specs):
            if spec is not None:
                offset, pins, summed = spec
                key = StoreKey(NS, LEAF, s, _hash(i))
                out[key] = Block(key, 100 + s, offset, pins=pins, checksum=bytes([i % 251, s]) * 8 if summed else None)
    return out


shard_specs = st.integers(2, 4).flatmap(lambda shards: st.tuples(st.just(shards), st.lists(
    st.lists(st.one_of(st.none(), st.tuples(st.sampled_from([-1, 0, 4096, 8192, 65536]), st.integers(0, 2),
                                            st.booleans())), min_size=shards, max_size=shards),
    max_size=12)))


@native
@settings(max_examples=300, deadline=None)
@given(spec=shard_specs, picks=st.lists(st.integers(0, 14), max_size=20),
       start=st.one_of(st.just(0), st.integers(0, 20)), known=st.lists(st.integers(0, 60), max_size=4))
def test_both_twins_of_the_shard_run_pin_and_stop_alike(spec: tuple, picks: list[int], start: int,
                                                       known: list[int]) -> None:
    shards, specs = spec
    hashes = [_hash(i) for i in picks]
    start = min(start, len(hashes))
    outs = []
    for run in (store_runs.pin_run_shards, store_runs.pin_run_shards_python):
        blocks = _shard_blocks(specs)
        order = list(blocks)
        pinned = {order[k]: -1 for k in known if k < len(order)}  # keys an earlier run already pinned
        mask: list[bool] = []
        tally = [3]
        stop = run(blocks, NS, LEAF, hashes, shards, start, mask, pinned, tally)
        outs.append((stop, mask, [(order.index(k), d) for k, d in pinned.items()], tally,
                     [b.pins for b in blocks.values()]))
    assert outs[0] == outs[1]
    stop, mask = outs[0][0], outs[0][1]
    assert start <= stop <= len(hashes) and len(mask) == stop - start


@native
@settings(max_examples=200, deadline=None)
@given(spec=shard_specs, picks=st.lists(st.integers(0, 14), max_size=20), cover=st.lists(st.booleans(), max_size=60))
def test_both_twins_of_the_slot_map_write_the_same_packed_entries(spec: tuple, picks: list[int],
                                                                  cover: list[bool]) -> None:
    shards, specs = spec
    blocks = _shard_blocks(specs)
    covered = {k: 0 for k, c in zip(blocks, cover) if c}
    hashes = [_hash(i) for i in picks]
    outs = []
    for run in (store_runs.slot_map, store_runs.slot_map_python):
        packed = (bytearray(b"o"), bytearray(b"s"), bytearray(b"c"))
        run(blocks, covered, NS, LEAF, hashes, shards, *packed)
        outs.append([bytes(p) for p in packed])
    assert outs[0] == outs[1]
    offsets = array("q", outs[0][0][1:])
    assert len(offsets) == len(hashes) * shards
    for j, offset in enumerate(offsets):  # an entry only where the key is covered and copyable
        key = (NS, LEAF, j % shards, hashes[j // shards])
        block = blocks.get(key)  # type: ignore[call-overload]
        copyable = key in covered and block is not None and block.checksum is not None and block.offset >= 0
        assert offset == (block.offset if copyable else -1)


@native
def test_a_run_stops_at_a_block_off_the_host_and_leaves_it_alone() -> None:
    blocks = _blocks([(0, 10, 0, True), (-1, 10, 0, True), (8192, 10, 1, False)])
    out = _run(store_runs.pin_run, blocks, [_hash(0), _hash(1), _hash(2)], 0, True)
    assert out["stop"] == 1 and out["mask"] == [True] and out["pins"] == [1, 0, 1] and out["tally"] == [6]
    out = _run(store_runs.pin_run, blocks, [_hash(0), _hash(1), _hash(2), _hash(9)], 2, True)
    assert out["stop"] == 4 and out["mask"] == [True, False] and out["pins"] == [1, 0, 2] and out["tally"] == [5]
    offsets, sizes, sums = out["packed"]
    assert list(array("q", offsets[1:])) == [-1, -1] and list(array("q", sizes[1:])) == [0, 0]  # no checksum: -1
    assert sums[1:] == bytes(32)


@native
@pytest.mark.parametrize("bad", ["checksum", "type"])
def test_a_bad_entry_midway_raises_with_every_pin_taken_so_far_held_and_counted(bad: str) -> None:
    blocks = _blocks([(0, 10, 0, True), (4096, 10, 2, True), (8192, 10, 0, True)])
    key = list(blocks)[2]
    if bad == "checksum":
        blocks[key].checksum = b"short"
    else:
        blocks[key] = object()  # type: ignore[assignment]
    mask: list[bool] = []
    held: list[Block] = []
    depths: list[int] = []
    tally = [0]
    with pytest.raises(TypeError):
        store_runs.pin_run(_column(blocks), [_hash(0), _hash(1), _hash(2)], 0, mask, held, depths, tally,
                           bytearray(), bytearray(), bytearray())
    first, second = list(blocks.values())[:2]
    assert held == [first, second] and depths == [0, 1] and (first.pins, second.pins) == (1, 3)
    assert tally == [1]  # only the first went from 0 to 1
    assert store_runs.unpin_all(held) == 1 and (first.pins, second.pins) == (0, 2)


@native
@pytest.mark.parametrize("args", [
    ("not a dict", [], 0, [], [], [], [0], None, None, None),
    ({}, [], 0, [], [], [], [], None, None, None),  # no tally
    ({}, [], 0, [], [], [], [0], bytearray(), None, None),  # one buffer of three
    ({}, [], 1, [], [], [], [0], None, None, None),  # start past the end
    ({}, 7, 0, [], [], [], [0], None, None, None),  # hashes not a sequence
    ({}, [], 0, [], [], [], [0], None, None),  # an argument short
])
def test_malformed_arguments_are_refused_before_anything_is_pinned(args: tuple) -> None:
    with pytest.raises((TypeError, ValueError)):
        store_runs.pin_run(*args)


@native
def test_a_slot_buffer_that_cannot_grow_is_an_error_before_anything_is_pinned() -> None:
    blocks = _blocks([(0, 10, 0, True)])
    offsets = bytearray()
    view = memoryview(offsets)  # someone holds a view of it: it cannot be resized
    held: list[Block] = []
    tally = [0]
    with pytest.raises(BufferError):
        store_runs.pin_run(_column(blocks), [_hash(0)], 0, [], held, [], tally, offsets, bytearray(), bytearray())
    view.release()
    assert held == [] and tally == [0] and next(iter(blocks.values())).pins == 0


@native
def test_unpin_all_checks_every_entry_before_it_changes_any() -> None:
    blocks = list(_blocks([(0, 10, 2, True), (4096, 10, 0, True)]).values())
    with pytest.raises(ValueError):
        store_runs.unpin_all(blocks)  # the second holds no pin
    assert [b.pins for b in blocks] == [2, 0]
    with pytest.raises(TypeError):
        store_runs.unpin_all([blocks[0], "not a block"])
    assert blocks[0].pins == 2
    twin = copy.deepcopy(blocks[:1]) * 2
    assert store_runs.unpin_all([blocks[0], blocks[0]]) == store_runs.unpin_all_python(twin) == 1
    assert blocks[0].pins == twin[0].pins == 0


@native
def test_pin_all_checks_every_entry_before_it_changes_any_and_counts_the_newly_pinned() -> None:
    blocks = list(_blocks([(0, 10, 2, True), (4096, 10, 0, True), (8192, 10, 0, True)]).values())
    with pytest.raises(TypeError):
        store_runs.pin_all([blocks[1], "not a block"])
    with pytest.raises(TypeError):
        store_runs.pin_all((blocks[1],))  # a list, nothing else
    assert [b.pins for b in blocks] == [2, 0, 0]
    twin = copy.deepcopy(blocks)
    listed = [blocks[0], blocks[1], blocks[1]]  # the second twice: two pins, counted once as newly pinned
    assert store_runs.pin_all(listed) == store_runs.pin_all_python([twin[0], twin[1], twin[1]]) == 1
    assert [b.pins for b in blocks] == [b.pins for b in twin] == [3, 2, 0]
    assert store_runs.unpin_all(listed) == 1 and [b.pins for b in blocks] == [2, 0, 0]


def _stamped(blocks: dict[Any, Block]) -> list[tuple[int, int, int]]:
    return [(b.stamp, b.depth, b.order) for b in blocks.values()]


@native
@settings(max_examples=300, deadline=None)
@given(specs=block_specs, picks=st.lists(st.integers(0, 30), max_size=40),
       depths=st.lists(st.one_of(st.integers(0, 5000), st.integers(0, 1 << 70)), min_size=40, max_size=40),
       rising=st.booleans(), gone=st.sets(st.integers(0, 30)),
       tenants=st.lists(st.sampled_from(["", "t1", "t2"]), min_size=31, max_size=31), order=st.integers(1, 1 << 40))
def test_both_twins_stamp_alike_over_any_store(specs: list, picks: list[int], depths: list[int], rising: bool,
                                               gone: set[int], tenants: list[str], order: int) -> None:
    """Stamps, depths, orders and recency entries alike; blocks no longer indexed (or replaced) left alone.

    ``rising``: depths in rising order, as a lookup finds its blocks (the native run then reverses its lists
    instead of sorting them); else any depths, small (kept negated) and beyond a C long.
    """
    if rising:
        depths = sorted(set(depths))
        depths += [depths[-1] + 1 + i for i in range(40 - len(depths))]
    made = _blocks(specs)
    for i, block in enumerate(made.values()):
        block.tenant = tenants[i]
        block.indexed = i not in gone  # (gone: evicted, cleared or replaced since)
    objects = list(made.values())
    held = [objects[i] for i in picks if i < len(objects)]  # repeats stamp twice, as the Python loop did
    twin_objects = copy.deepcopy(objects)
    twin_of = {id(a): b for a, b in zip(objects, twin_objects)}
    twin_held = [twin_of[id(b)] for b in held]
    native_next, entries = store_runs.stamp_run(held, depths[:len(held)], 99, order)
    python_next, twin_entries = store_runs.stamp_run_python(twin_held, depths[:len(held)], 99, order)
    assert native_next == python_next
    assert entries == twin_entries  # (blocks compared field by field: each twin's own)
    assert all(made == sorted(made) for made in entries.values())  # (appended to a heap as they come)
    assert [(b.stamp, b.depth, b.order) for b in objects] == [(b.stamp, b.depth, b.order) for b in twin_objects]
    stamped = [b for b in held if b.indexed]
    assert native_next == order + len(stamped)
    assert all(b.stamp == 0 for b in objects if not b.indexed)  # not in the index: never stamped
    assert sum(map(len, entries.values())) == sum(1 for b in stamped if b.offset >= 0)
    assert all(entry[3] in stamped for made in entries.values() for entry in made)  # the blocks themselves


@native
@settings(max_examples=200, deadline=None)
@given(specs=block_specs, entries=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3)), max_size=40))
def test_both_twins_keep_the_same_live_recency_entries(specs: list, entries: list[tuple[int, int]]) -> None:
    blocks = list(_blocks(specs).values())
    for i, block in enumerate(blocks):
        block.order, block.indexed = i % 4, i % 3 != 2
    heap = [(7, -i, order, blocks[i]) for i, order in entries if i < len(blocks)]
    live = store_runs.live_entries(heap)
    assert live == store_runs.live_entries_python(heap)
    assert all(e[3].indexed and e[3].offset >= 0 and e[3].order == e[2] for e in live)
    assert len(heap) - len(live) == sum(1 for e in heap if not (e[3].indexed and e[3].offset >= 0
                                                                  and e[3].order == e[2]))


@native
def test_stamp_run_checks_every_entry_before_it_stamps_any() -> None:
    blocks = _blocks([(0, 10, 0, True), (4096, 10, 0, True)])
    held = list(blocks.values())
    for block in held:
        block.indexed = True
    with pytest.raises(TypeError):
        store_runs.stamp_run([held[0], "not a block"], [1, 2], 5, 1)
    with pytest.raises(TypeError):
        store_runs.stamp_run(held, [1, "two"], 5, 1)
    with pytest.raises(TypeError):
        store_runs.stamp_run(held, [1], 5, 1)  # a depth short
    with pytest.raises(TypeError):
        store_runs.stamp_run(tuple(held), [1, 2], 5, 1)  # not a list
    assert _stamped(blocks) == [(0, 0, 0), (0, 0, 0)]
    with pytest.raises(TypeError):
        store_runs.live_entries([(1, 2, 3)])  # not an entry
    with pytest.raises(TypeError):
        store_runs.live_entries([(1, 2, 3, "not a block")])


@native
def test_bind_takes_only_a_type_whose_fields_are_writable_slots() -> None:
    from dkv import _store_index

    class Plain:
        offset = size = pins = checksum = 0

    with pytest.raises(TypeError):
        _store_index.bind(Plain)
    with pytest.raises(TypeError):
        _store_index.bind(Block(StoreKey(NS, LEAF, 0, _hash(0)), 1, 0))
    _store_index.bind(Block)  # the store's own binding stands


@native
@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("staged", [False, True])
def test_a_store_lookup_answers_alike_on_either_twin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     staged: bool, shards: int) -> None:
    """Whole leased lookups (promotions from staging among them) give the same masks, pins and slot maps."""
    runs = iter(range(2))

    def lookups() -> list[Any]:
        arena = Arena(8 * 4096, label="twins")
        try:  # with a disk tier, evicted blocks wait in staging, and a lookup promotes them between runs
            disk = DiskTier(str(tmp_path / f"disk{next(runs)}"), 32 * 4096) if staged else None
            store = Store(arena, disk)
            # more than the pool holds (some are evicted); with shards, hash 5 lacks its last shard
            keys = [StoreKey(NS, LEAF, s, _hash(i)) for i in range(12 // shards) for s in range(shards)
                    if not (shards > 1 and i == 5 and s == shards - 1)]
            for i, key in enumerate(keys):
                res, _ = store.reserve("w", [key], [4096], [bytes([i]) * 16])
                store.commit(res.write_id, "w")
            hashes = list(dict.fromkeys(k.hash for k in keys))
            asked = hashes + [_hash(99), hashes[3]]
            out = []
            for group in range(2):
                slots: dict = {}
                masks, lease = store.lookup(NS, asked, [LEAF], shards, owner="c", group=group, slots=slots)
                out.append((masks, slots, lease.depths if lease else None, store.pinned_blocks,
                            sorted((b.key.hash, b.key.shard, b.pins) for b in store.blocks.values())))
            store.end_lease(store._group_lease[("c", 0)])
            out.append((store.pinned_blocks, store.counters.disk_hits))
            by_column: dict = {}  # spills, promotions and evictions kept the column index whole
            for key, block in store.blocks.items():
                by_column.setdefault(key[:3], {})[key.hash] = block
            assert store.columns == by_column
            return out
        finally:
            arena.close()

    native_answers = lookups()
    for name in ("pin_run", "pin_run_shards", "slot_map", "pin_all", "unpin_all", "stamp_run", "live_entries"):
        monkeypatch.setattr(dkv_store, name, getattr(store_runs, f"{name}_python"))
    assert lookups() == native_answers
    assert any(native_answers[0][0][LEAF]) and not all(native_answers[0][0][LEAF])
    assert (native_answers[-1][1] > 0) == staged  # promotions happened where blocks were staged
