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
* **Reads pin for themselves (DESIGN §6).** :meth:`begin_read` checks the
  lease and then takes the read's *own* pins on its blocks, which last until
  :meth:`end_read` (the bytes have left: sent, or copied by a same-host
  client), the read's TTL, or :meth:`drop_owner` of the reading connection —
  whatever happens to the lease meanwhile. :meth:`end_read` says whether the
  pins were still held when the read ended: a same-host copy that finished
  after its read expired cannot be proven intact and must be failed.
* **Eviction (7).** Each offload (commit), touch or loaded lookup (read)
  stamps its blocks with one recency stamp; the oldest stamp evicts first and,
  within a stamp, the deepest block (largest position in the caller's run)
  first. A touch of the whole chain therefore keeps the root last to go.
* **Disk tier (DESIGN §6: the store decides, the server moves).** An evicted
  host block is copied into bounded staging memory, its slot freed at once,
  and a :class:`~dkv.spill.SpillJob` queued (:meth:`take_spill`); the server
  writes the file off the event loop and reports back (:meth:`finish_spill`).
  No room in staging or on disk: the block is dropped instead, never waited
  for. A leased lookup promotes staged blocks from memory and on-disk blocks
  only from bytes the server read beforehand (:meth:`disk_reads`, then
  ``lookup(promoted=...)``). A failed write or read drops the block
  (unpublished). No error path leaks a reservation, a pin, a slot or disk
  space. A failed spill write also degrades the tier (disk full, directory
  gone, I/O error): evictions then drop their blocks instead of staging them
  (memory only), but for one probe spill per retry interval; a written spill
  ends the degradation. A vanished directory loses every file in it: those
  blocks are dropped and unpublished at once (:meth:`disk_vanished`).
* **Bounds and quotas (no client exhausts the node).** Every block is
  charged to the credential that wrote it (``tenant``; ``""`` is the cluster
  credential), and each credential keeps its own recency heap; the node's
  eviction takes the oldest top across them, so the order above is kept.
  ``max_blocks`` bounds the blocks on every tier plus reserved keys (a
  zero-byte block holds no bytes but costs memory and a directory entry);
  reaching it drops the oldest blocks. Uncommitted reservations are bounded
  per connection and per credential, in bytes and keys: beyond, a key is
  FULL and nobody's block is evicted for it. A credential over its
  ``max_stored_bytes`` or ``max_blocks`` makes room from its own blocks
  only. Leases: per client, per credential (one more ends its oldest) and
  per node (:class:`NodeBusy`). See :meth:`reserve` and :meth:`lookup`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import operator
import struct
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dkv.arena import PAGE, Arena, align_up
from dkv.disk_tier import MISSING, DiskEntry, DiskTier, fault_of
from dkv.credentials import Quotas
from dkv.errors import LeaseExpired, NodeBusy, WriteRejected
from dkv.spill import DEFAULT_STAGING_BYTES, SpillJob, Staging
from dkv.store_runs import (bind, live_entries, pin_all, pin_run, pin_run_shards, slot_entry, slot_map, stamp_run,
                             unpin_all)

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = 10.0
# A reservation lives from the write's reply to its commit: one op on the listener path (bounded by the
# node's op timeout, 10 s), a memory copy on the same-host path. 15 s outlasts both with a margin, and halves
# how long a writer that reserves and then stalls (connection open, no commit) holds its share of the pool.
DEFAULT_RESERVATION_TTL = 15.0
DEFAULT_READ_TTL = 30.0
DEFAULT_MAX_LEASES_PER_OWNER = 64
DEFAULT_MAX_LEASES = 65536  # leases the whole node may hold (all clients, all credentials)
DEFAULT_MAX_LEASES_PER_TENANT = 8192  # leases one credential's clients may hold together
BLOCKS_PER_POOL_BYTES = 16 * 1024  # default max_blocks: one block per 16 KiB of pool ...
MIN_MAX_BLOCKS = 16384  # ... and never fewer than this
RESERVED_FLOOR_PER_OWNER = 256 * 2**20  # a connection may always reserve this much (one ordinary write) ...
RESERVED_FLOOR_PER_TENANT = 512 * 2**20  # ... and a credential this much, however small the pool's fractions
# reserved keys (a zero-byte key holds no bytes): a connection max_blocks/8, a credential max_blocks/4, with floors
RESERVED_KEYS_FLOOR_PER_OWNER = 1024
RESERVED_KEYS_FLOOR_PER_TENANT = 2048
MAX_BLOCK_SIZE = 256 * 2**20
HEAP_SLACK = 1024  # stale recency entries tolerated beyond one per block before a compaction


class StoreKey(NamedTuple):
    """A block's full identity: ``(namespace, leaf_id, tp_shard, hash)`` (contract 2)."""

    namespace: str
    leaf: str
    shard: int
    hash: bytes


TIER_ABSENT, TIER_HOST, TIER_DISK = 0, 1, 2  # where a block lies (:meth:`Store.tiers`)
_SIZE = operator.attrgetter("size")
_OFFSET = operator.attrgetter("offset")
_CHECKSUM = operator.attrgetter("checksum")


@dataclass(slots=True)
class Block:
    key: StoreKey
    size: int
    offset: int  # arena offset while on the host tier, -1 when only on disk
    stamp: int = 0
    depth: int = 0
    pins: int = 0  # leases and reads holding it
    order: int = 0  # bumps on every restamp; stale heap entries are skipped
    checksum: bytes | None = None  # the writer's end-to-end checksum (dkv.checksum); None: written without one
    tenant: str = ""  # the credential that wrote it (its quotas pay for it); "" is the cluster credential
    indexed: bool = False  # in the store's index now (Store._index / _unindex): its recency entries may be live

    @property
    def on_host(self) -> bool:
        return self.offset >= 0

    def __lt__(self, other: Block) -> bool:
        """Never needed: recency entries tie on no ``order`` (each handed out once). Were two to tie, they would
        compare by this rather than raise inside eviction."""
        return id(self) < id(other)


bind(Block)  # the native lookup run reads and writes a Block's slots directly (dkv.store_runs)

# A recency entry: (stamp, -depth, order, block). Live while the block is indexed, on the host tier and of that
# order (each restamp gives it a new one); the block itself, not its key, so that telling a live entry from a
# stale one (stamping, compaction, eviction) reads three fields instead of hashing a key into the index.
Recency = tuple[int, int, int, Block]


@dataclass(slots=True)
class Lease:
    """What a leased lookup pins: each block once (a repeated hash twice), in the order it was found.

    A pinned block stays indexed until its last pin goes (eviction, ``clear``
    and the disk tier all skip pinned blocks), so the lease holds the block
    objects themselves and ends without looking a key up.
    """

    lease_id: int
    owner: str
    group: int
    blocks: list[Block]  # the pinned blocks
    depths: list[int]  # each one's depth in the looked-up run
    expires_at: float
    tenant: str = ""  # the credential of the client that looked up (its lease quota pays for it)
    # (leaf, shard) when the lookup asked for one leaf of one shard: the blocks are then in strictly rising depth
    column: tuple[str, int] | None = None
    _keys: dict[StoreKey, int] | None = None
    _places: dict[tuple[str, int, int], int] | None = None

    @property
    def keys(self) -> dict[StoreKey, int]:
        """key -> its index in :attr:`blocks` and :attr:`depths` (built on first use: a same-host load never needs it).

        One lookup here gives a read everything it needs of a key: whether the
        lease covers it, its block and its depth.
        """
        if self._keys is None:
            self._keys = {block.key: i for i, block in enumerate(self.blocks)}
        return self._keys

    def at_runs(self, runs: Sequence[Sequence[Any]]) -> list[int]:
        """The indices in :attr:`blocks` of the places ``runs`` name, in order; ``KeyError`` for one not held.

        A run ``[leaf, shard, first, stop]`` names the blocks of ``leaf`` and
        ``shard`` whose hashes were at ``first`` .. ``stop - 1`` in the
        lookup's hash list (a block's depth; a hash the lookup named twice is
        held at each of its places where the lookup was of one shard, at its
        last otherwise: :mod:`dkv.store_runs`). A lease of one leaf and one
        shard answers by bisection (its depths rise strictly), any other from a
        map built on first use.
        """
        out: list[int] = []
        column, depths = self.column, self.depths
        for leaf, shard, first, stop in runs:
            count = stop - first
            if count <= 0:
                raise KeyError((leaf, shard, first))
            if column is not None:
                if (leaf, shard) != column:
                    raise KeyError((leaf, shard, first))
                at = bisect.bisect_left(depths, first)
                if at + count > len(depths) or depths[at] != first or depths[at + count - 1] != stop - 1:
                    raise KeyError((leaf, shard, first))
                out += range(at, at + count)  # rising integers, first and last as asked: every depth between
                continue
            if self._places is None:
                self._places = {(block.key.leaf, block.key.shard, depth): i
                                for i, (block, depth) in enumerate(zip(self.blocks, depths))}
            places = self._places
            out += [places[(leaf, shard, depth)] for depth in range(first, stop)]
        return out


Use = tuple[list[Block], list[int]]  # one use still to be stamped: blocks and their depths (see Store.stamp_uses)


@dataclass(slots=True)
class Read:
    """A read in flight: its own pins on its blocks, held until its bytes have left."""

    read_id: int
    owner: str  # the connection moving the bytes
    # its blocks, each pinned once per entry by this read (so each stays indexed until it ends): distinct, but for
    # one made of a lease (Store.lease_into_read), which holds a block its lookup found twice twice
    blocks: list[Block]
    expires_at: float


@dataclass(slots=True)
class Reservation:
    write_id: int
    owner: str
    keys: list[StoreKey]
    offsets: list[int]
    sizes: list[int]
    expires_at: float
    sums: list[bytes | None] = field(default_factory=list)  # per reserved key: its declared checksum, or None
    tenant: str = ""  # the writer's credential
    reserved_bytes: int = 0  # pool bytes its slots hold (page-aligned), charged to its owner and tenant


@dataclass(slots=True)
class TenantLimits:
    """One credential's bounds on this node, resolved (no ``None``): see :class:`dkv.credentials.Quotas`."""

    stored_bytes: int  # pool bytes its blocks and reservations may hold; beyond, its own oldest blocks go
    reserved_bytes: int  # pool bytes its uncommitted reservations may hold; beyond, FULL
    blocks: int  # blocks (any tier) plus reserved keys; beyond, its own oldest blocks go
    leases: int  # leases its clients may hold together; one more ends its oldest


@dataclass(slots=True)
class TenantUsage:
    """What one credential holds on this node, and its own recency order (DESIGN contract 7, per credential)."""

    name: str
    limits: TenantLimits
    stored_bytes: int = 0  # page-aligned bytes of its blocks on the host tier
    host_blocks: int = 0  # its blocks on the host tier (zero-byte ones included)
    blocks: int = 0  # its blocks on any tier (host, staging, disk)
    reserved_bytes: int = 0  # page-aligned bytes of its live reservations
    reserved_keys: int = 0  # keys of its live reservations
    leases: dict[int, None] = field(default_factory=dict)  # its leases, oldest first
    heap: list[Recency] = field(default_factory=list)  # (stamp, -depth, order, block): see Recency
    off_host: dict[StoreKey, None] = field(default_factory=dict)  # its blocks off the host tier, oldest first

    def stats(self) -> dict[str, int]:
        lim = self.limits
        return {"stored_bytes": self.stored_bytes, "blocks": self.blocks, "blocks_off_host": len(self.off_host),
                "reserved_bytes": self.reserved_bytes, "reserved_blocks": self.reserved_keys,
                "leases": len(self.leases), "max_stored_bytes": lim.stored_bytes,
                "max_reserved_bytes": lim.reserved_bytes, "max_blocks": lim.blocks, "max_leases": lim.leases}


def slot_cost(size: int) -> int:
    """Pool bytes a block of ``size`` bytes holds (page-aligned; a zero-byte block owns no slot)."""
    return (size + _PAGE_MASK) & ~_PAGE_MASK  # align_up, inline (0 stays 0): it runs per key


_PAGE_MASK = PAGE - 1


def default_max_blocks(pool_size: int) -> int:
    """The node's default block bound: one block per 16 KiB of pool, at least :data:`MIN_MAX_BLOCKS`.

    Every indexed block costs node memory (a few hundred bytes: its entry,
    key, recency entry, directory state) and, published, an etcd key, however
    few bytes it holds: a zero-byte block holds none. Real KV blocks are 16 KiB
    or more, so a pool of them fills its bytes before this bound; the index
    stays within about 2-3 % of the pool, and a small pool still takes a few
    thousand small blocks.
    """
    return max(pool_size // BLOCKS_PER_POOL_BYTES, MIN_MAX_BLOCKS)


class SlotPlan(NamedTuple):
    """Where a block's bytes live in the arena (a zero-byte block owns no slot), and its checksum."""

    offset: int
    size: int
    checksum: bytes | None = None


class ReadPlan(NamedTuple):
    """A started read: its id (for :meth:`Store.end_read`) and, per requested key, its slot's offset, size and checksum.

    Kept as columns, which is how a node answers and sends them (the
    listener path sends each run of back-to-back slots as one message).
    """

    read_id: int
    offsets: list[int]
    sizes: list[int]
    checksums: list[bytes | None]

    @property
    def slots(self) -> list[SlotPlan]:
        """One :class:`SlotPlan` per requested key, in order."""
        return list(map(SlotPlan, self.offsets, self.sizes, self.checksums))


class DiskRead(NamedTuple):
    """A spilled block's file that the server may read before a leased lookup (:meth:`Store.disk_reads`)."""

    key: StoreKey
    entry: DiskEntry


class Promoted(NamedTuple):
    """Bytes the server read from ``entry``'s file, handed to :meth:`Store.lookup` to promote."""

    entry: DiskEntry
    data: bytes | bytearray | memoryview


_LEASE, _READ, _RESERVATION = 0, 1, 2  # kinds of expiring items
_INT64 = struct.Struct("q")  # one entry of a packed slot map's offsets or sizes (as array("q") packs them)
SlotMap = tuple[bytes, bytes, bytes]  # per leaf: offsets and sizes (native int64 each), checksums (16 bytes each)


_NOTHING_HELD = (0, 0)  # a connection without reservations: (bytes, keys)

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
    spills: int = 0  # spill files written
    disk_hits: int = 0  # blocks promoted back to the host pool (from staging or from disk)
    disk_drops: int = 0  # on-disk blocks dropped to make room
    spill_drops: int = 0  # evicted blocks dropped, not spilled: staging memory or disk space full
    disk_errors: int = 0  # spill writes or promotion reads that failed (the block is dropped)
    disk_spill_failed: int = 0  # spill writes that failed (the block is dropped; the tier degrades)
    disk_degraded: int = 0  # times the tier went memory only (disk full, directory gone, write errors)
    disk_recovered: int = 0  # times a probe spill was written and the tier spilled again
    disk_degraded_drops: int = 0  # evicted blocks dropped, not staged, while the tier was degraded
    disk_lost: int = 0  # on-disk blocks dropped because the tier's directory vanished (their files with it)
    disk_read_timeouts: int = 0  # leased lookups that stopped waiting for their promotion reads
    leases_granted: int = 0
    leases_expired: int = 0
    leases_dropped_over_limit: int = 0
    reads_refused: int = 0
    reads_expired: int = 0
    touches: int = 0
    full_refusals: int = 0
    quota_refusals: int = 0  # keys answered FULL by a reservation or tenant quota (nobody else's block evicted)
    quota_evictions: int = 0  # blocks a credential over its stored-bytes or block quota lost to its own new ones
    leases_dropped_over_quota: int = 0  # oldest leases of a credential at its lease quota, ended for a new one
    leases_refused: int = 0  # leased lookups refused (NodeBusy): the node held max_leases
    checksum_rejects: int = 0  # reserved blocks not committed: their bytes did not match the declared checksum
    unverified_commits: int = 0  # blocks committed under verification without a declared checksum (old writers)
    # lookups by block (one key: hash x leaf x shard), by the tier a hit came from: "disk" counts the blocks a
    # leased lookup brought back from staging or the disk tier; every other hit (unleased ones too) is "host"
    blocks_hit_host: int = 0
    blocks_hit_disk: int = 0
    blocks_missed: int = 0


@dataclass
class Store:
    """Index of committed blocks plus reservations and leases over one :class:`Arena`."""

    arena: Arena
    disk: DiskTier | None = None
    lease_ttl: float = DEFAULT_LEASE_TTL
    reservation_ttl: float = DEFAULT_RESERVATION_TTL
    read_ttl: float = DEFAULT_READ_TTL
    max_leases_per_owner: int = DEFAULT_MAX_LEASES_PER_OWNER
    clock: Callable[[], float] = time.monotonic
    on_commit: list[Callable[[list[StoreKey]], None]] = field(default_factory=list)
    on_evict: list[Callable[[list[StoreKey]], None]] = field(default_factory=list)
    staging_bytes: int = DEFAULT_STAGING_BYTES  # memory for evicted blocks waiting for their spill write
    on_spill: list[Callable[[], None]] = field(default_factory=list)  # disk work queued (spill or garbage)
    # ---- bounds (see the README's Limits): None derives the default from the pool's size
    max_blocks: int | None = None  # blocks on any tier plus reserved keys, node-wide (default: default_max_blocks)
    max_leases: int = DEFAULT_MAX_LEASES  # leases node-wide; at it, a leased lookup raises NodeBusy
    max_reserved_bytes_per_owner: int | None = None  # one connection's uncommitted reservations (default pool/8)
    # a credential's quotas: ``quotas(name)`` gives its Quotas; a None field there takes these node defaults
    quotas: Callable[[str], Quotas] | None = None
    max_reserved_bytes_per_tenant: int | None = None  # default pool/4
    max_leases_per_tenant: int = DEFAULT_MAX_LEASES_PER_TENANT

    def __post_init__(self) -> None:
        capacity = self.arena.capacity
        if self.max_blocks is None:
            self.max_blocks = default_max_blocks(capacity)
        if self.max_reserved_bytes_per_owner is None:
            self.max_reserved_bytes_per_owner = min(capacity, max(capacity // 8, RESERVED_FLOOR_PER_OWNER))
        if self.max_reserved_bytes_per_tenant is None:
            self.max_reserved_bytes_per_tenant = min(capacity, max(capacity // 4, RESERVED_FLOOR_PER_TENANT))
        # the bounds as reserve() checks them, fixed at construction (like the credentials' quotas)
        self._max_blocks: int = self.max_blocks
        self._owner_reserved_bytes_cap: int = self.max_reserved_bytes_per_owner
        self._owner_keys_cap = min(self.max_blocks, max(self.max_blocks // 8, RESERVED_KEYS_FLOOR_PER_OWNER))
        self._tenant_keys_cap = min(self.max_blocks, max(self.max_blocks // 4, RESERVED_KEYS_FLOOR_PER_TENANT))
        self.max_reserved_keys_per_owner = self._owner_keys_cap  # announced to clients (they split writes)
        self._tenants: dict[str, TenantUsage] = {}
        self._owner_reserved: dict[str, list[int]] = {}  # reservation owner -> [bytes, keys] it holds reserved
        self._off_host: dict[StoreKey, None] = {}  # every block off the host tier, oldest first
        self.blocks: dict[StoreKey, Block] = {}
        # the same blocks by column: (namespace, leaf, shard) -> {hash: block}, kept with ``blocks`` by
        # _index/_unindex/close (a column goes with its last block). A leased lookup's per-key run
        # (dkv.store_runs.pin_run) looks hashes up here: no key tuple built, hashed and compared per hash.
        self.columns: dict[tuple[str, str, int], dict[bytes, Block]] = {}
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        self.reads: dict[int, Read] = {}
        self._owner_reads: dict[str, dict[int, None]] = {}
        self.pinned_blocks = 0  # blocks with pins > 0, kept as pins change
        self._expiries: list[tuple[float, int, int]] = []  # (expires_at, kind, id): leases, reads, reservations
        self.reserved_keys: dict[StoreKey, int] = {}
        self.counters = StoreCounters()
        self._group_lease: dict[tuple[str, int], int] = {}
        self._owner_leases: dict[str, dict[int, None]] = {}
        self._stamps = itertools.count(1)
        self._ids = itertools.count(1)
        self._next_order = 1  # (a counter the native stamp_run advances by a whole use at once)
        self._staging = Staging(self.staging_bytes)

    # ---- credentials: what each holds, its quotas, its own recency order ------------------------

    def _tenant(self, name: str) -> TenantUsage:
        """``name``'s usage, made on first use with its quotas resolved (a credential's quotas do not change)."""
        usage = self._tenants.get(name)
        if usage is None:
            q = self.quotas(name) if self.quotas is not None else Quotas()
            assert self.max_blocks is not None and self.max_reserved_bytes_per_tenant is not None
            limits = TenantLimits(
                stored_bytes=self.arena.capacity if q.max_stored_bytes is None else q.max_stored_bytes,
                reserved_bytes=(self.max_reserved_bytes_per_tenant if q.max_reserved_bytes is None
                                else q.max_reserved_bytes),
                blocks=self.max_blocks if q.max_blocks is None else q.max_blocks,
                leases=self.max_leases_per_tenant if q.max_leases is None else q.max_leases,
            )
            usage = self._tenants[name] = TenantUsage(name, limits)
        return usage

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per credential that has used this node (``""``: the cluster's): what it holds, and its bounds."""
        return {name: usage.stats() for name, usage in self._tenants.items()}

    def _index(self, block: Block) -> None:
        """A new block (on the host tier) enters the index, charged to its credential."""
        key = block.key
        self.blocks[key] = block
        block.indexed = True
        column = self.columns.get(key[:3])
        if column is None:
            column = self.columns[key[:3]] = {}
        column[key.hash] = block
        usage = self._tenant(block.tenant)
        usage.blocks += 1
        usage.host_blocks += 1
        usage.stored_bytes += slot_cost(block.size)

    def _unindex(self, block: Block) -> None:
        """``block`` leaves the index, whatever its tier (the caller frees its slot or its file)."""
        key = block.key
        del self.blocks[key]
        block.indexed = False
        column = self.columns[key[:3]]
        del column[key.hash]
        if not column:
            del self.columns[key[:3]]
        usage = self._tenants[block.tenant]
        usage.blocks -= 1
        if block.on_host:
            usage.host_blocks -= 1
            usage.stored_bytes -= slot_cost(block.size)
        else:
            usage.off_host.pop(block.key, None)
            self._off_host.pop(block.key, None)

    def _left_host(self, block: Block) -> None:
        """``block`` was spilled: off the host tier, still indexed (its slot is the caller's to free)."""
        usage = self._tenants[block.tenant]
        usage.host_blocks -= 1
        usage.stored_bytes -= slot_cost(block.size)
        usage.off_host[block.key] = None
        self._off_host[block.key] = None
        block.offset = -1

    def _back_on_host(self, block: Block, offset: int) -> None:
        """An off-host block was promoted into the slot at ``offset``; it keeps its stamp."""
        usage = self._tenants[block.tenant]
        block.offset = offset
        usage.host_blocks += 1
        usage.stored_bytes += slot_cost(block.size)
        usage.off_host.pop(block.key, None)
        self._off_host.pop(block.key, None)
        block.order = self._take_order()  # any entry left from its time on the host tier is stale
        self._push_recency(usage, block)

    # ---- presence ---------------------------------------------------------------------------

    def presence(self, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int) -> dict[str, list[bool]]:
        """Per leaf, a mask over ``hashes``: True when all ``shards`` shards hold the block."""
        blocks = self.blocks
        if shards == 1:  # the usual shape: one plain-tuple probe per hash (a StoreKey hashes and compares as one)
            return {leaf: [(namespace, leaf, 0, h) in blocks for h in hashes] for leaf in leaves}
        return {
            leaf: [all((namespace, leaf, s, h) in blocks for s in range(shards)) for h in hashes]
            for leaf in leaves
        }

    def tiers(self, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int) -> dict[str, bytes]:
        """Per leaf, one byte per hash: where the block lies (read-only, nothing pinned or stamped).

        :data:`TIER_ABSENT` when a shard is missing (as :meth:`presence` says
        False), :data:`TIER_HOST` when every shard is in the host pool,
        :data:`TIER_DISK` when every shard is held but one at least is off
        the host pool (staged for a spill or on disk: a lookup reads it back first).
        """
        blocks = self.blocks
        out: dict[str, bytes] = {}
        for leaf in leaves:
            row = bytearray(len(hashes))
            for i, h in enumerate(hashes):
                tier = TIER_HOST
                for s in range(shards):
                    block = blocks.get(StoreKey(namespace, leaf, s, h))
                    if block is None:
                        tier = TIER_ABSENT
                        break
                    if not block.on_host:
                        tier = TIER_DISK
                row[i] = tier
            out[leaf] = bytes(row)
        return out

    def lookup(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        leaves: Sequence[str],
        shards: int,
        *,
        owner: str | None = None,
        group: int = 0,
        promoted: Mapping[StoreKey, Promoted] | None = None,
        tenant: str = "",
        slots: dict[str, SlotMap] | None = None,
    ) -> tuple[dict[str, list[bool]], Lease | None]:
        """Presence masks; with ``owner``, also a lease pinning every block reported present.

        With ``slots`` (a dict to fill) a granted lease's slot map is put
        there too, as :meth:`lease_slots` gives it, found in the same pass.

        A leased lookup that finds nothing grants no lease (``None``): there is
        nothing to load, so it costs the owner none of its lease budget.

        Leases are bounded three ways. ``owner`` (a client) holds at most
        ``max_leases_per_owner`` and ``tenant`` (its credential) at most its
        quota: one more ends that owner's, or that credential's, oldest lease.
        The node holds at most ``max_leases``: there a lookup that would need a
        new lease beyond the bound raises :class:`NodeBusy` (nothing pinned,
        nobody's lease ended) rather than end another credential's lease.

        A leased lookup first ends the owner's previous lease for ``group``
        (back-to-back lookups never stack), and brings spilled blocks back into
        the host pool: staged ones from their staging buffer, on-disk ones only
        from ``promoted`` (bytes the server read beforehand, see
        :meth:`disk_reads`; used only while the block is still that file's).
        A block that cannot be brought back is reported absent. No file I/O
        happens here. If anything raises midway, the pins already taken are
        given back and no lease is granted.
        """
        self.expire()
        counters = self.counters
        counters.lookups += 1
        promotions_before = counters.disk_hits
        if owner is not None:
            previous = self._group_lease.get((owner, group))
            if previous is not None:
                self.end_lease(previous)
        lease = None
        if owner is None:
            masks = self.presence(namespace, hashes, leaves, shards)
        else:
            held: list[Block] = []
            depths: list[int] = []
            try:
                masks = self._pin_present(namespace, hashes, leaves, shards, held, depths, promoted, slots)
                column = (leaves[0], 0) if len(leaves) == 1 and shards == 1 else None  # see Lease.at_runs
                lease = self._grant(owner, group, held, depths, tenant, column) if held else None  # nothing found: nothing to hold
                if slots is not None and lease is not None and shards != 1:
                    slots.update(self.lease_slots(lease, namespace, hashes, leaves, shards))
            except BaseException:
                self._unpin_blocks(held)
                raise
        hit = sum(m.count(True) for m in masks.values())
        missed = len(hashes) * len(masks) - hit
        counters.hits += hit
        counters.misses += missed
        from_disk = min(counters.disk_hits - promotions_before, hit * shards)
        counters.blocks_hit_disk += from_disk
        counters.blocks_hit_host += hit * shards - from_disk
        counters.blocks_missed += missed * shards
        return masks, lease

    def _pin_present(self, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int,
                     held: list[Block], depths: list[int], promoted: Mapping[StoreKey, Promoted] | None,
                     slots: dict[str, SlotMap] | None = None) -> dict[str, list[bool]]:
        """Per leaf, the mask of hashes whose every shard is held and now pinned on the host tier.

        Each pinned block goes into ``held`` (its depth into ``depths``) as it
        is pinned, so a caller can give the pins back if this raises midway.
        The work per key is :func:`dkv.store_runs.pin_run` (one shard) or
        :func:`~dkv.store_runs.pin_run_shards` (several), native where built:
        runs of hashes on the host tier, each hash with a spilled block handled
        here between runs (promoted; one that cannot be brought back is
        reported absent; a promotion can evict blocks not yet pinned, so the
        next run fetches the rest afresh). With one shard, ``slots`` (when
        given) then gets each leaf's packed slot map from the same pass; with
        several, :meth:`lookup` asks :meth:`lease_slots` for it.
        """
        blocks, masks = self.blocks, {}
        tally = [0]  # blocks whose pins went from 0 to 1, kept true by the runs even when they raise
        if shards != 1:
            pinned: dict[StoreKey, int] = {}
            count = len(hashes)
            try:
                for leaf in leaves:
                    mask: list[bool] = []
                    at = 0
                    while at < count:  # runs of hashes on the host tier; one with a shard off it is handled here
                        at = pin_run_shards(blocks, namespace, leaf, hashes, shards, at, mask, pinned, tally)
                        if at == count:
                            break
                        keys = [StoreKey(namespace, leaf, s, hashes[at]) for s in range(shards)]
                        present = all(self._pin_on_host(k, pinned, promoted) for k in keys)
                        if present:
                            for k in keys:
                                pinned[k] = at
                        mask.append(present)
                        at += 1
                    masks[leaf] = mask
            finally:  # each pinned once, at its last depth
                self.pinned_blocks += tally[0]
                held.extend(blocks[k] for k in pinned)
                depths.extend(pinned.values())
            return masks
        try:
            for leaf in leaves:
                mask: list[bool] = []
                packed = (bytearray(), bytearray(), bytearray()) if slots is not None else (None, None, None)
                at, count = 0, len(hashes)
                while at < count:  # runs of host-tier blocks; one off the host tier is brought back here
                    column = self.columns.get((namespace, leaf, 0)) or {}  # (re-read: a promotion may evict)
                    at = pin_run(column, hashes, at, mask, held, depths, tally, *packed)
                    if at == count:
                        break
                    block = blocks[(namespace, leaf, 0, hashes[at])]  # type: ignore[index]
                    present = self._promote(block, promoted)
                    if present:
                        self._pin(block)
                        held.append(block)
                        depths.append(at)
                    mask.append(present)
                    if slots is not None:
                        offset, size, checksum = slot_entry(block if present else None)
                        packed[0].extend(_INT64.pack(offset))  # type: ignore[union-attr]
                        packed[1].extend(_INT64.pack(size))  # type: ignore[union-attr]
                        packed[2].extend(checksum)  # type: ignore[union-attr]
                    at += 1
                if slots is not None:
                    slots[leaf] = (bytes(packed[0]), bytes(packed[1]), bytes(packed[2]))  # type: ignore[arg-type]
                masks[leaf] = mask
        finally:
            self.pinned_blocks += tally[0]
        return masks

    def _pin_on_host(self, key: StoreKey, pinned: dict[StoreKey, int],
                     promoted: Mapping[StoreKey, Promoted] | None = None) -> bool:
        """Make ``key`` resident on the host tier (promoting from staging or ``promoted``) and pin it for a lease."""
        if key in pinned:
            return True
        block = self.blocks.get(key)
        if block is None:
            return False
        if not block.on_host:
            if not self._promote(block, promoted):
                return False
        self._pin(block)
        pinned[key] = 0
        return True

    def _grant(self, owner: str, group: int, held: list[Block], depths: list[int], tenant: str = "",
               column: tuple[str, int] | None = None) -> Lease:
        """A new lease, within the owner's, the credential's and the node's bounds; NodeBusy changes nothing."""
        owned = self._owner_leases.get(owner, {})
        usage = self._tenant(tenant)
        if usage.limits.leases <= 0:
            self.counters.leases_refused += 1
            raise NodeBusy("busy", "this credential may hold no leases on this node (max_leases = 0)")
        ends_one = len(owned) >= self.max_leases_per_owner or len(usage.leases) >= usage.limits.leases
        if not ends_one and len(self.leases) >= self.max_leases:
            self.counters.leases_refused += 1
            raise NodeBusy("busy", f"the node holds its maximum of {self.max_leases} leases: try again later")
        owned = self._owner_leases.setdefault(owner, {})
        while len(owned) >= self.max_leases_per_owner:
            self.counters.leases_dropped_over_limit += 1
            self.end_lease(next(iter(owned)))
        while usage.leases and len(usage.leases) >= usage.limits.leases:
            self.counters.leases_dropped_over_quota += 1
            self.end_lease(next(iter(usage.leases)))
        lease = Lease(next(self._ids), owner, group, held, depths, self.clock() + self.lease_ttl, tenant, column)
        self.leases[lease.lease_id] = lease
        owned[lease.lease_id] = None
        usage.leases[lease.lease_id] = None
        self._group_lease[(owner, group)] = lease.lease_id
        self._schedule_expiry(lease.expires_at, _LEASE, lease.lease_id)
        self.counters.leases_granted += 1
        return lease

    # ---- reads under a lease ----------------------------------------------------------------

    def begin_read(self, lease_id: int, lease_owner: str, keys: Sequence[StoreKey] | None = None, *,
                   runs: Sequence[Sequence[Any]] | None = None, reader: str | None = None,
                   uses: list[Use] | None = None) -> ReadPlan:
        """Start a read of ``keys`` (all covered by ``lease_owner``'s live lease ``lease_id``).

        Or, instead of ``keys``, of the blocks ``runs`` name by their place in
        the lease's lookup (:meth:`Lease.at_runs`): the same read, without a
        key to build or look up per block.

        With ``uses`` (a list the caller keeps) the read's stamp is left
        there for :meth:`stamp_uses`, as :meth:`end_used_lease` leaves a
        lease's: the server answers first and stamps after. The read's pins
        keep its blocks indexed meanwhile, and evictable by nothing.

        The read takes its own pin on each block (``reader``, the connection
        moving the bytes, owns it; default ``lease_owner``), so ending the lease
        afterwards — by the next lookup, the TTL, the lease limit or a release —
        cannot let the slots be evicted or rewritten while the bytes move. The
        pins last until :meth:`end_read`, the read TTL or :meth:`drop_owner` of
        ``reader``. Stamps the keys (a loaded lookup counts as use). Raises
        :class:`LeaseExpired` when the lease is gone or does not cover a key;
        nothing is pinned then.
        """
        self.expire()
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != lease_owner:
            self.counters.reads_refused += 1
            raise LeaseExpired("lease_expired", f"lease {lease_id} is not held (expired, ended or never granted)")
        if runs is not None:
            try:
                at = lease.at_runs(runs)
            except KeyError as exc:
                self.counters.reads_refused += 1
                raise LeaseExpired("lease_expired", f"lease {lease_id} does not hold a block at {exc.args[0]} "
                                                    "(leaf, shard, place in its lookup)") from None
        else:
            covered = lease.keys
            try:  # one lookup a key: its index in the lease gives its block and its depth
                at = list(map(covered.__getitem__, keys or ()))
            except KeyError:
                missing = [k for k in keys or () if k not in covered]
                self.counters.reads_refused += 1
                raise LeaseExpired("lease_expired",
                                   f"{len(missing)} requested block(s) are not covered by lease {lease_id}") from None
        distinct = at if len(set(at)) == len(at) else list(dict.fromkeys(at))
        blocks, depths = lease.blocks, lease.depths
        held = list(map(blocks.__getitem__, distinct))  # (a lease's blocks stay indexed while it holds them)
        self.pinned_blocks += pin_all(held)
        owner = reader if reader is not None else lease_owner
        read = self._open_read(owner, held)
        picked = held if distinct is at else list(map(blocks.__getitem__, at))
        if uses is None:
            self._stamp_blocks(held, list(map(depths.__getitem__, distinct)))
        else:
            uses.append((held, list(map(depths.__getitem__, distinct))))
        return ReadPlan(read.read_id, list(map(_OFFSET, picked)), list(map(_SIZE, picked)),
                        list(map(_CHECKSUM, picked)))

    def _open_read(self, owner: str, blocks: list[Block]) -> Read:
        """A new read of ``blocks`` (already pinned for it) by connection ``owner``, on the books with its TTL."""
        read = Read(next(self._ids), owner, blocks, self.clock() + self.read_ttl)
        self.reads[read.read_id] = read
        self._owner_reads.setdefault(owner, {})[read.read_id] = None
        self._schedule_expiry(read.expires_at, _READ, read.read_id)
        return read

    def lease_into_read(self, lease_id: int, lease_owner: str, *, reader: str, max_bytes: int) -> ReadPlan | None:
        """End lease ``lease_id`` by handing its pins to a read of every block it holds, in the order it found them.

        What :meth:`begin_read` of all the lease's blocks and then
        :meth:`end_lease` leave behind (the same read, the same stamps, the
        lease gone), without a key built or looked up and with no pin given
        back and taken again: each of the lease's pins becomes the read's.
        The read's blocks are the lease's, a block its lookup found twice
        twice (each pinned once per place), so their order is the lookup's:
        leaf by leaf, hash by hash, as a node sends a one-shard lookup's
        blocks with its answer. ``None``, with the lease as it was, when
        ``lease_owner`` holds no such lease, or its blocks come to more than
        ``max_bytes``, or one was stored without a checksum.
        """
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != lease_owner:
            return None
        blocks = lease.blocks
        sizes = list(map(_SIZE, blocks))
        if sum(sizes) > max_bytes:  # (a large lookup's usual answer: told before a checksum is listed)
            return None
        sums = list(map(_CHECKSUM, blocks))
        if None in sums:
            return None
        self._drop_lease(lease)  # (its pins stay: they are the read's now)
        read = self._open_read(reader, blocks)
        if len(set(map(id, blocks))) == len(blocks):
            self._stamp_blocks(blocks, lease.depths)
        else:  # each once, at its last place (as begin_read stamps a key the lease holds twice)
            last = dict(zip(map(id, blocks), zip(blocks, lease.depths)))
            self._stamp_blocks([b for b, _ in last.values()], [d for _, d in last.values()])
        return ReadPlan(read.read_id, list(map(_OFFSET, blocks)), sizes, sums)

    def end_read(self, read_id: int) -> bool:
        """End a read and drop its pins. True when its pins were still held (the read is intact).

        False when the read had already ended (TTL, its connection closed) or
        was never started: its blocks may have been rewritten meanwhile, so a
        same-host copy made under it must not be trusted. Idempotent.
        """
        read = self.reads.pop(read_id, None)
        if read is None:
            return False
        self._owner_reads.get(read.owner, {}).pop(read_id, None)
        self._unpin_blocks(read.blocks)  # pinned, so still indexed: no key is looked up (as a lease ends)
        return True

    def reads_of(self, owner: str) -> int:
        """How many reads in flight ``owner`` (a connection) holds."""
        return len(self._owner_reads.get(owner, ()))

    def leases_of(self, owner: str) -> int:
        """How many leases ``owner`` (a client) holds."""
        return len(self._owner_leases.get(owner, ()))

    def _pin(self, block: Block) -> None:
        if block.pins == 0:
            self.pinned_blocks += 1
        block.pins += 1

    def _pinned(self, block: Block) -> bool:
        return block.pins > 0

    def lease_slots(self, lease: Lease, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str],
                    shards: int) -> dict[str, SlotMap]:
        """Where a lease's blocks lie, for a same-host client that copies them itself (one round trip per load).

        Per leaf, a :data:`SlotMap`: three packed arrays over ``hashes`` x
        ``shards`` (hash-major), as they travel in a lookup's reply: the slot
        offset (``-1`` where the lease holds no block, or the block has no
        checksum: such a block is read the two-step way), the size (``0``
        there), and the writer's checksum (16 zero bytes there). The lease's pins hold the
        slots; a client that copies after they ended (TTL, a later lookup of
        its group) sees its checksum fail and falls back to a read.
        """
        covered, blocks = lease.keys, self.blocks
        slots = {}
        for leaf in leaves:
            packed = (bytearray(), bytearray(), bytearray())
            slot_map(blocks, covered, namespace, leaf, hashes, shards, *packed)
            slots[leaf] = (bytes(packed[0]), bytes(packed[1]), bytes(packed[2]))
        return slots

    def end_used_lease(self, lease_id: int, owner: str, uses: list[Use] | None = None) -> bool:
        """End ``owner``'s lease after a same-host client copied its blocks: stamp them as one use, then unpin.

        The lease's blocks count as loaded (as :meth:`begin_read` stamps a
        read's). False (nothing done) when ``owner`` holds no such lease.

        With ``uses`` (a list the caller keeps), the lease still ends now but
        its stamp is left for :meth:`stamp_uses`: the lease's blocks and
        depths are appended there. The server does this to answer a lookup
        first and stamp after, off the lookup's critical path (see
        :meth:`dkv.server.NodeServer._handle`); until then the blocks keep
        their previous stamps.
        """
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return False
        if uses is None:
            self._stamp_blocks(lease.blocks, lease.depths)
        else:
            uses.append((lease.blocks, lease.depths))
        return self.end_lease(lease_id)

    def stamp_uses(self, uses: Iterable[Use]) -> None:
        """Make the stamps :meth:`end_used_lease` or :meth:`begin_read` left in ``uses``: one use of each, in order.

        A block no longer indexed (evicted, cleared or replaced since its lease
        ended) is skipped: a stamp never brings a block back or touches its
        successor (:meth:`_stamp_blocks`).
        """
        for held, depths in uses:
            self._stamp_blocks(held, depths)

    def leased_count(self, lease_id: int) -> int:
        """How many blocks lease ``lease_id`` pins (one its lookup named twice, twice); 0 when it is not held."""
        lease = self.leases.get(lease_id)
        return 0 if lease is None else len(lease.blocks)

    def leased_bytes(self, lease_id: int) -> int:
        """The bytes of the blocks lease ``lease_id`` pins (one its lookup named twice, twice); 0 when it is not held."""
        lease = self.leases.get(lease_id)
        return 0 if lease is None else sum(map(_SIZE, lease.blocks))

    def end_lease(self, lease_id: int) -> bool:
        """End a lease and unpin its blocks; False if it was not held. Idempotent."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        self._drop_lease(lease)
        self._unpin_blocks(lease.blocks)
        return True

    def _drop_lease(self, lease: Lease) -> None:
        """Take ``lease`` out of every book (the node's, its owner's, its credential's, its group's); its pins stay."""
        lease_id = lease.lease_id
        del self.leases[lease_id]
        self._owner_leases.get(lease.owner, {}).pop(lease_id, None)
        usage = self._tenants.get(lease.tenant)
        if usage is not None:
            usage.leases.pop(lease_id, None)
        if self._group_lease.get((lease.owner, lease.group)) == lease_id:
            del self._group_lease[(lease.owner, lease.group)]

    # ---- two-phase writes -------------------------------------------------------------------

    def reserve(self, owner: str, keys: Sequence[StoreKey], sizes: Sequence[int],
                sums: Sequence[bytes | None] | None = None, *, tenant: str = "") -> tuple[Reservation, list[str]]:
        """Reserve slots for the keys not yet held; returns the reservation and a status per key.

        Status is :data:`WRITE` (send the bytes into the planned slot),
        :data:`EXISTS`, :data:`BUSY` (another writer holds the key) or
        :data:`FULL`. Reserved keys are invisible until :meth:`commit`. If
        anything raises midway (a bad size, a failure while making room), the
        slots and keys reserved so far are given back before it propagates.
        ``sums`` (one per key, or ``None``) are the writer's declared
        checksums; each reserved key keeps its own (:meth:`commit`).

        ``tenant`` is the writer's credential: its blocks are charged to it.
        A key is :data:`FULL` (counted in ``quota_refusals``, nobody's block
        evicted for it) when it would take past their bound the uncommitted
        reservations of ``owner`` (``max_reserved_bytes_per_owner``, and an
        eighth of ``max_blocks`` keys, at least 1 024) or of ``tenant`` (its
        ``max_reserved_bytes``, and a quarter of ``max_blocks`` keys, at least
        2 048; never more than ``max_blocks``). Within
        them, room is made as bytes are: a credential at its
        ``max_stored_bytes`` or ``max_blocks`` loses its *own* oldest unpinned
        blocks; the node at ``max_blocks`` drops its oldest blocks (spilled
        ones first); the pool out of bytes evicts its oldest; with nothing
        evictable the key is :data:`FULL`.
        """
        if len(keys) != len(sizes):
            raise WriteRejected("write_rejected", "keys and sizes differ in length")
        if sums is not None and len(sums) != len(keys):
            raise WriteRejected("write_rejected", "keys and checksums differ in length")
        self.expire()
        res = Reservation(next(self._ids), owner, [], [], [], self.clock() + self.reservation_ttl, tenant=tenant)
        usage = self._tenant(tenant)
        owner_held = self._owner_reserved
        statuses: list[str] = []
        try:
            for key, size in zip(keys, sizes):
                if not isinstance(size, int) or not 0 <= size <= MAX_BLOCK_SIZE:
                    raise WriteRejected("write_rejected", f"block size {size!r} outside [0, {MAX_BLOCK_SIZE}]")
                if key in self.blocks:
                    statuses.append(EXISTS)
                elif key in self.reserved_keys:
                    statuses.append(BUSY)
                else:
                    cost = (size + _PAGE_MASK) & ~_PAGE_MASK  # slot_cost(size)
                    offset = self._place(res, usage, key.namespace, size, cost)
                    if offset is None:
                        statuses.append(FULL)
                        continue
                    res.keys.append(key)
                    res.offsets.append(offset)
                    res.sizes.append(size)
                    # charged to the reservation, its credential and its connection (see _release_reserved)
                    res.reserved_bytes += cost
                    usage.reserved_bytes += cost
                    usage.reserved_keys += 1
                    held = owner_held.get(owner)
                    if held is None:
                        held = owner_held[owner] = [0, 0]
                    held[0] += cost
                    held[1] += 1
                    res.sums.append(sums[len(statuses)] if sums is not None else None)  # one status per key so far
                    self.reserved_keys[key] = res.write_id
                    statuses.append(WRITE)
        except BaseException:
            self._abort(res)
            raise
        self.reservations[res.write_id] = res
        self._schedule_expiry(res.expires_at, _RESERVATION, res.write_id)
        return res, statuses

    def commit(self, write_id: int, owner: str, *,
               verify: Callable[[StoreKey, int, int, bytes], bool] | None = None) -> list[StoreKey]:
        """Make a reservation's blocks visible, stamped as one use in key order; returns them.

        Each block keeps the checksum its writer declared (:meth:`reserve`).
        With ``verify`` (the node's ``verify_writes``), every block that
        declared one is checked first: ``verify(key, offset, size, checksum)``
        is the server's hash of the bytes now in the slot against it. A block
        that fails is not committed (its slot is freed, counted in
        ``checksum_rejects``) and is missing from the returned list; a block
        that declared none is committed and counted in ``unverified_commits``.
        If ``verify`` raises, nothing has changed (the reservation stands).
        """
        res = self.reservations.get(write_id)
        if res is None or res.owner != owner:
            raise WriteRejected("write_rejected", f"write {write_id} is not reserved (expired or aborted)")
        sums = res.sums if len(res.sums) == len(res.keys) else [None] * len(res.keys)
        rejected: set[int] = set()
        if verify is not None:
            rejected = {i for i, (key, offset, size, checksum) in enumerate(zip(res.keys, res.offsets, res.sizes, sums))
                        if checksum is not None and not verify(key, offset, size, checksum)}
            self.counters.checksum_rejects += len(rejected)
            self.counters.unverified_commits += sums.count(None)
        del self.reservations[write_id]
        self._release_reserved(res)
        stamp = next(self._stamps)
        committed: list[StoreKey] = []
        for depth, (key, offset, size, checksum) in enumerate(zip(res.keys, res.offsets, res.sizes, sums)):
            del self.reserved_keys[key]
            if depth in rejected:
                self._free(key.namespace, offset, size)
                continue
            block = Block(key, size, offset, checksum=checksum, tenant=res.tenant)
            self._index(block)
            self._restamp(block, stamp, depth)
            committed.append(key)
        self.counters.commits += len(committed)
        for callback in self.on_commit:
            callback(list(committed))
        return committed

    def abort(self, write_id: int) -> bool:
        """Drop a reservation and free its slots; False if it was not held. Idempotent."""
        res = self.reservations.pop(write_id, None)
        if res is None:
            return False
        self._abort(res)
        return True

    def _abort(self, res: Reservation) -> None:
        self.counters.aborted_writes += len(res.keys)
        self._release_reserved(res)
        for key, offset, size in zip(res.keys, res.offsets, res.sizes):
            self.reserved_keys.pop(key, None)
            self._free(key.namespace, offset, size)

    def _place(self, res: Reservation, usage: TenantUsage, namespace: str, size: int, cost: int) -> int | None:
        """A slot for one more key of ``res`` (``cost`` pool bytes) within every bound (see :meth:`reserve`).

        ``None`` (counted) means FULL. The checks that find room cost a few
        comparisons; only a bound reached calls into eviction.
        """
        held_bytes, held_keys = self._owner_reserved.get(res.owner, _NOTHING_HELD)
        limits = usage.limits
        if (held_bytes + cost > self._owner_reserved_bytes_cap or held_keys >= self._owner_keys_cap
                or usage.reserved_bytes + cost > limits.reserved_bytes
                or usage.reserved_keys >= self._tenant_keys_cap):
            self.counters.quota_refusals += 1
            return None
        max_blocks = self._max_blocks
        if ((limits.blocks < max_blocks and usage.blocks + usage.reserved_keys >= limits.blocks)
                or len(self.blocks) + len(self.reserved_keys) >= max_blocks) and not self._block_room(usage):
            return None
        if (cost and limits.stored_bytes < self.arena.capacity
                and usage.stored_bytes + usage.reserved_bytes + cost > limits.stored_bytes
                and not self._tenant_room(usage, cost)):
            self.counters.quota_refusals += 1
            return None
        offset = self._alloc(namespace, size)
        if offset is None:
            self.counters.full_refusals += 1
        return offset

    def _release_reserved(self, res: Reservation) -> None:
        """A reservation ended (committed, aborted, expired): its owner and credential hold its slots no more."""
        usage = self._tenants.get(res.tenant)
        if usage is not None:
            usage.reserved_bytes -= res.reserved_bytes
            usage.reserved_keys -= len(res.keys)
        held = self._owner_reserved.get(res.owner)
        if held is not None:
            held[0] -= res.reserved_bytes
            held[1] -= len(res.keys)
            if held[1] <= 0:
                del self._owner_reserved[res.owner]

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
        """One use of these (indexed) keys, each at its depth: :meth:`_stamp_blocks` of their blocks."""
        blocks = self.blocks
        pairs = [(blocks[key], depth) for key, depth in keyed_depths]
        self._stamp_blocks([block for block, _ in pairs], [depth for _, depth in pairs])

    def _stamp_blocks(self, held: list[Block], depths: list[int]) -> None:
        """One use of these blocks, each at its depth, where still indexed (a block since evicted, cleared or
        replaced is skipped): :func:`dkv.store_runs.stamp_run`, native where built (the hot path: touches,
        loaded lookups, a same-host lease's end).

        The use's recency entries share one stamp, newer than that of any
        entry in any heap. So, sorted (as ``stamp_run`` gives them), they are
        appended to their heap without a sift: each is at least every entry
        already there, and every parent stays at most its children.
        """
        self._next_order, by_tenant = stamp_run(held, depths, next(self._stamps), self._next_order)
        tenants = self._tenants
        for tenant, entries in by_tenant.items():  # (each list sorted already)
            usage = tenants[tenant]
            usage.heap += entries
            if len(usage.heap) > 2 * usage.host_blocks + HEAP_SLACK:  # (exceeded by at most this one use)
                self._compact_recency(usage)

    def _take_order(self) -> int:
        order = self._next_order
        self._next_order = order + 1
        return order

    def _restamp(self, block: Block, stamp: int, depth: int) -> None:
        block.stamp, block.depth, block.order = stamp, depth, self._take_order()
        if block.on_host:
            self._push_recency(self._tenants[block.tenant], block)

    def _push_recency(self, usage: TenantUsage, block: Block) -> None:
        """Enter a host block's current stamp in its credential's recency heap (one heap per credential)."""
        heap = usage.heap
        heapq.heappush(heap, (block.stamp, -block.depth, block.order, block))
        if len(heap) > 2 * usage.host_blocks + HEAP_SLACK:
            self._compact_recency(usage)

    def _compact_recency(self, usage: TenantUsage) -> None:
        """Drop stale recency entries: the heap keeps one live entry per host block plus bounded slack.

        Every restamp leaves the block's previous entry behind; without this,
        the heap grew with every read ever served and eviction slowed with it.
        Amortised O(1) per restamp: a pass over the heap itself (never over
        other credentials' blocks) after at least ``host_blocks`` pushes.
        """
        usage.heap = live_entries(usage.heap)  # (:mod:`dkv.store_runs`: native where built)
        heapq.heapify(usage.heap)

    def recency_entries(self) -> int:
        """Entries in the recency heaps (live and stale): bounded by twice the host blocks plus slack each."""
        return sum(len(usage.heap) for usage in self._tenants.values())

    # ---- ownership and expiry -------------------------------------------------------------

    def drop_owner(self, owner: str) -> None:
        """A client or connection vanished: end its leases and reads, abort its reservations."""
        for lease_id in list(self._owner_leases.pop(owner, {})):
            self.end_lease(lease_id)
        for read_id in list(self._owner_reads.pop(owner, {})):
            self.end_read(read_id)
        for res in [r for r in self.reservations.values() if r.owner == owner]:
            self.abort(res.write_id)

    def _schedule_expiry(self, when: float, kind: int, item_id: int) -> None:
        heapq.heappush(self._expiries, (when, kind, item_id))

    def expire(self) -> None:
        """End leases, reads and reservations whose TTL has passed.

        Costs what has expired, not what is live: one heap entry per grant,
        popped once (an entry whose item already ended is skipped).
        """
        now = self.clock()
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, kind, item_id = heapq.heappop(expiries)
            if kind == _LEASE:
                if self.end_lease(item_id):
                    self.counters.leases_expired += 1
            elif kind == _READ:
                if self.end_read(item_id):
                    self.counters.reads_expired += 1
            else:
                self.abort(item_id)

    # ---- space ------------------------------------------------------------------------------

    def _alloc(self, namespace: str, size: int) -> int | None:
        """A slot for ``size`` bytes in ``namespace``'s segment, evicting unpinned blocks oldest-first until one frees."""
        if size == 0:
            return 0  # a zero-byte block owns no slot
        if align_up(size) > self.arena.capacity:
            return None
        evicted: list[StoreKey] = []
        try:
            while (offset := self.arena.allocate(namespace, size)) is None:
                victim = self._next_victim()
                if victim is None:
                    return None
                if self._evict_from_host(victim):
                    evicted.append(victim.key)
            return offset
        finally:
            if evicted:
                self._notify_evicted(evicted)

    def _free(self, namespace: str, offset: int, size: int) -> None:
        if offset >= 0 and size > 0:
            self.arena.free(namespace, offset, size)

    def _next_victim(self, usage: TenantUsage | None = None) -> Block | None:
        """Pop the oldest-stamp, deepest unpinned host block (of ``usage``'s credential only, when given).

        Without ``usage``, the oldest across every credential's heap: each
        heap's top is its oldest, so the oldest of the tops is the node's
        oldest (a pass over the few credentials per pop). Pinned ones are put
        back.
        """
        usages = (usage,) if usage is not None else self._tenants.values()
        skipped: list[tuple[TenantUsage, Recency]] = []
        victim = None
        while True:
            best: TenantUsage | None = None
            for candidate in usages:
                heap = candidate.heap
                while heap:  # drop stale tops: evicted, dropped or restamped since
                    top = heap[0]
                    block = top[3]
                    if block.indexed and block.order == top[2] and block.offset >= 0:
                        break
                    heapq.heappop(heap)
                if heap and (best is None or heap[0] < best.heap[0]):
                    best = candidate
            if best is None:
                break
            entry = heapq.heappop(best.heap)
            block = entry[3]
            if self._pinned(block):
                skipped.append((best, entry))
                continue
            victim = block
            break
        for owner, entry in skipped:
            heapq.heappush(owner.heap, entry)
        return victim

    def _block_room(self, usage: TenantUsage) -> bool:
        """Room for one more block (any tier) under ``usage``'s ``max_blocks`` and the node's; False (counted): FULL.

        A block bound reached makes room as bytes do, but by dropping blocks
        outright (a spill would keep the block indexed): the oldest block off
        the host tier first (already evicted once), else the oldest unpinned
        host block. At the credential's bound only its own blocks go.
        """
        max_blocks = self._max_blocks
        evicted: list[StoreKey] = []
        try:
            while usage.limits.blocks < max_blocks and usage.blocks + usage.reserved_keys >= usage.limits.blocks:
                if not self._drop_oldest(usage, evicted):
                    self.counters.quota_refusals += 1
                    return False
                self.counters.quota_evictions += 1
            while len(self.blocks) + len(self.reserved_keys) >= max_blocks:
                if not self._drop_oldest(None, evicted):
                    self.counters.full_refusals += 1
                    return False
            return True
        finally:
            if evicted:
                self._notify_evicted(evicted)

    def _drop_oldest(self, usage: TenantUsage | None, dropped: list[StoreKey]) -> bool:
        """Drop one block (of ``usage``'s credential, or any): the oldest off the host tier, else the oldest host one."""
        off_host = usage.off_host if usage is not None else self._off_host
        key = next(iter(off_host), None)
        if key is not None:  # never pinned: a pinned block is on the host tier
            self._discard(self.blocks[key])
            self.counters.disk_drops += 1
            dropped.append(key)
            return True
        victim = self._next_victim(usage)
        if victim is None:
            return False
        self._evict_from_host(victim, spill=False)
        dropped.append(victim.key)
        return True

    def _discard(self, block: Block) -> None:
        """Take ``block`` out of the store whatever its tier: slot freed, or spill cancelled, or file dropped."""
        key = block.key
        if block.on_host:
            self._free(key.namespace, block.offset, block.size)
        elif self.disk is not None:
            if not self._unstage(key) and key in self.disk:
                self.disk.remove(key)
            self._disk_work()
        self._unindex(block)

    def _tenant_room(self, usage: TenantUsage, cost: int) -> bool:
        """Room for ``cost`` more pool bytes under ``usage``'s ``max_stored_bytes``: its own oldest blocks go.

        Its evicted blocks spill as usual, but only into free disk space: making
        room on disk would drop other credentials' spilled blocks. A quota of
        the whole pool (the default) is no quota: the pool's own eviction
        (oldest first, across credentials) makes the room.
        """
        if usage.limits.stored_bytes >= self.arena.capacity:
            return True
        evicted: list[StoreKey] = []
        try:
            while usage.stored_bytes + usage.reserved_bytes + cost > usage.limits.stored_bytes:
                victim = self._next_victim(usage)
                if victim is None:
                    return False
                self.counters.quota_evictions += 1
                if self._evict_from_host(victim, drop_others=False):
                    evicted.append(victim.key)
            return True
        finally:
            if evicted:
                self._notify_evicted(evicted)

    def _evict_from_host(self, block: Block, *, spill: bool = True, drop_others: bool = True) -> bool:
        """Move ``block`` off the host tier: stage it for a spill if there is a disk tier, else drop it.

        Returns True when the block left the store entirely (so it must be
        unpublished). Does no I/O and never raises: the bytes are copied into
        staging memory and the server writes the file later
        (:meth:`take_spill`); with no room in staging or on disk the block is
        dropped instead, counted in ``spill_drops``. Without ``spill`` it is
        dropped; without ``drop_others`` it spills only into free disk space.
        """
        self.counters.evictions += 1
        if spill and self.disk is not None and block.size > 0 and self._stage(block, drop_others):
            self._free(block.key.namespace, block.offset, block.size)
            self._left_host(block)
            return False
        self._unindex(block)
        self._free(block.key.namespace, block.offset, block.size)
        return True

    def _stage(self, block: Block, drop_others: bool = True) -> bool:
        """Copy a host block's bytes into staging and queue its spill; False (counted) when there is no room."""
        disk = self.disk
        assert disk is not None
        if not disk.spill_allowed(self.clock()):
            self.counters.disk_degraded_drops += 1  # memory only until a probe spill is written
            return False
        if not self._staging.fits(block.size) or block.size > disk.free + disk.indexed:
            self.counters.spill_drops += 1  # staging full, or the tier is busy with files being written
            return False
        try:
            data = bytearray(self.arena.slot(block.key.namespace, block.offset, block.size))
        except MemoryError:
            self.counters.spill_drops += 1
            return False
        if not (self._make_disk_room(block.size) if drop_others else block.size <= disk.free):
            self.counters.spill_drops += 1
            return False
        entry = disk.allocate(block.size)
        assert entry is not None
        self._staging.add(SpillJob(block.key, data, entry))
        self._disk_work()
        return True

    def _make_disk_room(self, size: int) -> bool:
        """Free ``size`` bytes on disk, dropping the oldest on-disk blocks (unpublished); False if it cannot."""
        disk = self.disk
        assert disk is not None
        dropped: list[StoreKey] = []
        while size > disk.free and (key := disk.oldest()) is not None:
            disk.remove(key)
            dropped.append(key)
        if dropped:
            self.counters.disk_drops += len(dropped)
            self._drop_disk_blocks(dropped)
        return size <= disk.free

    def _drop_disk_blocks(self, keys: list[StoreKey]) -> None:
        """Drop on-disk blocks from the tier (if still there) and from the store, and unpublish them."""
        disk = self.disk
        assert disk is not None
        gone = []
        for key in keys:
            if key in disk:
                disk.remove(key)
            block = self.blocks.get(key)
            if block is not None and not block.on_host and key not in self._staging:
                self._unindex(block)
                gone.append(key)
        self._disk_work()
        if gone:
            self._notify_evicted(gone)

    def _unstage(self, key: StoreKey) -> bool:
        """Cancel ``key``'s spill (its block is promoted or dropped); False if it was not staged."""
        job = self._staging.cancel(key)
        if job is None:
            return False
        if not job.taken:  # never handed to the server: no file exists
            assert self.disk is not None
            self.disk.release(job.entry, written=False)
        return True

    def _disk_work(self) -> None:
        """Tell the server there may be disk work: a spill to write or files to unlink."""
        for callback in self.on_spill:
            callback()

    # ---- spill and promotion: plans for the server -----------------------------------------

    def take_spill(self) -> SpillJob | None:
        """The next spill for the server to write (``job.data`` to ``job.entry.path``), or ``None``.

        The server writes it off the event loop and must end every taken job
        with :meth:`finish_spill` (unless the store is closing).
        """
        return self._staging.take()

    def finish_spill(self, job: SpillJob, error: BaseException | None = None) -> None:
        """The server's write of ``job`` ended, failed with ``error`` if given. Never raises.

        Success: the block is now on disk and its staging memory is freed; a
        degraded tier is healthy again (``disk_recovered``). Failure
        (directory gone, disk full, ...): the block is dropped and
        unpublished, counted in ``disk_spill_failed`` and ``disk_errors``,
        and the tier degrades (``disk_degraded``; a vanished directory also
        drops every on-disk block, :meth:`disk_vanished`). If the block
        stopped wanting the file meanwhile (promoted, cleared), the file's
        space is released and the file left to unlink
        (:meth:`DiskTier.take_garbage`); the outcome still tells the tier's health.
        """
        disk = self.disk
        assert disk is not None
        if error is None:
            if disk.recover():
                self.counters.disk_recovered += 1
                log.warning("disk tier: a spill was written again; spilling resumes")
        else:
            self.counters.disk_spill_failed += 1
            self._degrade(fault_of(error), error)
        if not self._staging.finish(job):
            disk.release(job.entry)
            self._disk_work()
            return
        if error is None:
            disk.admit(job.key, job.entry)
            self.counters.spills += 1
            return
        self.counters.disk_errors += 1
        disk.release(job.entry)
        self._disk_work()
        block = self.blocks.get(job.key)
        if block is not None and not block.on_host:
            self._unindex(block)
            self._notify_evicted([job.key])

    def disk_vanished(self) -> None:
        """The tier's directory is gone or replaced (the server saw it): drop every on-disk block. Never raises.

        Their files went with the directory, so each is dropped and
        unpublished (``disk_lost``), and the tier degrades to memory only
        until a probe spill is written (the server makes the directory again
        first). Staged blocks are kept: their bytes are in memory.
        """
        if self.disk is not None:
            self._degrade(MISSING, None)

    def _degrade(self, fault: str, error: BaseException | None) -> None:
        disk = self.disk
        assert disk is not None
        if fault == MISSING and len(disk):
            lost = disk.keys()
            self.counters.disk_lost += len(lost)
            self._drop_disk_blocks(lost)
        if disk.degrade(fault, self.clock()):
            self.counters.disk_degraded += 1
            log.warning("disk tier degraded (%s%s): evicted blocks are dropped, not spilled, until a probe spill "
                        "every %.1f s is written", fault, f": {error}" if error is not None else "",
                        disk.retry_interval)

    def disk_reads(self, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int,
                   budget: int, read: Container[StoreKey] = ()) -> list[DiskRead]:
        """Files a leased lookup of these hashes could promote: blocks only on disk, shallowest first.

        Only hashes that every shard of a leaf holds count; the list stops
        before the first file that would take it past ``budget`` bytes. The
        server reads them off the event loop and hands the bytes to
        :meth:`lookup` (``promoted``), or reports a failed read to
        :meth:`disk_read_failed`. Keys in ``read`` (read already) are left
        out and count nothing. Plans only; changes nothing.
        """
        disk = self.disk
        if disk is None or not len(disk):
            return []
        blocks = self.blocks
        reads: list[DiskRead] = []
        total = 0
        for h in hashes:
            for leaf in leaves:
                keys = [StoreKey(namespace, leaf, s, h) for s in range(shards)]
                if not all(k in blocks for k in keys):
                    continue
                for key in keys:
                    entry = disk.entry(key)
                    if entry is None or key in read:
                        continue
                    if total + entry.size > budget:
                        return reads
                    reads.append(DiskRead(key, entry))
                    total += entry.size
        return reads

    def disk_read_failed(self, read: DiskRead, error: BaseException) -> None:
        """The server could not read ``read``'s file: drop the block (unpublished), counted in ``disk_errors``.

        Nothing happens when the block no longer uses that file (promoted,
        dropped or spilled anew meanwhile). Never raises.
        """
        disk = self.disk
        if disk is None or disk.entry(read.key) is not read.entry:
            return
        self.counters.disk_errors += 1
        self._drop_disk_blocks([read.key])

    def blocks_off_host(self) -> int:
        """Blocks held only off the host pool: staged for a spill or written to disk (no walk over blocks)."""
        return len(self._staging) + (len(self.disk) if self.disk is not None else 0)

    def staging_usage(self) -> tuple[int, int]:
        """``(blocks, bytes)`` held in staging memory (queued or being written)."""
        return len(self._staging), self._staging.used

    def _promote(self, block: Block, promoted: Mapping[StoreKey, Promoted] | None = None) -> bool:
        """Bring an off-host block back into a host slot from memory; False (still off host) if it cannot.

        A staged block comes from its staging buffer; an on-disk one only from
        ``promoted``, and only while its file is the one that was read. No
        I/O. If making room raises, the block stays where it was.
        """
        key = block.key
        job = self._staging.get(key)
        if job is not None:
            if not self._copy_to_host(block, job.data):
                return False
            self._unstage(key)
            return True
        disk = self.disk
        read = promoted.get(key) if promoted is not None else None
        if disk is None or read is None or disk.entry(key) is not read.entry or len(read.data) != block.size:
            return False
        # Out of the index, so making room cannot drop it; its space is free for the blocks this
        # promotion pushes out, and its file stays until the promotion has succeeded.
        entry = disk.detach(key)
        disk.release(entry, written=False)
        try:
            moved = self._copy_to_host(block, read.data)
        except BaseException:
            self._keep_on_disk(block, entry)
            raise
        if moved:
            disk.unlink_later(entry.path)
            self._disk_work()
        else:
            self._keep_on_disk(block, entry)
        return moved

    def _keep_on_disk(self, block: Block, entry: DiskEntry) -> None:
        """A promotion failed: put the block's file back in the tier, or drop the block if it no longer fits."""
        disk = self.disk
        assert disk is not None
        if self._make_disk_room(entry.size) and disk.reclaim(entry):
            disk.admit(block.key, entry)
            return
        disk.unlink_later(entry.path)
        self._disk_work()
        self._unindex(block)
        self.counters.disk_drops += 1
        self._notify_evicted([block.key])

    def _copy_to_host(self, block: Block, data: bytes | bytearray | memoryview) -> bool:
        """Give an off-host block a host slot holding ``data``; False if there is no room.

        Room within its credential's ``max_stored_bytes`` first (its own oldest
        blocks go), then in the pool.
        """
        if block.size and not self._tenant_room(self._tenants[block.tenant], slot_cost(block.size)):
            return False
        offset = self._alloc(block.key.namespace, block.size)
        if offset is None:
            return False
        try:
            self.arena.slot(block.key.namespace, offset, block.size)[:] = data
        except BaseException:
            self._free(block.key.namespace, offset, block.size)
            raise
        self._back_on_host(block, offset)
        self.counters.disk_hits += 1
        return True

    def _unpin_blocks(self, held: list[Block]) -> None:
        """Give back one pin per entry of ``held`` (a lease's blocks: indexed while pinned)."""
        self.pinned_blocks -= unpin_all(held)

    def _notify_evicted(self, keys: list[StoreKey]) -> None:
        """Tell every ``on_evict`` callback; one that raises is logged and cannot undo the store's change."""
        for callback in self.on_evict:
            try:
                callback(keys)
            except Exception:
                log.exception("on_evict callback failed for %d key(s)", len(keys))

    # ---- accounting -------------------------------------------------------------------------

    def host_bytes(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the host pool (reserved slots count as used)."""
        return self.arena.free_bytes, self.arena.capacity

    def disk_state(self) -> str:
        """The disk tier's health: ``"ok"``, the fault that degraded it (``"full"``, ``"missing"``, ``"failing"``), or ``"off"``."""
        return self.disk.state if self.disk is not None else "off"

    def disk_bytes(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the disk tier; ``(0, 0)`` when there is none."""
        if self.disk is None:
            return 0, 0
        return self.disk.free, self.disk.capacity

    def clear(self, namespace: str) -> int:
        """Drop every unpinned block of ``namespace`` (``reset_prefix_cache``); returns how many."""
        victims = [b for b in self.blocks.values() if b.pins == 0 and b.key.namespace == namespace]
        for block in victims:
            self._unindex(block)
            if block.on_host:
                self._free(block.key.namespace, block.offset, block.size)
            elif self.disk is not None:
                if not self._unstage(block.key) and block.key in self.disk:
                    self.disk.remove(block.key)
        if self.disk is not None and victims:
            self._disk_work()
        if victims:
            self._notify_evicted([b.key for b in victims])
        return len(victims)

    def close(self) -> None:
        """Release everything (node shutdown); the arena and disk tier are closed by their owner."""
        self.leases.clear()
        self.reads.clear()
        self._expiries.clear()
        self.reservations.clear()
        self.reserved_keys.clear()
        self.blocks.clear()
        self.columns.clear()
        self._tenants.clear()
        self._owner_reserved.clear()
        self._off_host.clear()
        self._staging.clear()
