"""The node's disk mover: one thread for all file I/O, and the task that writes the store's spills.

DESIGN §6: the store decides, the server moves — including disk. The store
queues spills (:meth:`dkv.store.Store.take_spill`) and plans promotion reads
(:meth:`dkv.store.Store.disk_reads`); :class:`DiskWorker` runs the file I/O on
one daemon thread (:class:`DiskThread`) and reports every outcome back to the
store on the event-loop thread, so the disk tier's accounting only ever
changes there. The thread only opens, writes, renames, reads and unlinks.

Everything is bounded: staging memory (the store's), the bytes promotion reads
hold at once, how long a lookup waits for its reads, and how long shutdown
waits for a stuck disk. The thread is a daemon, so a write that never returns
cannot keep the node's process from exiting.

A full or vanished tier degrades to memory only (the store's half: see
:mod:`dkv.disk_tier`). The worker's half: every ``check_interval`` it checks
on the disk thread that the tier's directory is still the one it made, and
tells the store when it is not (:meth:`dkv.store.Store.disk_vanished`: those
blocks' files are gone), without waiting for a spill or a read to fail; and
before it writes a spill while the tier is degraded (a probe), it makes the
directory again if it vanished (:meth:`dkv.disk_tier.DiskTier.reopen`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dkv.disk_tier import MISSING, DiskTier
from dkv.store import Promoted, Store, StoreKey

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT = 2.0  # a lookup waits this long for its reads, then promotes nothing
DEFAULT_CLOSE_TIMEOUT = 5.0  # shutdown waits this long for the disk thread's last work
DEFAULT_CHECK_INTERVAL = 1.0  # seconds between checks that the tier's directory is still there
PROMOTION_PASSES = 4  # read plans per lookup: each after spills that landed during the last pass's reads


class DiskThread:
    """One daemon thread that runs submitted calls one at a time, urgent ones (reads, unlinks) first.

    :meth:`submit` may be called from any thread and returns a
    :class:`concurrent.futures.Future`; a call cancelled before it started
    never runs. After :meth:`close` new calls fail at once.
    """

    def __init__(self, name: str = "dkv-disk-io") -> None:
        self._cond = threading.Condition()
        self._urgent: deque[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._normal: deque[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._closing = False
        self._exited: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)``; its future holds the result or the exception."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                future.set_exception(RuntimeError("the disk thread is closed"))
                return future
            (self._urgent if urgent else self._normal).append((future, fn, args))
            self._cond.notify()
        return future

    def close(self) -> concurrent.futures.Future[None]:
        """Take no more work; the thread exits once what is queued has run. Returns a future set then."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        return self._exited

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._urgent and not self._normal and not self._closing:
                        self._cond.wait()
                    if self._urgent:
                        future, fn, args = self._urgent.popleft()
                    elif self._normal:
                        future, fn, args = self._normal.popleft()
                    else:
                        return
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the waiter, never lost
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            self._exited.set_result(None)


class DiskWorker:
    """Moves a store's disk-tier bytes off the event loop: spill writes, promotion reads, unlinks.

    Owned by the node server: :meth:`start` in its ``start``, :meth:`stop`
    in its ``stop`` (after the store is closed). All methods run on the
    event-loop thread.
    """

    def __init__(
        self,
        store: Store,
        *,
        read_budget: int | None = None,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        check_interval: float = DEFAULT_CHECK_INTERVAL,
    ) -> None:
        if store.disk is None:
            raise ValueError("a DiskWorker needs a store with a disk tier")
        self._store = store
        self._disk: DiskTier = store.disk
        # bytes all in-flight promotion reads may hold together (default: as much as staging holds)
        self._read_budget = store.staging_bytes if read_budget is None else read_budget
        self.read_timeout = read_timeout  # seconds a lookup waits for its reads (adjustable)
        self._close_timeout = close_timeout
        self._check_interval = check_interval
        self._probes = 0  # probe writes ended: a directory check that spans one is stale
        self._reading = 0  # bytes held by promotion reads in flight
        self._thread: DiskThread | None = None
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._errors = 0
        self._stopped = False

    def start(self) -> None:
        """Start the disk thread and the spill task (on the running loop)."""
        if self._thread is not None:
            return
        self._thread = DiskThread()
        self._store.on_spill.append(self._wakeup.set)
        self._task = asyncio.create_task(self._spill_forever(), name="dkv-spill")
        self._watch = asyncio.create_task(self._watch_forever(), name="dkv-disk-watch")

    async def stop(self) -> bool:
        """Stop the spill task, then remove the tier's directory on the disk thread.

        Waits at most ``close_timeout`` for the thread (queued writes, then
        the removal). Returns False when it was still busy — a stuck disk: the
        daemon thread is left behind and the directory may remain. Idempotent.
        """
        if self._stopped:
            return True
        self._stopped = True
        with contextlib.suppress(ValueError):
            self._store.on_spill.remove(self._wakeup.set)
        tasks = [t for t in (self._task, self._watch) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._watch = None
        thread, self._thread = self._thread, None
        if thread is None:  # never started: nothing is queued, and no thread to wait for
            self._disk.clear()
            return True
        thread.submit(self._disk.clear)
        exited = asyncio.wrap_future(thread.close())
        try:
            await asyncio.wait_for(asyncio.shield(exited), self._close_timeout)
        except asyncio.TimeoutError:
            log.warning("the disk thread is still busy after %.1f s (stuck disk?); leaving it behind",
                        self._close_timeout)
            return False
        return True

    async def promotions(
        self, namespace: str, hashes: Sequence[bytes], leaves: Sequence[str], shards: int
    ) -> dict[StoreKey, Promoted]:
        """Read the on-disk blocks a leased lookup of these hashes could promote, off the event loop.

        Returns the bytes read, for ``Store.lookup(promoted=...)``, which the
        caller makes with no await in between. A spill that lands while the
        reads run moves its block from staging (where the lookup would have
        found its bytes) onto disk, unread: so the reads are planned again
        until a pass finds nothing new on disk (at most
        :data:`PROMOTION_PASSES` passes), and no block is missed for having
        moved meanwhile. A failed read is reported to the store (the block is
        dropped). Bounded: all reads in flight hold at most ``read_budget``
        bytes (what does not fit is not read), and a lookup waits at most
        ``read_timeout`` over all its passes (then it promotes nothing more
        than the passes before read; the late reads finish in the background,
        their bytes discarded). Raises nothing but cancellation.
        """
        thread = self._thread
        promoted: dict[StoreKey, Promoted] = {}
        deadline = asyncio.get_running_loop().time() + self.read_timeout
        for _ in range(PROMOTION_PASSES if thread is not None else 0):
            budget = self._read_budget - self._reading
            reads = self._store.disk_reads(namespace, hashes, leaves, shards, budget, promoted) if budget > 0 else []
            if not reads:
                break
            size = sum(r.entry.size for r in reads)
            self._reading += size
            future = asyncio.wrap_future(
                thread.submit(_read_files, self._disk, [(r.entry.path, r.entry.size) for r in reads], urgent=True))
            future.add_done_callback(lambda _, size=size: self._read_done(size))
            try:
                results = await asyncio.wait_for(asyncio.shield(future),
                                                 max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                self._store.counters.disk_read_timeouts += 1
                break
            except Exception:  # the thread is closed: nothing more to promote
                break
            for read, result in zip(reads, results):
                if isinstance(result, BaseException):
                    self._log_error("promotion read", read.entry.path, result)
                    self._store.disk_read_failed(read, result)
                else:
                    promoted[read.key] = Promoted(read.entry, result)
        return promoted

    @property
    def reading_bytes(self) -> int:
        """Bytes held by promotion reads in flight (late ones included)."""
        return self._reading

    def _read_done(self, size: int) -> None:
        self._reading -= size

    async def _spill_forever(self) -> None:
        store, disk = self._store, self._disk
        while True:
            thread = self._thread
            assert thread is not None
            try:
                garbage = disk.take_garbage()
                if garbage:
                    thread.submit(disk.unlink_files, garbage, urgent=True)
                job = store.take_spill()
                if job is None:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                probe = disk.degraded  # a probe: the directory may have to be made again first
                try:
                    remade, error = await asyncio.wrap_future(
                        thread.submit(_write_spill, disk, job.entry.path, job.data, probe))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the thread is closed
                    remade, error = False, exc
                finally:
                    self._probes += probe
                if remade:  # the old directory was gone, and its files with it
                    store.disk_vanished()
                if error is not None:
                    self._log_error("spill write", job.entry.path, error)
                store.finish_spill(job, error)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop every later spill
                log.exception("spill task error")
                await asyncio.sleep(0.1)

    async def _watch_forever(self) -> None:
        """Every ``check_interval``: is the tier's directory still the one it made? If not, tell the store."""
        store, disk = self._store, self._disk
        while True:
            await asyncio.sleep(self._check_interval)
            thread = self._thread
            if thread is None:
                return
            probes = self._probes
            try:
                intact = await asyncio.wrap_future(thread.submit(disk.root_intact, urgent=True))
            except asyncio.CancelledError:
                raise
            except Exception:  # the thread is closed: the worker is stopping
                return
            # a probe that ended meanwhile may have made the directory again (and reported the old one gone)
            if not intact and probes == self._probes and disk.state != MISSING:
                log.warning("the disk tier's directory %s is gone: its blocks are dropped", disk.root)
                store.disk_vanished()

    def _log_error(self, what: str, path: str, exc: BaseException) -> None:
        self._errors += 1
        if self._errors == 1 or self._errors % 100 == 0:
            log.warning("disk tier %s failed (%d so far; the block is dropped): %s: %s",
                        what, self._errors, path, exc)


def _write_spill(disk: DiskTier, path: str, data: bytearray, probe: bool) -> tuple[bool, Exception | None]:
    """Write one spill (disk thread); a probe first makes the tier's directory again if it vanished.

    Returns whether a directory was made, and the write's error (``None``: written).
    """
    remade = False
    try:
        if probe:
            remade = disk.reopen()
        disk.write_file(path, data)
    except Exception as exc:
        return remade, exc
    return remade, None


def _read_files(disk: DiskTier, items: list[tuple[str, int]]) -> list[bytearray | Exception]:
    """Read each ``(path, size)``; a failure becomes that item's result (disk thread)."""
    out: list[bytearray | Exception] = []
    for path, size in items:
        try:
            out.append(disk.read_file(path, size))
        except Exception as exc:
            out.append(exc)
    return out
