"""No single client exhausts a node: real node processes (the store logic is in ``test_store_quotas.py``).

* (7) zero-byte blocks are counted: a client writing hundreds of thousands of
  them stops at ``--max-blocks``; the node's memory and its directory entries
  in etcd stay bounded;
* (9) a client that reserves more than the pool and never commits evicts
  nobody (the other client's blocks still load bit-exact, other writes still
  find room); a tenant over its stored quota evicts only its own blocks;
* (10) past ``--max-leases-total`` a leased lookup is refused with
  :class:`NodeBusy`, and no one's lease is ended for it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from dkv.arena import SegmentMapping
from dkv.client import handshake as handshake_as_client
from dkv.errors import NodeBusy
from dkv.etcd import Layout
from dkv.handover import redeem
from dkv.keys import BlockKey
from dkv.transport import connect
from dkv.units import parse_address
from tests.conftest import NAMESPACE, OnUcx, etcd_client, node_stats, on_ucx
from tests.dkv.test_publisher import _entries

BLOCK = 64 * 1024
SLOTS = 16
TOKEN = b"cluster-token-0123456789"
SMALL_SECRET = b"small-secret-0123456789"
BIG_SECRET = b"big-secret-0123456789ab"
WAIT = 20.0


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


async def _zero_byte_blocks(client: Any, n: int, batch: int = 1000) -> None:
    for start in range(0, n, batch):
        keys = [BlockKey("Z", 0, os.urandom(32)) for _ in range(min(batch, n - start))]
        await client.write(keys, [b""] * len(keys))


# ---- (7) ------------------------------------------------------------------------------------------


async def test_zero_byte_blocks_stop_at_max_blocks_and_the_node_memory_stays_bounded(node_factory, clients) -> None:
    bound = 2000
    node = node_factory("--max-blocks", str(bound))
    client = clients(node.address)
    await _zero_byte_blocks(client, 4 * bound)  # past the bound: the steady state
    stats = await client.stats()
    assert stats["blocks"] <= bound
    settled = _rss_bytes(stats["pid"])
    await _zero_byte_blocks(client, 200_000)  # the 2 million, scaled: ~75 MB of index unbounded
    stats = await client.stats()
    assert stats["blocks"] <= bound and stats["limits"]["max_blocks"] == bound
    assert stats["counters"]["evictions"] >= 200_000 + 4 * bound - bound
    grown = _rss_bytes(stats["pid"]) - settled
    assert grown < 24 * 2**20, f"the node grew by {grown / 2**20:.1f} MiB at a steady block count"


async def test_zero_byte_blocks_keep_the_directory_within_max_blocks(etcd, node_factory, clients) -> None:
    bound = 300
    node = node_factory(*etcd.node_args("n-zero", "--max-blocks", str(bound)))
    client = clients(node.address)
    await _zero_byte_blocks(client, 10 * bound, batch=bound)
    held = (await client.stats())["blocks"]
    assert held <= bound
    async with etcd_client(etcd.url) as etcd_:
        layout = Layout(prefix=etcd.prefix)
        deadline = asyncio.get_running_loop().time() + WAIT
        while len(entries := await _entries(etcd_, layout, "n-zero")) != held:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)
        assert len(entries) == held, "the directory lists exactly the blocks the node holds, no more"


# ---- (9) ------------------------------------------------------------------------------------------


async def _greedy_session(address: str) -> tuple[Any, SegmentMapping]:
    """A same-host client that redeemed its segment: it may reserve and copy, and then never commit."""

    async def open_() -> tuple[Any, SegmentMapping]:
        conn = await connect(*parse_address(address))
        hello = await handshake_as_client(conn, NAMESPACE, client_id="greedy")
        fd = await redeem(hello["shm"]["socket"], hello["shm"]["ticket"])
        try:
            mapping = SegmentMapping(fd, os.fstat(fd).st_size, writable=True)
        finally:
            os.close(fd)
        return conn, mapping

    conn, mapping = await on_ucx(open_())
    return OnUcx(conn), mapping


async def test_a_write_reserving_more_than_the_pool_never_committed_evicts_nobody(node_factory, clients) -> None:
    per_connection = 4 * BLOCK
    node = node_factory("--max-reserved-per-connection", str(per_connection), pool=str(SLOTS * BLOCK))
    victim = clients(node.address, local=False)
    keys = [BlockKey("V", 0, os.urandom(32)) for _ in range(SLOTS // 2)]
    payload = [os.urandom(BLOCK) for _ in keys]
    for half in (slice(0, 4), slice(4, 8)):  # each write within the connection's bound
        assert (await victim.write(keys[half], payload[half])).stored == 4

    greedy, mapping = await _greedy_session(node.address)
    try:
        await greedy.send_message({"op": "write", "keys": [["G", 0, os.urandom(32)] for _ in range(3 * SLOTS)],
                                   "sizes": [BLOCK] * (3 * SLOTS), "shm": True})
        reply = await greedy.recv_message()
        assert reply["ok"] is True, reply
        assert reply["status"] == ["write"] * 4 + ["full"] * (3 * SLOTS - 4), "reserved within its bound only"

        found = await victim.lookup([k.hash for k in keys], ["V"])
        assert found.masks["V"] == [True] * len(keys), "nobody's block was evicted for the reservation"
        dests = [bytearray(BLOCK) for _ in keys]
        await victim.read(found.lease_id, keys, dests)
        assert [bytes(d) for d in dests] == payload
        other = clients(node.address, local=False)
        fresh = [BlockKey("N", 0, os.urandom(32)) for _ in range(4)]
        assert (await other.write(fresh, [os.urandom(BLOCK) for _ in fresh])).stored == 4, "other writes find room"
        stats = await victim.stats()
        assert stats["counters"]["quota_refusals"] == 3 * SLOTS - 4 and stats["counters"]["evictions"] == 0
        assert stats["tenants"]["(cluster)"]["reserved_bytes"] == per_connection
    finally:
        await greedy.close()
        mapping.close()


def _tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(f"""
[tenants.small]
secret = "{SMALL_SECRET.decode()}"
namespaces = ["small/*"]
max_stored_bytes = "{4 * BLOCK}"

[tenants.big]
secret = "{BIG_SECRET.decode()}"
namespaces = ["big/*"]
""")
    return path


async def test_a_tenant_over_its_stored_quota_evicts_only_its_own_blocks(node_factory, clients, tmp_path) -> None:
    node = node_factory("--tenants", str(_tenants_file(tmp_path)), token=TOKEN, pool=str(SLOTS * BLOCK))
    big = clients(node.address, namespace="big/m", tenant="big", token=BIG_SECRET, local=False)
    big_keys = [BlockKey("B", 0, os.urandom(32)) for _ in range(SLOTS // 2)]
    big_payload = [os.urandom(BLOCK) for _ in big_keys]
    assert (await big.write(big_keys, big_payload)).stored == len(big_keys)

    small = clients(node.address, namespace="small/m", tenant="small", token=SMALL_SECRET, local=False)
    small_keys = [BlockKey("S", 0, os.urandom(32)) for _ in range(10)]
    for key in small_keys:  # ten blocks, one write each, against a quota of four
        assert (await small.write([key], [os.urandom(BLOCK)])).stored == 1

    held = (await small.probe([k.hash for k in small_keys], ["S"]))["S"]
    assert held == [False] * 6 + [True] * 4, "its own oldest went"
    found = await big.lookup([k.hash for k in big_keys], ["B"])
    assert found.masks["B"] == [True] * len(big_keys), "another tenant's blocks are never its quota's victims"
    dests = [bytearray(BLOCK) for _ in big_keys]
    await big.read(found.lease_id, big_keys, dests)
    assert [bytes(d) for d in dests] == big_payload
    stats = await node_stats(node.address, token=TOKEN)
    assert stats["tenants"]["small"]["stored_bytes"] == 4 * BLOCK
    assert stats["tenants"]["small"]["max_stored_bytes"] == 4 * BLOCK
    assert stats["tenants"]["big"]["blocks"] == len(big_keys)
    assert stats["counters"]["quota_evictions"] == 6


# ---- (10) -----------------------------------------------------------------------------------------


async def test_leases_beyond_the_node_cap_are_refused_with_node_busy(node_factory, clients) -> None:
    node = node_factory("--max-leases-total", "3")
    holder = clients(node.address)
    key = BlockKey("L", 0, os.urandom(32))
    await holder.write([key], [b"x" * 4096])
    held = [await holder.lookup([key.hash], ["L"], group=group) for group in range(3)]
    other = clients(node.address, client_id="other")
    with pytest.raises(NodeBusy):
        await other.lookup([key.hash], ["L"])
    stats = await holder.stats()
    assert stats["leases"] == 3 and stats["counters"]["leases_refused"] == 1
    assert stats["counters"]["leases_dropped_over_limit"] == 0, "no one's lease was ended for it"
    assert (await other.lookup([key.hash], ["L"], lease=False)).masks == {"L": [True]}
    assert await holder.release(held[0].lease_id)
    found = await other.lookup([key.hash], ["L"])
    assert found.lease_id is not None
    await other.release(found.lease_id)
    for lease in held[1:]:
        await holder.release(lease.lease_id)
