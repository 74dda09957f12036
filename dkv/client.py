"""Async client of a dKV node: handshake, a per-peer connection pool, timeouts, retries.

:class:`NodeClient` talks to one node. Connections are opened on demand up to
``pool_size`` and reused; a connection that saw a transport error is dropped.
Idempotent ops (lookup, probe, touch, release, stats) are retried with
jittered exponential back-off on transport errors; reads and writes are not
(the caller decides, since a read may have written part of its destination).

When the node runs on this machine, each connection trades the one-time
ticket of its handshake for a descriptor of *its own namespace's* segment
(:mod:`dkv.handover`; read-only for a read-only credential) and reads and
writes copy straight through that mapping, with the control messages on the
node's same-host control socket ("the same-host path"); otherwise block
bytes travel as UCX messages ("the listener path"), and the control requests
go over the node's TCP control socket where it announced one (lookups with
the few blocks they ask for, probes, touches, releases, lease ends).
``local=False`` forces the listener path.

The handshake is mutual (:func:`handshake`): the client proves its credential
(the cluster token, a tenant's secret, or a tokenless node's local credential
file) and checks the node's proof of the same credential, so an address that
merely appears in etcd cannot pose as a node (:class:`PeerUnauthenticated`).

Every public coroutine is bounded by ``timeout``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import operator
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from dkv.arena import SegmentMapping, align_up
from dkv.checksum import (CHECKSUM_SIZE, all_checksums, block_checksum, block_head, block_prefixes, is_checksum,
                          verify_prefixed)
from dkv.checksum import verify as checksum_matches
from dkv.copy_threads import ChunkedCopy, PostedCopy
from dkv.credentials import read_local_credential
from dkv.direct_channel import ChannelBusy, ChannelClosed, DirectChannel, PendingReply, PolledOutcome, RowsTarget
from dkv.errors import (
    AuthError,
    ChecksumMismatch,
    ConfigError,
    DKVError,
    OpTimeout,
    PeerUnauthenticated,
    ProtocolError,
    ReadNotIntact,
    RemoteError,
    TransportError,
    remote_error,
)
from dkv.hostid import host_id
from dkv.keys import (MAX_TP_SHARDS, BlockKey, check_hashes, check_leaf, check_namespace, check_shard,
                      plain_hashes)
from dkv.store import WRITE
from dkv.handover import redeem
from dkv.lease_slots import LeaseSlots, ReceivedBlocks, RowRun
from dkv.stream_channel import StreamConnection, connect_local, connect_tcp
from dkv.polling import REPLY_SPIN
from dkv.transport import (INLINE_MAX, TRAILING_MAX, Connection, connect, hold_transport, progress_now,
                           release_transport)
from dkv.units import parse_address
from dkv.wire import (
    FEATURE_PACKED_HASHES,
    FEATURE_READ_RUNS,
    HEADER_SIZE,
    MAX_FRAME,
    MAX_KEYS,
    MAX_ENDS,
    MAX_LEAVES,
    NONCE_SIZE,
    PACKED_HASH_OPS,
    PROTOCOL_VERSION,
    client_proof,
    packed_hashes,
    encode_body,
    node_proof,
    proof_equals,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_TIMEOUT = 10.0
# The limits a node announces in its handshake, and the wire's own bounds used when it names none.
# max_cost: hashes x leaves x shards of one lookup, probe or touch (a node that names none takes any).
WIRE_LIMITS = {"max_keys": MAX_KEYS, "max_frame": MAX_FRAME, "max_leaves": MAX_LEAVES,
               "max_cost": MAX_KEYS * MAX_LEAVES * MAX_TP_SHARDS,
               # a connection's uncommitted reservations (bytes of page-aligned slots, and keys)
               "max_reserved_bytes": 2**62, "max_reserved_keys": MAX_KEYS}
SMALL_REQUEST_KEYS = 1024  # this many keys (64-char leaves, 32-byte hashes) take under 128 KiB on the wire
SMALL_FRAME = 256 * 1024  # a node whose frames are at least this large takes them in one request
MAX_REMEMBERED_LEASES = 4096  # slot maps kept for loads to come (a lease past these loads in two steps)
# block bytes a client holds at most that nodes sent with lookups' answers and no load has taken yet
# (a lookup asks for no more than the room left; the oldest are dropped first, as slot maps are)
MAX_RECEIVED_BYTES = 64 << 20
LEASE_CLOCK_MARGIN = 0.5  # a same-host copy starts at least this long before the node's lease TTL runs out
END_FLUSH_DELAY = 0.05  # a loaded lease no lookup ended by then is ended by an ``end`` request of its own
_NO_CHECKSUM = bytes(CHECKSUM_SIZE)  # in place of a checksum the node did not name: no block's hashes to it
DIRECT_RETRY_AFTER = 1.0  # seconds before another attempt to open a direct channel (see NodeClient.want_direct)...
DIRECT_RETRY_MAX = 30.0  # ...doubled after each one that failed, up to this (a node at its connection cap, say)
# Direct channels a client opens at most to one node. The first opens when a lookup in place first wants one;
# each further one only when a lookup found every open channel busy (another handle's answer not yet read),
# one per DIRECT_RETRY_AFTER at most, so a scheduler that starts several lookups in a step gets each in place.
DIRECT_CHANNELS = 4
# Listener path: control requests (lookups, probes, touches, releases, ends) go over the node's TCP control socket,
# at most this many of its connections kept idle; one that fails to open sends them over UCX for
# CONTROL_RETRY_AFTER s (see NodeClient._control_usable)
CONTROL_POOL = 2
CONTROL_RETRY_AFTER = 30.0
FRAME_SLACK = 64  # bytes kept free in every estimated frame (array/map headers that grow with a count)
# A listener read checks each block as its message lands, and lets UCX progress after every this many
# bytes checked, so that the node's later messages keep moving meanwhile (UCX answers its rendezvous).
PROGRESS_EVERY_BYTES = 256 * 1024
CHECKSUM_WIRE_BYTES = CHECKSUM_SIZE + 2  # one checksum in a write request: msgpack bin8


@dataclass(frozen=True)
class NodeInfo:
    """What the node said in the handshake."""

    node_id: str
    epoch: str
    host: str
    limits: dict[str, Any]
    features: frozenset[str] = frozenset()  # what it serves beyond the base protocol (dkv.wire.FEATURES)

    @functools.cached_property
    def bounded_limits(self) -> dict[str, int]:
        """Every limit of :data:`WIRE_LIMITS`: the node's where it announced a usable one, never above the wire's.

        Worked out once per handshake (a lookup asks for several of them).
        """
        bounded = {}
        for name, default in WIRE_LIMITS.items():
            announced = self.limits.get(name)
            usable = isinstance(announced, int) and not isinstance(announced, bool) and announced > 0
            bounded[name] = min(announced, default) if usable else default
        return bounded

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> NodeInfo:
        """What a handshake ``reply`` says (a malformed ``features`` reads as none)."""
        features = reply.get("features")
        return cls(reply["node"], reply["epoch"], reply["host"], reply.get("limits", {}),
                   frozenset(f for f in features if isinstance(f, str)) if isinstance(features, list) else frozenset())


@dataclass(frozen=True)
class LookupResult:
    """Per-leaf presence masks, and the lease pinning them (``None`` for unleased lookups)."""

    masks: dict[str, list[bool]]
    lease_id: int | None
    # the node sent the leased blocks' bytes with the answer (see lookup's ``send``): this client holds them
    # for the lease's load, and the node ended the lease
    received: bool = False
    # of those, the blocks that failed their checksum: reported absent, nothing of them kept
    rejected: int = 0


class _SentBlocks:
    """The blocks a lookup's answer brings, as received: where each lies, and whether its checksum matched."""

    def __init__(self, lease_id: int, masks: dict[str, list[bool]], places: list[tuple[str, int]], shards: int,
                 hashes: Sequence[bytes], sizes: list[int], sums: list[Any], received: ReceivedBlocks,
                 views: list[memoryview]) -> None:
        self.lease_id, self.masks, self.places, self.shards, self.hashes = lease_id, masks, places, shards, hashes
        self.sizes, self.sums, self.received, self.views = sizes, sums, received, views
        self.verdicts = [False] * len(sizes)

    def check(self, start: int, stop: int) -> None:
        """Check blocks ``start``..``stop`` against their checksums (as each run lands, while the rest arrives)."""
        places, shards, hashes, views, sums, verdicts = (self.places, self.shards, self.hashes, self.views, self.sums,
                                                         self.verdicts)
        for k in range(start, stop):
            leaf, i = places[k // shards]
            verdicts[k] = checksum_matches(leaf, k % shards, hashes[i], views[k], sums[k])


@dataclass(frozen=True)
class WriteResult:
    """Per key: ``"write"`` (stored now), ``"exists"``, ``"busy"`` or ``"full"``."""

    statuses: list[str]

    @property
    def stored(self) -> int:
        return self.statuses.count(WRITE)


class _Session:
    """One handshaken connection, with the segment mapping it was handed (same-host path) if any."""

    def __init__(self, conn: Connection | StreamConnection | DirectChannel, info: NodeInfo,
                 mapping: SegmentMapping | None = None,
                 take_ends: Callable[[], list[int]] | None = None, *, control: bool = False) -> None:
        self.conn = conn
        self.info = info
        self.mapping = mapping
        self._take_ends = take_ends
        self.control = control  # over the node's TCP control socket: pooled apart (see NodeClient._control_usable)

    async def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request and its reply; it carries the leases its client loaded from since (``ends``)."""
        await self._send(message, timeout)
        return _check_reply(await self.conn.recv_message(timeout))

    async def request_with(self, message: dict[str, Any], room: int,
                           timeout: float) -> tuple[dict[str, Any], memoryview | None]:
        """:meth:`request` on a UCX connection, the reply received with room for ``room`` bytes after its body.

        Returns the reply and the bytes that followed its body in its message
        (:meth:`dkv.transport.Connection.recv_message_with`), or ``None``.
        """
        assert isinstance(self.conn, Connection)
        await self._send(message, timeout)
        reply, trailing = await self.conn.recv_message_with(room, timeout)
        return _check_reply(reply), trailing

    async def _send(self, message: dict[str, Any], timeout: float) -> None:
        message = on_the_wire(message, self.info)
        ends = self._take_ends() if self._take_ends is not None else None
        if ends:
            message = {**message, "ends": ends}
        await self.conn.send_message(message, timeout)


def on_the_wire(message: dict[str, Any], info: NodeInfo) -> dict[str, Any]:
    """``message`` as it is sent to the node ``info`` describes: a lookup's, probe's or touch's hashes packed where
    that node takes them so (:data:`dkv.wire.FEATURE_PACKED_HASHES`); else ``message`` itself.

    The caller keeps ``message`` (its ``hashes`` a list) to judge the answer by.
    """
    if message.get("op") in PACKED_HASH_OPS and FEATURE_PACKED_HASHES in info.features:
        packed = packed_hashes(message["hashes"])
        if packed is not None:
            return {**message, **packed}
    return message


@dataclass(frozen=True)
class _DirectLookup:
    """A leased lookup asked over the direct channel: what judging its answer needs."""

    direct: _Session
    channel: DirectChannel
    message: dict[str, Any]
    wire: dict[str, Any]  # the message as sent (its hashes packed where the node takes them so)
    mapping: SegmentMapping | None
    ends: list[int]
    sent_at: float


class PendingLookup(PolledOutcome):
    """A leased lookup sent over the direct channel, its answer read by :meth:`poll` (see :meth:`NodeClient.start_lookup_direct`).

    :meth:`poll` (any thread, never blocks) answers ``None`` until the
    answer is whole, then the :class:`LookupResult` (the same one every time
    after), judged and kept as :meth:`NodeClient.lookup_direct` does; it
    raises what that would raise, every time after too. :meth:`abort`
    settles it failed (the channel closed) unless it settled already.
    """

    def __init__(self, client: NodeClient, asked: _DirectLookup, pending: PendingReply) -> None:
        super().__init__()
        self._client = client
        self._asked = asked
        self._pending: PendingReply | None = pending  # let go of once judged: its buffer may hold the sent blocks

    def poll(self) -> LookupResult | None:
        """Any thread: the lookup's result once its answer is whole, else ``None``; raises the lookup's failure."""
        return super().poll()  # type: ignore[no-any-return]

    def abort(self) -> None:
        """Settle it failed, closing the channel (nothing once it settled)."""
        pending = self._pending
        if pending is not None:
            pending.abort()
        if self._asked.channel.closed:
            self._client._lost(self._asked.direct)  # noqa: SLF001 - the client's own session

    def _step(self) -> None:
        """Read what has arrived; once the answer is whole, judge it (as :meth:`NodeClient.lookup_direct` does)."""
        client, pending = self._client, self._pending
        assert pending is not None  # (unjudged)
        try:
            got = pending.poll()
        except Exception as exc:  # noqa: BLE001 - kept, raised by this poll and every later one
            client._direct_failed(self._asked, exc)  # noqa: SLF001
            self._failure, self._pending = exc, None
            return
        if got is None:
            return
        self._pending = None  # (the blocks it brought are the lease's now, kept by the client within its bound)
        try:
            self._outcome = client._direct_answer(self._asked, *got)  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001 - an error reply, or blocks that do not match the request
            self._failure = exc


async def handshake(conn: Connection, namespace: str, *, secret: bytes | None = None, tenant: str | None = None,
                    client_id: str = "raw", host: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """Run the client's side of the handshake on ``conn``; returns the node's accepting reply.

    ``secret`` is the cluster token, or ``tenant``'s secret; without one, a
    tokenless node's local credential is read from the file its challenge
    names (readable only on its host, by its OS user). The node must prove
    the same secret back: :class:`PeerUnauthenticated` otherwise.
    :class:`AuthError` when the node refuses us.
    """
    challenge = await conn.recv_message(timeout)
    if challenge.get("ok") is False:
        _check_reply(challenge)  # refused before any handshake: at a connection cap (NodeBusy)
    nonce = challenge.get("nonce")
    if challenge.get("t") != "challenge" or not isinstance(nonce, bytes):
        raise ProtocolError(f"{conn.peer} did not open with a dKV challenge")
    if secret is None and tenant is None and isinstance(challenge.get("local"), str):
        secret = read_local_credential(challenge["local"])
    cnonce = secrets.token_bytes(NONCE_SIZE)
    await conn.send_message(
        {"op": "hello", "v": PROTOCOL_VERSION, "ns": namespace, "client": client_id, "tenant": tenant,
         "cnonce": cnonce, "proof": client_proof(secret, nonce, cnonce, namespace, tenant),
         "host": host or host_id()},
        timeout,
    )
    reply = _check_reply(await conn.recv_message(timeout))
    node = reply.get("node")
    if secret is None or not isinstance(node, str) or not proof_equals(
            node_proof(secret, nonce, cnonce, node), reply.get("proof")):
        raise PeerUnauthenticated(f"{conn.peer} accepted us but could not prove the credential: "
                                  "not a node of this cluster")
    return reply


def _check_reply(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok") is True:
        return reply
    code, msg = reply.get("code"), reply.get("msg")
    if not isinstance(code, str) or not isinstance(msg, str):
        raise ProtocolError(f"malformed reply from node: {reply!r:.200}")
    raise remote_error(code, msg)


def _byte_view(buffer: Any) -> memoryview:
    """A flat writable/readable byte view of a buffer (numpy array, bytearray, CPU tensor...)."""
    if type(buffer) is memoryview and buffer.format == "B" and buffer.ndim == 1:  # already one (a row's)
        return buffer
    if hasattr(buffer, "numpy") and hasattr(buffer, "is_contiguous"):  # a CPU torch tensor
        buffer = buffer.numpy()
    return memoryview(buffer).cast("B")


class NodeClient:
    """Client of one dKV node for one namespace (see module docstring for the paths)."""

    def __init__(
        self,
        address: str,
        namespace: str,
        *,
        token: bytes | None = None,
        tenant: str | None = None,
        client_id: str | None = None,
        pool_size: int = 4,
        timeout: float = DEFAULT_TIMEOUT,
        local: bool | None = None,
        retries: int = 3,
        checksums: bool = True,
        reply_spin: float = REPLY_SPIN,
        direct_channels: int = DIRECT_CHANNELS,
    ) -> None:
        if direct_channels < 1:
            raise ConfigError(f"direct_channels must be at least 1, not {direct_channels}")
        self.host, self.port = parse_address(address)
        self.address = address
        self.namespace = check_namespace(namespace)
        self.token = token  # the cluster token, or with ``tenant`` that tenant's secret
        self.tenant = tenant
        self.client_id = client_id or secrets.token_hex(8)
        self.timeout = timeout
        self.local = local
        self.retries = retries
        self.checksums = checksums  # send each written block's checksum; check each read block against its own
        self.reply_spin = reply_spin  # seconds a direct channel polls for each reply before it sleeps on it
        self.direct_channels = direct_channels  # direct channels open to the node at most (see DIRECT_CHANNELS)
        self._pool_size = pool_size
        self._idle: list[_Session] = []
        self._control_idle: list[_Session] = []  # idle sessions over the node's TCP control socket (listener path)
        self._control_retry_at = 0.0  # none is opened before this: one failed to open (see _control_usable)
        self._sessions: set[_Session] = set()  # open connections, idle or in use
        self.lease_generation = 0  # moves on each time this client is left with no open connection
        self._open = 0
        self._slots = asyncio.Semaphore(pool_size)
        self._mapping: SegmentMapping | None = None  # this namespace's segment, shared by the sessions handed it
        self.info: NodeInfo | None = None
        self._closed = False
        self._holds_transport = False  # counted as a user of UCX from the first connection until close
        self._busy = 0  # sessions checked out of the pool
        self._control: tuple[str, NodeInfo] | None = None  # the node's control socket, once met over UCX
        # the node's TCP control port (listener path: its control requests and direct channel), once met over UCX
        self._peer_control: tuple[int, NodeInfo] | None = None
        # the lease book-keeping below and the set of sessions are shared with the thread that uses the
        # direct channel (lookup_direct), so they change under this lock
        self._lock = threading.Lock()
        self._group_leases: dict[int, int] = {}  # group -> its latest lease (bounded)
        # lease -> the hashes its lookup named, until its read: a read then names its blocks by place (bounded)
        self._lease_hashes: dict[int, tuple[Sequence[bytes], int]] = {}  # (and its shard count)
        self._lease_slots: dict[int, LeaseSlots] = {}  # same-host leases' slot maps, until their load (bounded)
        self._received_bytes = 0  # held in _lease_slots' received blocks (see MAX_RECEIVED_BYTES)
        self._ends: list[int] = []  # leases loaded from on the same-host path, to end with the next request
        self._flush_asked = False  # a flush of _ends is asked for and has not run (see end_later)
        self._directs: list[_Session] = []  # the direct channels opened (see open_direct), the first first
        self._direct_opening: asyncio.Future[bool] | None = None
        self._direct_tried_at = -DIRECT_RETRY_AFTER
        self._direct_retry_after = DIRECT_RETRY_AFTER  # doubled by each failed attempt in a row, reset by an open
        self._end_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Future[Any]] = set()  # owned: cancelled by close()
        self.fast_reads = 0  # reads served in one round trip (copied under the lookup's lease)
        self.lookups_with_payload = 0  # leased lookups answered with their blocks' bytes (see lookup's send)

    # ---- connection pool ------------------------------------------------------------------

    async def _open_session(self) -> _Session:
        """A new handshaken connection: over the node's control socket when it is on this host, else UCX.

        The control socket's name comes from an authenticated UCX handshake
        (:mod:`dkv.stream_channel`); from then on this client opens its
        connections there, until that fails once (the node restarted, say).
        """
        if self._control is not None:
            try:
                return await self._open_local_session(*self._control)
            except (DKVError, OSError) as exc:
                log.debug("control socket of %s: %s; back to UCX", self.address, exc)
                self._control = None
        if not self._holds_transport:
            hold_transport()
            self._holds_transport = True
        conn = await connect(self.host, self.port, min(self.timeout, 5.0))
        try:
            reply = await handshake(conn, self.namespace, secret=self.token, tenant=self.tenant,
                                    client_id=self.client_id, timeout=self.timeout)
            info = NodeInfo.from_reply(reply)
            mapping = await self._take_segment(reply.get("shm"), info)
        except BaseException:
            conn.abort()
            raise
        self.info = info
        session = _Session(conn, info, mapping, self._take_ends)
        port = reply.get("peer_control")
        if mapping is None and type(port) is int and 0 < port < 65536:  # noqa: E721 - (bool is no port)
            known = self._peer_control
            if known is None or (known[0], known[1].node_id, known[1].epoch) != (port, info.node_id, info.epoch):
                # another node, or one restarted: what failed against the last one is tried again at once
                self._control_retry_at = 0.0
                self._direct_tried_at, self._direct_retry_after = -DIRECT_RETRY_AFTER, DIRECT_RETRY_AFTER
            self._peer_control = (port, info)
        control = reply["shm"].get("control") if mapping is not None else None
        if isinstance(control, str):
            try:
                local = await self._open_local_session(control, info)
            except (DKVError, OSError) as exc:  # unreachable, or no room for one more connection (NodeBusy)
                log.debug("control socket of %s: %s; staying on UCX", self.address, exc)
                return session
            except BaseException:
                conn.abort()
                raise
            self._control = (control, info)
            conn.abort()  # its replacement is open, so the node keeps this client's leases
            return local
        return session

    async def _met_again(self, conn: StreamConnection, met: NodeInfo, what: str) -> tuple[dict[str, Any], NodeInfo]:
        """Handshake ``conn`` (a control socket ``what``) and check the node is the one ``met`` over UCX.

        The caller aborts ``conn`` on any failure.
        """
        reply = await handshake(conn, self.namespace, secret=self.token, tenant=self.tenant,
                                client_id=self.client_id, timeout=self.timeout)
        info = NodeInfo.from_reply(reply)
        if (info.node_id, info.epoch) != (met.node_id, met.epoch):
            raise TransportError(f"the {what} of {self.address} answers as another node")
        return reply, info

    async def _open_local_session(self, name: str, met: NodeInfo) -> _Session:
        """A session over the node's control socket ``name``; the node must be the one ``met`` over UCX."""
        conn = await connect_local(name, min(self.timeout, 2.0))
        try:
            reply, info = await self._met_again(conn, met, "control socket")
            mapping = await self._take_segment(reply.get("shm"), info)
            if mapping is None:
                raise TransportError("the control socket's session was not handed its segment")
        except BaseException:
            conn.abort()
            raise
        self.info = info
        return _Session(conn, info, mapping, self._take_ends)

    async def _open_peer_control_session(self, port: int, met: NodeInfo) -> _Session:
        """A session over the node's TCP control socket (same host as dialled, ``port``): control requests or the direct channel.

        The node must be the one ``met`` over UCX. No segment is taken (a
        same-host node may offer one: this session is the listener path's).
        """
        conn = await connect_tcp(self.host, port, min(self.timeout, 2.0))
        try:
            _, info = await self._met_again(conn, met, "TCP control socket")
        except BaseException:
            conn.abort()
            raise
        return _Session(conn, info, None, self._take_ends)

    async def _take_segment(self, offer: Any, info: NodeInfo) -> SegmentMapping | None:
        """Redeem the handshake's ticket for this namespace's segment (same-host path), or ``None``.

        With ``local=True`` a node that offers no segment, or a handover that
        fails, is a :class:`TransportError`; otherwise the connection takes
        the listener path.
        """
        if self.local is False:
            return None
        try:
            if info.host != host_id() or not isinstance(offer, dict):
                raise TransportError(f"{self.address} is not on this host")
            fd = await redeem(offer["socket"], offer["ticket"], min(self.timeout, 5.0))
            try:
                size = os.fstat(fd).st_size
                current = self._mapping
                if current is not None and current.identity == _identity(fd) and current.size == size:
                    return current
                mapping = SegmentMapping(fd, size, writable=offer.get("access") == "write")
            finally:
                os.close(fd)
        except (TransportError, OSError, ValueError, KeyError) as exc:
            if self.local is True:
                raise TransportError(f"the same-host path to {self.address} is unavailable: {exc}") from exc
            log.debug("listener path to %s: %s", self.address, exc)
            return None
        if self._mapping is not None:
            self._mapping.close()  # the node restarted: its old segment is gone (views in use keep it mapped)
        self._mapping = mapping
        return mapping

    async def _session_call(self, fn: Callable[[_Session], Awaitable[T]], control: bool = False) -> T:
        """``fn`` on a pooled session (one over the TCP control socket with ``control``, when one opens)."""
        if self._closed:
            raise TransportError("client is closed")
        try:
            async with asyncio.timeout(self.timeout):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise TransportError(f"no free connection to {self.address} within {self.timeout}s") from exc
        session = None
        self._busy += 1
        try:
            idle = self._control_idle if control else self._idle
            session = idle.pop() if idle else None
            if session is not None and session.conn.closed:
                session.conn.abort()  # closed by the peer while idle: still ours to release
                self._lost(session)
                session = None
            pooled = session is not None
            if session is None:
                session = await (self._open_control_session() if control else self._open_session())
                with self._lock:
                    self._sessions.add(session)
            try:
                result = await fn(session)
            except RemoteError:
                # an error reply leaves the stream in step: keep the connection (and the leases)
                self._return(session)
                session = None
                raise
            except TransportError as exc:
                if pooled and not isinstance(exc, OpTimeout):  # the node closed it while idle, unseen till now
                    raise _StalePooledConnection(str(exc)) from exc
                if isinstance(exc, OpTimeout) and not isinstance(exc, _Unanswered):
                    raise _Unanswered(str(exc)) from exc  # the node is hung: see _call
                raise
            self._return(session)
            session = None
            return result
        finally:
            if session is not None:
                session.conn.abort()
                self._lost(session)
            self._busy -= 1
            self._slots.release()
            if self._closed and not self._busy:
                await self._let_go_of_transport()  # the last call in flight when close() ran

    def _return(self, session: _Session) -> None:
        """Back to the pool; after :meth:`close` a session that comes back is closed instead."""
        if self._closed:
            session.conn.abort()
            self._lost(session)
        elif not session.conn.closed and not (session.control and len(self._control_idle) >= CONTROL_POOL):
            (self._control_idle if session.control else self._idle).append(session)
        else:
            session.conn.abort()  # closed by the peer: still ours to release
            self._lost(session)

    def _lost(self, session: _Session) -> None:
        """``session`` is closed; when it was this client's last, the node has ended the client's leases."""
        with self._lock:
            if session in self._sessions:
                self._sessions.discard(session)
                if not self._sessions:
                    self.lease_generation += 1

    def leases_lost_since(self, generation: int) -> bool:
        """True when the node may have ended every lease this client took at ``generation``.

        A node ends a client's leases when the client's last connection closes
        (and a restarted node holds none): that happened if the generation
        moved on, or if every connection this client has open is closed now.
        Safe from any thread (reads only).
        """
        if self.lease_generation != generation:
            return True
        sessions = tuple(self._sessions)
        return bool(sessions) and all(s.conn.closed for s in sessions)

    async def _call(self, fn: Callable[[_Session], Awaitable[T]], *, idempotent: bool, control: bool = False) -> T:
        """``fn`` on a pooled session, with the pool's retries; ``control``: a control request (see :meth:`_control_usable`)."""
        if control and not self._control_usable():
            control = False
        if not idempotent or self.retries <= 1:
            try:
                return await self._session_call(fn, control)
            except _StalePooledConnection:
                if not idempotent:
                    raise
                return await self._session_call(fn, control)  # once more, on a connection of its own: what any pool does
        try:  # the first attempt without the retry machinery (it costs more than a same-host round trip)
            return await self._session_call(fn, control)
        except _Unanswered:
            raise  # a connected node that did not answer in time is hung: asking again only waits as long again
        except TransportError:
            pass
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.retries - 1),
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception(_worth_retrying),
            before=_backoff_once,
            reraise=True,
        ):
            with attempt:
                return await self._session_call(fn, control)
        raise AssertionError("unreachable")

    async def _request(self, message: dict[str, Any], *, idempotent: bool, control: bool = False) -> dict[str, Any]:
        return await self._call(lambda s: s.request(message, self.timeout), idempotent=idempotent, control=control)

    def _control_usable(self) -> bool:
        """Whether control requests go over the node's TCP control socket (the listener path), not UCX.

        The node announced one (``peer_control``) in a UCX handshake, this
        client is not on the same-host path (whose every connection is a
        control socket already), and none failed to open in the last
        ``CONTROL_RETRY_AFTER`` s (a firewall, say: then UCX carries them).
        Lookups (with the blocks they ask for: ``send``), probes, touches,
        releases and lease ends go this way; reads and writes always take
        UCX, the data plane.
        """
        return (self._peer_control is not None and self._control is None
                and time.monotonic() >= self._control_retry_at)

    async def _open_control_session(self) -> _Session:
        """A pooled session over the node's TCP control socket; a UCX one (and no more tries for a while) if it fails."""
        if self._peer_control is not None:
            try:
                session = await self._open_peer_control_session(*self._peer_control)
            except (DKVError, OSError) as exc:
                self._control_retry_at = time.monotonic() + CONTROL_RETRY_AFTER
                log.debug("TCP control socket of %s: %s; control requests over UCX for %.0f s", self.address, exc,
                          CONTROL_RETRY_AFTER)
            else:
                session.control = True
                return session
        return await self._open_session()

    @staticmethod
    def _arena(session: _Session, *, write: bool = False) -> SegmentMapping | None:
        """The segment ``session`` was handed, when the same-host path applies (for writes: a writable one)."""
        mapping = session.mapping
        if mapping is None or (write and not mapping.writable):
            return None
        return mapping

    async def connect(self) -> NodeInfo:
        """Open one connection now (handshake errors surface here rather than on first use)."""
        await self._call(lambda s: asyncio.sleep(0), idempotent=False)
        assert self.info is not None
        return self.info

    def limit(self, name: str) -> int:
        """The node's announced limit ``name`` (a key of :data:`WIRE_LIMITS`), never above the wire's.

        Before the first handshake, or from a node that does not announce it,
        this is the wire's own bound (:data:`WIRE_LIMITS`).
        """
        return (WIRE_LIMITS if self.info is None else self.info.bounded_limits)[name]

    def _limits(self) -> dict[str, int]:
        """:meth:`limit` of every name at once."""
        return WIRE_LIMITS if self.info is None else self.info.bounded_limits

    async def _known_limits(self) -> None:
        """Handshake once if none happened yet, so that :meth:`limit` answers with the node's own limits."""
        if self.info is None:
            await self._call(lambda s: asyncio.sleep(0), idempotent=True)

    @property
    def uses_shared_memory(self) -> bool:
        """True once a connection of this client was handed its namespace's segment."""
        return self._mapping is not None

    # ---- ops ----------------------------------------------------------------------------------

    @staticmethod
    def _presence_fields(hashes: Sequence[bytes], leaves: Sequence[str], shards: int) -> dict[str, Any]:
        if not 1 <= shards <= 64:
            raise ValueError(f"shards must be in [1, 64], got {shards}")
        return {"hashes": check_hashes(hashes), "leaves": [check_leaf(x) for x in leaves], "shards": shards}

    def _fits_one_request(self, hashes: int, leaves: int, shards: int) -> bool:
        """True when a presence request of this many hashes, leaves and shards surely fits the node's limits as one."""
        limits = self._limits()
        return (leaves <= limits["max_leaves"] and hashes * leaves * shards <= limits["max_cost"]
                and _fits_without_estimate(hashes, limits))

    def _fits_without_estimate(self, keys: int) -> bool:
        """True when ``keys`` keys surely fit one request of this node (few keys, frames of usual size)."""
        return _fits_without_estimate(keys, self._limits())

    async def _presence_requests(self, op: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int,
                                 **extra: Any) -> list[tuple[range, dict[str, Any]]]:
        """The requests a presence op (lookup, probe, touch) takes within the node's limits.

        One per group of at most ``max_leaves`` leaves and run of hashes that
        fits ``max_keys``, ``max_frame`` (the request's frame and the masks of
        its reply) and ``max_cost`` (hashes x leaves x shards), in chain order;
        each with the range of ``hashes`` it covers. A leaf group is smaller
        than ``max_leaves`` when that many leaves of every shard would cost more
        than ``max_cost`` for a single hash; ``ValueError`` when one leaf does.
        """
        fields = self._presence_fields(hashes, leaves, shards)
        await self._known_limits()
        all_hashes, all_leaves = fields["hashes"], fields["leaves"]
        max_cost = self.limit("max_cost")
        if self._fits_one_request(len(all_hashes), len(all_leaves), shards):
            return [(range(len(all_hashes)), {"op": op, **fields, **extra})]  # far below any limit: no estimate
        if shards > max_cost:
            raise ValueError(f"{shards} shards exceed the node's max_cost ({max_cost}) for a single hash of one leaf")
        hash_bytes = 2 + max((len(h) for h in all_hashes), default=0)  # msgpack bin8: 2 header bytes
        max_leaves = min(self.limit("max_leaves"), max_cost // shards)
        requests = []
        for start in range(0, max(len(all_leaves), 1), max_leaves):
            group = all_leaves[start:start + max_leaves]
            base = {"op": op, "hashes": [], "leaves": group, "shards": shards, **extra}
            request_fixed = len(encode_body(base))
            reply_fixed = sum(len(leaf.encode()) + 8 for leaf in group) + 32  # masks: leaf -> bin32 of one byte a hash
            max_count = min(self.limit("max_keys"), max_cost // (max(len(group), 1) * shards))
            runs = chunk_ranges(len(all_hashes), max_count=max_count, max_bytes=self.limit("max_frame"),
                                item_bytes=max(hash_bytes, len(group)),
                                fixed_bytes=max(request_fixed, reply_fixed) + FRAME_SLACK)
            requests += [(run, {**base, "hashes": all_hashes[run.start:run.stop]}) for run in runs]
        return requests

    async def _presence(self, requests: Sequence[tuple[range, dict[str, Any]]]) -> list[dict[str, Any]]:
        """Send ``requests`` one after the other (each retried on its own); their replies, in order."""
        return [await self._request(message, idempotent=True, control=True) for _, message in requests]

    async def lookup(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1, *,
                     lease: bool = True, group: int = 0, send: int = 0) -> LookupResult:
        """Presence per leaf; with ``lease``, the node pins what it reports (ends the previous lease of ``group``).

        A leased lookup is one request (one lease): more hashes than the node's
        ``max_keys``, more leaves than its ``max_leaves``, or a request over its
        ``max_frame`` is refused with ``ValueError`` before anything is sent.
        An unleased one is split like :meth:`probe`.

        ``send``: on the listener path, with checksums on, ask the node to
        send the leased blocks' bytes with its answer when they come to at
        most this many (and the room left of ``MAX_RECEIVED_BYTES``). Each is
        checked against its checksum as it lands and kept for the lease's
        :meth:`read`, which then copies them with no request. A block that
        fails is reported absent (its hash, in its leaf: presence needs every
        shard), counted in the result's ``rejected`` and logged; the node
        ended the lease when it sent them. The node decides: a lease it did
        not send with is read the two-step way. See :mod:`dkv.wire`.
        """
        extra = {"send": send} if lease and send > 0 else {}
        requests = await self._presence_requests("lookup", hashes, leaves, shards, lease=lease, group=group, **extra)
        if lease and len(requests) > 1:
            raise ValueError(self._unsplittable("a leased lookup", len(hashes), len(leaves), shards))
        if lease:
            return await self._call(lambda session: self._leased_lookup(session, requests[0][1]), idempotent=True,
                                    control=True)
        masks: dict[str, list[bool]] = {}
        lease_id = None
        for (run, _), reply in zip(requests, await self._presence(requests)):
            _merge_masks(masks, _unpack_masks(reply["masks"], len(run)))
            lease_id = reply.get("lease")
        return LookupResult(masks, lease_id)

    async def _leased_lookup(self, session: _Session, message: dict[str, Any]) -> LookupResult:
        """One leased lookup on ``session``; on the same-host path it also learns where the blocks lie.

        Where the node sends the blocks' bytes with its answer, they are received here.
        """
        message, mapping = self._leased_request(session, message)
        sent_at = time.monotonic()
        trailing = None
        if message.get("inline_sent"):
            reply, trailing = await session.request_with(message, message["send"], self.timeout)
        else:
            reply = await session.request(message, self.timeout)
        if "sent" in reply:
            return await self._receive_sent(session, message, reply, trailing)
        if trailing is not None:
            session.conn.abort()
            raise ProtocolError("a lookup's answer carried block bytes it did not name")
        return self._leased_answer(message, mapping, reply, sent_at)

    def _leased_request(self, session: _Session, message: dict[str, Any]) -> tuple[dict[str, Any], SegmentMapping | None]:
        """A leased lookup's request on ``session``, and the mapping its slot map will point into (if it asks for one).

        The group's previous lease ends with this lookup on the node, so its
        slot map is forgotten here: its load must be refused, not copied.
        Bytes sent with the answer (``send``) are asked for only where no
        slot map is, with checksums on, within the room left of
        ``MAX_RECEIVED_BYTES``.
        """
        mapping = self._arena(session)
        if mapping is None or not self.checksums:  # copies are proven by their checksums: see dkv.lease_slots
            mapping = None
        else:
            message = {**message, "slots": True}
        with self._lock:
            previous = self._group_leases.pop(message["group"], None)
            if previous is not None:  # (the node ends it with this lookup: its load is refused, not copied or read)
                self._forget_slots_locked(previous)
                self._lease_hashes.pop(previous, None)
            room = MAX_RECEIVED_BYTES - self._received_bytes
        if "send" in message:
            distinct = len(set(message["leaves"])) == len(message["leaves"])  # (the blocks' order names each once)
            send = min(message["send"], room) if mapping is None and self.checksums and distinct else 0
            message = {k: v for k, v in message.items() if k not in ("send", "inline_sent")}
            if send > 0:
                message["send"] = send
                # in the answer's own message, where the receive's whole buffer fits the room left
                if (isinstance(session.conn, Connection) and send <= TRAILING_MAX
                        and _answer_buffer(send) <= room):
                    message["inline_sent"] = True
        return message, mapping

    async def _receive_sent(self, session: _Session, message: dict[str, Any], reply: dict[str, Any],
                            trailing: memoryview | None = None) -> LookupResult:
        """A leased lookup answered with its blocks' bytes: receive and check them, keep them for the lease's load.

        The reply's ``sent`` is checked against the request (one size and
        checksum per leased block, no more bytes than asked for) before a
        receive is posted; :class:`ProtocolError` otherwise, with the
        connection aborted (the node's payload would have nothing to meet it).
        ``trailing``: the bytes that came in the answer's own message (then
        exactly the blocks' total, and nothing more is received). A block
        that fails its checksum is reported absent (see :meth:`lookup`).
        """
        blocks = self._sent_blocks(session, message, reply, trailing)
        if trailing is None:
            sizes = blocks.sizes
            await session.conn.recv_payloads(blocks.views, self.timeout, blocks.check, reply["sent"].get("groups"))
            if 0 in sizes:  # an empty block travels in no message: checked here
                blocks.check(0, len(sizes))
        else:
            blocks.check(0, len(blocks.sizes))
        return self._keep_sent(message, blocks)

    def _sent_blocks(self, session: _Session, message: dict[str, Any], reply: dict[str, Any],
                     trailing: memoryview | None) -> _SentBlocks:
        """The blocks a lookup's ``reply`` says it sends, checked against the request; views into their buffer.

        The buffer is ``trailing`` (the bytes already received with the
        answer: then exactly the blocks' total) or a new one for a receive to
        fill. :class:`ProtocolError`, with the connection aborted, where
        they do not match the request (see :meth:`_receive_sent`).
        """
        hashes, shards, leaves = message["hashes"], message["shards"], message["leaves"]
        masks = _unpack_masks(reply["masks"], len(hashes))
        lease_id = reply.get("lease")
        sent = reply["sent"]
        sizes = sent.get("sizes") if isinstance(sent, dict) else None
        sums = sent.get("sums") if isinstance(sent, dict) else None
        if set(masks) == set(leaves):
            masks = {leaf: masks[leaf] for leaf in leaves}  # the order the blocks come in
            places = [(leaf, i) for leaf in leaves for i in itertools.compress(range(len(hashes)), masks[leaf])]
        else:
            places = []
        count = len(places) * shards
        if (lease_id is None or not places or not isinstance(sizes, list) or not isinstance(sums, list)
                or len(sizes) != count or len(sums) != count or not _byte_counts(sizes)
                or not all_checksums(sums) or sum(sizes) > message.get("send", 0)
                or (trailing is not None and len(trailing) != sum(sizes))):
            session.conn.abort()
            raise ProtocolError("a lookup's answer names blocks it sends that do not match the request")
        if trailing is None:
            whole = memoryview(bytearray(sum(sizes)))
            held = len(whole)
        else:  # (the receive's whole buffer is held while its bytes are: room for the most the request asked)
            whole = trailing
            held = memoryview(trailing.obj).nbytes if trailing.obj is not None else len(trailing)
        views, at = [], 0
        for size in sizes:
            views.append(whole[at:at + size])
            at += size
        return _SentBlocks(lease_id, masks, places, shards, hashes, sizes, sums, ReceivedBlocks(whole, held), views)

    def _keep_sent(self, message: dict[str, Any], blocks: _SentBlocks) -> LookupResult:
        """The lookup's answer once its sent blocks were checked: failed ones reported absent, the rest kept for the load."""
        hashes, masks, places, shards, verdicts = blocks.hashes, blocks.masks, blocks.places, blocks.shards, blocks.verdicts
        slots = LeaseSlots.received_with_lookup(blocks.received, hashes, shards, masks, blocks.sizes, blocks.sums,
                                                verdicts)
        rejected = verdicts.count(False)
        if rejected:
            for k in itertools.compress(range(len(verdicts)), map(operator.not_, verdicts)):
                leaf, i = places[k // shards]
                masks[leaf][i] = False
            leaf, i = places[verdicts.index(False) // shards]
            log.warning("%d of %d block(s) %s sent with a lookup's answer do not match their checksum (first: "
                        "leaf %r, hash %s): corrupted or substituted, reported absent", rejected, len(verdicts),
                        self.address, leaf, hashes[i].hex())
        with self._lock:
            self.lookups_with_payload += 1
        self._remember_slots(blocks.lease_id, message["group"], slots)
        return LookupResult(masks, blocks.lease_id, received=True, rejected=rejected)

    def _leased_answer(self, message: dict[str, Any], mapping: SegmentMapping | None, reply: dict[str, Any],
                       sent_at: float) -> LookupResult:
        """What a leased lookup's ``reply`` says; a slot map it carries is kept for the lease's load."""
        masks = _unpack_masks(reply["masks"], len(message["hashes"]))
        lease_id = reply.get("lease")
        if lease_id is None:
            return LookupResult(masks, None)
        slots = None
        if mapping is not None and "slots" in reply:  # (parsed before the lock is taken)
            ttl = float(reply.get("ttl") or 0.0)
            slots = LeaseSlots(mapping, message["hashes"], message["shards"], reply["slots"],
                               live_until=sent_at + ttl - LEASE_CLOCK_MARGIN)
        with self._lock:
            self._remember_lease_locked(lease_id, message["group"], (message["hashes"], message["shards"]))
            if slots is not None:
                self._keep_slots_locked(lease_id, slots)
        return LookupResult(masks, lease_id)

    def _remember_slots(self, lease_id: int, group: int, slots: LeaseSlots) -> None:
        """Keep a lease's slot map for its load (bounded: the oldest are forgotten, their loads take two steps)."""
        with self._lock:
            self._remember_lease_locked(lease_id, group)
            self._keep_slots_locked(lease_id, slots)

    def _keep_slots_locked(self, lease_id: int, slots: LeaseSlots) -> None:
        """Under ``_lock``: :meth:`_remember_slots` without the lease's group (the caller remembered it)."""
        self._forget_slots_locked(lease_id)
        self._lease_slots[lease_id] = slots
        if slots.received:
            self._received_bytes += slots.mapping.held
        while len(self._lease_slots) > MAX_REMEMBERED_LEASES or self._received_bytes > MAX_RECEIVED_BYTES:
            self._forget_slots_locked(next(iter(self._lease_slots)))

    def _remember_lease_locked(self, lease_id: int, group: int,
                               looked_up: tuple[Sequence[bytes], int] | None = None) -> None:
        """Under ``_lock``: ``lease_id`` is ``group``'s latest lease; ``looked_up`` (its lookup's hashes and shard
        count) is kept for its read.

        Bounded (the oldest are forgotten: a read of such a lease names its keys).
        """
        self._group_leases[group] = lease_id
        while len(self._group_leases) > MAX_REMEMBERED_LEASES:
            self._group_leases.pop(next(iter(self._group_leases)))
        if looked_up is not None:
            self._lease_hashes[lease_id] = looked_up
            while len(self._lease_hashes) > MAX_REMEMBERED_LEASES:
                self._lease_hashes.pop(next(iter(self._lease_hashes)))

    def _forget_slots_locked(self, lease_id: int) -> LeaseSlots | None:
        """Under ``_lock``: take ``lease_id``'s slot map out of the book (its received bytes no longer count)."""
        slots = self._lease_slots.pop(lease_id, None)
        if slots is not None and slots.received:
            self._received_bytes -= slots.mapping.held
        return slots

    # ---- the direct channel (leased lookups on the calling thread) ----------------------------------

    @property
    def _direct(self) -> _Session | None:
        """The first direct channel opened that is still open (``None``: none is)."""
        return next((d for d in self._directs if not d.conn.closed), None)

    @property
    def direct_ready(self) -> bool:
        """Any thread: True while a direct channel is open (:meth:`lookup_direct` may use it). Never reads the socket."""
        return any(not d.conn.closed for d in self._directs)

    @property
    def direct_open(self) -> int:
        """Any thread: how many direct channels are open now (at most ``direct_channels``). Never reads a socket."""
        return sum(1 for d in self._directs if not d.conn.closed)

    @property
    def direct_possible(self) -> bool:
        """Any thread: True when :meth:`want_direct` would start opening a channel now (a cheap check: no I/O).

        Only where the node announced a control socket this client may use:
        its same-host one on the same-host path, its TCP one
        (``peer_control``) on the listener path. With checksums (a direct
        lookup's slot map, and the blocks it may bring, are proven by them),
        with fewer than ``direct_channels`` open and none opening, and no
        attempt in the last ``DIRECT_RETRY_AFTER`` s (twice that after a
        failed attempt, and so on up to ``DIRECT_RETRY_MAX``).
        """
        return (not self._closed and (self._control is not None or self._peer_control is not None)
                and self.checksums and self.direct_open < self.direct_channels
                and self._direct_opening is None
                and time.monotonic() - self._direct_tried_at >= self._direct_retry_after)

    def want_direct(self) -> None:
        """Loop thread: open one more direct channel in the background when :attr:`direct_possible` (else nothing).

        Asked for when a lookup in place finds no channel open, or finds
        every open one busy (each holds a handle whose answer is not read
        yet): the channels grow one at a time, up to ``direct_channels``.

        The attempt is owned (cancelled by :meth:`close`); its failure is
        logged at debug level and doubles the wait before the next attempt
        (``DIRECT_RETRY_AFTER`` at first, at most ``DIRECT_RETRY_MAX``): a node
        that refuses it (at its connection cap, say) is not asked for a
        handshake every second by every client calling ``lookup()``.
        """
        if not self.direct_possible:
            return
        self._direct_opening = task = asyncio.ensure_future(self.open_direct(another=True))
        self._background.add(task)

        def opened(done: asyncio.Future[bool]) -> None:
            self._background.discard(done)
            self._direct_opening = None
            if not done.cancelled() and done.exception() is not None:
                self._direct_retry_after = min(2 * self._direct_retry_after, DIRECT_RETRY_MAX)
                log.debug("direct channel to %s: %s (next attempt in %.0f s at the earliest)", self.address,
                          done.exception(), self._direct_retry_after)

        task.add_done_callback(opened)

    async def open_direct(self, *, another: bool = False) -> bool:
        """Loop thread: open a direct channel now, unless one is open; True when one is open after.

        ``another``: open one more even where one is open, while fewer than
        ``direct_channels`` are (True when it opened one; False at the cap).

        It is one more connection over the node's control socket (same-host
        path) or its TCP one (listener path), with the same handshake and the
        same client id (so the node counts it among this client's
        connections: its leases stay this client's, and end only when the
        last of them closes) and, same-host, the same segment, then taken
        off the loop (:class:`dkv.direct_channel.DirectChannel`). With
        checksums only. Raises what opening a connection raises
        (:class:`~dkv.errors.NodeBusy` at the node's connection cap, say).
        """
        if self.direct_ready and not another:
            return True
        self._forget_closed_directs()
        if len(self._directs) >= self.direct_channels:
            return False
        self._direct_tried_at = time.monotonic()
        if self._closed or not self.checksums:
            return False
        if self._control is not None:
            session = await self._open_local_session(*self._control)
        elif self._peer_control is not None:
            session = await self._open_peer_control_session(*self._peer_control)
        else:
            return False
        conn = session.conn
        if self._closed or not isinstance(conn, StreamConnection) or self.direct_open >= self.direct_channels:
            conn.abort()  # (another open reached the cap meanwhile)
            return self.direct_ready and not another and not self._closed
        channel = DirectChannel(conn.detach(), conn.peer, max_frame=conn.max_frame, spin=self.reply_spin)
        direct = _Session(channel, session.info, session.mapping)
        with self._lock:
            self._sessions.add(direct)
        self._forget_closed_directs()
        self._directs = [*self._directs, direct]  # (a new list: the calling thread reads it without the lock)
        self._direct_retry_after = DIRECT_RETRY_AFTER
        return True

    def _forget_closed_directs(self) -> None:
        """Loop thread: drop the direct channels that closed (each failed exchange closes its own)."""
        closed = [d for d in self._directs if d.conn.closed]
        if closed:
            self._directs = [d for d in self._directs if not d.conn.closed]
            for direct in closed:
                self._lost(direct)

    def lookup_direct(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1, *,
                      group: int = 0, send: int = 0) -> LookupResult:
        """Calling thread: a leased :meth:`lookup` over the direct channel, one blocking round trip within ``timeout``.

        It answers as :meth:`lookup` would (the same request, the same
        checks of the reply), keeps the lease's slot map for its load the same
        way, and carries the loaded leases to end (``ends``) as any request
        does. ``send`` as :meth:`lookup`'s: on the listener path the blocks
        come right after the answer on the channel's stream, checked and
        kept the same way. It raises :class:`~dkv.direct_channel.ChannelClosed` or
        :class:`~dkv.direct_channel.ChannelBusy` when the node did not see
        the request (no channel, another thread on it, the node closed it, or
        one larger than this path sends: see :meth:`_fits_one_request`), so
        the caller may ask :meth:`lookup` on the loop instead. Any other error
        is the exchange's or the lookup's own: a :class:`~dkv.errors.TransportError`
        (the connection failed mid-exchange: the node may have seen the
        request; a leased lookup is idempotent, so asking again is safe),
        :class:`~dkv.errors.OpTimeout` (the node is hung), a
        :class:`~dkv.errors.ProtocolError` or a :class:`~dkv.errors.RemoteError`.
        """
        asked = self._direct_lookup(hashes, leaves, shards, group, send)
        try:
            reply, payload = asked.channel.exchange_with(asked.wire, self.timeout, asked.message.get("send", 0))
        except BaseException as exc:
            self._direct_failed(asked, exc)
            raise
        return self._direct_answer(asked, reply, payload)

    def start_lookup_direct(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1, *,
                            group: int = 0, send: int = 0) -> PendingLookup:
        """Calling thread: :meth:`lookup_direct` split in two: the request is sent now, the answer read by polling.

        The same request, answer, checks and errors as :meth:`lookup_direct`
        (:class:`~dkv.direct_channel.ChannelClosed` and
        :class:`~dkv.direct_channel.ChannelBusy` from here: nothing was
        sent), but nothing waits for the answer: :meth:`PendingLookup.poll`
        reads what has arrived, never blocking, and answers once it is whole
        (see :class:`dkv.direct_channel.PendingReply`, which holds the channel
        meanwhile).
        """
        asked = self._direct_lookup(hashes, leaves, shards, group, send)
        try:
            pending = asked.channel.begin(asked.wire, self.timeout, asked.message.get("send", 0))
        except BaseException as exc:
            self._direct_failed(asked, exc)
            raise
        return PendingLookup(self, asked, pending)

    def _direct_lookup(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int, group: int,
                       send: int) -> _DirectLookup:
        """A leased lookup's request for a direct channel not in use, with the loaded leases it ends (see :meth:`lookup_direct`).

        :class:`~dkv.direct_channel.ChannelClosed` where no channel is open,
        :class:`~dkv.direct_channel.ChannelBusy` where every open one is in use.
        """
        direct, channel = self._free_direct()
        fields = self._presence_fields(hashes, leaves, shards)
        if not self._fits_one_request(len(fields["hashes"]), len(fields["leaves"]), shards):
            raise ChannelBusy("a lookup near the node's limits is sized on the loop")
        extra = {"send": send} if send > 0 else {}
        message, mapping = self._leased_request(direct, {"op": "lookup", **fields, "lease": True, "group": group,
                                                         **extra})
        ends = self._take_ends()
        if ends:
            message["ends"] = ends
        return _DirectLookup(direct, channel, message, on_the_wire(message, direct.info), mapping, ends,
                             time.monotonic())

    def _free_direct(self) -> tuple[_Session, DirectChannel]:
        """A direct channel not in use: :class:`~dkv.direct_channel.ChannelClosed` where none is open,
        :class:`~dkv.direct_channel.ChannelBusy` where every open one is in use."""
        busy = False
        for session in self._directs:
            conn = session.conn
            if isinstance(conn, DirectChannel) and not conn.closed:
                if not conn.in_use:
                    if self._closed:
                        break
                    return session, conn
                busy = True
        if busy and not self._closed:
            raise ChannelBusy(f"every direct channel to {self.address} is in use")
        raise ChannelClosed(f"no direct channel to {self.address}")

    @property
    def direct_free(self) -> bool:
        """Any thread: True while an open direct channel is not in use (a hint: it may be taken first). No I/O."""
        return not self._closed and any(isinstance(d.conn, DirectChannel) and not d.conn.closed and not d.conn.in_use
                                        for d in self._directs)

    def read_rows_direct(self, lease_id: int, runs: Sequence[RowRun], answered: Callable[[], None] | None = None) -> None:
        """Any thread but the loop: :meth:`read` of ``runs`` over a direct channel, their blocks received into the rows natively.

        One request (``end``: the read ends the lease on the node) on a direct
        channel not in use; the node answers with the blocks' sizes and
        checksums and sends their bytes after it on the same stream, which
        :meth:`dkv.direct_channel.DirectChannel.exchange_into_rows` receives
        straight into the rows, hashing each block as it lands, without the
        GIL. ``answered()`` is called once the node's answer is in (it began
        the read: the lease is the read's). Blocks of one size, checksums on,
        a request that fits one frame; ``runs`` name no row twice. Raises
        :class:`~dkv.direct_channel.ChannelBusy` or
        :class:`~dkv.direct_channel.ChannelClosed` when the node did not see
        the request (the caller may read the usual way: the lease is as it
        was); otherwise as :meth:`read` does
        (:class:`~dkv.errors.ChecksumMismatch`: the rows hold garbage), or with
        a :class:`~dkv.errors.TransportError` or
        :class:`~dkv.errors.OpTimeout` where the channel failed (the lease may
        have ended with the request).
        """
        count = sum(len(run.hashes) for run in runs)
        if not self.checksums or not count or not self._fits_without_estimate(count):
            raise ChannelBusy("this read is not one for a direct channel: read it the usual way")
        direct, channel = self._free_direct()
        with self._lock:
            looked_up = self._lease_hashes.get(lease_id)
        places = _run_places(runs, *looked_up) if looked_up is not None else None
        named = ({"runs": places} if places is not None and FEATURE_READ_RUNS in direct.info.features
                 else {"keys": _run_wire_keys(runs)})
        message: dict[str, Any] = {"op": "read", "lease": lease_id, **named, "end": True, "shm": False}
        ends = self._take_ends()
        if ends:
            message["ends"] = ends
        unsummed = [0]  # blocks the node named no checksum for (they fail)
        rows_bytes: list[int] = []  # each block's size, in the stream's order
        for run in runs:
            rows_bytes += [run.row_bytes] * len(run.hashes)

        def expect(reply: dict[str, Any]) -> tuple[list[RowsTarget], bytes] | None:
            if reply.get("ok") is False:
                return None  # (judged below)
            sizes = reply.get("sizes")
            if not isinstance(sizes, list) or len(sizes) != count:
                raise ProtocolError("read reply names a different number of blocks")
            if sizes != rows_bytes:
                raise ProtocolError("read reply names blocks of other sizes than their rows'")
            if answered is not None:
                answered()
            named = _sums_for(reply.get("sums"), count)
            if all_checksums(named):  # (a node's usual answer: checked in C-speed passes)
                sums = b"".join(named)
            else:
                unsummed[0] = sum(1 for s in named if not is_checksum(s))
                sums = b"".join(s if is_checksum(s) else _NO_CHECKSUM for s in named)
            return [RowsTarget(run.rows, run.row_bytes, run.ids,
                               block_head(run.leaf, run.shard, run.row_bytes, len(run.hashes[0])), run.hashes)
                    for run in runs if run.hashes], sums

        sent = True  # (the node may have seen the read: the lease is the read's, or ended with it)
        try:
            reply, verdicts = channel.exchange_into_rows(message, self.timeout, expect)
        except BaseException as exc:
            sent = not isinstance(exc, (ChannelClosed, ChannelBusy))
            if ends and not sent:
                with self._lock:
                    self._ends[:0] = ends  # the node never saw them: the next request carries them
            if channel.closed:
                self._lost(direct)
            raise
        finally:
            if sent:  # what was kept for the lease's load: its read is this one, however it ended
                with self._lock:
                    self._lease_hashes.pop(lease_id, None)
                    self._forget_slots_locked(lease_id)
        _check_reply(reply)
        if verdicts is None or verdicts.count(0):  # (None: an ok reply is always followed by its blocks)
            first = verdicts.index(0) if verdicts is not None else 0
            raise self._mismatch(_run_wire_keys(runs)[first], verdicts.count(0) if verdicts is not None else count,
                                 count, unsummed[0])

    def _direct_failed(self, asked: _DirectLookup, exc: BaseException) -> None:
        """A direct lookup's exchange failed with ``exc``: ends the node never saw go back in the queue."""
        if asked.ends and isinstance(exc, (ChannelClosed, ChannelBusy)):
            with self._lock:
                self._ends[:0] = asked.ends  # the node never saw them: the next request carries them
        if asked.channel.closed:
            self._lost(asked.direct)

    def _direct_answer(self, asked: _DirectLookup, reply: dict[str, Any], payload: memoryview | None) -> LookupResult:
        """What a direct lookup's reply (and the block bytes after it) says, judged and kept as on the loop."""
        reply = _check_reply(reply)
        if payload is not None:  # (the channel read exactly what the answer's sent names: the stream is in step)
            try:
                blocks = self._sent_blocks(asked.direct, asked.message, reply, payload)
            except ProtocolError:  # (the channel is closed: blocks that do not match the request)
                self._lost(asked.direct)
                raise
            blocks.check(0, len(blocks.sizes))
            return self._keep_sent(asked.message, blocks)
        return self._leased_answer(asked.message, asked.mapping, reply, asked.sent_at)

    def read_here(self, lease_id: int, keys: Sequence[BlockKey], dests: Sequence[Any], slots: LeaseSlots) -> bool:
        """Calling thread: :meth:`read` of a same-host lease copied right here from its slot map; True when done.

        For small reads (the copy holds the calling thread for its length:
        a few tens of µs for a few hundred KiB); no round trip, no hop to the
        loop thread. ``slots`` is the lease's slot map, taken with
        :meth:`claim_slots`. True: every block is in its destination and
        matched its checksum, and the lease's end is queued
        (:meth:`end_later`; the caller makes sure it is sent). False: nothing
        may be used of the destinations (an expired slot map, a key it does
        not cover, a copy that failed its checksums); read them with
        :meth:`read` instead, which then takes the two-step way.
        """
        if len(keys) != len(dests) or not self._may_copy(slots):
            return False
        if not slots.copy_here(keys, [_byte_view(d) for d in dests]):
            return False
        self._count_fast_read()
        return True

    def read_rows_here(self, run: RowRun, slots: LeaseSlots) -> bool | None:
        """:meth:`read_here` of a read into rows of one buffer, with no Python step per block (:meth:`LeaseSlots.rows_copy`).

        The same answers as :meth:`read_here`, and ``None`` where the read
        cannot be copied this way: use :meth:`read_here`.
        """
        if not self._may_copy(slots):
            return False
        done = slots.copy_rows_here(run)
        if done:
            self._count_fast_read()
        return done

    def start_read_here(self, count: int, nbytes: int, prepare: Callable[[], tuple[Sequence[BlockKey], Sequence[Any]]],
                        slots: LeaseSlots, run: RowRun | None = None) -> ChunkedCopy | PostedCopy | None:
        """Any thread: :meth:`read_here` on the copy threads (:mod:`dkv.copy_threads`), for reads too large to hold the caller.

        This thread only posts it: ``count`` blocks, ``nbytes`` in all, whose
        keys and destinations ``prepare()`` gives, on a copy thread
        (:meth:`LeaseSlots.start_copy`; where ``run`` describes the same read
        and can be copied without them, they are not made). ``None`` when the lease cannot be
        copied this way (checksums off, its slot map expired): read it with
        :meth:`read`. The returned copy's ``done`` resolves to True when every
        block is in its destination and matched its checksum (the caller then
        queues the lease's end with :meth:`end_later`); to False or an error
        when nothing of the destinations may be used (read them with
        :meth:`read`, which then takes the two-step way).
        """
        if not self._may_copy(slots):
            return None

        def keys_and_views() -> tuple[Sequence[BlockKey], list[memoryview]]:
            keys, dests = prepare()
            if len(keys) != len(dests):
                raise ValueError("read: one destination per key")
            return keys, [_byte_view(d) for d in dests]

        copy = slots.start_copy(count, nbytes, keys_and_views, run)
        copy.done.add_done_callback(self._count_if_copied)
        return copy

    def _may_copy(self, slots: LeaseSlots) -> bool:
        """Whether a read may be copied from ``slots`` without asking the node: checked, and within its lease."""
        return self.checksums and time.monotonic() < slots.live_until

    def _count_if_copied(self, done: concurrent.futures.Future[bool]) -> None:
        if not done.cancelled() and done.exception() is None and done.result():
            self._count_fast_read()

    def _count_fast_read(self) -> None:
        with self._lock:  # from either thread
            self.fast_reads += 1

    def claim_slots(self, lease_id: int) -> LeaseSlots | None:
        """Any thread: take the slot map kept for ``lease_id``'s load (to pass to :meth:`read`); ``None`` if none is kept.

        Once taken, a later lookup of the lease's group no longer forgets it
        (see :meth:`_leased_request`): the load copies under the checksums'
        proof whatever the node did to the lease meanwhile. The lookup's
        hashes kept for the lease's read go too: a load copied from its slot
        map never sends one (one that falls back to the two-step read names
        its keys). Kept, a lease's list of hashes lived until the bound pushed
        it out, 4 096 leases later: every handle's lookup has a group of its
        own, which no later lookup ends. That held the hashes' bytes after the
        engine let go of them, and gave the garbage collector thousands of
        long lists to walk on the scheduler thread (a young collection took
        0.3-5 ms inside ``load()``).
        """
        with self._lock:
            slots = self._forget_slots_locked(lease_id)
            if slots is not None:
                self._lease_hashes.pop(lease_id, None)
            return slots

    def _take_ends(self) -> list[int]:
        """The loaded leases the next request ends (at most ``MAX_ENDS``); they leave the queue."""
        with self._lock:
            ends, self._ends = self._ends[:MAX_ENDS], self._ends[MAX_ENDS:]
        return ends

    def _end_soon(self, lease_id: int) -> None:
        """Loop thread: end a lease the same-host path loaded from: with the next request, or an ``end`` request shortly."""
        if self.end_later(lease_id):
            self.flush_ends_soon()

    def end_later(self, lease_id: int) -> bool:
        """Any thread: queue the end of a lease loaded from (the next request carries it).

        True when no flush is asked for yet: the caller then has
        :meth:`flush_ends_soon` run on the loop thread, so that the lease
        ends shortly even if no request follows.
        """
        with self._lock:
            self._ends.append(lease_id)
            asked, self._flush_asked = self._flush_asked, True
        return not asked

    def flush_ends_soon(self) -> None:
        """Loop thread: send the queued lease ends with an ``end`` request of their own in ``END_FLUSH_DELAY``
        seconds, unless a request carries them first."""
        if self._end_timer is None and not self._closed:
            self._end_timer = asyncio.get_running_loop().call_later(END_FLUSH_DELAY, self._flush_ends)

    def _flush_ends(self) -> None:
        self._end_timer = None
        with self._lock:
            self._flush_asked = False  # an end queued from here on asks for a flush of its own
        if self._ends and not self._closed:
            task = asyncio.ensure_future(self._send_ends())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_ends(self) -> None:
        while self._ends and not self._closed:
            try:
                await self._request({"op": "end"}, idempotent=True, control=True)  # it carries them as any request does
            except DKVError as exc:  # the leases lapse with their TTL (or with the connections) instead
                log.debug("ending loaded leases on %s: %s", self.address, exc)
                return

    def _unsplittable(self, what: str, hashes: int, leaves: int, shards: int = 1) -> str:
        if hashes > self.limit("max_keys"):
            over = f"{hashes} hashes exceed the node's max_keys ({self.limit('max_keys')})"
        elif leaves > self.limit("max_leaves"):
            over = f"{leaves} leaves exceed the node's max_leaves ({self.limit('max_leaves')})"
        elif hashes * leaves * shards > self.limit("max_cost"):
            over = (f"{hashes} hashes x {leaves} leaves x {shards} shards = {hashes * leaves * shards} "
                    f"exceed the node's max_cost ({self.limit('max_cost')})")
        else:
            over = f"{hashes} hashes x {leaves} leaves exceed the node's max_frame ({self.limit('max_frame')} bytes)"
        return f"{what} cannot be split across requests (one lease), and {over}"

    async def probe(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1) -> dict[str, list[bool]]:
        """Presence per leaf without a lease (in several requests when one cannot carry it all)."""
        requests = await self._presence_requests("probe", hashes, leaves, shards)
        masks: dict[str, list[bool]] = {}
        for (run, _), reply in zip(requests, await self._presence(requests)):
            _merge_masks(masks, _unpack_masks(reply["masks"], len(run)))
        return masks

    async def tiers(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1) -> dict[str, list[str | None]]:
        """Per leaf, where each block lies: ``"host"``, ``"disk"`` (off the host pool) or ``None`` (absent).

        Read-only (no lease, no stamp), split like :meth:`probe`. A node too old
        to say answers without them: :class:`~dkv.errors.ProtocolError`.
        """
        requests = await self._presence_requests("probe", hashes, leaves, shards, tiers=True)
        names = {1: "host", 2: "disk"}
        out: dict[str, list[str | None]] = {}
        for (run, _), reply in zip(requests, await self._presence(requests)):
            raw = reply.get("tiers")
            if not isinstance(raw, dict):
                raise ProtocolError("probe with tiers: the reply has no tiers map")
            for leaf, packed in raw.items():
                if not isinstance(packed, bytes) or len(packed) != len(run):
                    raise ProtocolError(f"tiers for leaf {leaf!r} have the wrong length")
                out.setdefault(leaf, []).extend(names.get(b) for b in packed)
        return out

    async def touch(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1) -> int:
        """Refresh recency of the held blocks among ``hashes`` (pass the whole chain from its root).

        When one request cannot carry it all, the runs go deepest first, so the
        root's run gets the newest stamp and the chain still evicts deepest first.
        """
        requests = await self._presence_requests("touch", hashes, leaves, shards)
        replies = await self._presence(requests[::-1])
        return sum(int(reply["found"]) for reply in replies)

    async def release(self, lease_id: int) -> bool:
        """End a lease (abandon). Returns False when the node no longer held it.

        A lease whose blocks the node sent with its lookup's answer ended
        then: its bytes are dropped here, and nothing is sent.
        """
        with self._lock:
            slots = self._forget_slots_locked(lease_id)
            self._lease_hashes.pop(lease_id, None)
        if slots is not None and slots.received:
            return False
        return bool((await self._request({"op": "release", "lease": lease_id}, idempotent=True,
                                         control=True))["released"])

    async def stats(self) -> dict[str, Any]:
        return (await self._request({"op": "stats"}, idempotent=True))["stats"]

    async def clear(self) -> int:
        """Drop every unpinned block of this namespace on the node."""
        return int((await self._request({"op": "clear"}, idempotent=True))["cleared"])

    async def read(self, lease_id: int, keys: Sequence[BlockKey], dests: Sequence[Any], *,
                   end_lease: bool = True, slots: LeaseSlots | None = None) -> None:
        """Read ``keys`` (all covered by ``lease_id``) into ``dests``, one writable buffer per key.

        Each destination must be exactly the block's size, and no two may
        overlap (a block is checked once its bytes are whole in its
        destination, while later ones still arrive). All or nothing from
        the caller's view: on any error some destinations may hold partial data
        and must not be used; nothing writes into them after this raises.

        The node pins what the read moves for the read itself, so the bytes
        cannot change under it even when the lease ends meanwhile; a same-host
        copy that outlived its read's pins raises :class:`ReadNotIntact`. More
        keys than one request may carry (the node's ``max_keys``/``max_frame``)
        are read in several requests under the same lease, which the last one
        ends (with ``end_lease``).

        With ``checksums`` (the default) every block is checked once its bytes
        are in its destination against the checksum the node returns (the
        writer's, :mod:`dkv.checksum`); a block that fails, or that the node
        names no checksum for, raises :class:`ChecksumMismatch` (the
        destinations hold garbage).

        ``slots``: the lease's slot map when the caller took it beforehand
        (:meth:`claim_slots`); otherwise the one kept for the lease, if any.
        """
        if len(keys) != len(dests):
            raise ValueError("read: one destination per key")
        views = [_byte_view(d) for d in dests]
        with self._lock:
            looked_up = self._lease_hashes.pop(lease_id, None) if end_lease else self._lease_hashes.get(lease_id)
            if slots is None:
                slots = self._forget_slots_locked(lease_id) if end_lease else self._lease_slots.get(lease_id)
        # a lease this client knows ended (its TTL, a later lookup of its group, a release) loads the two-step
        # way, which the node refuses; a copy under a lease ended by anything else fails its checksums
        if slots is not None and self._may_copy(slots) and await slots.copy(keys, views):
            if end_lease and not slots.received:  # (the node ended a lease it sent the blocks of)
                self._end_soon(lease_id)
            self._count_fast_read()
            return
        wire_keys = _wire_keys(keys)
        runs = await self._key_runs(wire_keys, extra_per_key=0,
                                    base={"op": "read", "lease": lease_id, "keys": [], "end": True, "shm": True})
        # deepest run first: each run is stamped as one use, so the root's run gets the newest stamp
        # and the chain still evicts deepest first (as a split touch does)
        for i, run in enumerate(reversed(runs)):
            last = i == len(runs) - 1
            run_keys = wire_keys[run.start:run.stop]
            try:
                await self._read_run(lease_id, run_keys, views[run.start:run.stop], end_lease and last,
                                     _places(run_keys, *looked_up) if looked_up is not None else None)
            except ChecksumMismatch:
                if end_lease and not last:  # the runs left will not be read: end the lease now, not at its TTL
                    with contextlib.suppress(DKVError):
                        await self.release(lease_id)
                raise

    async def _key_runs(self, wire_keys: Sequence[Any], *, extra_per_key: int,
                        base: dict[str, Any]) -> list[range]:
        """Runs of ``wire_keys`` that each fit one request within the node's ``max_keys`` and ``max_frame``."""
        await self._known_limits()
        if self._fits_without_estimate(len(wire_keys)):
            return [range(len(wire_keys))]
        leaf_bytes: dict[str, int] = {}
        sizes = []
        for leaf, _shard, h in wire_keys:
            n = leaf_bytes.get(leaf)
            if n is None:
                n = leaf_bytes[leaf] = len(leaf.encode()) + 3  # str header
            sizes.append(1 + n + 9 + len(h) + 2 + extra_per_key)  # array, leaf, shard (uint64 bound), bin hash
        return chunk_ranges(len(wire_keys), max_count=self.limit("max_keys"), max_bytes=self.limit("max_frame"),
                            item_bytes=sizes, fixed_bytes=len(encode_body(base)) + FRAME_SLACK)

    async def _read_run(self, lease_id: int, wire_keys: list[Any], views: list[memoryview],
                        end_lease: bool, places: list[list[Any]] | None = None) -> None:
        """One read request (see :meth:`read`), then the check of each block against its checksum.

        ``places``: the same blocks as runs of places in the lease's lookup
        (:func:`_places`); the request names them so where the node serves it
        (``read_runs``), by key otherwise.

        The check runs on the destinations, once the bytes are there and the
        connection is back in the pool: after the receive (listener path), or
        after the copy *and* ``done`` (same-host path). It hashes the
        caller's own copy, which nothing else writes, so it needs no pins: the
        node's pins cover only the copy, as before, and a copy that outlived
        them is reported as what it is (:class:`ReadNotIntact`) rather than as
        a mismatch. Hashing the slot before ``done`` instead would prove the
        slot, not the bytes the caller got, and hold the pins longer.
        """

        known: list[bool | None] = []  # per block: checked while later payloads were still arriving

        async def run(session: _Session) -> Any:
            known[:] = [None] * len(views)  # (a run is tried once; afresh if it ever were again)
            mapping = self._arena(session)
            named = ({"runs": places} if places is not None and FEATURE_READ_RUNS in session.info.features
                     else {"keys": wire_keys})
            reply = await session.request(
                {"op": "read", "lease": lease_id, **named, "end": end_lease, "shm": mapping is not None}, self.timeout)
            sizes = reply["sizes"]
            if len(sizes) != len(views):
                raise ProtocolError("read reply names a different number of blocks")
            wrong = [(v.nbytes, n) for v, n in zip(views, sizes) if v.nbytes != n]
            if wrong:
                if mapping is not None:
                    await self._end_read(session, reply)
                else:
                    session.conn.abort()  # the node is already sending; its read ends when that fails
                raise ValueError(f"destination of {wrong[0][0]} bytes for a block of {wrong[0][1]} bytes")
            if mapping is not None:
                await self._copy_out(session, mapping, reply, views)
            else:
                on_landed: Callable[[int, int], None] | None = None
                if self.checksums:
                    checks: list[Any] = []  # each block's prefix, and the checksums: made once the receives are
                    # posted (the node's first payload message meets a receive sooner), before the first check

                    def landed(start: int, stop: int) -> None:  # check these while the rest arrives
                        if not checks:
                            checks[:] = (block_prefixes(wire_keys, [view.nbytes for view in views]),  # one pass
                                         _sums_for(reply.get("sums"), len(views)))
                        prefixes, sums = checks
                        hashed = 0
                        for i in range(start, stop):
                            view = views[i]
                            known[i] = verify_prefixed(prefixes[i], view, sums[i])
                            hashed += view.nbytes
                            if hashed >= PROGRESS_EVERY_BYTES:
                                progress_now()  # the node's next messages keep coming meanwhile
                                hashed = 0

                    on_landed = landed
                await session.conn.recv_payloads(views, self.timeout, on_landed, reply.get("groups"))
            return reply.get("sums")

        sums = await self._call(run, idempotent=False)
        if self.checksums:
            self._check_sums(wire_keys, views, sums, known)

    def _check_sums(self, wire_keys: Sequence[Any], views: Sequence[memoryview], sums: Any,
                    known: Sequence[bool | None] = ()) -> None:
        """:class:`ChecksumMismatch` unless every block's bytes match the checksum the node returned for it.

        A block with no checksum (stored by a writer that sent none, or a node
        that returns none) fails too: a node cannot opt a read out of the check.
        ``known[i]``, where given and not None, is block ``i``'s verdict from a
        check made once its bytes were whole in its destination (nothing
        writes there after that).
        """
        sums = _sums_for(sums, len(views))
        known = list(known) if len(known) == len(views) else [None] * len(views)
        bad = [i for i, (key, view, checksum, verdict) in enumerate(zip(wire_keys, views, sums, known))
               if not (verdict if verdict is not None else checksum_matches(key[0], key[1], key[2], view, checksum))]
        if bad:
            raise self._mismatch(wire_keys[bad[0]], len(bad), len(views),
                                 sum(1 for i in bad if not is_checksum(sums[i])))

    def _mismatch(self, first_key: Sequence[Any], bad: int, count: int, unsummed: int) -> ChecksumMismatch:
        """The :class:`ChecksumMismatch` of a read of ``count`` blocks, ``bad`` of which (``unsummed`` named no checksum) failed."""
        leaf, shard, block_hash = first_key
        return ChecksumMismatch(
            f"{bad} of {count} block(s) read from {self.address} do not match their checksum "
            f"(first: leaf {leaf!r}, shard {shard}, hash {block_hash.hex()}"
            + (f"; {unsummed} came without one" if unsummed else "")
            + "): corrupted or substituted, the destinations hold garbage",
            count=bad, first_key=(leaf, shard, block_hash))

    async def _copy_out(self, session: _Session, mapping: SegmentMapping, reply: dict[str, Any],
                        views: Sequence[memoryview]) -> None:
        """Same-host path: copy a read's slots out of the mapped arena, then end the read.

        The node pins the slots for the read until ``done``; if the pins ended
        first (the read's TTL), the copy may hold bytes of another block and
        :class:`ReadNotIntact` is raised: the destinations must be discarded.
        """
        try:
            for view, offset, size in zip(views, reply["offsets"], reply["sizes"]):
                if size:
                    view[:] = mapping.slot(offset, size)
        except BaseException:
            with contextlib.suppress(DKVError):
                await self._end_read(session, reply)
            raise
        if not await self._end_read(session, reply):
            raise ReadNotIntact(f"read {reply['read']} on {self.address} ended before its copy finished: "
                                "the copied bytes may be torn")

    async def _end_read(self, session: _Session, reply: dict[str, Any]) -> bool:
        """Tell the node a same-host read's bytes are out; True when its pins held throughout."""
        done = await session.request({"op": "done", "read": reply["read"]}, self.timeout)
        return done.get("intact") is True

    async def write(self, keys: Sequence[BlockKey], sources: Sequence[Any]) -> WriteResult:
        """Store each source buffer under its key (two-phase: reserve, bytes, commit).

        Keys already held or being written by another client are skipped
        (``exists``/``busy``). The blocks become visible only once all their
        bytes are in the node; on error nothing of this write is visible.
        More keys than one request may carry are written in several
        two-phase writes, deepest run first (the root's run is then the newest
        use and is evicted last); on an error, the runs written before it stay
        (each block is whole), the failing one leaves nothing. The exception:
        with ``checksums``, a block whose bytes reached the node changed is
        refused by it alone, and :class:`ChecksumMismatch` is raised once its
        run is committed (every stored block matches its checksum).
        """
        if len(keys) != len(sources):
            raise ValueError("write: one source per key")
        views = [_byte_view(s) for s in sources]
        wire_keys = _wire_keys(keys)
        sums_field = {"sums": []} if self.checksums else {}
        runs = await self._key_runs(wire_keys, extra_per_key=9 + (CHECKSUM_WIRE_BYTES if self.checksums else 0),
                                    base={"op": "write", "keys": [], "sizes": [], "shm": True, **sums_field})
        runs = [part for run in runs for part in self._reservation_runs(run, views)]
        parts: list[list[str]] = []
        for run in reversed(runs):  # deepest run first, so the root's run is the newest use (see read)
            parts.append((await self._write_run(wire_keys[run.start:run.stop], views[run.start:run.stop])).statuses)
        return WriteResult([status for part in reversed(parts) for status in part])

    def _reservation_runs(self, run: range, views: Sequence[memoryview]) -> list[range]:
        """``run`` cut so that each part's slots fit one connection's reservation bound (``max_reserved_*``).

        A block larger than the bound on its own is a part of its own (the
        node answers it ``full``).
        """
        max_bytes, max_keys = self.limit("max_reserved_bytes"), self.limit("max_reserved_keys")
        parts, start, held = [], run.start, 0
        for i in run:
            cost = align_up(views[i].nbytes) if views[i].nbytes else 0
            if i > start and (held + cost > max_bytes or i - start >= max_keys):
                parts.append(range(start, i))
                start, held = i, 0
            held += cost
        parts.append(range(start, run.stop))
        return parts

    async def _write_run(self, wire_keys: list[Any], views: list[memoryview]) -> WriteResult:
        """One two-phase write (see :meth:`write`).

        With ``checksums``, each block's checksum is taken from its source
        bytes just before they leave and sent with the request; the node
        commits only the blocks whose bytes arrived intact and says how many
        it refused, which raises :class:`ChecksumMismatch` here (those blocks
        are not stored; the others of the run are).
        """
        sums = ([block_checksum(k[0], k[1], k[2], v) for k, v in zip(wire_keys, views)]
                if self.checksums else None)

        async def run(session: _Session) -> tuple[WriteResult, int]:
            mapping = self._arena(session, write=True)
            request = {"op": "write", "keys": wire_keys, "sizes": [v.nbytes for v in views], "shm": mapping is not None}
            if sums is not None:
                request["sums"] = sums
            reply = await session.request(request, self.timeout)
            statuses = list(reply["status"])
            accepted = [v for v, st in zip(views, statuses) if st == WRITE]
            if mapping is not None:
                try:
                    for view, offset in zip(accepted, reply["offsets"]):
                        if view.nbytes:
                            mapping.slot(offset, view.nbytes)[:] = view
                except BaseException:
                    await session.request({"op": "abort", "write": reply["write"]}, self.timeout)
                    raise
                done = await session.request({"op": "commit", "write": reply["write"]}, self.timeout)
            else:
                await session.conn.send_payloads([v for v in accepted if v.nbytes], self.timeout, reply.get("groups"))
                done = _check_reply(await session.conn.recv_message(self.timeout))
            rejected = done.get("rejected", 0)
            return WriteResult(statuses), rejected if isinstance(rejected, int) and not isinstance(rejected, bool) else 0

        result, rejected = await self._call(run, idempotent=False)
        if rejected:
            raise ChecksumMismatch(
                f"{self.address} refused {rejected} of {result.stored} block(s) of this write: the bytes it "
                "received did not match their checksums (not stored)", count=rejected)
        return result

    async def close(self) -> None:
        """Close every pooled connection (the node drops this client's leases). Idempotent.

        The last client of the process to close (on the loop that started UCX,
        with no other user of it left: see :func:`dkv.transport.release_transport`)
        also stops UCX's threads, so a script that used it can exit; a call
        still in flight defers that to its own end.
        """
        self._closed = True
        if self._end_timer is not None:
            self._end_timer.cancel()  # the node ends this client's leases as its connections close
            self._end_timer = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        directs, self._directs = self._directs, []
        for direct in directs:
            direct.conn.abort()  # a lookup on it now fails at once
            self._lost(direct)
        with self._lock:
            self._lease_slots.clear()
            self._lease_hashes.clear()
            self._received_bytes = 0
        sessions, self._idle, self._control_idle = self._idle + self._control_idle, [], []
        await asyncio.gather(*(s.conn.close() for s in sessions), return_exceptions=True)
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if not self._busy:
            await self._let_go_of_transport()

    async def _let_go_of_transport(self) -> None:
        if self._holds_transport:
            self._holds_transport = False
            await release_transport()

    async def __aenter__(self) -> NodeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _StalePooledConnection(TransportError):
    """A pooled connection failed on its first use since it went idle: the node had closed it meanwhile.

    An idempotent call is tried once more on a new connection whatever the
    client's ``retries`` (the node may close idle connections; see its idle
    timeout and connection caps).
    """


class _Unanswered(OpTimeout):
    """A request on an open, handshaken connection that the node did not answer within the timeout.

    Not retried, whatever the client's ``retries``: the node took the request
    and is hung (paused, overloaded, its link cut), so each retry would wait as
    long again (a failure to connect is still retried).
    """


def _worth_retrying(exc: BaseException) -> bool:
    """Retry a failed connection or connect, never a request a connected node left unanswered (:class:`_Unanswered`)."""
    return isinstance(exc, TransportError) and not isinstance(exc, _Unanswered)


async def _backoff_once(state: Any) -> None:
    """Before each retry (the first attempt failed already): the same random exponential backoff."""
    await asyncio.sleep(wait_random_exponential(multiplier=0.05, max=1.0)(state))


def chunk_ranges(count: int, *, max_count: int, max_bytes: int, item_bytes: int | Sequence[int],
                 fixed_bytes: int = 0) -> list[range]:
    """Split items ``0..count-1`` into consecutive ranges, one per request, each within a node's limits.

    Each range holds at most ``max_count`` items, and ``fixed_bytes`` (the
    message without its items, plus slack) plus the items' encoded bytes stays
    within ``max_bytes``. ``item_bytes`` is one upper bound for every item, or
    each item's own. Always at least one range (an empty one for ``count == 0``).
    ``ValueError`` naming ``max_frame`` when a single item cannot fit.
    """
    if max_count < 1:
        raise ValueError(f"max_keys must be at least 1, got {max_count}")
    room = max_bytes - fixed_bytes
    if isinstance(item_bytes, int):
        if item_bytes > room:
            raise ValueError(f"one item of {item_bytes} bytes does not fit the max_frame of {max_bytes} bytes")
        per = max_count if item_bytes <= 0 else min(max_count, room // item_bytes)
        return [range(start, min(start + per, count)) for start in range(0, count, per)] or [range(0)]
    if len(item_bytes) != count:
        raise ValueError("chunk_ranges: one size per item")
    ranges, start, used = [], 0, 0
    for i, size in enumerate(item_bytes):
        if size > room:
            raise ValueError(f"item {i} of {size} bytes does not fit the max_frame of {max_bytes} bytes")
        if i - start == max_count or used + size > room:
            ranges.append(range(start, i))
            start, used = i, 0
        used += size
    ranges.append(range(start, count))
    return ranges


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _merge_masks(into: dict[str, list[bool]], part: dict[str, list[bool]]) -> None:
    for leaf, mask in part.items():
        into.setdefault(leaf, []).extend(mask)


def _answer_buffer(room: int) -> int:
    """Bytes of the receive a lookup's answer lands in, with room for ``room`` bytes of blocks in its message."""
    return HEADER_SIZE + INLINE_MAX + room


def _byte_counts(values: list[Any]) -> bool:
    """Whether every value is a plain int from 0 to 2**40 (block sizes on the wire)."""
    return all(type(v) is int and 0 <= v <= 1 << 40 for v in values)


def _sums_for(sums: Any, count: int) -> list[Any]:
    """A read reply's checksums, one per block; all ``None`` (each fails its check) when malformed."""
    return sums if isinstance(sums, list) and len(sums) == count else [None] * count


_KEY_TYPES = {BlockKey, tuple}  # immutable: what was checked is what is sent (a list is copied by the slow path)


def _fine_leaf(leaf: str) -> bool:
    try:
        return bool(check_leaf(leaf))
    except ValueError:
        return False


def _places(wire_keys: Sequence[Any], looked_up: Sequence[bytes], shards: int) -> list[list[Any]] | None:
    """``wire_keys`` as runs ``[leaf, shard, first, stop]`` of places in their lease's lookup (see :mod:`dkv.wire`).

    ``looked_up``: the hashes the lookup named; ``shards``: its shard count.
    None when a key's hash is not among them (the read then names its keys).
    Keys of one leaf and shard whose hashes are a stretch of the lookup's (a
    load's usual shape) are one run, found in C-speed passes over the lists.
    A hash the lookup named twice is held by the node at each place where the
    lookup was of one shard, at its last place otherwise: key by key, each
    hash then goes to its last place.
    """
    count = len(wire_keys)
    if not count:
        return None
    hashes = list(map(operator.itemgetter(2), wire_keys))
    leaf, shard, first_hash = wire_keys[0]
    if shards == 1 and list(map(operator.itemgetter(0), wire_keys)).count(leaf) == count and list(
            map(operator.itemgetter(1), wire_keys)).count(shard) == count:
        try:
            first = looked_up.index(first_hash)
        except ValueError:
            return None
        if looked_up[first:first + count] == hashes:
            return [[leaf, shard, first, first + count]]
    depth_of = dict(zip(looked_up, range(len(looked_up))))
    try:
        depths = list(map(depth_of.__getitem__, hashes))
    except KeyError:
        return None
    runs: list[list[Any]] = []
    for (leaf, shard, _), depth in zip(wire_keys, depths):
        if runs and runs[-1][0] == leaf and runs[-1][1] == shard and runs[-1][3] == depth:
            runs[-1][3] = depth + 1
        else:
            runs.append([leaf, shard, depth, depth + 1])
    return runs


def _run_wire_keys(runs: Sequence[RowRun]) -> list[list[Any]]:
    """Each block of ``runs`` as the wire names a key, ``[leaf, shard, hash]``, in the stream's order."""
    return [[run.leaf, run.shard, h] for run in runs for h in run.hashes]


def _run_places(runs: Sequence[RowRun], looked_up: Sequence[bytes], shards: int) -> list[list[Any]] | None:
    """:func:`_places` of ``runs``' blocks, without a key list where each run is a stretch of the lookup's hashes.

    In a load's usual shape (one shard, each row run's hashes a stretch of
    its lookup's) each row run is one place run, found with one ``index`` and
    one slice compare; any other shape goes the way of :func:`_places`. Where
    the lookup named a hash twice, this may name another of its places than
    :func:`_places` does: with one shard the node holds it at each.
    """
    if shards == 1:
        places: list[list[Any]] = []
        for run in runs:
            hashes = run.hashes
            if not hashes:
                continue
            try:
                first = looked_up.index(hashes[0])
            except ValueError:
                return None
            if looked_up[first:first + len(hashes)] != hashes:
                break
            if places and places[-1][0] == run.leaf and places[-1][1] == run.shard and places[-1][3] == first:
                places[-1][3] = first + len(hashes)
            else:
                places.append([run.leaf, run.shard, first, first + len(hashes)])
        else:
            return places or None
    return _places(_run_wire_keys(runs), looked_up, shards)


def _wire_keys(keys: Sequence[BlockKey]) -> list[Any]:
    """Each key as the wire carries it, ``[leaf, shard, hash]``, checked (``ValueError`` names the first bad one).

    Column by column (each distinct leaf once, the hashes in one native
    pass), as a read's keys mostly share their leaf and shard; any doubt
    and each key is checked on its own, for the error that names it.
    """
    if keys and set(map(type, keys)) <= _KEY_TYPES and set(map(len, keys)) == {3}:
        leaves = list(map(operator.itemgetter(0), keys))
        shards = list(map(operator.itemgetter(1), keys))
        if (set(map(type, leaves)) == {str} and set(map(type, shards)) == {int} and min(shards) >= 0
                and max(shards) < MAX_TP_SHARDS and all(map(_fine_leaf, set(leaves)))
                and plain_hashes(list(map(operator.itemgetter(2), keys)))):
            return list(keys)  # (msgpack sends a tuple as the array a list would be)
    return [[check_leaf(k[0]), check_shard(k[1]), check_hashes([k[2]])[0]] for k in keys]


_FEW_MASK_BYTES = 32  # masks up to this long are unpacked without numpy (one byte: 0.2 against 1.1 µs, warm)


def _fits_without_estimate(keys: int, limits: Mapping[str, int]) -> bool:
    """True when ``keys`` keys surely fit one request of a node with these limits (few keys, frames of usual size)."""
    return keys <= SMALL_REQUEST_KEYS and keys <= limits["max_keys"] and limits["max_frame"] >= SMALL_FRAME


def _unpack_masks(raw: Any, length: int) -> dict[str, list[bool]]:
    if not isinstance(raw, dict):
        raise ProtocolError("masks must be a map")
    masks = {}
    for leaf, packed in raw.items():
        if not isinstance(packed, bytes) or len(packed) != length:
            raise ProtocolError(f"mask for leaf {leaf!r} has the wrong length")
        # a byte 1 is True, any other False (a few bytes in a Python step each: numpy's call costs more)
        masks[leaf] = [b == 1 for b in packed] if length <= _FEW_MASK_BYTES else (
            np.frombuffer(packed, dtype=np.uint8) == 1).tolist()
    return masks


__all__ = ["AuthError", "LookupResult", "NodeClient", "NodeInfo", "PeerUnauthenticated", "WriteResult", "handshake"]
