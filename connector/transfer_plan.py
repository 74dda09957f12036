"""What one load or offload moves: validated on the scheduler thread, expanded where the bytes move.

The engine's scheduler thread calls ``load``/``offload`` synchronously, so the
connector does there only what must happen before it returns: check every
leaf, hash and block id (a bad one is a ``ValueError`` before anything moves).
Turning the request into one node key and one ``(tensor, block id)`` row per
block and TP shard is per-block Python work; :meth:`TransferPlan.keys` and
:meth:`TransferPlan.row_groups` do it later, on the UCX loop thread.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from connector.copy_engine import RowGroups
from dkv.keys import BlockKey, block_keys, check_hashes


class LeafTensors(NamedTuple):
    """One leaf's shard tensors in one replica, with what every transfer asks of them, read once.

    Asking torch for a shape or a device costs µs a time on the scheduler
    thread (and more in a call whose code is cold), on every load and offload.
    """

    shards: Sequence[torch.Tensor]
    pages: int  # rows of each tensor: block ids 1..pages-1 (row 0 is the null page)
    row_bytes: int  # one block's bytes over every shard (contiguous 2-D uint8 tensors)
    device: torch.device


def leaf_tensors(shards: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, LeafTensors]:
    """:class:`LeafTensors` of each leaf of one replica's shard tensors (``shards[leaf]``)."""
    return {leaf: LeafTensors(tensors, int(tensors[0].shape[0]), sum(int(t.shape[1]) for t in tensors),
                              tensors[0].device)
            for leaf, tensors in shards.items()}


class LeafRun(NamedTuple):
    """One leaf's blocks: ``hashes[i]`` goes to/from row ``block_ids[i]`` of every shard tensor.

    A named tuple (immutable, and made in a fraction of a frozen
    dataclass's time: one is made per leaf on every load and offload).
    ``row_bytes`` and ``device`` are the leaf's (:class:`LeafTensors`).
    """

    leaf: str
    shards: Sequence[torch.Tensor]
    block_ids: list[int]
    hashes: list[bytes]
    row_bytes: int
    device: torch.device

    def subset(self, keep: Sequence[int]) -> LeafRun:
        """The same leaf's blocks at the indexes ``keep`` (in that order)."""
        return self._replace(block_ids=[self.block_ids[i] for i in keep], hashes=[self.hashes[i] for i in keep])


class TransferPlan:
    """The validated blocks of one transfer, leaf by leaf (leaves with no blocks left out). Read-only once made.

    Its sizes are summed once, here: the scheduler thread asks for them
    several times a call.
    """

    __slots__ = ("runs", "nbytes", "block_count")

    def __init__(self, runs: list[LeafRun]) -> None:
        self.runs = runs
        nbytes = blocks = 0
        for run in runs:
            nbytes += len(run.block_ids) * run.row_bytes
            blocks += len(run.block_ids) * len(run.shards)
        self.nbytes = nbytes  # bytes over every leaf and shard
        self.block_count = blocks  # blocks over every leaf and shard: the length of keys()

    @property
    def device(self) -> torch.device:
        return self.runs[0].device

    def keys(self) -> list[BlockKey]:
        """One node key per block and shard, in the order of :meth:`rows`."""
        keys: list[BlockKey] = []
        for run in self.runs:
            for shard in range(len(run.shards)):
                keys += block_keys(run.leaf, shard, run.hashes)
        return keys

    def row_groups(self) -> RowGroups:
        """One ``(shard tensor, block ids)`` per leaf and shard: their rows, in the order of :meth:`keys`."""
        return [(tensor, run.block_ids) for run in self.runs for tensor in run.shards]

    def block_ids(self) -> dict[str, list[int]]:
        return {run.leaf: run.block_ids for run in self.runs}


def plain_block_ids_python(ids: object, pages: int) -> list[int] | None:
    """A new list of ``ids`` when they are plain ints in ``1..pages-1``, no two alike; else ``None`` (the native twin)."""
    if type(ids) not in (list, tuple) or not all(type(i) is int and 1 <= i < pages for i in ids):  # type: ignore[attr-defined]
        return None
    rows = list(ids)  # type: ignore[call-overload]
    return rows if len(set(rows)) == len(rows) else None


try:  # one C pass for the usual block ids (a list of ints), on every load and offload
    from dkv._hash_check import plain_block_ids
except ImportError:  # not built (no C compiler at install): the same answer in Python
    plain_block_ids = plain_block_ids_python


def _checked_block_ids(leaf: str, ids: Sequence[int], pages: int) -> list[int]:
    """``ids`` as a new list of ints, each in ``1..pages-1`` and no two alike; ``ValueError`` naming what is wrong."""
    try:
        rows = list(map(operator.index, ids))  # ints and numpy ints, never floats
    except TypeError:
        raise ValueError(f"leaf {leaf!r}: block ids must be integers") from None
    if not rows:
        return rows
    low, high = min(rows), max(rows)
    if low < 1 or high >= pages:
        bad = low if low < 1 else high
        raise ValueError(f"leaf {leaf!r}: block id {bad} outside 1..{pages - 1}")
    if len(set(rows)) != len(rows):  # one row cannot hold two blocks (and a checked row is not written again)
        twice = next(r for r, n in collections.Counter(rows).items() if n > 1)
        raise ValueError(f"leaf {leaf!r}: block id {twice} appears more than once in one transfer")
    return rows


def plan_transfer(block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                  leaves: Mapping[str, LeafTensors]) -> TransferPlan:
    """Validate one transfer against a replica's leaves (:func:`leaf_tensors`); ``ValueError`` on bad input.

    Every leaf of ``block_ids`` must be known and have as many hashes as ids;
    hashes are 8 or 32 bytes; block ids are distinct integers in
    ``1..pages-1`` (row 0 is the null page).
    """
    runs: list[LeafRun] = []
    for leaf, ids in block_ids.items():
        tensors = leaves.get(leaf)
        if tensors is None:
            raise ValueError(f"unknown leaf {leaf!r}")
        hashes = check_hashes(block_hashes.get(leaf, ()))  # one native pass where they are plain bytes
        if len(ids) != len(hashes):
            raise ValueError(f"leaf {leaf!r}: {len(ids)} block ids for {len(hashes)} hashes")
        if not hashes:
            continue
        rows = plain_block_ids(ids, tensors.pages)  # one native pass for a list of ints
        if rows is None:
            rows = _checked_block_ids(leaf, ids, tensors.pages)
        runs.append(LeafRun(leaf, tensors.shards, rows, hashes, tensors.row_bytes, tensors.device))
    return TransferPlan(runs)
