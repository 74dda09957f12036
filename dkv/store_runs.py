"""A leased lookup's per-key work over the store's index: in C where built, else the same in Python.

:func:`pin_run` is the inner loop of a one-shard leased lookup
(:meth:`dkv.store.Store._pin_present`): fetch each hash's block, pin the ones
on the host tier, and write the mask, the lease's blocks and depths, and the
same-host slot map, already packed for the wire. :func:`unpin_all` gives a
lease's pins back, :func:`pin_all` takes a read's. Contract, for both builds:

* ``pin_run(column, hashes, start, mask, held, depths, tally, offsets, sizes,
  sums) -> stop`` walks ``hashes[start:]`` in order, each looked up in
  ``column``, a dict ``{hash: block}`` of one namespace, leaf and shard (the
  store's :attr:`dkv.store.Store.columns`; empty where none). An absent
  block: ``mask`` gets False and the slot map ``(-1, 0, 16 zero bytes)``. A
  block off the host tier (``offset < 0``): the run stops and returns its index,
  nothing done for it (the caller brings it back or reports it absent, then
  runs again from the next index). A block on the host tier: one more pin,
  appended to ``held`` (its index to ``depths``), ``mask`` gets True, and the
  slot map its ``(offset, size, checksum)``, or ``(-1, 0, zeros)`` where it has
  no checksum. Returns ``len(hashes)`` when every hash was seen.
* ``tally[0]`` grows by the blocks whose pins went from 0 to 1, **also when it
  raises midway**; every block pinned before an error is in ``held``. So a
  caller that gives back ``held``'s pins on an error keeps its count of pinned
  blocks true.
* ``offsets`` and ``sizes`` are bytearrays that get one native ``int64`` per
  hash seen (as ``array("q")`` packs them), ``sums`` 16 bytes per hash; all
  three ``None`` for no slot map.
* ``pin_run_shards(blocks, namespace, leaf, hashes, shards, start, mask,
  pinned, tally) -> stop``: the same run over ``shards`` > 1 tensor-parallel
  shards, where a hash is present only when every shard's block is. One shard
  absent: ``mask`` gets False, nothing pinned. One off the host tier and not
  yet in ``pinned``: the run stops there. Else each block whose key is not yet
  in ``pinned`` gets one more pin, every key is set in ``pinned`` to the hash's
  index (a key is pinned once per lookup, at its last depth, in first-pin
  order), and ``mask`` gets True. ``tally`` as above; every block pinned
  before an error has its key in ``pinned``.
* ``slot_map(blocks, covered, namespace, leaf, hashes, shards, offsets, sizes,
  sums)``: a lease's packed slot map over ``hashes`` x ``shards`` (hash-major),
  appended to the three bytearrays: for each key that ``covered`` holds, its
  block's ``(offset, size, checksum)``, else, or where the block has no
  checksum or lies off the host tier, ``(-1, 0, zeros)``. Nothing changes.
* ``unpin_all(held) -> int``: one pin less on each block listed (twice listed:
  two less); how many reached 0.
* ``pin_all(held) -> int``: one pin more on each block listed (twice listed:
  two more); how many went from 0 to pinned.
* ``stamp_run(held, depths, stamp, order) -> (order, entries)``: one use of
  each block of the list ``held`` still in the store's index (its
  ``indexed``), in order: its ``stamp``, its depth (``depths[i]``, a list as
  long) and the next ``order`` (``order``, ``order + 1``, ...); a block on the
  host tier also gets its recency entry ``(stamp, -depth, order, block)`` in
  ``entries[block.tenant]`` (a new dict of lists, each sorted ascending). A
  block no longer indexed (evicted, cleared, replaced) is skipped: a stamp
  never brings one back. Returns the next order to give with the entries.
  (The store's recency stamping, :meth:`dkv.store.Store._stamp_blocks`: 256
  blocks took ~70 µs in Python, most of a same-host load's node work.)
* ``live_entries(heap) -> list``: the recency entries of the list ``heap``
  still live, in order: their block indexed, on the host tier and of that
  very ``order`` (:meth:`dkv.store.Store._compact_recency`).

The native build (``dkv._store_index``, built at install where a C compiler is
present) reads and writes a :class:`dkv.store.Block`'s slots directly, learned
once by :func:`bind`. ``DKV_NATIVE_INDEX=0`` turns it off (to compare, or to
rule it out). The tests run both twins over the same stores and compare every
output and every block's pins.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Sequence
from typing import Any

NO_SUM = bytes(16)  # a slot map's checksum where a block has none, or none is copied the one-round-trip way

PinRun = Callable[[dict, Sequence[bytes], int, list, list, list, list,
                   bytearray | None, bytearray | None, bytearray | None], int]


def slot_entry(block: Any) -> tuple[int, int, bytes]:
    """A block's slot-map entry: ``(-1, 0, zeros)`` where it cannot be copied the one-round-trip way."""
    if block is None or block.checksum is None or block.offset < 0:
        return -1, 0, NO_SUM
    return block.offset, block.size, block.checksum


def _append_packed(packed: tuple[bytearray, bytearray, bytearray], offs: list[int], lens: list[int],
                   digests: list[bytes]) -> None:
    packed[0].extend(array("q", offs))
    packed[1].extend(array("q", lens))
    packed[2].extend(b"".join(digests))


def pin_run_python(column: dict, hashes: Sequence[bytes], start: int, mask: list[bool], held: list,
                   depths: list[int], tally: list[int], offsets: bytearray | None, sizes: bytearray | None,
                   sums: bytearray | None) -> int:
    """The Python twin of the native ``pin_run`` (see the module's contract)."""
    get, hold, at_depth, note = column.get, held.append, depths.append, mask.append
    offs: list[int] = []
    lens: list[int] = []
    digests: list[bytes] = []
    newly, stop = 0, len(hashes)
    try:
        for i in range(start, len(hashes)):
            block = get(hashes[i])
            if block is None:
                note(False)
                offs.append(-1)
                lens.append(0)
                digests.append(NO_SUM)
                continue
            if block.offset < 0:
                stop = i
                break
            note(True)
            at_depth(i)
            hold(block)
            if block.pins == 0:
                newly += 1
            block.pins += 1
            checksum = block.checksum  # inline (the hot loop): slot_entry of a block on the host tier
            offs.append(block.offset if checksum is not None else -1)
            lens.append(block.size if checksum is not None else 0)
            digests.append(checksum if checksum is not None else NO_SUM)
    finally:
        tally[0] += newly
    if offsets is not None:
        assert sizes is not None and sums is not None
        _append_packed((offsets, sizes, sums), offs, lens, digests)
    return stop


def pin_run_shards_python(blocks: dict, namespace: str, leaf: str, hashes: Sequence[bytes], shards: int,
                          start: int, mask: list[bool], pinned: dict, tally: list[int]) -> int:
    """The Python twin of the native ``pin_run_shards`` (see the module's contract)."""
    get, newly, stop = blocks.get, 0, len(hashes)
    try:
        for i in range(start, len(hashes)):
            h = hashes[i]
            keys = [(namespace, leaf, s, h) for s in range(shards)]
            found = [get(k) for k in keys]
            if None in found:
                mask.append(False)
                continue
            if any(block.offset < 0 and key not in pinned for key, block in zip(keys, found)):
                stop = i
                break
            for key, block in zip(keys, found):
                if key not in pinned:
                    pinned[key] = i
                    if block.pins == 0:
                        newly += 1
                    block.pins += 1
                else:
                    pinned[key] = i
            mask.append(True)
    finally:
        tally[0] += newly
    return stop


def slot_map_python(blocks: dict, covered: Any, namespace: str, leaf: str, hashes: Sequence[bytes], shards: int,
                    offsets: bytearray, sizes: bytearray, sums: bytearray) -> None:
    """The Python twin of the native ``slot_map``."""
    offs: list[int] = []
    lens: list[int] = []
    digests: list[bytes] = []
    for h in hashes:
        for s in range(shards):
            key = (namespace, leaf, s, h)
            offset, size, checksum = slot_entry(blocks.get(key) if key in covered else None)
            offs.append(offset)
            lens.append(size)
            digests.append(checksum)
    _append_packed((offsets, sizes, sums), offs, lens, digests)


def unpin_all_python(held: list) -> int:
    """The Python twin of the native ``unpin_all``."""
    reached = 0
    for block in held:
        block.pins -= 1
        if block.pins == 0:
            reached += 1
    return reached


def pin_all_python(held: list) -> int:
    """The Python twin of the native ``pin_all``."""
    reached = 0
    for block in held:
        if block.pins == 0:
            reached += 1
        block.pins += 1
    return reached


def stamp_run_python(held: list, depths: list, stamp: int,
                     order: int) -> tuple[int, dict[str, list[tuple[int, int, int, Any]]]]:
    """The Python twin of the native ``stamp_run``."""
    entries: dict[str, list[tuple[int, int, int, Any]]] = {}
    for block, depth in zip(held, depths, strict=True):
        if not block.indexed:
            continue
        block.stamp, block.depth, block.order = stamp, depth, order
        if block.offset >= 0:
            entries.setdefault(block.tenant, []).append((stamp, -depth, order, block))
        order += 1
    for made in entries.values():
        made.sort()
    return order, entries


def live_entries_python(heap: list[tuple[int, int, int, Any]]) -> list[tuple[int, int, int, Any]]:
    """The Python twin of the native ``live_entries``."""
    return [entry for entry in heap
            if (block := entry[3]).indexed and block.offset >= 0 and block.order == entry[2]]


_native: Any = None
if os.environ.get("DKV_NATIVE_INDEX", "1") != "0":
    try:
        from dkv import _store_index as _native
    except ImportError:
        _native = None

NATIVE = _native is not None
pin_run: PinRun = _native.pin_run if NATIVE else pin_run_python
pin_run_shards: Callable[..., int] = _native.pin_run_shards if NATIVE else pin_run_shards_python
slot_map: Callable[..., None] = _native.slot_map if NATIVE else slot_map_python
unpin_all: Callable[[list], int] = _native.unpin_all if NATIVE else unpin_all_python
pin_all: Callable[[list], int] = _native.pin_all if NATIVE else pin_all_python
stamp_run: Callable[..., tuple[int, dict]] = _native.stamp_run if NATIVE else stamp_run_python
live_entries: Callable[[list], list] = _native.live_entries if NATIVE else live_entries_python


def bind(block_type: type) -> None:
    """Tell the native build where ``block_type``'s fields lie (:mod:`dkv.store` calls it once)."""
    if NATIVE:
        _native.bind(block_type)
