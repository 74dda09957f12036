"""Async client of a dKV node: handshake, a per-peer connection pool, timeouts, retries.

:class:`NodeClient` talks to one node. Connections are opened on demand up to
``pool_size`` and reused; a connection that saw a transport error is dropped.
Idempotent ops (lookup, probe, touch, release, stats) are retried with
jittered exponential back-off on transport errors; reads and writes are not
(the caller decides, since a read may have written part of its destination).

When the node shares this machine's memory (same host id, arena mappable),
reads and writes copy straight through the mapped arena and only the control
messages cross UCX ("the same-host path"); otherwise block bytes travel as UCX
messages ("the listener path"). ``local=False`` forces the listener path.

Every public coroutine is bounded by ``timeout``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from dkv.arena import ArenaInfo, ArenaMapping, open_mapping
from dkv.errors import AuthError, ProtocolError, RemoteError, TransportError, remote_error
from dkv.hostid import host_id
from dkv.keys import BlockKey, check_hashes, check_leaf, check_namespace, check_shard
from dkv.store import WRITE
from dkv.transport import Connection, connect
from dkv.units import parse_address
from dkv.wire import PROTOCOL_VERSION, token_proof

T = TypeVar("T")
DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class NodeInfo:
    """What the node said in the handshake."""

    node_id: str
    epoch: str
    host: str
    arena: ArenaInfo
    limits: dict[str, Any]


@dataclass(frozen=True)
class LookupResult:
    """Per-leaf presence masks, and the lease pinning them (``None`` for unleased lookups)."""

    masks: dict[str, list[bool]]
    lease_id: int | None


@dataclass(frozen=True)
class WriteResult:
    """Per key: ``"write"`` (stored now), ``"exists"``, ``"busy"`` or ``"full"``."""

    statuses: list[str]

    @property
    def stored(self) -> int:
        return self.statuses.count(WRITE)


class _Session:
    """One handshaken connection."""

    def __init__(self, conn: Connection, info: NodeInfo) -> None:
        self.conn = conn
        self.info = info

    async def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        await self.conn.send_message(message, timeout)
        return _check_reply(await self.conn.recv_message(timeout))


def _check_reply(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok") is True:
        return reply
    code, msg = reply.get("code"), reply.get("msg")
    if not isinstance(code, str) or not isinstance(msg, str):
        raise ProtocolError(f"malformed reply from node: {reply!r:.200}")
    raise remote_error(code, msg)


def _byte_view(buffer: Any) -> memoryview:
    """A flat writable/readable byte view of a buffer (numpy array, bytearray, CPU tensor...)."""
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
        client_id: str | None = None,
        pool_size: int = 4,
        timeout: float = DEFAULT_TIMEOUT,
        local: bool | None = None,
        retries: int = 3,
    ) -> None:
        self.host, self.port = parse_address(address)
        self.address = address
        self.namespace = check_namespace(namespace)
        self.token = token
        self.client_id = client_id or secrets.token_hex(8)
        self.timeout = timeout
        self.local = local
        self.retries = retries
        self._pool_size = pool_size
        self._idle: list[_Session] = []
        self._open = 0
        self._slots = asyncio.Semaphore(pool_size)
        self._mapping: ArenaMapping | None = None
        self._mapping_checked = False
        self.info: NodeInfo | None = None
        self._closed = False

    # ---- connection pool ------------------------------------------------------------------

    async def _open_session(self) -> _Session:
        conn = await connect(self.host, self.port, min(self.timeout, 5.0))
        try:
            challenge = await conn.recv_message(self.timeout)
            nonce = challenge.get("nonce")
            if challenge.get("t") != "challenge" or not isinstance(nonce, bytes):
                raise ProtocolError(f"{self.address} did not open with a dKV challenge")
            await conn.send_message(
                {
                    "op": "hello", "v": PROTOCOL_VERSION, "ns": self.namespace, "client": self.client_id,
                    "proof": token_proof(self.token, nonce, self.namespace), "host": host_id(),
                },
                self.timeout,
            )
            reply = _check_reply(await conn.recv_message(self.timeout))
            arena = reply["arena"]
            info = NodeInfo(reply["node"], reply["epoch"], reply["host"],
                            ArenaInfo(arena["name"], int(arena["size"])), reply.get("limits", {}))
        except BaseException:
            conn.abort()
            raise
        if self.info is not None and info.epoch != self.info.epoch and self._mapping is not None:
            self._mapping.close()  # the node restarted: its old arena is gone
            self._mapping, self._mapping_checked = None, False
        self.info = info
        return _Session(conn, info)

    async def _session_call(self, fn: Callable[[_Session], Awaitable[T]]) -> T:
        if self._closed:
            raise TransportError("client is closed")
        try:
            async with asyncio.timeout(self.timeout):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise TransportError(f"no free connection to {self.address} within {self.timeout}s") from exc
        session = None
        try:
            session = self._idle.pop() if self._idle else None
            if session is None or session.conn.closed:
                session = await self._open_session()
            try:
                result = await fn(session)
            except RemoteError:
                # an error reply leaves the stream in step: keep the connection (and the leases)
                self._return(session)
                session = None
                raise
            self._return(session)
            session = None
            return result
        finally:
            if session is not None:
                session.conn.abort()
            self._slots.release()

    def _return(self, session: _Session) -> None:
        """Back to the pool; after :meth:`close` a session that comes back is closed instead."""
        if self._closed:
            session.conn.abort()
        elif not session.conn.closed:
            self._idle.append(session)

    async def _call(self, fn: Callable[[_Session], Awaitable[T]], *, idempotent: bool) -> T:
        if not idempotent or self.retries <= 1:
            return await self._session_call(fn)
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.retries),
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(TransportError),
            reraise=True,
        ):
            with attempt:
                return await self._session_call(fn)
        raise AssertionError("unreachable")

    async def _request(self, message: dict[str, Any], *, idempotent: bool) -> dict[str, Any]:
        return await self._call(lambda s: s.request(message, self.timeout), idempotent=idempotent)

    def _arena(self) -> ArenaMapping | None:
        """The node's arena mapped here, when the same-host path applies."""
        if self.local is False or self.info is None:
            return None
        if not self._mapping_checked:
            self._mapping_checked = True
            if self.info.host == host_id():
                self._mapping = open_mapping(self.info.arena)
            if self._mapping is None and self.local is True:
                raise TransportError(f"{self.address} is not on this host: the same-host path is unavailable")
        return self._mapping

    async def connect(self) -> NodeInfo:
        """Open one connection now (handshake errors surface here rather than on first use)."""
        await self._call(lambda s: asyncio.sleep(0), idempotent=False)
        assert self.info is not None
        return self.info

    @property
    def uses_shared_memory(self) -> bool:
        return self._arena() is not None

    # ---- ops ----------------------------------------------------------------------------------

    @staticmethod
    def _presence_fields(hashes: Sequence[bytes], leaves: Sequence[str], shards: int) -> dict[str, Any]:
        if not 1 <= shards <= 64:
            raise ValueError(f"shards must be in [1, 64], got {shards}")
        return {"hashes": check_hashes(hashes), "leaves": [check_leaf(x) for x in leaves], "shards": shards}

    async def lookup(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1, *,
                     lease: bool = True, group: int = 0) -> LookupResult:
        """Presence per leaf; with ``lease``, the node pins what it reports (ends the previous lease of ``group``)."""
        message = {"op": "lookup", **self._presence_fields(hashes, leaves, shards), "lease": lease, "group": group}
        reply = await self._request(message, idempotent=True)
        return LookupResult(_unpack_masks(reply["masks"], len(hashes)), reply.get("lease"))

    async def probe(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1) -> dict[str, list[bool]]:
        """Presence per leaf without a lease."""
        reply = await self._request({"op": "probe", **self._presence_fields(hashes, leaves, shards)}, idempotent=True)
        return _unpack_masks(reply["masks"], len(hashes))

    async def touch(self, hashes: Sequence[bytes], leaves: Sequence[str], shards: int = 1) -> int:
        """Refresh recency of the held blocks among ``hashes`` (pass the whole chain from its root)."""
        reply = await self._request({"op": "touch", **self._presence_fields(hashes, leaves, shards)}, idempotent=True)
        return int(reply["found"])

    async def release(self, lease_id: int) -> bool:
        """End a lease (abandon). Returns False when the node no longer held it."""
        return bool((await self._request({"op": "release", "lease": lease_id}, idempotent=True))["released"])

    async def stats(self) -> dict[str, Any]:
        return (await self._request({"op": "stats"}, idempotent=True))["stats"]

    async def clear(self) -> int:
        """Drop every unpinned block of this namespace on the node."""
        return int((await self._request({"op": "clear"}, idempotent=True))["cleared"])

    async def read(self, lease_id: int, keys: Sequence[BlockKey], dests: Sequence[Any], *,
                   end_lease: bool = True) -> None:
        """Read ``keys`` (all covered by ``lease_id``) into ``dests``, one writable buffer per key.

        Each destination must be exactly the block's size. All or nothing from
        the caller's view: on any error some destinations may hold partial data
        and must not be used; nothing writes into them after this raises.
        """
        if len(keys) != len(dests):
            raise ValueError("read: one destination per key")
        views = [_byte_view(d) for d in dests]
        wire_keys = _wire_keys(keys)

        async def run(session: _Session) -> None:
            mapping = self._arena()
            reply = await session.request(
                {"op": "read", "lease": lease_id, "keys": wire_keys, "end": end_lease, "shm": mapping is not None},
                self.timeout,
            )
            sizes = reply["sizes"]
            if len(sizes) != len(views):
                raise ProtocolError("read reply names a different number of blocks")
            wrong = [(v.nbytes, n) for v, n in zip(views, sizes) if v.nbytes != n]
            if wrong:
                if mapping is not None:
                    if end_lease:
                        await session.request({"op": "release", "lease": lease_id}, self.timeout)
                else:
                    session.conn.abort()  # the node is already sending; it ends the lease when that fails
                raise ValueError(f"destination of {wrong[0][0]} bytes for a block of {wrong[0][1]} bytes")
            if mapping is not None:
                try:
                    for view, offset, size in zip(views, reply["offsets"], sizes):
                        if size:
                            view[:] = mapping.slot(offset, size)
                finally:
                    if end_lease:
                        await session.request({"op": "release", "lease": lease_id}, self.timeout)
            else:
                await session.conn.recv_payloads([v for v in views if v.nbytes], self.timeout)

        await self._call(run, idempotent=False)

    async def write(self, keys: Sequence[BlockKey], sources: Sequence[Any]) -> WriteResult:
        """Store each source buffer under its key (two-phase: reserve, bytes, commit).

        Keys already held or being written by another client are skipped
        (``exists``/``busy``). The blocks become visible only once all their
        bytes are in the node; on error nothing of this write is visible.
        """
        if len(keys) != len(sources):
            raise ValueError("write: one source per key")
        views = [_byte_view(s) for s in sources]
        wire_keys = _wire_keys(keys)

        async def run(session: _Session) -> WriteResult:
            mapping = self._arena()
            reply = await session.request(
                {"op": "write", "keys": wire_keys, "sizes": [v.nbytes for v in views], "shm": mapping is not None},
                self.timeout,
            )
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
                await session.request({"op": "commit", "write": reply["write"]}, self.timeout)
            else:
                await session.conn.send_payloads([v for v in accepted if v.nbytes], self.timeout)
                _check_reply(await session.conn.recv_message(self.timeout))
            return WriteResult(statuses)

        return await self._call(run, idempotent=False)

    async def close(self) -> None:
        """Close every pooled connection (the node drops this client's leases). Idempotent."""
        self._closed = True
        sessions, self._idle = self._idle, []
        await asyncio.gather(*(s.conn.close() for s in sessions), return_exceptions=True)
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    async def __aenter__(self) -> NodeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _wire_keys(keys: Sequence[BlockKey]) -> list[list[Any]]:
    return [[check_leaf(k[0]), check_shard(k[1]), check_hashes([k[2]])[0]] for k in keys]


def _unpack_masks(raw: Any, length: int) -> dict[str, list[bool]]:
    if not isinstance(raw, dict):
        raise ProtocolError("masks must be a map")
    masks = {}
    for leaf, packed in raw.items():
        if not isinstance(packed, bytes) or len(packed) != length:
            raise ProtocolError(f"mask for leaf {leaf!r} has the wrong length")
        masks[leaf] = [b == 1 for b in packed]
    return masks


__all__ = ["AuthError", "LookupResult", "NodeClient", "NodeInfo", "WriteResult"]
