"""Disk-tier faults in a real node: the spill directory removed mid-run, the disk full.

After each fault every key still answers correctly — present and read back
exactly, or absent and writable again (never BUSY forever) — new writes
succeed, and, checked by ``node_factory``'s teardown, no lease, reservation or
pinned block is left behind.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from dkv.keys import BlockKey
from dkv.store import BUSY, WRITE
from tests.conftest import wait_for_stats

BLOCK = 64 * 1024
SLOTS = 16


def _hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _payload(h: bytes) -> np.ndarray:
    return np.frombuffer(h * (BLOCK // len(h)), np.uint8).copy()


async def _write(client, leaf: str, hashes: list[bytes]) -> list[str]:
    result = await client.write([BlockKey(leaf, 0, h) for h in hashes], [_payload(h) for h in hashes])
    return result.statuses


async def _spill_settled(node) -> dict:
    """Stats once nothing waits in staging (every spill written or failed)."""
    stats = await wait_for_stats(node.address, lambda s: s["staging"]["blocks"] == 0)
    assert stats["staging"] == {"blocks": 0, "bytes": 0}, stats
    return stats


async def _every_key_answers(client, leaf: str, hashes: list[bytes]) -> tuple[int, int]:
    """Each key is present with its exact bytes, or absent and written again; returns (present, rewritten)."""
    present = rewritten = 0
    for h in hashes:
        key = BlockKey(leaf, 0, h)
        found = await client.lookup([h], [leaf])
        if not found.masks[leaf][0]:
            if found.lease_id is not None:
                await client.release(found.lease_id)
            assert await _write(client, leaf, [h]) == [WRITE], "an absent key must be writable (not BUSY)"
            rewritten += 1
            found = await client.lookup([h], [leaf])
            assert found.masks[leaf] == [True]
        else:
            present += 1
        dest = np.empty(BLOCK, np.uint8)
        await client.read(found.lease_id, [key], [dest])
        assert np.array_equal(dest, _payload(h)), "a key answered with the wrong bytes"
    return present, rewritten


async def test_disk_directory_removed_mid_run_leaks_no_reservation_or_pin(node_factory, clients, tmp_path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    node = node_factory("--disk", str(spill), "--disk-size", str(8 * BLOCK), pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    chain = _hashes(4)
    fillers = _hashes(SLOTS)
    await _write(client, "L", chain)
    for h in fillers:
        assert await _write(client, "F", [h]) == [WRITE]
    stats = await wait_for_stats(node.address, lambda s: s["counters"]["spills"] >= 4)
    assert stats["counters"]["spills"] == 4 and stats["blocks_on_disk"] == 4, "the chain went to disk"

    shutil.rmtree(spill)  # the operator removes the disk tier's directory under the running node

    found = await client.lookup(chain, ["L"])  # the reads fail: nothing promoted, nothing pinned
    assert found.masks == {"L": [False] * 4}
    stats = await client.stats()
    assert stats["pinned_blocks"] == 0 and stats["counters"]["disk_errors"] == 4
    if found.lease_id is not None:
        await client.release(found.lease_id)

    more = _hashes(SLOTS)
    for h in more:  # every eviction's spill now fails; the writes do not
        assert await _write(client, "M", [h]) == [WRITE]
    stats = await _spill_settled(node)
    assert stats["counters"]["disk_errors"] > 4 and stats["reservations"] == 0
    assert stats["disk"]["used"] == 0 and stats["blocks_on_disk"] == 0

    assert await _every_key_answers(client, "L", chain) == (0, 4)
    for leaf, hashes in (("F", fillers), ("M", more)):
        present, rewritten = await _every_key_answers(client, leaf, hashes)
        assert present + rewritten == len(hashes)
    statuses = await _write(client, "N", _hashes(4))
    assert statuses == [WRITE] * 4 and BUSY not in statuses
    await _spill_settled(node)


@dataclass
class FillingDisk:
    """A directory whose writes run out of space: a tiny tmpfs, or a file-size limit on the node."""

    path: Path
    tmpfs: bool

    def limit(self, node) -> None:
        """Without a tmpfs, make the node's spill writes fail for real: a file-size limit (EFBIG)."""
        if not self.tmpfs:
            limit = BLOCK - 4096
            resource.prlimit(node.pid, resource.RLIMIT_FSIZE, (limit, limit))


@pytest.fixture
def filling_disk(tmp_path) -> Iterator[FillingDisk]:
    """A tmpfs with room for about four blocks where this process may mount one (root), else a plain directory."""
    path = tmp_path / "small"
    path.mkdir()
    mounted = False
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={4 * BLOCK}", "tmpfs", str(path)],
                       check=True, capture_output=True, timeout=10)
        mounted = True
    yield FillingDisk(path, mounted)
    if mounted:  # lazily: the node (stopped after this by node_factory) may still hold the directory
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=10)


async def test_disk_full_mid_run_drops_spills_and_leaks_no_reservation_or_pin(filling_disk, node_factory, clients) -> None:
    # the tier believes it has 64 blocks of room; the filesystem holds about four
    node = node_factory("--disk", str(filling_disk.path), "--disk-size", str(64 * BLOCK), pool=str(SLOTS * BLOCK))
    filling_disk.limit(node)
    client = clients(node.address)
    chain = _hashes(4)
    fillers = _hashes(3 * SLOTS)
    await _write(client, "L", chain)
    for h in fillers:  # 2 * SLOTS + 4 evictions: the disk fills, and every spill after that fails
        assert await _write(client, "F", [h]) == [WRITE]
    stats = await _spill_settled(node)
    assert stats["counters"]["disk_errors"] > 0, "the disk never filled"
    assert stats["reservations"] == 0 and stats["pinned_blocks"] == 0
    assert stats["disk"]["used"] == stats["blocks_on_disk"] * BLOCK

    present, rewritten = await _every_key_answers(client, "L", chain)
    assert present + rewritten == len(chain)
    present, rewritten = await _every_key_answers(client, "F", fillers)
    assert present + rewritten == len(fillers) and rewritten > 0
    statuses = await _write(client, "N", _hashes(4))
    assert statuses == [WRITE] * 4
    await _spill_settled(node)
