"""Store logic without I/O: visibility, presence, leases, eviction order (the disk tier: test_store_disk.py)."""

from __future__ import annotations

import os

import pytest

from dkv.arena import PAGE
from dkv.errors import LeaseExpired, WriteRejected
from dkv.store import BUSY, EXISTS, FULL, WRITE, Store, StoreKey
from tests.dkv.conftest import Clock

NS = "t/ns"
BLOCK = PAGE


def chain(n: int, tag: bytes = b"") -> list[bytes]:
    return [(tag + bytes([i])).rjust(8, b"\0") for i in range(n)]


def keys(hashes: list[bytes], leaf: str = "L", shard: int = 0) -> list[StoreKey]:
    return [StoreKey(NS, leaf, shard, h) for h in hashes]


def put(store: Store, ks: list[StoreKey], size: int = BLOCK, owner: str = "w") -> list[str]:
    res, statuses = store.reserve(owner, ks, [size] * len(ks))
    for k, off, n in zip(res.keys, res.offsets, res.sizes):
        store.arena.slot(k.namespace, off, n)[:] = bytes([k.hash[-1]]) * n
    store.commit(res.write_id, owner)
    return statuses


def test_reserved_block_is_invisible_until_commit(store: Store) -> None:
    ks = keys(chain(2))
    res, statuses = store.reserve("w", ks, [BLOCK, BLOCK])
    assert statuses == [WRITE, WRITE]
    assert store.presence(NS, chain(2), ["L"], 1) == {"L": [False, False]}
    store.commit(res.write_id, "w")
    assert store.presence(NS, chain(2), ["L"], 1) == {"L": [True, True]}


def test_abandoned_write_leaves_nothing_and_frees_its_slots(store: Store) -> None:
    free_before = store.host_bytes()[0]
    res, _ = store.reserve("w", keys(chain(3)), [BLOCK] * 3)
    assert store.host_bytes()[0] == free_before - 3 * BLOCK
    store.drop_owner("w")
    assert store.host_bytes()[0] == free_before
    assert not store.reserved_keys and not store.blocks
    with pytest.raises(WriteRejected):
        store.commit(res.write_id, "w")


def test_expired_reservation_is_aborted(store: Store, clock: Clock) -> None:
    res, _ = store.reserve("w", keys(chain(1)), [BLOCK])
    clock.now += 31
    store.expire()
    with pytest.raises(WriteRejected):
        store.commit(res.write_id, "w")
    assert not store.blocks


def test_concurrent_writers_of_one_key_first_wins_second_skips(store: Store) -> None:
    k = keys(chain(1))
    res1, st1 = store.reserve("a", k, [BLOCK])
    _, st2 = store.reserve("b", k, [BLOCK])
    assert (st1, st2) == ([WRITE], [BUSY])
    store.commit(res1.write_id, "a")
    _, st3 = store.reserve("b", k, [BLOCK])
    assert st3 == [EXISTS]


def test_writer_cannot_commit_someone_elses_reservation(store: Store) -> None:
    res, _ = store.reserve("a", keys(chain(1)), [BLOCK])
    with pytest.raises(WriteRejected):
        store.commit(res.write_id, "b")
    store.abort(res.write_id)


def test_presence_needs_every_tp_shard(store: Store) -> None:
    h = chain(2)
    put(store, [StoreKey(NS, "L", 0, h[0]), StoreKey(NS, "L", 1, h[0]), StoreKey(NS, "L", 0, h[1])])
    assert store.presence(NS, h, ["L"], 2) == {"L": [True, False]}
    assert store.presence(NS, h, ["L"], 1) == {"L": [True, True]}


def test_namespaces_do_not_see_each_other(store: Store) -> None:
    put(store, keys(chain(1)))
    assert store.presence("other/ns", chain(1), ["L"], 1) == {"L": [False]}


def test_lease_expires_before_read(store: Store, clock: Clock) -> None:
    ks = keys(chain(2))
    put(store, ks)
    _, lease = store.lookup(NS, chain(2), ["L"], 1, owner="c")
    assert lease is not None
    clock.now += 10.5
    with pytest.raises(LeaseExpired):
        store.begin_read(lease.lease_id, "c", ks).slots
    assert not store.leases and all(b.pins == 0 for b in store.blocks.values())


def test_back_to_back_lookups_release_the_first_lease(store: Store) -> None:
    put(store, keys(chain(2)))
    _, first = store.lookup(NS, chain(2), ["L"], 1, owner="c", group=0)
    _, second = store.lookup(NS, chain(2), ["L"], 1, owner="c", group=0)
    assert first is not None and second is not None
    assert list(store.leases) == [second.lease_id]
    assert all(b.pins == 1 for b in store.blocks.values())
    store.end_lease(second.lease_id)
    assert all(b.pins == 0 for b in store.blocks.values())


def test_a_lease_s_bytes_are_those_of_the_blocks_it_pins(store: Store) -> None:
    hashes = chain(3)
    put(store, keys(hashes[:2]), size=BLOCK)
    put(store, keys(hashes[2:]), size=3 * BLOCK)
    _, lease = store.lookup(NS, [*hashes, hashes[0], os.urandom(32)], ["L"], 1, owner="c")
    assert lease is not None
    assert store.leased_bytes(lease.lease_id) == 5 * BLOCK + BLOCK  # the repeated hash is pinned twice
    store.end_lease(lease.lease_id)
    assert store.leased_bytes(lease.lease_id) == 0


def test_lookups_of_other_groups_keep_their_leases(store: Store) -> None:
    put(store, keys(chain(1)))
    store.lookup(NS, chain(1), ["L"], 1, owner="c", group=0)
    store.lookup(NS, chain(1), ["L"], 1, owner="c", group=1)
    assert len(store.leases) == 2


def test_lease_count_is_bounded_per_owner(store: Store) -> None:
    put(store, keys(chain(1)))
    for group in range(10):
        store.lookup(NS, chain(1), ["L"], 1, owner="c", group=group)
    assert len(store.leases) == 4
    assert store.counters.leases_dropped_over_limit == 6
    assert store.blocks[keys(chain(1))[0]].pins == 4


def test_vanished_owner_loses_its_leases(store: Store) -> None:
    put(store, keys(chain(2)))
    store.lookup(NS, chain(2), ["L"], 1, owner="c")
    store.drop_owner("c")
    assert not store.leases and all(b.pins == 0 for b in store.blocks.values())


def test_read_outside_the_lease_is_refused(store: Store) -> None:
    h = chain(2)
    put(store, keys(h))
    _, lease = store.lookup(NS, h[:1], ["L"], 1, owner="c")
    assert lease is not None
    with pytest.raises(LeaseExpired):
        store.begin_read(lease.lease_id, "c", keys(h)).slots
    with pytest.raises(LeaseExpired):
        store.begin_read(lease.lease_id, "someone-else", keys(h[:1])).slots


def test_leased_blocks_are_never_evicted(store: Store) -> None:
    held = keys(chain(4, b"h"))
    put(store, held)
    _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c")
    for i in range(3):  # 8 slots: 4 pinned, the rest churns
        put(store, keys(chain(4, bytes([i + 1]))))
    assert all(k in store.blocks for k in held)
    assert lease is not None and store.begin_read(lease.lease_id, "c", held).slots
    store.end_lease(lease.lease_id)


def test_pool_full_of_pinned_blocks_refuses_writes(store: Store) -> None:
    held = keys(chain(8, b"h"))
    put(store, held)
    _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c")
    _, statuses = store.reserve("w", keys(chain(1, b"x")), [BLOCK])
    assert statuses == [FULL]
    assert lease is not None
    store.end_lease(lease.lease_id)


def _eviction_order(store: Store, n: int) -> list[StoreKey]:
    """Fill the pool with fresh blocks one by one and record which old blocks go, in order."""
    gone: list[StoreKey] = []
    store.on_evict.append(gone.extend)
    for i in range(n):
        put(store, keys([os.urandom(8)], leaf="filler"))
    return gone


def test_partial_touch_would_evict_the_root_first(store: Store) -> None:
    """The seed's warning, reproduced: touching a suffix ages the omitted root below it."""
    h = chain(4)
    put(store, keys(h))
    put(store, keys(chain(4, b"o")))  # other blocks, newer than the chain
    store.touch(NS, h[1:], ["L"], 1)  # root-omitting slice: the anti-pattern
    gone = _eviction_order(store, 1)
    assert gone[0].hash == h[0]


def test_whole_chain_touch_keeps_the_root_last(store: Store) -> None:
    h = chain(4)
    put(store, keys(h))
    put(store, keys(chain(4, b"o")))
    store.touch(NS, h, ["L"], 1)  # the contract: the whole chain, from its root
    gone = _eviction_order(store, 8)
    chain_order = [k.hash for k in gone if k.leaf == "L" and k.hash in h]
    assert chain_order == [h[3], h[2], h[1], h[0]], "deepest first, root last"
    others = [i for i, k in enumerate(gone) if k.hash not in h]
    assert max(others[:4]) < gone.index(StoreKey(NS, "L", 0, h[3])), "older stamps go before the touched chain"


def test_read_stamps_the_loaded_blocks(store: Store) -> None:
    h = chain(2)
    put(store, keys(h))
    put(store, keys(chain(2, b"o")))
    _, lease = store.lookup(NS, h, ["L"], 1, owner="c")
    assert lease is not None
    store.begin_read(lease.lease_id, "c", keys(h)).slots
    store.end_lease(lease.lease_id)
    gone = _eviction_order(store, 6)
    assert {k.hash for k in gone[:2]} == set(chain(2, b"o"))


def _put_summed(store: Store, ks: list[StoreKey]) -> None:
    """``put``, each block with a checksum of its own (a lease hands a read only blocks that have one)."""
    res, _ = store.reserve("w", ks, [BLOCK] * len(ks), [bytes([k.hash[-1]]) * 16 for k in ks])
    for k, off, n in zip(res.keys, res.offsets, res.sizes):
        store.arena.slot(k.namespace, off, n)[:] = bytes([k.hash[-1]]) * n
    store.commit(res.write_id, "w")


def test_a_reads_own_pins_outlast_its_lease_and_are_counted_once_each(store: Store) -> None:
    """The node-wide count of pinned blocks follows a read's pins through its lease's end and its own."""
    h = chain(3)
    put(store, keys(h))
    _, lease = store.lookup(NS, h, ["L"], 1, owner="c")
    assert lease is not None and store.pinned_blocks == 3
    read = store.begin_read(lease.lease_id, "c", keys(h[:2]) + keys(h[:1]), reader="conn")  # one named twice
    assert read.offsets == [store.blocks[k].offset for k in keys(h[:2]) + keys(h[:1])]
    assert [store.blocks[k].pins for k in keys(h)] == [2, 2, 1] and store.pinned_blocks == 3
    store.end_lease(lease.lease_id)
    assert [store.blocks[k].pins for k in keys(h)] == [1, 1, 0] and store.pinned_blocks == 2
    assert store.end_read(read.read_id) and not store.end_read(read.read_id)
    assert all(b.pins == 0 for b in store.blocks.values()) and store.pinned_blocks == 0


def test_a_lease_handed_to_a_read_moves_its_pins_and_lists_its_blocks_in_lookup_order(store: Store) -> None:
    h = chain(2)
    _put_summed(store, keys(h) + keys(h, leaf="M"))
    looked_up = [h[0], h[1], h[0]]  # a hash named twice is held, and sent, at each of its places
    _, lease = store.lookup(NS, looked_up, ["L", "M"], 1, owner="c")
    assert lease is not None
    expected = [store.blocks[k] for k in keys(looked_up) + keys(looked_up, leaf="M")]
    pins = [b.pins for b in expected]
    assert store.lease_into_read(lease.lease_id, "someone-else", reader="conn", max_bytes=1 << 30) is None
    assert store.lease_into_read(lease.lease_id, "c", reader="conn", max_bytes=6 * BLOCK - 1) is None
    assert lease.lease_id in store.leases and [b.pins for b in expected] == pins  # refused: the lease as it was

    read = store.lease_into_read(lease.lease_id, "c", reader="conn", max_bytes=6 * BLOCK)
    assert read is not None
    assert read.offsets == [b.offset for b in expected] and read.sizes == [BLOCK] * 6
    assert read.checksums == [b.checksum for b in expected]
    assert lease.lease_id not in store.leases and store.leases_of("c") == 0 and store.reads_of("conn") == 1
    assert [b.pins for b in expected] == pins, "the lease's pins are the read's: none given back, none taken"
    store.lookup(NS, h, ["L"], 1, owner="c")  # the group's next lookup ends no lease of the read's
    store.drop_owner("c")
    assert all(b.pins > 0 for b in expected)
    assert store.end_read(read.read_id)
    assert all(b.pins == 0 for b in store.blocks.values()) and store.pinned_blocks == 0


def test_a_lease_with_a_block_stored_without_a_checksum_is_not_handed_to_a_read(store: Store) -> None:
    put(store, keys(chain(1)))
    _, lease = store.lookup(NS, chain(1), ["L"], 1, owner="c")
    assert lease is not None
    assert store.lease_into_read(lease.lease_id, "c", reader="conn", max_bytes=1 << 30) is None
    assert lease.lease_id in store.leases and not store.reads


def test_a_lease_handed_to_a_read_stamps_its_blocks(store: Store) -> None:
    h = chain(2)
    _put_summed(store, keys(h))
    put(store, keys(chain(2, b"o")))
    _, lease = store.lookup(NS, h + h[:1], ["L"], 1, owner="c")
    assert lease is not None
    read = store.lease_into_read(lease.lease_id, "c", reader="conn", max_bytes=1 << 30)
    assert read is not None and store.end_read(read.read_id)
    gone = _eviction_order(store, 6)
    assert {k.hash for k in gone[:2]} == set(chain(2, b"o"))


def test_host_byte_accounting(store: Store) -> None:
    free, total = store.host_bytes()
    assert (free, total) == (8 * BLOCK, 8 * BLOCK)
    put(store, keys(chain(3)), size=100)  # one page each: slots are page-aligned
    assert store.host_bytes() == (5 * BLOCK, 8 * BLOCK)
    assert store.disk_bytes() == (0, 0)


def test_zero_byte_blocks_own_no_slot(store: Store) -> None:
    put(store, keys(chain(3)), size=0)
    assert store.host_bytes()[0] == 8 * BLOCK
    _, lease = store.lookup(NS, chain(3), ["L"], 1, owner="c")
    assert lease is not None
    assert [p.size for p in store.begin_read(lease.lease_id, "c", keys(chain(3))).slots] == [0, 0, 0]
    store.end_lease(lease.lease_id)


def test_clear_drops_unpinned_blocks_of_one_namespace(store: Store) -> None:
    put(store, keys(chain(2)))
    put(store, [StoreKey("other/ns", "L", 0, h) for h in chain(2)])
    assert store.clear(NS) == 2
    assert len(store.blocks) == 2
