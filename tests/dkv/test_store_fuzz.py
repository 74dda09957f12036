"""Fuzzing the store: random sequences of its operations against a simple model of what must hold.

A hypothesis state machine drives one :class:`~dkv.store.Store` over a small
arena (8 pages, as the ``store`` fixture of ``tests/dkv/conftest.py``; two
namespaces, so two segments share the budget) through reserve (filling the
slots), commit, abort, leased lookup, release, read (ended at once, or left
open), touch, owner drop, clear and the passing of time. Eviction happens as
a full pool makes room. After every step:

* a committed block still held reads back exactly the bytes written for it;
* nothing uncommitted is visible, to presence or to the index;
* every block a live lease or an open read holds is still in the pool
  (pinned blocks are never evicted), and its pin count is what those hold;
* pool accounting: the arena's used bytes are exactly the slots of held
  blocks and live reservations, never more than the pool;
* no slot is handed out twice: those slots never overlap within a segment.

No I/O, no node: a fake clock moves time.
"""

from __future__ import annotations

import tests.hypothesis_profiles  # noqa: F401  (first: loads the fuzz profile)

import hashlib
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dkv.arena import PAGE, Arena
from dkv.errors import LeaseExpired
from dkv.store import BUSY, EXISTS, FULL, WRITE, Store, StoreKey, slot_cost
from tests.dkv.conftest import Clock
from tests.hypothesis_profiles import examples

POOL = 8 * PAGE
LEASE_TTL, RESERVATION_TTL, READ_TTL = 10.0, 30.0, 30.0
MAX_LEASES_PER_OWNER = 4
NAMESPACES = ("t/ns", "t/other")
LEAF = "L"
HASHES = [bytes([i]) * 8 for i in range(8)]
OWNERS = ("a", "b")
SIZES = (0, 100, PAGE, PAGE + 1, 2 * PAGE, 3 * PAGE)

hash_runs = st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True)


@dataclass
class ModelLease:
    owner: str
    group: int
    keys: frozenset[StoreKey]
    expires_at: float


@dataclass
class ModelWrite:
    owner: str
    slots: list[tuple[StoreKey, int, bytes]]  # reserved key, its slot's offset, the bytes put there
    expires_at: float


@dataclass
class ModelRead:
    owner: str  # the reading connection (here the lease's owner: begin_read's default reader)
    keys: frozenset[StoreKey]
    expires_at: float


@dataclass
class Model:
    committed: dict[StoreKey, bytes] = field(default_factory=dict)  # last bytes committed per key
    writes: dict[int, ModelWrite] = field(default_factory=dict)
    leases: dict[int, ModelLease] = field(default_factory=dict)  # oldest first
    reads: dict[int, ModelRead] = field(default_factory=dict)


def _bytes_for(key: StoreKey, size: int, serial: int) -> bytes:
    seed = hashlib.sha256(repr((key, serial)).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.arena = Arena(POOL, label="fuzz")
        self.store = Store(self.arena, clock=self.clock, lease_ttl=LEASE_TTL, reservation_ttl=RESERVATION_TTL,
                           read_ttl=READ_TTL, max_leases_per_owner=MAX_LEASES_PER_OWNER)
        self.model = Model()
        self.serial = 0

    def teardown(self) -> None:
        self.store.close()
        self.arena.close()

    # ---- the model's view of time ------------------------------------------------------------

    def _expire_model(self) -> None:
        now = self.clock.now
        m = self.model
        m.leases = {i: lease for i, lease in m.leases.items() if lease.expires_at > now}
        m.reads = {i: read for i, read in m.reads.items() if read.expires_at > now}
        m.writes = {i: w for i, w in m.writes.items() if w.expires_at > now}

    def _end_model_lease_for_new(self, owner: str, group: int) -> None:
        """What a leased lookup ends first: the owner's lease of that group."""
        for lease_id, lease in list(self.model.leases.items()):
            if lease.owner == owner and lease.group == group:
                del self.model.leases[lease_id]

    # ---- rules -------------------------------------------------------------------------------

    @initialize(sizes=st.lists(st.sampled_from(SIZES), min_size=4, max_size=4))
    def fill(self, sizes: list[int]) -> None:
        """Start from a pool mostly full, so that writes soon evict and leases soon pin what eviction wants."""
        self.put("a", NAMESPACES[0], HASHES[:4], [PAGE] * 4)
        self.put("b", NAMESPACES[1], HASHES[4:], sizes)

    @rule(owner=st.sampled_from(OWNERS), namespace=st.sampled_from(NAMESPACES), hashes=hash_runs,
          sizes=st.lists(st.sampled_from(SIZES), min_size=4, max_size=4))
    def reserve(self, owner: str, namespace: str, hashes: list[bytes], sizes: list[int]) -> None:
        keys = [StoreKey(namespace, LEAF, 0, h) for h in hashes]
        sizes = sizes[:len(keys)]
        held_before = {k for k in keys if k in self.store.blocks}
        reserved_before = {k for k in keys if k in self.store.reserved_keys}
        res, statuses = self.store.reserve(owner, keys, sizes)
        self._expire_model()  # (reserve expires first)
        assert len(statuses) == len(keys)
        slots = []
        for key, status in zip(keys, statuses):
            if status == EXISTS:
                assert key in held_before
            elif status == BUSY:
                assert key in reserved_before
            else:  # a key held before may have been evicted to make room for an earlier key of this request
                assert status in (WRITE, FULL) and key not in reserved_before
                assert status == FULL or key not in self.store.blocks
        for key, offset, size in zip(res.keys, res.offsets, res.sizes):
            self.serial += 1
            data = _bytes_for(key, size, self.serial)
            if size:
                self.arena.slot(key.namespace, offset, size)[:] = data
            slots.append((key, offset, data))
        assert [s for s in statuses if s == WRITE] == [WRITE] * len(slots)
        self.model.writes[res.write_id] = ModelWrite(owner, slots, self.clock.now + RESERVATION_TTL)
        # the leases the model holds: eviction to make room must have spared them (checked by the invariants)

    @rule(owner=st.sampled_from(OWNERS), namespace=st.sampled_from(NAMESPACES), hashes=hash_runs,
          sizes=st.lists(st.sampled_from(SIZES), min_size=4, max_size=4))
    def put(self, owner: str, namespace: str, hashes: list[bytes], sizes: list[int]) -> None:
        """A whole write: reserve, fill, commit (the common path, and what fills the pool)."""
        self.reserve(owner, namespace, hashes, sizes)
        self._commit(max(self.model.writes))

    @precondition(lambda self: self.model.writes)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        self._commit(data.draw(st.sampled_from(sorted(self.model.writes))))

    def _commit(self, write_id: int) -> None:
        write = self.model.writes.pop(write_id)
        committed = self.store.commit(write_id, write.owner)
        assert committed == [key for key, _, _ in write.slots]
        for key, _, written in write.slots:
            self.model.committed[key] = written

    @precondition(lambda self: self.model.writes)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        write_id = data.draw(st.sampled_from(sorted(self.model.writes)))
        del self.model.writes[write_id]
        assert self.store.abort(write_id)

    @rule(owner=st.sampled_from(OWNERS), group=st.integers(0, 2), namespace=st.sampled_from(NAMESPACES),
          hashes=hash_runs)
    def lookup_with_lease(self, owner: str, group: int, namespace: str, hashes: list[bytes]) -> None:
        masks, lease = self.store.lookup(namespace, hashes, [LEAF], 1, owner=owner, group=group)
        self._expire_model()
        self._end_model_lease_for_new(owner, group)
        found = {StoreKey(namespace, LEAF, 0, h) for h, hit in zip(hashes, masks[LEAF]) if hit}
        for key in found:
            assert key in self.model.committed, f"{key} is visible but was never committed"
        for h, hit in zip(hashes, masks[LEAF]):
            assert hit == (StoreKey(namespace, LEAF, 0, h) in self.store.blocks)
        if not found:
            assert lease is None, "a lookup that finds nothing grants no lease"
            return
        assert lease is not None and set(lease.keys) == found
        owned = [i for i, held in self.model.leases.items() if held.owner == owner]
        while len(owned) >= MAX_LEASES_PER_OWNER:  # one more ends the owner's oldest
            del self.model.leases[owned.pop(0)]
        self.model.leases[lease.lease_id] = ModelLease(owner, group, frozenset(found),
                                                       self.clock.now + LEASE_TTL)

    @precondition(lambda self: self.store.blocks)
    @rule(owner=st.sampled_from(OWNERS), group=st.integers(0, 2), data=st.data())
    def lookup_held_blocks(self, owner: str, group: int, data: st.DataObject) -> None:
        """A leased lookup of blocks the store holds: what pins blocks a later write would like to evict."""
        namespace = data.draw(st.sampled_from(sorted({k.namespace for k in self.store.blocks})))
        held = sorted(k.hash for k in self.store.blocks if k.namespace == namespace)
        hashes = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True))
        self.lookup_with_lease(owner, group, namespace, hashes)

    @precondition(lambda self: self.model.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.model.leases)))
        del self.model.leases[lease_id]
        assert self.store.end_lease(lease_id)

    @precondition(lambda self: self.model.leases)
    @rule(data=st.data(), end_now=st.booleans(), end_lease=st.booleans())
    def read(self, data: st.DataObject, end_now: bool, end_lease: bool) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.model.leases)))
        lease = self.model.leases[lease_id]
        keys = data.draw(st.lists(st.sampled_from(sorted(lease.keys)), min_size=1, max_size=4))
        plan = self.store.begin_read(lease_id, lease.owner, keys)
        self._expire_model()
        for key, slot in zip(keys, plan.slots):
            assert slot.size == len(self.model.committed[key])
            got = bytes(self.arena.slot(key.namespace, slot.offset, slot.size)) if slot.size else b""
            assert got == self.model.committed[key], f"{key} reads back other bytes than were committed"
        if end_lease:
            del self.model.leases[lease_id]
            assert self.store.end_lease(lease_id)
        if end_now:
            assert self.store.end_read(plan.read_id)
        else:
            self.model.reads[plan.read_id] = ModelRead(lease.owner, frozenset(keys), self.clock.now + READ_TTL)

    @precondition(lambda self: self.model.reads)
    @rule(data=st.data())
    def end_read(self, data: st.DataObject) -> None:
        read_id = data.draw(st.sampled_from(sorted(self.model.reads)))
        del self.model.reads[read_id]
        assert self.store.end_read(read_id)

    @rule(owner=st.sampled_from(OWNERS), namespace=st.sampled_from(NAMESPACES), hashes=hash_runs)
    def read_under_a_lease_not_held_is_refused(self, owner: str, namespace: str, hashes: list[bytes]) -> None:
        held = {i for i, lease in self.model.leases.items() if lease.owner == owner}
        lease_id = max(self.store.leases, default=0) + 1000  # never granted
        keys = [StoreKey(namespace, LEAF, 0, h) for h in hashes]
        try:
            self.store.begin_read(lease_id, owner, keys)
        except LeaseExpired:
            pass
        else:
            raise AssertionError(f"read under lease {lease_id} (owner {owner} holds {held}) was served")
        self._expire_model()

    @rule(namespace=st.sampled_from(NAMESPACES), hashes=hash_runs)
    def touch(self, namespace: str, hashes: list[bytes]) -> None:
        found = self.store.touch(namespace, hashes, [LEAF], 1)
        assert found == sum(StoreKey(namespace, LEAF, 0, h) in self.store.blocks for h in hashes)

    @rule(owner=st.sampled_from(OWNERS))
    def drop_owner(self, owner: str) -> None:
        self.store.drop_owner(owner)
        m = self.model
        m.leases = {i: lease for i, lease in m.leases.items() if lease.owner != owner}
        m.writes = {i: w for i, w in m.writes.items() if w.owner != owner}
        m.reads = {i: r for i, r in m.reads.items() if r.owner != owner}

    @rule(namespace=st.sampled_from(NAMESPACES))
    def clear(self, namespace: str) -> None:
        pinned = {k for k, b in self.store.blocks.items() if b.pins and k.namespace == namespace}
        self.store.clear(namespace)
        assert {k for k in self.store.blocks if k.namespace == namespace} == pinned

    @rule(seconds=st.sampled_from([0.5, 3.0, 9.0, 11.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        self.store.expire()
        self._expire_model()

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def committed_blocks_read_back_exactly(self) -> None:
        for key, block in self.store.blocks.items():
            assert key in self.model.committed, f"{key} is indexed but was never committed"
            assert block.on_host  # no disk tier here
            want = self.model.committed[key]
            got = bytes(self.arena.slot(key.namespace, block.offset, block.size)) if block.size else b""
            assert got == want, f"{key}: its slot holds other bytes than were committed"

    @invariant()
    def the_column_index_holds_exactly_the_indexed_blocks(self) -> None:
        by_column: dict[tuple[str, str, int], dict[bytes, object]] = {}
        for key, block in self.store.blocks.items():
            by_column.setdefault((key.namespace, key.leaf, key.shard), {})[key.hash] = block
        assert self.store.columns.keys() == by_column.keys(), "a column without blocks, or blocks without one"
        for column, blocks in by_column.items():
            held = self.store.columns[column]
            assert held.keys() == blocks.keys() and all(held[h] is b for h, b in blocks.items()), column

    @invariant()
    def uncommitted_blocks_are_invisible(self) -> None:
        for write in self.model.writes.values():
            for key, _, _ in write.slots:
                assert key not in self.store.blocks
                assert self.store.presence(key.namespace, [key.hash], [LEAF], 1) == {LEAF: [False]}
        assert set(self.store.reserved_keys) == {k for w in self.model.writes.values() for k, _, _ in w.slots}

    @invariant()
    def held_blocks_are_never_evicted_and_pinned_exactly(self) -> None:
        assert set(self.store.leases) == set(self.model.leases), "live leases differ from the model's"
        assert set(self.store.reads) == set(self.model.reads), "open reads differ from the model's"
        pins: dict[StoreKey, int] = {}
        for holder in (*self.model.leases.values(), *self.model.reads.values()):
            for key in holder.keys:
                assert key in self.store.blocks, f"{key} was evicted while a lease or read held it"
                pins[key] = pins.get(key, 0) + 1
        for key, block in self.store.blocks.items():
            assert block.pins == pins.get(key, 0), f"{key} has {block.pins} pins, its holders {pins.get(key, 0)}"
        assert self.store.pinned_blocks == len(pins)

    @invariant()
    def each_recency_heap_is_a_heap_with_one_live_entry_per_host_block(self) -> None:
        """A use's entries are appended, not pushed (dkv.store.Store._stamp_blocks): the heap must stay one."""
        live: dict[StoreKey, int] = {}
        for usage in self.store._tenants.values():
            heap = usage.heap
            for child in range(1, len(heap)):
                assert heap[(child - 1) // 2] <= heap[child], f"recency heap order broken at entry {child}"
            for _, _, order, block in heap:
                assert block.indexed == (self.store.blocks.get(block.key) is block), "a block's indexed flag is wrong"
                if block.indexed and block.on_host and block.order == order:
                    live[block.key] = live.get(block.key, 0) + 1
        assert live == {key: 1 for key, block in self.store.blocks.items() if block.on_host}
        assert all(block.indexed for block in self.store.blocks.values())

    @invariant()
    def pool_accounting_is_exact_and_no_slot_is_handed_out_twice(self) -> None:
        slots = [(b.key.namespace, b.offset, slot_cost(b.size)) for b in self.store.blocks.values() if b.size]
        slots += [(k.namespace, offset, slot_cost(len(data))) for w in self.model.writes.values()
                  for k, offset, data in w.slots if data]
        used = sum(cost for _, _, cost in slots)
        free, total = self.store.host_bytes()
        assert total == POOL and used <= POOL
        assert free == POOL - used, f"the arena says {POOL - free} bytes used, the slots add up to {used}"
        for namespace in NAMESPACES:
            runs = sorted((offset, offset + cost) for ns, offset, cost in slots if ns == namespace)
            for (_, end), (start, _) in zip(runs, runs[1:]):
                assert end <= start, f"two slots overlap in {namespace}: {runs}"


StoreMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=50)
test_store_operations_keep_their_contracts = StoreMachine.TestCase
