"""The router against a real etcd and real ``dkv serve`` nodes: longest prefix, ties, failures, stale hints.

Each node joins the test's etcd prefix (``etcd.node_args``, lease TTL 2 s) and
is written to through a :class:`NodeClient`, so the directory entries the router
reads are the ones a node's publisher wrote after its store committed them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest

from cluster.process import NodeStartError
from tests.conftest import failure_of
from dkv.etcd import Layout, MemberRecord, make_client
from dkv.hints import STALE_EPOCH, UNKNOWN_PEER, UnusableHint, parse_hint, resolve_hint
from dkv.keys import BlockKey
from dkv.publisher import DirectoryPublisher
from dkv.router import DELETE, MEMBER_GRACE, PUT, ClusterEvent, Router
from dkv.store import StoreKey

NS = "test/ns0"  # the clients fixture's namespace
WAIT = 20.0  # generous bound for anything that goes through etcd
BLOCK = b"k" * 4096


@asynccontextmanager
async def _router(url: str, prefix: str, events: list[ClusterEvent] | None = None) -> AsyncIterator[Router]:
    client = make_client(url)
    await client.connect()
    router = Router(client, Layout(prefix=prefix), on_event=events.append if events is not None else None)
    try:
        await router.start(follow=True)
        yield router
    finally:
        await router.stop()
        await client.close()


def _chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


async def _write(client, hashes: Sequence[bytes], block: bytes = BLOCK) -> None:
    result = await client.write([BlockKey("L", 0, h) for h in hashes], [block] * len(hashes))
    assert result.statuses == ["write"] * len(hashes), result.statuses


def _peer(route) -> str | None:
    return route.peer.node_id if route.peer is not None else None


async def _until(router: Router, predicate, what: str, timeout: float = WAIT) -> None:
    if not await router.wait_until(predicate, timeout):
        raise AssertionError(f"not within {timeout}s: {what} (members {sorted(router.members)}, "
                             f"entries {router.entries})")


# ---- longest prefix, fail-over ------------------------------------------------------------------


async def test_route_picks_the_longest_prefix_and_fails_over_when_that_peer_leaves(etcd, node_factory, clients) -> None:
    hashes = _chain(6)
    events: list[ClusterEvent] = []
    async with _router(etcd.url, etcd.prefix, events) as router:
        nodes = {name: node_factory(*etcd.node_args(name)) for name in ("node-a", "node-b", "node-c")}
        await _until(router, lambda r: set(r.members) == set(nodes), "three members")
        held = {"node-a": hashes[:2], "node-b": hashes[:5], "node-c": hashes[:3]}
        writers = {name: clients(nodes[name].address) for name in nodes}
        for name, prefix in held.items():
            await _write(writers[name], prefix)
        await _until(router, lambda r: r.entries == 2 + 5 + 3, "all ten entries")

        assert router.holders(NS, hashes[0]) == {"node-a", "node-b", "node-c"}
        assert router.holders(NS, hashes[2]) == {"node-b", "node-c"}
        assert router.holders(NS, hashes[4]) == {"node-b"}
        assert router.holders(NS, hashes[5]) == set()
        assert router.holders("other/ns", hashes[0]) == set()

        route = router.route(NS, hashes)
        assert (_peer(route), route.depth) == ("node-b", 5)
        assert [router.depth_of(n, NS, hashes) for n in ("node-a", "node-b", "node-c")] == [2, 5, 3]
        assert router.depth_of("nobody", NS, hashes) == 0
        assert route.peer.address == nodes["node-b"].address
        assert route.peer.epoch == nodes["node-b"].ready["epoch"]
        assert (_peer(r := router.route(NS, hashes[:3])), r.depth) in {("node-b", 3), ("node-c", 3)}
        excluded = router.route(NS, hashes, exclude=["node-b"])
        assert (_peer(excluded), excluded.depth) == ("node-c", 3)
        nobody = router.route(NS, _chain(4))
        assert (nobody.peer, nobody.depth, nobody.hint) == (None, 0, None)
        # with the asking engine's own node named, only a peer holding more than that node is named
        for requester, expected in (("node-a", ("node-b", 5)), ("node-c", ("node-b", 5)),
                                    ("nobody", ("node-b", 5)), ("node-b", (None, 0))):
            asked = router.route(NS, hashes, requester=requester)
            assert (_peer(asked), asked.depth) == expected, requester
        assert router.route(NS, hashes, requester="node-b").hint is None
        # node-b holds as much of the first three as node-c does: for node-c, nobody is deeper
        assert router.route(NS, hashes[:3], requester="node-c").peer is None
        assert (_peer(r := router.route(NS, hashes, requester="node-a", exclude=["node-b"])), r.depth) == ("node-c", 3)
        assert router.route("other/ns", hashes).peer is None
        assert router.route(NS, []).peer is None

        # the route's hint parses back and resolves to the same live peer for this request
        hint = parse_hint(route.hint)
        assert (hint.peer_id, hint.epoch, hint.namespace, hint.depth, hint.deepest_hash) == (
            "node-b", nodes["node-b"].ready["epoch"], NS, 5, hashes[4])
        assert hint.endpoint == f"ucx://{nodes['node-b'].address}"
        assert resolve_hint(route.hint, NS, hashes, router.members) is router.members["node-b"]

        # node-b leaves gracefully: its member key and its entries go at once, and C is next best
        await writers["node-b"].close()
        assert nodes["node-b"].stop() == 0
        await _until(router, lambda r: "node-b" not in r.members and r.entries == 2 + 3, "node-b gone")
        failover = router.route(NS, hashes)
        assert (_peer(failover), failover.depth) == ("node-c", 3)
        assert router.depth_of("node-b", NS, hashes) == 0
        assert router.holders(NS, hashes[0]) == {"node-a", "node-c"}
        assert router.holders(NS, hashes[3]) == set()
        with pytest.raises(UnusableHint) as info:
            resolve_hint(route.hint, NS, hashes, router.members)
        assert info.value.reason == UNKNOWN_PEER

    kinds = {(e.kind, e.node_id) for e in events}
    assert {("join", n) for n in nodes} <= kinds
    assert ("leave", "node-b") in kinds
    published = {(e.node_id, e.block_hash) for e in events if e.kind == "publish"}
    assert published == {(name, h) for name, prefix in held.items() for h in prefix}
    unpublished = {(e.node_id, e.block_hash) for e in events if e.kind == "unpublish"}
    assert unpublished == {("node-b", h) for h in held["node-b"]}


async def test_ties_go_to_the_least_used_peer_then_the_smallest_id(etcd, node_factory, clients) -> None:
    hashes = _chain(3)
    async with _router(etcd.url, etcd.prefix) as router:
        # started in reverse order, so neither start order nor insertion order decides
        nodes = {name: node_factory(*etcd.node_args(name)) for name in ("tie-b", "tie-a")}
        writers = {name: clients(node.address) for name, node in nodes.items()}
        for writer in writers.values():
            await _write(writer, hashes)

        def same_use(r: Router) -> bool:
            m = r.members
            return (set(m) == set(nodes) and r.entries == 6
                    and m["tie-a"].host_used == m["tie-b"].host_used > 0)

        await _until(router, same_use, "both members report the same host use")
        route = router.route(NS, hashes)
        assert (_peer(route), route.depth) == ("tie-a", 3), "equal use: the smallest node id"

        # tie-a now holds 4 MiB more (unrelated blocks): the tie goes to tie-b
        await _write(writers["tie-a"], _chain(1), b"\x01" * (4 * 2**20))

        def a_busier(r: Router) -> bool:
            return r.members["tie-a"].host_used > r.members["tie-b"].host_used

        await _until(router, a_busier, "tie-a reports more host use")
        route = router.route(NS, hashes)
        assert (_peer(route), route.depth) == ("tie-b", 3), "the least used peer wins a tie"


async def test_a_deeper_peer_wins_over_a_less_used_one(etcd, node_factory, clients) -> None:
    hashes = _chain(4)
    async with _router(etcd.url, etcd.prefix) as router:
        busy = node_factory(*etcd.node_args("busy"))
        idle = node_factory(*etcd.node_args("idle"))
        busy_writer, idle_writer = clients(busy.address), clients(idle.address)
        await _write(busy_writer, _chain(1), b"\x02" * (4 * 2**20))
        await _write(busy_writer, hashes)
        await _write(idle_writer, hashes[:3])
        await _until(router, lambda r: r.entries == 1 + 4 + 3 and set(r.members) == {"busy", "idle"}
                     and r.members["busy"].host_used > r.members["idle"].host_used, "entries and use")
        route = router.route(NS, hashes)
        assert (_peer(route), route.depth) == ("busy", 4)
        route = router.route(NS, hashes[:3])
        assert (_peer(route), route.depth) == ("idle", 3)


async def test_a_requesters_own_chain_with_a_hole_does_not_hide_a_deeper_peer(etcd, node_factory, clients) -> None:
    # an engine's node holds the blocks its engine computed, not those it loaded from a peer: here
    # blocks 2 and 3 of its chain were loaded, so its node can serve 2 blocks although it announced block 6
    hashes = _chain(6)
    async with _router(etcd.url, etcd.prefix) as router:
        own = node_factory(*etcd.node_args("own"))
        peer = node_factory(*etcd.node_args("peer"))
        await _write(clients(own.address), hashes[:2] + hashes[4:])
        await _write(clients(peer.address), hashes[:4])
        await _until(router, lambda r: r.entries == 4 + 4 and set(r.members) == {"own", "peer"}, "eight entries")
        assert router.depth_of("own", NS, hashes) == 6
        assert router.held_prefix("own", NS, hashes) == 2
        assert router.held_prefix("peer", NS, hashes) == 4
        assert router.held_prefix("nobody", NS, hashes) == 0
        route = router.route(NS, hashes, requester="own")
        assert (_peer(route), route.depth) == ("peer", 4)
        assert parse_hint(route.hint).deepest_hash == hashes[3]
        # asked for the peer's engine, own's deepest announced block (6) is no prefix beyond the peer's 4
        assert router.route(NS, hashes, requester="peer").peer is None
        assert (_peer(r := router.route(NS, hashes)), r.depth) == ("own", 6)  # without a requester: the deepest hash


# ---- failures -----------------------------------------------------------------------------------


async def test_a_killed_node_leaves_members_and_holders_within_its_ttl(etcd, node_factory, clients) -> None:
    hashes = _chain(4)
    async with _router(etcd.url, etcd.prefix) as router:
        doomed = node_factory(*etcd.node_args("doomed", ttl=2))
        steady = node_factory(*etcd.node_args("steady", ttl=2))
        doomed_writer = clients(doomed.address)
        await _write(doomed_writer, hashes)
        await _write(clients(steady.address), hashes[:2])
        await _until(router, lambda r: r.entries == 6 and set(r.members) == {"doomed", "steady"}, "six entries")
        route = router.route(NS, hashes)
        assert (_peer(route), route.depth) == ("doomed", 4)

        await doomed_writer.close()
        killed_at = time.monotonic()
        doomed.kill()  # SIGKILL: no lease revoke, etcd must expire it
        assert not doomed.alive()
        await _until(router, lambda r: "doomed" not in r.members, "the killed node leaves members")
        await _until(router, lambda r: r.entries == 2, "the killed node's entries leave the index")
        gone_after = time.monotonic() - killed_at
        print(f"\n[router] SIGKILLed node (lease TTL 2 s) gone from members and index after {gone_after:.2f} s")
        for h in hashes:
            assert "doomed" not in router.holders(NS, h)
        assert router.holders(NS, hashes[0]) == {"steady"}
        route = router.route(NS, hashes)
        assert (_peer(route), route.depth) == ("steady", 2)
        assert "steady" in router.members, "the surviving node keeps its lease"


async def test_a_hint_from_before_a_restart_is_stale(etcd, node_factory, clients) -> None:
    hashes = _chain(3)
    async with _router(etcd.url, etcd.prefix) as router:
        first = node_factory(*etcd.node_args("phoenix"))
        writer = clients(first.address)
        await _write(writer, hashes)
        await _until(router, lambda r: r.entries == 3, "three entries")
        old = router.route(NS, hashes)
        assert _peer(old) == "phoenix"
        old_epoch = old.peer.epoch
        assert resolve_hint(old.hint, NS, hashes, router.members) is router.members["phoenix"]

        await writer.close()
        assert first.stop() == 0
        await _until(router, lambda r: "phoenix" not in r.members and r.entries == 0, "phoenix gone")
        second = node_factory(*etcd.node_args("phoenix"))
        assert second.ready["epoch"] != old_epoch
        await _until(router, lambda r: "phoenix" in r.members, "phoenix back")
        assert router.members["phoenix"].epoch == second.ready["epoch"]
        with pytest.raises(UnusableHint) as info:
            resolve_hint(old.hint, NS, hashes, router.members)
        assert info.value.reason == STALE_EPOCH

        # the restarted node is empty; once it holds the blocks again, a fresh hint resolves
        assert router.route(NS, hashes).peer is None
        await _write(clients(second.address), hashes)
        await _until(router, lambda r: r.entries == 3, "three entries again")
        fresh = router.route(NS, hashes)
        assert (_peer(fresh), fresh.depth) == ("phoenix", 3)
        assert resolve_hint(fresh.hint, NS, hashes, router.members) is router.members["phoenix"]


async def test_a_node_id_the_directory_cannot_parse_is_refused_not_silently_invisible(etcd, node_factory) -> None:
    # member keys are <prefix>/<cluster>/nodes/<id> and entries end in /<id>: an id with '/' cannot be read back
    try:
        node = node_factory(*etcd.node_args("rack1/n1"))
    except NodeStartError as exc:
        assert "rack1/n1" in str(exc), "the refusal names the id"
        return
    async with _router(etcd.url, etcd.prefix) as router:
        seen = await router.wait_until(lambda r: "rack1/n1" in r.members, WAIT)
        assert seen, (f"node 'rack1/n1' started and registered (pid {node.pid}) but no router can see it: "
                      f"members {sorted(router.members)}")


# ---- sparse nodes, long requests ----------------------------------------------------------------


async def test_a_sparse_node_is_routed_the_whole_chain_from_few_entries(etcd, node_factory, clients) -> None:
    chain = _chain(1000)
    async with _router(etcd.url, etcd.prefix) as router:
        node = node_factory(*etcd.node_args("sparse", "--publish-every", "8"))
        writer = clients(node.address)
        for start in range(0, len(chain), 16):  # runs of 16, as an engine offloads
            await _write(writer, chain[start:start + 16])
        announced = {start + i for start in range(0, 1000, 16) for i in range(min(16, 1000 - start))
                     if (i + 1) % 8 == 0 or i == min(16, 1000 - start) - 1}
        await _until(router, lambda r: r.entries == len(announced), f"{len(announced)} entries")
        assert router.members["sparse"].publish_every == 8
        assert {chain[i] for i in announced} == {h for h in chain if router.holders(NS, h)}
        route = router.route(NS, chain)
        assert (_peer(route), route.depth) == ("sparse", 1000)
        prefix = router.route(NS, chain[:500])
        assert (_peer(prefix), prefix.depth) == ("sparse", max(i for i in announced if i < 500) + 1)
        stats = await writer.stats()
        cluster = stats["cluster"]
        assert cluster["puts"] == len(announced) and cluster["announced"] == len(announced)
        print(f"\n[sparse node, publish_every=8] 1000 blocks in runs of 16: {cluster['puts']} entries, "
              f"{cluster['txns']} etcd txns")


async def test_route_of_8192_hashes_latency(etcd, node_factory, clients) -> None:
    chain = _chain(8192)
    async with _router(etcd.url, etcd.prefix) as router:
        node = node_factory(*etcd.node_args("long"), pool="128MiB")
        writer = clients(node.address)
        for start in range(0, len(chain), 2048):
            await _write(writer, chain[start:start + 2048], b"x" * 64)
        await _until(router, lambda r: r.entries == 8192, "8192 entries")

        foreign = _chain(8192)
        cases = {
            "full hit": (chain, 8192),
            "partial hit (6000)": (chain[:6000] + foreign[6000:], 6000),
            "miss": (foreign, 0),
        }
        timings = {}
        for name, (request, depth) in cases.items():
            route = router.route(NS, request)
            assert route.depth == depth, name
            assert _peer(route) == ("long" if depth else None), name
            samples = []
            for _ in range(200):
                t0 = time.perf_counter()
                router.route(NS, request)
                samples.append(time.perf_counter() - t0)
            samples.sort()
            timings[name] = (statistics.median(samples), samples[int(0.99 * (len(samples) - 1))])
            await asyncio.sleep(0)  # let the watch breathe between batches
        for name, (p50, p99) in timings.items():
            print(f"\n[router] route of 8192 hashes, {name}: p50 {p50 * 1e6:.1f} us, p99 {p99 * 1e6:.1f} us",
                  end="")
        print()
        # the hint of a long route is still small and parses back
        route = router.route(NS, chain)
        assert len(route.hint) < 2048
        assert parse_hint(route.hint).deepest_hash == chain[-1]


async def test_a_router_starts_when_the_directory_outgrows_one_grpc_message(etcd) -> None:
    # 48 000 entries, about 7 MB as one range response: one full node (64 GiB of 2 MiB blocks) announces
    # 32 768, so a router (and every `dkv peers/where/route`) must load a snapshot this big
    layout = Layout(prefix=etcd.prefix)
    chain = _chain(48_000)
    client = make_client(etcd.url)
    await client.connect()
    try:
        lease = (await client.lease.grant(120, timeout=5)).ID
        try:
            member = MemberRecord(node_id="full", address="127.0.0.1:7999", epoch="e1", protocol_version=1,
                                  started_at=0.0, host_id="h")
            await client.kv.put(layout.node_key("full"), member.to_json(), lease=lease, timeout=5)
            pub = DirectoryPublisher(client, layout, "full", epoch="e1")
            pub.set_lease(lease)
            pub.on_commit([StoreKey(NS, "L", 0, h) for h in chain])
            await pub.flush()
            await pub.flush()
            assert pub.counters.puts == len(chain)
            router = Router(client, layout)
            try:
                failure = await failure_of(router.start(follow=False))
                assert failure is None, f"the router cannot load a {len(chain)}-entry directory: {failure}"
                assert router.entries == len(chain)
                route = router.route(NS, chain)
                assert (_peer(route), route.depth) == ("full", len(chain))
            finally:
                await router.stop()
        finally:
            await client.lease.revoke(lease, timeout=5)
    finally:
        await client.close()


def test_a_member_that_left_or_registered_again_stays_recently_live_for_a_bounded_while() -> None:
    layout = Layout(prefix="/unit")
    router = Router(None, layout)  # type: ignore[arg-type] - fed by hand, no etcd
    now = [1000.0]
    router.clock = lambda: now[0]
    first = MemberRecord("b", "127.0.0.1:7420", "100-aaaa", 1, 0.0, "h")
    key = layout.node_key("b")
    router._apply(PUT, key, first.to_json().encode(), 7)  # noqa: SLF001 - a watch event, by hand
    assert router.recently_live("b", first.epoch) is None, "a live member is in members, not among the departed"

    again = dataclasses.replace(first, epoch="200-bbbb")
    router._apply(PUT, key, again.to_json().encode(), 8)  # noqa: SLF001 - registered again (new lease, new epoch)
    assert router.members["b"].epoch == again.epoch
    assert router.recently_live("b", first.epoch) == first
    assert router.recently_live("b", again.epoch) is None

    now[0] += MEMBER_GRACE / 2
    router._apply(DELETE, key, b"", 0)  # noqa: SLF001 - its lease ends too
    assert "b" not in router.members
    assert router.recently_live("b", again.epoch) == again
    assert router.recently_live("b") == again, "a hint without an epoch (MAX's form) takes the latest"
    assert router.recently_live("b", first.epoch) is None, "one record per node: the latest departure"
    now[0] += MEMBER_GRACE
    assert router.recently_live("b", again.epoch) is None, "past the grace nothing is vouched for"


def test_serving_prefixes_stop_at_the_first_gap_of_publish_every_unannounced_hashes() -> None:
    import random

    from dkv.router import _held_prefixes

    def walk(by_hash, hashes, every):  # the definition, hash by hash
        out = {}
        for node, k in every.items():
            depth = gap = 0
            for i, h in enumerate(hashes):
                if node in by_hash.get(h, frozenset()):
                    depth, gap = i + 1, 0
                else:
                    gap += 1
                    if gap >= k:
                        break
            out[node] = depth
        return out

    hashes = [bytes([i]) for i in range(6)]
    by_hash = {h: frozenset({"a"}) for h in hashes[:2] + hashes[3:]}  # a misses block 2
    assert _held_prefixes(by_hash, hashes, {"a": 1}) == {"a": 2}
    assert _held_prefixes(by_hash, hashes, {"a": 2}) == {"a": 6}  # a gap shorter than its publish_every
    rng = random.Random(7)
    for _ in range(2000):
        hashes = [bytes([i]) for i in range(rng.randrange(20))]
        by_hash = {h: frozenset(n for n in "abc" if rng.random() < 0.7) for h in hashes if rng.random() < 0.9}
        every = {n: rng.randrange(1, 4) for n in "abc" if rng.random() < 0.8}
        assert _held_prefixes(by_hash, hashes, every) == walk(by_hash, hashes, every), (by_hash, hashes, every)
