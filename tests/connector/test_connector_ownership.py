"""What the connector owns: its node clients and its background work.

Clients are made, used and closed on the loop thread, idle peers' closed;
background work is bounded, and nothing that must not be lost is.

Against real node processes: a peer's client that nobody uses is closed, but
not while a lease taken through it can still be loaded from, and never the
co-located node's; a storm of touches from the scheduler thread is bounded and
counted while the node hangs, and the lease releases queued meanwhile all
reach the node once it answers again.
"""

from __future__ import annotations

import threading
import time

from connector.dkv_connector import MAX_BACKGROUND
from tests.conftest import node_stats, wait_for_stats
from tests.connector.conftest import routed_hint
from tests.connector.test_connector import answered, chain, offload_chain, wait

BOUND = 20.0


def _cluster(etcd) -> dict:
    return {"etcd": etcd.url, "etcd_prefix": etcd.prefix}


def _until(predicate, what: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, f"not within {bound}s: {what}"
        time.sleep(0.01)


async def _loop_thread() -> threading.Thread:
    return threading.current_thread()


# ---- clients: the loop thread only ----------------------------------------------------------------


def test_clients_are_made_and_fetched_on_the_loop_thread_only(etcd, node_factory, connectors) -> None:
    a = node_factory(*etcd.node_args("a"))
    b = node_factory(*etcd.node_args("b"))
    writer = connectors(b.address, **_cluster(etcd))
    hashes = chain(3)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001 - the writer's device blocks
    conn = connectors(a.address, **_cluster(etcd))
    hint = routed_hint(conn, hashes, holder="b")

    seen: list[threading.Thread] = []
    fetch = conn._client  # noqa: SLF001 - the one place the connector makes or finds a node's client

    def recording(address: str):
        seen.append(threading.current_thread())
        return fetch(address)

    conn._client = recording  # type: ignore[method-assign]  # noqa: SLF001
    # every scheduler-thread call that reaches a node
    assert conn.lookup(hashes, hint=hint)["full"] == [True] * 3  # a lease on the peer, for replica 0
    conn.lookup(hashes)  # the co-located node now: the peer's lease is released
    handle = conn.start_lookup(hashes, hint=hint)
    answered(handle)
    conn.abandon_lookup(handle)
    handle = conn.start_lookup(hashes, hint=hint)
    answered(handle)
    wait(conn.load_lookup(handle, {"full": [7, 8, 9]}, {"full": hashes}, hint=hint))
    conn.probe(hashes, [0], hint=hint)
    conn.touch(hashes)
    conn.reset_prefix_cache()
    wait(conn.offload({"full": [1]}, {"full": chain(1)}))
    _until(lambda: conn.counters.touches == 1 and len(conn._tasks) == 0, "the touch settles")  # noqa: SLF001

    loop_thread = conn._loop.run(_loop_thread(), 10)  # noqa: SLF001
    assert seen, "the calls reached the nodes' clients"
    elsewhere = {t.name for t in seen if t is not loop_thread}
    assert not elsewhere, f"node clients made or fetched on {elsewhere}, not only on the loop thread"


# ---- idle peer clients ---------------------------------------------------------------------------


async def test_connector_closes_idle_peer_clients(etcd, node_factory, connectors) -> None:
    a = node_factory(*etcd.node_args("a"))
    b = node_factory(*etcd.node_args("b", "--lease-ttl", "5"))
    writer = connectors(b.address, **_cluster(etcd))
    hashes = chain(3)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001
    writer.shutdown()  # from here on, the only client of b is the reader's
    reader = connectors(a.address, peer_idle_timeout=0.3, **_cluster(etcd))
    hint = routed_hint(reader, hashes, holder="b")

    # a lease taken on the peer outlives the idle timeout: its client stays while the lease can be loaded from
    handle = reader.start_lookup(hashes, hint=hint)
    assert answered(handle)["full"] == [True] * 3
    time.sleep(1.0)  # past peer_idle_timeout, well within the lease's 5 s
    wait(reader.load_lookup(handle, {"full": [5, 6, 7]}, {"full": hashes}, hint=hint))
    assert reader.counters.peer_clients_closed == 0

    # unused now: closed, on the peer's side too (its only client left is the one asking for stats)
    stats = await wait_for_stats(b.address, lambda s: s["clients"] <= 1)
    assert stats["clients"] == 1, f"the idle peer client was never closed: {stats['clients']} clients on b"
    assert reader.counters.peer_clients_closed == 1
    # the co-located node's client is never closed, however long it sits idle
    assert (await node_stats(a.address))["clients"] == 2, "the co-located client must stay connected"

    # the next hint naming that peer makes a new client
    handle = reader.start_lookup(hashes, hint=hint)
    assert answered(handle)["full"] == [True] * 3
    reader.abandon_lookup(handle)
    assert (await wait_for_stats(b.address, lambda s: s["leases"] == 0))["leases"] == 0


# ---- background work: bounded, counted, releases kept ----------------------------------------------


async def test_touch_storm_is_bounded_and_lease_releases_are_not_lost(node_factory, connectors) -> None:
    node = node_factory("--lease-ttl", "60")  # only a release can end these leases within the test's bound
    conn = connectors(node.address)
    hashes = chain(4)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    handles = [conn.start_lookup(hashes) for _ in range(20)]
    for handle in handles:
        answered(handle)
    assert (await node_stats(node.address))["leases"] == 20

    storm, resets = 1000, 50
    node.pause()  # nothing the connector sends completes while the storm lasts
    try:
        for handle in handles:
            conn.abandon_lookup(handle)
        for _ in range(storm):
            conn.touch(hashes)
        for _ in range(resets):
            conn.reset_prefix_cache()
        in_flight = len(conn._tasks)  # noqa: SLF001 - the work the connector owns on the loop
        assert in_flight <= MAX_BACKGROUND, f"{in_flight} tasks owned at once after a storm of {storm} touches"
        assert conn.counters.touches == MAX_BACKGROUND
        assert conn.counters.touches_dropped == storm - MAX_BACKGROUND
        _until(lambda: conn.counters.resets_coalesced >= resets - 2, "the resets are coalesced")
    finally:
        node.resume()

    # every lease abandoned during the storm is released once the node answers (the TTL is 60 s)
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0, f"releases were lost in the storm: {stats['leases']} leases left"
    # the touches in flight settle, and a touch is accepted again
    _until(lambda: conn._background == 0, "the touches in flight settle")  # noqa: SLF001
    conn.touch(hashes)
    assert conn.counters.touches == MAX_BACKGROUND + 1
    # a reset still does its job
    conn.reset_prefix_cache()
    assert (await wait_for_stats(node.address, lambda s: s["blocks"] == 0))["blocks"] == 0
