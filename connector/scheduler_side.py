"""The connector's scheduler side: what the engine's scheduler thread decides, without I/O.

:class:`SchedulerSide` holds the state and logic behind every
:class:`~connector.dkv_connector.DKVConnector` call the engine makes: which
node a request's hint names (:meth:`SchedulerSide.source`), which nodes to
leave alone after they failed to answer (backoff), the lease each replica's
last ``lookup()`` holds and the lease budget per node, the validation and
planning of loads and offloads, what the co-located node is known to hold,
and the counters and per-batch metrics. Nothing here sends, awaits or blocks:
the worker side (:mod:`connector.worker_side`) moves the bytes on the loop
thread and reports back through the methods marked "loop thread" or "any
thread" (bookkeeping only, under the small locks noted).

Cross-thread reads follow DESIGN §6: the router's member table and directory
index are immutable snapshots swapped by reference on the loop thread; a call
here reads one snapshot and keeps it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import itertools
import logging
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.held_blocks import HeldBlocks
from connector.lease_budget import LeaseBudget, Slot
from connector.transfer_plan import TransferPlan, leaf_tensors, plan_transfer
from connector.metrics import load_duration_histogram
from connector.types import (
    AttentionKind,
    KVCacheMetrics,
    KVLoadInvalid,
    KVLoadRefused,
    LeafSpec,
)
from dkv.errors import ChecksumMismatch, OpTimeout, PeerUnauthenticated, ReadNotIntact, RemoteError, TransportError
from dkv.etcd import MemberRecord
from dkv.hints import (
    BEHIND_DEVICE,
    PEER_UNREACHABLE,
    UNAUTHENTICATED_PEER,
    UNKNOWN_PEER,
    UnusableHint,
    resolve_hint,
)
from dkv.keys import check_hashes
from dkv.router import Router
from dkv.store import EXISTS, WRITE

log = logging.getLogger("connector.dkv_connector")

Masks = dict[str, list[bool]]
LEASE_MARGIN = 0.5  # seconds: a lease closer than this to expiry is not loaded from
HANDLE_GROUPS = (1024, 1 << 20)  # node lease groups for start_lookup handles
DEFAULT_MAX_LEASES = 64  # a node's --max-leases when its handshake does not say
UNREACHABLE_BACKOFF = 10.0  # seconds a node that failed to answer a lookup or a load is not asked again


@dataclass
class LeaseState:
    """What a completed lookup found and holds. Built on the loop thread, then read-only."""

    address: str  # node the lease lives on
    lease_id: int | None
    masks: Masks
    hashes: list[bytes]
    hint: bytes | None
    expires_at: float
    peer: bool  # True when the source is not the co-located node
    generation: int = 0  # the client's lease generation when the lease was granted
    slot: int | None = None  # its slot in the connector's lease budget on that node
    # the node sent the blocks' bytes with the answer: the connector's client holds them, and the node ended
    # the lease then, so nothing of the node (a connection, the lease) is needed for the load
    received: bool = False
    # per leaf, the hashes the lookup reported, as sets: built the first time a load needs them (see
    # covers), which most loads do not (building them for 256 hashes cost a lookup ~8 µs, for 4,096 ~150)
    _reported: dict[str, frozenset[bytes]] | None = field(default=None, repr=False)

    @property
    def reported(self) -> dict[str, frozenset[bytes]]:
        """Per leaf, the set of hashes the lookup reported present (built once, on first use)."""
        reported = self._reported
        if reported is None:
            reported = self._reported = {leaf: frozenset(itertools.compress(self.hashes, mask))
                                         for leaf, mask in self.masks.items()}
        return reported

    def covers(self, leaf: str, hashes: Sequence[bytes]) -> bool:
        """Whether the lookup reported every one of ``hashes`` present in ``leaf``.

        A load usually reads a run of the lookup's own hashes, in order: that is
        checked against the lookup's list and mask directly (the same objects,
        so each comparison is one identity check). Anything else is checked
        against :attr:`reported`.
        """
        mask = self.masks.get(leaf)
        if mask is None:
            return not hashes
        if hashes:
            try:
                at = self.hashes.index(hashes[0])
            except ValueError:
                return False  # not among the lookup's hashes: never reported
            end = at + len(hashes)
            if all(itertools.islice(mask, at, end)) and self.hashes[at:end] == (
                    hashes if type(hashes) is list else list(hashes)):
                return True
        return self.reported[leaf].issuperset(hashes)

    def blame(self, plan: TransferPlan) -> tuple[str, bytes]:
        """Scheduler thread: the leaf and block to name when the whole lease is refused: the first block asked for."""
        first = plan.runs[0]
        return first.leaf, first.hashes[0]


_UNSETTLED = object()  # a DKVLookup's state before its future settled


def _outcome(future: concurrent.futures.Future[LeaseState | None]) -> LeaseState | None:
    """A settled lookup future's state: ``None`` when it failed or was cancelled (a miss, never an error)."""
    return None if future.cancelled() or future.exception() is not None else future.result()


def _keep_state(into: list[Any], future: concurrent.futures.Future[LeaseState | None]) -> None:
    """A lookup's future settled: what :meth:`DKVLookup.state` answers from now on."""
    into[0] = _outcome(future)


class DKVLookup:
    """The handle :meth:`DKVConnector.start_lookup` returns. Any thread; never blocks.

    ``is_complete()`` never blocks; ``result()`` gives the per-leaf masks once
    complete (all False if the lookup failed: a failure is a miss, never an error).
    """

    def __init__(self, hashes: list[bytes], replica_idx: int, hint: bytes | None, group: int,
                 future: concurrent.futures.Future[LeaseState | None],
                 poll: Callable[[], bool] | None = None) -> None:
        """Scheduler thread (:meth:`DKVConnector.start_lookup` makes it).

        ``poll``: where the answer is read by whoever polls (a lookup sent
        over a direct channel, see :class:`connector.worker_side.InPlaceLookup`),
        what :meth:`is_complete` calls until ``future`` resolves; the loop
        thread polls it too, so a handle nobody polls still completes.
        """
        self.block_hashes = hashes
        self.replica_idx = replica_idx
        self.hint = hint
        self.group = group
        self._future = future
        self._poll = poll
        self._leaves: Sequence[str] = ()
        self.consumed = False
        # what state() answers once the future settled, kept by the thread that settles it so that state() takes
        # no lock; in a list of its own, so that the future's callback does not hold the handle (no cycle)
        self._settled: list[Any] = [_UNSETTLED]
        future.add_done_callback(functools.partial(_keep_state, self._settled))

    def is_complete(self) -> bool:
        """Any thread: whether the lookup has answered (never blocks: at most it reads what arrived)."""
        future = self._future
        if not future.done() and self._poll is not None:
            self._poll()
        return future.done()

    @property
    def answered_by_polling(self) -> bool:
        """Whether this handle's answer is read by polling :meth:`is_complete` (a waiter should poll, not block)."""
        return self._poll is not None

    done = is_complete

    def state(self) -> LeaseState | None:
        """Any thread: what the lookup found and holds; ``None`` before it answers or when it failed."""
        state = self._settled[0]
        if state is not _UNSETTLED:
            return state  # type: ignore[return-value]
        future = self._future  # settled, its callbacks not run yet (or not settled at all)
        return _outcome(future) if future.done() else None

    def result(self) -> Masks:
        """Any thread: the masks, exactly ``len(block_hashes)`` long per leaf. ``RuntimeError`` before completion."""
        if not self._future.done():
            raise RuntimeError("lookup has not completed: poll is_complete() first")
        state = self.state()
        if state is None:
            return {leaf: [False] * len(self.block_hashes) for leaf in self._leaves}
        return {leaf: list(mask) for leaf, mask in state.masks.items()}

    @property
    def masks(self) -> Masks:
        """Any thread: :meth:`result`."""
        return self.result()


@dataclass
class ConnectorCounters:
    """dKV's own counters (beyond the protocol's :class:`KVCacheMetrics`)."""

    lookups: int = 0
    lookup_failures: int = 0
    lookups_skipped: int = 0  # the co-located node failed to answer recently: a miss without asking
    lookups_in_place: int = 0  # lookup() calls and start_lookup handles answered off the loop (a direct channel), in lookups too
    # lookups that took the loop because every direct channel to the node held an unread answer (direct_channels)
    lookups_channels_busy: int = 0
    blocks_reported: int = 0
    hits_local: int = 0
    hits_peer: int = 0
    loads: int = 0
    # loads copied without the loop thread (the calling thread, or the copy threads it posts to), from
    # same-host slots or from the blocks a lookup's answer brought (in loads too)
    loads_in_place: int = 0
    loads_refused: int = 0
    loads_failed: int = 0
    checksum_failures: int = 0  # loads failed by their checksums (in loads_failed too); offloads the node refused;
    # lookups whose blocks, sent with the answer, failed theirs (those blocks reported absent)
    blocks_loaded: int = 0
    offloads: int = 0
    blocks_offloaded: int = 0
    offloads_failed: int = 0
    offload_blocks_full: int = 0  # blocks the co-located node had no room for (its pool pinned, a quota): not stored
    offloads_dropped: int = 0  # the co-located node failed to answer recently: dropped without asking (backoff)
    touches: int = 0
    touches_dropped: int = 0  # MAX_BACKGROUND touches were already in flight
    resets_coalesced: int = 0  # a reset asked while another was still waiting to start: that one does it
    releases_dropped: int = 0  # past MAX_QUEUED_RELEASES waiting for one node: the oldest, long ended by it
    peer_clients_closed: int = 0  # peer clients closed after PEER_IDLE_TIMEOUT unused
    lookups_over_lease_budget: int = 0  # the node's max_leases were all held: a miss without asking
    lookups_truncated: int = 0  # longer than one leased request may be (max_cost, max_keys): the tail was a miss
    hints_behind_device: int = 0  # usable hints with nothing to add: the device already holds more
    bytes_loaded: int = 0  # block bytes loads brought in (host side: what the reads received)
    bytes_offloaded: int = 0  # block bytes offloads stored on the co-located node (D2H bytes it took)
    unusable_hints: Counter[str] = field(default_factory=Counter)
    loads_refused_by_reason: Counter[str] = field(default_factory=Counter)  # see LOAD_REFUSALS; sums to loads_refused
    loads_failed_by_reason: Counter[str] = field(default_factory=Counter)  # see load_failure_reason; sums to loads_failed


# Why a load was refused before anything moved (``counters.loads_refused_by_reason``).
LOAD_REFUSALS = ("invalid", "no_lookup", "hint_mismatch", "no_lease", "lease_expired", "lease_lost", "not_reported")
# Error codes a node may answer a read with that are counted by name; any other code counts as "remote".
_READ_ERROR_CODES = frozenset({"lease_expired", "busy", "forbidden", "invalid", "protocol", "shm", "too_costly"})


def load_failure_reason(exc: BaseException) -> str:
    """A bounded label for why a posted load failed (``counters.loads_failed_by_reason``).

    ``checksum`` (bytes did not match), ``not_intact`` (a same-host copy
    outlived its read's pins), ``unauthenticated`` (the peer could not prove the
    credential), ``timeout``, ``transport`` (the connection failed), a node's
    error code (``lease_expired``, ``busy``, ...; ``remote`` for one not known
    here, so a peer cannot mint labels), or ``other``.
    """
    if isinstance(exc, ChecksumMismatch):
        return "checksum"
    if isinstance(exc, ReadNotIntact):
        return "not_intact"
    if isinstance(exc, PeerUnauthenticated):
        return "unauthenticated"
    if isinstance(exc, (OpTimeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, (TransportError, OSError)):
        return "transport"
    if isinstance(exc, RemoteError):
        return exc.code if exc.code in _READ_ERROR_CODES else "remote"
    return "other"


def validate_device_blocks(leaves: Mapping[str, LeafSpec],
                           device_blocks: Sequence[Mapping[str, Sequence[torch.Tensor]]]) -> int:
    """Check the engine's device tensors against ``leaves``; returns the (common) TP shard count."""
    if not device_blocks:
        raise ValueError("device_blocks needs at least one replica")
    if len(device_blocks) > HANDLE_GROUPS[0] // 2:  # each replica's lookup() uses two node lease groups below them
        raise ValueError(f"at most {HANDLE_GROUPS[0] // 2} replicas, got {len(device_blocks)}")
    shard_counts = {spec.tp_shards for spec in leaves.values()}
    if len(shard_counts) != 1:
        raise ValueError(f"every leaf must have the same TP shard count, got {sorted(shard_counts)}")
    for replica in device_blocks:
        if set(replica) != set(leaves):
            raise ValueError(f"device_blocks leaves {sorted(replica)} differ from leaves {sorted(leaves)}")
        for leaf, shards in replica.items():
            if len(shards) != leaves[leaf].tp_shards:
                raise ValueError(f"leaf {leaf!r}: {len(shards)} shard tensors for tp_shards="
                                 f"{leaves[leaf].tp_shards}")
            for t in shards:
                if t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous():
                    raise ValueError(f"leaf {leaf!r}: device blocks must be contiguous 2-D uint8 tensors")
    return shard_counts.pop()


class SchedulerSide:
    """Hints, leases, backoff, validation and planning, counters: no I/O (see module docstring).

    ``router`` (the directory, when etcd is configured) and ``node_id`` are set
    once the worker side has started; ``router`` is only read here, one
    immutable snapshot per call.
    """

    def __init__(self, leaves: Mapping[str, LeafSpec],
                 device_blocks: Sequence[Mapping[str, Sequence[torch.Tensor]]], *,
                 namespace: str, node_address: str, timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Any thread (construction). ``ValueError`` for device tensors that do not match ``leaves``."""
        self.leaves = dict(leaves)
        self.tp_shards = validate_device_blocks(self.leaves, device_blocks)
        self.blocks = [dict(replica) for replica in device_blocks]
        self.tensors = [leaf_tensors(replica) for replica in self.blocks]  # pages, sizes, device: read once
        self.leaf_names = list(self.leaves)
        self.probe_leaves = [leaf for leaf, spec in self.leaves.items() if spec.kind is AttentionKind.FULL]
        self.namespace = namespace
        self.node_address = node_address
        self.timeout = timeout  # the connector's bound on one round trip
        self.node_id: str | None = None
        self.router: Router | None = None
        self.clock = clock
        self.counters = ConnectorCounters()
        self._count_lock = threading.Lock()  # counters are written from both threads
        self.load_seconds = load_duration_histogram()  # observed on the loop thread, per load that landed
        self._load_seconds_of: dict[bool, Any] = {}  # its child per source, made on first use (labels() locks)
        self._metrics = KVCacheMetrics()
        self._metrics_lock = threading.Lock()
        self.last_lookup: dict[int, LeaseState] = {}  # scheduler thread: each replica's lookup() lease
        self._replica_groups: dict[int, int] = {}  # scheduler thread: the group of each replica's last lookup()
        self.unreachable: dict[str, tuple[str | None, float]] = {}  # address -> (its epoch, backoff end)
        self.budget = LeaseBudget()  # leases held per node, within each node's max_leases
        self.held = HeldBlocks()  # what the co-located node is known to hold (offloads skip it)
        self._handle_groups = itertools.cycle(range(*HANDLE_GROUPS))

    # ---- identity -----------------------------------------------------------------------------

    def leaf_groups(self) -> dict[str, Hashable]:
        """Any thread: leaf id -> the engine's group id."""
        return {leaf: spec.group_id for leaf, spec in self.leaves.items()}

    def check_replica(self, replica_idx: int) -> None:
        """Any thread: ``ValueError`` for a replica the connector has no device blocks of."""
        if not 0 <= replica_idx < len(self.blocks):
            raise ValueError(f"replica_idx {replica_idx} outside 0..{len(self.blocks) - 1}")

    def replica_group(self, replica_idx: int, ends_previous: bool) -> int:
        """Scheduler thread: the node lease group of replica ``replica_idx``'s next ``lookup()``.

        Each replica has two groups (``2r`` and ``2r + 1``; replicas are far
        fewer than :data:`HANDLE_GROUPS`' start). A lookup that ends its
        replica's previous, unloaded lease (``ends_previous``) asks in that
        lease's group, so the node ends it; one that follows a ``load`` asks in
        the other group, so the node does not end the loaded lease before the
        load's own read has reached it (the read ends it).
        """
        last = self._replica_groups.get(replica_idx, 2 * replica_idx)
        group = last if ends_previous else last ^ 1
        self._replica_groups[replica_idx] = group
        return group

    def next_handle_group(self) -> int:
        """Scheduler thread: the node lease group of the next ``start_lookup`` handle."""
        return next(self._handle_groups)

    def empty_masks(self, n: int) -> Masks:
        """Any thread: a miss on every leaf."""
        return {leaf: [False] * n for leaf in self.leaf_names}

    # ---- counters and metrics ------------------------------------------------------------------

    def count(self, **deltas: int) -> None:
        """Any thread: add to :attr:`counters` (both threads count, so under a lock)."""
        with self._count_lock:
            counters = self.counters
            for name, n in deltas.items():
                if n:
                    setattr(counters, name, getattr(counters, name) + n)

    def add_metrics(self, **counts: int) -> None:
        """Any thread: add to the per-batch metrics; fields the metrics type lacks are skipped (MAX's has more)."""
        with self._metrics_lock:
            metrics = self._metrics
            for name, n in counts.items():
                if n and hasattr(metrics, name):
                    setattr(metrics, name, getattr(metrics, name) + n)

    def metrics_snapshot(self) -> Any:
        """Any thread: a copy of the per-batch metrics since the last :meth:`take_metrics`."""
        with self._metrics_lock:
            return copy.deepcopy(self._metrics)

    def take_metrics(self) -> Any:
        """Any thread: read and clear the per-batch metrics."""
        with self._metrics_lock:
            taken, self._metrics = self._metrics, KVCacheMetrics()
        return taken

    def count_unusable_hint(self, reason: str) -> None:
        """Any thread: a hint that cannot be used is a miss, counted by reason (in MAX's dKV metrics too).

        A hint whose peer holds less than the engine's device already has
        (``behind_device``) is not a rejected hint: it is counted apart, in
        ``counters.hints_behind_device``, and not in MAX's ``dkv_hints_rejected``.
        """
        if reason == BEHIND_DEVICE:
            self.count(hints_behind_device=1)
            return
        with self._count_lock:
            self.counters.unusable_hints[reason] += 1
        self.add_metrics(dkv_hints_rejected=1)
        with self._metrics_lock:
            by_reason = getattr(self._metrics, "dkv_hints_rejected_by_reason", None)
            if by_reason is not None:
                by_reason[reason] = by_reason.get(reason, 0) + 1

    def observe_load(self, peer: bool, seconds: float) -> None:
        """Loop thread: one load that landed, from a peer or from the co-located node, took ``seconds``."""
        child = self._load_seconds_of.get(peer)
        if child is None:
            child = self._load_seconds_of[peer] = self.load_seconds.labels("peer" if peer else "local")
        child.observe(seconds)

    def count_lookup(self, state: LeaseState | None) -> None:
        """Any thread (the loop thread for handles): count one lookup's outcome."""
        if state is None:
            self.count(lookups=1, lookup_failures=1)
            return
        reported = sum(m.count(True) for m in state.masks.values())
        with self._count_lock:  # (count() itself, spelled out: once per lookup)
            counters = self.counters
            counters.lookups += 1
            if reported:
                counters.blocks_reported += reported
                if state.peer:
                    counters.hits_peer += 1
                else:
                    counters.hits_local += 1

    def count_landed_in_place(self, blocks: int, nbytes: int, *, posted: bool) -> None:
        """Any thread: one load copied without the loop thread landed (``posted``: counted in ``loads`` already)."""
        with self._count_lock:  # (count() itself, spelled out: once per load)
            counters = self.counters
            if not posted:
                counters.loads += 1
            counters.loads_in_place += 1
            counters.blocks_loaded += blocks
            counters.bytes_loaded += nbytes

    # ---- sources, hints and backoff -------------------------------------------------------------

    def source(self, hashes: Sequence[bytes], hint: bytes | None) -> tuple[str, bool]:
        """Scheduler thread: ``(node address, is_peer)`` for a request; an unusable hint is counted and means local."""
        if hint is None:
            return self.node_address, False
        # one read of the router's member table: an immutable snapshot, whatever the loop thread does meanwhile
        router = self.router
        members: Mapping[str, MemberRecord] = router.members if router is not None else {}
        recent = getattr(router, "recently_live", None)  # members live a short, bounded while ago
        try:
            member = resolve_hint(hint, self.namespace, hashes, members, recent)
        except UnusableHint as exc:
            self.count_unusable_hint(exc.reason)
            return self.node_address, False
        except Exception:  # noqa: BLE001 - a hint never raises into the engine
            self.count_unusable_hint(UNKNOWN_PEER)
            return self.node_address, False
        if member is None or member.node_id == self.node_id:
            return self.node_address, False
        # a member only recently live (router.recently_live) is backed off whatever epoch it was marked at
        epoch = member.epoch if members.get(member.node_id) is member else None
        if self.backing_off(member.address, epoch):
            self.count_unusable_hint(PEER_UNREACHABLE)
            return self.node_address, False
        return member.address, True

    def backing_off(self, address: str, epoch: str | None = None) -> bool:
        """Any thread: True while ``address`` is marked unreachable (a peer that re-registered, new epoch, is asked again)."""
        mark = self.unreachable.get(address)
        if mark is None:
            return False
        marked_epoch, until = mark
        if self.clock() < until and (epoch is None or epoch == marked_epoch):
            return True
        self.unreachable.pop(address, None)
        return False

    def unanswered(self, address: str, exc: BaseException, *, closed: bool = False) -> None:
        """Any thread: a node did not answer a lookup, a load or an offload (transport failure or timeout): leave it alone a while.

        A dead or hung node then costs one bounded wait, not one per request:
        for ``UNREACHABLE_BACKOFF`` seconds hints naming it are misses counted
        as ``peer_unreachable`` (unless it re-registers with a new epoch), and
        a co-located node that does not answer makes lookups immediate misses
        (``lookups_skipped``) and offloads immediate drops (``offloads_dropped``,
        see :meth:`drop_offload`). What the co-located node was known to hold
        is forgotten: it may come back empty. ``closed``: the connector is
        shutting down, so a failure to answer says nothing about the node.
        """
        if isinstance(exc, PeerUnauthenticated):  # anyone can put an address into etcd: never trust it
            if address != self.node_address:
                self.count_unusable_hint(UNAUTHENTICATED_PEER)
            log.error("node %s could not prove the cluster credential: %s", address, exc)
        elif closed or not isinstance(exc, (TransportError, TimeoutError, OSError)):
            return  # an error reply (an expired lease, say) is an answer
        epoch = None
        if self.router is not None:
            epoch = next((m.epoch for m in self.router.members.values() if m.address == address), None)
        self.unreachable[address] = (epoch, self.clock() + UNREACHABLE_BACKOFF)
        if address != self.node_address:
            self.add_metrics(dkv_peer_attach_failures=1)
        else:
            self.held.forget()
        log.warning("node %s did not answer (%s); not asking it again for %.0f s", address, exc,
                    UNREACHABLE_BACKOFF)

    # ---- leases ---------------------------------------------------------------------------------

    def take_lease_slot(self, address: str, limits: Mapping[str, Any]) -> Slot | None:
        """Any thread (the loop thread, before it asks): a budget slot on ``address``, or ``None`` when all are held.

        ``None`` is counted (``lookups_over_lease_budget``): the lookup is a miss without asking.
        """
        ttl = float(limits.get("lease_ttl", 10.0))
        slot = self.budget.take(address, int(limits.get("max_leases", DEFAULT_MAX_LEASES)), self.timeout + ttl)
        if slot is None:
            self.count(lookups_over_lease_budget=1)
        return slot

    def granted(self, address: str, slot: Slot | None, hashes: list[bytes], hint: bytes | None, peer: bool,
                masks: Masks, lease_id: int | None, ttl: float, generation: int, *,
                received: bool = False) -> LeaseState:
        """Loop thread: a leased lookup answered; book its lease and what the co-located node holds.

        ``received``: the node sent the blocks' bytes with the answer (see :class:`LeaseState`).
        """
        expires_at = self.clock() + ttl
        if lease_id is None:
            self.budget.give_back(address, slot)
            slot = None
        else:
            self.budget.bind(address, slot, lease_id, expires_at)
        if not peer:
            self.learn_lookup(hashes, masks)
        return LeaseState(address, lease_id, masks, hashes, hint, expires_at, peer, generation, slot,
                          received=received)

    def learn_lookup(self, hashes: Sequence[bytes], masks: Mapping[str, Sequence[bool]]) -> None:
        """Any thread: the co-located node said which of ``hashes`` each leaf holds."""
        learn = self.held.learn
        for leaf, mask in masks.items():
            if all(mask):  # the usual answer: all of a prefix, or none of it
                learn(leaf, held=hashes)
            elif not any(mask):
                learn(leaf, absent=hashes)
            else:
                learn(leaf, held=list(itertools.compress(hashes, mask)),
                      absent=list(itertools.compress(hashes, map(operator.not_, mask))))

    # ---- loads ----------------------------------------------------------------------------------

    def plan_load(self, state: LeaseState | None, block_ids: Mapping[str, Sequence[int]],
                  block_hashes: Mapping[str, Sequence[bytes]], replica_idx: int, hint: bytes | None,
                  leases_lost: Callable[[str, int], bool]) -> TransferPlan | None:
        """Scheduler thread: validate a load against the lookup it reads out of; the plan, or ``None`` if it moves nothing.

        Raises :class:`KVLoadInvalid` for bad input and :class:`KVLoadRefused`
        for blocks the lookup cannot serve (both counted); the caller releases
        ``state``'s lease when this raises or returns ``None``.
        ``leases_lost(address, generation)`` says whether the node has since
        ended the leases granted at ``generation`` (a closed connection, a restart).
        """
        try:
            self.check_replica(replica_idx)
            plan = plan_transfer(block_ids, block_hashes, self.tensors[replica_idx])
        except ValueError as exc:
            self._refused("invalid")
            raise KVLoadInvalid(f"load refused: {exc}") from exc
        if not plan.runs:
            return None
        refusal = self.uncovered(state, plan, hint, leases_lost)
        if refusal is not None:
            reason, exc = refusal
            self._refused(reason)
            raise exc
        return plan

    def _refused(self, reason: str) -> None:
        with self._count_lock:
            self.counters.loads_refused += 1
            self.counters.loads_refused_by_reason[reason] += 1
        self.add_metrics(connector_loads_refused=1)

    def count_load_failure(self, exc: BaseException | None) -> None:
        """Any thread: a posted load failed (``None``: it could not be posted); counted by :func:`load_failure_reason`."""
        reason = "post" if exc is None else load_failure_reason(exc)
        with self._count_lock:
            self.counters.loads_failed += 1
            self.counters.loads_failed_by_reason[reason] += 1
            if reason == "checksum":
                self.counters.checksum_failures += 1

    def check_covered(self, state: LeaseState | None, plan: TransferPlan, hint: bytes | None,
                      leases_lost: Callable[[str, int], bool]) -> None:
        """Scheduler thread: :class:`KVLoadRefused` unless ``state``'s live lease covers every block of ``plan``."""
        refusal = self.uncovered(state, plan, hint, leases_lost)
        if refusal is not None:
            raise refusal[1]

    def uncovered(self, state: LeaseState | None, plan: TransferPlan, hint: bytes | None,
                  leases_lost: Callable[[str, int], bool]) -> tuple[str, KVLoadRefused] | None:
        """Scheduler thread: ``None`` when ``state``'s live lease covers every block of ``plan``, else (reason, refusal).

        The reason is one of :data:`LOAD_REFUSALS`.
        """
        if state is None:
            return "no_lookup", KVLoadRefused("no completed lookup precedes this load (or it found nothing)")
        if state.hint != hint:
            return "hint_mismatch", KVLoadRefused("load must carry the same hint as its lookup")
        if state.lease_id is None:
            return "no_lease", KVLoadRefused("the lookup holds no lease", *state.blame(plan))
        if self.clock() > state.expires_at - LEASE_MARGIN:
            return "lease_expired", KVLoadRefused("the lookup's lease expired before the load", *state.blame(plan))
        if not state.received and leases_lost(state.address, state.generation):
            return "lease_lost", KVLoadRefused("the node no longer holds the lookup's lease (every connection to it "
                                               "closed, or it restarted)", *state.blame(plan))
        for run in plan.runs:
            if not state.covers(run.leaf, run.hashes):
                held = state.reported.get(run.leaf, frozenset())
                missing = next(h for h in run.hashes if h not in held)
                return "not_reported", KVLoadRefused(f"leaf {run.leaf!r}: block was not reported by the lookup",
                                                     run.leaf, missing)
        return None

    # ---- offloads -------------------------------------------------------------------------------

    def plan_offload(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                     replica_idx: int) -> TransferPlan:
        """Scheduler thread: validate an offload (``ValueError``) and drop what the co-located node holds."""
        self.check_replica(replica_idx)
        return self.not_held(plan_transfer(block_ids, block_hashes, self.tensors[replica_idx]))

    def not_held(self, plan: TransferPlan) -> TransferPlan:
        """Scheduler thread: ``plan`` without the blocks the co-located node is known to hold (:mod:`connector.held_blocks`)."""
        runs = []
        changed = False
        for run in plan.runs:
            keep = self.held.lacking(run.leaf, run.hashes)
            if len(keep) == len(run.hashes):
                runs.append(run)
                continue
            changed = True
            if keep:
                runs.append(run.subset(keep))
        return TransferPlan(runs) if changed else plan

    def drop_offload(self, plan: TransferPlan) -> None:
        """Any thread: an offload not sent because the co-located node is backing off (:meth:`backing_off`).

        Counted in ``counters.offloads_dropped`` and, per leaf block, in the
        protocol's metrics (``connector_offload_blocks_dropped``). Nothing was
        written, so the node publishes nothing of it, and nothing is learnt.
        """
        self.count(offloads_dropped=1)
        self.add_metrics(connector_offload_blocks_dropped=sum(len(run.hashes) for run in plan.runs))

    def learn_offload(self, plan: TransferPlan, statuses: Sequence[str]) -> int:
        """Loop thread: remember what the node now holds; returns the bytes it took (the D2H bytes this offload moved)."""
        moved = 0
        at = 0
        for run in plan.runs:
            n, shards = len(run.hashes), len(run.shards)
            per_shard = [statuses[at + s * n: at + (s + 1) * n] for s in range(shards)]
            for s, tensor in enumerate(run.shards):
                moved += per_shard[s].count(WRITE) * int(tensor.shape[1])
            self.held.learn(run.leaf, held=[h for i, h in enumerate(run.hashes)
                                            if all(per_shard[s][i] in (WRITE, EXISTS) for s in range(shards))])
            at += n * shards
        return moved

    # ---- pricing --------------------------------------------------------------------------------

    def probe(self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int],
              hint: bytes | None = None) -> Sequence[Mapping[str, Sequence[bool]]] | None:
        """Scheduler thread: what each replica could load, from the directory index, without leases.

        See :meth:`DKVConnector.probe`. ``None`` without a directory or a full-attention leaf.
        """
        router = self.router
        if router is None or not self.probe_leaves:
            return None
        hashes = check_hashes(block_hashes)
        address, peer = self.source(hashes, hint)
        node_id = self.node_id
        if peer:
            node_id = next((m.node_id for m in router.members.values() if m.address == address), node_id)
        depth = router.depth_of(node_id, self.namespace, hashes)
        mask = [True] * depth + [False] * (len(hashes) - depth)
        answer = {leaf: mask for leaf in self.probe_leaves}
        return [answer for _ in replica_idxs]
