"""The host block pool: one page-aligned shared-memory arena per node, carved into slots.

The node creates the arena as a file under ``/dev/shm`` (so a connector on the
same machine can map it and copy without a socket), reserves its pages up front
with ``posix_fallocate`` (a too-small ``/dev/shm`` fails at start, not with a
SIGBUS later), and hands out page-aligned slots. Unaligned copies are several
times slower here, so every slot starts on a 4 KiB boundary.

When CUDA is present the arena is registered as pinned host memory so that
device copies can DMA straight from it; without CUDA it stays plain pages.

Allocation is first-fit over a sorted run list with coalescing on free and an
exact-size fast path (blocks of one namespace layout share one size, so a freed
slot is reused as is). The arena does no eviction: the store decides what to
free when :meth:`Arena.alloc` returns ``None``.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import secrets
from dataclasses import dataclass

from dkv.errors import ConfigError

log = logging.getLogger(__name__)

PAGE = 4096
SHM_DIR = "/dev/shm"


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


@dataclass(frozen=True)
class ArenaInfo:
    """What a same-host client needs to map the arena: its shm name and size."""

    shm_name: str
    size: int


class Arena:
    """A node's host pool: a shared-memory mapping and the slot allocator over it.

    Owned by exactly one node process, which must call :meth:`close` (the file
    under ``/dev/shm`` is unlinked there). Clients map it with :class:`ArenaMapping`.
    """

    def __init__(self, size: int, *, label: str = "node", pin: str = "auto") -> None:
        if size < PAGE:
            raise ConfigError(f"pool size must be at least {PAGE} bytes, got {size}")
        size = align_up(size)
        self.shm_name = f"dkv-{label}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.shm_name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ConfigError(
                    f"cannot reserve a {size}-byte pool in {SHM_DIR} ({exc.strerror}): "
                    "lower --pool or enlarge /dev/shm (docker: shm_size)"
                ) from exc
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.size = size
        self.view = memoryview(self._mmap)
        self.allocator = SlotAllocator(size)
        self._pin = _pin_host_memory(self._mmap, size) if pin != "off" else None

    @property
    def pinned(self) -> bool:
        """True when the arena is registered with CUDA as pinned host memory."""
        return self._pin is not None

    @property
    def info(self) -> ArenaInfo:
        return ArenaInfo(self.shm_name, self.size)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        """The ``nbytes`` of the slot at ``offset`` (a view, no copy)."""
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap and unlink the arena. Idempotent."""
        if self._mmap.closed:
            return
        if self._pin is not None:
            _unpin_host_memory(self._pin)
            self._pin = None
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:  # a view still exported somewhere: unlink anyway
            log.warning("arena %s still has exported views at close", self.shm_name)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ArenaMapping:
    """A same-host client's mapping of a node's arena (read and write through slot views)."""

    def __init__(self, info: ArenaInfo) -> None:
        if "/" in info.shm_name or not info.shm_name.startswith("dkv-"):
            raise ValueError(f"not a dKV arena name: {info.shm_name!r}")
        fd = os.open(os.path.join(SHM_DIR, info.shm_name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < info.size:
                raise ValueError(f"arena {info.shm_name} is smaller than announced")
            self._mmap = mmap.mmap(fd, info.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.info = info
        self.view = memoryview(self._mmap)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > self.info.size:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) outside the arena")
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        if not self._mmap.closed:
            self.view.release()
            try:
                self._mmap.close()
            except BufferError:
                log.debug("arena mapping %s closed with live views", self.info.shm_name)


def open_mapping(info: ArenaInfo) -> ArenaMapping | None:
    """Map a node's arena if it is reachable from this process, else ``None``."""
    try:
        return ArenaMapping(info)
    except (OSError, ValueError) as exc:
        log.debug("arena %s not mappable here: %s", info.shm_name, exc)
        return None


def _pin_host_memory(buffer: mmap.mmap, size: int) -> object | None:
    """Register the arena with CUDA as pinned memory when a GPU is present.

    Returns the handle :func:`_unpin_host_memory` takes, or ``None`` when the
    arena stays pageable (no GPU, no torch, or registration refused).
    """
    if not os.path.exists("/dev/nvidiactl"):
        return None
    try:
        import ctypes

        import torch

        if not torch.cuda.is_available():
            return None
        anchor = ctypes.c_char.from_buffer(buffer)
        err = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(anchor), size, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister failed (%s); arena stays pageable", err)
            return None
        return anchor
    except Exception as exc:  # noqa: BLE001 - pinning is an optimisation, never fatal
        log.warning("could not pin the arena: %s", exc)
        return None


def _unpin_host_memory(anchor: object) -> None:
    import ctypes

    import torch

    torch.cuda.cudart().cudaHostUnregister(ctypes.addressof(anchor))
