"""Same-host loads in one round trip: copy a lease's slots straight out of the mapped segment.

A leased ``lookup`` asked with ``"slots"`` on a connection that was handed its
namespace's segment comes back with where each leased block lies (see
:mod:`dkv.wire`). :class:`LeaseSlots` keeps that answer; :meth:`LeaseSlots.copy`
copies the requested blocks into the caller's buffers and checks each against
the writer's checksum.

Why no ``read``/``done`` round trips are needed: the lease pins the slots, so
while it holds, the bytes cannot change. If it ended before the copy finished
(its TTL, a later lookup of its group, a lease quota), a slot may have been
reused, and then the copied bytes fail their checksum: :meth:`copy` answers
False and the caller reads the two-step way, which pins for the read itself
and tells an ended lease from corruption. A block without a checksum is never
copied this way (the node announces offset ``-1``).

Large copies run off the event loop, on worker threads, so the event loop
and the engine's scheduler thread are not stalled by them. With the native
checked copy (:mod:`dkv.native`: built at install where a C compiler and
``xxhash.h`` are present; ``DKV_NATIVE_COPY=0`` turns it off) every block is
copied and hashed without the GIL, a chunk at a time so the hash reads the
copy while it is in cache, with XXH3's AVX2 code where the CPU has it.
A copy on the copy threads is then one native :class:`dkv._checked_copy.CheckedCopy`
that each thread claims blocks of, a few at a time, without the GIL; a load
into rows of one buffer (:class:`RowRun`: the usual ``load_lookup``) is made
into one straight from the packed slot map (:meth:`LeaseSlots.rows_copy`),
with no key, view, prefix or plan built per block.
Without it (:data:`dkv.native.NATIVE` false) the copy runs in Python, where
a block of at least ``GIL_FREE_COPY_MIN`` bytes is copied and hashed without the GIL and
a smaller one only copied without it. A copy of at least
``PARALLEL_COPY_MIN`` bytes of blocks hashed without the GIL is cut into
chunks of consecutive blocks that the ``COPY_THREADS`` copy threads take
in turn (:mod:`dkv.copy_threads`). Both give the same checksums (:func:`dkv.checksum.block_checksum`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from dkv import copy_threads, native
from dkv.arena import SegmentMapping
from dkv.checksum import CHECKSUM_SIZE
from dkv.checksum import block_checksum, block_head, block_prefixes
from dkv.copy_threads import COPY_THREADS, ChunkedCopy, PostedCopy
from dkv.errors import ProtocolError

_native_copy_and_checksum = native.copy_and_checksum  # None: the Python copy below
_native_shared_copy = native.CheckedCopy  # None likewise
_native_rows_copy = native.rows_copy  # None likewise: loads into rows are then planned key by key

# Copies of at least this many bytes in all run on a worker thread (numpy's copy releases the GIL);
# smaller ones cost less than the hop to the thread and back.
OFF_LOOP_COPY_MIN = 1 << 20
# A block this large is hashed without the GIL as well as copied without it (xxhash lets go of it only
# above 64 KiB: measured, two threads hashing 64 KiB blocks take as long as one). A memoryview assignment
# would copy a small block with less overhead than numpy, but it holds the GIL: a thread copying many
# small blocks would then keep the scheduler thread waiting for a whole switch interval.
GIL_FREE_COPY_MIN = 128 * 1024
# Copies of at least this many bytes, of blocks copied and hashed without the GIL, are shared by the
# COPY_THREADS copy threads, chunk by chunk: the copy and its checksum are most of a large same-host
# load. Smaller blocks would only take turns at the GIL.
PARALLEL_COPY_MIN = 4 << 20
# Loads of at most this many keys are planned a Python step per key: numpy's fixed cost per array pass
# (a dozen passes, a few µs each) is most of a one-block load's plan.
FEW_KEYS = 8
_CHECKSUM = np.dtype((np.void, CHECKSUM_SIZE))  # one packed checksum, gathered by index with its neighbours


class RowRun(NamedTuple):
    """A load whose destinations are rows of one buffer: hash ``i`` of ``(leaf, shard)`` into row ``ids[i]``.

    ``rows`` is a writable byte buffer of whole rows, ``row_bytes`` each (a
    contiguous CPU tensor's). :meth:`LeaseSlots.rows_copy` copies such a load
    with no Python step per block: no key, view, prefix or plan is built.
    A named tuple: the scheduler thread makes one per load (a frozen
    dataclass sets each field through ``object.__setattr__``).
    """

    leaf: str
    shard: int
    hashes: list[bytes]
    ids: Sequence[int]
    rows: Any
    row_bytes: int


_NO_SUM = bytes(CHECKSUM_SIZE)


_Entry = tuple[np.ndarray, np.ndarray, np.ndarray]  # one leaf's slot map: offsets, sizes (int64), checksums
# ... or the same as the packed bytes they view, until a plan needs the arrays (LeaseSlots._arrays): the usual
# load's native copy (rows_copy) reads the bytes as they are, and three arrays cost ~3 µs a lookup
_Packed = tuple[bytes, bytes, bytes]
_FEW_INT64S = [struct.Struct(f"={n}q") for n in range(FEW_KEYS + 1)]  # (a Struct made per call costs ~0.5 µs)


def _entry(offsets: bytes, sizes: bytes, sums: bytes) -> _Entry:
    """One leaf's packed slot map as arrays over its bytes (no copy)."""
    return np.frombuffer(offsets, dtype=np.int64), np.frombuffer(sizes, dtype=np.int64), np.frombuffer(sums, dtype=_CHECKSUM)


def _received_map_few(count: int, shards: int, masks: dict[str, list[bool]], sizes: Sequence[int],
                      sums: Sequence[bytes], good: Sequence[bool]) -> dict[str, _Entry | _Packed]:
    """:func:`_received_map_arrays` of a few keys, a Python step each (numpy's fixed cost per pass is most of a small map)."""
    starts, at = [], 0
    for size, ok in zip(sizes, good):
        starts.append(at if ok else -1)
        at += size
    pack = _FEW_INT64S[count].pack
    entries: dict[str, _Entry] = {}
    k = 0
    for leaf, mask in masks.items():
        offsets, slot_sizes, leaf_sums = [-1] * count, [0] * count, [_NO_SUM] * count
        for row in itertools.compress(range(len(mask)), mask):
            for place in range(row * shards, row * shards + shards):
                offsets[place], slot_sizes[place], leaf_sums[place] = starts[k], sizes[k], sums[k]
                k += 1
        entries[leaf] = (pack(*offsets), pack(*slot_sizes), b"".join(leaf_sums))
    return entries


def _received_map_arrays(count: int, shards: int, masks: dict[str, list[bool]], sizes: Sequence[int],
                         sums: Sequence[bytes], good: Sequence[bool]) -> dict[str, _Entry]:
    """The slot map (per leaf: offsets, sizes, sums over hashes x shards) of blocks sent with a lookup's answer.

    See :meth:`LeaseSlots.received_with_lookup`; array passes over all of them.
    """
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=starts[1:])
    starts[:-1][~np.asarray(good, dtype=bool)] = -1
    packed_sums = np.frombuffer(b"".join(sums), dtype=_CHECKSUM) if sums else np.empty(0, dtype=_CHECKSUM)
    entries: dict[str, _Entry] = {}
    at = 0
    for leaf, mask in masks.items():
        rows = np.flatnonzero(np.asarray(mask, dtype=bool))
        places = (rows[:, None] * shards + np.arange(shards)).ravel()  # hash by hash, shard by shard
        offsets = np.full(count, -1, dtype=np.int64)
        slot_sizes = np.zeros(count, dtype=np.int64)
        leaf_sums = np.zeros(count, dtype=_CHECKSUM)
        taken = slice(at, at + len(places))
        offsets[places], slot_sizes[places], leaf_sums[places] = starts[taken], sizes[taken], packed_sums[taken]
        at += len(places)
        entries[leaf] = (offsets, slot_sizes, leaf_sums)
    return entries


class ReceivedBlocks:
    """Block bytes a node sent with a leased lookup's answer, held in this process (see :mod:`dkv.wire`, ``send``).

    What a :class:`LeaseSlots` copies from in place of a mapped segment: the
    blocks back to back, in the order the node sent them. Nothing else
    writes into it once the lookup has returned.
    """

    __slots__ = ("view", "size", "held")

    def __init__(self, buffer: bytearray | memoryview, held: int | None = None) -> None:
        """``buffer``: the blocks, back to back; ``held``: the bytes kept alive with them (default: theirs).

        A view into a larger buffer (the receive that took the lookup's answer
        and the blocks in one message) keeps all of it: ``held`` says how much.
        """
        self.view = memoryview(buffer)
        self.size = self.view.nbytes
        self.held = self.size if held is None else held


class LeaseSlots:
    """A leased lookup's slot map for one mapping (built from the node's reply; see module docstring).

    Or, where ``mapping`` is :class:`ReceivedBlocks`, the map of the bytes a
    node sent with the lookup's answer (:meth:`received_with_lookup`): the
    node ended that lease when it sent them, so there is no lease to end or
    outlive, and the copy is checked against the checksums all the same.
    """

    __slots__ = ("mapping", "shards", "live_until", "_hashes", "_index", "_slots")

    def __init__(self, mapping: SegmentMapping | ReceivedBlocks, hashes: Sequence[bytes], shards: int, raw: Any, *,
                 live_until: float) -> None:
        """Parse the reply's ``slots``; :class:`ProtocolError` when they do not match the request.

        ``live_until`` (``time.monotonic()``) is when the client must stop
        trusting the lease: before the node's TTL ends it (the same clock on
        the same host).
        """
        if not isinstance(raw, dict):
            raise ProtocolError("slots must be a map")
        count = len(hashes) * shards
        slots: dict[str, _Entry | _Packed] = {}
        for leaf, entry in raw.items():
            if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is bytes for x in entry)):
                raise ProtocolError(f"slots of leaf {leaf!r} are malformed")
            offsets, sizes, sums = entry
            if len(offsets) != 8 * count or len(sizes) != 8 * count or len(sums) != CHECKSUM_SIZE * count:
                raise ProtocolError(f"slots of leaf {leaf!r} have the wrong length")
            slots[leaf] = (offsets, sizes, sums)  # as arrays once a plan needs them (_arrays)
        self._take(mapping, hashes, shards, slots, live_until)

    def _take(self, mapping: SegmentMapping | ReceivedBlocks, hashes: Sequence[bytes], shards: int,
              slots: dict[str, _Entry | _Packed], live_until: float) -> None:
        self.mapping = mapping
        self.shards = shards
        self.live_until = live_until
        self._hashes = hashes if type(hashes) is list else list(hashes)  # compared with lists (_plan_prefix)
        self._index: dict[bytes, int] | None = None  # built on first use: most lookups are never loaded
        self._slots = slots

    def _arrays(self, leaf: str) -> _Entry | None:
        """``leaf``'s slot map as arrays (made from its packed bytes on first use, then kept); ``None`` if none."""
        entry = self._slots.get(leaf)
        if entry is not None and type(entry[0]) is bytes:
            entry = self._slots[leaf] = _entry(*entry)  # (two threads may both make them: the same arrays)
        return entry  # type: ignore[return-value]

    @classmethod
    def received_with_lookup(cls, blocks: ReceivedBlocks, hashes: Sequence[bytes], shards: int,
                             masks: dict[str, list[bool]], sizes: Sequence[int], sums: Sequence[bytes],
                             good: Sequence[bool]) -> LeaseSlots:
        """The map of ``blocks``, sent with a lookup's answer in the wire's order: leaf by leaf as ``masks`` has
        them, hash by hash where the leaf's mask was set when they were sent, shard by shard (``sizes``,
        ``sums`` and ``good`` in that order).

        A block not ``good`` (it failed its checksum as it landed) is in the
        map as a block the lease does not hold: a copy of it is refused.
        """
        count = len(hashes) * shards
        if count <= FEW_KEYS:
            entries = _received_map_few(count, shards, masks, sizes, sums, good)
        else:
            entries = _received_map_arrays(count, shards, masks, sizes, sums, good)
        slots = cls.__new__(cls)  # (built here, not parsed from a reply: nothing to check)
        slots._take(blocks, hashes, shards, entries, float("inf"))
        return slots

    @property
    def received(self) -> bool:
        """Whether these are bytes the node sent with the lookup's answer (it ended the lease then: nothing to end)."""
        return isinstance(self.mapping, ReceivedBlocks)

    def _plan(self, keys: Sequence[Any], sizes: Sequence[int]) -> tuple[list[int], bytes] | None:
        """Each key's slot offset, and their checksums packed in key order; ``None`` when any key cannot be copied this way.

        ``sizes`` are the destination sizes, which must be the slots' own.
        Array passes over the whole load, not a Python step per key; a load of
        at most :data:`FEW_KEYS` keys takes one Python step per key instead
        (:meth:`_plan_few`: the same answer, without numpy's fixed cost per pass),
        and a load of the lease's own prefix slices the slot map
        (:meth:`_plan_prefix`: the same answer, without finding each key).
        """
        n = len(keys)
        if n != len(sizes):
            return None
        if not n:
            return [], b""
        if n > FEW_KEYS and self.shards == 1 and len(self._slots) == 1:
            prefix = self._plan_prefix(keys, sizes)
            if prefix is not False:
                return prefix
        if self._index is None:
            self._index = {h: i for i, h in enumerate(self._hashes)}
        rows = list(map(self._index.get, map(operator.itemgetter(2), keys)))
        if None in rows:
            return None
        if n <= FEW_KEYS:
            return self._plan_few(keys, sizes, rows)
        return self._plan_arrays(keys, sizes, rows)

    def _plan_prefix(self, keys: Sequence[Any], sizes: Sequence[int]) -> tuple[list[int], bytes] | None | Literal[False]:
        """:meth:`_plan` of a load of the lease's own prefix, in order: ``False`` when ``keys`` are not that.

        The usual load (``load_lookup`` of what its lookup found): one leaf,
        one shard, the looked-up hashes from the first on. Their places in
        the slot map are then ``0..n-1``, so no key is looked up and the map
        is sliced, not gathered. Refusals are the general plan's.
        """
        n = len(keys)
        (leaf, _), = self._slots.items()
        entry = self._arrays(leaf)
        assert entry is not None
        if (n > len(self._hashes) or list(map(operator.itemgetter(2), keys)) != self._hashes[:n]
                or set(map(operator.itemgetter(0), keys)) != {leaf}):
            return False
        if set(map(operator.itemgetter(1), keys)) != {0}:
            return None  # a shard this one-shard lease does not have
        offsets, slot_sizes = entry[0][:n], entry[1][:n]
        size = sizes[0]
        wanted = size if list(sizes).count(size) == n else np.asarray(sizes, dtype=np.int64)
        if ((offsets < 0).any() or (slot_sizes != wanted).any()
                or int((offsets + slot_sizes).max()) > self.mapping.size):
            return None
        return offsets.tolist(), entry[2][:n].tobytes()

    def _plan_few(self, keys: Sequence[Any], sizes: Sequence[int], rows: Sequence[int]) -> tuple[list[int], bytes] | None:
        """:meth:`_plan` of a few keys, each known to the lease (``rows``: its hash's place), a step per key."""
        shards, limit, arrays = self.shards, self.mapping.size, self._arrays
        offsets: list[int] = []
        sums: list[bytes] = []
        for (leaf, shard, _), size, row in zip(keys, sizes, rows):
            entry = arrays(leaf)
            if entry is None or not 0 <= shard < shards:
                return None
            at = row * shards + shard
            offset, slot_size = int(entry[0][at]), int(entry[1][at])
            if offset < 0 or slot_size != size or offset + slot_size > limit:
                return None
            offsets.append(offset)
            sums.append(entry[2][at].tobytes())
        return offsets, b"".join(sums)

    def _plan_arrays(self, keys: Sequence[Any], sizes: Sequence[int], rows: Sequence[int]) -> tuple[list[int], bytes] | None:
        """:meth:`_plan` of keys each known to the lease (``rows``: its hash's place), in array passes."""
        n = len(keys)
        shard = np.fromiter(map(operator.itemgetter(1), keys), dtype=np.int64, count=n)
        if not (0 <= int(shard.min()) and int(shard.max()) < self.shards):
            return None
        at = np.fromiter(rows, dtype=np.int64, count=n) * self.shards + shard  # each key's place in its leaf's map
        offsets = np.empty(n, dtype=np.int64)
        slot_sizes = np.empty(n, dtype=np.int64)
        sums = np.empty(n, dtype=_CHECKSUM)
        leaf_of = list(map(operator.itemgetter(0), keys))
        leaves = set(leaf_of)
        for leaf in leaves:
            entry = self._arrays(leaf)
            if entry is None:
                return None
            mine = (slice(None) if len(leaves) == 1
                    else np.flatnonzero(np.fromiter(map(leaf.__eq__, leaf_of), dtype=bool, count=n)))
            where = at[mine]
            offsets[mine] = entry[0][where]
            slot_sizes[mine] = entry[1][where]
            sums[mine] = entry[2][where]
        if ((offsets < 0).any() or (slot_sizes != np.asarray(sizes, dtype=np.int64)).any()
                or (offsets + slot_sizes > self.mapping.size).any()):
            return None
        return offsets.tolist(), sums.tobytes()

    async def copy(self, keys: Sequence[Any], views: Sequence[memoryview]) -> bool:
        """Copy ``keys`` (``(leaf, shard, hash)``) into ``views``; True when every block matched its checksum.

        False leaves the views holding garbage: the caller must read the blocks
        the two-step way (or fail). Nothing writes into the views after this
        returns or raises (a cancelled copy first waits for the chunks being
        copied). A copy of at least :data:`OFF_LOOP_COPY_MIN` bytes runs on
        the copy threads (:meth:`start_copy`), a smaller one here.
        """
        nbytes = sum(view.nbytes for view in views)
        if nbytes < OFF_LOOP_COPY_MIN:
            return self.copy_here(keys, views)
        copy = self.start_copy(len(keys), nbytes, lambda: (keys, views))
        done = asyncio.wrap_future(copy.done)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            copy.cancel()  # no chunk starts from here on; those being copied end before this raises
            while not done.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([done])
            raise

    def rows_copy(self, run: RowRun) -> Any | None:
        """``run``'s checked copy, made (not run) natively from the slot map; ``None`` where it cannot be made so.

        Only for a run of the lease's own hashes from the first, on a
        one-shard lease (the usual load: ``load_lookup`` of what its lookup
        found, see :meth:`_plan_prefix`), with the native copy built. ``None``
        also where a slot cannot be copied at all (no checksum, another
        size); plan such a load key by key instead (:meth:`copy_here`,
        :meth:`start_copy` without ``run``), which gives the same answer.
        The copy (:class:`dkv._checked_copy.CheckedCopy`) verifies as
        :meth:`copy` does.
        """
        if _native_rows_copy is None or self.shards != 1 or run.shard != 0 or not run.hashes:
            return None
        entry = self._slots.get(run.leaf)
        n = len(run.hashes)
        if entry is None or n > len(self._hashes) or run.hashes != self._hashes[:n]:
            return None
        return _native_rows_copy(self.mapping.view, run.rows, run.row_bytes, run.ids, entry[0], entry[1], entry[2],
                                 block_head(run.leaf, 0, run.row_bytes, len(run.hashes[0])), run.hashes)

    def copy_rows_here(self, run: RowRun) -> bool | None:
        """:meth:`copy_here` of ``run`` through :meth:`rows_copy`, holding the GIL; ``None`` where it cannot be made so.

        Meant for small copies (tens of µs): the calling thread keeps the GIL
        rather than wait a switch interval to get it back.
        """
        copy = self.rows_copy(run)
        return None if copy is None else copy.work(hold_gil=True)

    def start_copy(self, count: int, nbytes: int,
                   prepare: Callable[[], tuple[Sequence[Any], Sequence[memoryview]]],
                   run: RowRun | None = None) -> ChunkedCopy | PostedCopy:
        """Any thread: :meth:`copy` of ``count`` blocks (``nbytes`` in all) on the copy threads; this thread only posts it.

        Where ``run`` describes the load and :meth:`rows_copy` can copy it,
        the copy is made here (a native call: no Python step per block) and
        posted to the native copy threads (:class:`dkv.copy_threads.PostedCopy`),
        which no Python thread joins. Otherwise ``prepare()`` gives the keys
        and views; it runs on a copy thread, with
        the plan, so that a caller who must not wait leaves that work there
        too; an exception it raises resolves the copy's ``done`` to it. The
        returned copy's ``done`` resolves as :meth:`copy` answers. A copy of
        at least :data:`PARALLEL_COPY_MIN` bytes of blocks copied and hashed
        without the GIL (natively, or in Python when they are at least
        :data:`GIL_FREE_COPY_MIN` on average) is cut into chunks (:func:`dkv.copy_threads.chunk_bounds`),
        which every copy thread takes once it is planned; a smaller one is
        one chunk.
        """
        gil_free = nbytes >= PARALLEL_COPY_MIN and (
            _native_copy_and_checksum is not None or nbytes >= GIL_FREE_COPY_MIN * count)
        bounds = copy_threads.chunk_bounds(count, nbytes) if gil_free else [0, count] if count else [0]
        if run is not None and len(run.hashes) == count:
            posted = self._post_rows(run, min(COPY_THREADS, max(len(bounds) - 1, 1)))
            if posted is not None:
                return posted
        copy = ChunkedCopy()
        copy_threads.submit(self._plan_and_copy, copy, bounds, prepare, run)
        return copy

    def _post_rows(self, run: RowRun, shares: int) -> PostedCopy | None:
        """``run``'s copy made here and posted to the native copy threads; ``None`` where it cannot be (see :meth:`rows_copy`).

        An error making it is left to the keyed plan on a copy thread, which reports it through ``done``.
        """
        try:
            shared = self.rows_copy(run)
            return None if shared is None else PostedCopy(shared, shares)
        except Exception:  # noqa: BLE001 - the keyed plan meets it again and reports it
            return None

    def _plan_and_copy(self, copy: ChunkedCopy, bounds: list[int],
                       prepare: Callable[[], tuple[Sequence[Any], Sequence[memoryview]]],
                       run: RowRun | None = None) -> None:
        """A copy thread: plan ``copy`` whole, then copy it with the copy threads it wakes for it.

        The plan (and each block's checksum prefix) is made once, here, or
        not at all where :meth:`rows_copy` makes the copy of ``run``. With
        the native copy the batch is then one :data:`dkv.native.CheckedCopy`
        that each thread's share claims blocks of, without the GIL (``bounds``
        only says how many threads to share it with: one GIL hand-off a
        thread, however late the other starts); without it, each chunk of
        ``bounds`` costs a slice and a copy call.
        """
        plan: tuple[list[int], bytes] | None = None
        try:
            shared = self.rows_copy(run) if run is not None and len(run.hashes) == bounds[-1] else None
            if shared is None:
                keys, views = prepare()
                sizes = [view.nbytes for view in views]
                plan = self._plan(keys, sizes) if len(sizes) == bounds[-1] else None
                if plan is not None and _native_shared_copy is not None:
                    shared = _native_shared_copy(self.mapping.view, views, plan[0], block_prefixes(keys, sizes),
                                                 plan[1])
        except BaseException as exc:  # noqa: BLE001 - reported through copy.done
            copy.give_up(exc)
            return
        if shared is not None:
            shares = min(COPY_THREADS, len(bounds) - 1)
            copy.start(range(shares + 1), lambda _start, _stop: shared.work(), shared.stop)
        elif plan is None:
            copy.give_up()
            return
        else:
            offsets, sums = plan

            def copy_chunk(start: int, stop: int) -> bool:
                return self._copy_and_verify(keys[start:stop], views[start:stop], offsets[start:stop],
                                             sums[start * CHECKSUM_SIZE:stop * CHECKSUM_SIZE])

            copy.start(bounds, copy_chunk)
        for _ in range(min(COPY_THREADS, len(bounds) - 1) - 1):
            try:
                copy_threads.submit(copy.work)
            except RuntimeError:  # the interpreter is shutting down: this thread copies every chunk
                break
        copy.work()

    def copy_here(self, keys: Sequence[Any], views: Sequence[memoryview]) -> bool:
        """:meth:`copy` on the calling thread, whatever the size (any thread; meant for small copies).

        The same answer as :meth:`copy`: True when every block matched its
        checksum; False leaves the views holding garbage.
        """
        plan = self._plan(keys, [view.nbytes for view in views])
        if plan is None:
            return False
        offsets, sums = plan
        return self._copy_and_verify(keys, views, offsets, sums)

    def _copy_and_verify(self, keys: Sequence[Any], views: Sequence[memoryview], offsets: Sequence[int],
                         sums: bytes) -> bool:
        """Copy each key's slot into its view; True when the copied bytes' checksums are ``sums`` (key order)."""
        if _native_copy_and_checksum is not None:
            prefixes = block_prefixes(keys, [view.nbytes for view in views])
            return _native_copy_and_checksum(self.mapping.view, views, offsets, prefixes) == sums
        segment = np.frombuffer(self.mapping.view, dtype=np.uint8)  # sliced per block: no buffer export per block
        got = []
        for key, view, offset in zip(keys, views, offsets):
            size = view.nbytes
            if size:  # numpy's copy lets go of the GIL: other threads get it at least once a block
                np.copyto(np.frombuffer(view, dtype=np.uint8), segment[offset: offset + size])
            got.append(block_checksum(key[0], key[1], key[2], view))
        return b"".join(got) == sums  # one comparison: a mismatch anywhere fails the whole copy
