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
from dataclasses import dataclass
from typing import NamedTuple

import torch

from connector.copy_engine import RowGroups
from dkv.keys import BlockKey, block_keys, check_hashes


class LeafRun(NamedTuple):
    """One leaf's blocks: ``hashes[i]`` goes to/from row ``block_ids[i]`` of every shard tensor.

    A named tuple (immutable, and made in a fraction of a frozen
    dataclass's time: one is made per leaf on every load and offload).
    """

    leaf: str
    shards: Sequence[torch.Tensor]
    block_ids: list[int]
    hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The validated blocks of one transfer, leaf by leaf (leaves with no blocks left out)."""

    runs: list[LeafRun]

    @property
    def device(self) -> torch.device:
        return self.runs[0].shards[0].device

    @property
    def nbytes(self) -> int:
        return sum(len(run.block_ids) * sum(int(t.shape[1]) for t in run.shards) for run in self.runs)

    def keys(self) -> list[BlockKey]:
        """One node key per block and shard, in the order of :meth:`rows`."""
        keys: list[BlockKey] = []
        for run in self.runs:
            for shard in range(len(run.shards)):
                keys += block_keys(run.leaf, shard, run.hashes)
        return keys

    @property
    def block_count(self) -> int:
        """Blocks over every leaf and shard: the length of :meth:`keys`."""
        return sum(len(run.block_ids) * len(run.shards) for run in self.runs)

    def row_groups(self) -> RowGroups:
        """One ``(shard tensor, block ids)`` per leaf and shard: their rows, in the order of :meth:`keys`."""
        return [(tensor, run.block_ids) for run in self.runs for tensor in run.shards]

    def block_ids(self) -> dict[str, list[int]]:
        return {run.leaf: run.block_ids for run in self.runs}


def plan_transfer(block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                  shards: Mapping[str, Sequence[torch.Tensor]], pages: Mapping[str, int] | None = None) -> TransferPlan:
    """Validate one transfer against a replica's shard tensors (``shards[leaf]``); ``ValueError`` on bad input.

    Every leaf of ``block_ids`` must be known and have as many hashes as ids;
    hashes are 8 or 32 bytes; block ids are distinct integers in
    ``1..pages-1`` (row 0 is the null page). ``pages[leaf]``, where given, is
    the leaf's page count (its tensors' first dimension), kept by the caller:
    asking torch for a shape costs a few µs on every call.
    """
    runs: list[LeafRun] = []
    for leaf, ids in block_ids.items():
        tensors = shards.get(leaf)
        if tensors is None:
            raise ValueError(f"unknown leaf {leaf!r}")
        hashes = check_hashes(block_hashes.get(leaf, ()))  # one native pass where they are plain bytes
        if len(ids) != len(hashes):
            raise ValueError(f"leaf {leaf!r}: {len(ids)} block ids for {len(hashes)} hashes")
        if not hashes:
            continue
        try:
            rows = list(map(operator.index, ids))  # ints and numpy ints, never floats
        except TypeError:
            raise ValueError(f"leaf {leaf!r}: block ids must be integers") from None
        count = pages[leaf] if pages is not None else int(tensors[0].shape[0])
        low, high = min(rows), max(rows)
        if low < 1 or high >= count:
            bad = low if low < 1 else high
            raise ValueError(f"leaf {leaf!r}: block id {bad} outside 1..{count - 1}")
        if len(set(rows)) != len(rows):  # one row cannot hold two blocks (and a checked row is not written again)
            twice = next(r for r, n in collections.Counter(rows).items() if n > 1)
            raise ValueError(f"leaf {leaf!r}: block id {twice} appears more than once in one transfer")
        runs.append(LeafRun(leaf, tensors, rows, hashes))
    return TransferPlan(runs)
