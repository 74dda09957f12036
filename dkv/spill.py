"""Staging for spills: evicted blocks whose bytes wait in memory for their disk write.

When the store evicts a host block and there is a disk tier, it copies the
slot's bytes into a staging buffer (a memcpy), frees the slot at once and
queues a :class:`SpillJob`; the server writes the file off the event loop and
reports back (:meth:`dkv.store.Store.finish_spill`). Staging memory is bounded:
when a block does not fit, the store drops it instead of waiting. A staged
block can be promoted straight from its buffer.

Everything here runs on the node's event-loop thread and does no I/O. A job
has three states: *queued* (staged, waiting for the server), *taken* (the
server is writing it; its buffer stays counted until the write ends) and
finished. A job whose block stopped wanting it (promoted, cleared, dropped)
is *cancelled*: a queued one is forgotten at once, a taken one when its write
ends.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from dkv.disk_tier import DiskEntry

DEFAULT_STAGING_BYTES = 64 * 2**20


@dataclass(eq=False, slots=True)
class SpillJob:
    """One block's spill: its bytes, and the disk space reserved for its file."""

    key: Hashable
    data: bytearray
    entry: DiskEntry
    taken: bool = False  # handed to the server: the write may be running
    cancelled: bool = False  # the block no longer wants this file


class Staging:
    """Queued and in-flight spill jobs, one current job per key, within ``capacity`` bytes."""

    def __init__(self, capacity: int = DEFAULT_STAGING_BYTES) -> None:
        if capacity < 0:
            raise ValueError("staging capacity must not be negative")
        self.capacity = capacity
        self.used = 0  # bytes of queued and taken jobs (cancelled taken ones included)
        self._current: dict[Hashable, SpillJob] = {}  # key -> the job holding its bytes
        self._queue: dict[Hashable, SpillJob] = {}  # not yet taken, oldest first
        self._taken: set[SpillJob] = set()  # being written (cancelled ones included)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._current

    def __len__(self) -> int:
        return len(self._current)

    def fits(self, size: int) -> bool:
        return self.used + size <= self.capacity

    def get(self, key: Hashable) -> SpillJob | None:
        """The job holding ``key``'s bytes (queued or being written), or ``None``."""
        return self._current.get(key)

    def add(self, job: SpillJob) -> None:
        """Stage and queue ``job`` (the caller checked :meth:`fits`; ``job.key`` is not staged)."""
        if job.key in self._current:
            raise ValueError(f"{job.key!r} is already staged")
        self._current[job.key] = job
        self._queue[job.key] = job
        self.used += len(job.data)

    def take(self) -> SpillJob | None:
        """The oldest queued job, now taken (its write must end with :meth:`finish`); ``None`` if none."""
        if not self._queue:
            return None
        key = next(iter(self._queue))
        job = self._queue.pop(key)
        job.taken = True
        self._taken.add(job)
        return job

    def cancel(self, key: Hashable) -> SpillJob | None:
        """Unstage ``key``'s job (its block left the staged state); ``None`` if none.

        A queued job is forgotten now (its bytes freed; no file was written).
        A taken one is marked cancelled and stays counted until :meth:`finish`.
        """
        job = self._current.pop(key, None)
        if job is None:
            return None
        job.cancelled = True
        if not job.taken:
            del self._queue[key]
            self.used -= len(job.data)
        return job

    def finish(self, job: SpillJob) -> bool:
        """A taken job's write ended: free its bytes; True when it was still its key's current job.

        A current job is unstaged here; a cancelled one was already. A job
        that is not being written (never taken, finished, or forgotten by
        :meth:`clear`) answers False and changes nothing.
        """
        if job not in self._taken:
            return False
        self._taken.discard(job)
        self.used -= len(job.data)
        if job.cancelled:
            return False
        del self._current[job.key]
        return True

    def clear(self) -> None:
        """Forget everything (the store is closing)."""
        for job in self._current.values():
            job.cancelled = True
        self._current.clear()
        self._queue.clear()
        self._taken.clear()
        self.used = 0
