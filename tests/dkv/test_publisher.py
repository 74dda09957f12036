"""The directory publisher against a real etcd: what it announces, how many writes it costs, how it recovers.

Most tests drive a :class:`DirectoryPublisher` directly with :class:`StoreKey`
lists, the way a node's store calls it, on a lease the test grants, and call
``flush()`` themselves, so the number of etcd transactions is deterministic.
One test drives a real node to check that a reservation is never announced.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.conftest import failure_of
from tests.conftest import etcd_client as _etcd_client, etcd_lease as _lease
from dkv.etcd import MAX_TXN_OPS, Layout, MemberRecord, prefix_end
from dkv.keys import BlockKey
from dkv.publisher import DirectoryPublisher
from dkv.router import Router
from dkv.store import StoreKey

NS = "test/ns0"
NODE = "pub-node"
EPOCH = "1000-abcd"
RUN = 16  # blocks per offloaded run, as an engine saves a request's pages
BLOCKS = 1000
WAIT = 20.0
HALF_WRITER = Path(__file__).with_name("half_writer.py")


# ---- helpers ------------------------------------------------------------------------------------




def _chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _keys(hashes: Sequence[bytes], leaves: Sequence[str] = ("L",), shards: int = 1, ns: str = NS) -> list[StoreKey]:
    """The store keys one commit of ``hashes`` holds: every leaf × shard of every hash."""
    return [StoreKey(ns, leaf, shard, h) for h in hashes for leaf in leaves for shard in range(shards)]


def _runs(hashes: Sequence[bytes], size: int = RUN) -> list[list[bytes]]:
    return [list(hashes[i:i + size]) for i in range(0, len(hashes), size)]


async def _entries(client, layout: Layout, node_id: str | None = NODE) -> dict[tuple[str, bytes], tuple[bytes, int]]:
    """``(namespace, hash) -> (value, lease)`` of the directory entries of ``node_id`` (all nodes for None)."""
    response = await client.kv.get(layout.blocks, range_end=prefix_end(layout.blocks), timeout=5)
    found = {}
    for item in response.kvs:
        parsed = layout.parse_block_key(item.key.decode())
        assert parsed is not None, f"malformed directory key {item.key!r}"
        namespace, block_hash, holder = parsed
        if node_id is None or holder == node_id:
            found[(namespace, block_hash)] = (item.value, item.lease)
    return found


async def _revision(client) -> int:
    return (await client.kv.get("/", timeout=5)).header.revision


def _publisher(client, layout: Layout, lease: int, **kwargs) -> DirectoryPublisher:
    pub = DirectoryPublisher(client, layout, NODE, epoch=EPOCH, **kwargs)
    pub.set_lease(lease)
    # set_lease asks for a resync (a new lease republishes everything); with nothing announced yet it is
    # one read and no write. Tests that count writes settle it first with _settle().
    return pub


async def _settle(pub: DirectoryPublisher) -> None:
    await pub.flush()
    assert pub.pending == 0


async def _offload(pub: DirectoryPublisher, chain: Sequence[bytes], *, flush_every_runs: int = 0,
                   leaves: Sequence[str] = ("L",), shards: int = 1) -> list[int]:
    """Commit ``chain`` in runs of RUN, flushing every ``flush_every_runs`` runs (0: once at the end).

    Returns the pending count seen at each flush.
    """
    seen = []
    runs = _runs(chain)
    for i, run in enumerate(runs, 1):
        pub.on_commit(_keys(run, leaves, shards))
        if (flush_every_runs and i % flush_every_runs == 0) or i == len(runs):
            seen.append(pub.pending)
            await pub.flush()
    assert pub.pending == 0
    return seen


def _sparse_positions(n: int, every: int, run: int = RUN) -> set[int]:
    """Chain positions a sparse publisher announces: every k-th of each run, plus each run's last."""
    positions = set()
    for start in range(0, n, run):
        length = min(run, n - start)
        positions |= {start + i for i in range(length) if (i + 1) % every == 0 or i == length - 1}
    return positions


# ---- only committed blocks are announced --------------------------------------------------------


async def test_nothing_is_announced_before_commit(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as lease:
        pub = _publisher(client, layout, lease)
        await _settle(pub)
        assert await _entries(client, layout) == {}
        txns_before = pub.counters.txns
        await pub.flush()
        assert pub.counters.txns == txns_before, "an idle flush must not write"

        hashes = _chain(5)
        pub.on_commit(_keys(hashes, leaves=("L", "M"), shards=2))
        assert pub.pending == 5, "one entry per hash, however many (leaf, shard) blocks hold it"
        assert await _entries(client, layout) == {}, "the callback does no I/O"
        await pub.flush()
        assert await _entries(client, layout) == {(NS, h): (EPOCH.encode(), lease) for h in hashes}
        assert pub.announced == 5 and pub.counters.puts == 5


async def test_a_node_announces_committed_blocks_never_reserved_ones(etcd, node_factory, clients) -> None:
    node = node_factory(*etcd.node_args("n-commit"))
    layout = Layout(prefix=etcd.prefix)
    reserved = _chain(2)
    committed = _chain(3)
    writer = subprocess.Popen([sys.executable, str(HALF_WRITER), node.address, "1", *(h.hex() for h in reserved)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    async with _etcd_client(etcd.url) as client:
        try:
            line = await asyncio.wait_for(asyncio.to_thread(writer.stdout.readline), 30)
            assert line.strip() == b"reserved", line
            client_ = clients(node.address)
            result = await client_.write([BlockKey("L", 0, h) for h in committed], [b"c" * 4096] * 3)
            assert result.stored == 3
            # the committed blocks show up: once they do, the node has flushed after the reservation was made
            deadline = asyncio.get_running_loop().time() + WAIT
            while True:
                entries = await _entries(client, layout, "n-commit")
                if {(NS, h) for h in committed} <= set(entries) or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert set(entries) == {(NS, h) for h in committed}, "a reservation must never be announced"
        finally:
            writer.kill()
            writer.wait(10)
        # the aborted reservation leaves nothing behind in the directory either
        stats = await client_.stats()
        assert stats["cluster"]["announced"] == 3
        assert set(await _entries(client, layout, "n-commit")) == {(NS, h) for h in committed}


async def test_a_node_unpublishes_what_it_evicts_and_what_it_clears(etcd, node_factory, clients) -> None:
    node = node_factory(*etcd.node_args("n-evict"), pool="1MiB")
    layout = Layout(prefix=etcd.prefix)
    writer = clients(node.address)
    first, second = _chain(160), _chain(160)
    page = b"e" * 4096
    for chain in (first, second):  # 320 pages into a 256-page pool: the older chain is evicted, deepest first
        for run in _runs(chain):
            result = await writer.write([BlockKey("L", 0, h) for h in run], [page] * len(run))
            assert set(result.statuses) == {"write"}, result.statuses
    stats = await writer.stats()
    assert stats["counters"]["evictions"] > 0
    held = [h for h, present in zip(first + second, (await writer.probe(first + second, ["L"]))["L"]) if present]
    assert len(held) == stats["blocks"] < 320
    async with _etcd_client(etcd.url) as client:
        deadline = asyncio.get_running_loop().time() + WAIT
        while True:
            entries = set(await _entries(client, layout, "n-evict"))
            if entries == {(NS, h) for h in held} or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert entries == {(NS, h) for h in held}, "the directory lists exactly the blocks the node still holds"

        assert await writer.clear() == len(held)
        deadline = asyncio.get_running_loop().time() + WAIT
        while (entries := await _entries(client, layout, "n-evict")) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert entries == {}, "a cleared namespace leaves no entry behind"


# ---- how many writes a 1000-block offload costs -------------------------------------------------


async def test_dense_publication_costs_one_put_per_block_in_128_op_txns(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as lease:
        # one flush after the whole offload: the fewest txns possible
        pub = _publisher(client, layout, lease)
        await _settle(pub)
        chain = _chain(BLOCKS)
        txns0, rev0 = pub.counters.txns, await _revision(client)
        await _offload(pub, chain, shards=2)
        one_flush_txns = pub.counters.txns - txns0
        assert pub.counters.puts == BLOCKS
        assert one_flush_txns == math.ceil(BLOCKS / MAX_TXN_OPS)
        assert await _revision(client) - rev0 == one_flush_txns, "each txn is one etcd revision, nothing else"
        entries = await _entries(client, layout)
        assert set(entries) == {(NS, h) for h in chain}

        # flushing every 4 runs (64 blocks), as the background task would between offloads
        pub2 = DirectoryPublisher(client, layout, "pub-node-2", epoch=EPOCH)
        pub2.set_lease(lease)
        await _settle(pub2)
        chain2 = _chain(BLOCKS)
        txns0, rev0 = pub2.counters.txns, await _revision(client)
        seen = await _offload(pub2, chain2, flush_every_runs=4, shards=2)
        paced_txns = pub2.counters.txns - txns0
        assert pub2.counters.puts == BLOCKS
        assert paced_txns <= sum(math.ceil(p / MAX_TXN_OPS) for p in seen)
        assert paced_txns <= math.ceil(BLOCKS / MAX_TXN_OPS) + len(seen)
        assert await _revision(client) - rev0 == paced_txns
        assert set(await _entries(client, layout, "pub-node-2")) == {(NS, h) for h in chain2}
        print(f"\n[dense, publish_every=1] per {BLOCKS} blocks (runs of {RUN}, tp=2): "
              f"{pub.counters.puts} entries written in {one_flush_txns} txns (one flush); "
              f"{pub2.counters.puts} entries in {paced_txns} txns ({len(seen)} flushes of <=64)")


async def test_sparse_publication_writes_few_entries_and_still_routes_the_whole_chain(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    every = 8
    async with _etcd_client(etcd.url) as client, _lease(client) as lease:
        pub = _publisher(client, layout, lease, publish_every=every)
        await _settle(pub)
        chain = _chain(BLOCKS)
        txns0, rev0 = pub.counters.txns, await _revision(client)
        await _offload(pub, chain, shards=2)
        txns = pub.counters.txns - txns0
        wanted = _sparse_positions(BLOCKS, every)
        assert BLOCKS - 1 in wanted
        assert pub.counters.puts == len(wanted) == pub.announced
        assert pub.counters.puts <= BLOCKS // every + math.ceil(BLOCKS / RUN)
        assert txns == math.ceil(len(wanted) / MAX_TXN_OPS)
        assert await _revision(client) - rev0 == txns
        assert set(await _entries(client, layout)) == {(NS, chain[i]) for i in wanted}
        print(f"\n[sparse, publish_every={every}] per {BLOCKS} blocks (runs of {RUN}, tp=2): "
              f"{pub.counters.puts} entries written in {txns} txns (dense: {BLOCKS} entries)")

        # a router sees this node (its member record on the same lease, saying it publishes sparsely,
        # as a real node's does) cover the whole chain
        member = MemberRecord(node_id=NODE, address="127.0.0.1:7999", epoch=EPOCH, protocol_version=1,
                              started_at=0.0, host_id="h", publish_every=every)
        await client.kv.put(layout.node_key(NODE), member.to_json(), lease=lease, timeout=5)
        router = Router(client, layout)
        await router.start()
        try:
            assert await router.wait_until(lambda r: NODE in r.members and r.entries == len(wanted), WAIT)
            route = router.route(NS, chain)
            assert route.peer is not None and route.peer.node_id == NODE
            assert route.depth == len(chain)
            # a prefix of the chain routes as deep as the deepest announced block inside it
            prefix = chain[:500]
            deepest = max(i for i in wanted if i < 500)
            assert router.route(NS, prefix).depth == deepest + 1
            # a longer request (blocks this node never had) still routes to it for the chain
            longer = router.route(NS, chain + _chain(3))
            assert longer.peer is not None and longer.peer.node_id == NODE and longer.depth == len(chain)
        finally:
            await router.stop()


# ---- unpublish on eviction ----------------------------------------------------------------------


async def test_eviction_deletes_an_entry_only_when_the_hash_last_block_goes(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as lease:
        pub = _publisher(client, layout, lease)
        await _settle(pub)
        shared, alone, other = _chain(3)
        # `shared` is held by three (leaf, shard) blocks: two TP shards of L, one of M
        pub.on_commit([StoreKey(NS, "L", 0, shared), StoreKey(NS, "L", 1, shared), StoreKey(NS, "L", 0, alone),
                       StoreKey(NS, "L", 0, other)])
        pub.on_commit([StoreKey(NS, "M", 0, shared)])
        await pub.flush()
        assert set(await _entries(client, layout)) == {(NS, shared), (NS, alone), (NS, other)}

        pub.on_evict([StoreKey(NS, "L", 0, shared), StoreKey(NS, "L", 1, shared)])
        assert pub.pending == 0, "blocks of the hash are still held: nothing to unpublish"
        pub.on_evict([StoreKey(NS, "L", 0, alone)])
        await pub.flush()
        assert set(await _entries(client, layout)) == {(NS, shared), (NS, other)}
        assert pub.counters.deletes == 1

        pub.on_evict([StoreKey(NS, "M", 0, shared)])
        await pub.flush()
        assert set(await _entries(client, layout)) == {(NS, other)}
        assert pub.counters.deletes == 2 and pub.announced == 1

        # evicting something never committed (or already gone) changes nothing
        pub.on_evict([StoreKey(NS, "L", 0, os.urandom(32)), StoreKey(NS, "M", 0, shared)])
        assert pub.pending == 0

        # committed and evicted between two flushes: it must not linger in etcd
        brief = os.urandom(32)
        pub.on_commit([StoreKey(NS, "L", 0, brief)])
        pub.on_evict([StoreKey(NS, "L", 0, brief)])
        await pub.flush()
        assert set(await _entries(client, layout)) == {(NS, other)}

        # committed again after eviction: announced again
        pub.on_commit([StoreKey(NS, "L", 0, alone)])
        await pub.flush()
        assert set(await _entries(client, layout)) == {(NS, other), (NS, alone)}


async def test_sparse_eviction_of_an_unannounced_block_writes_nothing(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as lease:
        pub = _publisher(client, layout, lease, publish_every=4)
        await _settle(pub)
        run = _chain(8)
        pub.on_commit(_keys(run))
        await pub.flush()
        assert set(await _entries(client, layout)) == {(NS, run[3]), (NS, run[7])}
        pub.on_evict(_keys(run[4:7]))
        assert pub.pending == 0
        pub.on_evict(_keys(run[7:]))
        await pub.flush()
        assert set(await _entries(client, layout)) == {(NS, run[3])}


# ---- bounded queue, resync, new lease -----------------------------------------------------------


async def test_overflowing_the_pending_queue_counts_drops_and_the_next_flush_resyncs(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as lease:
        pub = _publisher(client, layout, lease, max_pending=10)
        await _settle(pub)
        resyncs0 = pub.counters.resyncs
        # an entry of this node that it no longer wants, and another node's entry, both already in etcd
        stale, foreign = os.urandom(32), os.urandom(32)
        await client.kv.put(layout.block_key(NS, stale, NODE), "old-epoch", lease=lease, timeout=5)
        await client.kv.put(layout.block_key(NS, foreign, "someone-else"), "x", lease=lease, timeout=5)

        hashes = _chain(50)
        pub.on_commit(_keys(hashes))
        assert pub.pending == 10
        assert pub.counters.dropped == 40
        await pub.flush()
        assert pub.counters.resyncs == resyncs0 + 1
        assert pub.pending == 0
        entries = await _entries(client, layout)
        assert set(entries) == {(NS, h) for h in hashes}, "etcd must hold exactly the desired state"
        assert all(v == (EPOCH.encode(), lease) for v in entries.values())
        assert set(await _entries(client, layout, "someone-else")) == {(NS, foreign)}, "another node's entry stays"

        # deletes overflow too: evict 30 (10 fit), the resync deletes the rest
        pub.on_evict(_keys(hashes[:30]))
        assert pub.counters.dropped == 60
        await pub.flush()
        assert pub.counters.resyncs == resyncs0 + 2
        assert set(await _entries(client, layout)) == {(NS, h) for h in hashes[30:]}

        # back to normal: no resync while the queue has room
        more = _chain(5)
        pub.on_commit(_keys(more))
        await pub.flush()
        assert pub.counters.resyncs == resyncs0 + 2
        assert set(await _entries(client, layout)) == {(NS, h) for h in hashes[30:] + more}


async def test_a_new_lease_republishes_every_entry(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as second:
        first = (await client.lease.grant(60, timeout=5)).ID
        try:
            pub = _publisher(client, layout, first, publish_every=1)
            await _settle(pub)
            hashes = _chain(300)
            await _offload(pub, hashes)
            assert {lease for _, lease in (await _entries(client, layout)).values()} == {first}

            # a lease lost: changes keep coming while there is none; nothing is written
            pub.set_lease(None)
            pub.on_evict(_keys(hashes[:10]))
            late = _chain(4)
            pub.on_commit(_keys(late))
            txns = pub.counters.txns
            await pub.flush()
            assert pub.counters.txns == txns

            resyncs = pub.counters.resyncs
            pub.set_lease(second, "2000-beef")
            await pub.flush()
            assert pub.counters.resyncs == resyncs + 1
            wanted = {(NS, h) for h in hashes[10:] + late}
            entries = await _entries(client, layout)
            assert set(entries) == wanted
            assert all(v == (b"2000-beef", second) for v in entries.values()), "every entry on the new lease"
            assert pub.counters.txns - txns <= math.ceil((len(wanted) + 10) / MAX_TXN_OPS)
        finally:
            await client.lease.revoke(first, timeout=5)
        # the old lease's end takes nothing with it
        assert set(await _entries(client, layout)) == wanted


async def test_the_background_task_flushes_on_its_own(etcd) -> None:
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client) as lease:
        pub = _publisher(client, layout, lease, flush_interval=0.05)
        await pub.start()
        try:
            hashes = _chain(300)
            for run in _runs(hashes):
                pub.on_commit(_keys(run))
                await asyncio.sleep(0)
            deadline = asyncio.get_running_loop().time() + WAIT
            while len(await _entries(client, layout)) < 300 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert set(await _entries(client, layout)) == {(NS, h) for h in hashes}
            assert pub.counters.puts == 300 and pub.counters.flush_failures == 0
        finally:
            await pub.stop()
        assert pub.pending == 0


async def test_a_resync_succeeds_when_the_directory_outgrows_one_grpc_message(etcd) -> None:
    # 48 000 entries (about 7 MB as one range response): a node whose 64 GiB pool holds 2 MiB blocks
    # announces 32 768; the resync after a lease loss must still repair the directory
    layout = Layout(prefix=etcd.prefix)
    async with _etcd_client(etcd.url) as client, _lease(client, ttl=120) as second:
        first = (await client.lease.grant(120, timeout=5)).ID
        try:
            pub = _publisher(client, layout, first)
            await _settle(pub)
            hashes = _chain(48_000)
            pub.on_commit(_keys(hashes))
            await pub.flush()
            assert pub.counters.puts == 48_000 and pub.pending == 0
            pub.set_lease(second)
            failure = await failure_of(pub.flush())
            assert failure is None, f"the resync cannot read a {len(hashes)}-entry directory: {failure}"
            assert pub.counters.puts == 96_000, "every entry written again on the new lease"
        finally:
            await client.lease.revoke(first, timeout=5)
        count = await client.kv.get(layout.blocks, range_end=prefix_end(layout.blocks), count_only=True, timeout=5)
        assert count.count == 48_000, "the entries live on the new lease"
