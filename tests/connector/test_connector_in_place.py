"""Lookups and small loads in place: work on the calling thread (real node processes).

The connector's ``lookup()`` sends its leased lookup over a control
connection of its own, driven from the scheduler thread, with no hop to the
loop thread: the node's same-host control socket, or its TCP one on the
listener path (where the lookup brings its blocks' bytes). A small load into
CPU rows is copied out of the lease's slots (or those bytes) right there (a larger one on the copy threads, posted straight
from the calling thread). These pin that nothing else changes: the same
masks and leases, loads bit-exact, a lookup never overtakes a load still
waiting on the loop thread, a copy that cannot be proven falls back to the
two-step read (and fails rather than deliver other bytes), a loaded lease
ends without another request, a dead or hung node costs the same bounded
miss (and backoff) as on the loop, and with the option off none of it happens.
"""

from __future__ import annotations

import threading
import time

import pytest

import dkv.lease_slots as lease_slots
from connector.copy_engine import CopyEngine
from connector.dkv_connector import DKVConnector
from connector.transfer_plan import TransferPlan
from connector.types import CompletedTransfer, KVLoadFailed
from connector.worker_side import InPlace, WorkerSide
from dkv.keys import BlockKey
from tests.conftest import node_stats, wait_for_stats
from tests.copy_hooks import watch_copies, watcher_held_off
from tests.connector.conftest import PAGE_BYTES, device_blocks, two_leaves
from tests.connector.test_connector import BOUND, answered, chain, fill, offload_chain, wait

pytestmark = pytest.mark.timeout(180)


def _in_place(conn: DKVConnector, hashes: list[bytes]) -> None:
    """Look up until a lookup ran in place (the first ones ask for the channel, opened in the background)."""
    deadline = time.monotonic() + BOUND
    before = conn.counters.lookups_in_place
    while conn.counters.lookups_in_place == before:
        assert time.monotonic() < deadline, "no lookup ran in place: the direct channel never opened"
        conn.lookup(hashes)
        time.sleep(0.01)


def _rows(conn: DKVConnector, leaf: str, ids: list[int]) -> list[bytes]:
    return [bytes(t[i].numpy()) for t in conn._blocks[0][leaf] for i in ids]  # noqa: SLF001


def _offloaded_then_overwritten(conn: DKVConnector, n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    """``n`` blocks offloaded from rows 1..n, which are then overwritten: their hashes, and the "full" rows' bytes
    a load of them must bring back."""
    hashes = chain(n)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    ids = list(range(1, n + 1))
    expected = _rows(conn, "full", ids)
    for leaf in conn._blocks[0]:  # noqa: SLF001
        fill(conn._blocks, leaf, ids, seed=seed)  # noqa: SLF001
    return hashes, expected


@pytest.mark.parametrize("tp", [1, 2])
def test_a_lookup_in_place_answers_as_on_the_loop_and_its_load_is_bit_exact(node_factory, connectors, tp: int) -> None:
    node = node_factory()
    leaves = two_leaves(tp)
    writer = connectors(node.address, leaves=leaves, blocks=device_blocks(leaves))
    reader = connectors(node.address, leaves=leaves, blocks=device_blocks(leaves))
    hashes = chain(4)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001
    _in_place(reader, hashes)
    counted = reader.counters.lookups_in_place
    masks = reader.lookup(hashes + chain(1))
    assert reader.counters.lookups_in_place == counted + 1
    assert masks == {"full": [True] * 4 + [False], "swa": [True] * 4 + [False]}
    wait(reader.load({"full": [1, 2, 3, 4], "swa": [3, 4]}, {"full": hashes, "swa": hashes[2:]}))
    assert _rows(reader, "full", [1, 2, 3, 4]) == _rows(writer, "full", [1, 2, 3, 4])
    assert _rows(reader, "swa", [3, 4]) == _rows(writer, "swa", [3, 4])
    assert reader.lookup(hashes[:1]) == {"full": [True], "swa": [True]}  # after a load: the other group
    assert reader.counters.lookups_in_place == counted + 2  # the load had begun (it landed): nothing to overtake


@pytest.mark.parametrize("tp", [1, 2])
async def test_a_listener_lookup_runs_in_place_over_the_tcp_control_port_and_brings_its_blocks(
        node_factory, connectors, tp: int) -> None:
    node = node_factory()
    leaves = two_leaves(tp)
    writer = connectors(node.address, leaves=leaves, blocks=device_blocks(leaves))
    reader = connectors(node.address, leaves=leaves, blocks=device_blocks(leaves), local=False)
    hashes = chain(4)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001
    _in_place(reader, hashes)
    channel = reader._clients[node.address]._direct.conn  # noqa: SLF001
    assert channel.peer.startswith("tcp:")  # the node's TCP control socket, not the same-host one
    counted, loaded = reader.counters.lookups_in_place, reader.counters.loads_in_place
    masks = reader.lookup(hashes + chain(1))
    assert reader.counters.lookups_in_place == counted + 1
    assert masks == {"full": [True] * 4 + [False], "swa": [True] * 4 + [False]}
    wait(reader.load({"full": [1, 2, 3, 4], "swa": [3, 4]}, {"full": hashes, "swa": hashes[2:]}))
    assert reader.counters.loads_in_place == loaded + 1  # from the bytes the lookup brought
    assert _rows(reader, "full", [1, 2, 3, 4]) == _rows(writer, "full", [1, 2, 3, 4])
    assert _rows(reader, "swa", [3, 4]) == _rows(writer, "swa", [3, 4])
    stats = await node_stats(node.address)
    assert stats["ops"].get("read", 0) == 0, "a load of bytes a lookup brought asked the node again"


@pytest.mark.parametrize("reply_spin", [0.0, 0.002], ids=["reply-waited-for", "reply-polled-first"])
def test_the_connector_s_reply_spin_is_how_long_its_direct_channel_polls_for_each_reply(node_factory, connectors,
                                                                                      reply_spin: float) -> None:
    node = node_factory()
    conn = connectors(node.address, reply_spin=reply_spin)
    hashes = chain(2)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    _in_place(conn, hashes)
    channel = conn._clients[node.address]._direct.conn  # noqa: SLF001
    assert channel._spin_ns == int(reply_spin * 1e9)  # noqa: SLF001 (the native poll is built: test_polling)
    counted = conn.counters.lookups_in_place
    for _ in range(5):
        assert conn.lookup(hashes) == {"full": [True, True], "swa": [True, True]}
    assert conn.counters.lookups_in_place == counted + 5
    wait(conn.load({"full": [1, 2]}, {"full": hashes}))


def test_a_lookup_through_the_loop_thread_polls_for_its_answer_as_long_as_reply_spin_says(
        node_factory, connectors, monkeypatch) -> None:
    node = node_factory()
    conn = connectors(node.address, local=False, reply_spin=0.002, lookup_in_place=False)  # every lookup hops
    hashes = chain(2)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    worker = conn._worker  # noqa: SLF001
    spins: list[object] = []
    run = worker.loop.run

    def recorded(coro: object, timeout: float, **kwargs: object) -> object:
        spins.append(kwargs.get("spin"))
        return run(coro, timeout, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(worker.loop, "run", recorded)
    for _ in range(5):
        assert conn.lookup(hashes) == {"full": [True, True], "swa": [True, True]}
    assert spins == [0.002] * 5
    wait(conn.load({"full": [1, 2]}, {"full": hashes}))


@pytest.mark.parametrize("reply_spin", [-1e-6, 0.0101])
def test_a_reply_spin_out_of_its_bounds_is_refused_before_anything_starts(reply_spin: float) -> None:
    with pytest.raises(ValueError, match="reply_spin"):
        DKVConnector(two_leaves(1), device_blocks(two_leaves(1)), namespace="ns", node="127.0.0.1:1",
                     reply_spin=reply_spin)


@pytest.mark.parametrize("direct_channels", [0, -1, 1.5, True])
def test_a_direct_channel_count_below_one_or_not_an_int_is_refused_before_anything_starts(direct_channels) -> None:
    with pytest.raises(ValueError, match="direct_channels"):
        DKVConnector(two_leaves(1), device_blocks(two_leaves(1)), namespace="ns", node="127.0.0.1:1",
                     direct_channels=direct_channels)


def test_with_lookup_in_place_off_every_lookup_and_load_takes_the_loop(node_factory, connectors) -> None:
    node = node_factory()
    conn = connectors(node.address, lookup_in_place=False)
    hashes = chain(2)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    for _ in range(20):
        handle = conn.start_lookup(hashes)  # (start_lookup_in_place follows lookup_in_place)
        assert not handle.answered_by_polling
        assert answered(handle) == {"full": [True, True], "swa": [True, True]}
        conn.abandon_lookup(handle)
        assert conn.lookup(hashes) == {"full": [True, True], "swa": [True, True]}
        time.sleep(0.01)
    wait(conn.load({"full": [1, 2]}, {"full": hashes}))
    assert conn.counters.lookups_in_place == 0 and conn.counters.loads_in_place == 0
    assert not conn._clients[node.address].direct_ready  # noqa: SLF001 - none was even opened


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
async def test_a_lookup_never_overtakes_a_load_still_waiting_on_the_loop(node_factory, connectors,
                                                                         monkeypatch, local: bool) -> None:
    monkeypatch.setattr(WorkerSide, "load_in_place", lambda *_: None)  # every load is posted to the loop
    node = node_factory()
    conn = connectors(node.address, timeout=10.0, local=local)
    blocks = conn._blocks  # noqa: SLF001
    hashes = chain(3)
    offload_chain(conn, blocks, hashes)
    expected = _rows(conn, "full", [1, 2, 3])
    _in_place(conn, hashes)
    conn.lookup(hashes)
    for leaf in blocks[0]:
        fill(blocks, leaf, [1, 2, 3], seed=99)  # rows the load must overwrite
    held, release = threading.Event(), threading.Event()

    async def hold_the_loop() -> None:
        held.set()
        release.wait(BOUND)  # blocks the loop thread itself: nothing queued behind it runs

    holding = conn._loop.submit(hold_the_loop())  # noqa: SLF001
    assert held.wait(BOUND)
    transfer = conn.load({"full": [1, 2, 3]}, {"full": hashes})  # posted; cannot begin while the loop is held
    before = conn.counters.lookups_in_place
    threading.Timer(0.3, release.set).start()
    assert conn.lookup(hashes) == {"full": [True] * 3, "swa": [True] * 3}  # on the loop, after the load began
    assert conn.counters.lookups_in_place == before, "the lookup overtook a load that had not begun"
    holding.result(BOUND)
    wait(transfer)
    assert _rows(conn, "full", [1, 2, 3]) == expected
    _in_place(conn, hashes)  # once the load began, lookups run in place again
    stats = await node_stats(node.address)
    assert stats["ops"].get("read", 0) == 0, "the load was refused its one-round-trip copy"


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
def test_a_killed_node_costs_an_in_place_lookup_one_miss_then_backoff(node_factory, connectors, local: bool) -> None:
    node = node_factory()
    conn = connectors(node.address, timeout=2.0, local=local)
    hashes = chain(2)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    _in_place(conn, hashes)
    failures, skipped = conn.counters.lookup_failures, conn.counters.lookups_skipped
    node.kill()
    started = time.monotonic()
    assert conn.lookup(hashes) == {"full": [False, False], "swa": [False, False]}
    assert time.monotonic() - started < BOUND
    assert conn.counters.lookup_failures == failures + 1
    assert conn.lookup(hashes) == {"full": [False, False], "swa": [False, False]}
    assert conn.counters.lookups_skipped == skipped + 1, "the dead node is not asked again during the backoff"


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
async def test_a_hung_node_costs_an_in_place_lookup_its_timeout_then_backoff(node_factory, connectors,
                                                                             local: bool) -> None:
    node = node_factory()
    conn = connectors(node.address, timeout=1.0, local=local)
    hashes = chain(2)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    _in_place(conn, hashes)
    failures = conn.counters.lookup_failures
    node.pause()
    try:
        started = time.monotonic()
        assert conn.lookup(hashes) == {"full": [False, False], "swa": [False, False]}
        assert time.monotonic() - started < 10.0  # the 1 s bound, generously on a noisy machine
        assert conn.counters.lookup_failures == failures + 1
        started = time.monotonic()
        assert conn.lookup(hashes) == {"full": [False, False], "swa": [False, False]}
        assert conn.counters.lookups_skipped >= 1 and time.monotonic() - started < 1.0
    finally:
        node.resume()
    conn._unreachable.clear()  # noqa: SLF001 - end the backoff early: the node answers again
    _in_place(conn, hashes)  # a new channel opens (the timed-out one was closed)
    assert conn.lookup(hashes) == {"full": [True, True], "swa": [True, True]}
    stats = await wait_for_stats(node.address, lambda s: s["leases"] <= 1)
    assert stats["leases"] <= 1, stats  # the replica's one lease: the timed-out lookup's ended with its connection


async def test_a_small_same_host_load_is_copied_in_place_and_its_lease_ends_without_another_request(
        node_factory, connectors, monkeypatch) -> None:
    monkeypatch.setattr("connector.worker_side.STATS_INTERVAL", 600.0)  # no stats request carries the end
    node = node_factory("--lease-ttl", "60")  # only the client's end can end the lease within the test's bound
    writer = connectors(node.address)
    reader = connectors(node.address)
    hashes = chain(4)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001
    assert reader.lookup(hashes) == {"full": [True] * 4, "swa": [True] * 4}
    transfer = reader.load({"full": [1, 2, 3, 4], "swa": [4]}, {"full": hashes, "swa": hashes[3:]})
    assert isinstance(transfer, CompletedTransfer)  # the bytes are in the rows already
    assert reader.counters.loads_in_place == 1 and reader.counters.loads == 1
    assert reader.counters.blocks_loaded == 5 and reader.counters.bytes_loaded == 5 * PAGE_BYTES
    assert _rows(reader, "full", [1, 2, 3, 4]) == _rows(writer, "full", [1, 2, 3, 4])
    assert _rows(reader, "swa", [4]) == _rows(writer, "swa", [4])
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)  # ended by a flush: no request follows
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0, stats
    assert "read" not in stats["ops"], stats["ops"]
    # the lease ended as used: the node counts its blocks (4 hashes x 2 leaves) as moved out locally
    assert stats["bytes"]["out"]["local"] == 8 * PAGE_BYTES, stats["bytes"]


async def test_a_load_over_the_in_place_bound_is_copied_on_the_copy_threads_and_its_lease_ends_without_a_request(
        node_factory, connectors, monkeypatch) -> None:
    monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 3 * PAGE_BYTES)
    monkeypatch.setattr("connector.worker_side.STATS_INTERVAL", 600.0)  # no stats request carries the end
    node = node_factory("--lease-ttl", "60")  # only the client's end can end the lease within the test's bound
    conn = connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 4, seed=5)
    conn.lookup(hashes)
    posted_to_loop = []
    monkeypatch.setattr(WorkerSide, "post_load", lambda *a: posted_to_loop.append(a))
    transfer = conn.load({"full": [1, 2, 3, 4]}, {"full": hashes})  # 4 pages: over the bound
    assert not isinstance(transfer, CompletedTransfer) and not posted_to_loop
    wait(transfer)
    assert conn.counters.loads_in_place == 1 and conn.counters.loads == 1
    assert conn.counters.blocks_loaded == 4 and conn.counters.bytes_loaded == 4 * PAGE_BYTES
    assert _rows(conn, "full", [1, 2, 3, 4]) == expected
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)  # ended by a flush: no request follows
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0, stats
    assert "read" not in stats["ops"], stats["ops"]
    conn.lookup(hashes[:3])
    assert isinstance(conn.load({"full": [1, 2, 3]}, {"full": hashes[:3]}), CompletedTransfer)  # at the bound


@pytest.mark.parametrize("where", ["in place", "copy threads"])
def test_a_one_leaf_load_into_contiguous_rows_is_copied_with_no_key_or_view_made(
        node_factory, connectors, monkeypatch, where: str) -> None:
    """The usual load (one leaf, one shard, CPU rows back to back) is copied from the slot map alone.

    :class:`dkv.lease_slots.RowRun`: no per-block key, view, prefix or plan
    in Python, on the calling thread or on the copy threads.
    """
    if lease_slots._native_rows_copy is None:
        pytest.skip("the native checked copy is not built (tests/dkv/test_checked_copy.py fails for that)")
    if where == "copy threads":
        monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)
    node = node_factory()
    conn = connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 5, seed=13)

    def no_keys(*_: object) -> None:
        raise AssertionError("the load's keys were made")

    targets = CopyEngine.load_targets

    def no_views(engine: CopyEngine, groups: list) -> object:
        if groups:
            raise AssertionError("the load's row views were made")
        return targets(engine, groups)  # the finisher of rows filled in place: no view

    monkeypatch.setattr(TransferPlan, "keys", no_keys)
    monkeypatch.setattr(CopyEngine, "load_targets", no_views)
    conn.lookup(hashes)
    wait(conn.load({"full": [5, 4, 3, 2, 1]}, {"full": hashes}))  # each block into another row than it came from
    assert _rows(conn, "full", [5, 4, 3, 2, 1]) == expected
    assert conn.counters.loads_in_place == 1 and conn.counters.blocks_loaded == 5


def test_a_load_on_the_native_copy_threads_completes_for_a_caller_that_only_polls(
        node_factory, connectors, monkeypatch) -> None:
    """No thread but the polling one needs the GIL to complete it: the watcher is kept out here, and it completes."""
    if lease_slots._native_rows_copy is None:
        pytest.skip("the native checked copy is not built (tests/dkv/test_checked_copy.py fails for that)")
    monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)  # every load goes to the copy threads
    node = node_factory()
    conn = connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 4, seed=17)
    conn.lookup(hashes)
    with watcher_held_off(monkeypatch, BOUND):  # the process's watcher cannot settle the copy
        transfer = conn.load({"full": [1, 2, 3, 4]}, {"full": hashes})
        assert not isinstance(transfer, CompletedTransfer)
        deadline = time.monotonic() + BOUND
        while not transfer.is_complete():
            assert time.monotonic() < deadline, "the load never completed for a caller that only polls"
            time.sleep(0.0005)
    assert _rows(conn, "full", [1, 2, 3, 4]) == expected
    assert conn.counters.loads_in_place == 1 and conn.counters.blocks_loaded == 4


@pytest.mark.parametrize("where", ["in place", "copy threads"])
def test_a_completed_load_holds_no_buffer_of_the_nodes_segment(node_factory, connectors, monkeypatch,
                                                                where: str) -> None:
    """The engine's books keep completed transfers; those must not keep the segment's buffers exported.

    A segment with a buffer exported cannot be unmapped: when its node
    restarts, the client could not take the new one, and every offload
    failed (seen in scripts/soak.py with the copies' native objects kept by
    the books and by the watcher's last loop variable).
    """
    if where == "copy threads":
        monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)
    node = node_factory()
    conn = connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 4, seed=19)
    transfers = []
    for _ in range(3):
        conn.lookup(hashes)
        transfers.append(conn.load({"full": [1, 2, 3, 4]}, {"full": hashes}))  # kept, as on the books
        wait(transfers[-1])
    assert _rows(conn, "full", [1, 2, 3, 4]) == expected and conn.counters.loads_in_place == 3
    mapping = conn._clients[node.address]._mapping  # noqa: SLF001
    deadline = time.monotonic() + BOUND  # the watcher lets go of its last copy once it has settled it
    while True:
        try:
            mapping.view.release()  # BufferError while any buffer of the segment is exported
            break
        except BufferError:
            assert time.monotonic() < deadline, "a completed load still holds a buffer of the segment"
            time.sleep(0.05)


def test_a_copy_thread_load_lets_go_of_its_plan_and_lease_as_it_lands(node_factory, connectors, monkeypatch) -> None:
    """A completed transfer the engine (and the books) still hold keeps neither its plan nor its lookup's lease.

    Each holds every block's hash and id; freed where the load lands (a copy
    thread, the watcher), not when the scheduler thread's next ``load()``
    drops the transfer from the books, which cost that call several µs.
    """
    import gc

    from connector.scheduler_side import LeaseState

    monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)
    node = node_factory()
    conn = connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 4, seed=29)

    def ours() -> list[object]:
        return [o for o in gc.get_objects() if (type(o) is TransferPlan and o.runs and o.runs[0].hashes == hashes)
                or (type(o) is LeaseState and o.hashes == hashes)]

    conn.lookup(hashes)
    transfer = conn.load({"full": [1, 2, 3, 4]}, {"full": hashes})
    wait(transfer)
    assert _rows(conn, "full", [1, 2, 3, 4]) == expected and conn.counters.loads_in_place == 1
    assert transfer in conn._worker.transfers  # noqa: SLF001 - still booked, and held here as an engine holds it
    deadline = time.monotonic() + BOUND  # (the thread that landed it lets go right after it resolved the transfer)
    while ours():
        assert time.monotonic() < deadline, f"a landed load still holds {sorted({type(o).__name__ for o in ours()})}"
        time.sleep(0.02)


@pytest.mark.parametrize("where", ["in place", "copy threads", "listener, sent with the answer", "listener, read"])
def test_handles_loaded_leave_none_of_their_hashes_behind(node_factory, connectors, monkeypatch, where: str) -> None:
    """Each ``start_lookup`` handle's lease has a group of its own, which no later lookup ends: what the client
    kept for its read must go when its load is copied from the slot map instead (it was kept until the bound,
    4 096 leases later: lists of hashes for the collector to walk on the scheduler thread), or once it is read."""
    if where == "copy threads":
        monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)
    node = node_factory()
    if where.startswith("listener"):
        conn = connectors(node.address, local=False, **({"lookup_payload_bytes": 0} if where.endswith("read") else {}))
    else:
        conn = connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 4, seed=31)
    client = conn._clients[node.address]  # noqa: SLF001
    for _ in range(12):
        handle = conn.start_lookup(hashes)
        assert all(answered(handle)["full"])
        wait(conn.load_lookup(handle, {"full": [1, 2, 3, 4]}, {"full": hashes}))
    assert _rows(conn, "full", [1, 2, 3, 4]) == expected and conn.counters.blocks_loaded == 12 * 4
    if where.startswith("listener"):  # the path it names was the one taken
        assert (client.lookups_with_payload > 0) == where.endswith("answer")
    assert len(client._lease_hashes) == 0, f"{len(client._lease_hashes)} loaded leases' hashes kept"  # noqa: SLF001
    assert len(client._lease_slots) == 0  # noqa: SLF001


@pytest.mark.parametrize("where", ["in place", "copy threads", "listener"])
def test_settled_loads_leave_the_books_and_no_garbage_for_the_collector(node_factory, connectors, monkeypatch,
                                                                       where: str) -> None:
    """Settled transfers are dropped from the books as new ones come, and a load makes no reference cycle.

    Either would leave each load's plan (every block's hash and id), futures
    and closures for the garbage collector, which walks them in the young
    collections that run on whichever thread allocates, the scheduler's
    too: measured, a 1.4 ms collection inside a 64-block ``load()``.
    """
    import gc

    if where == "copy threads":
        monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)
    node = node_factory()
    conn = connectors(node.address, local=False) if where == "listener" else connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 4, seed=23)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable is kept in gc.garbage, for this test
    try:
        for _ in range(40):  # never polled by the engine: only the books drop them
            conn.lookup(hashes)
            wait(conn.load({"full": [1, 2, 3, 4]}, {"full": hashes}))
        booked = len(conn._worker.transfers)  # noqa: SLF001
        gc.collect()
        garbage = sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert _rows(conn, "full", [1, 2, 3, 4]) == expected
    assert booked <= 2, f"{booked} settled loads kept on the books"
    assert not garbage, f"loads left cycles for the collector: {garbage}"


async def test_a_copy_thread_load_that_does_not_verify_is_read_the_two_step_way(
        node_factory, connectors, monkeypatch) -> None:
    monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)  # every load goes to the copy threads
    watch_copies(monkeypatch).fail = True  # as if a slot had been reused
    node = node_factory()
    conn = connectors(node.address)
    hashes, expected = _offloaded_then_overwritten(conn, 3, seed=7)
    conn.lookup(hashes)
    wait(conn.load({"full": [1, 2, 3]}, {"full": hashes}))  # the lease still holds: the node's read delivers
    assert _rows(conn, "full", [1, 2, 3]) == expected
    assert conn.counters.loads_in_place == 0 and conn.counters.loads == 1 and conn.counters.loads_failed == 0
    stats = await node_stats(node.address)
    assert stats["ops"].get("read", 0) >= 1, "the load was not read the two-step way"


def test_a_shutdown_waits_for_a_copy_thread_load_past_its_drain_and_nothing_lands_in_the_rows_after_it(
        node_factory, connectors, monkeypatch) -> None:
    monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)
    node = node_factory()
    conn = connectors(node.address, timeout=1.0)  # shutdown drains transfers for 2 s, then closes
    hashes, _ = _offloaded_then_overwritten(conn, 3, seed=11)
    copying = threading.Event()

    def slow_copy(_blocks: int) -> None:
        copying.set()
        time.sleep(3.0)  # still copying when the shutdown's drain gives up

    watch_copies(monkeypatch).before.append(slow_copy)
    conn.lookup(hashes)
    transfer = conn.load({"full": [1, 2, 3]}, {"full": hashes})
    assert copying.wait(BOUND)
    conn.shutdown()
    after = _rows(conn, "full", [1, 2, 3])
    time.sleep(0.8)
    assert _rows(conn, "full", [1, 2, 3]) == after, "bytes landed in the rows after shutdown returned"
    with pytest.raises(KVLoadFailed):  # shut down before it was reported: the engine must not use the rows
        transfer.is_complete()
    assert not conn._worker._copies  # noqa: SLF001 - the copy was waited for, not left behind


@pytest.mark.parametrize("where", ["in place", "copy threads"])
async def test_an_in_place_copy_of_reused_slots_fails_the_load_never_delivering_other_bytes(
        node_factory, connectors, clients, monkeypatch, where: str) -> None:
    if where == "copy threads":
        monkeypatch.setattr("connector.worker_side.IN_PLACE_LOAD_BYTES", 0)
    node = node_factory("--pool", "1MiB")
    conn = connectors(node.address)
    hashes = chain(2)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    assert conn.lookup(hashes) == {"full": [True, True], "swa": [True, True]}
    state = conn._sched.last_lookup[0]  # noqa: SLF001
    client = conn._clients[node.address]  # noqa: SLF001
    # the node ends the lease behind the connector's back (its slot map stays with the client), then every
    # slot is reused by other blocks
    conn._loop.run(client._request({"op": "release", "lease": state.lease_id}, idempotent=True), 10)  # noqa: SLF001
    filler = clients(node.address, namespace=conn.namespace, local=False)
    await filler.clear()
    keys = [BlockKey("full", 0, h) for h in chain(256)]
    assert (await filler.write(keys, [b"\xee" * PAGE_BYTES] * len(keys))).stored == len(keys)  # the whole pool
    transfer = conn.load({"full": [1, 2]}, {"full": hashes})
    with pytest.raises(KVLoadFailed):  # the copy failed its checksums; the two-step read found no lease
        wait(transfer)
    assert conn.counters.loads_in_place == 0


def test_a_lookup_that_falls_back_to_the_loop_late_gets_only_what_is_left_of_its_bound(
        node_factory, connectors, monkeypatch) -> None:
    node = node_factory()
    conn = connectors(node.address, timeout=2.0)  # lookup() is bounded by timeout + 1 = 3 s, however it goes
    hashes = chain(2)
    offload_chain(conn, conn._blocks, hashes)  # noqa: SLF001
    worker = conn._worker  # noqa: SLF001
    spent = [1.5]

    def failed_late(*_: object) -> object:
        time.sleep(spent[0])  # a direct channel that failed after this long (a late reset, say)
        return InPlace.NOT_TAKEN

    bounds: list[float] = []
    run = worker.loop.run

    def recorded(coro: object, timeout: float, **kwargs: object) -> object:
        bounds.append(timeout)
        return run(coro, timeout, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(worker, "lookup_in_place", failed_late)
    monkeypatch.setattr(worker.loop, "run", recorded)
    assert conn.lookup(hashes) == {"full": [True, True], "swa": [True, True]}  # the loop answers in what is left
    assert len(bounds) == 1 and 0 < bounds[0] <= 3.0 - 1.5
    spent[0] = 3.1  # past the whole bound: a miss, without asking again on the loop
    failures = conn.counters.lookup_failures
    assert conn.lookup(hashes) == {"full": [False, False], "swa": [False, False]}
    assert len(bounds) == 1 and conn.counters.lookup_failures == failures + 1
