"""Membership and directory against real etcd and real node processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from cluster.etcd_process import start_etcd
from cluster.process import NodeStartError
from dkv.etcd import Layout, MemberRecord, make_client, prefix_end
from dkv.keys import BlockKey
from tests.conftest import WAIT_BOUND, node_stats

NS = "test/ns0"


class EtcdView:
    """Reads one cluster's keys straight from etcd."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = make_client(url)
        self.layout = Layout("default", prefix)

    async def members(self) -> dict[str, MemberRecord]:
        got = await self.client.kv.get(self.layout.nodes, range_end=prefix_end(self.layout.nodes), timeout=5)
        return {r.node_id: r for kv in got.kvs if (r := MemberRecord.from_json(kv.value)) is not None}

    async def entries(self, node_id: str) -> set[bytes]:
        got = await self.client.kv.get(self.layout.blocks, range_end=prefix_end(self.layout.blocks),
                                       keys_only=True, timeout=5)
        return {p[1] for kv in got.kvs if (p := self.layout.parse_block_key(kv.key.decode())) and p[2] == node_id}

    async def until(self, predicate, what: str) -> None:
        deadline = time.monotonic() + WAIT_BOUND
        while True:
            try:
                if await predicate():
                    return
            except Exception:  # noqa: BLE001 - etcd may be coming back
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {WAIT_BOUND}s: {what}")
            await asyncio.sleep(0.1)


@pytest.fixture
async def view(etcd) -> AsyncIterator[EtcdView]:
    v = EtcdView(etcd.url, etcd.prefix)
    await v.client.connect()
    yield v
    await v.client.close()


async def _write_chain(client, n: int) -> list[bytes]:
    hashes = [os.urandom(32) for _ in range(n)]
    await client.write([BlockKey("L", 0, h) for h in hashes], [b"k" * 1024] * n)
    return hashes


async def test_killed_node_vanishes_from_membership_and_directory_within_ttl(etcd, view, node_factory, clients) -> None:
    node = node_factory(*etcd.node_args("victim", ttl=2))
    survivor = node_factory(*etcd.node_args("survivor", ttl=2))
    client = clients(node.address)
    hashes = await _write_chain(client, 4)
    await view.until(lambda: _eq(view.entries("victim"), set(hashes)), "victim's entries published")
    await client.close()
    node.kill()
    await view.until(lambda: _absent(view.members(), "victim"), "victim's member key gone")
    await view.until(lambda: _eq(view.entries("victim"), set()), "victim's entries gone")
    peers = subprocess.run([sys.executable, "-m", "dkv.cli", "peers", *etcd.cli_args(), "--json"],
                           capture_output=True, text=True, timeout=60)
    assert peers.returncode == 0, peers.stderr
    assert [p["node_id"] for p in json.loads(peers.stdout)] == ["survivor"]
    _ = survivor


async def test_second_live_node_with_the_same_id_is_refused(etcd, node_factory) -> None:
    node_factory(*etcd.node_args("twin"))
    with pytest.raises(NodeStartError, match="already registered"):
        node_factory(*etcd.node_args("twin"))


async def test_a_node_killed_and_restarted_on_its_address_registers_again_at_once(etcd, view, node_factory,
                                                                                   clients) -> None:
    ttl = 60  # far longer than any wait below: the restart must not wait out the dead node's lease
    first = node_factory(*etcd.node_args("lazarus", ttl=ttl))  # port 0: a port picked first could be taken before
    listen = first.address
    old_epoch = (await view.members())["lazarus"].epoch
    client = clients(first.address)
    hashes = await _write_chain(client, 2)
    await view.until(lambda: _eq(view.entries("lazarus"), set(hashes)), "entries published")
    await client.close()
    first.kill()

    second = node_factory(*etcd.node_args("lazarus", ttl=ttl), listen=listen)  # old code: "already registered"
    assert second.address == first.address
    members = await view.members()
    assert members["lazarus"].epoch != old_epoch
    await view.until(lambda: _eq(view.entries("lazarus"), set()), "the dead node's entries went with its lease")
    with pytest.raises(NodeStartError, match="already registered"):  # a live holder elsewhere is still refused
        node_factory(*etcd.node_args("lazarus", ttl=ttl))


async def test_restarted_node_gets_a_new_epoch(etcd, view, node_factory, clients) -> None:
    first = node_factory(*etcd.node_args("phoenix"))
    old_epoch = (await view.members())["phoenix"].epoch
    client = clients(first.address)
    hashes = await _write_chain(client, 2)
    await view.until(lambda: _eq(view.entries("phoenix"), set(hashes)), "entries published")
    await client.close()
    first.stop()
    await view.until(lambda: _eq(view.entries("phoenix"), set()), "a graceful stop revokes its entries at once")
    second = node_factory(*etcd.node_args("phoenix"))
    members = await view.members()
    assert members["phoenix"].epoch != old_epoch
    client = clients(second.address)
    fresh = await _write_chain(client, 3)
    await view.until(lambda: _eq(view.entries("phoenix"), set(fresh)), "the restarted node publishes")


async def test_lost_lease_reregisters_with_a_new_epoch_and_republishes(etcd, view, node_factory, clients) -> None:
    node = node_factory(*etcd.node_args("lossy", ttl=2))
    client = clients(node.address)
    hashes = await _write_chain(client, 5)
    await view.until(lambda: _eq(view.entries("lossy"), set(hashes)), "entries published")
    before = (await view.members())["lossy"]
    lease = (await node_stats(node.address))["cluster"]["lease"]
    await view.client.lease.revoke(lease, timeout=5)  # what an expiry does to a node
    await view.until(lambda: _epoch_changed(view, "lossy", before.epoch), "re-registered with a new epoch")
    await view.until(lambda: _eq(view.entries("lossy"), set(hashes)), "what it holds is republished")
    stats = await node_stats(node.address)
    assert stats["cluster"]["lease_losses"] >= 1 and stats["cluster"]["registrations"] >= 2
    assert stats["epoch"] == (await view.members())["lossy"].epoch


async def test_etcd_outage_longer_than_ttl_then_directory_converges(node_factory, clients, tmp_path) -> None:
    private = start_etcd(data_dir=tmp_path / "etcd")
    try:
        prefix = "/dkv-outage"
        node = node_factory("--etcd", private.url, "--etcd-prefix", prefix, "--node-id", "steady",
                            "--etcd-ttl", "2")
        view = EtcdView(private.url, prefix)
        await view.client.connect()
        client = clients(node.address)
        before = await _write_chain(client, 4)
        await view.until(lambda: _eq(view.entries("steady"), set(before)), "entries published")
        await view.client.close()

        private.stop(keep_data=True)
        during = await _write_chain(client, 3)  # the node keeps serving while etcd is away
        found = await client.lookup(before + during, ["L"])
        assert found.masks["L"] == [True] * 7
        await client.read(found.lease_id, [BlockKey("L", 0, h) for h in before + during],
                          [bytearray(1024) for _ in range(7)])
        await asyncio.sleep(2 * 2 + 1)  # longer than the TTL
        private = private.restart()

        view = EtcdView(private.url, prefix)
        await view.client.connect()
        await view.until(lambda: _present(view.members(), "steady"), "the node is a member again")
        await view.until(lambda: _eq(view.entries("steady"), set(before + during)),
                         "the directory converges to what the node holds")
        await view.client.close()
        await client.close()
        node.stop()  # before etcd goes: a graceful stop revokes its lease
    finally:
        private.stop()


async def _eq(awaitable, expected) -> bool:
    return await awaitable == expected


async def _absent(members_awaitable, node_id: str) -> bool:
    return node_id not in await members_awaitable


async def _present(members_awaitable, node_id: str) -> bool:
    return node_id in await members_awaitable


async def _epoch_changed(view: EtcdView, node_id: str, old: str) -> bool:
    members = await view.members()
    return node_id in members and members[node_id].epoch != old
