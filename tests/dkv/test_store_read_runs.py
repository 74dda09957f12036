"""A read named by runs of places in its lease's lookup reads exactly what the same keys read.

Store logic, with the client's own translation of keys into runs
(``dkv.client._places``, and ``_run_places`` of a load's row runs): for any lookup (one or two leaves, one or two
shards, absent hashes, a hash named twice) and any choice of the blocks it
found, in any order, the read by runs pins and returns the same blocks as
the read by keys. A place the lease does not hold is refused as an
uncovered key is, with nothing pinned. The node-level tests are in
``test_node_read_runs.py``.
"""

from __future__ import annotations

import tests.hypothesis_profiles  # noqa: F401  (first: loads the fuzz profile)

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dkv.arena import Arena
from dkv.client import _places, _run_places
from dkv.errors import LeaseExpired
from dkv.lease_slots import RowRun
from dkv.store import Store, StoreKey
from tests.dkv.conftest import Clock
from tests.dkv.test_store import BLOCK, NS, chain, keys, put
from tests.hypothesis_profiles import examples

POOL_BLOCKS = 64


@pytest.fixture
def big_store() -> Iterator[Store]:
    arena = Arena(POOL_BLOCKS * BLOCK, label="unit")
    yield Store(arena, clock=Clock(), lease_ttl=10.0)
    arena.close()


def _plan(read) -> list[tuple[int, int, bytes | None]]:
    return list(zip(read.offsets, read.sizes, read.checksums))


def _row_runs(wanted: list[tuple[str, int, bytes]]) -> list[RowRun]:
    """``wanted`` as a load's row runs: each stretch of one leaf and shard one run (rows and ids play no part)."""
    runs: list[RowRun] = []
    for leaf, shard, block_hash in wanted:
        if runs and (runs[-1].leaf, runs[-1].shard) == (leaf, shard):
            runs[-1].hashes.append(block_hash)
        else:
            runs.append(RowRun(leaf, shard, [block_hash], [], bytearray(BLOCK), BLOCK))
    return runs


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data(), leaves=st.sampled_from([["L"], ["L", "M"]]), shards=st.sampled_from([1, 2]),
       count=st.integers(1, 10))
def test_a_read_by_runs_reads_exactly_what_the_same_keys_read(data: st.DataObject, leaves: list[str], shards: int,
                                                             count: int) -> None:
    arena = Arena(POOL_BLOCKS * BLOCK, label="unit")
    try:
        store = Store(arena, clock=Clock(), lease_ttl=10.0)
        hashes = chain(count, b"h")
        if count > 2 and data.draw(st.booleans(), label="a hash named twice"):
            hashes[-1] = hashes[0]
        stored = data.draw(st.lists(st.booleans(), min_size=count, max_size=count), label="stored")
        for leaf in leaves:
            for shard in range(shards):
                put(store, keys([h for h, s in zip(hashes, stored) if s], leaf, shard))
        masks, lease = store.lookup(NS, hashes, leaves, shards, owner="c")
        found = [(leaf, shard, h) for leaf in leaves for shard in range(shards)
                 for h, present in zip(hashes, masks[leaf]) if present]
        if lease is None:
            assert not found
            return
        wanted = data.draw(st.lists(st.sampled_from(found), min_size=1, max_size=len(found), unique=True),
                           label="read")
        if data.draw(st.booleans(), label="in lookup order"):
            wanted.sort(key=found.index)
        runs = _places(wanted, hashes, shards)
        assert runs is not None  # every key is among the lookup's hashes
        by_keys = store.begin_read(lease.lease_id, "c", [StoreKey(NS, *k) for k in wanted], reader="r")
        by_runs = store.begin_read(lease.lease_id, "c", runs=runs, reader="r")
        assert _plan(by_runs) == _plan(by_keys)
        row_runs = _run_places(_row_runs(wanted), hashes, shards)  # (a direct read's: from its rows' runs)
        assert row_runs is not None
        by_row_runs = store.begin_read(lease.lease_id, "c", runs=row_runs, reader="r")
        assert _plan(by_row_runs) == _plan(by_keys)
        assert store.end_read(by_runs.read_id) and store.end_read(by_keys.read_id)
        assert store.end_read(by_row_runs.read_id)
    finally:
        arena.close()


@pytest.mark.parametrize("shards", [1, 2])
def test_keys_of_one_leaf_and_shard_at_consecutive_places_are_one_run(shards: int) -> None:
    hashes = chain(6, b"c")
    wanted = [("L", 0, h) for h in hashes[2:5]]
    assert _places(wanted, hashes, shards) == [["L", 0, 2, 5]]
    assert _places([("L", 0, hashes[4]), ("L", 0, hashes[3])], hashes, shards) == [["L", 0, 4, 5], ["L", 0, 3, 4]]
    assert _places([("L", 0, hashes[0]), ("L", 1, hashes[1])], hashes, shards) == [["L", 0, 0, 1], ["L", 1, 1, 2]]
    assert _places([("L", 0, b"\xff" * 8)], hashes, shards) is None  # not looked up: the read names its keys
    assert _places([("L", 0, hashes[0]), ("L", 0, b"\xff" * 8)], hashes, shards) is None
    assert _places([], hashes, shards) is None


@pytest.mark.parametrize("shards", [1, 2])
def test_a_loads_row_runs_that_are_stretches_of_its_lookup_are_one_place_run_each(shards: int) -> None:
    hashes = chain(8, b"r")
    stretch = _row_runs([("L", 0, h) for h in hashes[2:6]])
    assert _run_places(stretch, hashes, shards) == [["L", 0, 2, 6]]
    two_leaves = _row_runs([("L", 0, h) for h in hashes[:3]] + [("M", 0, h) for h in hashes[:3]])
    assert _run_places(two_leaves, hashes, shards) == [["L", 0, 0, 3], ["M", 0, 0, 3]]
    back_to_back = _row_runs([("L", 0, h) for h in hashes[:3]])
    back_to_back.append(RowRun("L", 0, hashes[3:5], [], bytearray(BLOCK), BLOCK))  # one leaf in two row runs
    assert _run_places(back_to_back, hashes, shards) == [["L", 0, 0, 5]]
    out_of_order = _row_runs([("L", 0, hashes[4]), ("L", 0, hashes[3])])
    assert _run_places(out_of_order, hashes, shards) == [["L", 0, 4, 5], ["L", 0, 3, 4]]
    assert _run_places(_row_runs([("L", 0, b"\xff" * 8)]), hashes, shards) is None  # not looked up
    assert _run_places(_row_runs([("L", 0, hashes[0]), ("L", 0, b"\xff" * 8)]), hashes, shards) is None
    assert _run_places([], hashes, shards) is None


def test_a_hash_named_twice_goes_to_a_place_the_node_holds_it_at() -> None:
    hashes = chain(4, b"d")
    hashes[3] = hashes[1]
    wanted = [("L", 0, h) for h in hashes[:3]]
    assert _places(wanted, hashes, 1) == [["L", 0, 0, 3]]  # one shard: the node holds it at both places
    assert _places(wanted, hashes, 2) == [["L", 0, 0, 1], ["L", 0, 3, 4], ["L", 0, 2, 3]]  # several: the last


@pytest.mark.parametrize("leaves", [["L"], ["L", "M"]], ids=["one leaf (bisection)", "two leaves (map)"])
@pytest.mark.parametrize("run", [
    ["L", 0, 2, 5],  # past the lookup's last place
    ["L", 0, 3, 4],  # a place whose hash was absent
    ["L", 1, 0, 1],  # a shard the lookup did not ask for
    ["X", 0, 0, 1],  # a leaf it did not ask for
    ["L", 0, 1, 1],  # an empty run
], ids=["past the end", "absent hash", "other shard", "other leaf", "empty"])
def test_a_run_the_lease_does_not_hold_is_refused_and_pins_nothing(big_store: Store, leaves: list[str],
                                                                    run: list) -> None:
    hashes = chain(4, b"r")
    for leaf in leaves:
        put(big_store, keys(hashes[:3], leaf))  # the fourth is absent
    masks, lease = big_store.lookup(NS, hashes, leaves, 1, owner="c")
    assert lease is not None and masks["L"] == [True, True, True, False]
    pinned = big_store.pinned_blocks
    with pytest.raises(LeaseExpired, match="does not hold a block"):
        big_store.begin_read(lease.lease_id, "c", runs=[["L", 0, 0, 1], run], reader="r")
    assert big_store.pinned_blocks == pinned and not big_store.reads
    assert big_store.counters.reads_refused == 1


def test_a_read_by_runs_of_another_owners_lease_is_refused(big_store: Store) -> None:
    hashes = chain(2, b"o")
    put(big_store, keys(hashes))
    _, lease = big_store.lookup(NS, hashes, ["L"], 1, owner="c")
    assert lease is not None
    with pytest.raises(LeaseExpired, match="not held"):
        big_store.begin_read(lease.lease_id, "someone else", runs=[["L", 0, 0, 2]], reader="r")


@pytest.mark.parametrize("shards", [1, 2])
def test_a_lease_holds_a_hash_named_twice_where_the_client_reads_it(big_store: Store, shards: int) -> None:
    hashes = chain(3, b"t")
    hashes[2] = hashes[0]
    for shard in range(shards):
        put(big_store, keys(hashes[:2], shard=shard))
    _, lease = big_store.lookup(NS, hashes, ["L"], shards, owner="c")
    assert lease is not None
    wanted = [("L", 0, hashes[0]), ("L", 0, hashes[1])]
    runs = _places(wanted, hashes, shards)
    by_keys = big_store.begin_read(lease.lease_id, "c", [StoreKey(NS, *k) for k in wanted], reader="r")
    by_runs = big_store.begin_read(lease.lease_id, "c", runs=runs, reader="r")
    assert _plan(by_runs) == _plan(by_keys)
    if shards == 1:  # held at both of its places
        big_store.end_read(big_store.begin_read(lease.lease_id, "c", runs=[["L", 0, 2, 3]], reader="r").read_id)
    else:  # held once, at its last place
        with pytest.raises(LeaseExpired):
            big_store.begin_read(lease.lease_id, "c", runs=[["L", 0, 0, 1]], reader="r")


@settings(max_examples=examples(150), deadline=None)
@given(leaves=st.sampled_from([["L"], ["L", "M"]]), shards=st.sampled_from([1, 2]),
       runs=st.lists(st.tuples(st.sampled_from(["L", "M", "X"]), st.integers(0, 2), st.integers(0, 12),
                               st.integers(-2, 12)).map(lambda r: [r[0], r[1], r[2], r[2] + r[3]]),
                     min_size=1, max_size=6))
def test_any_runs_read_their_blocks_or_are_refused_with_nothing_pinned(leaves: list[str], shards: int,
                                                                       runs: list[list]) -> None:
    """Whatever runs a client names (past the end, backwards, empty, other leaves or shards): the blocks at those
    places, each pinned once more by the read, or LeaseExpired and no pin changed; never another error."""
    arena = Arena(POOL_BLOCKS * BLOCK, label="unit")
    try:
        store = Store(arena, clock=Clock(), lease_ttl=10.0)
        hashes = chain(8, b"a")
        for leaf in leaves:
            for shard in range(shards):
                put(store, keys(hashes[:6], leaf, shard))  # the last two places absent
        _, lease = store.lookup(NS, hashes, leaves, shards, owner="c")
        assert lease is not None
        pins = {key: block.pins for key, block in store.blocks.items()}
        try:
            read = store.begin_read(lease.lease_id, "c", runs=runs, reader="r")
        except LeaseExpired:
            assert {key: block.pins for key, block in store.blocks.items()} == pins
            return
        wanted = [StoreKey(NS, leaf, shard, hashes[d]) for leaf, shard, first, stop in runs for d in range(first, stop)]
        assert all(leaf in leaves and shard < shards and d < 6 for leaf, shard, first, stop in runs
                   for d in range(first, stop))
        assert read.offsets == [store.blocks[k].offset for k in wanted]
        assert all(store.blocks[k].pins == pins[k] + 1 for k in set(wanted))
        assert store.end_read(read.read_id)
    finally:
        arena.close()
