"""Faults against real processes: a peer killed or paused mid-load, a link cut mid-load, a pool full of leases.

Each test asserts the same four things:

* **no hang** — the failing call settles within a generous bound, and every
  scheduler-side connector call made during the fault returns at once
  (:func:`~tests.cluster.load_faults.promptly`);
* **no wrong KV** — a load that reports success is bit-exact; one that does
  not is reported failed to the engine (``KVLoadFailed`` from the transfer,
  on every later poll), and nothing writes into its rows afterwards;
* **typed failures** — ``KVLoadFailed`` caused by a :mod:`dkv.errors`
  ``TransportError``; a write into a pool with no room is answered ``full``;
* **counters that explain** — the connector's counters and the node's stats
  name what happened, and the node holds no lease, read or pin once it is over.

Covered elsewhere, not repeated here: a peer paused mid-load and then killed,
on the listener path (``tests/connector/test_connector.py``,
``test_peer_that_hangs_mid_load_fails_from_the_transfer_within_a_bound``, and
through the reference engine, ``tests/connector/test_engine_with_dkv.py``),
a peer killed *before* the lookup, a paused co-located node or hinted peer
costing one bounded *synchronous* ``lookup()`` (``test_connector.py``), a node killed between
requests of a workload (``tests/cluster/test_end_to_end.py``), a late answer
after a timeout at the transport level (``tests/dkv/test_transport.py``), the
node's lease cap refusing with ``NodeBusy`` (``tests/dkv/test_node_quotas.py``)
and the store refusing writes into a pool of pinned blocks
(``tests/dkv/test_store.py``, in process).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster import local
from cluster.netns import NETNS_ENV, netns_available
from connector.dkv_connector import DKVConnector
from connector.types import full_attention
from dkv.errors import TransportError
from dkv.keys import BlockKey
from dkv.store import FULL, WRITE
from tests.cluster.load_faults import (
    BLOCK,
    SETTLE_BOUND,
    chain,
    nonzero_rows,
    promptly,
    settle,
    wait_for_first_bytes,
)
from tests.conftest import node_stats, wait_for_stats
from tests.connector.conftest import NAMESPACE, device_blocks

LEAVES = {"full": full_attention(0)}
BLOCKS = 64  # 64 MiB per load: tens of milliseconds on these machines, so a fault lands mid-load
TIMEOUT = 2.0  # the reader's network timeout; CALL_BOUND is below it
PATHS = {
    "listener": {"local": False},  # UCX messages from the node's listener
    "same-host": {"local": True},  # one round trip: the client copies the leased slots itself
    "same-host-two-step": {"local": True, "checksums": False},  # read, copy, done
}
CLIENT = Path(__file__).with_name("link_cut_client.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def connectors(node_factory) -> Iterator[Callable[..., DKVConnector]]:
    """Make connectors (namespace ``NAMESPACE``); all are shut down at teardown, before the nodes are checked."""
    made: list[DKVConnector] = []

    def make(address: str, **kwargs: Any) -> DKVConnector:
        conn = DKVConnector(LEAVES, kwargs.pop("blocks"), node=address, namespace=NAMESPACE, **kwargs)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.shutdown()


Connectors = Callable[..., DKVConnector]


def _stored_chain(connectors: Connectors, address: str, n: int = BLOCKS) -> tuple[list[bytes], torch.Tensor]:
    """Offload ``n`` never-0 blocks to the node at ``address``; returns their hashes and bytes."""
    src = device_blocks(LEAVES, pages=n + 1, page_bytes=BLOCK)
    src[0]["full"][0][1:] = nonzero_rows(n)
    writer = connectors(address, blocks=src, timeout=10.0)
    hashes = chain(n)
    _, _ = settle(writer.offload({"full": list(range(1, n + 1))}, {"full": hashes}))
    writer.shutdown()
    return hashes, src[0]["full"][0][1:]


def _reader(connectors: Connectors, address: str, path: str, n: int = BLOCKS) -> tuple[DKVConnector, torch.Tensor]:
    """A reader taking ``path`` (a key of ``PATHS``), and its zeroed device rows (row 0 is the null page)."""
    dst = device_blocks(LEAVES, pages=n + 1, page_bytes=BLOCK)
    reader = connectors(address, blocks=dst, timeout=TIMEOUT, **PATHS[path])
    return reader, dst[0]["full"][0]


def _loads_in_place(reader: DKVConnector, hashes: list[bytes]) -> Any:
    """Lookup (before any fault), then post the load of every block; returns the transfer."""
    assert reader.lookup(hashes)["full"] == [True] * len(hashes)
    return promptly(reader.load, {"full": list(range(1, len(hashes) + 1))}, {"full": hashes})


def _assert_failed_as_the_protocol_says(outcome: str, err: Exception | None, transfer: Any,
                                        reader: DKVConnector) -> None:
    """Failed as the protocol says: ``KVLoadFailed`` from the transfer, typed cause, on every poll, counted."""
    assert outcome == "failed" and err is not None
    assert isinstance(err.__cause__, TransportError), f"untyped cause: {err.__cause__!r}"
    with pytest.raises(type(err)):
        promptly(transfer.is_complete)  # every later poll reports the same failure
    assert reader.counters.loads_failed == 1 and reader.counters.blocks_loaded == 0


def _assert_completed_exact(outcome: str, rows: torch.Tensor, src: torch.Tensor, reader: DKVConnector) -> None:
    """Reported complete, so every byte is the stored one."""
    assert outcome == "completed"
    assert torch.equal(rows[1:], src), "a load that reported success must be bit-exact"
    assert reader.counters.blocks_loaded == len(src) and reader.counters.loads_failed == 0


# ---- (a) a peer SIGKILLed mid-load -------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
def test_a_node_killed_mid_load_fails_the_load_or_delivers_it_exact_and_never_blocks_the_scheduler(
        node_factory, connectors: Connectors, path: str) -> None:
    node = node_factory(pool="128MiB")
    hashes, src = _stored_chain(connectors, node.address)
    reader, rows = _reader(connectors, node.address, path)
    transfer = _loads_in_place(reader, hashes)
    try:
        landed_first = wait_for_first_bytes(rows[1], transfer)
    finally:
        node.kill()  # SIGKILL, now that the load's bytes are arriving
    outcome, err = settle(transfer)
    print(f"{path}: bytes landed before the kill: {landed_first}; the load {outcome}")
    if path == "same-host":
        # the leased slots were mapped before the kill, and nothing changes them after it: the copy is whole
        _assert_completed_exact(outcome, rows, src, reader)
    elif outcome == "completed":
        _assert_completed_exact(outcome, rows, src, reader)  # it had landed whole before the kill
    else:
        _assert_failed_as_the_protocol_says(outcome, err, transfer, reader)
        snapshot = rows.clone()
        time.sleep(0.5)
        assert torch.equal(rows, snapshot), "nothing writes into the destination after the failure"
    # the dead node costs the scheduler nothing more: each call returns at once
    promptly(reader.abandon_lookup, promptly(reader.start_lookup, hashes))
    offload = promptly(reader.offload, {"full": [1]}, {"full": chain(1)})
    assert settle(offload)[0] == "completed", "an offload to a dead node completes quietly"
    promptly(reader.poll_transfers)
    counted = reader.counters
    if outcome == "failed":
        assert reader._unreachable, "the node that did not answer is backed off"  # noqa: SLF001
        assert counted.lookups_skipped == 1, "backed off: the lookup was a miss at once"
    # sent and failed, or (once the node is backed off) dropped without asking: counted either way
    assert counted.offloads_failed + getattr(counted, "offloads_dropped", 0) == 1, counted


# ---- (b) a peer SIGSTOPped mid-load, then SIGCONTinued ------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
async def test_a_node_paused_mid_load_fails_it_within_the_timeout_and_writes_nothing_late_once_resumed(
        node_factory, connectors: Connectors, path: str) -> None:
    node = node_factory(pool="128MiB")
    hashes, src = _stored_chain(connectors, node.address)
    reader, rows = _reader(connectors, node.address, path)
    transfer = _loads_in_place(reader, hashes)
    try:
        landed_first = wait_for_first_bytes(rows[1], transfer)
        node.pause()
        paused_mid_load = not transfer._future.done()  # noqa: SLF001
        # the scheduler is not held up by the hung node: each call returns at once
        promptly(reader.abandon_lookup, promptly(reader.start_lookup, hashes))  # released if it is ever answered
        promptly(reader.touch, hashes)
        promptly(reader.poll_transfers)
        outcome, err = settle(transfer)
        print(f"{path}: bytes landed before the pause: {landed_first}, paused mid-load: {paused_mid_load}; "
              f"the load {outcome}")
        if path == "same-host" or outcome == "completed":
            # same-host, one round trip: the copy needs nothing more from the node, so a paused node cannot
            # fail it (on the other paths a load completes only if it had landed whole before the pause)
            _assert_completed_exact(outcome, rows, src, reader)
        else:
            _assert_failed_as_the_protocol_says(outcome, err, transfer, reader)
            # the node that did not answer is backed off: the next lookup is a miss at once, counted
            assert reader._unreachable, "the node that did not answer is backed off"  # noqa: SLF001
            skipped = promptly(reader.start_lookup, hashes)
            assert skipped.is_complete() and skipped.result() == {"full": [False] * len(hashes)}
            assert reader.counters.lookups_skipped == 1
            promptly(reader.abandon_lookup, skipped)
        snapshot = rows.clone()
    finally:
        node.resume()
    # once resumed the node answers what it was asked; none of it may land in the failed load's rows,
    # and the node ends the read, its pins and every lease
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0 and s["pinned_blocks"] == 0
                                 and s["reads"] == 0)
    assert (stats["leases"], stats["pinned_blocks"], stats["reads"]) == (0, 0, 0), stats
    await asyncio.sleep(0.3)
    assert torch.equal(rows, snapshot), "the resumed node wrote into a load that had already been reported"
    # and it serves again: once the backoff ends a load is whole
    reader._unreachable.clear()  # noqa: SLF001 - end the backoff early: the node answers again
    rows.zero_()
    outcome, _ = settle(_loads_in_place(reader, hashes))
    assert outcome == "completed" and torch.equal(rows[1:], src)


async def test_a_lookup_handle_on_a_paused_node_answers_a_miss_after_one_timeout_not_one_per_retry(
        node_factory, connectors: Connectors) -> None:
    node = node_factory()
    conn = connectors(node.address, blocks=device_blocks(LEAVES, pages=4, page_bytes=4096), timeout=1.0)
    hashes = chain(2)
    node.pause()
    try:
        started = time.monotonic()
        handle = promptly(conn.start_lookup, hashes)
        while not promptly(handle.is_complete):
            assert time.monotonic() - started < SETTLE_BOUND, "a lookup on a paused node never answered"
            await asyncio.sleep(0.01)
        waited = time.monotonic() - started
        assert handle.result() == {"full": [False, False]}
        promptly(conn.abandon_lookup, handle)
    finally:
        node.resume()
    assert conn.counters.lookup_failures == 1
    # the README's "one bounded wait" (the engine holds the request out of its batch this long): one
    # 1 s timeout and some slack, where asking again on new connections takes three and more
    assert waited < 2.5, f"the handle answered after {waited:.1f} s, not after one 1 s timeout"


# ---- (c) the link to a peer taken down mid-load (network namespaces) ------------------------------


def test_a_link_cut_mid_load_from_a_peer_fails_the_load_and_the_peer_serves_again_once_it_is_back(
        tmp_path: Path) -> None:
    reason = netns_available()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    record = local.up(tmp_path / "c", 2, pool="96MiB", netns=True)
    try:
        env = {**os.environ, **NETNS_ENV, "PYTHONPATH": str(ROOT)}
        result = subprocess.run([*record.client_prefix(), sys.executable, str(CLIENT), str(tmp_path / "c")],
                                capture_output=True, text=True, timeout=150, env=env, check=False)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        local.down(tmp_path / "c")
    print(report)
    assert report["landed_before_cut"] and report["in_flight_at_cut"], "the link went down mid-load"
    assert report["outcome"] == "failed", "bytes cannot cross a link that is down"
    assert report["cause_is_timeout"], f"typed: OpTimeout, a TransportError; got {report['cause']}"
    assert report["polls_after_failure_fail"], "every later poll reports the failure"
    assert report["settled_within"] < report["timeout"] + 10, "the load failed within its timeout, not later"
    # the peer that did not answer is not asked again: its hint is a counted miss, served by the co-located node
    assert report["lookup_after_failure"] == [False] * report["blocks"], "a peer behind a cut link is a miss"
    assert report["counters"]["loads_failed"] == 1 and report["counters"]["blocks_loaded_before_recovery"] == 0
    assert report["metrics"]["dkv_peer_load_failures"] == 1
    assert report["counters"]["unusable_hints"].get("peer_unreachable", 0) >= 1, "hints naming it are counted"
    assert report["late_writes"] is False, "nothing lands in the failed load's rows once the link is back"
    assert report["peer_stats_after"] == {"leases": 0, "pinned_blocks": 0, "reads": 0}
    assert report["recovered_exact"] is True, "once the link is back a load from the peer is whole"


# ---- (d) the pool full of leased blocks ---------------------------------------------------------

POOL_BLOCKS = 8  # an 8 MiB pool holds 8 blocks of 1 MiB
LEASE_TTL = 3  # s: long enough for the refused writes to happen under the lease on a slow machine


async def test_writes_into_a_pool_full_of_leased_blocks_are_refused_full_counted_and_land_once_the_leases_expire(
        node_factory, connectors: Connectors, clients) -> None:
    node = node_factory("--lease-ttl", str(LEASE_TTL), pool=f"{POOL_BLOCKS}MiB")
    held_hashes, _ = _stored_chain(connectors, node.address, POOL_BLOCKS)
    client = clients(node.address, namespace=NAMESPACE, local=False)
    found = await client.lookup(held_hashes, ["full"])  # leases every block of the pool; never released
    assert found.lease_id is not None and found.masks["full"] == [True] * POOL_BLOCKS

    # the connector's offload: completes (never hangs), stores nothing, evicts no leased block
    blocks = device_blocks(LEAVES, pages=4, page_bytes=BLOCK)
    blocks[0]["full"][0][1:] = nonzero_rows(3)
    writer = connectors(node.address, blocks=blocks, timeout=TIMEOUT)
    new = chain(3)
    offload = promptly(writer.offload, {"full": [1, 2, 3]}, {"full": new})
    assert settle(offload)[0] == "completed", "an offload the node has no room for completes, never hangs"
    # the library's write: refused per key with the typed status, before any byte moves
    fresh = [BlockKey("full", 0, h) for h in chain(2)]
    payload = [os.urandom(BLOCK) for _ in fresh]
    assert (await client.write(fresh, payload)).statuses == [FULL, FULL]
    stats = await node_stats(node.address)
    assert stats["counters"]["full_refusals"] == 3 + 2, "the node names the refusals"
    assert stats["blocks"] == POOL_BLOCKS and stats["pinned_blocks"] == POOL_BLOCKS, "no leased block was evicted"
    assert stats["reservations"] == 0
    counted = writer.counters
    assert counted.blocks_offloaded == 0 and counted.offloads_failed == 0 and writer.metrics.d2h_bytes_copied == 0
    refused_counted = getattr(counted, "offload_blocks_full", None)

    # once the lease expires there is room again: the same offload is sent again (nothing was learnt as held)
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0 and s["pinned_blocks"] == 0)
    assert stats["counters"]["leases_expired"] == 1, "the node names why the pins ended"
    again = promptly(writer.offload, {"full": [1, 2, 3]}, {"full": new})
    assert settle(again)[0] == "completed" and writer.counters.blocks_offloaded == 3
    assert (await client.write(fresh, payload)).statuses == [WRITE, WRITE]
    assert await client.probe(new, ["full"]) == {"full": [True] * 3}
    back = await client.lookup([k.hash for k in fresh], ["full"])
    dests = [bytearray(BLOCK) for _ in fresh]
    await client.read(back.lease_id, fresh, dests)
    assert [bytes(d) for d in dests] == payload
    assert refused_counted == 3, f"the connector names the blocks the node had no room for: {counted}"
