"""Plain TCP garbage sent to a node's UCX listener costs the node nothing that lasts."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from dkv.keys import BlockKey
from tests.conftest import node_stats

GARBAGE_CONNECTIONS = 1000
GARBAGE_BYTES = 4096  # more than UCX's connection-request buffer (2 KiB of private data and a header)
AT_ONCE = 100
SETTLE_BOUND = 45.0  # generous: a shared 2-core machine


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _close_wait_on(port: int) -> int:
    """TCP sockets on this host in CLOSE_WAIT whose local port is ``port``."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            count += int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "08"
    return count


async def _steady_descriptors(pid: int) -> int:
    """The node's descriptor count once it stopped moving (two equal readings in a row, bounded)."""
    deadline = time.monotonic() + SETTLE_BOUND
    last = _descriptors(pid)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        now = _descriptors(pid)
        if now == last:
            return now
        last = now
    return last


async def _send_garbage(port: int, gate: asyncio.Semaphore) -> None:
    async with gate:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(os.urandom(GARBAGE_BYTES))
            await writer.drain()
        finally:
            writer.close()
            await writer.wait_closed()


async def test_a_thousand_garbage_connections_leave_the_nodes_descriptors_where_they_were(node, clients) -> None:
    port, pid = int(node.ready["port"]), node.pid
    baseline = await _steady_descriptors(pid)
    log_lines = len(node.log_path.read_text(errors="replace").splitlines())

    gate = asyncio.Semaphore(AT_ONCE)
    await asyncio.gather(*(_send_garbage(port, gate) for _ in range(GARBAGE_CONNECTIONS)))

    deadline = time.monotonic() + SETTLE_BOUND
    while (_descriptors(pid) > baseline or _close_wait_on(port)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert _descriptors(pid) <= baseline, f"{_descriptors(pid)} descriptors, {baseline} before the garbage"
    assert _close_wait_on(port) == 0, f"{_close_wait_on(port)} sockets left in CLOSE_WAIT on port {port}"
    assert node.alive()

    client = clients(node.address, local=False)  # the node still serves, bit-exact
    key = BlockKey("full", 0, os.urandom(32))
    block = os.urandom(256 * 1024)
    assert (await client.write([key], [block])).statuses == ["write"]
    found = await client.lookup([key.hash], ["full"])
    dest = bytearray(len(block))
    await client.read(found.lease_id, [key], [dest])
    assert bytes(dest) == block

    stats = await node_stats(node.address)
    assert stats["stuck_connections_reset"] > 0, "the node's stats do not say it reset stuck connections"

    grown = len(node.log_path.read_text(errors="replace").splitlines()) - log_lines
    assert grown < 50, f"the node logged {grown} lines for {GARBAGE_CONNECTIONS} garbage connections:\n{node.log_tail()}"
