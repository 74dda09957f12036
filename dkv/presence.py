"""A node's presence in its cluster: etcd client, membership and directory publisher, wired to the store.

Started after the node listens (its address is known) and stopped before the
arena is freed. Stopping revokes the node's lease, so its member key and every
directory entry vanish at once; a node that dies instead vanishes after its
lease's TTL.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol

from dkv.etcd import DEFAULT_CLUSTER, DEFAULT_PREFIX, EtcdSettings, Layout, MemberRecord, make_client
from dkv.hostid import host_id
from dkv.membership import Membership
from dkv.publisher import DirectoryPublisher
from dkv.wire import PROTOCOL_VERSION

from dkv.store import Store

log = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    """How a node joins a cluster (``dkv serve --etcd ...``).

    ``etcd`` is the endpoints URL(s), or :class:`~dkv.etcd.EtcdSettings` for an
    etcd with TLS and/or user/password authentication.
    """

    etcd: str | EtcdSettings
    cluster: str = DEFAULT_CLUSTER
    prefix: str = DEFAULT_PREFIX
    ttl: int = 10
    publish_every: int = 1
    flush_interval: float = 0.05
    max_pending: int = 100_000


def new_epoch() -> str:
    """A fresh epoch: start time plus randomness, so two starts never share one."""
    return f"{int(time.time())}-{secrets.token_hex(4)}"


class ServedNode(Protocol):
    """What a cluster presence needs of its node (:class:`dkv.server.NodeServer` is one): no import of the server."""

    epoch: str  # replaced when the node's etcd lease was lost (a new registration is a new epoch)
    started_at: float
    store: Store

    @property
    def node_id(self) -> str: ...

    @property
    def address(self) -> str: ...


class ClusterPresence:
    """Owns the node's etcd side (see module docstring)."""

    def __init__(self, server: ServedNode, config: ClusterConfig) -> None:
        self.server = server
        self.config = config
        self.layout = Layout(config.cluster, config.prefix)
        self.client = make_client(config.etcd)
        node_id = server.node_id
        self.publisher = DirectoryPublisher(
            self.client, self.layout, node_id, epoch=server.epoch, publish_every=config.publish_every,
            flush_interval=config.flush_interval, max_pending=config.max_pending,
        )
        self.membership = Membership(
            self.client, self.layout, node_id, self.record, ttl=config.ttl,
            on_new_lease=self._on_new_lease, on_lease_lost=self._on_lease_lost,
        )

    def record(self) -> MemberRecord:
        server = self.server
        host_free, host_total = server.store.host_bytes()
        disk_free, disk_total = server.store.disk_bytes()
        return MemberRecord(
            node_id=server.node_id,
            address=server.address,
            epoch=server.epoch,
            protocol_version=PROTOCOL_VERSION,
            started_at=server.started_at,
            host_id=host_id(),
            host_total=host_total,
            host_used=host_total - host_free,
            disk_total=disk_total,
            disk_used=disk_total - disk_free,
            blocks=len(server.store.blocks),
            published=self.publisher.announced,
            publish_every=self.config.publish_every,
        )

    async def start(self) -> None:
        await self.client.connect()
        try:
            await self.membership.start()
        except BaseException:
            await self.client.close()
            raise
        self.publisher.set_lease(self.membership.lease_id, self.server.epoch)
        self.server.store.on_commit.append(self.publisher.on_commit)
        self.server.store.on_evict.append(self.publisher.on_evict)
        await self.publisher.start()

    async def stop(self) -> None:
        await self.publisher.stop()
        await self.membership.stop()
        with contextlib.suppress(Exception):
            await self.client.close()

    def _on_lease_lost(self) -> None:
        # the next registration is a new epoch: hints naming the old one become stale
        self.server.epoch = new_epoch()
        self.publisher.set_lease(None)

    async def _on_new_lease(self, lease_id: int) -> None:
        self.publisher.set_lease(lease_id, self.server.epoch)
        log.info("re-registered with epoch %s; republishing %d entries", self.server.epoch,
                 self.publisher.announced)

    def stats(self) -> dict[str, Any]:
        return {
            "cluster": self.config.cluster,
            "lease": self.membership.lease_id,
            "registrations": self.membership.registrations,
            "lease_losses": self.membership.lease_losses,
            "announced": self.publisher.announced,
            "pending": self.publisher.pending,
            "publish_every": self.config.publish_every,
            **vars(self.publisher.counters),
        }
