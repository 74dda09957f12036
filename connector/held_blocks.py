"""What the co-located node is known to hold, so that an offload copies only what it lacks.

The protocol: "An offload that moved nothing returns a CompletedTransfer and
is pinned nowhere." ``offload`` must decide on the scheduler thread, without a
round trip, which device blocks to copy and keep pinned; it skips the
``(leaf, hash)`` pairs this memory says the node holds. The memory learns from
what the node said: an offload's statuses (stored, or already there) and the
co-located node's lookup masks (present or absent). It is bounded in size and
in age: the node may evict a block without telling anyone, and a stale entry
costs at most one skipped offload of a block the node since dropped, never
wrong bytes.

Bounded by the order of learning: each batch of pairs learned is queued
with its stamp; once the queued batches name more than ``capacity`` pairs,
the oldest are forgotten, each pair only where no later batch learned it
again (its stamp is still the batch's). Every pair remembered is in a
queued batch, so at most ``capacity`` entries are remembered (and queued);
the pairs of the newest batches that together name at most ``capacity``
are still there (unless the node since said it lacks them); and learning
and forgetting are C-speed passes per batch. Each leaf has one map keyed by the
hash bytes, whose hash Python caches: an offload asks one map per block.
(Two generations, young and old, cost an offload of new blocks a second
lookup per block, into a second large map: 29 against 15 µs for 64 new
blocks, timed in place on the scheduler thread.)

Thread-safe: read on the scheduler thread (:meth:`HeldBlocks.lacking` without a lock), taught on
the loop thread.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
import threading
import time
from collections.abc import Callable, Sequence

DEFAULT_CAPACITY = 65536  # (leaf, hash) pairs remembered
DEFAULT_MAX_AGE = 30.0  # seconds an entry is trusted

Known = dict[str, dict[bytes, float]]  # leaf -> hash -> the stamp of the batch that last learned it


class HeldBlocks:
    """A bounded, ageing set of ``(leaf, hash)`` pairs the co-located node holds on every TP shard."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_age: float = DEFAULT_MAX_AGE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2: {capacity}")
        self._lock = threading.Lock()
        self._known: Known = {}
        self._batches: collections.deque[tuple[str, float, Sequence[bytes]]] = collections.deque()
        self._queued = 0  # pairs named by the queued batches (learned again or not)
        self._capacity = capacity
        self._max_age = max_age
        self._clock = clock
        self._last_stamp = -math.inf

    def _stamp(self) -> float:
        """Under the lock: now, made later than every earlier batch's stamp (a stamp names its batch)."""
        now = self._clock()
        if now <= self._last_stamp:
            now = math.nextafter(self._last_stamp, math.inf)
        self._last_stamp = now
        return now

    def learn(self, leaf: str, held: Sequence[bytes] = (), absent: Sequence[bytes] = ()) -> None:
        """The node said it holds ``held`` of ``leaf`` (on every shard) and lacks ``absent``."""
        if len(held) > self._capacity:
            held = held[len(held) - self._capacity:]  # more than the memory: the last learned are kept
        with self._lock:
            if absent:
                known = self._known.get(leaf)
                if known:
                    collections.deque(map(known.pop, absent, itertools.repeat(None)), maxlen=0)
            if not held:
                return
            known = self._known.get(leaf)
            if known is None:
                known = self._known[leaf] = {}
            stamp = self._stamp()
            known.update(zip(held, itertools.repeat(stamp)))
            self._batches.append((leaf, stamp, tuple(held)))  # a copy: the caller's list may change
            self._queued += len(held)
            while self._queued > self._capacity:
                self._forget_oldest_batch()

    def _forget_oldest_batch(self) -> None:
        """Under the lock: forget the oldest batch's pairs that no later batch learned again."""
        leaf, stamp, hashes = self._batches.popleft()
        self._queued -= len(hashes)
        known = self._known.get(leaf)
        if known:
            stale = itertools.compress(hashes, map(operator.eq, map(known.get, hashes), itertools.repeat(stamp)))
            collections.deque(map(known.pop, list(stale), itertools.repeat(None)), maxlen=0)

    def forget(self) -> None:
        """Forget everything: the node stopped answering, and may come back empty."""
        with self._lock:
            self._known, self._batches, self._queued = {}, collections.deque(), 0

    def holds(self, leaf: str, block_hash: bytes) -> bool:
        """True when the node said it holds the pair within the last ``max_age`` seconds."""
        return not self.lacking(leaf, [block_hash])

    def lacking(self, leaf: str, hashes: Sequence[bytes]) -> list[int]:
        """Indexes into ``hashes`` of the blocks of ``leaf`` the node is not known to hold (as :meth:`holds`).

        The scheduler thread asks this per offload, so it takes no lock: the
        writers (the loop thread) hold the lock through a whole batch, and a
        reader that waited for it would wait for the loop thread to get the
        GIL back. Each dict operation is atomic under the GIL, so a read
        concurrent with :meth:`learn` sees each pair either learned or not,
        which is all this advisory memory promises.
        """
        n = len(hashes)
        known = self._known.get(leaf)
        if not known:
            return list(range(n))
        learned = list(map(known.get, hashes))
        misses = learned.count(None)
        if misses == n:  # the usual offload: new blocks, none known
            return list(range(n))
        oldest = self._clock() - self._max_age
        if not misses and min(learned) >= oldest:  # type: ignore[type-var]
            return []
        keep = []
        for i, when in enumerate(learned):
            if when is None:
                keep.append(i)
            elif when < oldest:
                known.pop(hashes[i], None)  # aged out (atomic; a concurrent learn may have renewed it)
                keep.append(i)
        return keep

    def __len__(self) -> int:
        """Entries remembered: at most ``capacity``."""
        return sum(map(len, self._known.values()))
