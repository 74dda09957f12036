"""How many leases a connector holds on each node, kept within what the node allows one client.

A node grants each client at most ``max_leases`` leases (it announces the
number in its handshake); one more ends the client's oldest, silently. An
engine with more outstanding ``start_lookup`` handles than that would lose a
lease it still means to load from, and the load would break after posting.
So the connector takes a slot here before it asks for a lease, and a lookup
that finds no slot is answered as a miss without asking (counted). A slot is
given back only once the node has ended its lease — the read that ended it
returned, the release was answered, the next ``lookup()`` of the same replica
was answered (its slot passes to that lookup), or the lookup granted no lease —
so the node never holds more than its limit; a slot whose lease's TTL has
passed lapses on its own.

Thread-safe: slots are taken on the loop thread (before it asks the node) and given back from the
scheduler thread or the loop thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

Slot = int


class LeaseBudget:
    """Per-node slots for leases; never more taken than the node's limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, dict[Slot, float]] = {}  # address -> slot -> lapses at
        self._by_lease: dict[tuple[str, int], Slot] = {}  # (address, lease id) -> its slot
        self._slots = itertools.count(1)
        self._clock = clock

    def take(self, address: str, limit: int, hold_for: float) -> Slot | None:
        """A slot on ``address`` for at most ``hold_for`` seconds, or ``None`` when ``limit`` are held."""
        with self._lock:
            held = self._held.setdefault(address, {})
            now = self._clock()
            if len(held) >= limit:  # (lapsed slots only matter once the budget is full: swept then)
                for slot in [s for s, until in held.items() if until <= now]:
                    del held[slot]  # its lease has expired on the node by now (its _by_lease entry is swept later)
                if len(held) >= limit:
                    return None
            slot = next(self._slots)
            held[slot] = now + hold_for
            return slot

    def bind(self, address: str, slot: Slot | None, lease_id: int, until: float) -> None:
        """The slot's lease was granted as ``lease_id`` and lapses at ``until`` (monotonic clock)."""
        if slot is None:
            return
        with self._lock:
            held = self._held.get(address)
            if held is not None and slot in held:
                held[slot] = until
                self._by_lease[(address, lease_id)] = slot

    def give_back_lease(self, address: str, lease_id: int) -> None:
        """The node has ended ``lease_id``: its slot is free. Idempotent; unknown leases are ignored."""
        with self._lock:
            slot = self._by_lease.pop((address, lease_id), None)
            if slot is not None:
                self._free_locked(address, slot)

    def give_back(self, address: str, slot: Slot | None) -> None:
        """Its lease has ended (or was never granted). Idempotent; ``None`` is ignored."""
        if slot is None:
            return
        with self._lock:
            self._free_locked(address, slot)

    def _free_locked(self, address: str, slot: Slot) -> None:
        held = self._held.get(address)
        if held is not None:
            held.pop(slot, None)
            if not held:
                del self._held[address]
        by_lease = self._by_lease
        if len(by_lease) > 64 and len(by_lease) > 4 * sum(map(len, self._held.values())) + 64:
            live = {(a, s) for a, h in self._held.items() for s in h}  # (lapsed slots' leases: swept here)
            self._by_lease = {k: s for k, s in by_lease.items() if (k[0], s) in live}

    def held(self, address: str) -> int:
        """Slots held on ``address`` now (lapsed ones included until a :meth:`take` finds the budget full)."""
        with self._lock:
            return len(self._held.get(address, ()))
