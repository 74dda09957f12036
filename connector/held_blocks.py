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

Asked about an offload's fresh hashes, the dicts would be probed one hash
after another, each probe a chain of cache misses on a scheduler thread whose
caches the model step has just swept (64 fresh hashes against 64 Ki
remembered: 3.6 µs warm, 42 µs cold). So each generation also keeps a filter
(:mod:`dkv._hash_filter`: bits set for every pair it learned, keyed by hash
alone), whose probes do not depend on each other: the dicts are asked only
about the hashes it cannot rule out (about 0.2 % of fresh ones). A pair
forgotten (absent, aged out) keeps its bits until its generation is
forgotten whole; that costs a dict probe, never a wrong answer. Without the
native build the dicts answer alone.

Thread-safe: read on the scheduler thread (:meth:`HeldBlocks.lacking` without a lock), taught on
the loop thread.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence

try:  # the filter probed before the dicts; without the native build the dicts answer alone
    from dkv._hash_filter import mark as _mark_filter
    from dkv._hash_filter import maybe as _filter_maybe
except ImportError:
    _mark_filter = _filter_maybe = None

DEFAULT_CAPACITY = 65536  # (leaf, hash) pairs remembered
FILTER_BITS_PER_PAIR = 64  # a generation's filter bits per pair it may hold: about 0.1 % false "maybe" each
DEFAULT_MAX_AGE = 30.0  # seconds an entry is trusted

Generation = dict[str, dict[bytes, float]]  # leaf -> hash -> when learned


class HeldBlocks:
    """A bounded, ageing set of ``(leaf, hash)`` pairs the co-located node holds on every TP shard."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_age: float = DEFAULT_MAX_AGE,
                 clock: Callable[[], float] = time.monotonic, filter_bits: int = FILTER_BITS_PER_PAIR) -> None:
        """``filter_bits``: each generation's filter bits per pair (0: no filter, the dicts answer alone)."""
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2: {capacity}")
        self._lock = threading.Lock()
        self._young: Generation = {}
        self._old: Generation = {}
        self._young_size = 0  # entries in the young generation, over every leaf
        self._half = capacity // 2
        self._max_age = max_age
        self._clock = clock
        if filter_bits < 0:
            raise ValueError(f"filter_bits must be at least 0: {filter_bits}")
        self._filter_bytes = filter_bytes(self._half, filter_bits) if _filter_maybe is not None and filter_bits else 0
        self._young_bits = self._new_bits()
        self._old_bits = self._new_bits()

    def _new_bits(self) -> bytearray | None:
        """An empty filter for a generation; ``None`` without the native build (or once a learn could not mark it)."""
        return bytearray(self._filter_bytes) if self._filter_bytes else None

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
                self._old, self._young, self._young_size, self._old_bits, self._young_bits = (
                    self._young, {}, 0, self._young_bits, self._new_bits())
            young = self._young.get(leaf)
            if young is None:
                young = self._young[leaf] = {}
            before = len(young)
            young.update(zip(held, itertools.repeat(now)))
            self._young_size += len(young) - before
            bits = self._young_bits
            if bits is not None:
                try:
                    _mark_filter(bits, held if type(held) in (list, tuple) else list(held))
                except (TypeError, ValueError):  # not plain hashes: a filter that missed a pair must not be asked
                    self._filter_bytes = 0
                    self._young_bits = self._old_bits = None

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
            self._young_bits, self._old_bits = self._new_bits(), self._new_bits()

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
        The filters answer first; the dicts only for what they cannot rule out.
        """
        young_bits, old_bits = self._young_bits, self._old_bits
        if young_bits is None or type(hashes) not in (list, tuple):
            return self._lacking_exactly(leaf, hashes)
        try:
            maybe = _filter_maybe(hashes, young_bits, old_bits)
        except (TypeError, ValueError):  # not plain hashes: the dicts answer
            return self._lacking_exactly(leaf, hashes)
        n = len(hashes)
        if maybe is None:  # the usual offload: new blocks, none known
            return list(range(n))
        if len(maybe) == n:
            return self._lacking_exactly(leaf, hashes)
        kept = set(range(n)).difference(maybe)  # surely not held
        kept.update(maybe[i] for i in self._lacking_exactly(leaf, [hashes[i] for i in maybe]))
        return sorted(kept)

    def _lacking_exactly(self, leaf: str, hashes: Sequence[bytes]) -> list[int]:
        """:meth:`lacking` answered by the dicts alone."""
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


def filter_bytes(pairs: int, bits_per_pair: int = FILTER_BITS_PER_PAIR) -> int:
    """The bytes of a generation's filter for ``pairs`` pairs: a power of two, at least ``bits_per_pair`` bits each."""
    need = max(1, pairs * bits_per_pair // 8)
    return 1 << (need - 1).bit_length()
