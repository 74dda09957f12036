"""The router: an in-memory index of the cluster fed by an etcd watch, answering in microseconds.

:meth:`Router.start` loads a snapshot of the cluster prefix and then follows a
watch from the snapshot's revision, so no request ever waits on etcd. If the
watch falls behind a compaction or breaks, the router reloads a snapshot.

:meth:`Router.route` returns the live peer holding the longest prefix of a
request's hashes: the deepest hash any live peer announced (with sparse
publication that is the deepest announced block of the peer's run); ties go
to the least used peer (host bytes), then to the smallest node id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from etcd3aio import Etcd3Client

from dkv.etcd import DEFAULT_ETCD_TIMEOUT, Layout, MemberRecord, get_prefix, prefix_end
from dkv.hints import build_hint

log = logging.getLogger(__name__)

PUT, DELETE = 0, 1
RESYNC_DELAY = 0.5


@dataclass(frozen=True)
class Route:
    """The chosen peer (``None`` if no live peer holds even the root) and how deep it covers."""

    peer: MemberRecord | None
    depth: int
    namespace: str
    hashes: Sequence[bytes]

    @property
    def hint(self) -> str | None:
        """The request's ``dkv_cache_hint`` JSON, or ``None`` when nothing is routed."""
        if self.peer is None:
            return None
        return build_hint(self.peer, self.namespace, self.hashes, self.depth)


@dataclass(frozen=True)
class ClusterEvent:
    """One change the router saw: join, leave, update, publish or unpublish."""

    kind: str
    node_id: str
    namespace: str = ""
    block_hash: bytes = b""


class Router:
    """Watches one cluster's prefix and routes requests to peers (see module docstring)."""

    def __init__(self, client: Etcd3Client, layout: Layout, *, timeout: float = DEFAULT_ETCD_TIMEOUT,
                 on_event: Callable[[ClusterEvent], None] | None = None) -> None:
        self.client = client
        self.layout = layout
        self.timeout = timeout
        self.on_event = on_event
        self.members: dict[str, MemberRecord] = {}
        self.lease_of: dict[str, int] = {}
        self._index: dict[str, dict[bytes, set[str]]] = {}
        self._entries = 0
        self.revision = 0
        self.resyncs = 0
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, follow: bool = True) -> None:
        """Load the snapshot (bounded by ``timeout``); with ``follow``, keep it current from a watch."""
        await self._load_snapshot()
        if follow:
            self._task = asyncio.create_task(self._follow(), name="dkv-router-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def wait_until(self, predicate: Callable[[Router], bool], timeout: float) -> bool:
        """Wait (bounded) until ``predicate(router)`` holds; returns whether it did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _load_snapshot(self) -> None:
        kvs, revision = await get_prefix(self.client, self.layout.root, timeout=self.timeout)
        self.members.clear()
        self.lease_of.clear()
        self._index.clear()
        self._entries = 0
        for item in kvs:
            self._apply(PUT, item.key.decode(), item.value, item.lease, quiet=True)
        self.revision = revision
        self._synced.set()

    async def _follow(self) -> None:
        root = self.layout.root
        while True:
            try:
                async for response in self.client.watch.watch(root, range_end=prefix_end(root),
                                                              start_revision=self.revision + 1):
                    if response.compact_revision > 0 or response.canceled:
                        raise _Resync(f"watch compacted at {response.compact_revision}")
                    for event in response.events:
                        self._apply(event.type, event.kv.key.decode(), event.kv.value, event.kv.lease)
                    if response.header.revision:
                        self.revision = max(self.revision, response.header.revision)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reload and carry on
                log.info("router watch interrupted (%s); reloading the snapshot", exc)
                await asyncio.sleep(RESYNC_DELAY)
                with contextlib.suppress(Exception):
                    await self._load_snapshot()
                    self.resyncs += 1

    # ---- index maintenance --------------------------------------------------------------------

    def _apply(self, kind: int, key: str, value: bytes, lease: int, quiet: bool = False) -> None:
        node_id = self.layout.parse_node_key(key)
        if node_id is not None:
            if kind == PUT:
                record = MemberRecord.from_json(value)
                if record is None or record.node_id != node_id:
                    return
                joined = node_id not in self.members
                self.members[node_id] = record
                self.lease_of[node_id] = lease
                self._emit(quiet, ClusterEvent("join" if joined else "update", node_id))
            elif self.members.pop(node_id, None) is not None:
                self.lease_of.pop(node_id, None)
                self._emit(quiet, ClusterEvent("leave", node_id))
            return
        parsed = self.layout.parse_block_key(key)
        if parsed is None:
            return
        namespace, block_hash, holder = parsed
        by_hash = self._index.setdefault(namespace, {})
        holders = by_hash.get(block_hash)
        if kind == PUT:
            if holders is None:
                holders = by_hash[block_hash] = set()
            if holder not in holders:
                holders.add(holder)
                self._entries += 1
            self._emit(quiet, ClusterEvent("publish", holder, namespace, block_hash))
        elif holders is not None and holder in holders:
            holders.discard(holder)
            self._entries -= 1
            if not holders:
                del by_hash[block_hash]
            self._emit(quiet, ClusterEvent("unpublish", holder, namespace, block_hash))

    def _emit(self, quiet: bool, event: ClusterEvent) -> None:
        if not quiet and self.on_event is not None:
            self.on_event(event)

    # ---- queries ------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        """Directory entries in the index."""
        return self._entries

    def holders(self, namespace: str, block_hash: bytes) -> set[str]:
        """Live peers that announced ``block_hash`` in ``namespace``."""
        holders = self._index.get(namespace, {}).get(block_hash, set())
        return {h for h in holders if h in self.members}

    def route(self, namespace: str, hashes: Sequence[bytes], *, exclude: Sequence[str] = ()) -> Route:
        """The live peer holding the longest prefix of ``hashes`` (see module docstring).

        Cost: a full hit is one lookup; a request whose first ``k`` hashes
        nobody announced (``k`` = the largest ``publish_every`` among members)
        is ``k`` lookups, since every run announces one of its first ``k``
        blocks; anything else is one C-speed pass over the hashes.
        """
        by_hash = self._index.get(namespace)
        n = len(hashes)
        if not by_hash or not n:
            return Route(None, 0, namespace, hashes)
        best = self._best_holder(by_hash.get(hashes[-1]), exclude)
        if best is not None:
            return Route(best, n, namespace, hashes)
        k = min(n, max((m.publish_every for m in self.members.values()), default=1))
        if not any(map(by_hash.__contains__, hashes[:k])):
            return Route(None, 0, namespace, hashes)
        present = list(map(by_hash.__contains__, hashes))
        present.reverse()
        start = 1  # the last hash was tried above
        while True:
            try:
                j = present.index(True, start)
            except ValueError:
                return Route(None, 0, namespace, hashes)
            best = self._best_holder(by_hash.get(hashes[n - 1 - j]), exclude)
            if best is not None:
                return Route(best, n - j, namespace, hashes)
            start = j + 1

    def depth_of(self, node_id: str, namespace: str, hashes: Sequence[bytes]) -> int:
        """How deep a prefix of ``hashes`` ``node_id`` announced (0 if none, or if it is not live)."""
        by_hash = self._index.get(namespace)
        if not by_hash or node_id not in self.members:
            return 0
        for i in range(len(hashes) - 1, -1, -1):
            holders = by_hash.get(hashes[i])
            if holders and node_id in holders:
                return i + 1
        return 0

    def _best_holder(self, holders: set[str] | None, exclude: Sequence[str]) -> MemberRecord | None:
        """Least used live holder, then smallest node id; ``None`` when no holder is live."""
        if not holders:
            return None
        members = self.members
        live = [members[h] for h in holders if h in members and h not in exclude]
        return min(live, key=lambda m: (m.host_used, m.node_id)) if live else None


class _Resync(Exception):
    pass
