"""No single client exhausts a node: block bounds, reservation and stored quotas, lease caps (store logic).

Each block is charged to the credential (tenant) that wrote it. The node's
bounds and each credential's quotas make room the way running out of bytes
does (oldest unpinned first, evictions unpublished), but a credential over its
own quota only ever loses its own blocks, and an uncommitted reservation
beyond its bound is answered FULL instead of evicting anyone. The node-level
tests are in ``test_node_quotas.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from dkv.arena import Arena
from dkv.credentials import Quotas
from dkv.disk_tier import DiskTier
from dkv.errors import NodeBusy, remote_error
from dkv.store import FULL, WRITE, Store, StoreKey, slot_cost
from tests.dkv.conftest import Clock
from tests.dkv.test_store import BLOCK, NS, chain, keys

SLOTS = 8  # the arena fixture: 8 pages


def make(arena: Arena, clock: Clock, quotas: dict[str, Quotas] | None = None, **kwargs: Any) -> tuple[Store, list[StoreKey]]:
    """A store whose credentials' quotas come from ``quotas``; returns it and the list of unpublished keys."""
    table = quotas or {}
    store = Store(arena, clock=clock, quotas=lambda name: table.get(name, Quotas()), **kwargs)
    unpublished: list[StoreKey] = []
    store.on_evict.append(unpublished.extend)
    return store, unpublished


def write(store: Store, ks: list[StoreKey], *, tenant: str = "", owner: str = "w", size: int = BLOCK) -> list[str]:
    """Reserve, fill and commit ``ks`` as ``owner`` of credential ``tenant``; the statuses."""
    res, statuses = store.reserve(owner, ks, [size] * len(ks), tenant=tenant)
    for k, off, n in zip(res.keys, res.offsets, res.sizes):
        store.arena.slot(k.namespace, off, n)[:] = bytes([k.hash[-1]]) * n
    store.commit(res.write_id, owner)
    check_books(store)
    return statuses


def tagged(tag: str, n: int) -> list[StoreKey]:
    return [StoreKey(NS, tag, 0, h) for h in chain(n)]


def check_books(store: Store) -> None:
    """Every credential's counts agree with the blocks, reservations and leases the store holds."""
    expect: dict[str, dict[str, int]] = {}
    for block in store.blocks.values():
        row = expect.setdefault(block.tenant, {"blocks": 0, "stored_bytes": 0, "blocks_off_host": 0,
                                               "reserved_bytes": 0, "reserved_blocks": 0, "leases": 0})
        row["blocks"] += 1
        if block.on_host:
            row["stored_bytes"] += slot_cost(block.size)
        else:
            row["blocks_off_host"] += 1
    for res in store.reservations.values():
        row = expect.setdefault(res.tenant, {"blocks": 0, "stored_bytes": 0, "blocks_off_host": 0,
                                             "reserved_bytes": 0, "reserved_blocks": 0, "leases": 0})
        row["reserved_bytes"] += sum(slot_cost(n) for n in res.sizes)
        row["reserved_blocks"] += len(res.keys)
    for lease in store.leases.values():
        row = expect.setdefault(lease.tenant, {"blocks": 0, "stored_bytes": 0, "blocks_off_host": 0,
                                               "reserved_bytes": 0, "reserved_blocks": 0, "leases": 0})
        row["leases"] += 1
    got = store.tenant_stats()
    for name, row in expect.items():
        assert {k: got[name][k] for k in row} == row, name
    for name, row in got.items():
        if name not in expect:
            assert row["blocks"] == row["reserved_blocks"] == row["leases"] == row["stored_bytes"] == 0, name


@pytest.fixture
def disk(tmp_path) -> Iterator[DiskTier]:
    tier = DiskTier(str(tmp_path), 2 * BLOCK)
    yield tier
    tier.clear()


# ---- (7) blocks are counted, zero-byte ones too ------------------------------------------------


def test_zero_byte_blocks_stop_at_the_block_bound_oldest_first_and_are_unpublished(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock, max_blocks=10)
    written = [StoreKey(NS, "Z", 0, os.urandom(8)) for _ in range(300)]
    for key in written:
        assert write(store, [key], size=0) == [WRITE]
        assert len(store.blocks) <= 10
    assert set(store.blocks) == set(written[-10:]), "the newest stay, the oldest went"
    assert unpublished == written[:-10], "each dropped block is unpublished, oldest first"
    assert store.host_bytes()[0] == SLOTS * BLOCK


def test_default_block_bound_is_derived_from_the_pool_with_a_floor(arena: Arena, clock: Clock) -> None:
    from dkv.store import MIN_MAX_BLOCKS, default_max_blocks

    assert Store(arena, clock=clock).max_blocks == MIN_MAX_BLOCKS  # a 32 KiB pool: the floor
    assert default_max_blocks(8 * 2**30) == 8 * 2**30 // (16 * 1024)


def test_block_bound_with_nothing_evictable_answers_full(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock, max_blocks=3)
    held = keys(chain(3, b"p"))
    write(store, held, size=0)
    _, lease = store.lookup(NS, [k.hash for k in held], ["L"], 1, owner="c")
    assert lease is not None
    res, statuses = store.reserve("w", keys(chain(2, b"n")), [0, 0])
    assert statuses == [FULL, FULL]
    assert store.counters.full_refusals == 2 and not unpublished
    store.abort(res.write_id)
    store.end_lease(lease.lease_id)


def test_reserved_keys_count_against_the_block_bound(arena: Arena, clock: Clock) -> None:
    """Zero-byte reservations hold no bytes, but each holds a key: a connection's are bounded (max_blocks / 8)."""
    store, unpublished = make(arena, clock, max_blocks=16 * 1024)
    others = [StoreKey(NS, "O", 0, i.to_bytes(8, "big")) for i in range(1000)]
    write(store, others, owner="other", size=0)
    greedy = [StoreKey(NS, "Z", 0, i.to_bytes(8, "big")) for i in range(5000)]
    res, statuses = store.reserve("greedy", greedy, [0] * len(greedy))  # never committed
    assert statuses.count(WRITE) == 2048 and statuses[2048:] == [FULL] * (5000 - 2048)
    assert store.counters.quota_refusals == 5000 - 2048
    assert not unpublished and all(k in store.blocks for k in others), "an uncommitted write evicts nobody"
    check_books(store)
    store.abort(res.write_id)


def test_block_bound_spilled_blocks_are_dropped_first(arena: Arena, clock: Clock, disk: DiskTier) -> None:
    store, unpublished = make(arena, clock, max_blocks=SLOTS + 1)
    store.disk = disk
    first = tagged("A", SLOTS)
    write(store, first)
    write(store, tagged("B", 1))  # the pool is full: A's oldest (deepest) spills, still indexed
    assert len(store.blocks) == SLOTS + 1 and store.blocks_off_host() == 1
    spilled = next(k for k, b in store.blocks.items() if not b.on_host)
    write(store, tagged("C", 1))  # at the block bound: the spilled block is the one dropped
    assert spilled not in store.blocks and spilled in unpublished
    assert len(store.blocks) <= SLOTS + 1
    check_books(store)


# ---- (9a) uncommitted reservations are bounded per connection and per credential -----------------


def test_reservation_beyond_the_connection_bound_is_full_and_evicts_nobody(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock, max_reserved_bytes_per_owner=2 * BLOCK)
    others = tagged("O", 6)
    for pair in (others[:2], others[2:4], others[4:]):
        assert write(store, pair, owner="other") == [WRITE] * 2
    res, statuses = store.reserve("greedy", tagged("G", 20), [BLOCK] * 20)  # more than the pool, never committed
    assert statuses == [WRITE] * 2 + [FULL] * 18
    assert store.counters.quota_refusals == 18
    assert not unpublished and all(k in store.blocks for k in others)
    check_books(store)
    assert write(store, tagged("N", 2), owner="other2") == [WRITE] * 2, "other writers still get room"
    clock.now += store.reservation_ttl + 1
    store.expire()
    assert not store.reservations
    check_books(store)


def test_reservations_are_bounded_per_credential_across_its_connections(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock, {"t": Quotas(max_reserved_bytes=3 * BLOCK)})
    a, sa = store.reserve("conn:1", tagged("A", 2), [BLOCK] * 2, tenant="t")
    b, sb = store.reserve("conn:2", tagged("B", 2), [BLOCK] * 2, tenant="t")
    c, sc = store.reserve("conn:3", tagged("C", 2), [BLOCK] * 2, tenant="u")  # another credential: its own quota
    assert (sa, sb, sc) == ([WRITE] * 2, [WRITE, FULL], [WRITE] * 2)
    check_books(store)
    store.commit(a.write_id, "conn:1")
    _, again = store.reserve("conn:2", tagged("D", 2), [BLOCK] * 2, tenant="t")  # committed bytes are no reservation
    assert again == [WRITE] * 2
    check_books(store)
    store.drop_owner("conn:2")
    store.abort(c.write_id)
    check_books(store)
    assert not unpublished


def test_default_reservation_bounds_are_pool_fractions_with_a_floor() -> None:
    big = Arena(64 * 2**30, label="unit-big")  # sparse: nothing is touched
    try:
        store = Store(big)
        assert store.max_reserved_bytes_per_owner == 8 * 2**30
        assert store._tenant("").limits.reserved_bytes == 16 * 2**30  # noqa: SLF001
        assert store._tenant("").limits.stored_bytes == 64 * 2**30  # noqa: SLF001
    finally:
        big.close()


# ---- (9b) a credential over its stored quota evicts its own blocks only ------------------------


def test_credential_over_its_stored_quota_evicts_only_its_own_oldest(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock, {"small": Quotas(max_stored_bytes=3 * BLOCK)})
    others = tagged("O", 4)
    write(store, others, tenant="big")
    own = tagged("S", 3)
    write(store, own, tenant="small")  # one use: the deepest goes first
    later = tagged("T", 2)
    for key in later:
        assert write(store, [key], tenant="small") == [WRITE]
    assert all(k in store.blocks for k in others), "another credential's blocks are never its quota's victims"
    assert unpublished == [own[2], own[1]], "its own oldest stamp, deepest first"
    assert store.tenant_stats()["small"]["stored_bytes"] == 3 * BLOCK
    assert store.counters.quota_evictions == 2


def test_stored_quota_with_only_pinned_blocks_answers_full(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock, {"small": Quotas(max_stored_bytes=2 * BLOCK)})
    own = tagged("S", 2)
    write(store, own, tenant="small")
    _, lease = store.lookup(NS, [k.hash for k in own], ["S"], 1, owner="c", tenant="small")
    assert lease is not None
    res, statuses = store.reserve("w", tagged("T", 1), [BLOCK], tenant="small")
    assert statuses == [FULL] and store.counters.quota_refusals == 1 and not unpublished
    assert store.host_bytes()[0] == (SLOTS - 2) * BLOCK, "the pool had room: the quota said no"
    store.abort(res.write_id)
    store.end_lease(lease.lease_id)


def test_quota_eviction_never_drops_another_credentials_spilled_blocks(arena: Arena, clock: Clock,
                                                                       disk: DiskTier) -> None:
    store, unpublished = make(arena, clock, {"small": Quotas(max_stored_bytes=1 * BLOCK)})
    store.disk = disk  # room for two spilled blocks
    others = tagged("O", SLOTS)
    write(store, others, tenant="big")
    write(store, tagged("X", 2), tenant="big")  # the pool is full: two of big's blocks spill, filling the disk
    while (job := store.take_spill()) is not None:
        disk.write_file(job.entry.path, job.data)
        store.finish_spill(job)
    on_disk = {k for k, b in store.blocks.items() if not b.on_host}
    assert len(on_disk) == 2 and not unpublished
    write(store, tagged("S", 1), tenant="small")  # evicts big's oldest host block (the pool's own eviction)
    unpublished.clear()
    on_disk = {k for k, b in store.blocks.items() if not b.on_host and b.tenant == "big"}
    write(store, tagged("T", 1), tenant="small")  # over its quota: its own block goes, dropped (the disk is full)
    assert all(k in store.blocks for k in on_disk), "big's spilled blocks stay"
    assert [k.leaf for k in unpublished] == ["S"]
    check_books(store)


def test_node_eviction_takes_the_oldest_across_credentials(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock)
    order = []
    for i in range(SLOTS):  # alternating credentials, one use each
        key = StoreKey(NS, "L", 0, bytes([i]).rjust(8, b"\0"))
        write(store, [key], tenant=f"t{i % 3}")
        order.append(key)
    store.touch(NS, [order[0].hash], ["L"], 1)  # the first becomes the newest
    for i in range(SLOTS):
        write(store, [StoreKey(NS, "F", 0, os.urandom(8))], tenant="filler")
    assert unpublished == order[1:] + order[:1]


def test_credential_block_quota_drops_its_own_oldest(arena: Arena, clock: Clock) -> None:
    store, unpublished = make(arena, clock, {"small": Quotas(max_blocks=3)})
    others = tagged("O", 2)
    write(store, others, tenant="big", size=0)
    own = [StoreKey(NS, "S", 0, os.urandom(8)) for _ in range(6)]
    for key in own:
        write(store, [key], tenant="small", size=0)
    assert set(unpublished) == set(own[:3]) and all(k in store.blocks for k in others)
    assert store.tenant_stats()["small"]["blocks"] == 3


# ---- (10) leases: per credential, and node-wide ----------------------------------------------


def test_global_lease_cap_refuses_with_node_busy_and_ends_no_lease(arena: Arena, clock: Clock) -> None:
    store, _ = make(arena, clock, max_leases=3)
    held = keys(chain(1, b"l"))
    write(store, held)
    leases = []
    for i in range(3):
        _, lease = store.lookup(NS, [held[0].hash], ["L"], 1, owner=f"client:{i}", tenant=f"t{i}")
        assert lease is not None
        leases.append(lease.lease_id)
    with pytest.raises(NodeBusy) as refused:
        store.lookup(NS, [held[0].hash], ["L"], 1, owner="client:new", tenant="t9")
    assert refused.value.code == "busy"
    assert sorted(store.leases) == sorted(leases) and store.blocks[held[0]].pins == 3, "nothing ended, nothing pinned"
    assert store.counters.leases_refused == 1
    masks, none = store.lookup(NS, [held[0].hash], ["L"], 1)  # an unleased lookup still answers
    assert masks == {"L": [True]} and none is None
    store.end_lease(leases[0])
    _, lease = store.lookup(NS, [held[0].hash], ["L"], 1, owner="client:new", tenant="t9")
    assert lease is not None
    check_books(store)
    store.drop_owner("client:new")
    for lease_id in leases:
        store.end_lease(lease_id)
    assert store.pinned_blocks == 0


def test_the_wire_code_busy_is_raised_as_node_busy() -> None:
    assert isinstance(remote_error("busy", "at the cap"), NodeBusy)


def test_credential_lease_quota_ends_its_own_oldest(arena: Arena, clock: Clock) -> None:
    store, _ = make(arena, clock, {"t": Quotas(max_leases=2)})
    held = keys(chain(1, b"q"))
    write(store, held)
    _, other = store.lookup(NS, [held[0].hash], ["L"], 1, owner="client:u", tenant="u")
    granted = []
    for i in range(4):  # four clients of one credential: the credential holds two leases at most
        _, lease = store.lookup(NS, [held[0].hash], ["L"], 1, owner=f"client:{i}", tenant="t")
        assert lease is not None
        granted.append(lease.lease_id)
    assert other is not None and other.lease_id in store.leases, "another credential's lease stays"
    assert [i for i in granted if i in store.leases] == granted[2:]
    assert store.counters.leases_dropped_over_quota == 2
    assert store.tenant_stats()["t"]["leases"] == 2
    check_books(store)
    for lease_id in list(store.leases):
        store.end_lease(lease_id)
    assert store.pinned_blocks == 0


# ---- the books balance under any mix ---------------------------------------------------------


def test_books_balance_under_a_random_mix_of_tenants_tiers_and_bounds(arena: Arena, clock: Clock,
                                                                        disk: DiskTier) -> None:
    """Writes, aborts, leased lookups with promotion, reads, spills, clears, expiry, by three credentials."""
    import random

    from dkv.store import Promoted

    rng = random.Random(7)
    quotas = {"a": Quotas(max_stored_bytes=3 * BLOCK, max_blocks=6, max_leases=3), "b": Quotas(max_reserved_bytes=BLOCK)}
    store, _ = make(arena, clock, quotas, max_blocks=14, max_leases=5)
    store.disk = disk
    hashes = [bytes([i]).rjust(8, b"\0") for i in range(24)]
    leases: list[tuple[str, int]] = []
    open_writes: list[tuple[str, int]] = []
    for step in range(3000):
        op = rng.randrange(9)
        tenant = rng.choice(["", "a", "b"])
        owner = f"conn:{rng.randrange(4)}"
        if op <= 2:  # a write: committed, left open, or aborted
            ks = [StoreKey(NS, "L", 0, h) for h in rng.sample(hashes, rng.randint(1, 3))]
            res, _ = store.reserve(owner, ks, [rng.choice([0, 100, BLOCK])] * len(ks), tenant=tenant)
            if op == 0:
                store.commit(res.write_id, owner)
            elif op == 1:
                open_writes.append((owner, res.write_id))
            else:
                store.abort(res.write_id)
        elif op == 3 and open_writes:
            owner, write_id = open_writes.pop(rng.randrange(len(open_writes)))
            if write_id in store.reservations:
                store.commit(write_id, owner)
        elif op == 4:  # a leased lookup, promoting what is on disk
            wanted = rng.sample(hashes, 4)
            promoted = {}
            for read in store.disk_reads(NS, wanted, ["L"], 1, 2**30):
                promoted[read.key] = Promoted(read.entry, disk.read_file(read.entry.path, read.entry.size))
            client = f"client:{rng.randrange(3)}"
            try:
                _, lease = store.lookup(NS, wanted, ["L"], 1, owner=client, group=rng.randrange(2), promoted=promoted,
                                        tenant=tenant)
            except NodeBusy:
                lease = None
            if lease is not None:
                leases.append((client, lease.lease_id))
        elif op == 5 and leases:
            client, lease_id = leases.pop(rng.randrange(len(leases)))
            lease = store.leases.get(lease_id)
            if lease is not None:
                store.end_read(store.begin_read(lease_id, client, list(lease.keys)).read_id)
                store.end_lease(lease_id)
        elif op == 6:  # the server's spill task
            while (job := store.take_spill()) is not None:
                disk.write_file(job.entry.path, job.data)
                store.finish_spill(job)
            disk.unlink_files(disk.take_garbage())
        elif op == 7:
            clock.now += rng.choice([0.5, 5, 20])
            store.expire()
        elif op == 8 and rng.random() < 0.1:
            store.clear(NS)
        check_books(store)
        usage = store.tenant_stats()
        assert usage["a"]["stored_bytes"] <= 3 * BLOCK if "a" in usage else True, step
        assert len(store.blocks) + len(store.reserved_keys) <= 14, step
        assert len(store.leases) <= 5, step
    for owner, write_id in open_writes:
        store.abort(write_id)
    for _, lease_id in leases:
        store.end_lease(lease_id)
    check_books(store)
