"""The router: an in-memory index of the cluster fed by an etcd watch, answering in microseconds.

:meth:`Router.start` loads a snapshot of the cluster prefix and then follows a
watch from the snapshot's revision, so no request ever waits on etcd. If the
watch falls behind a compaction or breaks, the router reloads a snapshot.

Threads. The index changes on the thread of the loop that runs the router;
other threads (an engine's scheduler thread, a demo) read it at any time,
without a lock, through a :class:`_Snapshot` swapped by reference: its member
table is a read-only mapping replaced whole on every membership change, and a
reload builds a complete new snapshot before one assignment publishes it, so
no reader ever sees an empty or half-filled table. The block index inside a
snapshot changes one key at a time, each value a frozenset that is replaced,
never changed in place, so every read of it is whole. A reader that keeps a
mapping (``router.members``) keeps that version of it.

:meth:`Router.route` returns the live peer holding the longest prefix of a
request's hashes: the deepest hash any live peer announced (with sparse
publication that is the deepest announced block of the peer's run); ties go
to the least used peer (host bytes), then to the smallest node id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from types import MappingProxyType
from typing import Any

from etcd3aio import Etcd3Client

from dkv.errors import DKVError
from dkv.etcd import (
    DEFAULT_ETCD_TIMEOUT,
    RECONNECT_MAX,
    Layout,
    MemberRecord,
    cluster_error,
    get_prefix,
    prefix_end,
)
from dkv.hints import build_hint

log = logging.getLogger(__name__)

PUT, DELETE = 0, 1
RESYNC_DELAY = 0.1  # seconds before the first reload after the watch broke (then doubling, to RECONNECT_MAX)
# Seconds a member that left the table (its key deleted: a lease that ran out or was revoked, a
# graceful stop) or registered again under a new epoch still counts as recently live, for hints
# that name it (:meth:`Router.recently_live`). A node whose etcd lease ran out in an outage
# registers again with a new epoch once etcd is back, keeping the blocks it held: hints made
# before that still name its old epoch, and serve for this long.
MEMBER_GRACE = 30.0
MAX_DEPARTED = 4096  # departed members remembered at once (the oldest are forgotten first)


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


Holders = frozenset[str]
_NOBODY: Holders = frozenset()


class _Snapshot:
    """One version of the cluster as readers see it (see the module docstring on threads).

    ``members`` and ``lease_of`` are never changed once the snapshot is
    published: a membership change makes a new snapshot (copy-on-write of the
    small member table) that shares ``index``. ``index`` (namespace -> hash ->
    holders) and ``entries`` are changed only by the loop thread, one key at a
    time, each holder set replaced by a new frozenset.
    """

    __slots__ = ("members", "members_view", "lease_of", "lease_view", "index", "entries", "max_every")

    def __init__(self, members: dict[str, MemberRecord], lease_of: dict[str, int],
                 index: dict[str, dict[bytes, Holders]], entries: int) -> None:
        self.members = members
        self.members_view: Mapping[str, MemberRecord] = MappingProxyType(members)
        self.lease_of = lease_of
        self.lease_view: Mapping[str, int] = MappingProxyType(lease_of)
        self.index = index
        self.entries = entries
        # the largest publish_every among members: how many leading hashes a miss must try
        self.max_every = max((m.publish_every for m in members.values()), default=1)

    def with_members(self, members: dict[str, MemberRecord], lease_of: dict[str, int]) -> _Snapshot:
        return _Snapshot(members, lease_of, self.index, self.entries)

    def put(self, namespace: str, block_hash: bytes, holder: str) -> bool:
        """Add an entry (loop thread only); False when it was already there."""
        by_hash = self.index.get(namespace)
        if by_hash is None:
            by_hash = self.index[namespace] = {}
        holders = by_hash.get(block_hash, _NOBODY)
        if holder in holders:
            return False
        by_hash[block_hash] = holders | {holder}
        self.entries += 1
        return True

    def remove(self, namespace: str, block_hash: bytes, holder: str) -> bool:
        """Remove an entry (loop thread only); False when it was not there."""
        by_hash = self.index.get(namespace)
        holders = by_hash.get(block_hash) if by_hash is not None else None
        if holders is None or holder not in holders:
            return False
        rest = holders - {holder}
        if rest:
            by_hash[block_hash] = rest  # type: ignore[index]
        else:
            del by_hash[block_hash]  # type: ignore[union-attr]
        self.entries -= 1
        return True


class Router:
    """Watches one cluster's prefix and routes requests to peers (see module docstring)."""

    def __init__(self, client: Etcd3Client, layout: Layout, *, timeout: float = DEFAULT_ETCD_TIMEOUT,
                 on_event: Callable[[ClusterEvent], None] | None = None) -> None:
        self.client = client
        self.layout = layout
        self.timeout = timeout
        self.on_event = on_event
        self._snap = _Snapshot({}, {}, {}, 0)
        self.revision = 0
        self.resyncs = 0  # snapshot reloads after the watch broke (and :meth:`reload` calls)
        self._synced = asyncio.Event()
        self._watch_live = False  # a watch stream is open and etcd confirmed it (see :attr:`watch_live`)
        self._task: asyncio.Task[None] | None = None
        # node id -> (its last record, when it stopped being live); replaced whole (loop thread), read anywhere
        self._departed: Mapping[str, tuple[MemberRecord, float]] = MappingProxyType({})
        self.clock: Callable[[], float] = time.monotonic

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, follow: bool = True) -> None:
        """Load the snapshot (bounded by ``timeout``); with ``follow``, keep it current from a watch.

        Raises :class:`~dkv.errors.ClusterError` when etcd cannot be read (unreachable, TLS or auth refused).
        """
        try:
            await self._load_snapshot()
        except DKVError:
            raise
        except Exception as exc:  # noqa: BLE001 - etcd and gRPC errors, translated
            raise cluster_error(exc, getattr(self.client, "settings", None), "reading the cluster directory") from None
        if follow:
            self._task = asyncio.create_task(self._follow(), name="dkv-router-watch")

    async def stop(self) -> None:
        self._watch_live = False
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

    async def reload(self) -> None:
        """Load a fresh snapshot now, as a broken watch does; readers keep answering from the old one meanwhile.

        A router that follows the watch restarts it from the new snapshot's revision.
        """
        following = self._task is not None
        await self.stop()
        try:
            await self._load_snapshot()
            self.resyncs += 1
        finally:  # a failed load leaves the old snapshot, and the watch goes on from its revision
            if following:
                self._task = asyncio.create_task(self._follow(), name="dkv-router-watch")

    async def _load_snapshot(self) -> None:
        """Build a complete new snapshot aside, then publish it in one assignment."""
        kvs, revision = await get_prefix(self.client, self.layout.root, timeout=self.timeout)
        members: dict[str, MemberRecord] = {}
        lease_of: dict[str, int] = {}
        fresh = _Snapshot({}, {}, {}, 0)
        for item in kvs:
            key = item.key.decode()
            node_id = self.layout.parse_node_key(key)
            if node_id is not None:
                record = _member(node_id, item.value)
                if record is not None:
                    members[node_id] = record
                    lease_of[node_id] = item.lease
            elif (parsed := self.layout.parse_block_key(key)) is not None:
                fresh.put(*parsed)
        previous = self._snap.members
        self._snap = fresh.with_members(members, lease_of)
        self.revision = revision
        self._note_departed(old for node_id, old in previous.items()
                            if node_id not in members or members[node_id].epoch != old.epoch)
        self._synced.set()

    async def _follow(self) -> None:
        """Follow the watch; when it breaks (etcd away, a compaction), reload the snapshot, then watch again.

        A reload that fails (etcd still away) is tried again, at most
        ``RECONNECT_MAX`` seconds apart, so the router is current again about
        that long after etcd answers. Readers keep the last snapshot meanwhile.
        """
        root = self.layout.root
        while True:
            try:
                # closed here, however this ends (a cancel included), so its stream ends with it
                async with contextlib.aclosing(self._watch(root, prefix_end(root), self.revision + 1)) as responses:
                    async for response in responses:
                        if response.compact_revision > 0 or response.canceled:
                            raise _Resync(f"watch compacted at {response.compact_revision}")
                        self._watch_live = True  # etcd answered this stream (its first answer confirms it)
                        for event in response.events:
                            self._apply(event.type, event.kv.key.decode(), event.kv.value, event.kv.lease)
                        if response.header.revision:
                            self.revision = max(self.revision, response.header.revision)
                raise _Resync("the watch ended")
            except asyncio.CancelledError:
                self._watch_live = False
                raise
            except Exception as exc:  # noqa: BLE001 - reload and carry on
                log.info("router watch interrupted (%s); reloading the snapshot", exc)
            self._watch_live = False
            delay = RESYNC_DELAY
            while True:
                await asyncio.sleep(delay)
                try:
                    await self._load_snapshot()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - etcd still away: the old snapshot serves meanwhile
                    delay = min(delay * 2, RECONNECT_MAX)
                    log.debug("router reload failed (%s); again in %.1f s", exc, delay)
                    continue
                self.resyncs += 1
                break

    def _watch(self, key: str, range_end: bytes, start_revision: int) -> AsyncIterator[Any]:
        """One watch stream (:meth:`dkv.etcd.EtcdClient.watch_range`; a plain etcd3aio client's own watch otherwise)."""
        watch_range = getattr(self.client, "watch_range", None)
        if watch_range is not None:
            return watch_range(key, range_end, start_revision)  # type: ignore[no-any-return]
        return self.client.watch.watch(key, range_end=range_end, start_revision=start_revision)

    # ---- index maintenance (the loop thread only) ---------------------------------------------

    def _apply(self, kind: int, key: str, value: bytes, lease: int, quiet: bool = False) -> None:
        snap = self._snap
        node_id = self.layout.parse_node_key(key)
        if node_id is not None:
            if kind == PUT:
                record = _member(node_id, value)
                if record is None:
                    return
                joined = node_id not in snap.members
                self._snap = snap.with_members({**snap.members, node_id: record}, {**snap.lease_of, node_id: lease})
                if not joined and snap.members[node_id].epoch != record.epoch:
                    self._note_departed([snap.members[node_id]])
                self._emit(quiet, ClusterEvent("join" if joined else "update", node_id))
            elif node_id in snap.members:
                members, lease_of = dict(snap.members), dict(snap.lease_of)
                del members[node_id]
                lease_of.pop(node_id, None)
                self._snap = snap.with_members(members, lease_of)
                self._note_departed([snap.members[node_id]])
                self._emit(quiet, ClusterEvent("leave", node_id))
            return
        parsed = self.layout.parse_block_key(key)
        if parsed is None:
            return
        namespace, block_hash, holder = parsed
        if kind == PUT:
            snap.put(namespace, block_hash, holder)
            self._emit(quiet, ClusterEvent("publish", holder, namespace, block_hash))
        elif snap.remove(namespace, block_hash, holder):
            self._emit(quiet, ClusterEvent("unpublish", holder, namespace, block_hash))

    def _note_departed(self, gone: Iterable[MemberRecord]) -> None:
        """Remember members that stopped being live just now (loop thread; readers see the map replaced whole)."""
        now = self.clock()
        departed = {node_id: entry for node_id, entry in self._departed.items() if now - entry[1] < MEMBER_GRACE}
        for record in gone:
            departed.pop(record.node_id, None)
            departed[record.node_id] = (record, now)
        while len(departed) > MAX_DEPARTED:
            del departed[next(iter(departed))]
        self._departed = MappingProxyType(departed)

    def _emit(self, quiet: bool, event: ClusterEvent) -> None:
        if not quiet and self.on_event is not None:
            self.on_event(event)

    # ---- queries (any thread: each takes one snapshot and answers from it) ---------------------

    @property
    def loaded(self) -> bool:
        """Whether a snapshot has been loaded (the index answers from it from then on, etcd or not)."""
        return self._synced.is_set()

    @property
    def watch_live(self) -> bool:
        """Whether a watch stream is open and etcd confirmed it: the index is following changes now.

        False before :meth:`start` (and with ``follow=False``), from the moment a
        watch breaks (etcd away, a compaction) until a reloaded snapshot's new
        watch is confirmed, and after :meth:`stop`.
        """
        return self._watch_live

    @property
    def ready(self) -> bool:
        """A snapshot is loaded and the watch is live: answers reflect the cluster as etcd sees it now."""
        return self._synced.is_set() and self._watch_live

    @property
    def members(self) -> Mapping[str, MemberRecord]:
        """Live members by node id: a read-only mapping that never changes once taken."""
        return self._snap.members_view

    def recently_live(self, node_id: str, epoch: str | None = None) -> MemberRecord | None:
        """Any thread: ``node_id``'s record if it stopped being a live member less than ``MEMBER_GRACE`` s ago.

        Only at ``epoch`` when one is given. "Stopped being live" is when this
        router learnt it: its member key was deleted, or it registered again
        under a new epoch. While etcd is away the router learns nothing, so the
        members it last saw stay in :attr:`members` (the connector's backoff
        of unanswering nodes covers one that died meanwhile).
        """
        entry = self._departed.get(node_id)
        if entry is None:
            return None
        record, left = entry
        if self.clock() - left >= MEMBER_GRACE or (epoch is not None and record.epoch != epoch):
            return None
        return record

    @property
    def lease_of(self) -> Mapping[str, int]:
        """Each member's etcd lease: a read-only mapping that never changes once taken."""
        return self._snap.lease_view

    @property
    def entries(self) -> int:
        """Directory entries in the index."""
        return self._snap.entries

    def holders(self, namespace: str, block_hash: bytes) -> set[str]:
        """Live peers that announced ``block_hash`` in ``namespace``."""
        snap = self._snap
        members = snap.members
        holders = snap.index.get(namespace, {}).get(block_hash, _NOBODY)
        return {h for h in holders if h in members}

    def route(self, namespace: str, hashes: Sequence[bytes], *, exclude: Sequence[str] = (),
              requester: str | None = None) -> Route:
        """The live peer holding the longest prefix of ``hashes`` (see module docstring).

        ``requester`` is the node co-located with the engine that asks, where
        the caller knows it: that engine's connector already looks up its own
        node, so a hint naming it, or naming a peer no deeper than it, adds
        nothing. With a requester the answer is the peer other than it whose
        serving prefix (:meth:`held_prefix`: from the root up to a hole in its
        chain) is deepest, with that prefix as the depth, and no peer (depth
        0, no hint) when none is deeper than the requester's own.

        Cost: a full hit is one lookup; a request whose first ``k`` hashes
        nobody announced (``k`` = the largest ``publish_every`` among members)
        is ``k`` lookups, since every run announces one of its first ``k``
        blocks; anything else is one C-speed pass over the hashes. With a
        requester: one C-speed pass over all the hashes for each node that
        announced one of the first ``k`` (about 0.2 ms for 1 k hashes and
        1.7 ms for 8 k with three such nodes, on the 2-core machine).
        """
        if requester is None:
            return self._route(namespace, hashes, exclude)
        snap = self._snap
        by_hash = snap.index.get(namespace)
        if not by_hash or not hashes:
            return Route(None, 0, namespace, hashes)
        members = snap.members
        early = set().union(*(by_hash.get(h, _NOBODY) for h in hashes[:snap.max_every]))
        candidates = {n for n in early if n in members and (n == requester or n not in exclude)}
        held = _held_prefixes(by_hash, hashes, {n: members[n].publish_every for n in candidates})
        own = held.pop(requester, 0)
        # the deepest serving prefix; ties to the least used peer, then the smallest node id
        best = min(held.items(), key=lambda item: (-item[1], members[item[0]].host_used, item[0]), default=None)
        if best is None or best[1] <= own:
            return Route(None, 0, namespace, hashes)
        return Route(members[best[0]], best[1], namespace, hashes)

    def _route(self, namespace: str, hashes: Sequence[bytes], exclude: Sequence[str]) -> Route:
        snap = self._snap
        by_hash = snap.index.get(namespace)
        n = len(hashes)
        if not by_hash or not n:
            return Route(None, 0, namespace, hashes)
        members = snap.members
        best = _best_holder(by_hash.get(hashes[-1]), exclude, members)
        if best is not None:
            return Route(best, n, namespace, hashes)
        k = min(n, snap.max_every)
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
            best = _best_holder(by_hash.get(hashes[n - 1 - j]), exclude, members)
            if best is not None:
                return Route(best, n - j, namespace, hashes)
            start = j + 1

    def held_prefix(self, node_id: str, namespace: str, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` ``node_id`` can serve, by what it announced (0 if it is not live).

        Unlike :meth:`depth_of` this stops at a hole: a node holds the blocks its engine computed, not
        those it loaded from a peer, so its chain may miss a stretch in the middle, and a lookup serves
        only the prefix before it. Walking from the root, a gap of ``publish_every`` unannounced
        hashes in a row (more than any of its runs leaves between announcements) ends the prefix.
        """
        snap = self._snap
        by_hash = snap.index.get(namespace)
        member = snap.members.get(node_id)
        if not by_hash or member is None:
            return 0
        return _held_prefixes(by_hash, hashes, {node_id: member.publish_every})[node_id]

    def depth_of(self, node_id: str, namespace: str, hashes: Sequence[bytes]) -> int:
        """How deep a prefix of ``hashes`` ``node_id`` announced (0 if none, or if it is not live)."""
        snap = self._snap
        by_hash = snap.index.get(namespace)
        if not by_hash or node_id not in snap.members:
            return 0
        for i in range(len(hashes) - 1, -1, -1):
            holders = by_hash.get(hashes[i])
            if holders and node_id in holders:
                return i + 1
        return 0


def _held_prefixes(by_hash: dict[bytes, Holders], hashes: Sequence[bytes], every: dict[str, int]) -> dict[str, int]:
    """For each node of ``every`` (node id -> its ``publish_every``), how many leading ``hashes`` it can
    serve: up to its last announced hash before the first gap of ``publish_every`` unannounced hashes in
    a row (see :meth:`Router.held_prefix`). The holder sets are fetched once; each node is then one
    C-speed pass that marks the hashes it announced as bytes, and two searches of them."""
    if not every:
        return {}
    holders = list(map(by_hash.get, hashes, repeat(_NOBODY)))
    depth = {}
    for node, n in every.items():
        marks = bytes(map(operator.contains, holders, repeat(node)))
        gap = marks.find(b"\x00" * max(1, n))
        depth[node] = marks.rfind(b"\x01", 0, len(marks) if gap < 0 else gap) + 1
    return depth


def _best_holder(holders: Holders | None, exclude: Sequence[str],
                 members: dict[str, MemberRecord]) -> MemberRecord | None:
    """Least used live holder, then smallest node id; ``None`` when no holder is live."""
    if not holders:
        return None
    live = [members[h] for h in holders if h in members and h not in exclude]
    return min(live, key=lambda m: (m.host_used, m.node_id)) if live else None


def _member(node_id: str, value: bytes) -> MemberRecord | None:
    """The member record a node key holds, ``None`` when it is not one for this node id."""
    record = MemberRecord.from_json(value)
    return record if record is not None and record.node_id == node_id else None


class _Resync(Exception):
    pass
