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

Bounded by generations, not by an order kept per entry: pairs are learned
into the young generation; once it would hold more than half the capacity
it becomes the old one and the previous old one is forgotten whole. Pairs it
already holds count for nothing (they only get a new time), so a prefix
taught again by every lookup does not age what offloads taught. So at most
``capacity`` entries are remembered, a pair learned within the last half
capacity of learning is always still there, and learning is one C-speed
dict pass per leaf (no per-pair reordering). Each leaf has its own map keyed
by the hash bytes, whose hash Python caches.

Thread-safe: read on the scheduler thread (:meth:`HeldBlocks.lacking` without a lock), taught on
the loop thread.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence

DEFAULT_CAPACITY = 65536  # (leaf, hash) pairs remembered
DEFAULT_MAX_AGE = 30.0  # seconds an entry is trusted

Generation = dict[str, dict[bytes, float]]  # leaf -> hash -> when learned


class HeldBlocks:
    """A bounded, ageing set of ``(leaf, hash)`` pairs the co-located node holds on every TP shard."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_age: float = DEFAULT_MAX_AGE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2: {capacity}")
        self._lock = threading.Lock()
        self._young: Generation = {}
        self._old: Generation = {}
        self._young_size = 0  # entries in the young generation, over every leaf
        self._half = capacity // 2
        self._max_age = max_age
        self._clock = clock

    def learn(self, leaf: str, held: Sequence[bytes] = (), absent: Sequence[bytes] = ()) -> None:
        """The node said it holds ``held`` of ``leaf`` (on every shard) and lacks ``absent``."""
        now = self._clock()
        if len(held) > self._half:
            held = held[len(held) - self._half:]  # more than a generation: the last learned are kept
        with self._lock:
            if absent:
                for generation in (self._young, self._old):
                    known = generation.get(leaf)
                    if known:
                        before = len(known)
                        collections.deque(map(known.pop, absent, itertools.repeat(None)), maxlen=0)
                        if generation is self._young:
                            self._young_size -= before - len(known)
            if not held:
                return
            if self._young_size + self._new_to_young(leaf, held) > self._half:  # it would overflow: it ages
                self._old, self._young, self._young_size = self._young, {}, 0
            young = self._young.get(leaf)
            if young is None:
                young = self._young[leaf] = {}
            before = len(young)
            young.update(zip(held, itertools.repeat(now)))
            self._young_size += len(young) - before

    def _new_to_young(self, leaf: str, held: Sequence[bytes]) -> int:
        """Under the lock: how many of ``held`` the young generation lacks (what learning them adds to it).

        Pairs the young generation already has only get a new time: a hot
        prefix that every lookup teaches again must not age the generations
        (and push out what offloads taught) as if it were new each time. One
        C-speed pass, taken only when ``held`` could make the generation overflow.
        """
        if self._young_size + len(held) <= self._half:
            return len(held)
        young = self._young.get(leaf)
        return len(held) - (sum(map(young.__contains__, held)) if young else 0)

    def forget(self) -> None:
        """Forget everything: the node stopped answering, and may come back empty."""
        with self._lock:
            self._young, self._old, self._young_size = {}, {}, 0

    def holds(self, leaf: str, block_hash: bytes) -> bool:
        """True when the node said it holds the pair within the last ``max_age`` seconds."""
        return not self.lacking(leaf, [block_hash])

    def lacking(self, leaf: str, hashes: Sequence[bytes]) -> list[int]:
        """Indexes into ``hashes`` of the blocks of ``leaf`` the node is not known to hold (as :meth:`holds`).

        The scheduler thread asks this per offload, so it takes no lock: the
        writers (the loop thread) hold the lock through a whole batch, and a
        reader that waited for it would wait for the loop thread to get the
        GIL back. Each dict operation, and the swap of generations, is atomic
        under the GIL, so a read concurrent with :meth:`learn` sees each pair
        either learned or not, which is all this advisory memory promises.
        """
        n = len(hashes)
        young, old = self._young.get(leaf), self._old.get(leaf)
        if (not young or young.keys().isdisjoint(hashes)) and (not old or old.keys().isdisjoint(hashes)):
            return list(range(n))  # the usual offload: new blocks, none known (C-speed probes, no list made)
        learned = list(map(young.get, hashes)) if young else [None] * n
        misses = learned.count(None)
        if old and misses:
            if misses == n:  # none learned lately (the usual offload: new blocks): one C-speed pass over the old
                learned = list(map(old.get, hashes))
            else:
                learned = [old.get(h) if when is None else when for when, h in zip(learned, hashes)]
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
                for generation in (young, old):  # aged out (atomic; a concurrent learn may have renewed it)
                    if generation:
                        generation.pop(hashes[i], None)
                keep.append(i)
        return keep

    def __len__(self) -> int:
        """Entries remembered over both generations (a pair in both counts twice): at most ``capacity``."""
        return sum(map(len, self._young.values())) + sum(map(len, self._old.values()))
