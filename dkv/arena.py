"""The host block pool: a byte budget over per-namespace memory segments, carved into slots.

Isolation is by construction. Each namespace's blocks live in a segment of
their own: an anonymous ``memfd`` (no name under ``/dev/shm``, nothing left
behind by a killed node) that is sparse, so a page exists only under a live
slot. A same-host client is handed *its own namespace's* segment by file
descriptor after authentication (:mod:`dkv.handover`), read-only when its
credential only reads; no client can map another namespace's memory.

Freed bytes never come back: :meth:`Arena.free` zeroes the slot, so a slot
handed out again holds zeros until its writer fills it. The zeroed pages stay
mapped, so the next block of that namespace (usually of the same size: the
allocator reuses an exact fit first) is written without page faults, which
cost far more than the zeroing. Freed-but-mapped memory is bounded: each
segment counts the freed bytes it still has mapped (a reuse in that segment
takes them back), and once the bytes in use plus those of every segment pass
``size`` plus :data:`TRIM_SLACK` of it (at most 1 GiB) — memory that one
namespace freed while another grows — :meth:`Arena.allocate` calls
:meth:`Arena.trim`, which returns the free runs' pages to the system
(``MADV_REMOVE``). One namespace that frees and refills, however much at once,
never pays page faults again; the pool's memory stays within ``size`` plus the
slack whatever mix of namespaces churns through it.

Every slot starts on a 4 KiB boundary (unaligned copies are several times
slower here). Allocation within a segment is first-fit over a sorted run list
with coalescing on free and an exact-size fast path (blocks of one namespace
layout share one size). The arena does no eviction: the store decides what to
free when :meth:`Arena.allocate` returns ``None``.

The node's segments are not registered with CUDA: a same-host connector copies
between its own mapping and its own pinned staging, and the node's own sends
and receives are host-to-host.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import stat

import numpy as np

from dkv.errors import ConfigError

log = logging.getLogger(__name__)

PAGE = 4096
DEFAULT_MAX_NAMESPACES = 256
TRIM_SLACK = 1 / 8  # of the pool: freed memory kept resident for reuse before it is returned
MAX_TRIM_SLACK = 2**30


def align_up(nbytes: int, alignment: int = PAGE) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment``."""
    return (nbytes + alignment - 1) // alignment * alignment


class SlotAllocator:
    """First-fit allocator of page-aligned runs inside ``[0, capacity)``; no I/O."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % PAGE
        self._starts: list[int] = [0] if self.capacity else []
        self._length: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._by_size: dict[int, set[int]] = {}
        if self.capacity:
            self._by_size[self.capacity] = {0}
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free run of ``align_up(nbytes)`` bytes, or ``None`` if none is free."""
        size = align_up(max(nbytes, 1))
        exact = self._by_size.get(size)
        if exact:
            start = next(iter(exact))
            self._take(start, size)
            return start
        for start in self._starts:
            if self._length[start] >= size:
                self._take(start, size)
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return the run at ``offset`` (as allocated for ``nbytes``), merging with its neighbours."""
        size = align_up(max(nbytes, 1))
        self.used -= size
        i = bisect.bisect_left(self._starts, offset)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._length[prev] == offset:
                self._drop(prev)
                offset, size = prev, size + (offset - prev)
                i -= 1
        if i < len(self._starts) and self._starts[i] == offset + size:
            nxt = self._starts[i]
            size += self._length[nxt]
            self._drop(nxt)
        self._add(offset, size)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def _take(self, start: int, size: int) -> None:
        length = self._length[start]
        self._drop(start)
        if length > size:
            self._add(start + size, length - size)
        self.used += size

    def free_runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every free run, in address order."""
        return [(start, self._length[start]) for start in self._starts]

    def _add(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._length[start] = length
        self._by_size.setdefault(length, set()).add(start)

    def _drop(self, start: int) -> None:
        length = self._length.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        bucket = self._by_size[length]
        bucket.discard(start)
        if not bucket:
            del self._by_size[length]


class Segment:
    """One namespace's memory: a sparse anonymous memfd of ``span`` bytes, mapped read-write by the node."""

    def __init__(self, namespace: str, span: int, label: str) -> None:
        self.namespace = namespace
        self.span = span
        self.fd = os.memfd_create(f"dkv-{label}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, span)
            self._mmap = mmap.mmap(self.fd, span, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._mmap)
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)  # zeroing without a temporary buffer
        self.allocator = SlotAllocator(span)
        self.resident_free = 0  # freed bytes whose pages are still mapped (a reuse here takes them back)
        self.holders = 0  # connections that were handed this segment and are still open

    @property
    def idle(self) -> bool:
        """True when nothing lives in it and no connection holds it mapped: it may be dropped."""
        return self.allocator.used == 0 and self.holders == 0

    def share(self, writable: bool) -> int:
        """A new descriptor of this segment for a client (read-only unless ``writable``); the caller closes it."""
        if writable:
            return os.dup(self.fd)
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)  # cannot be mapped writable

    def zero(self, offset: int, length: int) -> None:
        self._bytes[offset : offset + length] = 0

    def release_pages(self, offset: int, length: int) -> None:
        """Give the pages of ``[offset, offset + length)`` back to the system; they read as zeros afterwards."""
        self._mmap.madvise(mmap.MADV_REMOVE, offset, length)

    def release_free_runs(self) -> None:
        """Give back the pages of every free run (what :meth:`Arena.trim` does per segment)."""
        for start, length in self.allocator.free_runs():
            self.release_pages(start, length)

    def close(self) -> None:
        if self._mmap.closed:
            return
        self.view.release()
        del self._bytes
        try:
            self._mmap.close()
        except BufferError:  # a view still exported somewhere: the fd still goes
            log.warning("segment of %s still has exported views at close", self.namespace)
        os.close(self.fd)


class Arena:
    """A node's host pool: ``size`` bytes of slots shared by all namespaces, each in its own :class:`Segment`.

    Owned by exactly one node process, which must call :meth:`close`. A
    namespace's segment is made on its first allocation or handover; at most
    ``max_namespaces`` exist, and to make room for another, one that holds no
    block and is mapped by no open connection (:meth:`hold`, :meth:`let_go`)
    is dropped. A client therefore never keeps a segment the node replaced.
    """

    def __init__(self, size: int, *, label: str = "node", max_namespaces: int = DEFAULT_MAX_NAMESPACES) -> None:
        if size < PAGE:
            raise ConfigError(f"pool size must be at least {PAGE} bytes, got {size}")
        self.size = align_up(size)
        self.label = label
        self.max_namespaces = max_namespaces
        self.used = 0
        self.trim_slack = min(int(self.size * TRIM_SLACK), MAX_TRIM_SLACK)
        self.trims = 0
        self._segments: dict[str, Segment] = {}
        self._closed = False

    @property
    def capacity(self) -> int:
        return self.size

    @property
    def free_bytes(self) -> int:
        return self.size - self.used

    @property
    def segments(self) -> int:
        return len(self._segments)

    def segment(self, namespace: str) -> Segment | None:
        """``namespace``'s segment, made now if it has none; ``None`` when the namespace bound is reached."""
        seg = self._segments.get(namespace)
        if seg is None:
            if self._closed:
                return None
            if len(self._segments) >= self.max_namespaces:
                idle = next((s for s in self._segments.values() if s.idle), None)
                if idle is None:
                    return None
                del self._segments[idle.namespace]
                idle.close()
            seg = self._segments[namespace] = Segment(namespace, self.size, self.label)
        return seg

    def hold(self, namespace: str) -> None:
        """A connection was handed ``namespace``'s segment: keep it while that connection is open."""
        self._segments[namespace].holders += 1

    def let_go(self, namespace: str) -> None:
        """A connection that held ``namespace``'s segment ended."""
        seg = self._segments.get(namespace)
        if seg is not None:
            seg.holders = max(0, seg.holders - 1)

    def allocate(self, namespace: str, nbytes: int) -> int | None:
        """Offset of a slot of ``align_up(nbytes)`` bytes in ``namespace``'s segment, or ``None``.

        ``None`` when the pool's budget is spent (the store evicts and tries
        again), the segment has no run that large, or no segment can be made.
        """
        need = align_up(max(nbytes, 1))
        if self.used + need > self.size:
            return None
        seg = self.segment(namespace)
        if seg is None:
            return None
        offset = seg.allocator.alloc(nbytes)
        if offset is not None:
            self.used += need
            seg.resident_free = max(0, seg.resident_free - need)  # most likely a reused, resident run
            if self.used + self.resident_free > self.size + self.trim_slack:
                self.trim()  # another namespace's freed pages are still mapped while this one grows
        return offset

    def free(self, namespace: str, offset: int, nbytes: int) -> None:
        """Return a slot, zeroed: nothing of it is ever read again (its pages stay mapped for reuse)."""
        seg = self._segments[namespace]
        size = align_up(max(nbytes, 1))
        seg.zero(offset, size)  # cheaper than faulting fresh pages in on reuse
        seg.allocator.free(offset, nbytes)
        self.used -= size
        seg.resident_free += size

    def trim(self) -> None:
        """Return the pages of every free run of every segment to the system (bounded by free runs)."""
        for seg in self._segments.values():
            if seg.resident_free:
                seg.release_free_runs()
                seg.resident_free = 0
        self.trims += 1

    @property
    def resident_free(self) -> int:
        """Freed bytes still mapped, over all segments (an upper bound: what :meth:`trim` would give back)."""
        return sum(seg.resident_free for seg in self._segments.values())

    def slot(self, namespace: str, offset: int, nbytes: int) -> memoryview:
        """The ``nbytes`` of ``namespace``'s slot at ``offset`` (a view, no copy; a zero-byte block owns none)."""
        if nbytes == 0:
            return memoryview(bytearray())
        return self._segments[namespace].view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap and close every segment. Idempotent."""
        self._closed = True
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


class SegmentMapping:
    """A same-host client's mapping of one namespace segment it was handed (read-only unless writable)."""

    def __init__(self, fd: int, size: int, writable: bool) -> None:
        """Map ``size`` bytes of ``fd`` (the caller keeps and closes ``fd``)."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < size:
            raise ValueError("the handed-over descriptor is not a segment of the announced size")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        self.identity = (info.st_dev, info.st_ino)  # the same segment handed over twice maps once
        self.size = size
        self.writable = writable
        self.view = memoryview(self._mmap)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) outside the segment")
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        if not self._mmap.closed:
            self.view.release()
            try:
                self._mmap.close()
            except BufferError:
                log.debug("segment mapping closed with live views")

