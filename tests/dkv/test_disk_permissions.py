"""Spilled blocks are as private as the arena: a real node's disk tier is a 0700 directory of 0600 files.

The node is started under umask 0, so nothing here holds by the umask's grace:
the modes are the tier's own.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dkv.keys import BlockKey
from dkv.store import WRITE
from tests.conftest import wait_for_stats

BLOCK = 64 * 1024
SLOTS = 16
SPILLS = 4


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(os.lstat(path).st_mode))


async def _spill(node, client) -> dict:
    """Write SLOTS + SPILLS blocks into a pool of SLOTS: the oldest SPILLS go to disk."""
    for _ in range(SLOTS + SPILLS):
        h = os.urandom(32)
        data = np.frombuffer(h * (BLOCK // len(h)), np.uint8).copy()
        assert (await client.write([BlockKey("L", 0, h)], [data])).statuses == [WRITE]
    stats = await wait_for_stats(node.address, lambda s: s["blocks_on_disk"] >= SPILLS and s["staging"]["blocks"] == 0)
    assert stats["blocks_on_disk"] >= SPILLS, f"the node never spilled: {stats}"
    return stats


async def test_spilled_blocks_are_owner_only_files_in_an_owner_only_directory(node_factory, clients, tmp_path) -> None:
    disk = tmp_path / "disk"  # the node creates it: owner-only too
    with _umask(0):
        node = node_factory("--disk", str(disk), "--disk-size", str(8 * BLOCK), pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    await _spill(node, client)

    tier = disk / f"dkv-spill-{node.pid}"
    files = sorted(tier.iterdir())
    assert len(files) >= SPILLS, f"spill files missing in {tier}: {files}"
    assert _mode(disk) == "0o700", "the disk directory the node created must be owner-only"
    assert _mode(tier) == "0o700", "the spill directory must be owner-only"
    assert {f.name: _mode(f) for f in files} == {f.name: "0o600" for f in files}, "spill files must be 0600"


async def test_an_existing_wide_disk_directory_still_gets_an_owner_only_tier(node_factory, clients, tmp_path) -> None:
    disk = tmp_path / "shared"
    disk.mkdir()
    disk.chmod(0o777)  # the operator's directory: left as it is; the node's own directory beneath is private
    with _umask(0):
        node = node_factory("--disk", str(disk), "--disk-size", str(8 * BLOCK), pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    await _spill(node, client)

    tier = disk / f"dkv-spill-{node.pid}"
    assert _mode(disk) == "0o777"
    assert _mode(tier) == "0o700"
    files = sorted(tier.iterdir())
    assert files and all(_mode(f) == "0o600" for f in files), {f.name: _mode(f) for f in files}
