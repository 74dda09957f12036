"""The dKV node server: accepts UCX connections and runs the wire protocol against the store.

Each connection is served by one task, one request at a time. A connection
first proves the cluster token over a fresh nonce and binds itself to one
namespace; every op after that is validated against its schema before the
store is asked anything. A malformed or oversized message gets an error reply
and the connection is closed; other connections are untouched.

Ownership (DESIGN contract 5): leases belong to the *client* (the id sent in
``hello``, shared by all connections of one client's pool) and end when its
last connection closes; write reservations belong to the *connection* and are
aborted when it closes, so a writer that dies mid-write leaves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dkv.arena import Arena
from dkv.disk_tier import DiskTier
from dkv.disk_worker import DiskWorker
from dkv.errors import ConfigError, DKVError, ProtocolError, RemoteError, TransportError
from dkv.hostid import host_id
from dkv.etcd import check_node_id
from dkv.keys import check_namespace
from dkv.presence import ClusterConfig, ClusterPresence, new_epoch
from dkv.store import Store, StoreKey
from dkv.transport import Connection, Listener, stop_progress
from dkv.units import is_loopback
from dkv.wire import (
    MAX_FRAME,
    MAX_KEYS,
    MAX_LEAVES,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    check_request,
    error_reply,
    proof_matches,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0
ADMIN_NAMESPACE = "dkv.admin"  # inspection only (stats); accepted whatever the namespace allow-list
IDLE_TIMEOUT = 600.0
EXPIRY_INTERVAL = 0.5


@dataclass
class NodeConfig:
    """Everything ``dkv serve`` configures."""

    pool_size: int
    host: str = "127.0.0.1"
    port: int = 0
    node_id: str = field(default_factory=lambda: f"node-{secrets.token_hex(3)}")
    token: bytes | None = None
    namespaces: frozenset[str] | None = None  # None: any namespace
    disk_dir: str | None = None
    disk_size: int = 0
    lease_ttl: float = 10.0
    reservation_ttl: float = 30.0
    read_ttl: float = 30.0
    max_leases_per_client: int = 64
    op_timeout: float = 10.0
    max_connections: int = 1024

    def validate(self) -> None:
        if self.token is None and not is_loopback(self.host):
            raise ConfigError(
                f"listening on {self.host} (beyond loopback) needs a cluster token: pass --token-file"
            )
        check_node_id(self.node_id)
        if self.namespaces is not None:
            for ns in self.namespaces:
                check_namespace(ns)
        if self.disk_dir is not None and self.disk_size <= 0:
            raise ConfigError("--disk needs --disk-size")


@dataclass
class _Peer:
    """Per-connection state."""

    conn: Connection
    conn_owner: str
    client_owner: str = ""
    namespace: str = ""
    task: asyncio.Task[Any] | None = None


class NodeServer:
    """A dKV node: arena, store, UCX listener, and the background expiry task."""

    def __init__(self, config: NodeConfig, cluster: ClusterConfig | None = None) -> None:
        config.validate()
        self.config = config
        self.cluster_config = cluster
        self.presence: ClusterPresence | None = None
        self.epoch = new_epoch()
        self.started_at = time.time()
        self.arena = Arena(config.pool_size, label=_label(config.node_id))
        try:
            disk = DiskTier(config.disk_dir, config.disk_size) if config.disk_dir else None
        except BaseException:
            self.arena.close()
            raise
        self.store = Store(
            self.arena,
            disk,
            lease_ttl=config.lease_ttl,
            reservation_ttl=config.reservation_ttl,
            read_ttl=config.read_ttl,
            max_leases_per_owner=config.max_leases_per_client,
        )
        self._peers: dict[str, _Peer] = {}
        self._client_conns: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._listener: Listener | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._disk_worker = DiskWorker(self.store) if disk is not None else None  # file I/O off the loop
        self._closed = False
        self.errors_by_code: dict[str, int] = {}
        self.ops: dict[str, int] = {}

    @property
    def port(self) -> int:
        assert self._listener is not None, "server not started"
        return self._listener.port

    @functools.cached_property
    def address(self) -> str:
        """The address peers should dial (a wildcard listen host is replaced by this host's address).

        Resolved once, after the listener started (the host name is not looked up per stats call).
        """
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Start listening, the expiry task, and (with a cluster) register in etcd.

        Raises :class:`dkv.membership.NodeIdTaken` when a live node holds the id;
        the caller must still :meth:`stop`.
        """
        if self._disk_worker is not None:
            self._disk_worker.start()
        self._listener = Listener(self._serve, self.config.port)
        self._expiry = asyncio.create_task(self._expire_forever(), name="dkv-expiry")
        if self.cluster_config is not None:
            self.presence = ClusterPresence(self, self.cluster_config)
            await self.presence.start()
        log.info("node %s listening on %s (pool %d bytes, shm %s)", self.config.node_id,
                 self.address, self.arena.size, self.arena.shm_name)

    async def stop(self) -> None:
        """Graceful shutdown: stop accepting, close connections, free the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.presence is not None:
            await self.presence.stop()
        if self._listener is not None:
            self._listener.close()
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        peers = list(self._peers.values())
        for peer in peers:
            peer.conn.abort()
        tasks = [p.task for p in peers if p.task is not None and p.task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self.store.close()
        if self._disk_worker is not None:
            await self._disk_worker.stop()  # bounded: a stuck disk write cannot hang shutdown
        self.arena.close()
        await stop_progress()

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL)
            self.store.expire()

    # ---- connections ------------------------------------------------------------------------

    async def _serve(self, conn: Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn_id = next(self._ids)
        peer = _Peer(conn, conn_owner=f"conn:{conn_id}", task=asyncio.current_task())
        self._peers[peer.conn_owner] = peer
        try:
            if len(self._peers) > self.config.max_connections:
                await conn.send_message(error_reply("busy", "too many connections"), HANDSHAKE_TIMEOUT)
                return
            if not await self._handshake(peer):
                return
            while not conn.closed:
                request = await conn.recv_message(IDLE_TIMEOUT)
                await self._handle(peer, request)
        except ProtocolError as exc:
            self._count_error("protocol")
            log.info("closing %s: %s", conn.peer, exc)
            with contextlib.suppress(DKVError):
                await conn.send_message(error_reply("protocol", str(exc)), HANDSHAKE_TIMEOUT)
        except TransportError as exc:
            log.debug("connection %s ended: %s", conn.peer, exc)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must cost one connection, never the node
            self._count_error("internal")
            log.exception("internal error serving %s", conn.peer)
        finally:
            conn.abort()
            self._forget(peer)

    def _forget(self, peer: _Peer) -> None:
        self._peers.pop(peer.conn_owner, None)
        self.store.drop_owner(peer.conn_owner)
        if peer.client_owner:
            left = self._client_conns.get(peer.client_owner, 1) - 1
            if left <= 0:
                self._client_conns.pop(peer.client_owner, None)
                self.store.drop_owner(peer.client_owner)
            else:
                self._client_conns[peer.client_owner] = left

    async def _handshake(self, peer: _Peer) -> bool:
        conn = peer.conn
        nonce = secrets.token_bytes(NONCE_SIZE)
        await conn.send_message(
            {"t": "challenge", "v": PROTOCOL_VERSION, "nonce": nonce, "node": self.config.node_id},
            HANDSHAKE_TIMEOUT,
        )
        hello = await conn.recv_message(HANDSHAKE_TIMEOUT)
        if check_request(hello) != "hello":
            raise ProtocolError("the first message must be hello")
        refusal = None
        if hello["v"] != PROTOCOL_VERSION:
            refusal = error_reply("version", f"protocol version {hello['v']} not supported; node speaks {PROTOCOL_VERSION}")
        elif not proof_matches(self.config.token, nonce, hello["ns"], hello["proof"]):
            refusal = error_reply("auth", "cluster token proof rejected")
        elif (self.config.namespaces is not None and hello["ns"] not in self.config.namespaces
              and hello["ns"] != ADMIN_NAMESPACE):
            refusal = error_reply("namespace", f"namespace {hello['ns']!r} is not served by this node")
        if refusal is not None:
            self._count_error(refusal["code"])
            await conn.send_message(refusal, HANDSHAKE_TIMEOUT)
            return False
        peer.namespace = hello["ns"]
        peer.client_owner = f"client:{hello['client']}"
        self._client_conns[peer.client_owner] = self._client_conns.get(peer.client_owner, 0) + 1
        await conn.send_message(
            {
                "ok": True,
                "node": self.config.node_id,
                "epoch": self.epoch,
                "host": host_id(),
                "arena": {"name": self.arena.shm_name, "size": self.arena.size},
                "limits": {"max_frame": MAX_FRAME, "max_keys": MAX_KEYS, "max_leaves": MAX_LEAVES,
                           "lease_ttl": self.config.lease_ttl, "read_ttl": self.config.read_ttl,
                           "max_leases": self.config.max_leases_per_client},
            },
            HANDSHAKE_TIMEOUT,
        )
        return True

    # ---- ops ----------------------------------------------------------------------------------

    async def _handle(self, peer: _Peer, request: dict[str, Any]) -> None:
        op = check_request(request)  # ProtocolError closes the connection
        if op == "hello":
            raise ProtocolError("hello sent twice")
        if peer.namespace == ADMIN_NAMESPACE and op != "stats":
            raise ProtocolError(f"the {ADMIN_NAMESPACE} namespace may only ask for stats")
        self.ops[op] = self.ops.get(op, 0) + 1
        handler: Callable[[_Peer, dict[str, Any]], Any] = getattr(self, f"_op_{op}")
        try:
            await handler(peer, request)
        except RemoteError as exc:
            self._count_error(exc.code)
            await peer.conn.send_message(error_reply(exc.code, exc.message), self.config.op_timeout)
        except ValueError as exc:
            self._count_error("invalid")
            await peer.conn.send_message(error_reply("invalid", str(exc)), self.config.op_timeout)

    async def _reply(self, peer: _Peer, **fields: Any) -> None:
        await peer.conn.send_message({"ok": True, **fields}, self.config.op_timeout)

    def _keys(self, peer: _Peer, raw_keys: list[list[Any]]) -> list[StoreKey]:
        return [StoreKey(peer.namespace, k[0], k[1], k[2]) for k in raw_keys]

    async def _op_lookup(self, peer: _Peer, req: dict[str, Any]) -> None:
        """Presence masks, and with ``lease`` a lease; spilled blocks are read back off the event loop first."""
        promoted = None
        if req["lease"] and self._disk_worker is not None:
            promoted = await self._disk_worker.promotions(peer.namespace, req["hashes"], req["leaves"], req["shards"])
        masks, lease = self.store.lookup(
            peer.namespace, req["hashes"], req["leaves"], req["shards"],
            owner=peer.client_owner if req["lease"] else None, group=req["group"], promoted=promoted,
        )
        await self._reply(peer, masks=_pack_masks(masks), lease=lease.lease_id if lease else None,
                          ttl=self.config.lease_ttl)

    async def _op_probe(self, peer: _Peer, req: dict[str, Any]) -> None:
        masks = self.store.presence(peer.namespace, req["hashes"], req["leaves"], req["shards"])
        await self._reply(peer, masks=_pack_masks(masks))

    async def _op_touch(self, peer: _Peer, req: dict[str, Any]) -> None:
        found = self.store.touch(peer.namespace, req["hashes"], req["leaves"], req["shards"])
        await self._reply(peer, found=found)

    async def _op_read(self, peer: _Peer, req: dict[str, Any]) -> None:
        """Serve a read under a lease; the read pins its own blocks until its bytes have left.

        With ``end`` the lease ends here, before any byte moves: from then on
        only the read's pins hold the slots, so a next lookup, the lease TTL or
        a release cannot let them be rewritten under the read. Listener path:
        the pins drop once the node's sends are done (or failed). Same-host
        path: they drop on the client's ``done`` (which answers whether they
        were still held), the read TTL, or the connection's end.
        """
        read = self.store.begin_read(req["lease"], peer.client_owner, self._keys(peer, req["keys"]),
                                     reader=peer.conn_owner)
        if req["end"]:
            self.store.end_lease(req["lease"])
        slots = read.slots
        sizes = [p.size for p in slots]
        if req["shm"]:
            await self._reply(peer, sizes=sizes, offsets=[p.offset for p in slots], read=read.read_id)
            return  # the client copies from the shared arena, then sends done
        try:
            await self._reply(peer, sizes=sizes)
            await peer.conn.send_payloads([self.arena.slot(p.offset, p.size) for p in slots if p.size],
                                          self.config.op_timeout)
        finally:
            self.store.end_read(read.read_id)

    async def _op_done(self, peer: _Peer, req: dict[str, Any]) -> None:
        """A same-host client finished copying a read: drop its pins; ``intact`` says they held throughout."""
        read = self.store.reads.get(req["read"])
        intact = read is not None and read.owner == peer.conn_owner and self.store.end_read(req["read"])
        await self._reply(peer, intact=intact)

    async def _op_write(self, peer: _Peer, req: dict[str, Any]) -> None:
        keys = self._keys(peer, req["keys"])
        if len(keys) != len(req["sizes"]):
            raise ProtocolError("write: keys and sizes differ in length")
        res, statuses = self.store.reserve(peer.conn_owner, keys, req["sizes"])
        if req["shm"]:
            await self._reply(peer, write=res.write_id, status=statuses, offsets=res.offsets)
            return  # the client copies into the reserved slots, then commits
        try:
            await self._reply(peer, write=res.write_id, status=statuses)
            slots = [self.arena.slot(o, n) for o, n in zip(res.offsets, res.sizes) if n]
            await peer.conn.recv_payloads(slots, self.config.op_timeout)
        except BaseException:
            self.store.abort(res.write_id)  # the transport aborted the endpoint first: no late bytes
            raise
        committed = self.store.commit(res.write_id, peer.conn_owner)
        await self._reply(peer, committed=len(committed))

    async def _op_commit(self, peer: _Peer, req: dict[str, Any]) -> None:
        committed = self.store.commit(req["write"], peer.conn_owner)
        await self._reply(peer, committed=len(committed))

    async def _op_abort(self, peer: _Peer, req: dict[str, Any]) -> None:
        res = self.store.reservations.get(req["write"])
        aborted = res is not None and res.owner == peer.conn_owner and self.store.abort(req["write"])
        await self._reply(peer, aborted=aborted)

    async def _op_release(self, peer: _Peer, req: dict[str, Any]) -> None:
        lease = self.store.leases.get(req["lease"])
        released = lease is not None and lease.owner == peer.client_owner and self.store.end_lease(req["lease"])
        await self._reply(peer, released=released)

    async def _op_stats(self, peer: _Peer, req: dict[str, Any]) -> None:
        await self._reply(peer, stats=self.stats())

    async def _op_clear(self, peer: _Peer, req: dict[str, Any]) -> None:
        await self._reply(peer, cleared=self.store.clear(peer.namespace))

    # ---- numbers ------------------------------------------------------------------------------

    def _count_error(self, code: str) -> None:
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1

    def stats(self) -> dict[str, Any]:
        """Everything ``dkv stats`` shows: identity, tiers, index, leases, counters."""
        store = self.store
        host_free, host_total = store.host_bytes()
        disk_free, disk_total = store.disk_bytes()
        return {
            "node_id": self.config.node_id,
            "epoch": self.epoch,
            "address": self.address,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "protocol_version": PROTOCOL_VERSION,
            "host": {"free": host_free, "total": host_total, "used": host_total - host_free,
                     "shm": self.arena.shm_name, "pinned": self.arena.pinned},
            "disk": {"free": disk_free, "total": disk_total, "used": disk_total - disk_free},
            "blocks": len(store.blocks),
            "blocks_on_disk": store.blocks_off_host(),
            "staging": dict(zip(("blocks", "bytes"), store.staging_usage())),
            "leases": len(store.leases),
            "pinned_blocks": store.pinned_blocks,
            "reads": len(store.reads),
            "reservations": len(store.reservations),
            "connections": len(self._peers),
            "clients": len(self._client_conns),
            "ops": dict(self.ops),
            "errors": dict(self.errors_by_code),
            "counters": vars(store.counters).copy(),
            "cluster": self.presence.stats() if self.presence is not None else None,
        }


def _pack_masks(masks: dict[str, list[bool]]) -> dict[str, bytes]:
    """Masks travel as one byte per hash (0 or 1): compact and cheap to build."""
    return {leaf: bytes(mask) for leaf, mask in masks.items()}


def _label(node_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in node_id)[:32]
