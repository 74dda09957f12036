"""The router's state as other threads see it: whole snapshots, never an emptied or half-built one.

The router changes its index on its loop; an engine's scheduler thread (the
connector's probe and hints) and the demo read it from other threads at any
time. These tests drive a router from a real etcd (entries written straight
to etcd on leases the test grants, so no node process is needed) and read it
while it changes: during a snapshot reload, after a membership change, and
from another thread while the directory churns.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.conftest import etcd_client as _etcd, etcd_lease as _lease
from dkv.etcd import MAX_TXN_OPS, Layout, MemberRecord
from dkv.router import Router

NS = "test/snap"
BULK_NS = "test/bulk"
ANCHOR = "anchor"  # a member that never leaves and holds the whole chain
WAIT = 20.0




def _chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _record(node_id: str, host_used: int = 0) -> MemberRecord:
    return MemberRecord(node_id=node_id, address=f"127.0.0.1:{7000 + len(node_id)}", epoch=f"{node_id}-1",
                        protocol_version=1, started_at=0.0, host_id="h", host_used=host_used)


async def _put_entries(client: Any, layout: Layout, lease: int, namespace: str, hashes: Sequence[bytes],
                       node_id: str) -> None:
    kv = client.kv
    for start in range(0, len(hashes), MAX_TXN_OPS):
        ops = [kv.txn_op_put(layout.block_key(namespace, h, node_id), "e", lease=lease)
               for h in hashes[start:start + MAX_TXN_OPS]]
        await kv.txn(compare=[], success=ops, timeout=5)


async def _delete_entries(client: Any, layout: Layout, namespace: str, hashes: Sequence[bytes], node_id: str) -> None:
    kv = client.kv
    for start in range(0, len(hashes), MAX_TXN_OPS):
        ops = [kv.txn_op_delete(layout.block_key(namespace, h, node_id)) for h in hashes[start:start + MAX_TXN_OPS]]
        await kv.txn(compare=[], success=ops, timeout=5)


async def _anchor(client: Any, layout: Layout, lease: int, chain: Sequence[bytes], bulk: int) -> None:
    """The anchor member, holding ``chain`` and ``bulk`` unrelated entries (to make a reload take a while)."""
    await client.kv.put(layout.node_key(ANCHOR), _record(ANCHOR).to_json(), lease=lease, timeout=5)
    await _put_entries(client, layout, lease, NS, chain, ANCHOR)
    await _put_entries(client, layout, lease, BULK_NS, _chain(bulk), ANCHOR)


class _SpyLayout:
    """The router's layout, calling ``check`` each time the router parses a directory key."""

    def __init__(self, layout: Layout, check: Callable[[], None]) -> None:
        self._layout = layout
        self._check = check

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layout, name)

    def parse_block_key(self, key: str) -> Any:
        self._check()
        return self._layout.parse_block_key(key)


def _inconsistencies(router: Router, chain: Sequence[bytes], entries_at_least: int) -> list[str]:
    """What a reader that may run at any moment finds wrong with the router's answers (empty: all consistent).

    The anchor is a member throughout and holds the whole chain; nothing else holds all of it.
    """
    wrong = []
    members = router.members
    if ANCHOR not in members:
        wrong.append(f"the anchor is not among the members {sorted(members)}")
    if any(m.node_id != node_id for node_id, m in members.items()):
        wrong.append("a member table whose records are not its keys'")
    route = router.route(NS, chain)
    if route.peer is None or route.peer.node_id != ANCHOR or route.depth != len(chain):
        wrong.append(f"route gave {route.peer.node_id if route.peer else None} at depth {route.depth}")
    if router.depth_of(ANCHOR, NS, chain) != len(chain):
        wrong.append(f"depth_of the anchor is {router.depth_of(ANCHOR, NS, chain)}")
    if ANCHOR not in router.holders(NS, chain[0]):
        wrong.append("the anchor does not hold the root")
    if router.entries < entries_at_least:
        wrong.append(f"{router.entries} entries, fewer than the anchor's {entries_at_least}")
    return wrong


# ---- a reload builds aside and swaps ---------------------------------------------------------------


async def test_router_reader_never_sees_an_empty_member_table_during_reload(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    chain = _chain(16)
    bulk = 500
    async with _etcd(etcd.url) as client, _lease(client) as lease:
        await _anchor(client, layout, lease, chain, bulk)
        router = Router(client, layout)
        await router.start(follow=False)
        assert _inconsistencies(router, chain, len(chain) + bulk) == []

        # a reader looks at the router every time the reload parses a key: the reload must not be visible
        seen: list[str] = []
        checks = 0

        def check() -> None:
            nonlocal checks
            checks += 1
            seen.extend(_inconsistencies(router, chain, len(chain) + bulk))

        router.layout = _SpyLayout(layout, check)  # type: ignore[assignment]
        await router.start(follow=False)  # loads the snapshot again
        router.layout = layout
        assert checks >= len(chain) + bulk, "the reload parsed every directory key"
        assert seen == [], f"a reader saw the reload half done ({len(seen)} times), first: {seen[0]}"
        assert _inconsistencies(router, chain, len(chain) + bulk) == []
        await router.stop()


async def test_a_member_table_a_reader_took_never_changes_under_it(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    chain = _chain(4)
    async with _etcd(etcd.url) as client, _lease(client) as lease:
        await _anchor(client, layout, lease, chain, 0)
        router = Router(client, layout)
        await router.start(follow=True)
        try:
            taken, leases = router.members, router.lease_of
            assert set(taken) == {ANCHOR} and set(leases) == {ANCHOR}
            await client.kv.put(layout.node_key("late"), _record("late").to_json(), lease=lease, timeout=5)
            assert await router.wait_until(lambda r: "late" in r.members, WAIT)
            await client.kv.put(layout.node_key(ANCHOR), _record(ANCHOR, host_used=7).to_json(), lease=lease,
                                timeout=5)
            assert await router.wait_until(lambda r: r.members[ANCHOR].host_used == 7, WAIT)

            assert set(taken) == {ANCHOR} and set(leases) == {ANCHOR}, "the reader's table changed under it"
            assert taken[ANCHOR].host_used == 0, "the reader's record changed under it"
            assert set(router.members) == {ANCHOR, "late"} and router.lease_of["late"] == lease
            with pytest.raises(TypeError):
                router.members["intruder"] = _record("intruder")  # type: ignore[index]
        finally:
            await router.stop()


# ---- stress: another thread reads while the directory churns ------------------------------------------


async def test_reads_from_another_thread_stay_consistent_while_the_directory_churns(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    chain = _chain(32)
    bulk = 6000  # a reload parses this many keys: long enough for the reader's thread to run in the middle
    rounds = 24
    async with _etcd(etcd.url) as client, _lease(client) as lease, _lease(client) as churn_lease:
        await _anchor(client, layout, lease, chain, bulk)
        router = Router(client, layout)
        await router.start(follow=True)
        stop = threading.Event()
        wrong: list[str] = []
        reads = 0

        def reader() -> None:
            nonlocal reads
            while not stop.is_set() and len(wrong) < 20:
                try:
                    wrong.extend(_inconsistencies(router, chain, len(chain) + bulk))
                    for member in router.members.values():  # iterating a table someone changes would raise
                        assert member.node_id
                except Exception as exc:  # noqa: BLE001 - reported below
                    wrong.append(f"{type(exc).__name__}: {exc}")
                reads += 1

        thread = threading.Thread(target=reader, name="router-reader", daemon=True)
        thread.start()
        try:
            for i in range(rounds):
                node_id = f"churn-{i % 3}"
                mine = chain[: 1 + i % (len(chain) - 1)]  # a prefix of the anchor's chain: shared holder sets
                extra = _chain(64)
                await client.kv.put(layout.node_key(node_id), _record(node_id, i).to_json(), lease=churn_lease,
                                    timeout=5)
                await _put_entries(client, layout, churn_lease, NS, mine + extra, node_id)
                await client.kv.put(layout.node_key(node_id), _record(node_id, i + 1).to_json(), lease=churn_lease,
                                    timeout=5)
                if i % 4 == 3:
                    await router.reload()
                await _delete_entries(client, layout, NS, mine + extra, node_id)
                await client.kv.delete(layout.node_key(node_id), timeout=5)
                await asyncio.sleep(0.01)
            settled = await router.wait_until(
                lambda r: set(r.members) == {ANCHOR} and r.entries == len(chain) + bulk, WAIT)
        finally:
            stop.set()
            thread.join(WAIT)
            await router.stop()
        assert not thread.is_alive()
        assert reads > 0
        assert wrong == [], f"{len(wrong)} inconsistent reads out of {reads}, first: {wrong[:3]}"
        assert settled, f"the router did not settle: members {sorted(router.members)}, entries {router.entries}"
        assert router.resyncs == rounds // 4
        print(f"\n{reads} consistent reads from another thread over {rounds} churn rounds "
              f"and {router.resyncs} reloads of {len(chain) + bulk} entries")
