"""The connector when its co-located node dies: offloads back off as lookups do, and resume after a restart."""

from __future__ import annotations

import time

import connector.scheduler_side as scheduler_side
from connector.types import CompletedTransfer
from tests.connector.test_connector import BOUND, answered, chain, fill, offload_chain, wait

BACKOFF = 3.0  # the unreachable-node backoff for these tests (10 s in service), so the restart is seen soon
OFFLOADS = 8  # offloads posted while the node is dead


def test_offloads_to_a_killed_colocated_node_are_dropped_at_once_and_resume_once_it_is_back(
        node_factory, connectors, monkeypatch) -> None:
    monkeypatch.setattr(scheduler_side, "UNREACHABLE_BACKOFF", BACKOFF)
    node = node_factory()  # port 0: a port picked first could be taken before the node binds it
    listen = node.address
    conn = connectors(node.address, timeout=2.0)
    blocks = conn._blocks  # noqa: SLF001 - the connector's own device rows
    leaves = list(blocks[0])
    offload_chain(conn, blocks, chain(2))
    assert conn.counters.blocks_offloaded == 2 * len(leaves)

    node.kill()
    first = conn.offload({leaf: [3] for leaf in leaves}, {leaf: chain(1) for leaf in leaves})
    wait(first)  # the one offload that finds the node dead: one bounded wait, completes quietly
    assert conn.counters.offloads_failed == 1

    dropped = [chain(1) for _ in range(OFFLOADS)]
    started = time.monotonic()
    for i, hashes in enumerate(dropped):
        ids = [4 + i]
        for leaf in leaves:
            fill(blocks, leaf, ids, seed=11)
        transfer = conn.offload({leaf: ids for leaf in leaves}, {leaf: hashes for leaf in leaves})
        assert transfer.is_complete(), "an offload to a node in backoff is answered at once, never waits"
        assert isinstance(transfer, CompletedTransfer) and not transfer.g0_blocks_per_leaf, \
            "a dropped offload pins no device block"
    took = time.monotonic() - started
    assert took < conn.timeout, f"{OFFLOADS} offloads to a dead node took {took:.1f} s: they waited on it"
    assert conn.counters.offloads_dropped == OFFLOADS
    assert conn.metrics.connector_offload_blocks_dropped == OFFLOADS * len(leaves), \
        "the protocol's metrics count every dropped block, per leaf"
    assert conn.counters.offloads_failed == 1, "dropped offloads never reached the node"
    conn.poll_transfers()
    assert not conn._worker.transfers, "nothing of a dropped offload is left on the books"  # noqa: SLF001
    print(f"\n[faults] {OFFLOADS} offloads to a SIGKILLed co-located node answered in {took * 1000:.1f} ms")

    restarted = node_factory(listen=listen)
    assert restarted.address == node.address
    deadline = time.monotonic() + BACKOFF + BOUND
    again = chain(2)
    while True:  # the backoff lets offloads through once it ends; until then they are dropped
        for leaf in leaves:
            fill(blocks, leaf, [20, 21], seed=13)
        wait(conn.offload({leaf: [20, 21] for leaf in leaves}, {leaf: again for leaf in leaves}))
        if conn.counters.blocks_offloaded > 2 * len(leaves):
            break
        assert time.monotonic() < deadline, "offloads never resumed after the node came back"
        time.sleep(0.2)
    assert conn.counters.blocks_offloaded == 4 * len(leaves)
    masks = conn.lookup([*again, *dropped[0]])
    assert all(mask == [True, True, False] for mask in masks.values()), \
        "the restarted node holds what was offloaded after it, nothing a dropped offload carried"
    conn.abandon_lookup(conn.start_lookup([]))


def test_a_start_lookup_on_a_node_that_stopped_answering_completes_within_the_timeout(node_factory,
                                                                                     connectors) -> None:
    """A lookup handle answers as ``lookup()`` does: a miss within the timeout, not after every retry of it.

    A paused node never completes a connect: the client's retries of that
    connect (three, each bounded by the timeout) must not add up on a handle.
    """
    node = node_factory()
    beside = connectors(node.address, timeout=2.0)  # same-host: its own bounded wait first, as in the soak
    conn = connectors(node.address, timeout=2.0, local=False)
    hashes = chain(2)
    node.pause()
    try:
        assert answered(beside.start_lookup(hashes)) == {"full": [False, False], "swa": [False, False]}
        started = time.monotonic()
        handle = conn.start_lookup(hashes)
        deadline = started + BOUND
        while not handle.is_complete() and time.monotonic() < deadline:
            time.sleep(0.02)
        took = time.monotonic() - started
        assert handle.is_complete(), f"the handle had not answered after {BOUND} s"
        # lookup() gives up after timeout + 1 s; the margin is for a loaded machine, far below the retries' 3 x 2 s
        assert took < conn.timeout + 2.5, f"the handle answered after {took:.1f} s, not within the {conn.timeout} s timeout"
        assert handle.result() == {"full": [False, False], "swa": [False, False]}, "a node that does not answer is a miss"
        assert conn.counters.lookup_failures == 1
        conn.abandon_lookup(handle)
    finally:
        node.resume()


def test_an_offload_whose_device_copy_fails_completes_quietly_is_counted_and_blames_no_node(
        node, connectors, monkeypatch) -> None:
    """A device-to-host copy that fails on the loop thread stores nothing, is counted, and backs no node off."""
    conn = connectors(node.address)
    blocks = conn._blocks  # noqa: SLF001 - the connector's own device rows
    leaves = list(blocks[0])
    engine = next(iter(conn._worker.copy.values()))  # noqa: SLF001 - the one device of these rows
    working = engine.offload_sources

    def failing(groups):
        def start():
            raise RuntimeError("the device copy failed")
        return start

    monkeypatch.setattr(engine, "offload_sources", failing)
    for leaf in leaves:
        fill(blocks, leaf, [3, 4], seed=5)
    lost = chain(2)
    transfer = conn.offload({leaf: [3, 4] for leaf in leaves}, {leaf: lost for leaf in leaves})
    wait(transfer)  # completes, quietly: the engine is not told an offload failed
    assert conn.counters.offloads_failed == 1 and conn.counters.blocks_offloaded == 0
    monkeypatch.setattr(engine, "offload_sources", working)
    stored = chain(2)
    wait(conn.offload({leaf: [3, 4] for leaf in leaves}, {leaf: stored for leaf in leaves}))
    assert conn.counters.offloads_dropped == 0, "a device failure is not the node's: nothing is dropped after it"
    assert conn.counters.blocks_offloaded == 2 * len(leaves)
    masks = conn.lookup([*stored, *lost])
    assert all(mask == [True, True, False, False] for mask in masks.values()), masks
    conn.abandon_lookup(conn.start_lookup([]))
