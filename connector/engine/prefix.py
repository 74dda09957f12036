"""Prefix-hit rules: how far a hit reaches given which blocks each leaf holds.

A hit of ``H`` blocks (blocks ``0..H-1``) is usable when

* every full-attention leaf holds all of blocks ``0..H-1``, and
* every sliding-window leaf holds the last ``window_blocks`` of them,
  ``max(0, H - window_blocks)..H-1``; the row below that is the null page.

``window_blocks = ceil(window / block_size)``. The same rules serve the device
prefix cache and the connector's masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from connector.types import AttentionKind, LeafSpec


def window_blocks(spec: LeafSpec, block_size: int) -> int | None:
    """Blocks a windowed leaf needs at the end of a hit (``None`` for a full-attention leaf)."""
    if spec.kind is AttentionKind.FULL:
        return None
    assert spec.window is not None
    return math.ceil(spec.window / block_size)


def needed_range(spec: LeafSpec, block_size: int, hit: int) -> range:
    """Block indices of a hit of ``hit`` blocks that the leaf must hold."""
    nw = window_blocks(spec, block_size)
    return range(0, hit) if nw is None else range(max(0, hit - nw), hit)


def longest_hit(
    leaves: Mapping[str, LeafSpec],
    block_size: int,
    limit: int,
    holds: Callable[[str, int], bool],
) -> int:
    """The largest ``H <= limit`` whose needed blocks ``holds(leaf, block_index)`` for every leaf."""
    hit = limit
    windowed: list[tuple[str, int]] = []
    for leaf, spec in leaves.items():
        nw = window_blocks(spec, block_size)
        if nw is None:
            run = 0
            while run < hit and holds(leaf, run):
                run += 1
            hit = run
        else:
            windowed.append((leaf, nw))
    while hit > 0 and not all(holds(leaf, i) for leaf, nw in windowed for i in range(max(0, hit - nw), hit)):
        hit -= 1
    return hit


def reconcile(
    masks: Mapping[str, Sequence[bool]],
    leaves: Mapping[str, LeafSpec],
    block_size: int,
    device_hit: int,
    *,
    require_all_leaves: bool = True,
) -> int:
    """How many blocks past ``device_hit`` a connector answer lets the manager load.

    ``masks[leaf][j]`` says whether the connector holds block ``device_hit + j``
    (every mask as long as the hashes asked about). Blocks below ``device_hit``
    are on device already. A ``probe`` answer may omit leaves
    (``require_all_leaves=False``): an omitted leaf adds no constraint.
    """
    lengths = {len(m) for m in masks.values()}
    if len(lengths) > 1:
        raise ValueError(f"masks differ in length: {sorted(lengths)}")
    if require_all_leaves and set(masks) != set(leaves):
        raise ValueError(f"masks cover leaves {sorted(masks)}, expected {sorted(leaves)}")
    unknown = set(masks) - set(leaves)
    if unknown:
        raise ValueError(f"masks name unknown leaves {sorted(unknown)}")
    n = lengths.pop() if lengths else 0
    covered = {leaf: spec for leaf, spec in leaves.items() if leaf in masks}

    def holds(leaf: str, index: int) -> bool:
        return index < device_hit or bool(masks[leaf][index - device_hit])

    return max(0, longest_hit(covered, block_size, device_hit + n, holds) - device_hit) if n else 0
