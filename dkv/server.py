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
import operator
import os
import resource
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dkv.arena import DEFAULT_MAX_NAMESPACES, Arena
from dkv.checksum import verify as checksum_matches
from dkv.credentials import CLUSTER, Credential, Credentials, LocalCredential, Quotas
from dkv.disk_tier import DiskTier
from dkv.disk_worker import DiskWorker
from dkv.handover import HandoverServer
from dkv.stay_awake import DEFAULT_BOUND as STAY_AWAKE_BOUND
from dkv.stay_awake import MAX_BOUND as MAX_STAY_AWAKE
from dkv.stay_awake import StayAwake
from dkv.stream_channel import LocalListener, StreamConnection, TcpListener
from dkv.errors import ConfigError, DKVError, ProtocolError, RemoteError, TransportError
from dkv.event_loop import loop_kind
from dkv.hostid import host_id
from dkv.etcd import check_node_id
from dkv.keys import MAX_TP_SHARDS, check_namespace
from dkv.presence import ClusterConfig, ClusterPresence, new_epoch
from dkv.store import (
    DEFAULT_MAX_LEASES,
    DEFAULT_MAX_LEASES_PER_TENANT,
    DEFAULT_RESERVATION_TTL,
    ReadPlan,
    Store,
    StoreKey,
    Use,
)
from dkv.transport import (Connection, Listener, active_progress_mode, payload_groups, payload_plan, plan_groups,
                           stop_progress)
from dkv.units import is_loopback
from dkv.wire import (
    FEATURES,
    MAX_FRAME,
    MAX_KEYS,
    MAX_LEAVES,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    check_request,
    client_proof,
    error_reply,
    node_proof,
    proof_equals,
)

log = logging.getLogger(__name__)
_BLOCK_SIZE = operator.attrgetter("size")

HANDSHAKE_TIMEOUT = 5.0
ADMIN_NAMESPACE = "dkv.admin"  # inspection only (stats), for the cluster credential; whatever the allow-list
WRITE_OPS = frozenset({"write", "commit", "abort", "clear"})  # refused to a read-only credential
IDLE_TIMEOUT = 600.0  # the longest a connection waits for its next request, whatever it holds (backstop)
EXPIRY_INTERVAL = 0.5
# Before a peer has authenticated it may send nothing larger than a handshake (the hello takes
# well under 1 KiB): a stranger's header announcing 8 MiB is refused before anything is allocated.
HANDSHAKE_MAX_FRAME = 4096
REFUSAL_TIMEOUT = 1.0  # the most a connection refused at a cap may take of the node (its "busy" reply)
REAP_GRACE = 1.0  # idle this long, a connection may be closed to admit a new one at a connection cap
IDLE_SCAN_INTERVAL = 1.0  # how often idle connections are looked for
# Lookup, probe and touch cost hashes x leaves x shards key checks on the node's only event loop.
# Touch and probe work through it in chunks of this cost, letting other connections in between.
YIELD_COST = 2048
COSTED_OPS = frozenset({"lookup", "probe", "touch"})
# the most blocks a leased lookup's answer carries the bytes of (see NodeServer._read_to_send)
MAX_LOOKUP_PAYLOAD_KEYS = 1024
# Ops after whose reply the leases in "ends" are stamped as used (they end before the op, as always): a
# lookup answers sooner by the stamps' cost (~0.15 ms per 256 blocks). Other requests do not see the
# difference: the stamps follow the reply's send with no await between. If the send has to wait (a full
# socket, UCX), one that runs meanwhile may meet those blocks with their previous stamps, which changes
# eviction order only. Only where the op cannot evict: with a disk tier a lookup may promote blocks.
STAMPS_AFTER_REPLY = frozenset({"lookup"})
# Descriptors one connection may hold in the node (measured: 3 for a UCX one, its connection-manager
# socket and its data sockets; 1 for a same-host control socket), with a margin; and those the node
# holds besides its connections.
DESCRIPTORS_PER_CONNECTION = 4
DESCRIPTOR_SLACK = 256


@dataclass
class NodeConfig:
    """Everything ``dkv serve`` configures."""

    pool_size: int
    host: str = "127.0.0.1"
    port: int = 0
    node_id: str = field(default_factory=lambda: f"node-{secrets.token_hex(3)}")
    token: bytes | None = None  # the cluster credential; None: a local one (same host, same OS user)
    tenants: dict[str, Credential] | None = None  # tenant credentials (dkv.credentials.load_tenants)
    namespaces: frozenset[str] | None = None  # None: any namespace
    max_namespaces: int = DEFAULT_MAX_NAMESPACES  # namespace segments the pool may hold
    disk_dir: str | None = None
    disk_size: int = 0
    lease_ttl: float = 10.0
    reservation_ttl: float = DEFAULT_RESERVATION_TTL  # 15 s: beyond op_timeout, and no longer (dkv.store)
    read_ttl: float = 30.0
    max_leases_per_client: int = 64
    # bounds no client may take a node past (README, Security: limits); None derives the default from the pool
    max_blocks: int | None = None  # blocks on any tier plus reserved keys; None: max(pool / 16 KiB, 16384)
    max_leases: int = DEFAULT_MAX_LEASES  # leases node-wide; at it a leased lookup is refused (NodeBusy)
    max_reserved_bytes_per_connection: int | None = None  # None: pool/8, at least 256 MiB (at most the pool)
    # a credential's quotas where its tenants entry (or the cluster credential) sets none
    max_reserved_bytes_per_credential: int | None = None  # None: pool/4, at least 512 MiB (at most the pool)
    max_leases_per_credential: int = DEFAULT_MAX_LEASES_PER_TENANT
    op_timeout: float = 10.0
    max_connections: int = 1024  # connections node-wide (authenticating ones included)
    # a credential's connections where its tenants entry (or the cluster credential) sets none;
    # None: half of max_connections, so no one credential can hold the whole node
    max_connections_per_credential: int | None = None
    max_unauthenticated: int = 64  # connections still in their handshake (each within HANDSHAKE_TIMEOUT)
    idle_timeout: float = 60.0  # an authenticated connection idle this long, holding nothing live, is closed
    max_cost: int = 16384  # hashes x leaves x shards of one lookup, probe or touch (see YIELD_COST)
    # the most block bytes a leased lookup's answer may carry, for a client that asks (``send``); 0: never
    max_lookup_payload: int = 1 << 20
    # the TCP control socket for clients on other hosts (dkv.stream_channel), on ``host``; 0: a free port, None: none
    peer_control_port: int | None = 0
    verify_writes: bool = True  # check each written block's declared checksum before it becomes visible
    # seconds the event loop keeps polling after a request that came back to back (dkv.stay_awake); 0: never
    stay_awake: float = STAY_AWAKE_BOUND

    def validate(self) -> None:
        if self.token is None and not is_loopback(self.host):
            raise ConfigError(
                f"listening on {self.host} (beyond loopback) needs a cluster token: pass --token-file"
            )
        check_node_id(self.node_id)
        if self.namespaces is not None:
            for ns in self.namespaces:
                check_namespace(ns)
        if self.max_namespaces < 1:
            raise ConfigError("--max-namespaces must be at least 1")
        if self.disk_dir is not None and self.disk_size <= 0:
            raise ConfigError("--disk needs --disk-size")
        if self.reservation_ttl <= self.op_timeout:
            raise ConfigError(f"the reservation TTL ({self.reservation_ttl} s) must outlast the op timeout "
                              f"({self.op_timeout} s): a write still receiving its bytes would lose its slots")
        for name in ("max_blocks", "max_reserved_bytes_per_connection", "max_reserved_bytes_per_credential"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, not {value}")
        if self.max_leases < 1 or self.max_leases_per_credential < 0:
            raise ConfigError("max_leases must be at least 1 and max_leases_per_credential not negative")
        for name in ("max_connections", "max_unauthenticated", "max_connections_per_credential", "max_cost"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, not {value}")
        if self.idle_timeout <= 0:
            raise ConfigError(f"idle_timeout must be positive, not {self.idle_timeout}")
        if self.max_lookup_payload < 0:
            raise ConfigError(f"max_lookup_payload must not be negative, not {self.max_lookup_payload}")
        if self.peer_control_port is not None and not 0 <= self.peer_control_port <= 65535:
            raise ConfigError(f"peer_control_port must be a TCP port (0: a free one), not {self.peer_control_port}")
        if not 0 <= self.stay_awake <= MAX_STAY_AWAKE:
            raise ConfigError(f"stay_awake must be from 0 to {MAX_STAY_AWAKE} s (--stay-awake-us 0 to "
                              f"{round(MAX_STAY_AWAKE * 1e6)}), not {self.stay_awake} s")
        if self.max_cost < MAX_TP_SHARDS:
            raise ConfigError(f"max_cost must be at least {MAX_TP_SHARDS} (one hash of one leaf with every shard)")


@dataclass
class _Peer:
    """Per-connection state."""

    conn: Connection | StreamConnection
    conn_owner: str
    client_owner: str = ""
    namespace: str = ""
    task: asyncio.Task[Any] | None = None
    credential: Credential | None = None  # set once the hello's proof checked out
    shm: str | None = None  # "read"/"write" once the connection was handed its segment (dkv.handover)
    # connection accounting (see NodeServer._admit): each connection is either being refused at a
    # cap, authenticating (at most max_unauthenticated), or authenticated and counted under its
    # credential; it is idle since ``idle_since`` unless ``in_op``
    refused: bool = False
    authenticated: bool = False
    counted_as: str | None = None  # the credential name it counts under, once counted
    in_op: bool = False
    idle_since: float = 0.0


class NodeServer:
    """A dKV node: arena, store, UCX listener, and the background expiry task."""

    def __init__(self, config: NodeConfig, cluster: ClusterConfig | None = None) -> None:
        config.validate()
        self.config = config
        self.cluster_config = cluster
        self.presence: ClusterPresence | None = None
        self.epoch = new_epoch()
        self.started_at = time.time()
        self.runtime: dict[str, str | None] = {}  # set by start()
        label = _label(config.node_id)
        self.arena = Arena(config.pool_size, label=label, max_namespaces=config.max_namespaces)
        self.local_credential: LocalCredential | None = None
        try:
            disk = DiskTier(config.disk_dir, config.disk_size) if config.disk_dir else None
            if config.token is None:
                self.local_credential = LocalCredential(label)
        except BaseException:
            self.arena.close()
            raise
        cluster_secret = config.token if config.token is not None else self.local_credential.secret
        self.credentials = Credentials(Credential(CLUSTER, cluster_secret), config.tenants)
        self.handover = HandoverServer(label, self._share_segment, self._segment_granted)
        self.control = LocalListener(label, self._serve)  # same-host clients' control path (dkv.stream_channel)
        # the control requests of clients on the listener path (other hosts), their calling-thread lookups
        # too (dkv.direct_channel), on the host peers dial
        self.peer_control = (TcpListener(config.host, config.peer_control_port, self._serve)
                             if config.peer_control_port is not None else None)
        self.store = Store(
            self.arena,
            disk,
            lease_ttl=config.lease_ttl,
            reservation_ttl=config.reservation_ttl,
            read_ttl=config.read_ttl,
            max_leases_per_owner=config.max_leases_per_client,
            max_blocks=config.max_blocks,
            max_leases=config.max_leases,
            max_reserved_bytes_per_owner=config.max_reserved_bytes_per_connection,
            quotas=self._quotas_of,
            max_reserved_bytes_per_tenant=config.max_reserved_bytes_per_credential,
            max_leases_per_tenant=config.max_leases_per_credential,
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
        self.lookup_payloads = 0  # leased lookups answered with their blocks' bytes (see _op_lookup)
        self._refusing = 0  # connections in _peers being refused at a cap
        self._authenticating: set[str] = set()  # conn_owner of connections still in their handshake
        self._credential_conns: dict[str, int] = {}  # authenticated connections per credential name
        self._next_idle_scan = 0.0
        self.reaped: dict[str, int] = {}  # connections closed by the node: "idle", or "cap" to admit another
        # block bytes moved, by direction and path: "in" = committed writes, "out" = reads and same-host loads;
        # "listener" = the bytes went over the node's connection, "local" = the client copied them itself (shm)
        self.traffic: dict[str, dict[str, int]] = {"in": {"local": 0, "listener": 0},
                                                   "out": {"local": 0, "listener": 0}}
        # called with (op, seconds) after each request once metrics are on (dkv.metrics); None: nothing timed
        self.observe_request: Callable[[str, float], None] | None = None
        self._awake = StayAwake(config.stay_awake)  # the loop kept polling between back-to-back requests

    @property
    def node_id(self) -> str:
        return self.config.node_id

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
        await self.handover.start()
        await self.control.start()
        if self.peer_control is not None:
            await self.peer_control.start()
        _raise_descriptor_limit(self.config.max_connections * DESCRIPTORS_PER_CONNECTION + DESCRIPTOR_SLACK)
        self._listener = Listener(self._serve, self.config.port)
        self.runtime = {"event_loop": loop_kind(asyncio.get_running_loop()), "ucx_progress": active_progress_mode()}
        self._expiry = asyncio.create_task(self._expire_forever(), name="dkv-expiry")
        if self.cluster_config is not None:
            self.presence = ClusterPresence(self, self.cluster_config)
            await self.presence.start()
        log.info("node %s listening on %s (pool %d bytes, %s)", self.config.node_id, self.address,
                 self.arena.size, "cluster token" if self.local_credential is None
                 else f"same-host clients only: credential in {self.local_credential.path}")

    def not_ready(self) -> str | None:
        """Why the node is not ready to serve (``None``: ready): its listener is up and, with a cluster, it is registered.

        A node whose etcd lease was lost is not ready until it registered again.
        """
        if self._closed:
            return "stopping"
        if self._listener is None:
            return "starting: the listener is not up yet"
        if self.cluster_config is not None:
            presence = self.presence
            if presence is None or presence.membership.lease_id is None:
                return "not registered in etcd (membership not live)"
        return None

    async def stop(self) -> None:
        """Graceful shutdown: stop accepting, close connections, free the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._awake.close()
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
        await self.control.close()
        if self.peer_control is not None:
            await self.peer_control.close()
        self.store.close()
        await self.handover.close()
        if self._disk_worker is not None:
            await self._disk_worker.stop()  # bounded: a stuck disk write cannot hang shutdown
        self.arena.close()
        if self.local_credential is not None:
            self.local_credential.close()
        await stop_progress()

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL)
            self.store.expire()
            self._reap_idle()

    # ---- connections ------------------------------------------------------------------------

    async def _serve(self, conn: Connection | StreamConnection) -> None:
        if self._closed:
            conn.abort()
            return
        conn_id = next(self._ids)
        peer = _Peer(conn, conn_owner=f"conn:{conn_id}", task=asyncio.current_task())
        refusal = self._admit(peer)
        if refusal is not None and self._refusing >= self.config.max_unauthenticated:
            self._count_error("refused")  # refusals are bounded too: beyond that many at once, no reply
            conn.abort()
            return
        self._peers[peer.conn_owner] = peer
        self._refusing += peer.refused
        try:
            if refusal is not None:  # instead of the challenge: the client raises NodeBusy
                await conn.send_message(error_reply("busy", refusal), REFUSAL_TIMEOUT)
                return
            conn.max_frame = HANDSHAKE_MAX_FRAME  # nothing larger than a hello until the hello is accepted
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT):  # the whole handshake, however many steps it takes
                    accepted = await self._handshake(peer)
            except TimeoutError:  # (a step's own bound raises OpTimeout, a TransportError)
                self._count_error("handshake_timeout")
                log.info("closing %s: no handshake within %.1f s", conn.peer, HANDSHAKE_TIMEOUT)
                return
            if not accepted:
                return
            self._authenticating.discard(peer.conn_owner)
            peer.authenticated = True
            conn.max_frame = MAX_FRAME
            refusal = self._admit_credential(peer)  # a no-op when the handshake did it (and refused there)
            if refusal is not None:  # the answer to its first request, if that comes soon: the client raises NodeBusy
                self._count_error("busy")
                peer.refused = True
                self._refusing += 1
                await conn.recv_message(REFUSAL_TIMEOUT)
                await conn.send_message(error_reply("busy", refusal), REFUSAL_TIMEOUT)
                return
            wait = max(IDLE_TIMEOUT, 2 * self.config.idle_timeout)  # idle ones are closed sooner: _reap_idle
            while not conn.closed:
                peer.in_op, peer.idle_since = False, time.monotonic()
                request = await conn.recv_message(wait)
                peer.in_op = True
                self._awake.arrived()
                await self._handle(peer, request)
                self._awake.served()
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
        if self._peers.pop(peer.conn_owner, None) is None:
            return  # forgotten already: the node closed it (_reap)
        self._refusing -= peer.refused
        self._authenticating.discard(peer.conn_owner)
        if peer.counted_as is not None:
            left = self._credential_conns.get(peer.counted_as, 1) - 1
            if left <= 0:
                self._credential_conns.pop(peer.counted_as, None)
            else:
                self._credential_conns[peer.counted_as] = left
        self.handover.forget(peer.conn_owner)
        if peer.shm is not None:
            self.arena.let_go(peer.namespace)
        self.store.drop_owner(peer.conn_owner)
        if peer.client_owner:
            left = self._client_conns.get(peer.client_owner, 1) - 1
            if left <= 0:
                self._client_conns.pop(peer.client_owner, None)
                self.store.drop_owner(peer.client_owner)
            else:
                self._client_conns[peer.client_owner] = left

    # ---- connection accounting ------------------------------------------------------------------
    #
    # Every connection is counted against max_connections from its arrival; one still in its
    # handshake also against max_unauthenticated (and it has HANDSHAKE_TIMEOUT for the whole of
    # it), an authenticated one against its credential's cap. At a cap, the longest-idle
    # connection (of that credential, for its cap) idle beyond REAP_GRACE that holds nothing live
    # is closed to make room; failing that the newcomer is refused with "busy" (NodeBusy). A
    # connection idle beyond idle_timeout that holds nothing live is closed too. "Holds nothing
    # live": no write reservation or same-host read of its own, and it is not the last connection
    # of a client that holds a lease (closing that would end the lease): closing it costs its
    # client a reconnect and nothing else. One that does hold something is closed once that ended
    # (TTLs bound it), or, whatever it holds, when it was idle past max(IDLE_TIMEOUT, 2 x idle_timeout).

    def _connections(self) -> int:
        """Connections counted against max_connections (authenticating or authenticated)."""
        return len(self._peers) - self._refusing

    def _admit(self, peer: _Peer) -> str | None:
        """Account a new connection: ``None`` when it may go on to its handshake, else why it is refused."""
        reason = None
        if len(self._authenticating) >= self.config.max_unauthenticated:
            reason = f"{len(self._authenticating)} connections are authenticating, the node's max_unauthenticated"
        elif self._connections() >= self.config.max_connections and not self._reap_one(None):
            reason = f"{self._connections()} connections are open, the node's max_connections"
        if reason is None:
            self._authenticating.add(peer.conn_owner)
            return None
        self._count_error("busy")
        peer.refused = True
        return reason

    def _connection_cap(self, credential: Credential) -> int:
        """A credential's connection cap: its quota, else the node's default for every credential."""
        quota = credential.quotas.max_connections
        if quota is not None:
            return quota
        return self.config.max_connections_per_credential or max(1, self.config.max_connections // 2)

    def _admit_credential(self, peer: _Peer, credential: Credential | None = None) -> str | None:
        """Count an authenticated connection under its credential (once): ``None``, or why it is refused ("busy").

        The handshake calls it once the credential checked out, before its
        accepting reply (so that a refused client gets NodeBusy at connect),
        and counts the refusal; _serve calls it again after (a no-op then).
        ``credential`` defaults to ``peer.credential``.
        """
        if peer.counted_as is not None:
            return None
        credential = credential or peer.credential
        assert credential is not None, "only an authenticated connection is counted under a credential"
        name = credential.name
        cap = self._connection_cap(credential)
        if self._credential_conns.get(name, 0) >= cap and not self._reap_one(name):
            return f"credential {credential.label!r} holds {cap} connections, its max_connections"
        self._credential_conns[name] = self._credential_conns.get(name, 0) + 1
        peer.counted_as = name
        return None

    def _idle_peers(self, now: float, longer_than: float, credential: str | None = None) -> list[_Peer]:
        """Authenticated connections waiting for a request for longer than ``longer_than`` s, longest first."""
        idle = [p for p in self._peers.values()
                if p.authenticated and not p.in_op and not p.refused and now - p.idle_since > longer_than
                and (credential is None or p.counted_as == credential)]
        idle.sort(key=lambda p: p.idle_since)
        return idle

    def _holds_nothing(self, peer: _Peer, reservers: set[str]) -> bool:
        """True when closing ``peer`` ends nothing: no reservation or read of its own, no lease it keeps alive."""
        store = self.store
        if peer.conn_owner in reservers or store.reads_of(peer.conn_owner):
            return False
        last = self._client_conns.get(peer.client_owner, 0) <= 1
        return not (last and store.leases_of(peer.client_owner))

    def _reservers(self) -> set[str]:
        return {res.owner for res in self.store.reservations.values()}

    def _reap_one(self, credential: str | None) -> bool:
        """Close the longest-idle connection (of ``credential``, or any) that may be closed; True if one was."""
        candidates = self._idle_peers(time.monotonic(), REAP_GRACE, credential)
        if candidates:
            reservers = self._reservers()
            for peer in candidates:
                if self._holds_nothing(peer, reservers):
                    self._reap(peer, "cap")
                    return True
        return False

    def _reap_idle(self) -> None:
        """Close the connections idle beyond idle_timeout that hold nothing live (every IDLE_SCAN_INTERVAL)."""
        now = time.monotonic()
        if now < self._next_idle_scan:
            return
        self._next_idle_scan = now + IDLE_SCAN_INTERVAL
        stale = self._idle_peers(now, self.config.idle_timeout)
        if stale:
            reservers = self._reservers()
            for peer in stale:
                if self._holds_nothing(peer, reservers):  # one at a time: a client's last one may keep its lease
                    self._reap(peer, "idle")

    def _reap(self, peer: _Peer, why: str) -> None:
        """Close an idle connection now, and account for it at once (its task ends on its own)."""
        self.reaped[why] = self.reaped.get(why, 0) + 1
        log.info("closing %s: idle for %.1f s (%s)", peer.conn.peer, time.monotonic() - peer.idle_since,
                 "idle timeout" if why == "idle" else "to admit a connection at a cap")
        peer.conn.abort()
        if peer.task is not None and peer.task is not asyncio.current_task():
            peer.task.cancel()
        self._forget(peer)

    async def _handshake(self, peer: _Peer) -> bool:
        """Mutual proof of the credential, then the namespace check; True when the connection may go on.

        The client proves the credential it names (the cluster's, or a
        tenant's) over the node's nonce, its own nonce, the namespace and the
        tenant; the node answers with its own proof over both nonces and its
        id, so a client can tell a real node from anyone who merely got an
        address into etcd. A same-host client is offered a ticket for its
        namespace's segment (:mod:`dkv.handover`).
        """
        conn = peer.conn
        nonce = secrets.token_bytes(NONCE_SIZE)
        local = self.local_credential.path if self.local_credential is not None else None
        await conn.send_message(
            {"t": "challenge", "v": PROTOCOL_VERSION, "nonce": nonce, "node": self.config.node_id, "local": local},
            HANDSHAKE_TIMEOUT,
        )
        hello = await conn.recv_message(HANDSHAKE_TIMEOUT)
        if hello.get("op") != "hello":
            raise ProtocolError("the first message must be hello")
        refusal = None
        if hello.get("v") != PROTOCOL_VERSION:
            refusal = error_reply("version", f"protocol version {hello.get('v')} not supported; "
                                             f"node speaks {PROTOCOL_VERSION}")
        else:
            check_request(hello)
            namespace, tenant = hello["ns"], hello["tenant"]
            credential = self.credentials.get(tenant)
            expected = None if credential is None else client_proof(credential.secret, nonce, hello["cnonce"],
                                                                    namespace, tenant)
            if credential is None or not proof_equals(expected, hello["proof"]):
                refusal = error_reply("auth", "credential proof rejected: wrong or missing token (or tenant secret)" + (
                    "" if tenant or self.local_credential is None
                    else f" (a node without a cluster token admits only clients that can read {local})"))
            elif namespace == ADMIN_NAMESPACE:
                if credential.name != CLUSTER:
                    refusal = error_reply("namespace", f"{ADMIN_NAMESPACE} needs the cluster credential")
            elif not credential.allows(namespace):
                refusal = error_reply("namespace", f"namespace {namespace!r} is not granted to this credential")
            elif self.config.namespaces is not None and namespace not in self.config.namespaces:
                refusal = error_reply("namespace", f"namespace {namespace!r} is not served by this node")
            elif (busy := self._admit_credential(peer, credential)) is not None:
                refusal = error_reply("busy", busy)  # the credential's connection cap: NodeBusy at connect
        if refusal is not None:
            self._count_error(refusal["code"])
            await conn.send_message(refusal, HANDSHAKE_TIMEOUT)
            return False
        peer.namespace = namespace
        peer.credential = credential
        peer.client_owner = f"client:{credential.name}:{hello['client']}"  # client ids are per credential
        self._client_conns[peer.client_owner] = self._client_conns.get(peer.client_owner, 0) + 1
        shm = None
        if hello["host"] == host_id() and namespace != ADMIN_NAMESPACE:
            shm = {"socket": self.handover.name, "access": credential.access, "control": self.control.name,
                   "ticket": self.handover.issue(peer.conn_owner, namespace, credential.can_write)}
        await conn.send_message(
            {
                "ok": True,
                "node": self.config.node_id,
                "epoch": self.epoch,
                "host": host_id(),
                "proof": node_proof(credential.secret, nonce, hello["cnonce"], self.config.node_id),
                "shm": shm,
                "peer_control": self.peer_control.port if self.peer_control is not None else None,
                "features": list(FEATURES),
                "limits": {"max_frame": MAX_FRAME, "max_keys": MAX_KEYS, "max_leaves": MAX_LEAVES,
                           "lease_ttl": self.config.lease_ttl, "read_ttl": self.config.read_ttl,
                           "max_leases": self.config.max_leases_per_client, "max_cost": self.config.max_cost,
                           # one connection's uncommitted reservations: a client splits bigger writes to fit
                           "max_reserved_bytes": self.store.max_reserved_bytes_per_owner,
                           "max_reserved_keys": self.store.max_reserved_keys_per_owner},
            },
            HANDSHAKE_TIMEOUT,
        )
        return True

    def _share_segment(self, namespace: str, writable: bool) -> int | None:
        segment = self.arena.segment(namespace)
        return segment.share(writable) if segment is not None else None

    def _segment_granted(self, conn_owner: str, writable: bool) -> None:
        peer = self._peers.get(conn_owner)
        if peer is not None and peer.shm is None:
            peer.shm = "write" if writable else "read"
            self.arena.hold(peer.namespace)  # not dropped while this connection may use it

    # ---- ops ----------------------------------------------------------------------------------

    async def _handle(self, peer: _Peer, request: dict[str, Any]) -> None:
        op = check_request(request)  # ProtocolError closes the connection
        if op == "hello":
            raise ProtocolError("hello sent twice")
        if peer.namespace == ADMIN_NAMESPACE and op != "stats":
            raise ProtocolError(f"the {ADMIN_NAMESPACE} namespace may only ask for stats")
        self.ops[op] = self.ops.get(op, 0) + 1
        observe = self.observe_request  # (None unless metrics are on: then each request is timed)
        started = time.perf_counter() if observe is not None else 0.0  # from a valid request to its reply sent
        uses: list[Use] | None = None  # the ended leases' stamps, when they are made after the reply
        try:
            if "ends" in request:  # leases the client loaded from on the same-host path (see dkv.wire)
                uses = self._end_used(peer, request["ends"])
                if op not in STAMPS_AFTER_REPLY or self._disk_worker is not None:
                    self._stamp_used(uses)
                    uses = None
            handler: Callable[[_Peer, dict[str, Any]], Any] = getattr(self, f"_op_{op}")
            try:
                if op in COSTED_OPS:
                    self._check_cost(request)  # before any work: one request must not stall the node
                self._authorise(peer, op, request)
                await handler(peer, request)
            except RemoteError as exc:
                self._count_error(exc.code)
                await peer.conn.send_message(error_reply(exc.code, exc.message), self.config.op_timeout)
            except ValueError as exc:
                self._count_error("invalid")
                await peer.conn.send_message(error_reply("invalid", str(exc)), self.config.op_timeout)
        finally:
            if observe is not None:
                observe(op, time.perf_counter() - started)
            if uses:
                self._stamp_used(uses)

    @staticmethod
    def _authorise(peer: _Peer, op: str, request: dict[str, Any]) -> None:
        """Refuse writes to a read-only credential, and the same-host path to a connection not handed its segment.

        ``shm`` is never taken on the client's word: only a connection that
        redeemed its ticket holds a mapping, and only a writable one may
        reserve slots for bytes it copies in itself.
        """
        assert peer.credential is not None
        if op in WRITE_OPS and not peer.credential.can_write:
            raise RemoteError("forbidden", f"credential {peer.credential.label!r} may only read")
        if request.get("shm") is True and (peer.shm is None or (op == "write" and peer.shm != "write")):
            raise RemoteError("shm", "this connection was not handed a writable mapping of its segment"
                              if peer.shm == "read" else "this connection was not handed its segment: "
                              "use the listener path (shm false)")

    async def _reply(self, peer: _Peer, **fields: Any) -> None:
        await peer.conn.send_message({"ok": True, **fields}, self.config.op_timeout)

    def _keys(self, peer: _Peer, raw_keys: list[list[Any]]) -> list[StoreKey]:
        return [StoreKey(peer.namespace, k[0], k[1], k[2]) for k in raw_keys]

    async def _op_lookup(self, peer: _Peer, req: dict[str, Any]) -> None:
        """Presence masks, and with ``lease`` a lease; spilled blocks are read back off the event loop first.

        A leased lookup that asks for its blocks' bytes (``send``, see
        :mod:`dkv.wire`) gets them after its answer when they come to at most
        that many bytes and ``max_lookup_payload``: a read of every leased
        block, which ends the lease (:meth:`_send_with_lookup`).
        """
        promoted = None
        if req["lease"] and self._disk_worker is not None:
            promoted = await self._disk_worker.promotions(peer.namespace, req["hashes"], req["leaves"], req["shards"])
        slot_map = {} if req["lease"] and req.get("slots") and peer.shm is not None else None  # same-host loads
        masks, lease = self.store.lookup(
            peer.namespace, req["hashes"], req["leaves"], req["shards"],
            owner=peer.client_owner if req["lease"] else None, group=req["group"], promoted=promoted,
            tenant=_tenant_of(peer), slots=slot_map,
        )
        extra = {}
        if lease is not None and slot_map:  # one round trip per load: where the leased blocks lie
            extra["slots"] = slot_map  # packed by the store: per leaf, a tuple msgpack sends as a list
        packed = _pack_masks(masks)
        if lease is not None and req.get("send") and not slot_map:
            read = self._read_to_send(peer, req, masks, lease.lease_id)
            if read is not None:
                await self._send_with_lookup(peer, read, bool(req.get("inline_sent")), masks=packed,
                                             lease=lease.lease_id, ttl=self.config.lease_ttl)
                return
        await self._reply(peer, masks=packed, lease=lease.lease_id if lease else None,
                          ttl=self.config.lease_ttl, **extra)

    def _read_to_send(self, peer: _Peer, req: dict[str, Any], masks: dict[str, list[bool]],
                      lease_id: int) -> ReadPlan | None:
        """A read of every block ``lease_id`` holds, in the order the client expects them; ``None`` when not sent.

        The order: leaf by leaf as asked, hash by hash where the leaf's mask
        is set, shard by shard. Not sent (the read ended again at once): more
        than ``send`` or ``max_lookup_payload`` bytes, more than
        ``MAX_LOOKUP_PAYLOAD_KEYS`` blocks, or a block stored without a
        checksum (the client could not check what it received).
        """
        limit = min(req["send"], self.config.max_lookup_payload)
        hashes, shards = req["hashes"], req["shards"]
        count = sum(map(sum, masks.values())) * shards
        if not limit or not count or count > MAX_LOOKUP_PAYLOAD_KEYS:
            return None
        if shards == 1 and self.store.leased_count(lease_id) == count:  # the lease's blocks are in the sent order
            return self.store.lease_into_read(lease_id, peer.client_owner, reader=peer.conn_owner, max_bytes=limit)
        if self.store.leased_bytes(lease_id) > limit:
            return None  # (a large lookup costs a sum of its blocks' sizes, not a read begun and ended)
        namespace = peer.namespace
        keys = [StoreKey(namespace, leaf, shard, h)
                for leaf in req["leaves"] for h in itertools.compress(hashes, masks[leaf]) for shard in range(shards)]
        read = self.store.begin_read(lease_id, peer.client_owner, keys, reader=peer.conn_owner)
        if sum(read.sizes) > limit or None in read.checksums:
            self.store.end_read(read.read_id)
            return None
        self.store.end_lease(lease_id)  # from here only the read's pins hold the slots, as a read that ends it
        return read

    async def _send_with_lookup(self, peer: _Peer, read: ReadPlan, inline: bool, **answer: Any) -> None:
        """The lookup's ``answer`` with what ``read`` sends (``sent``), then its blocks' bytes; the read ends here.

        With ``inline`` (the client made room for them, see :mod:`dkv.wire`)
        the bytes go in the answer's own UCX message where its body is
        inline (:meth:`Connection.send_message_with`); else as a read's
        payload messages after it. On a stream connection they follow the
        answer in the same write (the bytes are the same either way), and the
        answer tells no ``groups`` (a stream has no messages to cut).
        """
        try:
            conn = peer.conn
            if isinstance(conn, StreamConnection):  # no message boundaries: no cut to plan or tell (groups)
                slot, namespace = self.arena.slot, peer.namespace
                blocks = [slot(namespace, offset, size) for offset, size in zip(read.offsets, read.sizes) if size]
                await conn.send_message_with({"ok": True, **answer, "sent": {"sizes": read.sizes,
                                                                             "sums": read.checksums}},
                                             blocks, self.config.op_timeout)
                self.traffic["out"]["listener"] += sum(read.sizes)
                self.lookup_payloads += 1
                return
            plan, offsets, sizes = self._payload_plan(read)
            reply = {"ok": True, **answer, "sent": {"sizes": read.sizes, "sums": read.checksums,
                                                    "groups": plan_groups(plan)}}
            if inline and isinstance(conn, Connection):
                slot = self.arena.slot
                blocks = [slot(peer.namespace, offset, size) for offset, size in zip(offsets, sizes)]
                carried = await conn.send_message_with(reply, blocks, self.config.op_timeout)
            else:
                await conn.send_message(reply, self.config.op_timeout)
                carried = False
            if carried:
                self.traffic["out"]["listener"] += sum(sizes)
            else:
                await self._send_payloads(peer, plan, offsets, sizes)
            self.lookup_payloads += 1
        finally:
            self.store.end_read(read.read_id)

    def _end_used(self, peer: _Peer, lease_ids: Any) -> list[Use]:
        """End leases whose blocks the client copied itself (same-host loads); their stamps, for :meth:`_stamp_used`.

        A lease ``peer`` does not hold is skipped (see :meth:`Store.end_used_lease`).
        """
        store, owner, uses = self.store, peer.client_owner, []
        for lease_id in lease_ids:
            store.end_used_lease(lease_id, owner, uses)
        return uses

    def _stamp_used(self, uses: list[Use]) -> None:
        """Stamp the blocks of the leases :meth:`_end_used` ended as one use each; their bytes count as moved out locally."""
        self.traffic["out"]["local"] += sum(sum(map(_BLOCK_SIZE, blocks)) for blocks, _ in uses)  # (no Python step a block)
        self.store.stamp_uses(uses)

    async def _op_end(self, peer: _Peer, req: dict[str, Any]) -> None:
        """Carries ``ends`` for a client with nothing else to send (ended in :meth:`_handle`)."""
        await self._reply(peer)

    def _check_cost(self, req: dict[str, Any]) -> None:
        """Refuse a lookup, probe or touch over max_cost (hashes x leaves x shards) before any work starts."""
        cost = len(req["hashes"]) * len(req["leaves"]) * req["shards"]
        if cost > self.config.max_cost:
            raise RemoteError("too_costly", f"{len(req['hashes'])} hashes x {len(req['leaves'])} leaves x "
                                            f"{req['shards']} shards = {cost} exceeds the node's max_cost "
                                            f"({self.config.max_cost}): split the request")

    @staticmethod
    def _chunks(req: dict[str, Any]) -> list[range]:
        """Runs of ``req``'s hashes that each cost at most YIELD_COST (at least one hash each)."""
        per = max(1, YIELD_COST // (len(req["leaves"]) * req["shards"]))
        count = len(req["hashes"])
        return [range(start, min(start + per, count)) for start in range(0, count, per)] or [range(0)]

    async def _op_probe(self, peer: _Peer, req: dict[str, Any]) -> None:
        """Presence masks, a chunk at a time with other connections served in between (not atomic).

        With ``tiers`` the reply also says, per leaf, where each block lies
        (one byte a hash, :meth:`dkv.store.Store.tiers`); nothing is pinned or stamped.
        """
        hashes, leaves, shards = req["hashes"], req["leaves"], req["shards"]
        masks: dict[str, list[bool]] = {leaf: [] for leaf in leaves}
        tiers: dict[str, bytes] = {leaf: b"" for leaf in leaves}
        for i, run in enumerate(self._chunks(req)):
            if i:
                await asyncio.sleep(0)
            part = hashes[run.start:run.stop]
            for leaf, mask in self.store.presence(peer.namespace, part, leaves, shards).items():
                masks[leaf] += mask
            if req.get("tiers"):
                for leaf, row in self.store.tiers(peer.namespace, part, leaves, shards).items():
                    tiers[leaf] += row
        await self._reply(peer, masks=_pack_masks(masks), **({"tiers": tiers} if req.get("tiers") else {}))

    async def _op_touch(self, peer: _Peer, req: dict[str, Any]) -> None:
        """Stamp the held blocks a chunk at a time, deepest chunk first (so the root's is the newest use).

        Each chunk is one use, as when the client splits a touch: the chain
        still evicts deepest first and its root last. Other connections are
        served between chunks (not atomic).
        """
        hashes, leaves, shards = req["hashes"], req["leaves"], req["shards"]
        found = 0
        for i, run in enumerate(reversed(self._chunks(req))):
            if i:
                await asyncio.sleep(0)
            found += self.store.touch(peer.namespace, hashes[run.start:run.stop], leaves, shards)
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
        if ("keys" in req) == ("runs" in req):
            raise ProtocolError("read: name the blocks by 'keys' or by 'runs', exactly one")
        uses: list[Use] = []  # the read's stamp, made once its answer (and its payload) is on its way
        if "runs" in req:
            read = self.store.begin_read(req["lease"], peer.client_owner, runs=req["runs"], reader=peer.conn_owner,
                                         uses=uses)
        else:
            read = self.store.begin_read(req["lease"], peer.client_owner, self._keys(peer, req["keys"]),
                                         reader=peer.conn_owner, uses=uses)
        if req["end"]:
            self.store.end_lease(req["lease"])
        sizes, sums = read.sizes, read.checksums  # the client checks what it received against the sums
        if req["shm"]:
            try:
                await self._reply(peer, sizes=sizes, offsets=read.offsets, read=read.read_id, sums=sums)
            finally:
                self.store.stamp_uses(uses)
            self.traffic["out"]["local"] += sum(sizes)
            return  # the client copies from the shared arena, then sends done
        try:
            plan, offsets, held_sizes = self._payload_plan(read)
            await self._reply(peer, sizes=sizes, sums=sums, groups=plan_groups(plan))
            await self._send_payloads(peer, plan, offsets, held_sizes)
        finally:
            self.store.stamp_uses(uses)  # (while its pins hold: its blocks are still indexed)
            self.store.end_read(read.read_id)

    @staticmethod
    def _payload_plan(read: ReadPlan) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """How a listener read's blocks travel: its messages (back-to-back slots join), and the non-empty blocks' offsets and sizes."""
        sizes = read.sizes
        if all(sizes):
            offsets, held_sizes = read.offsets, sizes
        else:
            offsets = [o for o, n in zip(read.offsets, sizes) if n]
            held_sizes = [n for n in sizes if n]
        return payload_plan(held_sizes, offsets), offsets, held_sizes

    async def _send_payloads(self, peer: _Peer, plan: list[tuple[int, int]], offsets: list[int],
                             sizes: list[int]) -> None:
        """Send a listener read's blocks as ``plan`` cuts them, straight from their slots where they lie back to back."""
        buffers, counts = self._payload_buffers(peer.namespace, plan, offsets, sizes)
        await peer.conn.send_payloads(buffers, self.config.op_timeout, counts)
        self.traffic["out"]["listener"] += sum(sizes)

    def _payload_buffers(self, namespace: str, plan: list[tuple[int, int]], offsets: list[int],
                         sizes: list[int]) -> tuple[list[memoryview], list[int]]:
        """The buffers that send ``plan``'s messages, and how many of them each message takes.

        A message of slots that lie back to back is one view of the arena;
        one of slots apart is its slots' views (the transport gathers them).
        """
        slot = self.arena.slot
        buffers: list[memoryview] = []
        counts: list[int] = []
        for start, end in plan:
            last = end - 1
            if end - start == 1 or all(map(operator.eq, map(operator.add, offsets[start:last], sizes[start:last]),
                                           offsets[start + 1:end])):
                buffers.append(slot(namespace, offsets[start], offsets[last] + sizes[last] - offsets[start]))
                counts.append(1)
            else:
                buffers += [slot(namespace, offsets[i], sizes[i]) for i in range(start, end)]
                counts.append(end - start)
        return buffers, counts

    async def _op_done(self, peer: _Peer, req: dict[str, Any]) -> None:
        """A same-host client finished copying a read: drop its pins; ``intact`` says they held throughout."""
        read = self.store.reads.get(req["read"])
        intact = read is not None and read.owner == peer.conn_owner and self.store.end_read(req["read"])
        await self._reply(peer, intact=intact)

    async def _op_write(self, peer: _Peer, req: dict[str, Any]) -> None:
        keys = self._keys(peer, req["keys"])
        if len(keys) != len(req["sizes"]):
            raise ProtocolError("write: keys and sizes differ in length")
        sums = req.get("sums")  # optional: a client that declares no checksums (an old one) sends none
        if sums is not None and len(sums) != len(keys):
            raise ProtocolError("write: keys and checksums differ in length")
        res, statuses = self.store.reserve(peer.conn_owner, keys, req["sizes"], sums, tenant=_tenant_of(peer))
        if req["shm"]:
            await self._reply(peer, write=res.write_id, status=statuses, offsets=res.offsets)
            return  # the client copies into the reserved slots, then commits
        try:
            held = [(o, n) for o, n in zip(res.offsets, res.sizes) if n]
            groups = payload_groups([n for _, n in held], [o for o, _ in held])
            await self._reply(peer, write=res.write_id, status=statuses, groups=groups)
            slots = [self.arena.slot(peer.namespace, o, n) for o, n in held]
            await peer.conn.recv_payloads(slots, self.config.op_timeout, groups=groups)
        except BaseException:
            self.store.abort(res.write_id)  # the transport aborted the endpoint first: no late bytes
            raise
        await self._commit_write(peer, res.write_id, "listener")

    async def _op_commit(self, peer: _Peer, req: dict[str, Any]) -> None:
        await self._commit_write(peer, req["write"], "local")  # the client copied the bytes in itself

    async def _commit_write(self, peer: _Peer, write_id: int, path: str) -> None:
        """Commit a reservation, checking each declared checksum against its slot first; reply with the counts.

        With ``verify_writes`` a block whose bytes in the slot do not hash to
        what its writer declared is not committed (the store frees its slot
        and counts it): this is how a block is committed only when exactly its
        declared bytes arrived (UCX does not report a short message's length).
        The reply says ``committed`` and ``rejected``.
        """
        res = self.store.reservations.get(write_id)
        reserved = len(res.keys) if res is not None and res.owner == peer.conn_owner else 0
        verify = self._slot_matches if self.config.verify_writes else None
        committed = self.store.commit(write_id, peer.conn_owner, verify=verify)
        blocks = self.store.blocks
        self.traffic["in"][path] += sum(block.size for key in committed if (block := blocks.get(key)) is not None)
        rejected = reserved - len(committed)
        if rejected:
            log.warning("write %d from %s: %d block(s) did not match their declared checksum; not committed",
                        write_id, peer.conn.peer, rejected)
        await self._reply(peer, committed=len(committed), rejected=rejected)

    def _slot_matches(self, key: StoreKey, offset: int, size: int, checksum: bytes) -> bool:
        """True when the bytes in ``key``'s reserved slot hash to ``checksum`` (see :mod:`dkv.checksum`)."""
        data = self.arena.slot(key.namespace, offset, size) if size else b""
        return checksum_matches(key.leaf, key.shard, key.hash, data, checksum)

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
            "runtime": dict(self.runtime),  # the event loop it runs on and UCX's progress mode (dkv.event_loop)
            # its loop kept polling after back-to-back requests (dkv.stay_awake): the bound, and the turns polled
            "stay_awake": {"bound_us": round(self._awake.bound * 1e6), "polls": self._awake.polls},
            "host": {"free": host_free, "total": host_total, "used": host_total - host_free,
                     "segments": self.arena.segments, "free_resident": self.arena.resident_free,
                     "trims": self.arena.trims},
            "disk": {"free": disk_free, "total": disk_total, "used": disk_total - disk_free,
                     "state": store.disk_state()},  # "ok", "full", "missing", "failing" ("off": no tier)
            "blocks": len(store.blocks),
            "blocks_on_disk": store.blocks_off_host(),
            "staging": dict(zip(("blocks", "bytes"), store.staging_usage())),
            "leases": len(store.leases),
            "pinned_blocks": store.pinned_blocks,
            "reads": len(store.reads),
            "reservations": len(store.reservations),
            "handover": {"granted": self.handover.granted, "refused": self.handover.refused},
            "connections": self._connections(),
            "unauthenticated": len(self._authenticating),
            "reaped": dict(self.reaped),  # closed by the node: "idle" (idle timeout), "cap" (to admit another)
            # connections UCX left stuck after a malformed connection request, reset (dkv.stuck_connections)
            "stuck_connections_reset": self._listener.stuck_connections_reset if self._listener is not None else 0,
            "clients": len(self._client_conns),
            "ops": dict(self.ops),
            "lookups_with_payload": self.lookup_payloads,
            "bytes": {direction: dict(paths) for direction, paths in self.traffic.items()},  # by direction, path
            "errors": dict(self.errors_by_code),
            "counters": vars(store.counters).copy(),
            "cluster": self.presence.stats() if self.presence is not None else None,
            "limits": {"max_blocks": store.max_blocks, "max_leases": store.max_leases,
                       "max_reserved_bytes_per_connection": store.max_reserved_bytes_per_owner,
                       "reservation_ttl": store.reservation_ttl},
            # per credential that has used this node ("(cluster)": the cluster credential): holdings and quotas
            "tenants": {name or "(cluster)": usage for name, usage in store.tenant_stats().items()},
        }

    def _quotas_of(self, name: str) -> Quotas:
        """The quotas of credential ``name`` (the store resolves ``None`` fields to the node's defaults)."""
        credential = self.credentials.get(name)
        return credential.quotas if credential is not None else Quotas()


def _tenant_of(peer: _Peer) -> str:
    """The name of the credential ``peer`` authenticated with (``""``: the cluster credential)."""
    assert peer.credential is not None, "ops run only on authenticated connections"
    return peer.credential.name


def _pack_masks(masks: dict[str, list[bool]]) -> dict[str, bytes]:
    """Masks travel as one byte per hash (0 or 1): compact and cheap to build."""
    return {leaf: bytes(mask) for leaf, mask in masks.items()}


def _raise_descriptor_limit(wanted: int) -> None:
    """Raise this process's soft descriptor limit towards ``wanted`` (never past the hard limit).

    At the limit UCX can accept no connection: its listener then fails every
    accept and logs each failure, thousands of lines a second. So the node
    takes what its connection bound needs, within what the system allows,
    and says so once when that is too little.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.debug("cannot raise the descriptor limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning("descriptor limit %d (hard %s) is below the %d that --max-connections may need "
                    "(%d per connection): raise it (ulimit -n) or lower --max-connections",
                    soft, hard, wanted, DESCRIPTORS_PER_CONNECTION)


def _label(node_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in node_id)[:32]
