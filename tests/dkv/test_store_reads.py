"""Reads pin for themselves: a read's blocks stay put until its bytes have left, whatever its lease does.

Store logic only (the node-level tests are in ``test_node_reads.py``); also the
bounds on the store's own book-keeping (expiry and recency structures).
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from dkv.errors import LeaseExpired
from dkv.store import FULL, HEAP_SLACK, WRITE, Store
from tests.dkv.conftest import Clock
from tests.dkv.test_store import BLOCK, NS, chain, keys, put


def _fill_with_other_writes(store: Store, n: int = 8) -> list[str]:
    """Try to write ``n`` fresh blocks in one write (the pool holds 8): returns their statuses."""
    return put(store, keys(chain(n, b"other")), owner="other")


def _slot_bytes(store: Store, plan) -> bytes:
    return bytes(store.arena.slot(NS, plan.offset, plan.size))


def test_next_lookup_of_the_same_group_cannot_let_a_read_be_overwritten(store: Store) -> None:
    held = keys(chain(4, b"r"))
    put(store, held)
    _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c", group=0)
    assert lease is not None
    read = store.begin_read(lease.lease_id, "c", held, reader="conn:1")
    before = [_slot_bytes(store, p) for p in read.slots]
    store.lookup(NS, chain(1, b"miss"), ["L"], 1, owner="c", group=0)  # ends the first lease
    assert lease.lease_id not in store.leases
    statuses = _fill_with_other_writes(store)
    assert statuses.count(FULL) == 4, "the read's four blocks must stay pinned"
    assert [_slot_bytes(store, p) for p in read.slots] == before
    assert store.end_read(read.read_id) is True
    assert store.pinned_blocks == 0
    assert put(store, keys(chain(8, b"more")), owner="other").count(WRITE) == 8  # unpinned now: evictable


def test_lease_ttl_passing_during_a_read_keeps_the_read_pinned(store: Store, clock: Clock) -> None:
    held = keys(chain(2, b"t"))
    put(store, held)
    _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c")
    assert lease is not None
    read = store.begin_read(lease.lease_id, "c", held, reader="conn:1")
    clock.now += 10.5  # past the lease TTL, not the read TTL
    store.expire()
    assert not store.leases
    assert all(store.blocks[k].pins == 1 for k in held)
    assert store.end_read(read.read_id) is True


def test_read_that_outlived_its_ttl_is_reported_not_intact(arena, clock: Clock) -> None:
    store = Store(arena, clock=clock, lease_ttl=10.0, read_ttl=2.0)
    held = keys(chain(2, b"x"))
    put(store, held)
    _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c")
    assert lease is not None
    read = store.begin_read(lease.lease_id, "c", held, reader="conn:1")
    store.end_lease(lease.lease_id)
    clock.now += 2.5
    store.expire()
    assert store.counters.reads_expired == 1 and store.pinned_blocks == 0
    assert store.end_read(read.read_id) is False


def test_reading_connection_that_vanishes_drops_its_read_pins(store: Store) -> None:
    held = keys(chain(2, b"v"))
    put(store, held)
    _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="client:c")
    assert lease is not None
    read = store.begin_read(lease.lease_id, "client:c", held, reader="conn:7")
    store.end_lease(lease.lease_id)
    store.drop_owner("conn:7")
    assert not store.reads and store.pinned_blocks == 0
    assert store.end_read(read.read_id) is False


def test_refused_read_pins_nothing(store: Store) -> None:
    h = chain(2, b"n")
    put(store, keys(h))
    _, lease = store.lookup(NS, h[:1], ["L"], 1, owner="c")
    assert lease is not None
    with pytest.raises(LeaseExpired):
        store.begin_read(lease.lease_id, "c", keys(h))
    assert not store.reads and store.pinned_blocks == 1  # the lease's one pin only
    store.end_lease(lease.lease_id)
    assert store.pinned_blocks == 0


def test_duplicate_keys_in_one_read_pin_once_and_unpin_once(store: Store) -> None:
    k = keys(chain(1, b"d"))
    put(store, k)
    _, lease = store.lookup(NS, [k[0].hash], ["L"], 1, owner="c")
    assert lease is not None
    read = store.begin_read(lease.lease_id, "c", k * 3)
    assert len(read.slots) == 3
    store.end_lease(lease.lease_id)
    assert store.blocks[k[0]].pins == 1
    store.end_read(read.read_id)
    assert store.blocks[k[0]].pins == 0 and store.pinned_blocks == 0


# ---- book-keeping stays bounded by what is live ----------------------------------------------


def test_recency_heap_does_not_grow_with_every_read_served(store: Store) -> None:
    held = keys(chain(4, b"h"))
    put(store, held)
    for _ in range(3000):  # 12 000 restamps of 4 live blocks
        _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c")
        assert lease is not None
        store.end_read(store.begin_read(lease.lease_id, "c", held).read_id)
        store.end_lease(lease.lease_id)
    assert store.recency_entries() <= 2 * len(store.blocks) + HEAP_SLACK + 1


def test_a_use_larger_than_its_recency_heap_keeps_it_a_heap_and_evicts_deepest_first(store: Store) -> None:
    """A use's entries are appended to the heap sorted (Store._stamp_blocks): unsorted, a use naming more
    entries than the heap held would put a deeper block's entry under a shallower one's."""
    held = keys(chain(2, b"u"))
    put(store, held)
    uses: list[Any] = []
    _, lease = store.lookup(NS, [k.hash for k in held] * 6, ["L"], 1, owner="c")  # each block named 6 times
    assert lease is not None and len(lease.blocks) == 12
    store.end_used_lease(lease.lease_id, "c", uses)
    store.stamp_uses(uses)
    for usage in store._tenants.values():
        heap = usage.heap
        assert all(heap[(child - 1) // 2] <= heap[child] for child in range(1, len(heap)))
    assert store._next_victim() is store.blocks[held[1]]  # the deeper of the two, at its last (deepest) place


def test_recency_entries_that_tied_on_their_order_would_still_compare(store: Store) -> None:
    """Entries hold their blocks; orders never repeat, but were two to tie, eviction must not raise comparing blocks."""
    a, b = keys(chain(2, b"t"))
    put(store, [a, b])
    first, second = store.blocks[a], store.blocks[b]
    assert ((1, 0, 5, first) < (1, 0, 5, second)) != ((1, 0, 5, second) < (1, 0, 5, first))


def test_expiry_book_holds_only_what_may_still_expire(store: Store, clock: Clock) -> None:
    held = keys(chain(2, b"e"))
    put(store, held)
    for _ in range(5000):
        _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c")
        assert lease is not None
        store.end_lease(lease.lease_id)
        clock.now += 0.01  # 50 s in all: five lease TTLs
    store.expire()
    # only the grants of the last lease TTL (10 s = 1 000 grants) may still be waiting
    assert len(store._expiries) <= 1001 + 2  # noqa: SLF001
    assert store.pinned_blocks == 0


def test_pinned_block_count_is_kept_as_pins_change(store: Store) -> None:
    ks = keys(chain(3, b"p"))
    put(store, ks)
    _, a = store.lookup(NS, [k.hash for k in ks], ["L"], 1, owner="c", group=0)
    _, b = store.lookup(NS, [k.hash for k in ks[:1]], ["L"], 1, owner="c", group=1)
    assert a is not None and b is not None
    assert store.pinned_blocks == 3 == sum(1 for blk in store.blocks.values() if blk.pins > 0)
    store.end_lease(a.lease_id)
    assert store.pinned_blocks == 1
    store.drop_owner("c")
    assert store.pinned_blocks == 0


def test_block_size_constant_is_a_page(store: Store) -> None:
    assert BLOCK == store.arena.capacity // 8


@pytest.mark.parametrize("shards", [1, 2])
def test_a_leased_lookup_maps_the_slots_of_what_it_pins_in_the_same_pass(store: Store, shards: int) -> None:
    hashes = chain(3, b"s")
    for shard in range(shards):
        put(store, keys(hashes, shard=shard))
    for shard in range(shards):  # the checksums a same-host copy is proven by
        for k in keys(hashes, shard=shard):
            store.blocks[k].checksum = bytes([k.hash[-1], shard]) * 8
    store.blocks[keys(hashes[1:2])[0]].checksum = None  # without one: never copied the one-round-trip way
    asked = [*hashes, b"missing!"]
    slots: dict = {}
    masks, lease = store.lookup(NS, asked, ["L"], shards, owner="c", slots=slots)
    assert lease is not None and masks == {"L": [True, True, True, False]}
    assert slots["L"] == store.lease_slots(lease, NS, asked, ["L"], shards)["L"]
    packed_offsets, packed_sizes, packed_sums = slots["L"]  # packed as they travel: int64s, 16-byte checksums
    offsets, sizes = array("q", packed_offsets), array("q", packed_sizes)
    sums = [packed_sums[i:i + 16] for i in range(0, len(packed_sums), 16)]
    assert len(offsets) == len(sizes) == len(sums) == len(asked) * shards
    for i, h in enumerate(asked):
        for shard in range(shards):
            j = i * shards + shard
            block = store.blocks.get(keys([h], shard=shard)[0])
            if block is None or block.checksum is None:
                assert offsets[j] == -1
            else:
                assert (offsets[j], sizes[j], sums[j]) == (block.offset, block.size, block.checksum)
    assert store.end_used_lease(lease.lease_id, "someone else") is False
    assert store.end_used_lease(lease.lease_id, "c") is True and store.pinned_blocks == 0


def _older_loaded_blocks(store: Store) -> tuple[list, list, Any, list]:
    """A full pool (8 blocks): 4 to load, written first, then 4 others; a lease on the 4; their stamps."""
    loaded, other = keys(chain(4, b"a")), keys(chain(4, b"b"))
    put(store, loaded)
    put(store, other)
    _, lease = store.lookup(NS, [k.hash for k in loaded], ["L"], 1, owner="c")
    assert lease is not None
    return loaded, other, lease, [store.blocks[k].stamp for k in loaded]


def _loaded_now_outlive_the_others(store: Store, loaded: list, other: list) -> None:
    assert all(store.blocks[k].stamp > store.blocks[o].stamp for k in loaded for o in other)
    assert put(store, keys(chain(4, b"new")), owner="other").count(WRITE) == 4
    assert all(k in store.blocks for k in loaded) and not any(o in store.blocks for o in other)


def test_a_used_leases_stamp_can_be_left_for_later_and_then_counts_as_its_use(store: Store) -> None:
    loaded, other, lease, stamps = _older_loaded_blocks(store)
    uses: list = []
    assert store.end_used_lease(lease.lease_id, "c", uses) is True
    assert lease.lease_id not in store.leases and store.pinned_blocks == 0  # ended at once
    assert [store.blocks[k].stamp for k in loaded] == stamps and len(uses) == 1  # the stamp waits
    store.stamp_uses(uses)
    _loaded_now_outlive_the_others(store, loaded, other)


def test_a_stamp_left_for_later_skips_blocks_gone_or_replaced_meanwhile(store: Store) -> None:
    loaded = keys(chain(3, b"g"))
    put(store, loaded)
    _, lease = store.lookup(NS, [k.hash for k in loaded], ["L"], 1, owner="c")
    assert lease is not None
    uses: list = []
    assert store.end_used_lease(lease.lease_id, "c", uses) is True
    store.clear(NS)  # every block gone; then one key written again: a new block under the old key
    put(store, loaded[:1])
    successor = store.blocks[loaded[0]]
    stamp, heap = successor.stamp, list(store._tenants[successor.tenant].heap)
    store.stamp_uses(uses)
    assert successor.stamp == stamp  # the old block's use is not its successor's
    assert store._tenants[successor.tenant].heap == heap  # nor an entry in the recency heap for a gone block
    assert list(store.blocks) == loaded[:1]


def test_a_reads_stamp_can_be_left_for_after_its_answer_and_then_counts_as_its_use(store: Store) -> None:
    loaded, other, lease, stamps = _older_loaded_blocks(store)
    uses: list = []
    read = store.begin_read(lease.lease_id, "c", runs=[["L", 0, 0, 4]], reader="conn:1", uses=uses)
    store.end_lease(lease.lease_id)
    assert [store.blocks[k].stamp for k in loaded] == stamps and len(uses) == 1  # the stamp waits
    assert all(store.blocks[k].pins == 1 for k in loaded)  # the read's pins keep them meanwhile
    store.stamp_uses(uses)
    assert store.end_read(read.read_id) is True
    _loaded_now_outlive_the_others(store, loaded, other)
