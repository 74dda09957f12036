"""``DKVConnector``: the seed's KVConnector protocol over dKV nodes.

Who calls what (the seed, ``KVConnector-protocol.txt``, is the contract):

* The engine's **scheduler thread** calls every member synchronously. No member
  waits on a network there, except :meth:`DKVConnector.lookup`, which the
  protocol makes synchronous; it is bounded by ``timeout`` and engines should
  prefer :meth:`start_lookup` (``defers_lookup()`` is True).
* The process's **UCX loop thread** (:func:`dkv.loop_thread.acquire_shared_loop`,
  shared by every connector of the process) runs every round trip: leased
  lookups, reads, writes, touches, stats. The connector owns the tasks it
  starts there and cancels what is left of them at shutdown.

Sources. A request's hint decides where blocks come from: a usable hint names
a live peer (which may be the co-located node itself); no hint means the
co-located node; an unusable hint is a miss on the peer path, counted by
reason in :attr:`DKVConnector.counters`, and the lookup falls back to the
co-located node. ``lookup`` and ``load`` must see the same hint (a different
hint at ``load`` is refused). Offloads always go to the co-located node, which
publishes a block only once its bytes are committed.

Leases. A lookup pins what it reported on the source node. ``lookup()``'s
lease is the replica's (``group = replica_idx``): the next lookup of the same
replica ends it on that node, and the connector releases it itself when the
next lookup goes elsewhere. Each ``start_lookup()`` handle holds its own lease
until ``load_lookup`` (the read ends it), ``abandon_lookup``, or the node's TTL.
Leases stay within the node's ``max_leases`` (:mod:`connector.lease_budget`):
past it a lookup is a miss without asking. A load whose lease would expire
before the read, or that the node no longer holds, is refused up front. Once
posted, a read's bytes cannot change under it: the node pins them for the read
itself, whatever happens to the lease (the next ``lookup()`` ends it at once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from connector.copy_engine import Completion, CopyEngine
from connector.held_blocks import HeldBlocks
from connector.lease_budget import LeaseBudget
from connector.transfer_plan import LeafRun, TransferPlan, plan_transfer
from connector.types import (
    ByteCount,
    CompletedTransfer,
    KVCacheMetrics,
    KVLoadFailed,
    KVLoadInvalid,
    KVLoadRefused,
    AttentionKind,
    LeafSpec,
)
from dkv.client import LookupResult, NodeClient
from dkv.store import EXISTS, WRITE
from dkv.errors import ChecksumMismatch, DKVError, PeerUnauthenticated, TransportError
from dkv.etcd import DEFAULT_CLUSTER, DEFAULT_PREFIX, EtcdSettings, Layout, MemberRecord, make_client
from dkv.hints import (
    BEHIND_DEVICE,
    PEER_UNREACHABLE,
    UNAUTHENTICATED_PEER,
    UNKNOWN_PEER,
    UnusableHint,
    resolve_hint,
)
from dkv.keys import check_hashes, check_namespace
from dkv.loop_thread import acquire_shared_loop, release_shared_loop
from dkv.router import Router

log = logging.getLogger(__name__)

Masks = dict[str, list[bool]]
LEASE_MARGIN = 0.5  # seconds: a lease closer than this to expiry is not loaded from
HANDLE_GROUPS = (1024, 1 << 20)  # node lease groups for start_lookup handles
STATS_INTERVAL = 1.0
DEFAULT_MAX_LEASES = 64  # a node's --max-leases when its handshake does not say
UNREACHABLE_BACKOFF = 10.0  # seconds a node that failed to answer a lookup or a load is not asked again
PEER_IDLE_TIMEOUT = 60.0  # seconds a peer's client may sit unused before it is closed (never the co-located one)
MAX_BACKGROUND = 64  # fire-and-forget touches in flight at once; more are dropped and counted
MAX_QUEUED_RELEASES = 1024  # lease releases waiting per node (a node ends a client's oldest lease past 64 anyway)


@dataclass
class _LeaseState:
    """What a completed lookup found and holds."""

    address: str  # node the lease lives on
    lease_id: int | None
    masks: Masks
    hashes: list[bytes]
    hint: bytes | None
    expires_at: float
    peer: bool  # True when the source is not the co-located node
    generation: int = 0  # the client's lease generation when the lease was granted
    slot: int | None = None  # its slot in the connector's lease budget on that node

    def blame(self, plan: TransferPlan) -> tuple[str, bytes]:
        """The leaf and block to name when the whole lease is refused: the first block asked for."""
        first = plan.runs[0]
        return first.leaf, first.hashes[0]


class DKVLookup:
    """The handle :meth:`DKVConnector.start_lookup` returns.

    ``is_complete()`` never blocks; ``result()`` gives the per-leaf masks once
    complete (all False if the lookup failed: a failure is a miss, never an error).
    """

    def __init__(self, hashes: list[bytes], replica_idx: int, hint: bytes | None, group: int,
                 future: concurrent.futures.Future[_LeaseState | None]) -> None:
        self.block_hashes = hashes
        self.replica_idx = replica_idx
        self.hint = hint
        self.group = group
        self._future = future
        self._leaves: Sequence[str] = ()
        self.consumed = False

    def is_complete(self) -> bool:
        return self._future.done()

    done = is_complete

    def state(self) -> _LeaseState | None:
        if not self._future.done() or self._future.cancelled() or self._future.exception() is not None:
            return None
        return self._future.result()

    def result(self) -> Masks:
        """The masks, exactly ``len(block_hashes)`` long per leaf. ``RuntimeError`` before completion."""
        if not self._future.done():
            raise RuntimeError("lookup has not completed: poll is_complete() first")
        state = self.state()
        if state is None:
            return {leaf: [False] * len(self.block_hashes) for leaf in self._leaves}
        return {leaf: list(mask) for leaf, mask in state.masks.items()}

    @property
    def masks(self) -> Masks:
        return self.result()


class _Transfer:
    """A posted copy: a future on the loop thread, then maybe a device completion."""

    def __init__(self, future: concurrent.futures.Future[Completion | None], *, is_load: bool,
                 g0_blocks_per_leaf: Mapping[str, Sequence[int]] | None = None) -> None:
        self._future = future
        self._is_load = is_load
        self._g0 = dict(g0_blocks_per_leaf or {})
        self._error: BaseException | None = None
        self._completion: Completion | None = None
        self._landed = False

    @property
    def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
        return self._g0

    def is_complete(self) -> bool:
        """Never blocks. A failed load raises :class:`KVLoadFailed`, on every poll."""
        if self._landed:
            return True
        if self._error is not None:
            raise KVLoadFailed(str(self._error)) from self._error
        if not self._future.done():
            return False
        try:
            self._completion = self._completion or self._future.result()
        except BaseException as exc:  # noqa: BLE001 - reported as the protocol's failure type
            if not self._is_load:
                self._landed = True  # a failed offload stores nothing; the engine is not told
                return True
            self._error = exc
            if isinstance(exc, ChecksumMismatch):
                raise KVLoadFailed(f"load failed its end-to-end checksum (corrupted or substituted blocks; "
                                   f"nothing loaded may be used): {exc}") from exc
            raise KVLoadFailed(f"load failed after it was posted: {exc}") from exc
        try:
            if self._completion is not None and not self._completion.is_done():
                return False
        except Exception as exc:  # noqa: BLE001 - a device error in the copy is this load's failure
            if not self._is_load:
                self._landed = True
                return True
            self._error = exc
            raise KVLoadFailed(f"the device copy failed: {exc}") from exc
        self._landed = True
        return True

    def synchronize(self) -> None:
        """Block until the transfer settles (drain and shutdown only). Never raises."""
        try:
            completion = self._future.result()
            if completion is not None:
                completion.wait()
        except BaseException:  # noqa: BLE001
            pass


class _TrackedClient(NodeClient):
    """A node client whose use the connector can see (loop thread): calls in flight, and when it was last used."""

    in_flight = 0
    last_used = 0.0

    async def _call(self, fn: Any, *, idempotent: bool) -> Any:
        self.in_flight += 1
        try:
            return await super()._call(fn, idempotent=idempotent)
        finally:
            self.in_flight -= 1
            self.last_used = time.monotonic()


@dataclass
class ConnectorCounters:
    """dKV's own counters (beyond the protocol's :class:`KVCacheMetrics`)."""

    lookups: int = 0
    lookup_failures: int = 0
    lookups_skipped: int = 0  # the co-located node failed to answer recently: a miss without asking
    blocks_reported: int = 0
    hits_local: int = 0
    hits_peer: int = 0
    loads: int = 0
    loads_refused: int = 0
    loads_failed: int = 0
    checksum_failures: int = 0  # loads failed by their checksums (in loads_failed too); offloads the node refused
    blocks_loaded: int = 0
    offloads: int = 0
    blocks_offloaded: int = 0
    offloads_failed: int = 0
    touches: int = 0
    touches_dropped: int = 0  # MAX_BACKGROUND touches were already in flight
    resets_coalesced: int = 0  # a reset asked while another was still waiting to start: that one does it
    releases_dropped: int = 0  # past MAX_QUEUED_RELEASES waiting for one node: the oldest, long ended by it
    peer_clients_closed: int = 0  # peer clients closed after PEER_IDLE_TIMEOUT unused
    lookups_over_lease_budget: int = 0  # the node's max_leases were all held: a miss without asking
    lookups_truncated: int = 0  # longer than one leased request may be (max_cost, max_keys): the tail was a miss
    hints_behind_device: int = 0  # usable hints with nothing to add: the device already holds more
    unusable_hints: Counter[str] = field(default_factory=Counter)


class DKVConnector:
    """KVConnector over dKV (see module docstring for threading, sources and leases)."""

    def __init__(
        self,
        leaves: Mapping[str, LeafSpec],
        device_blocks: Sequence[Mapping[str, Sequence[torch.Tensor]]],
        *,
        namespace: str,
        node: str,
        node_id: str | None = None,
        etcd: str | None = None,
        etcd_settings: EtcdSettings | None = None,
        cluster: str = DEFAULT_CLUSTER,
        etcd_prefix: str = DEFAULT_PREFIX,
        token: bytes | None = None,
        tenant: str | None = None,
        timeout: float = 5.0,
        local: bool | None = None,
        peer_idle_timeout: float = PEER_IDLE_TIMEOUT,
        checksums: bool = True,
    ) -> None:
        """Connect to the co-located node at ``node`` and, with ``etcd``, follow the cluster.

        ``device_blocks[replica][leaf][shard]`` is a 2-D ``uint8`` tensor
        ``[pages, bytes_per_page]`` whose rows are the block ids ``load`` and
        ``offload`` name. ``node_id`` is the co-located node's id in the
        cluster (learned from the node when omitted). A peer's client unused
        for ``peer_idle_timeout`` seconds (and for its node's lease TTL, so
        that no lease of it can still be loaded from) is closed.

        ``checksums`` (default on): offloads send each block's end-to-end
        checksum and loads check every block against it (:mod:`dkv.checksum`);
        a load whose bytes do not match fails with :class:`KVLoadFailed`,
        counted in ``counters.checksum_failures``.

        ``etcd_settings`` reaches an etcd with TLS and/or authentication
        (:class:`dkv.etcd.EtcdSettings`, e.g. ``EtcdSettings.from_env()``); its
        endpoints are used unless ``etcd`` is given too. Invalid settings raise
        :class:`~dkv.errors.ConfigError`, a refusing etcd :class:`~dkv.errors.ClusterError`.
        """
        self._leaves = dict(leaves)
        self._validate_blocks(device_blocks)
        self._blocks = [dict(replica) for replica in device_blocks]
        self.namespace = check_namespace(namespace)
        self.node_address = node
        self.timeout = timeout
        self._token = token  # the cluster token, or with ``tenant`` that tenant's secret
        self._tenant = tenant
        self._local_path = local
        self._checksums = checksums
        if etcd_settings is not None:
            etcd_settings = (replace(etcd_settings, endpoints=etcd) if etcd else etcd_settings).validate()
        self._etcd: str | EtcdSettings | None = etcd_settings or etcd
        self._layout = Layout(cluster, etcd_prefix) if self._etcd else None
        self.counters = ConnectorCounters()
        self._metrics = KVCacheMetrics()
        self._metrics_lock = threading.Lock()
        self._host_bytes = ByteCount(free=0, total=0)
        self._disk_bytes = ByteCount(free=0, total=0)
        self._last_lookup: dict[int, _LeaseState] = {}
        self._unreachable: dict[str, tuple[str | None, float]] = {}  # address -> (its epoch, backoff end)
        self._transfers: list[_Transfer] = []
        self._budget = LeaseBudget()  # leases held per node, within each node's max_leases
        self._held = HeldBlocks()  # what the co-located node is known to hold (offloads skip it)
        self._probe_leaves = [leaf for leaf, spec in self._leaves.items() if spec.kind is AttentionKind.FULL]
        self._handle_groups = itertools.cycle(range(*HANDLE_GROUPS))
        self._clients: dict[str, _TrackedClient] = {}  # loop thread: made, used and closed there
        self._router: Router | None = None
        self._etcd_client: Any = None
        self._closed = False
        devices = {t.device for replica in self._blocks for shards in replica.values() for t in shards}
        self._copy = {d: CopyEngine(d) for d in devices}
        self._tasks: set[concurrent.futures.Future[Any]] = set()
        self._tasks_lock = threading.Lock()  # _tasks and _background, changed from any thread
        self._count_lock = threading.Lock()  # counters written from both threads
        self._background = 0  # fire-and-forget touches in flight
        self._peer_idle = peer_idle_timeout
        # loop thread only: per-node lease releases waiting (an ordered set) and the task sending them
        self._releases: dict[str, dict[int, None]] = {}
        self._releasers: dict[str, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._closing: set[NodeClient] = set()  # idle clients being closed
        self._reset_wanted = False  # loop thread: a reset asked for and not started yet
        self._resetter: asyncio.Task[None] | None = None
        self._loop = acquire_shared_loop()
        try:
            self.node_id = self._loop.run(self._start(node_id), timeout + 10)
            max_leaves = self._clients[self.node_address].limit("max_leaves")  # as its handshake said
            if len(self._leaves) > max_leaves:  # every lookup names all leaves, in one request (one lease)
                raise ValueError(f"{len(self._leaves)} leaves exceed the node's max_leaves ({max_leaves}): "
                                 f"{self.node_address} cannot look them up in one request")
        except BaseException:
            self._loop.run(self._close_clients(), timeout + 5)
            release_shared_loop()
            raise

    # ---- set-up -------------------------------------------------------------------------------

    def _validate_blocks(self, device_blocks: Sequence[Mapping[str, Sequence[torch.Tensor]]]) -> None:
        if not device_blocks:
            raise ValueError("device_blocks needs at least one replica")
        shard_counts = {spec.tp_shards for spec in self._leaves.values()}
        if len(shard_counts) != 1:
            raise ValueError(f"every leaf must have the same TP shard count, got {sorted(shard_counts)}")
        self._tp_shards = shard_counts.pop()
        for replica in device_blocks:
            if set(replica) != set(self._leaves):
                raise ValueError(f"device_blocks leaves {sorted(replica)} differ from leaves {sorted(self._leaves)}")
            for leaf, shards in replica.items():
                if len(shards) != self._leaves[leaf].tp_shards:
                    raise ValueError(f"leaf {leaf!r}: {len(shards)} shard tensors for tp_shards="
                                     f"{self._leaves[leaf].tp_shards}")
                for t in shards:
                    if t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous():
                        raise ValueError(f"leaf {leaf!r}: device blocks must be contiguous 2-D uint8 tensors")

    async def _start(self, node_id: str | None) -> str:
        local = self._client(self.node_address)
        info = await local.connect()
        await self._refresh_stats(local)  # byte counts are the node's from construction, not 0 of 0
        if self._etcd:
            self._etcd_client = make_client(self._etcd)
            await self._etcd_client.connect()
            assert self._layout is not None
            self._router = Router(self._etcd_client, self._layout)
            await self._router.start()
        self._stats_task = asyncio.create_task(self._refresh_stats_forever(), name="dkv-connector-stats")
        return node_id or info.node_id

    def _client(self, address: str) -> _TrackedClient:
        """The client of the node at ``address``, made on first use. The loop thread only.

        Clients are made, used and closed on the loop thread; another thread
        gets an existing client (to read what its handshake said), never a new
        one. A peer's client unused for a while is closed by
        :meth:`_close_idle_clients_forever`; the co-located node's never is.
        """
        client = self._clients.get(address)
        if client is None:
            if not self._loop.in_loop():
                raise RuntimeError(f"no client of {address}: clients are made on the loop thread")
            client = _TrackedClient(address, self.namespace, token=self._token, tenant=self._tenant,
                                    timeout=self.timeout,
                                    local=self._local_path, checksums=self._checksums)
            self._clients[address] = client
            if address != self.node_address and self._sweeper is None and not self._closed:
                self._sweeper = asyncio.get_running_loop().create_task(
                    self._close_idle_clients_forever(), name="dkv-connector-idle-clients")
        client.last_used = time.monotonic()
        return client

    def _idle(self, client: _TrackedClient, now: float) -> bool:
        """Unused for ``peer_idle_timeout``, and long enough that no lease it took can still be loaded from."""
        ttl = float((client.info.limits if client.info else {}).get("lease_ttl", 10.0))
        return client.in_flight == 0 and now - client.last_used >= max(self._peer_idle, ttl + LEASE_MARGIN)

    async def _close_idle_clients_forever(self) -> None:
        """Close the peers' clients that went idle (see :meth:`_idle`). The loop thread; ends at shutdown."""
        period = max(0.05, min(self._peer_idle / 2, 5.0))
        while not self._closed:
            await asyncio.sleep(period)
            now = time.monotonic()
            for address, client in list(self._clients.items()):
                if address == self.node_address or not self._idle(client, now):
                    continue
                del self._clients[address]  # the next use makes a new one
                self._closing.add(client)
                self._count(peer_clients_closed=1)
                try:
                    async with asyncio.timeout(self.timeout):
                        await client.close()
                except Exception as exc:  # noqa: BLE001 - its connections are dropped either way
                    log.debug("closing the idle client of %s: %s", address, exc)
                finally:
                    self._closing.discard(client)
                log.debug("closed the client of %s, unused for %.0f s", address, now - client.last_used)

    async def _refresh_stats(self, client: NodeClient) -> None:
        """Take the co-located node's tier occupancy (loop thread); on failure the numbers just go stale."""
        try:
            stats = await client.stats()
            self._host_bytes = ByteCount(free=stats["host"]["free"], total=stats["host"]["total"])
            self._disk_bytes = ByteCount(free=stats["disk"]["free"], total=stats["disk"]["total"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - numbers go stale, nothing breaks
            log.debug("node stats unavailable: %s", exc)

    async def _refresh_stats_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(STATS_INTERVAL)
            await self._refresh_stats(self._client(self.node_address))

    # ---- identity -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "dkv"

    @property
    def leaves(self) -> Mapping[str, Hashable]:
        return {leaf: spec.group_id for leaf, spec in self._leaves.items()}

    def defers_lookup(self, replica_idx: int = 0) -> bool:
        """True: :meth:`start_lookup` returns before it answers (the answer is a round trip)."""
        return True

    # ---- sources and hints --------------------------------------------------------------------

    def _source(self, hashes: Sequence[bytes], hint: bytes | None) -> tuple[str, bool]:
        """``(node address, is_peer)`` for a request; an unusable hint is counted and means local."""
        if hint is None:
            return self.node_address, False
        # one read of the router's member table: an immutable snapshot, whatever the loop thread does meanwhile
        members: Mapping[str, MemberRecord] = self._router.members if self._router is not None else {}
        try:
            member = resolve_hint(hint, self.namespace, hashes, members)
        except UnusableHint as exc:
            self._count_unusable_hint(exc.reason)
            return self.node_address, False
        except Exception:  # noqa: BLE001 - a hint never raises into the engine
            self._count_unusable_hint(UNKNOWN_PEER)
            return self.node_address, False
        if member is None or member.node_id == self.node_id:
            return self.node_address, False
        if self._backing_off(member.address, member.epoch):
            self._count_unusable_hint(PEER_UNREACHABLE)
            return self.node_address, False
        return member.address, True

    def _backing_off(self, address: str, epoch: str | None = None) -> bool:
        """True while ``address`` is marked unreachable (a peer that re-registered, new epoch, is asked again)."""
        mark = self._unreachable.get(address)
        if mark is None:
            return False
        marked_epoch, until = mark
        if time.monotonic() < until and (epoch is None or epoch == marked_epoch):
            return True
        self._unreachable.pop(address, None)
        return False

    def _unanswered(self, address: str, exc: BaseException) -> None:
        """A node did not answer a lookup or a load (transport failure or timeout): leave it alone a while.

        A dead or hung node then costs one bounded wait, not one per request:
        for ``UNREACHABLE_BACKOFF`` seconds hints naming it are misses counted
        as ``peer_unreachable`` (unless it re-registers with a new epoch), and
        a co-located node that does not answer makes lookups immediate misses
        (``lookups_skipped``).
        """
        if isinstance(exc, PeerUnauthenticated):  # anyone can put an address into etcd: never trust it
            if address != self.node_address:
                self._count_unusable_hint(UNAUTHENTICATED_PEER)
            log.error("node %s could not prove the cluster credential: %s", address, exc)
        elif self._closed or not isinstance(exc, (TransportError, TimeoutError, OSError)):
            return  # an error reply (an expired lease, say) is an answer
        epoch = None
        if self._router is not None:
            epoch = next((m.epoch for m in self._router.members.values() if m.address == address), None)
        self._unreachable[address] = (epoch, time.monotonic() + UNREACHABLE_BACKOFF)
        if address != self.node_address:
            self._add_metrics(dkv_peer_attach_failures=1)
        log.warning("node %s did not answer (%s); not asking it again for %.0f s", address, exc,
                    UNREACHABLE_BACKOFF)

    # ---- lookups ------------------------------------------------------------------------------

    async def _lookup_on(self, address: str, hashes: list[bytes], group: int, peer: bool,
                         hint: bytes | None, slot: int | None = None) -> _LeaseState | None:
        """One leased lookup (loop thread) within the node's lease budget.

        ``slot`` is a budget slot already held (``lookup()`` passes on its
        replica's previous one, whose lease this lookup ends on the node);
        without one a slot is taken, and with none left the lookup is a miss
        without asking (``None``, counted ``lookups_over_lease_budget``).
        """
        client = self._client(address)
        limits = client.info.limits if client.info else {}
        ttl = float(limits.get("lease_ttl", 10.0))
        if slot is None:
            slot = self._budget.take(address, int(limits.get("max_leases", DEFAULT_MAX_LEASES)),
                                     self.timeout + ttl)
            if slot is None:
                self._count(lookups_over_lease_budget=1)
                return None
        try:
            result = await self._leased_lookup(client, hashes, group)
        except BaseException:
            self._budget.give_back(address, slot)  # whatever the node did, the TTL ends it: do not wait on it
            raise
        expires_at = time.monotonic() + ttl
        if result.lease_id is None:
            self._budget.give_back(address, slot)
            slot = None
        else:
            self._budget.bind(address, slot, result.lease_id, expires_at)
        if not peer:
            self._held.learn(held=[(leaf, h) for leaf, mask in result.masks.items() for h, ok in zip(hashes, mask) if ok],
                             absent=[(leaf, h) for leaf, mask in result.masks.items()
                                     for h, ok in zip(hashes, mask) if not ok])
        return _LeaseState(address, result.lease_id, result.masks, hashes, hint, expires_at, peer,
                           client.lease_generation, slot)

    async def _leased_lookup(self, client: NodeClient, hashes: list[bytes], group: int) -> LookupResult:
        """One leased lookup of the longest prefix of ``hashes`` the node takes in one request.

        A lease is one request, bounded by the node's ``max_cost`` (hashes x
        leaves x shards) and ``max_keys``: a longer prefix is asked only as far
        as those allow, and the rest is reported absent (a shorter hit, never
        a refusal).
        """
        if client.info is None:
            await client.connect()  # the node's limits come with its handshake
        per_hash = max(1, len(self._leaves) * self._tp_shards)
        fits = max(1, min(client.limit("max_cost") // per_hash, client.limit("max_keys")))
        if len(hashes) <= fits:
            return await client.lookup(hashes, list(self._leaves), self._tp_shards, lease=True, group=group)
        self._count(lookups_truncated=1)
        result = await client.lookup(hashes[:fits], list(self._leaves), self._tp_shards, lease=True, group=group)
        absent = [False] * (len(hashes) - fits)
        return LookupResult({leaf: mask + absent for leaf, mask in result.masks.items()}, result.lease_id)

    def _empty_masks(self, n: int) -> Masks:
        return {leaf: [False] * n for leaf in self._leaves}

    def _count_lookup(self, state: _LeaseState | None) -> None:
        if state is None:
            self._count(lookups=1, lookup_failures=1)
            return
        reported = sum(m.count(True) for m in state.masks.values())
        hit = "hits_peer" if state.peer else "hits_local"
        self._count(lookups=1, blocks_reported=reported, **{hit: int(reported > 0)})

    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None) -> Masks:
        """Presence per leaf (True only when every TP shard holds the block), leased for the next ``load``.

        Blocks the calling thread for one round trip, bounded by ``timeout``; a
        node that does not answer in time is a miss. Raises ``ValueError`` for a
        hash that is not 8 or 32 bytes.
        """
        hashes = check_hashes(block_hashes)
        self._check_replica(replica_idx)
        address, peer = self._source(hashes, hint)
        previous = self._last_lookup.pop(replica_idx, None)
        slot = None
        if previous is not None and previous.address != address:
            self._release(previous)
        elif previous is not None:
            slot = previous.slot  # this lookup ends the previous one's lease on the node: its slot passes on
        if self._backing_off(address):
            self._budget.give_back(address, slot)
            self._count(lookups_skipped=1)
            return self._empty_masks(len(hashes))
        state: _LeaseState | None
        try:
            state = self._loop.run(self._lookup_on(address, hashes, replica_idx, peer, hint, slot), self.timeout + 1)
        except Exception as exc:  # noqa: BLE001 - a dead or slow node costs a miss
            self._unanswered(address, exc)
            state = None
        self._count_lookup(state)
        if state is None:
            return self._empty_masks(len(hashes))
        self._last_lookup[replica_idx] = state
        return {leaf: list(mask) for leaf, mask in state.masks.items()}

    def start_lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0,
                     hint: bytes | None = None) -> DKVLookup:
        """Start a lookup and return at once; the handle holds its own lease once it answers."""
        hashes = check_hashes(block_hashes)
        self._check_replica(replica_idx)
        address, peer = self._source(hashes, hint)
        group = next(self._handle_groups)

        async def run() -> _LeaseState | None:
            try:
                state = await self._lookup_on(address, hashes, group, peer, hint)
            except Exception as exc:  # noqa: BLE001 - a dead or slow node costs a miss
                self._unanswered(address, exc)
                state = None
            self._count_lookup(state)
            return state

        future: concurrent.futures.Future[_LeaseState | None]
        if self._backing_off(address):
            self._count(lookups_skipped=1)
            future = concurrent.futures.Future()
            future.set_result(None)
        else:
            try:
                future = self._submit(run())
            except RuntimeError:
                future = concurrent.futures.Future()
                future.set_result(None)
        handle = DKVLookup(hashes, replica_idx, hint, group, future)
        handle._leaves = list(self._leaves)
        return handle

    def abandon_lookup(self, lookup: DKVLookup) -> None:
        """Hand back a handle that will not be loaded from. Never raises, on any handle state."""
        try:
            if not isinstance(lookup, DKVLookup) or lookup.consumed:
                return
            lookup.consumed = True
            lookup._future.add_done_callback(lambda f: self._release_future(f))
        except Exception:  # noqa: BLE001
            log.debug("abandon_lookup ignored an error", exc_info=True)

    def _release_future(self, future: concurrent.futures.Future[_LeaseState | None]) -> None:
        try:
            if not future.cancelled() and future.exception() is None and future.result() is not None:
                self._release(future.result())
        except Exception:  # noqa: BLE001
            pass

    def _release(self, state: _LeaseState) -> None:
        """End a lease on its node, fire-and-forget (any thread; never lost to a limit, see :meth:`_queue_release`)."""
        if state.lease_id is None or self._closed:
            return
        try:
            self._loop.loop.call_soon_threadsafe(self._queue_release, state.address, state.lease_id)
        except RuntimeError:
            pass  # the loop is stopped: the node ended this client's leases with its connections

    def _queue_release(self, address: str, lease_id: int) -> None:
        """Queue a release for the node's releaser (loop thread): one task per node, one ordered set of leases.

        A lease queued twice is released once. Past ``MAX_QUEUED_RELEASES`` the
        oldest is let go: a node holds at most its ``--max-leases`` (64 by
        default) of one client and ends the oldest itself past that, so those
        are long gone.
        """
        if self._closed:
            return
        queue = self._releases.setdefault(address, {})
        queue[lease_id] = None
        if len(queue) > MAX_QUEUED_RELEASES:
            del queue[next(iter(queue))]
            self._count(releases_dropped=1)
        if address not in self._releasers:
            self._releasers[address] = asyncio.get_running_loop().create_task(
                self._send_releases(address), name=f"dkv-connector-release-{address}")

    async def _send_releases(self, address: str) -> None:
        """Send the releases queued for one node, one after the other, until none is left (loop thread)."""
        queue = self._releases[address]
        try:
            while queue:
                lease_id = next(iter(queue))
                del queue[lease_id]
                client = self._clients.get(address)
                try:
                    if client is not None:  # else closed since: the node ended its leases with its connections
                        await client.release(lease_id)
                except Exception as exc:  # noqa: BLE001 - the lease ends with its TTL anyway
                    log.debug("lease release failed: %s", exc)
                finally:
                    self._budget.give_back_lease(address, lease_id)  # answered, or it lapses with its TTL
        finally:
            self._releasers.pop(address, None)
            if not queue:
                self._releases.pop(address, None)

    # ---- loads --------------------------------------------------------------------------------

    def load(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
             replica_idx: int = 0, hint: bytes | None = None) -> Any:
        """Load exactly these blocks, all or nothing, out of the replica's last ``lookup()``.

        Raises only :class:`KVLoadRefused` (before anything moved: a block the
        lookup did not report, an expired lease, a different hint; bad input is
        its subclass :class:`KVLoadInvalid`, also a ``ValueError``) and
        :class:`KVLoadFailed` (posting failed); a later failure is raised by the
        returned transfer's ``is_complete()``.
        """
        state = self._last_lookup.pop(replica_idx, None)
        return self._load(state, block_ids, block_hashes, replica_idx, hint)

    def load_lookup(self, lookup: DKVLookup, block_ids: Mapping[str, Sequence[int]],
                    block_hashes: Mapping[str, Sequence[bytes]], replica_idx: int = 0,
                    hint: bytes | None = None) -> Any:
        """Load out of what ``lookup`` found; consumes the handle however this exits."""
        if not isinstance(lookup, DKVLookup) or lookup.consumed:
            raise KVLoadRefused("lookup handle was already consumed or is not a dKV handle")
        lookup.consumed = True
        state = lookup.state()
        if not lookup.is_complete():
            self._abandon_later(lookup)
            raise KVLoadRefused("lookup has not completed")
        if state is not None and (lookup.replica_idx != replica_idx or lookup.hint != hint):
            self._release(state)
            raise KVLoadRefused("load_lookup must use the lookup's replica and hint")
        return self._load(state, block_ids, block_hashes, replica_idx, hint)

    def _abandon_later(self, lookup: DKVLookup) -> None:
        lookup._future.add_done_callback(lambda f: self._release_future(f))

    def _load(self, state: _LeaseState | None, block_ids: Mapping[str, Sequence[int]],
              block_hashes: Mapping[str, Sequence[bytes]], replica_idx: int, hint: bytes | None) -> Any:
        try:
            self._check_replica(replica_idx)
            plan = plan_transfer(block_ids, block_hashes, self._blocks[replica_idx])
        except ValueError as exc:
            if state is not None:
                self._release(state)  # bad input must not leave the lookup's lease pinned
            self._count(loads_refused=1)
            self._add_metrics(connector_loads_refused=1)
            raise KVLoadInvalid(f"load refused: {exc}") from exc
        if not plan.runs:
            if state is not None:
                self._release(state)
            return CompletedTransfer()
        try:
            self._check_covered(state, plan, hint)
        except KVLoadRefused:
            self._count(loads_refused=1)
            self._add_metrics(connector_loads_refused=1)
            if state is not None:
                self._release(state)
            raise
        assert state is not None
        try:
            future = self._submit(self._read(state, plan))
        except Exception as exc:
            self._count(loads_failed=1)
            self._release(state)
            raise KVLoadFailed(f"could not post the load: {exc}") from exc
        self._count(loads=1)
        transfer = _Transfer(future, is_load=True)
        self._transfers.append(transfer)
        return transfer

    def _check_covered(self, state: _LeaseState | None, plan: TransferPlan, hint: bytes | None) -> None:
        if state is None:
            raise KVLoadRefused("no completed lookup precedes this load (or it found nothing)")
        if state.hint != hint:
            raise KVLoadRefused("load must carry the same hint as its lookup")
        if state.lease_id is None:
            raise KVLoadRefused("the lookup holds no lease", *state.blame(plan))
        if time.monotonic() > state.expires_at - LEASE_MARGIN:
            raise KVLoadRefused("the lookup's lease expired before the load", *state.blame(plan))
        client = self._clients.get(state.address)
        if client is None or client.leases_lost_since(state.generation):
            raise KVLoadRefused("the node no longer holds the lookup's lease (every connection to it closed, "
                                "or it restarted)", *state.blame(plan))
        for run in plan.runs:
            mask = state.masks.get(run.leaf, ())
            reported = {h for h, ok in zip(state.hashes, mask) if ok}
            if not reported.issuperset(run.hashes):
                missing = next(h for h in run.hashes if h not in reported)
                raise KVLoadRefused(f"leaf {run.leaf!r}: block was not reported by the lookup", run.leaf, missing)

    async def _read(self, state: _LeaseState, plan: TransferPlan) -> Completion:
        keys, rows = plan.keys(), plan.rows()
        targets, finish = self._copy[plan.device].load_targets(rows)
        try:
            await self._client(state.address).read(state.lease_id, keys, targets)  # type: ignore[arg-type]
        except Exception as exc:
            self._count(loads_failed=1)
            if isinstance(exc, ChecksumMismatch):  # corrupted or substituted bytes: failed, never delivered
                self._count(checksum_failures=1)
                log.warning("a load from %s failed its checksum: %s", state.address, exc)
            if state.peer:
                self._add_metrics(dkv_peer_load_failures=1)
            self._unanswered(state.address, exc)
            raise
        finally:
            # the read ended the lease on the node (or its failure did: a refused read, or the
            # connection closing); a lease the node still holds, if any, lapses with its TTL
            self._budget.give_back_lease(state.address, state.lease_id)  # type: ignore[arg-type]
        self._count(blocks_loaded=len(keys))
        self._add_metrics(h2d_bytes_copied=plan.nbytes, dkv_peer_loads=int(state.peer))
        return finish()

    # ---- offloads -----------------------------------------------------------------------------

    def offload(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                replica_idx: int = 0) -> Any:
        """Copy device blocks to the co-located node; published there once their bytes are in.

        The returned transfer's ``g0_blocks_per_leaf`` are the device blocks to
        keep pinned until it completes. A failed offload completes without
        raising (the blocks are simply not stored) and is counted.
        """
        self._check_replica(replica_idx)
        plan = self._not_held(plan_transfer(block_ids, block_hashes, self._blocks[replica_idx]))
        if not plan.runs or self._closed:
            return CompletedTransfer()  # moves nothing: pinned nowhere
        sources, ready = self._copy[plan.device].offload_sources(plan.rows)

        async def run() -> None:
            while not ready.is_done():
                await asyncio.sleep(0.0005)
            try:
                result = await self._client(self.node_address).write(plan.keys(), sources())
            except Exception as exc:
                self._count(offloads_failed=1, checksum_failures=int(isinstance(exc, ChecksumMismatch)))
                raise
            self._count(blocks_offloaded=result.stored)
            self._add_metrics(d2h_bytes_copied=self._learn_offload(plan, result.statuses))
            return None

        try:
            future = self._submit(run())
        except RuntimeError:
            return CompletedTransfer()
        self._count(offloads=1)
        transfer = _Transfer(future, is_load=False, g0_blocks_per_leaf=plan.block_ids())
        self._transfers.append(transfer)
        return transfer

    def _not_held(self, plan: TransferPlan) -> TransferPlan:
        """``plan`` without the blocks the co-located node is known to hold (see :mod:`connector.held_blocks`)."""
        runs = []
        for run in plan.runs:
            keep = [i for i, h in enumerate(run.hashes) if not self._held.holds(run.leaf, h)]
            if len(keep) == len(run.hashes):
                runs.append(run)
            elif keep:
                runs.append(LeafRun(run.leaf, run.shards, [run.block_ids[i] for i in keep],
                                    [run.hashes[i] for i in keep]))
        return plan if len(runs) == len(plan.runs) and all(a is b for a, b in zip(runs, plan.runs)) \
            else TransferPlan(runs)

    def _learn_offload(self, plan: TransferPlan, statuses: Sequence[str]) -> int:
        """Remember what the node now holds; returns the bytes it took (the D2H bytes this offload moved)."""
        moved = 0
        held = []
        at = 0
        for run in plan.runs:
            n, shards = len(run.hashes), len(run.shards)
            per_shard = [statuses[at + s * n: at + (s + 1) * n] for s in range(shards)]
            for s, tensor in enumerate(run.shards):
                moved += per_shard[s].count(WRITE) * int(tensor.shape[1])
            held += [(run.leaf, h) for i, h in enumerate(run.hashes)
                     if all(per_shard[s][i] in (WRITE, EXISTS) for s in range(shards))]
            at += n * shards
        self._held.learn(held=held)
        return moved

    # ---- recency, pricing, housekeeping -------------------------------------------------------

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        """Refresh recency of device-served blocks (the whole chain from its root). Never raises.

        Fire-and-forget, at most ``MAX_BACKGROUND`` in flight: one more is
        dropped and counted (``counters.touches_dropped``); a missed touch costs
        a later refetch at most.
        """
        try:
            hashes = check_hashes(block_hashes)
            if not hashes or self._closed:
                return
            leaves = list(self._leaves)

            async def run() -> None:
                try:
                    await self._client(self.node_address).touch(hashes, leaves, self._tp_shards)
                except Exception as exc:  # noqa: BLE001 - a missed touch costs a later refetch at most
                    log.debug("touch failed: %s", exc)

            if self._fire(run()):
                self._count(touches=1)
            else:
                self._count(touches_dropped=1)
        except Exception:  # noqa: BLE001
            log.debug("touch ignored an error", exc_info=True)

    def probe(self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int],
              hint: bytes | None = None) -> Sequence[Mapping[str, Sequence[bool]]] | None:
        """What each replica could load, from the directory index, without leases.

        The external tier is replica-agnostic, so every replica gets the same
        answer (one shared mapping). The directory knows a node's deepest
        block of a chain, not which leaf holds what, so the answer covers the
        full-attention leaves only (each of those holds every block of the
        prefix it covers; a windowed leaf holds only its window's worth, and
        the protocol lets an answer leave out leaves that one representative
        leaf stands for). ``None`` when there is no directory to answer from
        (no etcd configured) or no full-attention leaf to answer for.
        """
        if self._router is None or not self._probe_leaves:
            return None
        hashes = check_hashes(block_hashes)
        address, peer = self._source(hashes, hint)
        node_id = self.node_id
        if peer:
            node_id = next((m.node_id for m in self._router.members.values() if m.address == address), node_id)
        depth = self._router.depth_of(node_id, self.namespace, hashes)
        mask = [True] * depth + [False] * (len(hashes) - depth)
        answer = {leaf: mask for leaf in self._probe_leaves}
        return [answer for _ in replica_idxs]

    def poll_transfers(self) -> None:
        """Drop settled transfers from the books. Cheap, non-blocking, never raises."""
        try:
            self._transfers = [t for t in self._transfers if not t._future.done()]
        except Exception:  # noqa: BLE001
            pass

    def _add_metrics(self, **counts: int) -> None:
        """Add to the per-batch metrics; fields the metrics type lacks are skipped (MAX's has more)."""
        with self._metrics_lock:
            for name, n in counts.items():
                if n and hasattr(self._metrics, name):
                    setattr(self._metrics, name, getattr(self._metrics, name) + n)

    def _count_unusable_hint(self, reason: str) -> None:
        """A hint that cannot be used: a miss, counted by reason (in MAX's dKV metrics too).

        A hint whose peer holds less than the engine's device already has
        (``behind_device``) is not a rejected hint: it is counted apart, in
        ``counters.hints_behind_device``, and not in MAX's ``dkv_hints_rejected``.
        """
        if reason == BEHIND_DEVICE:
            self._count(hints_behind_device=1)
            return
        with self._count_lock:
            self.counters.unusable_hints[reason] += 1
        self._add_metrics(dkv_hints_rejected=1)
        with self._metrics_lock:
            by_reason = getattr(self._metrics, "dkv_hints_rejected_by_reason", None)
            if by_reason is not None:
                by_reason[reason] = by_reason.get(reason, 0) + 1

    @property
    def metrics(self) -> Any:
        """A snapshot of the per-batch metrics since the last :meth:`take_metrics` (MAX's type under MAX)."""
        with self._metrics_lock:
            return copy.deepcopy(self._metrics)

    def take_metrics(self) -> Any:
        """Read and clear the per-batch transfer counters."""
        with self._metrics_lock:
            taken, self._metrics = self._metrics, KVCacheMetrics()
        return taken

    @property
    def host_byte_count(self) -> Any:
        return self._host_bytes

    @property
    def disk_byte_count(self) -> Any:
        return self._disk_bytes

    def reset_prefix_cache(self) -> None:
        """Drop this namespace's unpinned blocks on the co-located node (fire-and-forget). Never raises.

        One reset runs at a time; one asked while another waits to start is
        that one (``counters.resets_coalesced``).
        """
        try:
            if not self._closed:
                self._loop.loop.call_soon_threadsafe(self._want_reset)
        except Exception:  # noqa: BLE001 - the loop is stopped
            pass

    def _want_reset(self) -> None:
        """Loop thread: note a reset and start the resetter unless it runs."""
        if self._closed:
            return
        if self._reset_wanted:
            self._count(resets_coalesced=1)
            return
        self._reset_wanted = True
        if self._resetter is None:
            self._resetter = asyncio.get_running_loop().create_task(self._reset(), name="dkv-connector-reset")

    async def _reset(self) -> None:
        try:
            while self._reset_wanted:
                self._reset_wanted = False
                try:
                    await self._client(self.node_address).clear()
                except Exception as exc:  # noqa: BLE001
                    log.debug("reset_prefix_cache failed: %s", exc)
        finally:
            self._resetter = None

    def shutdown(self) -> None:
        """Drain transfers (bounded), release leases, close connections, stop the loop. Never raises."""
        if self._closed:
            return
        try:
            deadline = time.monotonic() + self.timeout * 2
            for transfer in list(self._transfers):
                try:
                    transfer._future.result(max(0.0, deadline - time.monotonic()))
                except BaseException:  # noqa: BLE001
                    pass
            for state in list(self._last_lookup.values()):
                self._release(state)
            self._last_lookup.clear()
            self._closed = True
            self._loop.run(self._close_clients(), self.timeout + 5)
        except Exception:  # noqa: BLE001
            log.warning("connector shutdown was not clean", exc_info=True)
        finally:
            self._closed = True
            release_shared_loop()

    # ---- owned work on the loop thread ----------------------------------------------------------
    #
    # Everything the connector starts on the loop is owned here and cancelled at shutdown:
    # lookups and transfers behind handles (_submit; as many as the engine has handles), touches
    # (_fire: at most MAX_BACKGROUND, more dropped and counted), one resetter (_reset) and one
    # lease releaser per node (_send_releases, its queue bounded), and the idle-client sweeper.

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the UCX loop as a task this connector owns (cancelled at shutdown). Any thread."""
        future = self._loop.submit(coro)
        with self._tasks_lock:
            self._tasks.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._tasks_lock:
            self._tasks.discard(future)

    def _fire(self, coro: Any) -> bool:
        """Run fire-and-forget ``coro`` as owned work; False (``coro`` dropped) when ``MAX_BACKGROUND`` run."""
        with self._tasks_lock:
            if self._background >= MAX_BACKGROUND:
                coro.close()
                return False
            self._background += 1
        try:
            future = self._submit(coro)
        except BaseException:
            self._fired(None)
            raise
        future.add_done_callback(self._fired)
        return True

    def _fired(self, _future: concurrent.futures.Future[Any] | None) -> None:
        with self._tasks_lock:
            self._background -= 1

    def _count(self, **deltas: int) -> None:
        """Add to :attr:`counters`; both threads count, so under a lock."""
        with self._count_lock:
            for name, n in deltas.items():
                if n:
                    setattr(self.counters, name, getattr(self.counters, name) + n)

    async def _close_clients(self) -> None:
        self._closed = True  # nothing new is started on the loop from here on
        with self._tasks_lock:
            owned = [f for f in self._tasks if not f.done()]
        for future in owned:
            future.cancel()
        await asyncio.gather(*(asyncio.wrap_future(f) for f in owned), return_exceptions=True)
        workers = [t for t in (self._sweeper, self._resetter, *self._releasers.values()) if t is not None]
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        self._releases.clear()
        task = getattr(self, "_stats_task", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._router is not None:
            await self._router.stop()
        clients = [*self._clients.values(), *self._closing]
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        if self._etcd_client is not None:
            try:
                await self._etcd_client.close()
            except Exception:  # noqa: BLE001
                pass

    def _check_replica(self, replica_idx: int) -> None:
        if not 0 <= replica_idx < len(self._blocks):
            raise ValueError(f"replica_idx {replica_idx} outside 0..{len(self._blocks) - 1}")

    def __repr__(self) -> str:
        return f"DKVConnector(node={self.node_address!r}, namespace={self.namespace!r}, leaves={list(self._leaves)})"


__all__ = ["DKVConnector", "DKVLookup", "DKVError"]
