"""Publishes a node's blocks to the etcd directory: after commit, batched, optionally sparse.

The store tells the publisher what it committed and what it evicted (both
synchronous callbacks on the node's loop, no I/O). The publisher keeps the
*desired* directory state (which ``(namespace, hash)`` this node announces) and
a bounded queue of changes, coalesced per key, that a background task flushes
in transactions of at most 128 ops every ``flush_interval``.

* **Only committed blocks are published** (contract 3): nothing is queued
  before the store's commit callback.
* **Sparse publication**: of each committed run, only every ``publish_every``-th
  distinct hash and the run's last are announced. Hashes are prefix-chained, so
  the deepest announced hash still tells the router how far a peer's prefix
  reaches; the connector's lookup on that peer reports the exact blocks.
* **Unpublish on eviction**: when the last block of an announced hash leaves
  the node, its entry is deleted (batched like the puts).
* **etcd outages**: the queue is bounded (``max_pending``); changes beyond it
  are dropped and counted, and the next flush after etcd answers resynchronises
  this node's entries from the desired state. A new lease (after a lease loss)
  republishes everything.
* **Costs stay linear**: the queue is ordered by first change and each batch
  is taken from its front, so a flush of ``n`` changes costs ``O(n)``. A
  resync reads only this node's own entries: the keys attached to its etcd
  lease (``LeaseTimeToLive`` with keys) and its own record of what it may
  have written (on an old lease too), never the whole cluster's directory;
  should the lease's key list outgrow one gRPC message, the record alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from etcd3aio import Etcd3Client

from dkv.etcd import DEFAULT_ETCD_TIMEOUT, MAX_TXN_OPS, Layout
from dkv.store import StoreKey

log = logging.getLogger(__name__)

DirKey = tuple[str, bytes]  # (namespace, hash)
MAX_RETRY_INTERVAL = 0.5  # seconds: a failed flush is retried at most this long after (etcd may be back)


@dataclass
class PublisherCounters:
    txns: int = 0
    puts: int = 0
    deletes: int = 0
    dropped: int = 0
    resyncs: int = 0
    flush_failures: int = 0
    resyncs_from_record: int = 0  # the lease's key list outgrew one message: reconciled against the record


class DirectoryPublisher:
    """Keeps this node's directory entries in etcd in step with its store (see module docstring)."""

    def __init__(
        self,
        client: Etcd3Client,
        layout: Layout,
        node_id: str,
        *,
        epoch: str,
        publish_every: int = 1,
        flush_interval: float = 0.05,
        max_pending: int = 100_000,
        timeout: float = DEFAULT_ETCD_TIMEOUT,
    ) -> None:
        if publish_every < 1:
            raise ValueError("publish_every must be at least 1")
        self.client = client
        self.layout = layout
        self.node_id = node_id
        self.epoch = epoch
        self.publish_every = publish_every
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self.timeout = timeout
        self.lease_id: int | None = None
        self.counters = PublisherCounters()
        self._held: dict[DirKey, int] = {}
        self._announced: set[DirKey] = set()  # desired state
        # True: put, False: delete; in order of first change, coalesced per key, batches taken from the front
        self._pending: OrderedDict[DirKey, bool] = OrderedDict()
        # entries of this node that may be in etcd, on this lease or an old one that etcd may still keep:
        # every put tried, until a delete of it succeeds (bounded by the announced entries plus pending deletes)
        self._written: set[DirKey] = set()
        self._needs_resync = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- store callbacks (synchronous, no I/O) ---------------------------------------------

    def on_commit(self, keys: list[StoreKey]) -> None:
        run: dict[DirKey, None] = {}
        for key in keys:
            dkey = (key.namespace, key.hash)
            self._held[dkey] = self._held.get(dkey, 0) + 1
            run[dkey] = None
        ordered = list(run)
        for i, dkey in enumerate(ordered):
            if (i + 1) % self.publish_every == 0 or i == len(ordered) - 1:
                if dkey not in self._announced:
                    self._announced.add(dkey)
                    self._queue(dkey, True)

    def on_evict(self, keys: list[StoreKey]) -> None:
        for key in keys:
            dkey = (key.namespace, key.hash)
            left = self._held.get(dkey, 0) - 1
            if left > 0:
                self._held[dkey] = left
                continue
            self._held.pop(dkey, None)
            if dkey in self._announced:
                self._announced.discard(dkey)
                self._queue(dkey, False)

    def _queue(self, dkey: DirKey, put: bool) -> None:
        if dkey not in self._pending and len(self._pending) >= self.max_pending:
            self.counters.dropped += 1
            self._needs_resync = True
            return
        self._pending[dkey] = put
        if len(self._pending) >= MAX_TXN_OPS:
            self._wake.set()

    # ---- state ------------------------------------------------------------------------------

    @property
    def announced(self) -> int:
        return len(self._announced)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def set_lease(self, lease_id: int | None, epoch: str | None = None) -> None:
        """A new lease (after re-registration) means every entry must be written again."""
        self.lease_id = lease_id
        if epoch is not None:
            self.epoch = epoch
        if lease_id is not None:
            self._needs_resync = True
            self._wake.set()

    # ---- background flushing ------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._flush_forever(), name=f"dkv-publisher-{self.node_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def flush(self) -> None:
        """Write everything pending now (tests and shutdown use this; the task does it on its own)."""
        if self.lease_id is None:
            return
        if self._needs_resync:
            await self._resync()
            return
        while self._pending:
            batch = list(islice(self._pending.items(), MAX_TXN_OPS))  # from the front: O(batch), not O(queue)
            await self._apply(batch)
            for dkey, put in batch:
                if self._pending.get(dkey) is put:
                    del self._pending[dkey]

    async def _flush_forever(self) -> None:
        backoff = self.flush_interval
        while True:
            try:
                async with asyncio.timeout(backoff):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
                backoff = self.flush_interval
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd may be away; keep serving, retry later
                self.counters.flush_failures += 1
                backoff = min(max(backoff * 2, 0.1), MAX_RETRY_INTERVAL)
                log.debug("directory flush failed (%s); retrying in %.2fs", exc, backoff)

    async def _apply(self, batch: Iterable[tuple[DirKey, bool]]) -> None:
        kv = self.client.kv
        ops = []
        deleted = []
        for dkey, put in batch:
            key = self.layout.block_key(dkey[0], dkey[1], self.node_id)
            if put:
                ops.append(kv.txn_op_put(key, self.epoch, lease=self.lease_id or 0))
                self._written.add(dkey)  # before the txn: a put whose answer is lost may still have landed
                self.counters.puts += 1
            else:
                ops.append(kv.txn_op_delete(key))
                deleted.append(dkey)
                self.counters.deletes += 1
        if ops:
            await kv.txn(compare=[], success=ops, timeout=self.timeout)
            self.counters.txns += 1
            self._written.difference_update(deleted)

    async def _resync(self) -> None:
        """Make etcd hold exactly the desired entries of this node, on the current lease."""
        self.counters.resyncs += 1
        self._needs_resync = False
        try:
            present = await self._own_entries()
            self._pending.clear()
            changes = [(k, True) for k in self._announced] + [(k, False) for k in present - self._announced]
            for start in range(0, len(changes), MAX_TXN_OPS):
                await self._apply(changes[start : start + MAX_TXN_OPS])
        except BaseException:
            self._needs_resync = True
            raise

    async def _own_entries(self) -> set[DirKey]:
        """This node's entries that may be in etcd: the keys attached to its lease, and what it recorded writing.

        One ``LeaseTimeToLive`` request lists this lease's keys (the member key
        and this node's entries), never the cluster's whole directory; the
        record adds what this node wrote on an old lease that etcd may still
        keep. A list too large for one gRPC message leaves the record alone.
        """
        present = set(self._written)
        assert self.lease_id is not None
        try:
            answer = await self.client.lease.time_to_live(self.lease_id, keys=True, timeout=self.timeout)
        except Exception as exc:
            if not _too_large(exc):
                raise
            self.counters.resyncs_from_record += 1
            log.info("the lease's key list outgrew one message; resyncing from the record of %d entries",
                     len(present))
            return present
        for raw in answer.keys:
            parsed = self.layout.parse_block_key(bytes(raw).decode())
            if parsed is not None and parsed[2] == self.node_id:
                present.add((parsed[0], parsed[1]))
        return present


def _too_large(exc: BaseException) -> bool:
    """True for gRPC's RESOURCE_EXHAUSTED: an answer larger than the channel accepts."""
    code = getattr(exc, "code", None)
    try:
        return callable(code) and getattr(code(), "name", "") == "RESOURCE_EXHAUSTED"
    except Exception:  # noqa: BLE001 - not a gRPC error
        return False
