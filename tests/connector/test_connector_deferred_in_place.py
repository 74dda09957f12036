"""``start_lookup`` handles answered in place: sent from the scheduler thread, read by whoever polls (real nodes).

Where the node's direct channel is open, ``start_lookup`` sends its leased
lookup over it on the calling thread and returns; ``is_complete()`` reads
what has arrived, never blocking, so a scheduler that polls between its
steps reads the answer itself instead of waiting for the loop thread to take
the GIL from it. These pin that nothing else changes: the same masks and
leases, loads bit-exact (on the listener path from the bytes the answer
brought), a handle nobody polls still completes and an abandoned one still
ends its lease, a hung node costs the same bounded miss and backoff, a
channel lost mid-lookup asks again on the loop, a handle that finds the
channel busy takes the loop, a shutdown settles what is pending, and
``start_lookup_in_place`` chooses it apart from ``lookup()`` (with both
off, see ``test_connector_in_place.py``, none of it happens).
"""

from __future__ import annotations

import threading
import time

import pytest

from connector import worker_side
from connector.dkv_connector import DKVConnector
from connector.scheduler_side import DKVLookup
from tests.conftest import node_stats, wait_for_stats
from tests.connector.test_connector import BOUND, answered, chain, offload_chain, wait
from tests.connector.test_connector_in_place import _in_place, _rows

pytestmark = pytest.mark.timeout(180)

PATHS = pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])


def _reader(node_factory, connectors, local: bool,  # noqa: ANN001
            **kwargs) -> tuple[object, DKVConnector, list[bytes], DKVConnector]:
    """A node holding 4 offloaded blocks, their writer, and a reader whose direct channel is open."""
    node = node_factory()
    writer = connectors(node.address)
    hashes = chain(4)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001
    reader = connectors(node.address, local=local, **kwargs)
    _in_place(reader, hashes)
    reader.lookup(chain(1))  # (ends the lease the warm-up's lookups left)
    return node, writer, hashes, reader


def _settled(handle: DKVLookup, bound: float = BOUND) -> None:
    """Until the handle's future resolves, without polling the handle (only the loop thread reads its answer)."""
    handle._future.result(bound)  # noqa: SLF001


@PATHS
async def test_a_handle_is_answered_by_its_poller_as_on_the_loop_and_its_load_is_bit_exact(
        node_factory, connectors, local: bool) -> None:
    node, writer, hashes, reader = _reader(node_factory, connectors, local)
    counted = reader.counters.lookups_in_place
    reads_before = (await node_stats(node.address))["ops"].get("read", 0)
    handle = reader.start_lookup(hashes + chain(1))
    assert handle.answered_by_polling, "the handle's lookup was not sent over the direct channel"
    assert answered(handle) == {"full": [True] * 4 + [False], "swa": [True] * 4 + [False]}
    assert reader.counters.lookups_in_place == counted + 1
    wait(reader.load_lookup(handle, {"full": [1, 2, 3, 4], "swa": [3, 4]}, {"full": hashes, "swa": hashes[2:]}))
    assert _rows(reader, "full", [1, 2, 3, 4]) == _rows(writer, "full", [1, 2, 3, 4])
    assert _rows(reader, "swa", [3, 4]) == _rows(writer, "swa", [3, 4])
    stats = await node_stats(node.address)
    assert stats["ops"].get("read", 0) == reads_before, "the load asked the node again (no one-round-trip copy)"
    assert (await wait_for_stats(node.address, lambda s: s["leases"] == 0))["leases"] == 0


@PATHS
async def test_a_handle_nobody_polls_completes_and_an_abandoned_one_ends_its_lease(
        node_factory, connectors, local: bool) -> None:
    node, _, hashes, reader = _reader(node_factory, connectors, local)
    unpolled = reader.start_lookup(hashes)
    assert unpolled.answered_by_polling
    _settled(unpolled)  # the loop thread read it
    assert unpolled.result() == {"full": [True] * 4, "swa": [True] * 4}
    reader.abandon_lookup(unpolled)
    abandoned = reader.start_lookup(hashes)
    assert abandoned.answered_by_polling
    reader.abandon_lookup(abandoned)  # at once: its answer may not even be there yet
    _settled(abandoned)
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0, "an abandoned handle's lease outlived it"
    assert not reader._worker._in_place_lookups  # noqa: SLF001 - nothing left for the loop to poll


@PATHS
async def test_a_hung_node_costs_a_polled_handle_its_timeout_then_backoff(node_factory, connectors,
                                                                          local: bool) -> None:
    node, _, hashes, reader = _reader(node_factory, connectors, local, timeout=1.0)
    failures = reader.counters.lookup_failures
    node.pause()
    try:
        started = time.monotonic()
        handle = reader.start_lookup(hashes)
        assert time.monotonic() - started < 1.0, "start_lookup waited for the node"
        assert handle.answered_by_polling
        assert answered(handle) == {"full": [False] * 4, "swa": [False] * 4}
        assert time.monotonic() - started < 10.0  # the 1 s bound, generously on a noisy machine
        assert reader.counters.lookup_failures == failures + 1
        skipped = reader.counters.lookups_skipped
        assert answered(reader.start_lookup(hashes)) == {"full": [False] * 4, "swa": [False] * 4}
        assert reader.counters.lookups_skipped == skipped + 1, "the hung node is asked again during the backoff"
    finally:
        node.resume()
    reader._unreachable.clear()  # noqa: SLF001 - end the backoff early: the node answers again
    _in_place(reader, hashes)  # a new channel opens (the timed-out one was closed)
    handle = reader.start_lookup(hashes)
    assert handle.answered_by_polling and answered(handle) == {"full": [True] * 4, "swa": [True] * 4}
    reader.abandon_lookup(handle)


@PATHS
def test_a_channel_lost_mid_lookup_asks_again_on_the_loop(node_factory, connectors, local: bool) -> None:
    node, writer, hashes, reader = _reader(node_factory, connectors, local)
    counted = reader.counters.lookups_in_place
    handle = reader.start_lookup(hashes)
    assert handle.answered_by_polling
    reader._clients[node.address]._direct.conn.abort()  # noqa: SLF001 - a blip, with the answer unread
    assert answered(handle) == {"full": [True] * 4, "swa": [True] * 4}
    assert reader.counters.lookups_in_place == counted, "the answer was read off a closed channel"
    assert reader.counters.lookup_failures == 0
    wait(reader.load_lookup(handle, {"full": [1, 2, 3, 4]}, {"full": hashes}))
    assert _rows(reader, "full", [1, 2, 3, 4]) == _rows(writer, "full", [1, 2, 3, 4])


@PATHS
def test_a_handle_that_finds_the_channel_busy_takes_the_loop(node_factory, connectors, local: bool) -> None:
    node, _, hashes, reader = _reader(node_factory, connectors, local)
    node.pause()  # the first handle's answer cannot have arrived when the second starts
    try:
        first = reader.start_lookup(hashes)
        second = reader.start_lookup(hashes[:2])  # the first holds the channel until its answer is read
    finally:
        node.resume()
    assert first.answered_by_polling and not second.answered_by_polling
    assert answered(second) == {"full": [True] * 2, "swa": [True] * 2}
    assert answered(first) == {"full": [True] * 4, "swa": [True] * 4}
    for handle in (first, second):
        reader.abandon_lookup(handle)
    third = reader.start_lookup(hashes)  # the channel is free again
    assert third.answered_by_polling and answered(third) == {"full": [True] * 4, "swa": [True] * 4}
    reader.abandon_lookup(third)


@PATHS
async def test_a_step_that_starts_two_lookups_gets_both_in_place_once_a_second_channel_opened(
        node_factory, connectors, local: bool) -> None:
    node, writer, hashes, reader = _reader(node_factory, connectors, local)
    client = reader._clients[node.address]  # noqa: SLF001
    assert client.direct_open == 1
    deadline = time.monotonic() + BOUND
    steps = 0
    while True:  # as a scheduler's steps: the first finds one channel busy and asks for another
        node.pause()  # neither answer can have arrived when the second starts
        try:
            first = reader.start_lookup(hashes)
            second = reader.start_lookup(hashes[:2])
        finally:
            node.resume()
        steps += 1
        assert answered(first) == {"full": [True] * 4, "swa": [True] * 4}
        assert answered(second) == {"full": [True] * 2, "swa": [True] * 2}
        both = first.answered_by_polling and second.answered_by_polling
        if both:
            break
        assert first.answered_by_polling, "the first of a step took the loop"
        reader.abandon_lookup(first)
        reader.abandon_lookup(second)
        assert time.monotonic() < deadline, "the second handle of a step never went in place"
        time.sleep(0.05)
    assert steps > 1 and client.direct_open == 2, "channels opened that no step asked for"
    assert reader.counters.lookups_channels_busy == steps - 1  # the second handle of each step before the last
    wait(reader.load_lookup(second, {"full": [1, 2]}, {"full": hashes[:2]}))
    assert _rows(reader, "full", [1, 2]) == _rows(writer, "full", [1, 2])
    reader.abandon_lookup(first)
    assert (await wait_for_stats(node.address, lambda s: s["leases"] == 0))["leases"] == 0


@PATHS
def test_a_lookup_call_that_finds_the_channel_held_takes_the_loop_and_asks_for_another(
        node_factory, connectors, local: bool) -> None:
    node, _, hashes, reader = _reader(node_factory, connectors, local)
    client = reader._clients[node.address]  # noqa: SLF001
    client._direct_tried_at = -1e9  # noqa: SLF001 - as if the wait between attempts had passed
    counted = reader.counters.lookups_in_place
    node.pause()
    resumer = threading.Timer(0.3, node.resume)  # the lookup() below starts while the node is paused
    try:
        held = reader.start_lookup(hashes)  # holds the one channel: its answer cannot arrive while paused
        assert held.answered_by_polling
        resumer.start()
        assert reader.lookup(hashes[:2]) == {"full": [True] * 2, "swa": [True] * 2}
    finally:
        resumer.cancel()
        resumer.join()
        node.resume()
    assert answered(held) == {"full": [True] * 4, "swa": [True] * 4}
    reader.abandon_lookup(held)
    deadline = time.monotonic() + BOUND
    while client.direct_open < 2:
        assert time.monotonic() < deadline, "no second channel was asked for"
        time.sleep(0.01)
    assert reader.counters.lookups_in_place == counted + 1  # the handle only: lookup() went through the loop
    assert reader.counters.lookups_channels_busy == 1


async def test_an_abandoned_handle_whose_answer_brought_its_blocks_frees_its_slot_without_asking(
        node_factory, connectors) -> None:
    node, _, hashes, reader = _reader(node_factory, connectors, False)
    client = reader._clients[node.address]  # noqa: SLF001
    budget = reader._sched.budget  # noqa: SLF001
    releases = (await node_stats(node.address))["ops"].get("release", 0)
    for _ in range(3):
        handle = reader.start_lookup(hashes)
        assert answered(handle) == {"full": [True] * 4, "swa": [True] * 4}
        assert handle.state().received, "the answer brought no blocks"
        assert client._received_bytes > 0  # noqa: SLF001 - kept for its load
        reader.abandon_lookup(handle)
        assert budget.held(node.address) == 0, "the slot waited for a release the node does not need"
        assert client._received_bytes == 0  # noqa: SLF001 - let go of with the handle
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0 and stats["ops"].get("release", 0) == releases, stats["ops"]


@PATHS
def test_a_shutdown_settles_a_handle_still_unanswered(node_factory, connectors, local: bool) -> None:
    node, _, hashes, reader = _reader(node_factory, connectors, local, timeout=30.0)
    node.pause()
    try:
        handle = reader.start_lookup(hashes)
        assert handle.answered_by_polling and not handle.is_complete()
        started = time.monotonic()
        reader.shutdown()
        assert time.monotonic() - started < BOUND
        assert handle.is_complete() and handle.result() == {"full": [False] * 4, "swa": [False] * 4}
    finally:
        node.resume()


def test_start_lookup_in_place_is_a_choice_of_its_own(node_factory, connectors) -> None:
    node = node_factory()
    hashes = chain(2)
    loop_handles = connectors(node.address, start_lookup_in_place=False)  # lookup() in place, handles on the loop
    offload_chain(loop_handles, loop_handles._blocks, hashes)  # noqa: SLF001
    _in_place(loop_handles, hashes)
    handle = loop_handles.start_lookup(hashes)
    assert not handle.answered_by_polling and answered(handle) == {"full": [True, True], "swa": [True, True]}
    loop_handles.abandon_lookup(handle)

    handles_only = connectors(node.address, lookup_in_place=False, start_lookup_in_place=True)
    deadline = time.monotonic() + BOUND
    while True:  # the first handles ask for the channel (opened in the background) and take the loop
        handle = handles_only.start_lookup(hashes)
        assert answered(handle) == {"full": [True, True], "swa": [True, True]}
        handles_only.abandon_lookup(handle)
        if handle.answered_by_polling:
            break
        assert time.monotonic() < deadline, "no handle was answered in place: the direct channel never opened"
        time.sleep(0.01)
    counted = handles_only.counters.lookups_in_place
    assert handles_only.lookup(hashes) == {"full": [True, True], "swa": [True, True]}
    assert handles_only.counters.lookups_in_place == counted, "lookup() ran in place with lookup_in_place off"


@PATHS
def test_an_answer_that_arrived_unpolled_is_read_by_the_next_lookup_which_then_runs_in_place(
        node_factory, connectors, monkeypatch, local: bool) -> None:
    monkeypatch.setattr(worker_side, "IN_PLACE_WATCH_PERIOD", 30.0)  # the loop thread does not read it meanwhile
    _, _, hashes, reader = _reader(node_factory, connectors, local)
    first = reader.start_lookup(hashes)
    assert first.answered_by_polling
    time.sleep(0.3)  # its answer arrives; its owner does not poll
    assert not first._future.done()  # noqa: SLF001 - nobody read it yet
    second = reader.start_lookup(hashes[:2])
    assert second.answered_by_polling, "the channel stayed held by an answer that had arrived"
    assert first._future.done()  # noqa: SLF001 - read on the way, for its owner
    assert answered(first) == {"full": [True] * 4, "swa": [True] * 4}
    assert answered(second) == {"full": [True] * 2, "swa": [True] * 2}
    counted = reader.counters.lookups_in_place
    third = reader.start_lookup(hashes)
    time.sleep(0.3)
    assert reader.lookup(hashes[:1]) == {"full": [True], "swa": [True]}  # lookup() reads it too, then runs in place
    assert reader.counters.lookups_in_place == counted + 2 and third._future.done()  # noqa: SLF001
    for handle in (first, second, third):
        reader.abandon_lookup(handle)
