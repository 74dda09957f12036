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

Thread-safe: read on the scheduler thread (:meth:`HeldBlocks.lacking` without a lock), taught on
the loop thread.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

DEFAULT_CAPACITY = 65536  # (leaf, hash) pairs remembered
DEFAULT_MAX_AGE = 30.0  # seconds an entry is trusted

Pair = tuple[str, bytes]


class HeldBlocks:
    """A bounded, ageing set of ``(leaf, hash)`` pairs the co-located node holds on every TP shard."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_age: float = DEFAULT_MAX_AGE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[Pair, float] = OrderedDict()  # pair -> when learned, oldest first
        self._capacity = capacity
        self._max_age = max_age
        self._clock = clock

    def learn(self, held: Iterable[Pair] = (), absent: Iterable[Pair] = ()) -> None:
        """The node said it holds ``held`` and lacks ``absent``."""
        now = self._clock()
        held = held if isinstance(held, list) else list(held)
        with self._lock:
            seen = self._seen
            # popped, then entered anew: each learned pair goes to the young end (C-speed passes, no per-pair step)
            collections.deque(map(seen.pop, itertools.chain(absent, held), itertools.repeat(None)), maxlen=0)
            seen.update(zip(held, itertools.repeat(now)))
            while len(seen) > self._capacity:
                seen.popitem(last=False)

    def forget(self) -> None:
        """Forget everything: the node stopped answering, and may come back empty."""
        with self._lock:
            self._seen.clear()

    def holds(self, leaf: str, block_hash: bytes) -> bool:
        """True when the node said it holds the pair within the last ``max_age`` seconds."""
        with self._lock:
            learned = self._seen.get((leaf, block_hash))
            if learned is None:
                return False
            if self._clock() - learned > self._max_age:
                del self._seen[(leaf, block_hash)]
                return False
            return True

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
        seen = self._seen
        if not seen:
            return list(range(n))
        learned = list(map(seen.get, zip(itertools.repeat(leaf, n), hashes)))
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
                seen.pop((leaf, hashes[i]), None)  # aged out (atomic; a concurrent learn may have renewed it)
                keep.append(i)
        return keep

    def __len__(self) -> int:
        return len(self._seen)
