"""The block store: index, two-phase writes, leases, prefix-aware eviction, disk spill.

The store decides; it does no network I/O (httpcore's rule: the pool assigns
state, the caller moves bytes). The server asks it for a plan, moves the
bytes, then reports back (``commit``, ``end_lease``). Everything runs on the
node's single event-loop thread, so there are no locks.

Contracts (DESIGN.md §3):

* **Visibility (3).** A block is present only after :meth:`commit`; a
  reservation that is aborted, expires or whose owner disconnects frees its
  slots and leaves nothing behind.
* **Presence (4).** A leaf's mask is True for a hash only when every shard
  ``0..shards-1`` of that leaf holds it.
* **Leases (5).** A leased lookup pins what it reported. The lease ends on
  :meth:`end_lease` (load done or abandoned), the owner's next leased lookup
  for the same group, expiry (TTL), or :meth:`drop_owner`. An owner holds at
  most ``max_leases_per_owner`` leases; one more ends its oldest. A pinned
  block is never evicted.
* **Eviction (7).** Each offload (commit), touch or loaded lookup (read)
  stamps its blocks with one recency stamp; the oldest stamp evicts first and,
  within a stamp, the deepest block (largest position in the caller's run)
  first. A touch of the whole chain therefore keeps the root last to go.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dkv.arena import Arena, align_up
from dkv.disk_tier import DiskTier
from dkv.errors import LeaseExpired, WriteRejected

DEFAULT_LEASE_TTL = 10.0
DEFAULT_RESERVATION_TTL = 30.0
DEFAULT_MAX_LEASES_PER_OWNER = 64
MAX_BLOCK_SIZE = 256 * 2**20


class StoreKey(NamedTuple):
    """A block's full identity: ``(namespace, leaf_id, tp_shard, hash)`` (contract 2)."""

    namespace: str
    leaf: str
    shard: int
    hash: bytes


@dataclass(slots=True)
class Block:
    key: StoreKey
    size: int
    offset: int  # arena offset while on the host tier, -1 when only on disk
    stamp: int = 0
    depth: int = 0
    pins: int = 0  # leases holding it
    order: int = 0  # bumps on every restamp; stale heap entries are skipped

    @property
    def on_host(self) -> bool:
        return self.offset >= 0


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: str
    group: int
    keys: dict[StoreKey, int]  # key -> depth in the looked-up run
    expires_at: float


@dataclass(slots=True)
class Reservation:
    write_id: int
    owner: str
    keys: list[StoreKey]
    offsets: list[int]
    sizes: list[int]
    expires_at: float


class SlotPlan(NamedTuple):
    """Where a block's bytes live in the arena (a zero-byte block owns no slot)."""

    offset: int
    size: int


WRITE = "write"  # reserved for this writer: send the bytes
EXISTS = "exists"  # already committed: nothing to send
BUSY = "busy"  # another writer holds it: nothing to send
FULL = "full"  # no room even after eviction: nothing to send


@dataclass
class StoreCounters:
    """Monotonic counters the node reports in ``stats``."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    commits: int = 0
    aborted_writes: int = 0
    evictions: int = 0
    spills: int = 0
    disk_hits: int = 0
    disk_drops: int = 0
    leases_granted: int = 0
    leases_expired: int = 0
    leases_dropped_over_limit: int = 0
    reads_refused: int = 0
    touches: int = 0
    full_refusals: int = 0


@dataclass
class Store:
    """Index of committed blocks plus reservations and leases over one :class:`Arena`."""

    arena: Arena
    disk: DiskTier | None = None
    lease_ttl: float = DEFAULT_LEASE_TTL
    reservation_ttl: float = DEFAULT_RESERVATION_TTL
    max_leases_per_owner: int = DEFAULT_MAX_LEASES_PER_OWNER
    clock: Callable[[], float] = time.monotonic
    on_commit: list[Callable[[list[StoreKey]], None]] = field(default_factory=list)
    on_evict: list[Callable[[list[StoreKey]], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.blocks: dict[StoreKey, Block] = {}
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        self.reserved_keys: dict[StoreKey, int] = {}
        self.counters = StoreCounters()
        self._group_lease: dict[tuple[str, int], int] = {}
        self._owner_leases: dict[str, dict[int, None]] = {}
        self._heap: list[tuple[int, int, int, StoreKey]] = []
        self._stamps = itertools.count(1)
        self._ids = itertools.count(1)
        self._orders = itertools.count(1)

    # ---- presence ---------------------------------------------------------------------------

    def presence(self, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int) -> dict[str, list[bool]]:
        """Per leaf, a mask over ``hashes``: True when all ``shards`` shards hold the block."""
        blocks = self.blocks
        return {
            leaf: [all(StoreKey(namespace, leaf, s, h) in blocks for s in range(shards)) for h in hashes]
            for leaf in leaves
        }

    def lookup(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        leaves: Sequence[str],
        shards: int,
        *,
        owner: str | None = None,
        group: int = 0,
    ) -> tuple[dict[str, list[bool]], Lease | None]:
        """Presence masks; with ``owner``, also a lease pinning every block reported present.

        A leased lookup first ends the owner's previous lease for ``group``
        (back-to-back lookups never stack), and brings spilled blocks back into
        the host pool (a block that cannot be brought back is reported absent).
        """
        self.expire()
        self.counters.lookups += 1
        if owner is not None:
            previous = self._group_lease.get((owner, group))
            if previous is not None:
                self.end_lease(previous)
        masks = self.presence(namespace, hashes, leaves, shards)
        lease = None
        if owner is not None:
            pinned: dict[StoreKey, int] = {}
            for leaf, mask in masks.items():
                for depth, (h, present) in enumerate(zip(hashes, mask)):
                    if not present:
                        continue
                    keys = [StoreKey(namespace, leaf, s, h) for s in range(shards)]
                    if all(self._pin_on_host(k, pinned) for k in keys):
                        for k in keys:
                            pinned[k] = depth
                    else:
                        mask[depth] = False
            lease = self._grant(owner, group, pinned)
        hit = sum(m.count(True) for m in masks.values())
        self.counters.hits += hit
        self.counters.misses += len(hashes) * len(masks) - hit
        return masks, lease

    def _pin_on_host(self, key: StoreKey, pinned: dict[StoreKey, int]) -> bool:
        """Make ``key`` resident on the host tier (promoting from disk) and pin it for a lease."""
        if key in pinned:
            return True
        block = self.blocks.get(key)
        if block is None:
            return False
        if not block.on_host:
            if not self._promote(block):
                return False
        block.pins += 1
        pinned[key] = 0
        return True

    def _grant(self, owner: str, group: int, pinned: dict[StoreKey, int]) -> Lease:
        owned = self._owner_leases.setdefault(owner, {})
        while len(owned) >= self.max_leases_per_owner:
            self.counters.leases_dropped_over_limit += 1
            self.end_lease(next(iter(owned)))
        lease = Lease(next(self._ids), owner, group, pinned, self.clock() + self.lease_ttl)
        self.leases[lease.lease_id] = lease
        owned[lease.lease_id] = None
        self._group_lease[(owner, group)] = lease.lease_id
        self.counters.leases_granted += 1
        return lease

    # ---- reads under a lease ----------------------------------------------------------------

    def read_plan(self, lease_id: int, owner: str, keys: Sequence[StoreKey]) -> list[SlotPlan]:
        """Slots to read ``keys`` from; every key must be pinned by ``owner``'s live lease.

        Stamps the keys (a loaded lookup counts as use). Raises
        :class:`LeaseExpired` when the lease is gone or does not cover a key.
        """
        self.expire()
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            self.counters.reads_refused += 1
            raise LeaseExpired("lease_expired", f"lease {lease_id} is not held (expired, ended or never granted)")
        missing = [k for k in keys if k not in lease.keys]
        if missing:
            self.counters.reads_refused += 1
            raise LeaseExpired("lease_expired", f"{len(missing)} requested block(s) are not covered by lease {lease_id}")
        plans = [SlotPlan(self.blocks[k].offset, self.blocks[k].size) for k in keys]
        self._stamp((k, lease.keys[k]) for k in keys)
        return plans

    def end_lease(self, lease_id: int) -> bool:
        """End a lease and unpin its blocks; False if it was not held. Idempotent."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        for key in lease.keys:
            block = self.blocks.get(key)
            if block is not None:
                block.pins -= 1
        self._owner_leases.get(lease.owner, {}).pop(lease_id, None)
        if self._group_lease.get((lease.owner, lease.group)) == lease_id:
            del self._group_lease[(lease.owner, lease.group)]
        return True

    # ---- two-phase writes -------------------------------------------------------------------

    def reserve(self, owner: str, keys: Sequence[StoreKey], sizes: Sequence[int]) -> tuple[Reservation, list[str]]:
        """Reserve slots for the keys not yet held; returns the reservation and a status per key.

        Status is :data:`WRITE` (send the bytes into the planned slot),
        :data:`EXISTS`, :data:`BUSY` (another writer holds the key) or
        :data:`FULL`. Reserved keys are invisible until :meth:`commit`.
        """
        if len(keys) != len(sizes):
            raise WriteRejected("write_rejected", "keys and sizes differ in length")
        self.expire()
        res = Reservation(next(self._ids), owner, [], [], [], self.clock() + self.reservation_ttl)
        statuses: list[str] = []
        for key, size in zip(keys, sizes):
            if not isinstance(size, int) or not 0 <= size <= MAX_BLOCK_SIZE:
                self._abort(res)
                raise WriteRejected("write_rejected", f"block size {size!r} outside [0, {MAX_BLOCK_SIZE}]")
            if key in self.blocks:
                statuses.append(EXISTS)
            elif key in self.reserved_keys:
                statuses.append(BUSY)
            else:
                offset = self._alloc(size)
                if offset is None:
                    self.counters.full_refusals += 1
                    statuses.append(FULL)
                    continue
                res.keys.append(key)
                res.offsets.append(offset)
                res.sizes.append(size)
                self.reserved_keys[key] = res.write_id
                statuses.append(WRITE)
        self.reservations[res.write_id] = res
        return res, statuses

    def commit(self, write_id: int, owner: str) -> list[StoreKey]:
        """Make a reservation's blocks visible, stamped as one use in key order; returns them."""
        res = self.reservations.get(write_id)
        if res is None or res.owner != owner:
            raise WriteRejected("write_rejected", f"write {write_id} is not reserved (expired or aborted)")
        del self.reservations[write_id]
        stamp = next(self._stamps)
        for depth, (key, offset, size) in enumerate(zip(res.keys, res.offsets, res.sizes)):
            del self.reserved_keys[key]
            block = Block(key, size, offset)
            self.blocks[key] = block
            self._restamp(block, stamp, depth)
        self.counters.commits += len(res.keys)
        for callback in self.on_commit:
            callback(list(res.keys))
        return res.keys

    def abort(self, write_id: int) -> bool:
        """Drop a reservation and free its slots; False if it was not held. Idempotent."""
        res = self.reservations.pop(write_id, None)
        if res is None:
            return False
        self._abort(res)
        return True

    def _abort(self, res: Reservation) -> None:
        self.counters.aborted_writes += len(res.keys)
        for key, offset, size in zip(res.keys, res.offsets, res.sizes):
            self.reserved_keys.pop(key, None)
            self._free(offset, size)

    # ---- recency ----------------------------------------------------------------------------

    def touch(self, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int) -> int:
        """Stamp the held blocks among ``hashes`` as one use (depth = position); returns how many."""
        self.counters.touches += 1
        found = [
            (key, depth)
            for depth, h in enumerate(hashes)
            for leaf in leaves
            for s in range(shards)
            if (key := StoreKey(namespace, leaf, s, h)) in self.blocks
        ]
        self._stamp(found)
        return len(found)

    def _stamp(self, keyed_depths: Iterable[tuple[StoreKey, int]]) -> None:
        stamp = next(self._stamps)
        for key, depth in keyed_depths:
            self._restamp(self.blocks[key], stamp, depth)

    def _restamp(self, block: Block, stamp: int, depth: int) -> None:
        block.stamp, block.depth, block.order = stamp, depth, next(self._orders)
        if block.on_host:
            heapq.heappush(self._heap, (stamp, -depth, block.order, block.key))

    # ---- ownership and expiry -------------------------------------------------------------

    def drop_owner(self, owner: str) -> None:
        """A client vanished: end its leases and abort its reservations."""
        for lease_id in list(self._owner_leases.pop(owner, {})):
            self.end_lease(lease_id)
        for res in [r for r in self.reservations.values() if r.owner == owner]:
            self.abort(res.write_id)

    def expire(self) -> None:
        """End leases and reservations whose TTL has passed."""
        now = self.clock()
        for lease in [x for x in self.leases.values() if x.expires_at <= now]:
            self.counters.leases_expired += 1
            self.end_lease(lease.lease_id)
        for res in [r for r in self.reservations.values() if r.expires_at <= now]:
            self.abort(res.write_id)

    # ---- space ------------------------------------------------------------------------------

    def _alloc(self, size: int) -> int | None:
        """A slot for ``size`` bytes, evicting unpinned blocks oldest-first until one frees."""
        if size == 0:
            return 0  # a zero-byte block owns no slot
        if align_up(size) > self.arena.allocator.capacity:
            return None
        evicted: list[StoreKey] = []
        try:
            while (offset := self.arena.allocator.alloc(size)) is None:
                victim = self._next_victim()
                if victim is None:
                    return None
                if self._evict_from_host(victim):
                    evicted.append(victim.key)
            return offset
        finally:
            if evicted:
                self._notify_evicted(evicted)

    def _free(self, offset: int, size: int) -> None:
        if offset >= 0 and size > 0:
            self.arena.allocator.free(offset, size)

    def _next_victim(self) -> Block | None:
        """Pop the oldest-stamp, deepest unpinned host block; pinned ones are put back."""
        skipped = []
        victim = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            block = self.blocks.get(entry[3])
            if block is None or block.order != entry[2] or not block.on_host:
                continue  # stale entry
            if block.pins > 0:
                skipped.append(entry)
                continue
            victim = block
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return victim

    def _evict_from_host(self, block: Block) -> bool:
        """Move ``block`` off the host tier: spill to disk if there is one, else drop it.

        Returns True when the block left the store entirely (so it must be unpublished).
        """
        self.counters.evictions += 1
        if self.disk is not None and block.size > 0:
            dropped = self.disk.put(block.key, self.arena.slot(block.offset, block.size))
            self._drop_disk_blocks(dropped)
            if block.key in self.disk:
                self.counters.spills += 1
                self._free(block.offset, block.size)
                block.offset = -1
                return False
        del self.blocks[block.key]
        self._free(block.offset, block.size)
        return True

    def _drop_disk_blocks(self, keys: list) -> None:
        gone = []
        for key in keys:
            block = self.blocks.get(key)
            if block is not None and not block.on_host:
                del self.blocks[key]
                gone.append(key)
        self.counters.disk_drops += len(gone)
        if gone:
            self._notify_evicted(gone)

    def _promote(self, block: Block) -> bool:
        """Read a spilled block back into a host slot; False (and still spilled) if there is no room."""
        assert self.disk is not None
        data = bytearray(block.size)
        self.disk.read_into(block.key, memoryview(data))
        self.disk.remove(block.key)  # so that making room cannot drop it from the disk tier
        offset = self._alloc(block.size)
        if offset is None:
            self._drop_disk_blocks(self.disk.put(block.key, memoryview(data)))
            if block.key not in self.disk:
                del self.blocks[block.key]
                self._notify_evicted([block.key])
            return False
        self.arena.slot(offset, block.size)[:] = data
        block.offset = offset
        self.counters.disk_hits += 1
        heapq.heappush(self._heap, (block.stamp, -block.depth, block.order, block.key))
        return True

    def _notify_evicted(self, keys: list[StoreKey]) -> None:
        for callback in self.on_evict:
            callback(keys)

    # ---- accounting -------------------------------------------------------------------------

    def host_bytes(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the host pool (reserved slots count as used)."""
        allocator = self.arena.allocator
        return allocator.free_bytes, allocator.capacity

    def disk_bytes(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the disk tier; ``(0, 0)`` when there is none."""
        if self.disk is None:
            return 0, 0
        return self.disk.free, self.disk.capacity

    def clear(self, namespace: str) -> int:
        """Drop every unpinned block of ``namespace`` (``reset_prefix_cache``); returns how many."""
        victims = [b for b in self.blocks.values() if b.pins == 0 and b.key.namespace == namespace]
        for block in victims:
            del self.blocks[block.key]
            if block.on_host:
                self._free(block.offset, block.size)
            elif self.disk is not None:
                self.disk.remove(block.key)
        if victims:
            self._notify_evicted([b.key for b in victims])
        return len(victims)

    def close(self) -> None:
        """Release everything (node shutdown); the arena and disk tier are closed by their owner."""
        self.leases.clear()
        self.reservations.clear()
        self.reserved_keys.clear()
        self.blocks.clear()
        self._heap.clear()
