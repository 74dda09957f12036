"""Listener loads read over a direct channel (``direct_reads``): sent and received on a copy thread (real nodes).

A load that must read from its node (no slot map, no bytes brought with the
lookup) goes over a free direct channel instead of UCX where UCX has no
RDMA: a copy thread sends the read and receives its blocks straight into the
rows, each hashed as it lands. These pin that it lands bit-exact with no
read through the loop, that it is a choice (off, the loop reads), that a
load finding every channel busy is read by the loop after all, that a hung
node costs a failed load within its bound (counted, and backed off), and
that a shutdown during such a read returns within its bound with the rows
written no more.
"""

from __future__ import annotations

import threading
import time

import pytest

from connector.dkv_connector import DKVConnector
from connector.types import KVLoadFailed, full_attention
from dkv.client import NodeClient
from tests.conftest import node_stats, wait_for_stats
from tests.connector.conftest import device_blocks, two_leaves
from tests.connector.test_connector import BOUND, answered, chain, offload_chain, wait
from tests.connector.test_connector_in_place import _rows

pytestmark = pytest.mark.timeout(180)

ONE_LEAF = {"full": full_attention(0)}
PAGE = 64 * 1024
COUNT = 6


def _listener_reader(node_factory, connectors, leaves=ONE_LEAF,  # noqa: ANN001
                     **kwargs) -> tuple[object, DKVConnector, list[bytes], DKVConnector]:
    """A node holding ``COUNT`` blocks of ``PAGE`` bytes, their writer, and a listener reader whose lookups bring no bytes."""
    node = node_factory()
    writer = connectors(node.address, leaves=leaves, blocks=device_blocks(leaves, page_bytes=PAGE))
    hashes = chain(COUNT)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001
    kwargs.setdefault("lookup_payload_bytes", 0)  # (a lookup that brought the bytes would need no read)
    reader = connectors(node.address, leaves=leaves, blocks=device_blocks(leaves, page_bytes=PAGE), local=False,
                        **kwargs)
    deadline = time.monotonic() + BOUND
    while not reader._clients[node.address].direct_free:  # noqa: SLF001 - opened on the first lookup
        assert time.monotonic() < deadline, "the direct channel never opened"
        assert all(reader.lookup(hashes)["full"])
        time.sleep(0.01)
    return node, writer, hashes, reader


@pytest.fixture
def loop_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the reads that went through the loop thread (``NodeClient.read``)."""
    calls: list[int] = []
    original = NodeClient.read

    async def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        calls.append(1)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(NodeClient, "read", counted)
    return calls


def _load(reader: DKVConnector, hashes: list[bytes]) -> object:
    handle = reader.start_lookup(hashes)
    assert answered(handle) == {"full": [True] * len(hashes)}
    return reader.load_lookup(handle, {"full": list(range(1, len(hashes) + 1))}, {"full": hashes})


async def test_a_listener_load_reads_over_a_direct_channel_bit_exact_with_no_read_on_the_loop(
        node_factory, connectors, loop_reads) -> None:
    node, writer, hashes, reader = _listener_reader(node_factory, connectors)
    ids = list(range(1, COUNT + 1))
    reads_before = (await node_stats(node.address))["ops"].get("read", 0)
    wait(_load(reader, hashes))
    assert _rows(reader, "full", ids) == _rows(writer, "full", ids)
    assert not loop_reads, "the load was read through the loop"
    assert (await node_stats(node.address))["ops"]["read"] == reads_before + 1
    assert reader.counters.blocks_loaded == COUNT and reader.counters.loads_failed == 0
    assert (await wait_for_stats(node.address, lambda s: s["leases"] == 0))["leases"] == 0
    assert reader.lookup(hashes) == {"full": [True] * COUNT}  # lookups in place again once its answer was in


def test_a_load_of_several_leaves_and_shards_reads_over_one_channel_bit_exact(node_factory, connectors,
                                                                             loop_reads) -> None:
    _, writer, hashes, reader = _listener_reader(node_factory, connectors, leaves=two_leaves(tp=2))
    ids = list(range(1, COUNT + 1))
    handle = reader.start_lookup(hashes)
    assert answered(handle) == {"full": [True] * COUNT, "swa": [True] * COUNT}
    wait(reader.load_lookup(handle, {"full": ids, "swa": ids[-2:]}, {"full": hashes, "swa": hashes[-2:]}))
    assert _rows(reader, "full", ids) == _rows(writer, "full", ids)  # (every shard's rows)
    assert _rows(reader, "swa", ids[-2:]) == _rows(writer, "swa", ids[-2:])
    assert not loop_reads, "the load was read through the loop"
    assert reader.counters.blocks_loaded == 2 * (COUNT + 2)


def test_with_direct_reads_off_the_loop_reads(node_factory, connectors, loop_reads) -> None:
    _, writer, hashes, reader = _listener_reader(node_factory, connectors, direct_reads=False)
    wait(_load(reader, hashes))
    assert _rows(reader, "full", list(range(1, COUNT + 1))) == _rows(writer, "full", list(range(1, COUNT + 1)))
    assert loop_reads == [1]


def test_a_read_over_a_channel_never_waits_for_the_copy_threads(node_factory, connectors, loop_reads) -> None:
    """A read mostly waits on the network: on a copy thread it held one for its whole run, so reads from more
    nodes than there are copy threads, and every copy, queued behind those waits. Here every copy thread is
    held, and the read still lands, over its channel."""
    from dkv import copy_threads

    _, writer, hashes, reader = _listener_reader(node_factory, connectors)
    release = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> None:
        started.release()
        release.wait(BOUND)

    held = [copy_threads.submit(hold) for _ in range(copy_threads.COPY_THREADS)]
    try:
        for _ in held:
            assert started.acquire(timeout=BOUND), "a copy thread never took its work"
        wait(_load(reader, hashes))
    finally:
        release.set()
        for job in held:
            job.result(BOUND)
    assert _rows(reader, "full", list(range(1, COUNT + 1))) == _rows(writer, "full", list(range(1, COUNT + 1)))
    assert loop_reads == []


def test_a_load_that_finds_every_channel_busy_is_read_by_the_loop(node_factory, connectors, loop_reads) -> None:
    node, writer, hashes, reader = _listener_reader(node_factory, connectors, direct_channels=1)
    handle = reader.start_lookup(hashes)
    assert answered(handle) == {"full": [True] * COUNT}
    node.pause()
    try:
        holder = reader.start_lookup(hashes[:1])  # holds the one channel: its answer cannot arrive while paused
        assert holder.answered_by_polling
        transfer = reader.load_lookup(handle, {"full": list(range(1, COUNT + 1))}, {"full": hashes})
    finally:
        node.resume()
    wait(transfer)
    assert _rows(reader, "full", list(range(1, COUNT + 1))) == _rows(writer, "full", list(range(1, COUNT + 1)))
    assert loop_reads == [1]
    answered(holder)
    reader.abandon_lookup(holder)


def test_no_lookup_runs_in_place_until_a_read_over_a_channel_was_answered(node_factory, connectors) -> None:
    node, writer, hashes, reader = _listener_reader(node_factory, connectors)
    client = reader._clients[node.address]  # noqa: SLF001
    assert reader._worker.loop.run(client.open_direct(another=True), BOUND)  # noqa: SLF001 - a channel to spare
    ids = list(range(1, COUNT + 1))
    assert reader.lookup(hashes) == {"full": [True] * COUNT}
    node.pause()
    resumer = threading.Timer(0.3, node.resume)
    try:
        transfer = reader.load({"full": ids}, {"full": hashes})  # sent on one channel; its answer cannot come
        before = reader.counters.lookups_in_place
        resumer.start()
        # on the spare channel it could reach the node before the read, and end the lease the read is to read
        assert reader.lookup(hashes) == {"full": [True] * COUNT}
        assert reader.counters.lookups_in_place == before, "a lookup ran in place before the read was answered"
    finally:
        resumer.cancel()
        resumer.join()
        node.resume()
    wait(transfer)
    assert _rows(reader, "full", ids) == _rows(writer, "full", ids)


def test_a_hung_node_fails_a_read_over_a_channel_within_its_bound(node_factory, connectors, loop_reads) -> None:
    node, _, hashes, reader = _listener_reader(node_factory, connectors, timeout=1.0)
    handle = reader.start_lookup(hashes)
    assert answered(handle) == {"full": [True] * COUNT}
    node.pause()
    try:
        started = time.monotonic()
        transfer = reader.load_lookup(handle, {"full": list(range(1, COUNT + 1))}, {"full": hashes})
        with pytest.raises(KVLoadFailed):
            wait(transfer)
        assert time.monotonic() - started < 10  # the 1 s bound, generously
    finally:
        node.resume()
    assert not loop_reads
    assert reader.counters.loads_failed == 1 and reader.counters.loads_failed_by_reason["timeout"] == 1
    assert reader.lookup(hashes) == {"full": [False] * COUNT}  # backed off: a miss without asking
    assert reader.counters.lookups_skipped >= 1


def test_a_shutdown_during_a_read_over_a_channel_returns_within_its_bound(node_factory, connectors) -> None:
    # shutdown drains in-flight transfers for up to twice the timeout, then closes the channels under them
    node, _, hashes, reader = _listener_reader(node_factory, connectors, timeout=2.0)
    handle = reader.start_lookup(hashes)
    assert answered(handle) == {"full": [True] * COUNT}
    node.pause()
    try:
        transfer = reader.load_lookup(handle, {"full": list(range(1, COUNT + 1))}, {"full": hashes})
        time.sleep(0.2)  # the copy thread sent the read and waits for the answer
        assert not transfer.is_complete()
        done = threading.Event()
        threading.Thread(target=lambda: (reader.shutdown(), done.set()), daemon=True).start()
        assert done.wait(BOUND), "shutdown waited past its bound on a read its node never answers"
        with pytest.raises(KVLoadFailed):
            transfer.is_complete()
        assert not reader._worker._channel_jobs  # noqa: SLF001 - the read's thread ended before shutdown returned
    finally:
        node.resume()
