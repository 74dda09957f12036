"""Disk-tier faults in a real node: the disk full, the tier's directory removed under it.

A full or vanished tier degrades to memory only, counted, and spills again
once space (or the directory) is back. After each fault: every write
succeeds; a key the node reports present (an unleased lookup) is found by a
leased lookup and reads back bit-exact, and a key it reports absent is not
(never an entry for a block nobody has) and can be written again (never BUSY
forever); the tier holds no ``.tmp`` and no short file; the counters name the
fault (``disk_spill_failed``, ``disk_degraded``, ``disk_degraded_drops``,
``disk_lost``) and the recovery (``disk_recovered``). ``node_factory``'s
teardown checks that no lease, reservation or pinned block is left behind.

The full disk is a small tmpfs mounted in the node's own mount namespace
(``unshare --mount``, root only; a visible skip elsewhere): nothing is mounted
on the machine, and the mount ends with the node. The test looks into that
namespace with ``nsenter`` to list the tier's files and to grow the tmpfs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.process import READY_TIMEOUT, NodeProcess
from dkv.keys import BlockKey
from dkv.store import WRITE
from tests.conftest import WAIT_BOUND, node_stats, wait_for_stats

BLOCK = 64 * 1024
SLOTS = 16  # the pool holds this many blocks
TIER_BLOCKS = 64  # what the tier's --disk-size allows
FULL_TMPFS_BLOCKS = 4  # what the small tmpfs holds: it fills long before the tier's cap
ROOMY_TMPFS_BLOCKS = 2 * TIER_BLOCKS  # after the remount: room for the whole tier


def mount_namespace_unavailable() -> str | None:
    """``None`` when a tmpfs can be mounted in a private mount namespace here, else why not."""
    if os.geteuid() != 0:
        return "a private tmpfs needs root (mount namespaces)"
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (Debian package util-linux / mount) is missing"
    with tempfile.TemporaryDirectory() as point:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private",
                                "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", point],
                               capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"`unshare --mount` cannot mount a tmpfs here: {probe.stderr.strip()}"
    return None


def in_namespace(node: NodeProcess, *command: str) -> str:
    """Run ``command`` in ``node``'s mount namespace (where its tmpfs is); its stdout."""
    result = subprocess.run(["nsenter", "--target", str(node.pid), "--mount", "--", *command],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout


@pytest.fixture
async def tmpfs_nodes(tmp_path: Path, node_factory: Any) -> AsyncIterator[Callable[..., NodeProcess]]:
    """Start ``dkv serve`` with its ``--disk`` directory on a tmpfs of its own (a private mount namespace).

    The node is exec'd by the shell that mounted the tmpfs, so its PID is the
    one ``unshare`` started; it is stopped by that PID. At teardown (after the
    test's clients closed) it must hold no lease, reservation or pin.
    """
    reason = mount_namespace_unavailable()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    started: list[NodeProcess] = []

    def start(disk_dir: Path, tmpfs_bytes: int, *args: str, pool: str) -> NodeProcess:
        workdir = tmp_path / f"tmpfs-node{len(started)}"
        workdir.mkdir()
        ready_file, log_path = workdir / "ready.json", workdir / "node.log"
        mount_then_exec = 'mount -t tmpfs -o "size=$1,mode=0700" tmpfs "$2" && shift 2 && exec "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount_then_exec, "sh",
                   str(tmpfs_bytes), str(disk_dir),
                   sys.executable, "-m", "dkv.cli", "serve", "--listen", "127.0.0.1:0", "--pool", pool,
                   "--ready-file", str(ready_file), "--exit-with-parent", "--disk", str(disk_dir), *args]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        node = NodeProcess(proc, workdir, log_path)
        started.append(node)
        deadline = time.monotonic() + READY_TIMEOUT
        while not ready_file.exists():
            assert node.alive(), f"the node exited:\n{node.log_tail()}"
            assert time.monotonic() < deadline, f"the node did not start:\n{node.log_tail()}"
            time.sleep(0.05)
        node.ready = json.loads(ready_file.read_text())
        return node

    yield start
    try:
        for node in started:
            if node.alive():
                stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0 and s["reservations"] == 0)
                assert stats["leases"] == 0 and stats["reservations"] == 0 and stats["pinned_blocks"] == 0, stats
    finally:
        for node in started:
            node.stop()


def _hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _payload(h: bytes) -> np.ndarray:
    return np.frombuffer(h * (BLOCK // len(h)), np.uint8).copy()


async def _write_each(client: Any, leaf: str, hashes: list[bytes]) -> None:
    """Write the blocks one at a time (each may evict one); every write must be stored."""
    for h in hashes:
        result = await client.write([BlockKey(leaf, 0, h)], [_payload(h)])
        assert result.statuses == [WRITE], "a write failed while the disk tier was faulty"


async def _settled(node: NodeProcess) -> dict[str, Any]:
    """Stats once nothing waits in staging (every spill written or failed)."""
    stats = await wait_for_stats(node.address, lambda s: s["staging"]["blocks"] == 0)
    assert stats["staging"] == {"blocks": 0, "bytes": 0}, stats
    return stats


async def _every_key_answers(client: Any, leaf: str, hashes: list[bytes], *, rewrite: bool = False) -> tuple[int, int]:
    """Per key: the unleased answer is the leased one; a present block reads back bit-exact.

    With ``rewrite``, an absent key is written again (it must be WRITE, never
    BUSY) and then read back. Returns ``(present, rewritten)``.
    """
    present = rewritten = 0
    for h in hashes:
        key = BlockKey(leaf, 0, h)
        reported = (await client.lookup([h], [leaf], lease=False)).masks[leaf][0]
        found = await client.lookup([h], [leaf])
        assert found.masks[leaf][0] == reported, "the node reports a block it cannot serve (or hides one it has)"
        if reported:
            present += 1
        elif rewrite:
            if found.lease_id is not None:
                await client.release(found.lease_id)
            await _write_each(client, leaf, [h])
            rewritten += 1
            found = await client.lookup([h], [leaf])
            assert found.masks[leaf] == [True]
        else:
            if found.lease_id is not None:
                await client.release(found.lease_id)
            continue
        dest = np.zeros(BLOCK, np.uint8)
        await client.read(found.lease_id, [key], [dest])
        assert np.array_equal(dest, _payload(h)), "a block came back with the wrong bytes"
    return present, rewritten


def _assert_clean_files(listing: list[tuple[str, int]], stats: dict[str, Any]) -> None:
    """The tier's files: whole blocks only, one per block on disk; no ``.tmp``, no empty or short file."""
    assert not [name for name, _ in listing if name.endswith(".tmp")], f"temporary files left: {listing}"
    assert all(size == BLOCK for _, size in listing), f"a spill file is not a whole block: {listing}"
    assert len(listing) == stats["blocks_on_disk"] == stats["disk"]["used"] // BLOCK, (listing, stats)


def _files_in_namespace(node: NodeProcess, disk_dir: Path) -> list[tuple[str, int]]:
    out = in_namespace(node, "find", str(disk_dir), "-type", "f", "-printf", "%s %P\n")
    return [(name, int(size)) for size, name in (line.split(" ", 1) for line in out.splitlines())]


def _files_in(disk_dir: Path) -> list[tuple[str, int]]:
    return [(str(p.relative_to(disk_dir)), p.stat().st_size) for p in disk_dir.rglob("*") if p.is_file()]


async def _write_until_spilling_again(node: NodeProcess, client: Any, leaf: str) -> list[bytes]:
    """Write blocks one at a time until the node counts a recovery and a new spill (bounded); the hashes written."""
    before = (await node_stats(node.address))["counters"]["spills"]
    written: list[bytes] = []
    deadline = time.monotonic() + WAIT_BOUND
    while True:
        h = _hashes(1)
        await _write_each(client, leaf, h)
        written += h
        counters = (await node_stats(node.address))["counters"]
        if counters["disk_recovered"] >= 1 and counters["spills"] > before:
            return written
        assert time.monotonic() < deadline, f"spills never resumed: {counters}"
        await asyncio.sleep(0.05)


async def _spill_fresh_blocks(node: NodeProcess, client: Any) -> list[bytes]:
    """Write blocks and push them out of the pool with as many more: every one of them spills (settled)."""
    fresh = _hashes(SLOTS // 2)
    await _write_each(client, "S", fresh)
    before = (await node_stats(node.address))["counters"]["spills"]
    await _write_each(client, "P", _hashes(SLOTS))
    stats = await _settled(node)
    assert stats["counters"]["spills"] - before >= len(fresh), stats["counters"]
    return fresh


async def _assert_read_back_from_disk(client: Any, spilled: list[bytes]) -> None:
    """Every one of ``spilled`` is reported present, comes back from disk, and reads back bit-exact."""
    hits = (await client.stats())["counters"]["disk_hits"]
    assert await _every_key_answers(client, "S", spilled) == (len(spilled), 0)
    assert (await client.stats())["counters"]["disk_hits"] - hits >= len(spilled), "they did not come from disk"


async def test_a_full_disk_tier_degrades_to_memory_only_and_spills_again_once_space_returns(
        tmpfs_nodes: Callable[..., NodeProcess], clients: Any, tmp_path: Path) -> None:
    disk_dir = tmp_path / "tier"
    disk_dir.mkdir()
    node = tmpfs_nodes(disk_dir, FULL_TMPFS_BLOCKS * BLOCK, "--disk-size", str(TIER_BLOCKS * BLOCK),
                       pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    chain, fillers = _hashes(4), _hashes(3 * SLOTS)
    await _write_each(client, "L", chain)
    await _write_each(client, "F", fillers)  # 2 * SLOTS + 4 evictions: the tmpfs fills after about four

    stats = await _settled(node)
    counters = stats["counters"]
    assert counters["disk_spill_failed"] >= 1, f"the tmpfs never filled: {counters}"
    assert counters["disk_degraded"] == 1 and counters["disk_recovered"] == 0, counters
    assert counters["disk_degraded_drops"] > 0, "once degraded, evictions drop instead of spilling"
    assert stats["reservations"] == 0 and stats["pinned_blocks"] == 0
    _assert_clean_files(_files_in_namespace(node, disk_dir), stats)

    on_disk_before = stats["blocks_on_disk"]
    from_disk = min(on_disk_before, len(chain))  # the oldest blocks went first: the chain's
    present, _ = await _every_key_answers(client, "L", chain)
    assert present == from_disk > 0, "the chain's blocks on disk answer from disk"
    assert (await client.stats())["counters"]["disk_hits"] == from_disk
    present, rewritten = await _every_key_answers(client, "F", fillers, rewrite=True)
    assert present + rewritten == len(fillers) and rewritten > 0

    in_namespace(node, "mount", "-o", f"remount,size={ROOMY_TMPFS_BLOCKS * BLOCK}", str(disk_dir))
    await _write_until_spilling_again(node, client, "R")
    failed = (await client.stats())["counters"]["disk_spill_failed"]
    spilled = await _spill_fresh_blocks(node, client)
    stats = await _settled(node)
    counters = stats["counters"]
    # the promotions above freed files too: a probe then may have spilled into them, until the disk was full again
    assert counters["disk_recovered"] >= 1 and counters["disk_degraded"] == counters["disk_recovered"], counters
    assert counters["disk_spill_failed"] == failed, "a spill failed after the space returned"
    _assert_clean_files(_files_in_namespace(node, disk_dir), stats)
    await _assert_read_back_from_disk(client, spilled)


async def test_a_removed_disk_tier_directory_drops_its_blocks_at_once_and_is_made_again(
        node_factory: Callable[..., NodeProcess], clients: Any, tmp_path: Path) -> None:
    disk_dir = tmp_path / "tier"
    disk_dir.mkdir()
    node = node_factory("--disk", str(disk_dir), "--disk-size", str(TIER_BLOCKS * BLOCK), pool=str(SLOTS * BLOCK))
    client = clients(node.address)
    chain, fillers = _hashes(4), _hashes(SLOTS)
    await _write_each(client, "L", chain)
    await _write_each(client, "F", fillers)
    stats = await wait_for_stats(node.address, lambda s: s["counters"]["spills"] >= 4)
    assert stats["counters"]["spills"] == 4 and stats["blocks_on_disk"] == 4, "the chain went to disk"

    shutil.rmtree(disk_dir)  # the operator removes the tier under the running node; no request follows

    stats = await wait_for_stats(node.address, lambda s: s["counters"].get("disk_lost", 0) >= 4)
    masks = (await client.lookup(chain, ["L"], lease=False)).masks
    assert masks == {"L": [False] * 4}, "blocks whose files are gone are still reported present"
    counters = stats["counters"]
    assert counters["disk_lost"] == 4 and counters["disk_degraded"] == 1, counters
    assert stats["blocks_on_disk"] == 0 and stats["disk"]["used"] == 0

    more = _hashes(SLOTS)
    await _write_each(client, "M", more)  # memory only: evictions drop, writes go on
    assert await _every_key_answers(client, "L", chain, rewrite=True) == (0, 4), "the lost keys can be written again"
    for leaf, hashes in (("F", fillers), ("M", more)):
        present, rewritten = await _every_key_answers(client, leaf, hashes, rewrite=True)
        assert present + rewritten == len(hashes)

    await _write_until_spilling_again(node, client, "R")
    spilled = await _spill_fresh_blocks(node, client)
    stats = await _settled(node)
    assert stats["counters"]["disk_degraded"] == 1 and stats["counters"]["disk_recovered"] == 1, stats["counters"]
    roots = list(disk_dir.iterdir())
    assert len(roots) == 1 and stat.S_IMODE(roots[0].stat().st_mode) == 0o700, "the tier's directory is made again, 0700"
    assert stat.S_IMODE(disk_dir.stat().st_mode) == 0o700
    _assert_clean_files(_files_in(disk_dir), stats)
    await _assert_read_back_from_disk(client, spilled)

