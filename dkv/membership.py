"""A node's membership in etcd: one lease, the member key on it, kept alive, re-made when lost.

Registration is create-if-absent: a second live node with the same id is
refused (:class:`NodeIdTaken`). A holder at this node's own address is not
live, since this process listens there now: it is a predecessor that died
without revoking its lease (SIGKILL), so its lease is ended and the node
registers at once instead of waiting out the old TTL. The lease is kept alive every TTL/3 (every
``RETRY_INTERVAL`` while etcd does not answer); if etcd
says the lease is gone, or no keep-alive succeeded for a whole TTL (an etcd
outage longer than the TTL), the node counts the lease as lost and
re-registers as soon as etcd answers: a new epoch, a new lease, and its
directory entries republished (``on_new_lease``). While etcd is unreachable the
node keeps serving; only the directory waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from etcd3aio import Etcd3Client

from dkv.errors import NodeIdTaken
from dkv.etcd import DEFAULT_ETCD_TIMEOUT, Layout, MemberRecord, cluster_error

log = logging.getLogger(__name__)

RETRY_INTERVAL = 0.5  # seconds between keep-alive attempts while etcd does not answer


class Membership:
    """Registers a node and keeps its lease; see the module docstring for the contract."""

    def __init__(
        self,
        client: Etcd3Client,
        layout: Layout,
        node_id: str,
        record: Callable[[], MemberRecord],
        *,
        ttl: int = 10,
        on_new_lease: Callable[[int], Awaitable[None]] | None = None,
        on_lease_lost: Callable[[], None] | None = None,
        timeout: float = DEFAULT_ETCD_TIMEOUT,
    ) -> None:
        self.client = client
        self.layout = layout
        self.node_id = node_id
        self.ttl = max(2, int(ttl))
        self._record = record
        self._on_new_lease = on_new_lease
        self._on_lease_lost = on_lease_lost
        self.timeout = timeout
        self.lease_id: int | None = None
        self._stale_lease: int | None = None
        self.registrations = 0
        self.lease_losses = 0
        self._last_ok = 0.0
        self._last_value = ""
        self._task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return self.layout.node_key(self.node_id)

    async def start(self) -> None:
        """Register and start keeping alive.

        Raises :class:`NodeIdTaken` if the id is live elsewhere, :class:`ClusterError`
        if etcd cannot be reached.
        """
        try:
            await self._register()
        except NodeIdTaken:
            raise
        except Exception as exc:
            raise cluster_error(exc, getattr(self.client, "settings", None), "registering in the cluster") from exc
        self._task = asyncio.create_task(self._keep_alive_forever(), name=f"dkv-membership-{self.node_id}")

    async def stop(self) -> None:
        """Stop keeping alive and revoke the lease, so the member key and entries vanish now."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.lease_id is not None:
            with contextlib.suppress(Exception):
                await self.client.lease.revoke(self.lease_id, timeout=self.timeout)
            self.lease_id = None

    async def _register(self) -> None:
        grant = await self.client.lease.grant(self.ttl, timeout=self.timeout)
        record = self._record()
        value = record.to_json()
        kv = self.client.kv

        async def create() -> Any:
            return await kv.txn(
                compare=[kv.txn_compare_create_revision(self.key, 0)],
                success=[kv.txn_op_put(self.key, value, lease=grant.ID)],
                failure=[kv.txn_op_get(self.key)],
                timeout=self.timeout,
            )

        txn = await create()
        if not txn.succeeded:
            holder = txn.responses[0].response_range.kvs
            previous = MemberRecord.from_json(holder[0].value) if holder else None
            if previous is not None and previous.address == record.address and holder[0].lease:
                # Our predecessor at this very address died without revoking its lease (SIGKILL, a
                # crash): this process listens on that port now, so the holder is dead. End its lease
                # (its member key and directory entries go with it) rather than wait out its TTL.
                log.warning("node id %r was held by a dead process at our address %s (epoch %s): taking it over",
                            self.node_id, previous.address, previous.epoch)
                with contextlib.suppress(Exception):
                    await self.client.lease.revoke(holder[0].lease, timeout=self.timeout)
                txn = await create()
        if not txn.succeeded:
            holder = txn.responses[0].response_range.kvs
            with contextlib.suppress(Exception):
                await self.client.lease.revoke(grant.ID, timeout=self.timeout)
            detail = MemberRecord.from_json(holder[0].value) if holder else None
            raise NodeIdTaken(
                f"node id {self.node_id!r} is already registered in cluster {self.layout.cluster!r}"
                + (f" by a live node at {detail.address} (epoch {detail.epoch})" if detail else "")
            )
        self.lease_id = grant.ID
        self._last_ok = time.monotonic()
        self._last_value = value
        self.registrations += 1
        log.info("registered %s with lease %x (ttl %ds)", self.key, grant.ID, self.ttl)

    async def _keep_alive_once(self) -> int:
        assert self.lease_id is not None
        call = self.client.lease.keep_alive(self.lease_id)
        try:
            async with asyncio.timeout(self.timeout):
                async for response in call:
                    return int(response.TTL)
        finally:
            call.cancel()
        return 0

    async def _keep_alive_forever(self) -> None:
        """Keep the lease alive every TTL/3; while etcd does not answer, try every ``RETRY_INTERVAL``.

        So a node whose lease was lost in an outage registers again (and its
        entries are republished) within about ``RETRY_INTERVAL`` of etcd
        answering, not a TTL/3 later.
        """
        answered = True
        while True:
            await asyncio.sleep(self.ttl / 3 if answered else min(self.ttl / 3, RETRY_INTERVAL))
            answered = False
            try:
                if self.lease_id is None:
                    await self._reregister()
                    answered = True
                    continue
                if await self._keep_alive_once() <= 0:
                    self._lose_lease("etcd reports the lease expired")
                    await self._reregister()
                    answered = True
                    continue
                self._last_ok = time.monotonic()
                answered = True
                await self._refresh_record()
            except asyncio.CancelledError:
                raise
            except NodeIdTaken as exc:
                answered = True  # etcd answered: another live node holds the id; ask again at the usual pace
                log.error("cannot re-register: %s", exc)
            except Exception as exc:  # noqa: BLE001 - etcd outages must not stop the node
                log.warning("etcd keep-alive failed: %s", exc)
                if self.lease_id is not None and time.monotonic() - self._last_ok > self.ttl:
                    self._lose_lease("no keep-alive succeeded for a whole TTL")

    def _lose_lease(self, why: str) -> None:
        log.warning("lease of %s lost: %s", self.key, why)
        self._stale_lease, self.lease_id = self.lease_id, None
        self.lease_losses += 1
        if self._on_lease_lost is not None:
            self._on_lease_lost()

    async def _reregister(self) -> None:
        if self._stale_lease is not None:
            # etcd may have kept our old lease through its outage: end it, so its member
            # key and entries cannot block the new registration or outlive it
            with contextlib.suppress(Exception):  # "not found" is the usual answer
                await self.client.lease.revoke(self._stale_lease, timeout=self.timeout)
        await self._register()
        self._stale_lease = None
        if self._on_new_lease is not None and self.lease_id is not None:
            await self._on_new_lease(self.lease_id)

    async def _refresh_record(self) -> None:
        value = self._record().to_json()
        if value != self._last_value and self.lease_id is not None:
            await self.client.kv.put(self.key, value, lease=self.lease_id, timeout=self.timeout)
            self._last_value = value

    async def refresh_now(self) -> None:
        """Rewrite the member record now (after a change worth announcing)."""
        with contextlib.suppress(Exception):
            await self._refresh_record()
