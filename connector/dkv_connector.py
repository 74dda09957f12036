"""``DKVConnector``: the seed's KVConnector protocol over dKV nodes.

Split by thread role (DESIGN §6), as vLLM splits scheduler and worker:

* :mod:`connector.scheduler_side` (:class:`SchedulerSide`): hints and the
  choice of source, backoff of unanswered nodes, lease state and the lease
  budget, load/offload validation and planning, what the co-located node
  holds, counters and metrics. No I/O, no awaits, nothing that blocks.
* :mod:`connector.worker_side` (:class:`WorkerSide`): the node clients, leased
  lookups, reads, writes, releases, touches, resets, stats, idle-client
  reaping and the copy engine, on the loop thread.
* :class:`DKVConnector` (here): the facade implementing the protocol by
  delegating. ``load``, ``load_lookup`` and ``offload`` validate and plan on
  the scheduler side and hand one coroutine to the loop; nothing else.

Who calls what (the seed, ``KVConnector-protocol.txt``, is the contract):

* The engine's **scheduler thread** calls every member synchronously. No member
  waits on a network there, except :meth:`DKVConnector.lookup`, which the
  protocol makes synchronous; it is bounded by ``timeout`` and engines should
  prefer :meth:`start_lookup` (``defers_lookup()`` is True).
* The process's **UCX loop thread** (:func:`dkv.loop_thread.acquire_shared_loop`,
  shared by every connector of the process) runs every round trip: leased
  lookups, reads, writes, touches, stats. The connector owns the tasks it
  starts there and cancels what is left of them at shutdown. The one
  exception: ``lookup()`` runs its round trip on the calling thread, over a
  control connection to the node taken off the loop (:mod:`dkv.direct_channel`:
  the node's same-host control socket, or its TCP one on the listener path),
  when one is open and no load it posted is still waiting to begin
  (:meth:`~connector.worker_side.WorkerSide.lookup_in_place`); otherwise, and
  whenever that channel fails, it runs on the loop as above. A
  ``start_lookup`` handle sends its lookup over the same channel from the
  calling thread and returns; its answer is read by whoever polls
  ``is_complete()`` first, never blocking, the loop thread included (every
  ``IN_PLACE_WATCH_PERIOD`` s, for a handle nobody polls:
  :class:`~connector.worker_side.InPlaceLookup`). A scheduler busy in
  Python between its polls so reads its answers without handing the GIL to
  the loop thread and back. Likewise a
  load into CPU rows is copied out of its lease's slots (same-host), or out
  of the bytes its lookup brought (listener), without the loop (a checked memcpy, no I/O:
  :meth:`~connector.worker_side.WorkerSide.load_in_place`): a small one on the
  calling thread, a larger one on the process's **copy threads**
  (:mod:`dkv.copy_threads`), to which the calling thread posts it.

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

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from connector.metrics import ConnectorCollector
from connector.scheduler_side import (
    DEFAULT_MAX_LEASES,
    HANDLE_GROUPS,
    LEASE_MARGIN,
    UNREACHABLE_BACKOFF,
    ConnectorCounters,
    DKVLookup,
    LeaseState,
    Masks,
    SchedulerSide,
)
from connector.types import CompletedTransfer, KVLoadRefused, LeafSpec
from connector.worker_side import (
    LOOKUP_PAYLOAD_BYTES,
    MAX_BACKGROUND,
    MAX_QUEUED_RELEASES,
    PEER_IDLE_TIMEOUT,
    STATS_INTERVAL,
    InPlace,
    InPlaceLookup,
    TrackedClient,
    Transfer,
    WorkerSide,
)
from dkv.client import DIRECT_CHANNELS
from dkv.errors import DKVError, OpTimeout
from dkv.etcd import DEFAULT_CLUSTER, DEFAULT_PREFIX, EtcdSettings, Layout
from dkv.gil import DEFAULT_SWITCH_INTERVAL, check_switch_interval, hold_switch_interval, release_switch_interval
from dkv.keys import check_hashes, check_namespace
from dkv.light_future import resolved
from dkv.loop_thread import acquire_shared_loop, release_shared_loop
from dkv.polling import REPLY_SPIN, check_reply_spin
from dkv.transport import rdma_possible

log = logging.getLogger(__name__)

# the names this module has always had (now defined where they live)
_LeaseState = LeaseState
_Transfer = Transfer
_TrackedClient = TrackedClient


class DKVConnector:
    """KVConnector over dKV (see module docstring for threading, sources and leases).

    A facade: the scheduler side (:class:`~connector.scheduler_side.SchedulerSide`)
    decides, the worker side (:class:`~connector.worker_side.WorkerSide`) moves
    bytes on the loop thread. Each method's docstring names the thread it runs on.
    """

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
        metrics_registry: CollectorRegistry | None = None,
        lookup_in_place: bool = True,
        start_lookup_in_place: bool | None = None,
        gil_switch_interval: float | None = DEFAULT_SWITCH_INTERVAL,
        lookup_payload_bytes: int = LOOKUP_PAYLOAD_BYTES,
        reply_spin: float = REPLY_SPIN,
        direct_channels: int = DIRECT_CHANNELS,
        direct_reads: bool | None = None,
    ) -> None:
        """Any thread (the engine's, once): connect to the co-located node at ``node`` and, with ``etcd``, follow the cluster.

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

        ``metrics_registry``: a prometheus_client registry to export the
        connector's ``dkv_connector_*`` metrics in (:mod:`connector.metrics`;
        one connector per registry), until :meth:`shutdown`. Without one,
        :meth:`prometheus_registry` makes one on request.

        ``lookup_in_place`` (default on): :meth:`lookup` runs its round trip
        on the calling thread when it can, and a small load into CPU rows
        from a same-host lease or from bytes its lookup brought is copied
        there too (see the module docstring); off, both always go through
        the loop thread.

        ``start_lookup_in_place`` (default: as ``lookup_in_place``):
        :meth:`start_lookup` sends its lookup over the same direct channel
        on the calling thread, and its handle's polls read the answer. The
        call costs the calling thread the send (the node's wake-up: tens of
        µs, ~100-200 µs on a 2-core VM, against ~40 µs to post it to the
        loop), and saves the handle's answer two hand-offs of the GIL to and
        from the loop thread: a scheduler busy in Python between its polls
        gets it ~8 × sooner (*Twenty-fourth round* in the README). Off, its
        lookups go through the loop thread.

        ``gil_switch_interval`` (seconds, default :data:`dkv.gil.DEFAULT_SWITCH_INTERVAL`):
        until :meth:`shutdown`, the interpreter's GIL switch interval is at
        most this, so that the loop thread's steps of a listener load do not
        each wait up to CPython's 5 ms for a scheduler thread busy in Python
        (see :mod:`dkv.gil`); the interval found is put back by the last
        connector's shutdown. None leaves the interpreter's setting alone.

        ``lookup_payload_bytes`` (default :data:`connector.worker_side.LOOKUP_PAYLOAD_BYTES`,
        256 KiB): a lookup on the listener path (a peer's blocks, or
        ``local=False``) asks the node to send the blocks' bytes with its
        answer when they come to at most this many, each checked against its
        checksum as it lands. The lease's load then copies them on the
        calling thread, with no round trip (a small remote load costs one
        round trip, not two). 0 never asks. See :mod:`dkv.wire`, ``send``.

        ``reply_spin`` (seconds, default :data:`dkv.polling.REPLY_SPIN`, 1 ms,
        at most 10 ms): :meth:`lookup` polls for its answer this long, without
        the GIL, before it sleeps on it: the node's reply on the same-host
        path, the loop thread's on the listener path (a sleeping thread's
        wake-up cost ~60 µs of a ~220 µs one-block same-host load here; see
        :mod:`dkv.polling`). The calling thread's core is busy meanwhile. 0
        never polls.

        ``direct_channels`` (default :data:`dkv.client.DIRECT_CHANNELS`, 4):
        direct channels each node client opens at most. One holds a
        ``start_lookup`` handle until its answer is read; a lookup that finds
        every open one held asks for one more (in the background, one a
        second at most) and goes through the loop meanwhile, so a scheduler
        that starts several lookups in a step gets up to this many in place.
        Each is a connection the node counts against its caps.

        ``direct_reads`` (default: where UCX may use no RDMA transport, see
        :func:`dkv.transport.rdma_possible`): a load that reads from a node
        (its blocks came with no lookup and lie in no shared segment) goes
        over a free direct channel instead of UCX, received on a read thread
        straight into CPU rows, each block hashed as it lands, without the
        GIL (*Twenty-fifth round* in the README). Where UCX has RDMA it
        carries the bytes without either CPU's copy: off there by default.
        """
        if lookup_payload_bytes < 0:
            raise ValueError(f"lookup_payload_bytes must not be negative, not {lookup_payload_bytes}")
        if type(direct_channels) is not int or direct_channels < 1:  # noqa: E721 - (bool is no count)
            raise ValueError(f"direct_channels must be an int of at least 1, not {direct_channels!r}")
        self._reply_spin = check_reply_spin(reply_spin)
        self.namespace = check_namespace(namespace)
        if gil_switch_interval is not None:
            check_switch_interval(gil_switch_interval)  # before anything starts
        self._sched = SchedulerSide(leaves, device_blocks, namespace=self.namespace, node_address=node,
                                    timeout=timeout)
        self.node_address = node
        self.timeout = timeout
        self._registry: CollectorRegistry | None = None
        self._collector = ConnectorCollector(self._sched)
        if metrics_registry is not None:
            self._export_to(metrics_registry)  # before anything starts: a clash raises with nothing to undo
        if etcd_settings is not None:
            etcd_settings = (replace(etcd_settings, endpoints=etcd) if etcd else etcd_settings).validate()
        etcd_target: str | EtcdSettings | None = etcd_settings or etcd
        layout = Layout(cluster, etcd_prefix) if etcd_target else None
        loop = acquire_shared_loop()
        self._worker = WorkerSide(self._sched, loop, namespace=self.namespace, node_address=node, token=token,
                                  tenant=tenant, timeout=timeout, local=local, checksums=checksums,
                                  etcd=etcd_target, layout=layout, peer_idle_timeout=peer_idle_timeout,
                                  lookup_in_place=lookup_in_place, lookup_payload_bytes=lookup_payload_bytes,
                                  reply_spin=reply_spin, direct_channels=direct_channels,
                                  direct_reads=not rdma_possible() if direct_reads is None else direct_reads,
                                  start_lookup_in_place=(lookup_in_place if start_lookup_in_place is None
                                                         else start_lookup_in_place))
        hold_switch_interval(gil_switch_interval)  # (checked above: it does not raise)
        try:
            self.node_id = loop.run(self._worker.start(node_id), timeout + 10)
            max_leaves = self._worker.max_leaves()  # as its handshake said
            if len(self._sched.leaves) > max_leaves:  # every lookup names all leaves, in one request (one lease)
                raise ValueError(f"{len(self._sched.leaves)} leaves exceed the node's max_leaves ({max_leaves}): "
                                 f"{self.node_address} cannot look them up in one request")
        except BaseException:
            loop.run(self._worker.close(), timeout + 5)
            release_switch_interval()
            release_shared_loop()
            self._unexport()
            raise

    # ---- metrics ------------------------------------------------------------------------------

    def prometheus_registry(self) -> CollectorRegistry:
        """Any thread: the registry this connector's metrics are in (``metrics_registry``, else a new one, made once)."""
        if self._registry is None:
            self._export_to(CollectorRegistry(auto_describe=False))
        assert self._registry is not None
        return self._registry

    def _export_to(self, registry: CollectorRegistry) -> None:
        registry.register(self._collector)  # ValueError if the registry holds another connector's families
        self._registry = registry

    def _unexport(self) -> None:
        registry, self._registry = self._registry, None
        if registry is not None:
            with contextlib.suppress(KeyError):
                registry.unregister(self._collector)

    # ---- identity -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """Any thread."""
        return "dkv"

    @property
    def leaves(self) -> Mapping[str, Hashable]:
        """Any thread: leaf id -> the engine's group id."""
        return self._sched.leaf_groups()

    def defers_lookup(self, replica_idx: int = 0) -> bool:
        """Any thread: True, :meth:`start_lookup` returns before it answers (the answer is a round trip)."""
        return True

    @property
    def counters(self) -> ConnectorCounters:
        """Any thread: dKV's own counters (written by both threads)."""
        return self._sched.counters

    @property
    def node_id(self) -> str | None:
        """Any thread: the co-located node's id in the cluster."""
        return self._sched.node_id

    @node_id.setter
    def node_id(self, value: str | None) -> None:
        """Any thread (construction, once the co-located node has said)."""
        self._sched.node_id = value

    # ---- lookups ------------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: bytes | None = None) -> Masks:
        """Scheduler thread: presence per leaf (True only when every TP shard holds the block), leased for the next ``load``.

        Blocks the calling thread for one round trip, bounded by ``timeout``
        (plus a second for the hop to the loop thread), however it gets there;
        a node that does not answer in time is a miss. Raises ``ValueError`` for a
        hash that is not 8 or 32 bytes. The round trip runs on this thread
        when it can (a direct channel, no hop to the loop thread: see the
        module docstring), with the same answer, lease and bounds. Either way
        the answer is polled for, without the GIL, for up to ``reply_spin``
        before this thread sleeps on it (:mod:`dkv.polling`).
        """
        sched, worker = self._sched, self._worker
        hashes = check_hashes(block_hashes)
        sched.check_replica(replica_idx)
        address, peer = sched.source(hashes, hint)
        previous = sched.last_lookup.pop(replica_idx, None)  # None after a load: its read ends that lease
        slot = None
        if previous is not None and previous.address != address:
            worker.release(previous)
        elif previous is not None:
            slot = previous.slot  # this lookup ends the previous one's lease on the node: its slot passes on
        group = sched.replica_group(replica_idx, ends_previous=slot is not None)
        if sched.backing_off(address):
            sched.budget.give_back(address, slot)
            sched.count(lookups_skipped=1)
            return sched.empty_masks(len(hashes))
        state: LeaseState | None
        started = time.monotonic()
        try:
            answer = worker.lookup_in_place(address, hashes, group, peer, hint, slot)  # no hop, when it can
            if answer is InPlace.NOT_TAKEN:
                # one bound for the whole call: a direct channel that failed late leaves the loop the rest
                left = self.timeout + 1 - (time.monotonic() - started)
                if left <= 0:
                    sched.budget.give_back(address, slot)
                    raise OpTimeout(f"lookup of {address}: no answer within {self.timeout:.1f}s")
                answer = worker.loop.run(worker.lookup_on(address, hashes, group, peer, hint, slot), left,
                                         spin=self._reply_spin)
            state = answer
        except Exception as exc:  # noqa: BLE001 - a dead or slow node costs a miss
            worker.unanswered(address, exc)
            state = None
        sched.count_lookup(state)
        if state is None:
            return sched.empty_masks(len(hashes))
        sched.last_lookup[replica_idx] = state
        return {leaf: list(mask) for leaf, mask in state.masks.items()}

    def start_lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0,
                     hint: bytes | None = None) -> DKVLookup:
        """Scheduler thread: start a lookup and return at once; the handle holds its own lease once it answers."""
        sched, worker = self._sched, self._worker
        hashes = check_hashes(block_hashes)
        sched.check_replica(replica_idx)
        address, peer = sched.source(hashes, hint)
        group = sched.next_handle_group()
        future: concurrent.futures.Future[LeaseState | None]
        poll = None
        if sched.backing_off(address):
            sched.count(lookups_skipped=1)
            future = resolved(None)
        else:
            try:
                in_place = worker.start_lookup_in_place(address, hashes, group, peer, hint)  # no hop, when it can
            except Exception as exc:  # noqa: BLE001 - a node too slow to take the request costs a miss
                worker.unanswered(address, exc)
                in_place = None
            if isinstance(in_place, InPlaceLookup):
                future, poll = in_place.future, in_place.poll
            elif in_place is None:
                sched.count_lookup(None)
                future = resolved(None)
            else:
                try:
                    future = worker.submit(worker.lookup_handle(address, hashes, group, peer, hint))
                except RuntimeError:
                    future = resolved(None)
        handle = DKVLookup(hashes, replica_idx, hint, group, future, poll)
        handle._leaves = sched.leaf_names
        return handle

    def abandon_lookup(self, lookup: DKVLookup) -> None:
        """Scheduler thread: hand back a handle that will not be loaded from. Never raises, on any handle state."""
        try:
            if not isinstance(lookup, DKVLookup) or lookup.consumed:
                return
            lookup.consumed = True
            lookup._future.add_done_callback(self._worker.release_future)
        except Exception:
            log.debug("abandon_lookup ignored an error", exc_info=True)

    # ---- loads --------------------------------------------------------------------------------

    def load(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
             replica_idx: int = 0, hint: bytes | None = None) -> Any:
        """Scheduler thread: load exactly these blocks, all or nothing, out of the replica's last ``lookup()``.

        Validates, plans and posts the read to the loop thread; never waits on it.
        A small same-host load is copied here instead (see the module
        docstring) and returns a :class:`CompletedTransfer`; a larger one is
        posted to the copy threads, not the loop.
        Raises only :class:`KVLoadRefused` (before anything moved: a block the
        lookup did not report, an expired lease, a different hint; bad input is
        its subclass :class:`KVLoadInvalid`, also a ``ValueError``) and
        :class:`KVLoadFailed` (posting failed); a later failure is raised by the
        returned transfer's ``is_complete()``.
        """
        state = self._sched.last_lookup.pop(replica_idx, None)
        return self._load(state, block_ids, block_hashes, replica_idx, hint)

    def load_lookup(self, lookup: DKVLookup, block_ids: Mapping[str, Sequence[int]],
                    block_hashes: Mapping[str, Sequence[bytes]], replica_idx: int = 0,
                    hint: bytes | None = None) -> Any:
        """Scheduler thread: load out of what ``lookup`` found; consumes the handle however this exits."""
        if not isinstance(lookup, DKVLookup) or lookup.consumed:
            raise KVLoadRefused("lookup handle was already consumed or is not a dKV handle")
        lookup.consumed = True
        state = lookup.state()
        if not lookup.is_complete():
            lookup._future.add_done_callback(self._worker.release_future)  # released once it answers
            raise KVLoadRefused("lookup has not completed")
        if state is not None and (lookup.replica_idx != replica_idx or lookup.hint != hint):
            self._worker.release(state)
            raise KVLoadRefused("load_lookup must use the lookup's replica and hint")
        return self._load(state, block_ids, block_hashes, replica_idx, hint)

    def _load(self, state: LeaseState | None, block_ids: Mapping[str, Sequence[int]],
              block_hashes: Mapping[str, Sequence[bytes]], replica_idx: int, hint: bytes | None) -> Any:
        """Scheduler thread: validate and plan (scheduler side), then post (worker side)."""
        worker = self._worker
        try:
            plan = self._sched.plan_load(state, block_ids, block_hashes, replica_idx, hint, worker.leases_lost)
        except KVLoadRefused:
            if state is not None:
                worker.release(state)  # a refused load must not leave the lookup's lease pinned
            raise
        if plan is None:
            if state is not None:
                worker.release(state)
            return CompletedTransfer()
        assert state is not None
        done = worker.load_in_place(state, plan)  # a small same-host load: copied here, no hop
        return done if done is not None else worker.post_load(state, plan)

    # ---- offloads -----------------------------------------------------------------------------

    def offload(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                replica_idx: int = 0) -> Any:
        """Scheduler thread: copy device blocks to the co-located node; published there once their bytes are in.

        Validates, plans and posts the write to the loop thread (on CUDA the
        device-to-host copy is queued here, behind the compute stream). The
        returned transfer's ``g0_blocks_per_leaf`` are the device blocks to
        keep pinned until it completes. A failed offload completes without
        raising (the blocks are simply not stored) and is counted. While the
        co-located node is backing off (it failed to answer a lookup, load or
        offload: the same backoff as lookups), an offload is dropped here,
        without asking: a :class:`CompletedTransfer` pinning nothing, counted
        (``counters.offloads_dropped``, metrics ``connector_offload_blocks_dropped``).
        """
        sched = self._sched
        plan = sched.plan_offload(block_ids, block_hashes, replica_idx)
        if not plan.runs or self._worker.closed:
            return CompletedTransfer()  # moves nothing: pinned nowhere
        if sched.backing_off(self.node_address):
            sched.drop_offload(plan)
            return CompletedTransfer()
        transfer = self._worker.post_offload(plan)
        return CompletedTransfer() if transfer is None else transfer

    # ---- recency, pricing, housekeeping -------------------------------------------------------

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        """Scheduler thread: refresh recency of device-served blocks (the whole chain from its root). Never raises.

        Fire-and-forget, at most ``MAX_BACKGROUND`` in flight: one more is
        dropped and counted (``counters.touches_dropped``); a missed touch costs
        a later refetch at most.
        """
        try:
            hashes = check_hashes(block_hashes)
            if not hashes or self._worker.closed:
                return
            if self._worker.touch(hashes):
                self._sched.count(touches=1)
            else:
                self._sched.count(touches_dropped=1)
        except Exception:
            log.debug("touch ignored an error", exc_info=True)

    def probe(self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int],
              hint: bytes | None = None) -> Sequence[Mapping[str, Sequence[bool]]] | None:
        """Scheduler thread: what each replica could load, from the directory index, without leases.

        The external tier is replica-agnostic, so every replica gets the same
        answer (one shared mapping). The directory knows a node's deepest
        block of a chain, not which leaf holds what, so the answer covers the
        full-attention leaves only (each of those holds every block of the
        prefix it covers; a windowed leaf holds only its window's worth, and
        the protocol lets an answer leave out leaves that one representative
        leaf stands for). ``None`` when there is no directory to answer from
        (no etcd configured) or no full-attention leaf to answer for.
        """
        return self._sched.probe(block_hashes, replica_idxs, hint)

    def poll_transfers(self) -> None:
        """Scheduler thread: drop settled transfers from the books. Cheap, non-blocking, never raises."""
        try:
            self._worker.poll_transfers()
        except Exception:  # noqa: BLE001
            pass

    @property
    def metrics(self) -> Any:
        """Any thread: a snapshot of the per-batch metrics since the last :meth:`take_metrics` (MAX's type under MAX)."""
        return self._sched.metrics_snapshot()

    def take_metrics(self) -> Any:
        """Any thread: read and clear the per-batch transfer counters."""
        return self._sched.take_metrics()

    @property
    def host_byte_count(self) -> Any:
        """Any thread: the co-located node's host tier, as of the last stats refresh (loop thread, every second)."""
        return self._worker.host_bytes

    @property
    def disk_byte_count(self) -> Any:
        """Any thread: the co-located node's disk tier, as of the last stats refresh."""
        return self._worker.disk_bytes

    def reset_prefix_cache(self) -> None:
        """Scheduler thread: drop this namespace's unpinned blocks on the co-located node (fire-and-forget). Never raises.

        One reset runs at a time; one asked while another waits to start is
        that one (``counters.resets_coalesced``).
        """
        try:
            if not self._worker.closed:
                self._worker.reset()
        except Exception:  # noqa: BLE001 - the loop is stopped
            pass

    def shutdown(self) -> None:
        """Scheduler thread (or any, once): drain transfers (bounded), release leases, close connections, stop the loop. Never raises."""
        worker = self._worker
        if worker.closed:
            return
        try:
            deadline = time.monotonic() + self.timeout * 2
            for transfer in list(worker.transfers):
                try:
                    transfer._future.result(max(0.0, deadline - time.monotonic()))
                except BaseException:  # noqa: BLE001
                    pass
            for state in list(self._sched.last_lookup.values()):
                worker.release(state)
            self._sched.last_lookup.clear()
            worker.closed = True
            worker.loop.run(worker.close(), self.timeout + 5)
        except Exception:
            log.warning("connector shutdown was not clean", exc_info=True)
        finally:
            worker.closed = True
            release_switch_interval()
            release_shared_loop()
            self._unexport()  # a registry the engine keeps shows no stopped connector

    # ---- the two sides' state, by the names tests and tools have used ----------------------------

    @property
    def _leaves(self) -> dict[str, LeafSpec]:
        return self._sched.leaves

    @property
    def _blocks(self) -> list[dict[str, Sequence[torch.Tensor]]]:
        return self._sched.blocks

    @property
    def _router(self) -> Any:
        return self._worker.router

    @property
    def _loop(self) -> Any:
        return self._worker.loop

    @property
    def _clients(self) -> dict[str, TrackedClient]:
        return self._worker.clients

    @property
    def _tasks(self) -> set[concurrent.futures.Future[Any]]:
        return self._worker.tasks

    @property
    def _background(self) -> int:
        return self._worker.background

    @property
    def _unreachable(self) -> dict[str, tuple[str | None, float]]:
        return self._sched.unreachable

    @property
    def _closed(self) -> bool:
        return self._worker.closed

    @property
    def _client(self) -> Callable[[str], TrackedClient]:
        """The one place a node's client is made or found (loop thread); replaceable, for tests."""
        return self._worker.client

    @_client.setter
    def _client(self, fn: Callable[[str], TrackedClient]) -> None:
        self._worker.client = fn  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"DKVConnector(node={self.node_address!r}, namespace={self.namespace!r}, leaves={list(self._leaves)})"


__all__ = [
    "DEFAULT_MAX_LEASES",
    "HANDLE_GROUPS",
    "LEASE_MARGIN",
    "MAX_BACKGROUND",
    "MAX_QUEUED_RELEASES",
    "PEER_IDLE_TIMEOUT",
    "STATS_INTERVAL",
    "UNREACHABLE_BACKOFF",
    "ConnectorCounters",
    "DKVConnector",
    "DKVError",
    "DKVLookup",
    "LeaseState",
    "Masks",
    "SchedulerSide",
    "TrackedClient",
    "Transfer",
    "WorkerSide",
]
