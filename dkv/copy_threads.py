"""The process's copy threads: checked same-host copies, cut into chunks the threads take in turn.

A large same-host load is a checked memcpy out of the node's segment (see
:mod:`dkv.lease_slots`). It runs here, off both the event loop and the
engine's scheduler thread, on :data:`COPY_THREADS` threads the process shares.

One copy is a :class:`ChunkedCopy`: its chunks (consecutive blocks, at
least :data:`CHUNK_BYTES` each, at most :data:`CHUNKS` of them) are taken
one at a time by whichever thread works on it, so two threads share it by
what each managed to copy, not by a split decided in advance (one thread
that starts late, or shares its core with the loop, no longer leaves the
other idle at the end). No thread waits for another: the thread that
finishes the last chunk settles the copy's future.

Any thread may start work here (:func:`submit`; a direct channel's read,
which mostly waits on the network, on threads of its own: :func:`submit_read`); the threads are made on
first use, again in a forked child (a pool inherited over ``fork`` has no
threads behind it), and are joined at interpreter exit after the work they
hold.

A copy that is one native :class:`dkv._checked_copy.CheckedCopy` from the
start (a load into rows, made from the slot map on the posting thread) skips
these threads: it is a :class:`PostedCopy` on the native copy threads, which
never take the GIL, so no thread needs the GIL to start, share or end it
(each such hand-off waits for the switch interval while the engine's
scheduler thread runs Python).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dkv.light_future import LightFuture

COPY_THREADS = 2  # the copy and its checksum are most of a large same-host load; more would only share two cores
CHUNK_BYTES = 1 << 20  # a chunk at least: enough to amortise its slices of the plan and its native call
# A copy is cut into at most this many chunks: one a thread, taken in turn (a thread that starts late
# leaves its chunk to the other). More chunks evened out the threads' shares, but each costs a hand-off of
# the GIL, and with the engine's scheduler thread busy in Python each hand-off waits for its switch
# interval: 256 x 64 KiB took 48 ms with 16 chunks against 13 ms with 2 (scripts/probe_load_phases.py
# --busy-caller), and no less time with the caller waiting.
CHUNKS = COPY_THREADS

# A read over a direct channel waits on the network for most of its run, without the GIL: it gets a thread of
# its own, so that reads from several nodes at once, and the copies, never queue behind each other's waits.
READ_THREADS = 16  # (made as reads come, up to this many; a read past them waits for one to end)


class _Threads:
    """A pool of threads made on first use, and again in a forked child (one inherited over ``fork`` has none)."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads, self._name = threads, name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        pool = self._pool
        if pool is None or self._pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pid != os.getpid():
                    self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
                    self._pid = os.getpid()
                pool = self._pool
        return pool.submit(fn, *args)


_copy_threads = _Threads(COPY_THREADS, "dkv-copy")
_read_threads = _Threads(READ_THREADS, "dkv-read")


def submit(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """Any thread: run ``fn(*args)`` on a copy thread."""
    return _copy_threads.submit(fn, *args)


def submit_read(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """Any thread: run ``fn(*args)``, a read that waits on the network (a direct channel's), on a thread of its own.

    Not on the copy threads: a read held one for its whole run, network wait
    included, so a third read at once, or any copy, waited for one to end.
    """
    return _read_threads.submit(fn, *args)


def chunk_bounds(count: int, nbytes: int) -> list[int]:
    """Where the chunks of a copy of ``count`` blocks (``nbytes`` in all) start, and the end: ``[0, ..., count]``.

    Consecutive blocks, as many a chunk as make :data:`CHUNK_BYTES` (at
    least one) or ``count / CHUNKS``, whichever is more.
    """
    if count <= 0:
        return [0]
    per = max(1, -(-count // CHUNKS), count * CHUNK_BYTES // max(nbytes, 1))
    return [*range(0, count, per), count]


class PostedCopy:
    """A native copy (:class:`dkv._checked_copy.CheckedCopy`) posted to the native copy threads.

    No Python thread takes part: the native threads copy and check it
    without ever taking the GIL. :attr:`done` resolves as
    :class:`ChunkedCopy`'s does (True: every block verified; False: one did
    not, or it was cancelled), once no native thread works on it.
    :meth:`poll` (any thread, never blocks) settles it right there when the
    native threads are through, so a thread that polls (the engine's
    scheduler thread, through ``Transfer.is_complete``) learns of it
    without waiting for another thread to get the GIL; otherwise the
    process's watcher thread (blocked in native code, without the GIL,
    until a posted copy ends) settles it. Whichever comes first settles it
    once; ``done``'s callbacks run on that thread.
    """

    __slots__ = ("done", "_copy", "_key", "_lock", "_cancelled")  # one made per load() posted

    def __init__(self, copy: Any, shares: int) -> None:
        """Any thread: post ``copy`` as ``shares`` shares (``RuntimeError``: no native thread could be started)."""
        self.done: concurrent.futures.Future[bool] = LightFuture()
        self._copy = copy
        self._key = id(copy)  # the watcher's key: the native copy hands back itself
        self._lock = threading.Lock()
        self._cancelled = False
        _watch(self)
        try:
            copy.post(shares)
        except BaseException:
            _unwatch(self)
            raise

    def poll(self) -> bool:
        """Any thread: settle the copy if the native threads are through with it; True once it is settled."""
        copy = self._copy
        if copy is None:
            return True
        if copy.result() is None:
            return False
        self._settle()
        return True

    def cancel(self) -> None:
        """Any thread: claim no further block; :attr:`done` resolves (False) once the blocks being copied end."""
        self._cancelled = True
        copy = self._copy
        if copy is not None:
            copy.stop()

    def _settle(self) -> None:
        """Resolve :attr:`done` once, and let go of the native copy.

        The native copy holds the segment's and the rows' buffers: a
        transfer kept on the engine's books after it completed must not keep
        them (a segment with a buffer exported cannot be unmapped when its
        node restarts).
        """
        with self._lock:
            copy, self._copy = self._copy, None
        if copy is None:
            return
        ok = bool(copy.result()) and not self._cancelled
        _unwatch(self)
        del copy  # ended: no native thread uses it; freeing it releases its buffers
        if self.done.set_running_or_notify_cancel():
            self.done.set_result(ok)


# The posted copies not yet seen to end by the watcher, by the id of their native copy (which it hands back).
# A store and a pop are each atomic under the GIL: posting (the engine's scheduler thread) takes no lock here,
# and touches nothing the watcher thread writes but the dict (a lock shared with it cost a post 2-6 µs).
_posted: dict[int, PostedCopy] = {}
_watcher_lock = threading.Lock()  # starting the watcher
_watching = False  # this process has its watcher (a forked child has none: see _forget_the_parents_watcher)
WATCH_WAKE = 1.0  # seconds: how often the idle watcher wakes (only to be interruptible; nothing is polled)


def _watch(posted: PostedCopy) -> None:
    if not _watching:
        _start_watcher()
    _posted[posted._key] = posted


def _start_watcher() -> None:
    global _watching
    with _watcher_lock:
        if not _watching:  # first use, or a forked child's
            threading.Thread(target=_watcher, name="dkv-copy-watcher", daemon=True).start()
            _watching = True


def _forget_the_parents_watcher() -> None:
    """A forked child: the parent's watcher is not here, nor are its posted copies (the native pool ends them)."""
    global _watching, _watcher_lock
    _watching = False
    _watcher_lock = threading.Lock()
    _posted.clear()


os.register_at_fork(after_in_child=_forget_the_parents_watcher)


def _unwatch(posted: PostedCopy) -> None:
    _posted.pop(posted._key, None)  # the key is the live native copy's id: no other copy has it meanwhile


def _watcher() -> None:
    """The watcher thread: settle each posted copy as the native threads end it (see :class:`PostedCopy`)."""
    from dkv import _checked_copy  # only posted copies start this thread, and they need the native build

    while True:
        _settle_ended(_checked_copy.wait_ended(WATCH_WAKE))


def _settle_ended(ended: list[Any]) -> None:
    """The watcher: settle these ended copies (a function of its own, so that no reference outlives it)."""
    for copy in ended:
        posted = _posted.pop(id(copy), None)
        if posted is not None:
            posted._settle()  # noqa: SLF001 - the module's own class


class ChunkedCopy:
    """One copy cut into chunks; the threads that :meth:`work` on it take them in turn.

    Made before its chunks are known (the planning runs on a copy thread
    too), so that it can be cancelled from the start. The thread that plans
    it calls :meth:`start` with the chunks (or :meth:`give_up`), then
    :meth:`work`; other threads may :meth:`work` on it as well.
    ``copy_chunk(start, stop)`` copies buffers ``start:stop`` and answers
    whether they verified.

    :attr:`done` resolves to True when every chunk verified; to False when
    one did not, when the copy was given up or :meth:`cancel`-led; to the
    first exception a chunk raised. It resolves only once no chunk is being
    copied, and nothing of this copy is copied after that.
    """

    def __init__(self) -> None:
        self.done: concurrent.futures.Future[bool] = LightFuture()
        self._lock = threading.Lock()
        self._bounds: Sequence[int] = ()
        self._copy_chunk: Callable[[int, int], bool] | None = None
        self._stop: Callable[[], None] | None = None
        self._chunks = 0
        self._ready = False  # start() has set the chunks
        self._started = 0  # chunks taken so far (under the lock: the next one to take is this one)
        self._ended = 0  # chunks whose copy returned or raised
        self._stopped = False  # no chunk is taken any more: failed, given up or cancelled
        self._ok = True
        self._error: BaseException | None = None
        self._settled = False

    def start(self, bounds: Sequence[int], copy_chunk: Callable[[int, int], bool],
              stop: Callable[[], None] | None = None) -> None:
        """The planning thread: the chunks' bounds (as :func:`chunk_bounds` gives them) and how to copy one.

        ``stop()``, when given, makes the chunks being copied end early (and
        answer False); :meth:`cancel` calls it. A copy shared natively (see
        :mod:`dkv.lease_slots`) passes bounds ``0..threads`` and a
        ``copy_chunk`` that ignores them: each "chunk" is then one thread's
        share of blocks it claims itself, without the GIL.
        """
        with self._lock:
            if not self._settled:  # (a copy cancelled before it started keeps nothing)
                self._stop = stop
                self._bounds, self._copy_chunk = bounds, copy_chunk
            self._chunks = max(len(bounds) - 1, 0)
            self._ready = True
            empty = not self._chunks
        if empty:
            self._settle()

    def give_up(self, error: BaseException | None = None) -> None:
        """The planning thread: nothing will be copied (``error``: why, raised through :attr:`done`)."""
        with self._lock:
            self._stopped, self._ok = True, False
            if self._error is None:
                self._error = error
        self._settle()

    def cancel(self) -> None:
        """Any thread: start no further chunk; :attr:`done` resolves (False) once the chunks being copied end."""
        with self._lock:
            self._stopped = True
            idle = self._started == self._ended
            stop = self._stop
        if stop is not None:
            stop()
        if idle:
            self._settle()

    def work(self) -> None:
        """A copy thread: copy chunks until none is left (or the copy failed, or was cancelled)."""
        while True:
            with self._lock:
                if self._stopped or not self._ready:
                    return
                index = self._started
                if index >= self._chunks:
                    return
                self._started += 1
                copy_chunk, start, stop = self._copy_chunk, self._bounds[index], self._bounds[index + 1]
            ok, error = False, None
            try:
                ok = bool(copy_chunk(start, stop))  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - reported through done
                error = exc
            with self._lock:
                self._ended += 1
                if error is not None and self._error is None:
                    self._error = error
                if not ok:
                    self._ok = False
                    self._stopped = True  # the copy has failed: the chunks left would be wasted
                last = self._ended == self._started and (self._stopped or self._ended == self._chunks)
            if last:
                self._settle()
                return

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
            error = self._error
            ok = self._ok and self._ready and self._ended == self._chunks
            # nothing is copied from here on: what the copy holds (a native copy, its buffers) goes now
            self._copy_chunk = self._stop = None
        if self.done.set_running_or_notify_cancel():
            if error is not None:
                self.done.set_exception(error)
            else:
                self.done.set_result(ok)
