"""Two-phase writes against a real node: a writer that dies leaves nothing; concurrent writers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dkv.keys import BlockKey
from tests.conftest import wait_for_stats

WRITER = Path(__file__).with_name("half_writer.py")


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
async def test_writer_killed_mid_write_leaves_nothing_visible(node, clients, local: bool) -> None:
    hashes = [os.urandom(32) for _ in range(2)]
    child = subprocess.Popen(
        [sys.executable, str(WRITER), node.address, "1" if local else "0", *(h.hex() for h in hashes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == b"reserved", child.stderr.read().decode() if child.poll() is not None else line
        observer = clients(node.address)
        assert await observer.probe(hashes, ["L"]) == {"L": [False, False]}, "reserved blocks must be invisible"
        assert (await observer.stats())["reservations"] == 1
    finally:
        child.kill()
        child.wait(10)
    stats = await wait_for_stats(node.address, lambda s: s["reservations"] == 0)
    assert stats["reservations"] == 0
    assert stats["counters"]["aborted_writes"] == 2
    assert await observer.probe(hashes, ["L"]) == {"L": [False, False]}
    # the keys are free again: a healthy writer stores them
    keys = [BlockKey("L", 0, h) for h in hashes]
    assert (await observer.write(keys, [b"x" * 65536] * 2)).statuses == ["write", "write"]


async def test_concurrent_writers_of_the_same_key_store_it_once(node, clients) -> None:
    key = BlockKey("L", 0, os.urandom(32))
    payloads = [np.full(2**20, i, dtype=np.uint8) for i in range(4)]
    writers = [clients(node.address, local=(i % 2 == 0)) for i in range(4)]
    results = await asyncio.gather(*(w.write([key], [p]) for w, p in zip(writers, payloads)))
    statuses = [r.statuses[0] for r in results]
    assert statuses.count("write") >= 1
    assert set(statuses) <= {"write", "busy", "exists"}
    reader = clients(node.address)
    found = await reader.lookup([key.hash], ["L"])
    dest = np.empty(2**20, dtype=np.uint8)
    await reader.read(found.lease_id, [key], [dest])
    assert len(set(dest.tolist())) == 1, "the stored block is one writer's bytes, never a mix"
    assert (await reader.stats())["blocks"] == 1
