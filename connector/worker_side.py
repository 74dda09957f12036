"""The connector's worker side: everything that runs on the shared UCX loop thread.

:class:`WorkerSide` owns the node clients (one per address, made, used and
closed on the loop thread, idle peers' reaped), the leased lookups on the
wire, the reads and writes and the copy engine they use, the lease releases
(one releaser per node), touches, resets, the stats refresh, and the
directory (router, etcd client). Every coroutine it starts is owned and
cancelled at shutdown.

The scheduler thread reaches it only through the methods marked "scheduler
thread" or "any thread", which validate nothing (the scheduler side did) and
only hand work to the loop: :meth:`WorkerSide.submit` (a coroutine, with a
future) and :meth:`WorkerSide.call_soon` (a plain callback). The exceptions
are the lookups and loads without the loop
(:meth:`WorkerSide.lookup_in_place`, :meth:`WorkerSide.start_lookup_in_place`
and :meth:`WorkerSide.load_in_place`,
which posts large same-host copies to :mod:`dkv.copy_threads`, where they
complete). Bookkeeping goes back to the scheduler side
(:class:`~connector.scheduler_side.SchedulerSide`), whose methods called
from here are marked "loop thread" or "any thread".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any

from connector.copy_engine import Completion, CopyEngine
from connector.scheduler_side import LEASE_MARGIN, LeaseState, SchedulerSide
from connector.transfer_plan import TransferPlan
from connector.types import ByteCount, CompletedTransfer, KVLoadFailed
from connector.lease_budget import Slot
from dkv.client import DIRECT_CHANNELS, LookupResult, NodeClient, PendingLookup
from dkv import held_gil
from dkv import copy_threads
from dkv.copy_threads import ChunkedCopy, PostedCopy
from dkv.lease_slots import LeaseSlots, RowRun
from dkv.light_future import LightFuture
from dkv.direct_channel import ChannelBusy, ChannelClosed
from dkv.errors import ChecksumMismatch, OpTimeout, TransportError
from dkv.etcd import EtcdSettings, Layout, make_client
from dkv.loop_thread import LoopThread
from dkv.polling import REPLY_SPIN
from dkv.router import Router
from dkv.store import FULL

log = logging.getLogger("connector.dkv_connector")

STATS_INTERVAL = 1.0
PEER_IDLE_TIMEOUT = 60.0  # seconds a peer's client may sit unused before it is closed (never the co-located one)
MAX_BACKGROUND = 64  # fire-and-forget touches in flight at once; more are dropped and counted
# transfers kept on the books before settled ones are dropped without waiting for poll_transfers():
# an engine that never polls cannot grow them (and their futures and tasks) without bound
MAX_BOOKED = 1024
MAX_QUEUED_RELEASES = 1024  # lease releases waiting per node (a node ends a client's oldest lease past 64 anyway)
# a same-host load of at most this many bytes into CPU rows is copied on the scheduler thread (load_in_place):
# a checked copy of this size (~30 µs) costs less than the two thread hops of posting it; a larger one is
# posted straight to the copy threads
IN_PLACE_LOAD_BYTES = 256 * 1024
# a listener lookup asks its node to send the blocks' bytes with the answer when they come to at most this
# many (see dkv.wire, ``send``): their load then copies them on the calling thread, with no round trip
LOOKUP_PAYLOAD_BYTES = IN_PLACE_LOAD_BYTES
# how often the loop thread polls the start_lookup handles answered in place that their scheduler has not
# settled (see InPlaceLookup): one it abandoned, or one it does not poll, still settles, and its lease ends
IN_PLACE_WATCH_PERIOD = 0.05
IN_PLACE_WATCH_LINGER = 20  # periods the poller waits with nothing to poll before it ends (restarting it wakes the loop)


class Transfer:
    """A posted copy: a future on the loop thread, then maybe a device completion. Any thread; never blocks."""

    __slots__ = ("_future", "_poll", "_is_load", "_g0", "_error", "_completion", "_landed")  # one made per load()

    def __init__(self, future: concurrent.futures.Future[Completion | None], *, is_load: bool,
                 g0_blocks_per_leaf: Mapping[str, Sequence[int]] | None = None,
                 poll: Callable[[], object] | None = None) -> None:
        """Scheduler thread (posting a load or offload makes it).

        ``poll()``, when given, may resolve ``future`` on the polling thread
        (a load on the native copy threads: :class:`dkv.copy_threads.PostedCopy`),
        so that :meth:`is_complete` learns of it without waiting for another
        thread to get the GIL.
        """
        self._future = future
        self._poll = poll
        self._is_load = is_load
        self._g0 = dict(g0_blocks_per_leaf or {})
        self._error: BaseException | None = None
        self._completion: Completion | None = None
        self._landed = False

    @property
    def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
        """Any thread: the device blocks an offload keeps pinned until it completes (empty for a load)."""
        return self._g0

    def is_complete(self) -> bool:
        """Any thread (the scheduler's polls); never blocks. A failed load raises :class:`KVLoadFailed`, on every poll."""
        if self._landed:
            return True
        if self._error is not None:
            raise KVLoadFailed(str(self._error)) from self._error
        if not self._future.done():
            if self._poll is None:
                return False
            self._poll()  # it may settle the copy here, and with it the future
            if not self._future.done():
                return False
        try:
            self._completion = self._completion or self._future.result()
        except BaseException as exc:
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
        except Exception as exc:
            if not self._is_load:
                self._landed = True
                return True
            self._error = exc
            raise KVLoadFailed(f"the device copy failed: {exc}") from exc
        self._landed = True
        return True

    def synchronize(self) -> None:
        """Any thread but the loop thread: block until the transfer settles (drain and shutdown only). Never raises."""
        try:
            completion = self._future.result()
            if completion is not None:
                completion.wait()
        except BaseException:  # noqa: BLE001
            pass


class InPlace(enum.Enum):
    """What :meth:`WorkerSide.lookup_in_place` answers when it did not look up: ask on the loop thread instead."""

    NOT_TAKEN = "not taken"


class InPlaceLookup:
    """A ``start_lookup`` handle's leased lookup, sent over the node's direct channel and read by whoever polls first.

    Made by :meth:`WorkerSide.start_lookup_in_place` on the scheduler
    thread, which sent the request itself: no hop to the loop thread. The
    answer is read by :meth:`poll` (any thread, never blocks): the engine's
    scheduler polls the handle between its steps anyway, so it reads the
    answer as soon as it is there, instead of waiting (a switch interval, on
    a busy scheduler) for the loop thread to take the GIL from it and read
    it. The loop thread polls every handle not yet settled every
    ``IN_PLACE_WATCH_PERIOD`` s, so that one nobody polls (abandoned, or
    waited on some other way) settles too.

    :attr:`future` resolves once, as :meth:`WorkerSide.lookup_handle`'s
    does: the :class:`LeaseState`, or ``None`` for a miss (a node that did
    not answer within the client's timeout, or answered with an error: counted
    and backed off, as on the loop). A connection that failed mid-way asks
    again on the loop thread (a leased lookup is idempotent), whose answer
    then resolves it.
    """

    def __init__(self, worker: WorkerSide, client: NodeClient, address: str, hashes: list[bytes], fits: int,
                 peer: bool, hint: bytes | None, group: int, slot: Slot, pending: PendingLookup) -> None:
        self.future: concurrent.futures.Future[LeaseState | None] = LightFuture()
        self._worker = worker
        self._client = client
        self._address = address
        self._hashes = hashes
        self._fits = fits
        self._peer = peer
        self._hint = hint
        self._group = group
        self._slot = slot
        self._pending = pending
        self._settling = threading.Lock()
        self._on_the_loop = False  # asked again on the loop thread, whose answer resolves the future

    def poll(self) -> bool:
        """Any thread, never blocks: read what has arrived; True once :attr:`future` is resolved."""
        if self.future.done() or self._on_the_loop:
            return self.future.done()
        if not self._settling.acquire(blocking=False):
            return False  # another thread is reading it now
        try:
            if not self.future.done() and not self._on_the_loop:
                self._advance()
        finally:
            self._settling.release()
        return self.future.done()

    def abort(self) -> None:
        """Loop thread, at shutdown: settle now (a miss unless its answer was read); the channel closes."""
        self._pending.abort()
        self.poll()

    def _advance(self) -> None:
        worker, sched, address = self._worker, self._worker.sched, self._address
        try:
            result = self._pending.poll()
        except OpTimeout as exc:  # the node is hung
            self._missed(exc)
            return
        except TransportError as exc:  # the connection failed, or was closed, mid-exchange
            log.debug("the direct channel to %s failed mid-lookup (%s): asking on the loop", address, exc)
            self._ask_on_the_loop()
            return
        except Exception as exc:  # noqa: BLE001 - an error reply or a bad one: a miss, as on the loop
            self._missed(exc)
            return
        if result is None:
            return
        self._client.last_used = time.monotonic()
        sched.count(lookups_in_place=1)
        if result.rejected:  # sent with the answer, failed their checksums: reported absent by the client
            sched.count(checksum_failures=1)
        limits = self._client.info.limits if self._client.info else {}
        state = sched.granted(address, self._slot, self._hashes, self._hint, self._peer,
                              worker._padded(result, self._fits, len(self._hashes)).masks,  # noqa: SLF001
                              result.lease_id, float(limits.get("lease_ttl", 10.0)), self._client.lease_generation,
                              received=result.received)
        self._resolve(state)

    def _missed(self, exc: BaseException) -> None:
        self._worker.sched.budget.give_back(self._address, self._slot)
        self._worker.unanswered(self._address, exc)
        self._resolve(None)

    def _ask_on_the_loop(self) -> None:
        """The request may not have been answered on this channel: the loop thread asks again, and resolves this."""
        worker = self._worker
        worker.sched.budget.give_back(self._address, self._slot)
        if worker.closed:
            self._resolve(None)
            return
        try:
            asked = worker.submit(worker.lookup_handle(self._address, self._hashes, self._group, self._peer,
                                                       self._hint))
        except RuntimeError:  # the connector is shut down
            self._resolve(None)
            return
        self._on_the_loop = True
        worker.forget_in_place(self)
        asked.add_done_callback(self._take_the_loops_answer)

    def _take_the_loops_answer(self, asked: concurrent.futures.Future[LeaseState | None]) -> None:
        state = None if asked.cancelled() or asked.exception() is not None else asked.result()
        if self.future.set_running_or_notify_cancel():
            self.future.set_result(state)  # (lookup_handle counted it)
        elif state is not None:
            self._worker.release(state)

    def _resolve(self, state: LeaseState | None) -> None:
        self._worker.sched.count_lookup(state)
        self._worker.forget_in_place(self)
        if self.future.set_running_or_notify_cancel():
            self.future.set_result(state)
        elif state is not None:
            self._worker.release(state)


class TrackedClient(NodeClient):
    """A node client and its use as the worker side sees it (loop thread): calls in flight, and when it was last used.

    Only the worker side's own calls are tracked (:meth:`WorkerSide.using`),
    so the client is used through its public methods alone.
    """

    in_flight = 0
    last_used = 0.0


class WorkerSide:
    """Clients, transfers, releases and background work on the loop thread (see module docstring)."""

    def __init__(self, sched: SchedulerSide, loop: LoopThread, *, namespace: str, node_address: str,
                 token: bytes | None, tenant: str | None, timeout: float, local: bool | None, checksums: bool,
                 etcd: str | EtcdSettings | None, layout: Layout | None, peer_idle_timeout: float,
                 lookup_in_place: bool = True, lookup_payload_bytes: int = LOOKUP_PAYLOAD_BYTES,
                 reply_spin: float = REPLY_SPIN, start_lookup_in_place: bool = True,
                 direct_channels: int = DIRECT_CHANNELS, direct_reads: bool = False) -> None:
        """Any thread (construction); nothing is started until :meth:`start` runs on the loop."""
        self.sched = sched
        self.loop = loop
        self.namespace = namespace
        self.node_address = node_address
        self.timeout = timeout
        self._token = token  # the cluster token, or with ``tenant`` that tenant's secret
        self._tenant = tenant
        self._local_path = local
        self._checksums = checksums
        self._etcd = etcd
        self._layout = layout
        self._peer_idle = peer_idle_timeout
        self._in_place = lookup_in_place  # lookup() may use a node's direct channel (same-host or TCP)
        self._start_in_place = start_lookup_in_place  # start_lookup() may too (see start_lookup_in_place)
        self._lookup_payload = lookup_payload_bytes  # listener lookups ask for their blocks' bytes up to this
        self._reply_spin = reply_spin  # a direct channel's replies are polled for this long before a sleep
        self._direct_channels = direct_channels  # each node client's direct channels at most
        self._direct_reads = direct_reads  # listener loads may read over a free direct channel (see _read_on_channel)
        self.host_bytes = ByteCount(free=0, total=0)
        self.disk_bytes = ByteCount(free=0, total=0)
        devices = {t.device for replica in sched.blocks for shards in replica.values() for t in shards}
        self.copy = {d: CopyEngine(d) for d in devices}
        self.clients: dict[str, TrackedClient] = {}  # loop thread: made, used and closed there
        self.closing: set[NodeClient] = set()  # idle clients being closed
        self.router: Router | None = None
        self.etcd_client: Any = None
        self.closed = False
        self.transfers: collections.deque[Transfer] = collections.deque()  # scheduler thread: posted, oldest first
        self.tasks: set[concurrent.futures.Future[Any]] = set()
        self._tasks_lock = threading.Lock()  # tasks and background, changed from any thread
        self.background = 0  # fire-and-forget touches in flight
        # loop thread only: per-node lease releases waiting (an ordered set) and the task sending them
        self._releases: dict[str, dict[int, None]] = {}
        self._releasers: dict[str, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self._reset_wanted = False  # loop thread: a reset asked for and not started yet
        self._resetter: asyncio.Task[None] | None = None
        # work posted to the loop from any thread, drained there in order (see _post)
        self._inbox: collections.deque[Callable[[], Any]] = collections.deque()
        self._wake_pending = False
        self._wake_lock = threading.Lock()  # the pipe's write end is not closed under a writer
        self._wake_fd = -1  # write end of the wake pipe, once the loop reads it (start)
        self._wake_read_fd = -1
        # loads posted (scheduler thread) and begun on the loop thread (their slot maps taken): a lookup
        # runs in place only while the two are equal (see lookup_in_place)
        self._loads_posted = 0
        self._loads_begun = 0
        self._channel_reads_unanswered = 0  # reads sent over a direct channel whose answer is not in (under _tasks_lock)
        self._channel_jobs: set[concurrent.futures.Future[Any]] = set()  # their copy-thread runs, waited for by close
        self._copies: set[ChunkedCopy | PostedCopy] = set()  # loads on the copy threads (load_in_place): waited for at close
        # start_lookup handles answered in place and not settled yet (under _tasks_lock), and the loop's poller of them
        self._in_place_lookups: set[InPlaceLookup] = set()
        self._in_place_watcher: asyncio.Task[None] | bool | None = None  # True: asked for, not started yet

    # ---- start, clients --------------------------------------------------------------------------

    async def start(self, node_id: str | None) -> str:
        """Loop thread: connect to the co-located node and, with etcd, follow the cluster; returns the node id."""
        self._open_wake_pipe()
        local = self.client(self.node_address)
        with self.using(local):
            info = await local.connect()
        await self._refresh_stats(local)  # byte counts are the node's from construction, not 0 of 0
        if self._etcd:
            self.etcd_client = make_client(self._etcd)
            await self.etcd_client.connect()
            assert self._layout is not None
            self.router = Router(self.etcd_client, self._layout)
            await self.router.start()
            self.sched.router = self.router
        self._stats_task = asyncio.create_task(self._refresh_stats_forever(), name="dkv-connector-stats")
        return node_id or info.node_id

    def client(self, address: str) -> TrackedClient:
        """Loop thread: the client of the node at ``address``, made on first use.

        Clients are made, used and closed on the loop thread; another thread
        gets an existing client (to read what its handshake said), never a new
        one. A peer's client unused for a while is closed by
        :meth:`_close_idle_clients_forever`; the co-located node's never is.
        """
        client = self.clients.get(address)
        if client is None:
            if not self.loop.in_loop():
                raise RuntimeError(f"no client of {address}: clients are made on the loop thread")
            client = TrackedClient(address, self.namespace, token=self._token, tenant=self._tenant,
                                   timeout=self.timeout, local=self._local_path, checksums=self._checksums,
                                   reply_spin=self._reply_spin, direct_channels=self._direct_channels)
            self.clients[address] = client
            if address != self.node_address and self._sweeper is None and not self.closed:
                self._sweeper = asyncio.get_running_loop().create_task(
                    self._close_idle_clients_forever(), name="dkv-connector-idle-clients")
        client.last_used = time.monotonic()
        return client

    @staticmethod
    @contextlib.contextmanager
    def using(client: TrackedClient) -> Iterator[TrackedClient]:
        """Loop thread: count a call on ``client`` as in flight while it runs (an idle client is one with none)."""
        client.in_flight += 1
        try:
            yield client
        finally:
            client.in_flight -= 1
            client.last_used = time.monotonic()

    def leases_lost(self, address: str, generation: int) -> bool:
        """Any thread: whether the node at ``address`` has ended the leases its client was granted at ``generation``.

        True when there is no client of it any more (closed as idle).
        """
        client = self.clients.get(address)
        return client is None or client.leases_lost_since(generation)

    def max_leaves(self) -> int:
        """Any thread, after :meth:`start`: how many leaves one request to the co-located node may name."""
        return self.clients[self.node_address].limit("max_leaves")

    def _idle(self, client: TrackedClient, now: float) -> bool:
        """Unused for ``peer_idle_timeout``, and long enough that no lease it took can still be loaded from."""
        ttl = float((client.info.limits if client.info else {}).get("lease_ttl", 10.0))
        return client.in_flight == 0 and now - client.last_used >= max(self._peer_idle, ttl + LEASE_MARGIN)

    async def _close_idle_clients_forever(self) -> None:
        """Loop thread: close the peers' clients that went idle (see :meth:`_idle`); ends at shutdown."""
        period = max(0.05, min(self._peer_idle / 2, 5.0))
        while not self.closed:
            await asyncio.sleep(period)
            now = time.monotonic()
            for address, client in list(self.clients.items()):
                if address == self.node_address or not self._idle(client, now):
                    continue
                del self.clients[address]  # the next use makes a new one
                self.closing.add(client)
                self.sched.count(peer_clients_closed=1)
                try:
                    async with asyncio.timeout(self.timeout):
                        await client.close()
                except Exception as exc:  # noqa: BLE001 - its connections are dropped either way
                    log.debug("closing the idle client of %s: %s", address, exc)
                finally:
                    self.closing.discard(client)
                log.debug("closed the client of %s, unused for %.0f s", address, now - client.last_used)

    async def _refresh_stats(self, client: TrackedClient) -> None:
        """Loop thread: take the co-located node's tier occupancy; on failure the numbers just go stale."""
        try:
            with self.using(client):
                stats = await client.stats()
            self.host_bytes = ByteCount(free=stats["host"]["free"], total=stats["host"]["total"])
            self.disk_bytes = ByteCount(free=stats["disk"]["free"], total=stats["disk"]["total"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - numbers go stale, nothing breaks
            log.debug("node stats unavailable: %s", exc)

    async def _refresh_stats_forever(self) -> None:
        while not self.closed:
            await asyncio.sleep(STATS_INTERVAL)
            await self._refresh_stats(self.client(self.node_address))

    # ---- lookups ----------------------------------------------------------------------------------

    async def lookup_on(self, address: str, hashes: list[bytes], group: int, peer: bool,
                        hint: bytes | None, slot: int | None = None) -> LeaseState | None:
        """Loop thread: one leased lookup within the node's lease budget.

        ``slot`` is a budget slot already held (``lookup()`` passes on its
        replica's previous one, whose lease this lookup ends on the node);
        without one a slot is taken, and with none left the lookup is a miss
        without asking (``None``, counted ``lookups_over_lease_budget``).
        """
        client = self.client(address)
        limits = client.info.limits if client.info else {}
        ttl = float(limits.get("lease_ttl", 10.0))
        if slot is None:
            slot = self.sched.take_lease_slot(address, limits)
            if slot is None:
                return None
        try:
            with self.using(client):
                result = await self._leased_lookup(client, hashes, group)
        except BaseException:
            self.sched.budget.give_back(address, slot)  # whatever the node did, the TTL ends it: do not wait on it
            raise
        return self.sched.granted(address, slot, hashes, hint, peer, result.masks, result.lease_id, ttl,
                                  client.lease_generation, received=result.received)

    def _lookup_fits(self, client: NodeClient, hashes: int) -> int:
        """How many of ``hashes`` one leased request to ``client``'s node may carry (``max_cost``, ``max_keys``)."""
        per_hash = max(1, len(self.sched.leaf_names) * self.sched.tp_shards)
        return max(1, min(client.limit("max_cost") // per_hash, client.limit("max_keys"), hashes))

    def _padded(self, result: LookupResult, asked: int, hashes: int) -> LookupResult:
        """A lookup of the first ``asked`` of ``hashes`` hashes, the rest reported absent (counted when any is)."""
        if asked == hashes:
            return result
        self.sched.count(lookups_truncated=1)
        absent = [False] * (hashes - asked)
        return dataclasses.replace(result, masks={leaf: mask + absent for leaf, mask in result.masks.items()})

    async def _leased_lookup(self, client: NodeClient, hashes: list[bytes], group: int) -> LookupResult:
        """Loop thread: one leased lookup of the longest prefix of ``hashes`` the node takes in one request.

        A lease is one request, bounded by the node's ``max_cost`` (hashes x
        leaves x shards) and ``max_keys``: a longer prefix is asked only as far
        as those allow, and the rest is reported absent (a shorter hit, never
        a refusal).
        """
        if client.info is None:
            await client.connect()  # the node's limits come with its handshake
        fits = self._lookup_fits(client, len(hashes))
        result = await client.lookup(hashes[:fits], list(self.sched.leaf_names), self.sched.tp_shards,
                                     lease=True, group=group, send=self._lookup_payload)
        if result.rejected:  # sent with the answer, failed their checksums: reported absent by the client
            self.sched.count(checksum_failures=1)
        return self._padded(result, fits, len(hashes))

    def lookup_in_place(self, address: str, hashes: list[bytes], group: int, peer: bool, hint: bytes | None,
                        slot: Slot | None) -> LeaseState | None | InPlace:
        """Scheduler thread: :meth:`lookup_on`, on this thread, over the node's direct channel.

        One blocking exchange (:meth:`dkv.client.NodeClient.lookup_direct`),
        bounded by the client's timeout, with no hop to the loop thread: over
        the node's same-host control socket, or its TCP one on the listener
        path (where, as on the loop, the lookup asks for its blocks' bytes:
        ``lookup_payload_bytes``). It answers :data:`InPlace.NOT_TAKEN` when
        it did not look up, having given back any budget slot it took itself
        (``slot``, one passed on, stays the caller's): no client of the node
        yet, no direct channel open (one is asked for, in the background), a
        load of this connector posted but not yet begun (a lookup here could
        otherwise overtake it and end the lease it is about to read: on the
        loop thread the load goes first), a lookup the channel does not take,
        or a connection that failed mid-exchange (a leased lookup is
        idempotent: the loop thread asks again, with its retries). A timeout
        (a hung node) or an error reply raises, with the slot given back, as
        :meth:`lookup_on` does.
        """
        client = self._direct_client(address) if self._in_place else None
        if client is None:
            return InPlace.NOT_TAKEN
        limits = client.info.limits
        taken = slot is None
        if taken:
            slot = self.sched.take_lease_slot(address, limits)
            if slot is None:
                return None
        fits = self._lookup_fits(client, len(hashes))
        try:
            result = client.lookup_direct(hashes[:fits], self.sched.leaf_names, self.sched.tp_shards, group=group,
                                          send=self._lookup_payload)
        except OpTimeout:
            self.sched.budget.give_back(address, slot)
            raise
        except TransportError as exc:  # not sent (ChannelBusy, ChannelClosed), or the connection failed mid-way
            if isinstance(exc, ChannelBusy):
                self._want_another_channel(client)
            elif not isinstance(exc, ChannelClosed):
                log.debug("the direct channel to %s failed mid-lookup (%s): asking on the loop", address, exc)
            if taken:
                self.sched.budget.give_back(address, slot)
            return InPlace.NOT_TAKEN
        except BaseException:
            self.sched.budget.give_back(address, slot)
            raise
        client.last_used = time.monotonic()
        self.sched.count(lookups_in_place=1)
        if result.rejected:  # sent with the answer, failed their checksums: reported absent by the client
            self.sched.count(checksum_failures=1)
        return self.sched.granted(address, slot, hashes, hint, peer, self._padded(result, fits, len(hashes)).masks,
                                  result.lease_id, float(limits.get("lease_ttl", 10.0)), client.lease_generation,
                                  received=result.received)

    def _direct_client(self, address: str) -> TrackedClient | None:
        """Scheduler thread: the client whose direct channel a lookup in place may use now; ``None`` where none may.

        None: no client of the node yet, no direct
        channel open (one is asked for, in the background), or a load of this
        connector posted but not yet begun (a lookup here could otherwise
        overtake it and end the lease it is about to read: on the loop
        thread the load goes first). The answers that arrived for handles
        not polled yet are read first (:meth:`_settle_arrived`): each frees
        the channel its handle holds.
        """
        if self.closed:
            return None
        client = self.clients.get(address)
        if client is None or client.info is None:
            return None
        if not client.direct_ready:
            if client.direct_possible:
                self.call_soon(client.want_direct)
            return None
        if self._loads_begun != self._loads_posted or self._channel_reads_unanswered:
            return None
        if self._in_place_lookups:  # (read without the lock: at worst one poll too few, or one of a settled handle)
            self._settle_arrived()
        return client

    def _want_another_channel(self, client: TrackedClient) -> None:
        """Scheduler thread: every direct channel to the node was busy: ask for one more, where the client may open one.

        Each open channel holds a handle whose answer is not read yet; with
        one more, the next lookup of a step like this one goes in place too
        (see :data:`dkv.client.DIRECT_CHANNELS`). Counted
        (``counters.lookups_channels_busy``): a count that keeps rising once
        the channels reached their cap says a step starts more lookups than
        ``direct_channels``.
        """
        self.sched.count(lookups_channels_busy=1)
        if client.direct_possible:
            self.call_soon(client.want_direct)

    def _settle_arrived(self) -> None:
        """Any thread: poll every unsettled handle answered in place (a non-blocking read each; see :class:`InPlaceLookup`)."""
        with self._tasks_lock:
            waiting = list(self._in_place_lookups)
        for lookup in waiting:
            lookup.poll()

    def start_lookup_in_place(self, address: str, hashes: list[bytes], group: int, peer: bool,
                              hint: bytes | None) -> InPlaceLookup | InPlace | None:
        """Scheduler thread: a ``start_lookup`` handle's lookup sent over the node's direct channel, its answer read by polling.

        The request goes out on this thread (:meth:`dkv.client.NodeClient.start_lookup_direct`);
        the answer is read by whoever polls the returned :class:`InPlaceLookup`
        first (see there): no hop to the loop thread either way.
        :data:`InPlace.NOT_TAKEN` where it sent nothing (the conditions of
        :meth:`lookup_in_place`, or a channel busy with another exchange):
        ask on the loop (:meth:`lookup_handle`). ``None``: a miss without
        asking (the lease budget is spent, counted). A send that timed out
        (a hung node) raises :class:`~dkv.errors.OpTimeout`, the slot given back.
        """
        client = self._direct_client(address) if self._start_in_place else None
        if client is None:
            return InPlace.NOT_TAKEN
        slot = self.sched.take_lease_slot(address, client.info.limits)
        if slot is None:
            return None
        fits = self._lookup_fits(client, len(hashes))
        try:
            pending = client.start_lookup_direct(hashes[:fits], self.sched.leaf_names, self.sched.tp_shards,
                                                 group=group, send=self._lookup_payload)
        except OpTimeout:
            self.sched.budget.give_back(address, slot)
            raise
        except TransportError as exc:  # not sent (ChannelBusy, ChannelClosed), or the connection failed as it was
            self.sched.budget.give_back(address, slot)
            if isinstance(exc, ChannelBusy):
                self._want_another_channel(client)
            return InPlace.NOT_TAKEN
        except BaseException:
            self.sched.budget.give_back(address, slot)
            raise
        lookup = InPlaceLookup(self, client, address, hashes, fits, peer, hint, group, slot, pending)
        with self._tasks_lock:
            self._in_place_lookups.add(lookup)
            start_watcher = self._in_place_watcher is None
            if start_watcher:
                self._in_place_watcher = True
        if start_watcher:
            self.call_soon(self._start_in_place_watcher)
        return lookup

    def forget_in_place(self, lookup: InPlaceLookup) -> None:
        """Any thread: ``lookup`` settled (or went to the loop): the loop's poller no longer looks at it."""
        with self._tasks_lock:
            self._in_place_lookups.discard(lookup)

    def _start_in_place_watcher(self) -> None:
        """Loop thread: start polling the unsettled handles answered in place (see :class:`InPlaceLookup`)."""
        with self._tasks_lock:
            if self._in_place_watcher is not True:
                return
            if self.closed:
                self._in_place_watcher = None
                return
            self._in_place_watcher = asyncio.get_running_loop().create_task(
                self._watch_in_place_forever(), name="dkv-connector-in-place-lookups")

    async def _watch_in_place_forever(self) -> None:
        """Loop thread: poll the unsettled handles answered in place; ends once none was left for a while (or at shutdown)."""
        idle = 0
        try:
            while not self.closed:
                await asyncio.sleep(IN_PLACE_WATCH_PERIOD)
                waiting = bool(self._in_place_lookups)
                self._settle_arrived()
                with self._tasks_lock:
                    idle = 0 if self._in_place_lookups or waiting else idle + 1
                    if idle >= IN_PLACE_WATCH_LINGER:
                        self._in_place_watcher = None
                        return
        finally:
            with self._tasks_lock:
                if self._in_place_watcher is asyncio.current_task():
                    self._in_place_watcher = None

    async def lookup_handle(self, address: str, hashes: list[bytes], group: int, peer: bool,
                            hint: bytes | None) -> LeaseState | None:
        """Loop thread: a ``start_lookup`` handle's lookup; a failure is a counted miss (``None``), never an error.

        Bounded as :meth:`DKVConnector.lookup` waits (``timeout + 1``): the
        client's own retries of a connect that never completes (a paused
        node) must not add up to several timeouts on a handle.
        """
        try:
            async with asyncio.timeout(self.timeout + 1):
                state = await self.lookup_on(address, hashes, group, peer, hint)
        except Exception as exc:  # noqa: BLE001 - a dead or slow node costs a miss
            self.unanswered(address, exc)
            state = None
        self.sched.count_lookup(state)
        return state

    def unanswered(self, address: str, exc: BaseException) -> None:
        """Any thread: a node did not answer (see :meth:`SchedulerSide.unanswered`)."""
        self.sched.unanswered(address, exc, closed=self.closed)

    # ---- releases ---------------------------------------------------------------------------------

    def release(self, state: LeaseState) -> None:
        """Any thread: end a lease on its node, fire-and-forget (never lost to a limit, see :meth:`_queue_release`).

        A lease whose blocks came with the lookup's answer was ended by the
        node as it sent them: nothing is asked, its slot is free at once and
        the bytes kept for its load are let go of. (Asking would cost a round
        trip on the loop thread per abandoned handle, and hold the slot
        meanwhile: a busy scheduler that abandons many found the budget spent.)
        """
        if state.lease_id is None or self.closed:
            return
        if state.received:
            client = self.clients.get(state.address)
            if client is not None:
                client.claim_slots(state.lease_id)  # (taken and dropped: the kept bytes count no more)
            self.sched.budget.give_back_lease(state.address, state.lease_id)
            return
        self.call_soon(self._queue_release, state.address, state.lease_id)

    def release_future(self, future: concurrent.futures.Future[LeaseState | None]) -> None:
        """Any thread (a done-callback): release the lease a handle's lookup took, if it took one."""
        try:
            if not future.cancelled() and future.exception() is None and future.result() is not None:
                self.release(future.result())
        except Exception:  # noqa: BLE001
            pass

    def _queue_release(self, address: str, lease_id: int) -> None:
        """Loop thread: queue a release for the node's releaser: one task per node, one ordered set of leases.

        A lease queued twice is released once. Past ``MAX_QUEUED_RELEASES`` the
        oldest is let go: a node holds at most its ``--max-leases`` (64 by
        default) of one client and ends the oldest itself past that, so those
        are long gone.
        """
        if self.closed:
            return
        queue = self._releases.setdefault(address, {})
        queue[lease_id] = None
        if len(queue) > MAX_QUEUED_RELEASES:
            del queue[next(iter(queue))]
            self.sched.count(releases_dropped=1)
        if address not in self._releasers:
            self._releasers[address] = asyncio.get_running_loop().create_task(
                self._send_releases(address), name=f"dkv-connector-release-{address}")

    async def _send_releases(self, address: str) -> None:
        """Loop thread: send the releases queued for one node, one after the other, until none is left."""
        queue = self._releases[address]
        try:
            while queue:
                lease_id = next(iter(queue))
                del queue[lease_id]
                client = self.clients.get(address)
                try:
                    if client is not None:  # else closed since: the node ended its leases with its connections
                        with self.using(client):
                            await client.release(lease_id)
                except Exception as exc:  # noqa: BLE001 - the lease ends with its TTL anyway
                    log.debug("lease release failed: %s", exc)
                finally:
                    self.sched.budget.give_back_lease(address, lease_id)  # answered, or it lapses with its TTL
        finally:
            self._releasers.pop(address, None)
            if not queue:
                self._releases.pop(address, None)

    # ---- loads and offloads -----------------------------------------------------------------------

    def post_load(self, state: LeaseState, plan: TransferPlan) -> Transfer:
        """Scheduler thread: post a validated load; :class:`KVLoadFailed` (lease released) if posting failed.

        A load of CPU rows from a node this client has a free direct channel
        to is read over it instead, on a read thread (:meth:`_read_on_channel`).
        """
        transfer = self._read_on_channel(state, plan)
        if transfer is not None:
            return transfer
        try:
            future = self.submit(self._read(state, plan))
        except Exception as exc:
            self.sched.count_load_failure(None)
            self.release(state)
            raise KVLoadFailed(f"could not post the load: {exc}") from exc
        self._loads_posted += 1  # after the submit: _read counts it begun (see lookup_in_place)
        self.sched.count(loads=1)
        transfer = Transfer(future, is_load=True)
        self._book(transfer)
        return transfer

    def load_in_place(self, state: LeaseState, plan: TransferPlan) -> CompletedTransfer | Transfer | None:
        """Scheduler thread: a load copied without the loop thread; ``None`` when it must be posted instead.

        Only a load into rows the copy engine fills in place (CPU tensors)
        whose lease's slot map this client holds: a same-host node's (the
        co-located one, or a peer on the same host), or the bytes a node sent
        with the lookup's answer (:meth:`LeaseSlots.received_with_lookup`, any
        node). It is claimed here, then copied and checked without a round
        trip and without a hop through the loop thread:
        - at most ``IN_PLACE_LOAD_BYTES``: right here
          (:meth:`dkv.client.NodeClient.read_here`: tens of µs), and the load
          is returned completed;
        - larger: on the copy threads (:meth:`dkv.client.NodeClient.start_read_here`):
          this thread only posts it (its keys, views and plan are made
          there), and the returned transfer completes when the thread that
          copies its last chunk has checked it.
        Either way the lease's end is queued for the next request (or a
        flush the loop thread sends shortly; not for received bytes: the node
        ended that lease when it sent them), and the load is booked as
        :meth:`_read` books one. A copy that does not verify (a slot map that
        lapsed, a slot reused) is read the two-step way on the loop thread,
        as :meth:`_read` would do with it.
        """
        if not self._in_place or state.lease_id is None or self.copy[plan.device].staged or self.closed:
            return None
        client = self.clients.get(state.address)
        slots = client.claim_slots(state.lease_id) if client is not None else None
        if slots is None:
            return None
        assert client is not None
        run = self._row_run(plan)
        if plan.nbytes > IN_PLACE_LOAD_BYTES:
            return self._load_on_copy_threads(state, plan, client, slots, run)
        started = time.perf_counter()
        try:
            done = client.read_rows_here(run, slots) if run is not None else None
            if done is None:
                targets, _ = self.copy[plan.device].load_targets(plan.row_groups())
                done = client.read_here(state.lease_id, plan.keys(), targets, slots)
        except Exception:  # noqa: BLE001 - a copy that could not run: the loop reads it the two-step way
            log.debug("an in-place load failed before its copy; posted instead", exc_info=True)
            done = False
        if not done:
            return None
        self._landed_in_place(state, plan, client, started, posted=False, ends=not slots.received)
        return CompletedTransfer()

    def _row_runs(self, plan: TransferPlan) -> list[RowRun] | None:
        """The plan as one run into rows per leaf and shard, in :meth:`TransferPlan.keys`'s order; ``None`` unless every
        shard tensor is CPU rows back to back."""
        engine = self.copy[plan.device]
        runs = []
        for run in plan.runs:
            for shard, tensor in enumerate(run.shards):
                rows = engine.flat_rows(tensor)
                if rows is None:
                    return None
                runs.append(RowRun(run.leaf, shard, run.hashes, run.block_ids, *rows))
        return runs

    def _row_run(self, plan: TransferPlan) -> RowRun | None:
        """The plan as one run into rows of one buffer (see :class:`RowRun`): one leaf, one shard, CPU rows back to back."""
        if len(plan.runs) != 1 or len(plan.runs[0].shards) != 1:
            return None
        run = plan.runs[0]
        rows = self.copy[plan.device].flat_rows(run.shards[0])
        return None if rows is None else RowRun(run.leaf, 0, run.hashes, run.block_ids, *rows)

    def _load_on_copy_threads(self, state: LeaseState, plan: TransferPlan, client: TrackedClient,
                              slots: LeaseSlots, run: RowRun | None) -> Transfer | None:
        """Scheduler thread: :meth:`load_in_place` of a load too large to copy here (see there)."""
        engine = self.copy[plan.device]
        _, finish = engine.load_targets([])  # CPU rows are filled in place: a finisher that only says so
        started = time.perf_counter()

        def prepare() -> tuple[list[Any], list[Any]]:  # a copy thread
            return plan.keys(), engine.load_targets(plan.row_groups())[0]

        try:
            copy = client.start_read_here(plan.block_count, plan.nbytes, prepare, slots, run)
        except RuntimeError:  # no copy thread takes work any more (the interpreter is shutting down)
            copy = None
        if copy is None:
            return None  # posted: the loop reads it the two-step way (its slot map is taken)
        future: concurrent.futures.Future[Completion | None] = LightFuture()
        with self._tasks_lock:
            self.tasks.add(future)
            self._copies.add(copy)
        future.add_done_callback(self._forget)
        held = [copy]  # taken by landed(): a closure holding the copy would make a cycle with the copy's future
        ends = not slots.received

        def landed(done: concurrent.futures.Future[bool]) -> None:  # the copy thread that ended it (or this one)
            nonlocal state, plan
            with self._tasks_lock:
                self._copies.discard(held.pop())
            try:
                error = None if done.cancelled() else done.exception()
                if not done.cancelled() and error is None and done.result():
                    self._landed_in_place(state, plan, client, started, posted=True, ends=ends)
                    if future.set_running_or_notify_cancel():
                        future.set_result(finish())
                    return
                if error is not None:
                    log.debug("a load on the copy threads failed; read the two-step way", exc_info=error)
                self._read_after_all(state, plan, future)
            finally:
                # Let go of the lease and the plan (every block's hash and id) here, as the load ends: the transfer
                # stays on the books until the scheduler thread next books one (_book), and freeing them there
                # cost every load() several µs (measured 6 idle, 15 with loads running).
                state = plan = None  # type: ignore[assignment]

        copy.done.add_done_callback(landed)
        self.sched.count(loads=1)
        transfer = Transfer(future, is_load=True, poll=getattr(copy, "poll", None))
        self._book(transfer)
        return transfer

    def _read_after_all(self, state: LeaseState, plan: TransferPlan,
                        future: concurrent.futures.Future[Completion | None]) -> None:
        """Any thread: a load whose copy without the loop did not verify, read the two-step way; ``future`` reports it."""
        if future.cancelled():
            return
        try:
            if self.closed:
                raise RuntimeError("the connector is shut down")
            reading = self.submit(self._read_with(state, plan, None))
        except Exception as exc:  # noqa: BLE001 - reported through the load's future
            self.sched.count_load_failure(None)
            self.release(state)
            if future.set_running_or_notify_cancel():
                future.set_exception(KVLoadFailed(f"could not post the load: {exc}"))
            return

        def report(read: concurrent.futures.Future[Completion | None]) -> None:
            if not future.set_running_or_notify_cancel():
                return
            if read.cancelled():
                future.set_exception(KVLoadFailed("the load was cancelled"))
            elif read.exception() is not None:
                future.set_exception(read.exception())  # type: ignore[arg-type]
            else:
                future.set_result(read.result())

        reading.add_done_callback(report)

    def _landed_in_place(self, state: LeaseState, plan: TransferPlan, client: NodeClient, started: float, *,
                         posted: bool, ends: bool) -> None:
        """Any thread: a load copied without the loop thread landed: its lease ends soon, and it is counted.

        ``posted``: the load was counted in ``loads`` when it was posted to the copy threads.
        ``ends``: the lease is still the node's to end (not where it sent the blocks with its answer).
        """
        if ends and client.end_later(state.lease_id):  # type: ignore[arg-type]
            self.call_soon(client.flush_ends_soon)
        sched = self.sched
        sched.budget.give_back_lease(state.address, state.lease_id)  # type: ignore[arg-type]
        sched.count_landed_in_place(plan.block_count, plan.nbytes, posted=posted)
        sched.observe_load(state.peer, time.perf_counter() - started)
        sched.add_metrics(h2d_bytes_copied=plan.nbytes, dkv_peer_loads=int(state.peer))

    def _claim_slots(self, state: LeaseState) -> LeaseSlots | None:
        """Loop thread, first thing in a load: take its lease's slot map, and count the load as begun. Never raises.

        From here on a lookup in place may end the lease (the map is the
        load's; its copy is proven by the checksums); before, it must not
        (see :meth:`lookup_in_place`).
        """
        try:
            client = self.clients.get(state.address)
            return client.claim_slots(state.lease_id) if client is not None and state.lease_id is not None else None
        finally:
            self._loads_begun += 1

    async def _read(self, state: LeaseState, plan: TransferPlan) -> Completion:
        """Loop thread: read a lease's blocks into the plan's rows (the read ends the lease on the node)."""
        return await self._read_with(state, plan, self._claim_slots(state))

    async def _read_with(self, state: LeaseState, plan: TransferPlan, slots: LeaseSlots | None) -> Completion:
        """Loop thread: :meth:`_read` with the lease's slot map already taken (``None``: none, or used up)."""
        sched = self.sched
        keys = plan.keys()
        targets, finish = self.copy[plan.device].load_targets(plan.row_groups())
        started = time.perf_counter()
        try:
            client = self.client(state.address)
            with self.using(client):
                await client.read(state.lease_id, keys, targets, slots=slots)  # type: ignore[arg-type]
        except Exception as exc:
            self._read_failed(state, exc)
            raise
        finally:
            # the read ended the lease on the node (or its failure did: a refused read, or the
            # connection closing); a lease the node still holds, if any, lapses with its TTL
            sched.budget.give_back_lease(state.address, state.lease_id)  # type: ignore[arg-type]
        self._read_landed(state, plan, started)
        return finish()

    def _read_failed(self, state: LeaseState, exc: BaseException) -> None:
        """Any thread: a read from a node failed: counted by reason, and the node noted as not answering."""
        sched = self.sched
        sched.count_load_failure(exc)  # by reason; a checksum failure in checksum_failures too
        if isinstance(exc, ChecksumMismatch):  # corrupted or substituted bytes: failed, never delivered
            log.warning("a load from %s failed its checksum: %s", state.address, exc)
        if state.peer:
            sched.add_metrics(dkv_peer_load_failures=1)
        self.unanswered(state.address, exc)

    def _read_landed(self, state: LeaseState, plan: TransferPlan, started: float) -> None:
        """Any thread: a read's bytes are in the plan's rows, checked: timed and counted."""
        sched = self.sched
        sched.observe_load(state.peer, time.perf_counter() - started)
        sched.count(blocks_loaded=plan.block_count, bytes_loaded=plan.nbytes)
        sched.add_metrics(h2d_bytes_copied=plan.nbytes, dkv_peer_loads=int(state.peer))

    def _read_on_channel(self, state: LeaseState, plan: TransferPlan) -> Transfer | None:
        """Scheduler thread: a load read over a free direct channel, on a read thread; ``None``: post it to the loop.

        With ``direct_reads`` only (on by default where UCX has no RDMA
        transport: then UCX carries the bytes over TCP anyway, with its own
        copy and a Python step per message on the loop thread). A listener
        read (not same-host, whose reads copy out of the shared segment, and
        not a lease whose blocks came with its lookup: the node ended it)
        into CPU rows back to back, every leaf and shard (:meth:`_row_runs`),
        from a node whose client has a direct channel not in use. A read thread
        (:func:`dkv.copy_threads.submit_read`: not a copy thread, which the
        network wait would hold) sends the read and receives its blocks straight into the rows, each hashed as
        it lands, without the GIL (:meth:`dkv.client.NodeClient.read_rows_direct`):
        no Python step per block or message, and, with the scheduler thread
        busy in Python, one GIL hand-off at each end instead of one per step
        of the loop. Until the node's answer is in, no lookup runs in place
        (a lookup could otherwise reach the node first and end the lease the
        read is about to read). A read the node never saw (the channel was
        taken, or closed) goes to the loop after all; any other failure fails
        the load, counted as the loop's would be.
        """
        if (not self._direct_reads or state.lease_id is None or state.received or self.closed
                or self.copy[plan.device].staged):
            return None
        client = self.clients.get(state.address)
        if client is None or client.uses_shared_memory or not client.direct_free:
            return None  # (a same-host read copies out of the shared segment: no bytes on any stream)
        runs = self._row_runs(plan)
        if runs is None:
            return None
        _, finish = self.copy[plan.device].load_targets([])  # CPU rows are filled in place: a finisher that says so
        future: concurrent.futures.Future[Completion | None] = LightFuture()
        waiting = [True]  # until the node's answer is in (or the read failed): lookups wait meanwhile

        def answered() -> None:
            with self._tasks_lock:
                if waiting[0]:
                    waiting[0] = False
                    self._channel_reads_unanswered -= 1

        def read() -> None:  # a read thread
            started = time.perf_counter()
            try:
                client.read_rows_direct(state.lease_id, runs, answered)  # type: ignore[arg-type]
            except (ChannelBusy, ChannelClosed):  # the node never saw it: the loop reads it, the lease as it was
                answered()
                self._read_after_all(state, plan, future)
                return
            except BaseException as exc:  # noqa: BLE001 - reported through the load's future
                answered()
                self.sched.budget.give_back_lease(state.address, state.lease_id)  # type: ignore[arg-type]
                if isinstance(exc, Exception):
                    self._read_failed(state, exc)
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
                return
            answered()
            self.sched.budget.give_back_lease(state.address, state.lease_id)  # type: ignore[arg-type]
            self._read_landed(state, plan, started)
            if future.set_running_or_notify_cancel():
                future.set_result(finish())

        with self._tasks_lock:
            self._channel_reads_unanswered += 1
            self.tasks.add(future)
        future.add_done_callback(self._forget)
        try:
            job = copy_threads.submit_read(read)
        except RuntimeError:  # no thread takes work any more (the interpreter is shutting down)
            answered()
            future.cancel()
            return None
        with self._tasks_lock:
            self._channel_jobs.add(job)
        job.add_done_callback(self._forget_channel_job)
        self.sched.count(loads=1)
        transfer = Transfer(future, is_load=True)
        self._book(transfer)
        return transfer

    def _forget_channel_job(self, job: concurrent.futures.Future[Any]) -> None:
        with self._tasks_lock:
            self._channel_jobs.discard(job)

    def post_offload(self, plan: TransferPlan) -> Any:
        """Scheduler thread: fence a validated offload's rows (CUDA: an event on the compute stream) and post it.

        The loop thread queues the device copy behind the fence, waits for it
        to land, then writes.

        ``None`` when the loop is stopped (nothing was posted: the caller returns a completed transfer).
        """
        start_copy = self.copy[plan.device].offload_sources(plan.row_groups)
        sched = self.sched

        async def run() -> None:
            try:
                ready, sources = start_copy()
                await ready.settled()  # the device-to-host copy landed (CUDA: woken by its event, no polling)
            except Exception:
                sched.count(offloads_failed=1)  # the device copy failed: nothing was sent
                raise
            if sched.backing_off(self.node_address):  # found unanswering since this was posted: nothing sent
                sched.drop_offload(plan)
                return
            try:
                client = self.client(self.node_address)
                with self.using(client):
                    result = await client.write(plan.keys(), sources())
            except Exception as exc:
                sched.count(offloads_failed=1, checksum_failures=int(isinstance(exc, ChecksumMismatch)))
                self.unanswered(self.node_address, exc)  # a dead node: later offloads and lookups back off
                raise
            moved = sched.learn_offload(plan, result.statuses)
            sched.count(blocks_offloaded=result.stored, offload_blocks_full=result.statuses.count(FULL),
                        bytes_offloaded=moved)
            sched.add_metrics(d2h_bytes_copied=moved)

        try:
            future = self.submit(run())
        except RuntimeError:
            return None
        sched.count(offloads=1)
        transfer = Transfer(future, is_load=False, g0_blocks_per_leaf=plan.block_ids())
        self._book(transfer)
        return transfer

    def poll_transfers(self) -> None:
        """Scheduler thread: drop settled transfers from the books."""
        self.transfers = collections.deque(t for t in self.transfers if not t._future.done())

    def _book(self, transfer: Transfer) -> None:
        """Scheduler thread: keep ``transfer`` on the books, after dropping the settled ones at their head.

        Transfers mostly settle in the order they were posted, so the books
        stay about as long as the transfers in flight, and each call frees
        about one. A settled transfer left there would keep its plan (the
        hashes and block ids of every block) alive, for the garbage collector
        to walk in each young collection on whichever thread allocates, the
        scheduler's too; and dropping hundreds at once would cost one call
        hundreds of µs. Past ``MAX_BOOKED`` (one old transfer that does not
        settle), every settled one is dropped.
        """
        books = self.transfers
        while books and books[0]._future.done():
            books.popleft()
        if len(books) >= MAX_BOOKED:
            self.poll_transfers()
            books = self.transfers
        books.append(transfer)

    # ---- touches and resets -----------------------------------------------------------------------

    def touch(self, hashes: list[bytes]) -> bool:
        """Scheduler thread: post a fire-and-forget touch; False when dropped (``MAX_BACKGROUND`` in flight)."""
        leaves, shards = self.sched.leaf_names, self.sched.tp_shards

        async def run() -> None:
            try:
                client = self.client(self.node_address)
                with self.using(client):
                    await client.touch(hashes, list(leaves), shards)
            except Exception as exc:  # noqa: BLE001 - a missed touch costs a later refetch at most
                log.debug("touch failed: %s", exc)

        return self._fire(run())

    def reset(self) -> None:
        """Any thread: ask the loop for a reset of this namespace on the co-located node."""
        self.call_soon(self._want_reset)

    def _want_reset(self) -> None:
        """Loop thread: note a reset and start the resetter unless it runs."""
        if self.closed:
            return
        if self._reset_wanted:
            self.sched.count(resets_coalesced=1)
            return
        self._reset_wanted = True
        if self._resetter is None:
            self._resetter = asyncio.get_running_loop().create_task(self._reset(), name="dkv-connector-reset")

    async def _reset(self) -> None:
        try:
            while self._reset_wanted:
                self._reset_wanted = False
                try:
                    client = self.client(self.node_address)
                    with self.using(client):
                        await client.clear()
                except Exception as exc:  # noqa: BLE001
                    log.debug("reset_prefix_cache failed: %s", exc)
        finally:
            self._resetter = None

    # ---- owned work on the loop thread --------------------------------------------------------------
    #
    # Everything the connector starts on the loop is owned here and cancelled at shutdown:
    # lookups and transfers behind handles (submit; as many as the engine has handles), touches
    # (_fire: at most MAX_BACKGROUND, more dropped and counted), one resetter (_reset) and one
    # lease releaser per node (_send_releases, its queue bounded), and the idle-client sweeper.

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Any thread: run ``coro`` on the loop as a task this connector owns (cancelled at shutdown).

        Returns at once; ``RuntimeError`` (``coro`` closed) once the loop is stopped.
        """
        future: concurrent.futures.Future[Any] = LightFuture()
        with self._tasks_lock:
            self.tasks.add(future)
        future.add_done_callback(self._forget)
        try:
            self._post(functools.partial(self._start_task, coro, future))
        except RuntimeError:
            coro.close()
            future.cancel()
            raise
        return future

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Any thread: run ``fn(*args)`` on the loop thread soon; silently nothing once the loop is stopped."""
        try:
            self._post(functools.partial(fn, *args) if args else fn)
        except RuntimeError:
            pass  # the loop is stopped: the node ended this client's leases with its connections

    def _post(self, item: Callable[[], Any]) -> None:
        """Any thread: queue ``item`` for the loop thread, waking it only when no wake-up is pending.

        ``call_soon_threadsafe`` wakes the loop with a write to its self-pipe
        that lets go of the GIL; a loop thread waiting for the GIL (busy with
        earlier transfers) then takes it and can keep it for a whole switch
        interval (5 ms) before the caller gets it back. So the scheduler
        thread wakes the loop at most once per drain (while a wake-up is
        pending the loop has not drained yet, and appending is enough), and
        through a pipe of the connector's own, written without letting go of
        the GIL (:func:`dkv.held_gil.write`). ``RuntimeError`` once the loop is
        stopped (``item`` is not queued).
        """
        loop = self.loop
        if not loop.alive:
            raise RuntimeError("the connector's event loop is stopped")
        inbox = self._inbox
        inbox.append(item)
        if self._wake_pending:
            return
        self._wake_pending = True
        with self._wake_lock:
            fd = self._wake_fd
            if fd >= 0:
                try:
                    held_gil.write(fd, b"\0")
                except BlockingIOError:  # a full pipe: a wake-up is on its way anyway
                    pass
                return
        try:
            loop.loop.call_soon_threadsafe(self._drain_inbox)
        except RuntimeError:
            self._wake_pending = False
            with contextlib.suppress(ValueError):
                inbox.remove(item)
            raise

    def _open_wake_pipe(self) -> None:
        """Loop thread: the pipe :meth:`_post` wakes the loop through (see :meth:`_post`)."""
        if not held_gil.HOLDS_GIL:
            return  # no GIL-holding write here: call_soon_threadsafe does as well
        read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        asyncio.get_running_loop().add_reader(read_fd, self._on_wake, read_fd)
        with self._wake_lock:
            self._wake_fd = write_fd
        self._wake_read_fd = read_fd

    def _close_wake_pipe(self) -> None:
        """Loop thread: stop waking through the pipe (posts fall back to call_soon_threadsafe) and close it."""
        with self._wake_lock:
            write_fd, self._wake_fd = self._wake_fd, -1
        read_fd, self._wake_read_fd = self._wake_read_fd, -1
        if read_fd >= 0:
            asyncio.get_running_loop().remove_reader(read_fd)
            os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)

    def _on_wake(self, read_fd: int) -> None:
        """Loop thread: the wake pipe is readable: empty it, then drain the inbox."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            os.read(read_fd, 4096)
        self._drain_inbox()

    def _drain_inbox(self) -> None:
        """Loop thread: run everything posted, in order (a post from now on wakes the loop again)."""
        self._wake_pending = False
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            try:
                item()
            except Exception:
                log.exception("connector work posted to the loop failed to start")

    @staticmethod
    def _start_task(coro: Coroutine[Any, Any, Any], future: concurrent.futures.Future[Any]) -> None:
        """Loop thread: start ``coro`` as a task whose outcome ``future`` reports (cancelling ``future`` cancels it)."""
        if future.cancelled():  # cancelled before it started (shutdown)
            coro.close()
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(coro)

        def report(done: asyncio.Task[Any]) -> None:
            if done.cancelled():
                future.cancel()
            if not future.set_running_or_notify_cancel():
                return  # cancelled by its owner
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(done.result())

        def cancel(f: concurrent.futures.Future[Any]) -> None:
            if f.cancelled():
                with contextlib.suppress(RuntimeError):  # the loop is closed: the task went with it
                    loop.call_soon_threadsafe(task.cancel)

        task.add_done_callback(report)
        future.add_done_callback(cancel)

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._tasks_lock:
            self.tasks.discard(future)

    def _fire(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """Any thread: run fire-and-forget ``coro`` as owned work; False (``coro`` dropped) when ``MAX_BACKGROUND`` run."""
        with self._tasks_lock:
            if self.background >= MAX_BACKGROUND:
                coro.close()
                return False
            self.background += 1
        try:
            future = self.submit(coro)
        except BaseException:
            self._fired(None)
            raise
        future.add_done_callback(self._fired)
        return True

    def _fired(self, _future: concurrent.futures.Future[Any] | None) -> None:
        with self._tasks_lock:
            self.background -= 1

    async def close(self) -> None:
        """Loop thread: cancel all owned work, stop the directory, close every client."""
        self.closed = True  # nothing new is started on the loop from here on
        with self._tasks_lock:
            owned = [f for f in self.tasks if not f.done()]
        for future in owned:
            future.cancel()
        with self._tasks_lock:
            copies = list(self._copies)
        for copy in copies:
            copy.cancel()  # no chunk starts from here on: the rows are written no more once these settle
        await asyncio.gather(*(asyncio.wrap_future(f) for f in owned), return_exceptions=True)
        if copies:  # bounded: a copy is a memcpy of what one load moves, chunk by chunk
            await asyncio.wait([asyncio.wrap_future(c.done) for c in copies], timeout=self.timeout + 5)
        with self._tasks_lock:
            watcher = self._in_place_watcher
        workers = [t for t in (self._sweeper, self._resetter, *self._releasers.values(),
                               watcher if isinstance(watcher, asyncio.Task) else None) if t is not None]
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        self._releases.clear()
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)
        if self.router is not None:
            await self.router.stop()
        clients = [*self.clients.values(), *self.closing]
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        with self._tasks_lock:
            jobs = list(self._channel_jobs)
        if jobs:  # reads over direct channels, ended by their channels' close: the rows are written no more after
            await asyncio.wait([asyncio.wrap_future(job) for job in jobs], timeout=self.timeout + 5)
        with self._tasks_lock:
            unsettled = list(self._in_place_lookups)
        for lookup in unsettled:  # their channels are closed: each settles now, a miss unless answered already
            lookup.abort()
        for engine in self.copy.values():
            engine.close()
        if self.etcd_client is not None:
            try:
                await self.etcd_client.close()
            except Exception:  # noqa: BLE001
                pass
        self._close_wake_pipe()
