"""DKVConnector against real node processes: one test per contract, named after the failure it prevents."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from connector.dkv_connector import DKVConnector, DKVLookup
from connector.types import ByteCount, CompletedTransfer, KVLoadFailed, KVLoadRefused
from dkv.hints import MISMATCH, STALE_EPOCH, UNKNOWN_PEER, UNKNOWN_VERSION, UNPARSEABLE, WRONG_NAMESPACE
from dkv.keys import BlockKey
from tests.conftest import node_stats, wait_for_stats
from tests.connector.conftest import NAMESPACE, PAGE_BYTES, device_blocks, routed_hint, two_leaves

BOUND = 20.0


def chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def wait(transfer, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not transfer.is_complete():
        assert time.monotonic() < deadline, "transfer did not settle within the bound"
        time.sleep(0.002)


def answered(handle: DKVLookup) -> dict[str, list[bool]]:
    deadline = time.monotonic() + BOUND
    while not handle.is_complete():
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return handle.result()


def fill(conn_blocks, leaf: str, ids: list[int], seed: int, replica: int = 0) -> None:
    for shard, tensor in enumerate(conn_blocks[replica][leaf]):
        for i in ids:
            tensor[i] = torch.from_numpy(np.random.default_rng(seed * 1000 + i * 10 + shard)
                                         .integers(0, 256, tensor.shape[1], dtype=np.uint8))


def offload_chain(conn: DKVConnector, blocks, hashes: list[bytes], ids: list[int] | None = None) -> None:
    ids = ids or list(range(1, len(hashes) + 1))
    for leaf in blocks[0]:
        fill(blocks, leaf, ids, seed=7)
    wait(conn.offload({leaf: ids for leaf in blocks[0]}, {leaf: hashes for leaf in blocks[0]}))


# ---- presence ---------------------------------------------------------------------------------


def test_masks_are_exactly_len_hashes_long_and_real_bools(node, connectors) -> None:
    writer_blocks = device_blocks(two_leaves())
    writer = connectors(node.address, blocks=writer_blocks)
    hashes = chain(3)
    offload_chain(writer, writer_blocks, hashes[:2])
    reader = connectors(node.address)
    masks = reader.lookup(hashes)
    assert set(masks) == {"full", "swa"}
    for mask in masks.values():
        assert len(mask) == 3 and all(type(b) is bool for b in mask)
    assert masks["full"] == [True, True, False]
    handle = reader.start_lookup(hashes)
    assert answered(handle) == masks
    reader.abandon_lookup(handle)


async def test_mask_is_false_when_one_tp_shard_is_missing(node, clients, connectors) -> None:
    hashes = chain(2)
    raw = clients(node.address, namespace=NAMESPACE)
    # both shards of block 0, only shard 0 of block 1
    keys = [BlockKey(leaf, s, hashes[0]) for leaf in ("full", "swa") for s in (0, 1)]
    keys += [BlockKey(leaf, 0, hashes[1]) for leaf in ("full", "swa")]
    await raw.write(keys, [b"\x01" * PAGE_BYTES] * len(keys))
    conn = connectors(node.address, leaves=two_leaves(tp=2))
    assert conn.lookup(hashes) == {"full": [True, False], "swa": [True, False]}


def test_wrong_hash_length_is_a_value_error(node, connectors) -> None:
    conn = connectors(node.address)
    with pytest.raises(ValueError):
        conn.lookup([b"short"])
    with pytest.raises(ValueError):
        conn.start_lookup([b"x" * 31])
    with pytest.raises(ValueError):
        conn.load({"full": [1]}, {"full": [b"x" * 9]})
    with pytest.raises(ValueError):
        conn.offload({"full": [1]}, {"full": [b"x" * 33]})


def test_defers_lookup_is_true_exactly_because_start_lookup_returns_before_it_answers(node, connectors) -> None:
    conn = connectors(node.address)
    assert conn.defers_lookup(0) is True
    node.pause()
    try:
        handle = conn.start_lookup(chain(4))
        assert not handle.is_complete(), "start_lookup must return before the node answers"
    finally:
        node.resume()
    assert answered(handle) == {"full": [False] * 4, "swa": [False] * 4}
    conn.abandon_lookup(handle)


# ---- leases -------------------------------------------------------------------------------------


async def test_lookup_with_no_load_after_it_holds_one_bounded_lease(node_factory, connectors) -> None:
    node = node_factory("--lease-ttl", "2")
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(3)
    offload_chain(conn, blocks, hashes)
    conn.lookup(hashes)
    conn.lookup(hashes)  # back to back: still one lease
    assert (await node_stats(node.address))["leases"] == 1
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0, "a lookup nobody loads from must not pin blocks past its TTL"


async def test_node_lease_count_returns_to_zero_after_abandon_load_and_back_to_back(node, connectors) -> None:
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(4)
    offload_chain(conn, blocks, hashes)
    # abandon
    handle = conn.start_lookup(hashes)
    answered(handle)
    assert (await node_stats(node.address))["leases"] == 1
    conn.abandon_lookup(handle)
    assert (await wait_for_stats(node.address, lambda s: s["leases"] == 0))["leases"] == 0
    # load
    handle = conn.start_lookup(hashes)
    answered(handle)
    wait(conn.load_lookup(handle, {"full": [10, 11]}, {"full": hashes[:2]}))
    assert (await wait_for_stats(node.address, lambda s: s["leases"] == 0))["leases"] == 0
    # back-to-back synchronous lookups, then the load
    conn.lookup(hashes)
    conn.lookup(hashes)
    wait(conn.load({"full": [12]}, {"full": hashes[:1]}))
    assert (await wait_for_stats(node.address, lambda s: s["leases"] == 0))["leases"] == 0


def test_abandon_lookup_never_raises_on_any_handle_state(node, connectors) -> None:
    conn = connectors(node.address)
    node.pause()
    try:
        pending = conn.start_lookup(chain(2))
        conn.abandon_lookup(pending)  # not answered yet
    finally:
        node.resume()
    found_nothing = conn.start_lookup(chain(2))
    answered(found_nothing)
    conn.abandon_lookup(found_nothing)
    conn.abandon_lookup(found_nothing)  # twice
    consumed = conn.start_lookup(chain(1))
    answered(consumed)
    with pytest.raises(KVLoadRefused):
        conn.load_lookup(consumed, {"full": [1]}, {"full": [consumed.block_hashes[0]]})
    conn.abandon_lookup(consumed)  # after load_lookup consumed it
    conn.abandon_lookup(object())  # not even a handle
    conn.abandon_lookup(None)


def test_lease_expired_before_load_is_refused_and_nothing_moves(node_factory, connectors) -> None:
    node = node_factory("--lease-ttl", "1")
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(2)
    offload_chain(conn, blocks, hashes)
    reader_blocks = device_blocks(two_leaves())
    reader = connectors(node.address, blocks=reader_blocks)
    handle = reader.start_lookup(hashes)
    assert answered(handle)["full"] == [True, True]
    time.sleep(1.5)  # past the node's TTL
    with pytest.raises(KVLoadRefused):
        reader.load_lookup(handle, {"full": [3, 4]}, {"full": hashes})
    assert int(reader_blocks[0]["full"][0][3:5].sum()) == 0, "a refused load moves nothing"
    assert reader.counters.loads_refused == 1


# ---- loads --------------------------------------------------------------------------------------


def test_load_is_bit_exact_into_the_named_rows(node, connectors) -> None:
    leaves = two_leaves(tp=2)
    src = device_blocks(leaves)
    writer = connectors(node.address, leaves=leaves, blocks=src)
    hashes = chain(4)
    offload_chain(writer, src, hashes, ids=[3, 5, 7, 9])
    dst = device_blocks(leaves)
    reader = connectors(node.address, leaves=leaves, blocks=dst)
    assert reader.lookup(hashes) == {"full": [True] * 4, "swa": [True] * 4}
    transfer = reader.load({"full": [20, 21, 22, 23], "swa": [24, 25]}, {"full": hashes, "swa": hashes[2:]})
    wait(transfer)
    assert transfer.is_complete() is True  # safe to poll again
    for shard in (0, 1):
        assert torch.equal(dst[0]["full"][shard][20:24], src[0]["full"][shard][[3, 5, 7, 9]])
        assert torch.equal(dst[0]["swa"][shard][24:26], src[0]["swa"][shard][[7, 9]])
    assert reader.metrics.h2d_bytes_copied == 12 * PAGE_BYTES


def test_load_of_a_block_the_lookup_did_not_report_is_refused_before_anything_moves(node, connectors) -> None:
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(3)
    offload_chain(conn, blocks, hashes[:2])
    dst = device_blocks(two_leaves())
    reader = connectors(node.address, blocks=dst)
    reader.lookup(hashes)
    with pytest.raises(KVLoadRefused) as refused:
        reader.load({"full": [1, 2, 3]}, {"full": hashes})
    assert refused.value.leaf_id == "full" and refused.value.block_hash == hashes[2]
    assert int(dst[0]["full"][0].sum()) == 0
    with pytest.raises(KVLoadRefused):
        reader.load({"full": [1]}, {"full": hashes[:1]})  # the lookup was consumed by the refused load


def test_load_without_a_lookup_or_with_another_hint_is_refused(node, connectors) -> None:
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(2)
    offload_chain(conn, blocks, hashes)
    with pytest.raises(KVLoadRefused):
        conn.load({"full": [5]}, {"full": hashes[:1]})
    conn.lookup(hashes, hint=None)
    with pytest.raises(KVLoadRefused, match="same hint"):
        conn.load({"full": [5]}, {"full": hashes[:1]}, hint=b'{"version": 2, "instances": []}')


def test_load_of_nothing_is_a_completed_transfer(node, connectors) -> None:
    conn = connectors(node.address)
    conn.lookup(chain(2))
    transfer = conn.load({"full": []}, {"full": []})
    assert isinstance(transfer, CompletedTransfer) and transfer.is_complete()


def test_peer_that_hangs_mid_load_fails_from_the_transfer_within_a_bound(node_factory, connectors) -> None:
    node = node_factory(pool="256MiB")
    big = 1 << 20
    leaves = two_leaves()
    src = device_blocks(leaves, pages=40, page_bytes=big)
    writer = connectors(node.address, leaves=leaves, blocks=src, local=False)
    hashes = chain(32)
    offload_chain(writer, src, hashes)
    dst = device_blocks(leaves, pages=40, page_bytes=big)
    reader = connectors(node.address, leaves=leaves, blocks=dst, local=False, timeout=2.0)
    reader.lookup(hashes)
    node.pause()
    try:
        transfer = reader.load({"full": list(range(1, 33))}, {"full": hashes})
        started = time.monotonic()
        with pytest.raises(KVLoadFailed):
            wait(transfer, bound=BOUND)
        assert time.monotonic() - started < BOUND
        with pytest.raises(KVLoadFailed):
            transfer.is_complete()  # polling again reports the same failure
        snapshot = dst[0]["full"][0].clone()
    finally:
        node.kill()
    time.sleep(0.5)
    assert torch.equal(dst[0]["full"][0], snapshot), "nothing writes into the destination after the failure"
    assert reader.counters.loads_failed >= 1


def test_peer_killed_before_lookup_costs_a_miss_not_an_error(node_factory, connectors) -> None:
    node = node_factory()
    conn = connectors(node.address, timeout=2.0)
    node.kill()
    assert conn.lookup(chain(2)) == {"full": [False, False], "swa": [False, False]}
    handle = conn.start_lookup(chain(2))
    assert answered(handle) == {"full": [False, False], "swa": [False, False]}
    with pytest.raises(KVLoadRefused):
        conn.load_lookup(handle, {"full": [1]}, {"full": [handle.block_hashes[0]]})
    assert conn.counters.lookup_failures == 1, "the node that did not answer is asked once"
    assert conn.counters.lookups_skipped == 1, "then lookups are misses without a wait until the backoff ends"


def test_a_colocated_node_that_stops_answering_costs_one_bounded_wait_not_one_per_lookup(node_factory,
                                                                                          connectors) -> None:
    node = node_factory()
    conn = connectors(node.address, timeout=2.0)
    blocks = conn._blocks  # noqa: SLF001 - the connector's own device rows
    hashes = chain(2)
    offload_chain(conn, blocks, hashes)
    node.pause()
    try:
        assert conn.lookup(hashes) == {"full": [False, False], "swa": [False, False]}
        assert conn.counters.lookup_failures == 1
        for _ in range(3):  # a scheduler thread calling lookup() synchronously is not held up again
            assert conn.lookup(hashes) == {"full": [False, False], "swa": [False, False]}
            assert answered(conn.start_lookup(hashes)) == {"full": [False, False], "swa": [False, False]}
        assert conn.counters.lookup_failures == 1 and conn.counters.lookups_skipped == 6
    finally:
        node.resume()
    conn._unreachable.clear()  # noqa: SLF001 - end the backoff early: the node answers again
    assert conn.lookup(hashes) == {"full": [True, True], "swa": [True, True]}
    conn.abandon_lookup(conn.start_lookup([]))


def test_a_hinted_peer_that_stops_answering_is_a_counted_miss_until_it_answers_again(etcd, node_factory,
                                                                                     connectors) -> None:
    a = node_factory(*etcd.node_args("a"))
    b = node_factory(*etcd.node_args("b", ttl=60))  # stays a member while paused
    cluster = {"etcd": etcd.url, "etcd_prefix": etcd.prefix, "timeout": 2.0}
    writer = connectors(b.address, **cluster)
    hashes = chain(2)
    offload_chain(writer, writer._blocks, hashes)  # noqa: SLF001
    reader = connectors(a.address, **cluster)
    hint = routed_hint(reader, hashes, holder="b")
    b.pause()
    try:
        assert reader.lookup(hashes, hint=hint) == {"full": [False, False], "swa": [False, False]}
        assert reader.counters.lookup_failures == 1
        handle = reader.start_lookup(hashes, hint=hint)  # served by the co-located node, which lacks them
        assert answered(handle) == {"full": [False, False], "swa": [False, False]}
        reader.abandon_lookup(handle)
        assert reader.counters.unusable_hints["peer_unreachable"] == 1
        assert reader.counters.lookup_failures == 1, "the hung peer was not asked again"
    finally:
        b.resume()
    reader._unreachable.clear()  # noqa: SLF001 - end the backoff early: the peer answers again
    assert reader.lookup(hashes, hint=hint) == {"full": [True, True], "swa": [True, True]}
    reader.abandon_lookup(reader.start_lookup([]))


# ---- offloads -----------------------------------------------------------------------------------


async def test_offload_pins_its_sources_and_stores_them_once_landed(node, connectors, clients) -> None:
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(3)
    fill(blocks, "full", [4, 5, 6], seed=3)
    transfer = conn.offload({"full": [4, 5, 6], "swa": [6]}, {"full": hashes, "swa": hashes[2:]})
    assert transfer.g0_blocks_per_leaf == {"full": [4, 5, 6], "swa": [6]}
    wait(transfer)
    found = await clients(node.address, namespace=NAMESPACE).probe(hashes, ["full", "swa"])
    assert found == {"full": [True] * 3, "swa": [False, False, True]}
    assert conn.metrics.d2h_bytes_copied == 4 * PAGE_BYTES
    assert isinstance(conn.offload({"full": []}, {"full": []}), CompletedTransfer)


# ---- touch, metrics, housekeeping ------------------------------------------------------------------


def test_touch_is_fire_and_forget_and_never_raises(node, connectors) -> None:
    conn = connectors(node.address)
    started = time.monotonic()
    node.pause()
    try:
        conn.touch(chain(3))  # the node does not answer: touch still returns at once
        conn.touch([b"bad"])  # bad input: no exception either
        conn.touch([])
    finally:
        node.resume()
    assert time.monotonic() - started < 2.0
    conn.shutdown()
    conn.touch(chain(1))  # after shutdown too


def test_metrics_take_and_clear_and_byte_counts_are_consistent(node, connectors) -> None:
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    offload_chain(conn, blocks, chain(2))
    taken = conn.take_metrics()
    assert taken.d2h_bytes_copied == 4 * PAGE_BYTES
    assert conn.take_metrics().d2h_bytes_copied == 0
    deadline = time.monotonic() + BOUND
    while conn.host_byte_count.used == 0 and time.monotonic() < deadline:  # refreshed every second
        time.sleep(0.05)
    host = conn.host_byte_count
    assert isinstance(host, ByteCount) and host.total == 64 * 2**20 and host.used > 0
    assert 0 < host.used_pct < 100
    disk = conn.disk_byte_count
    assert (disk.total, disk.used_pct, disk.free_pct) == (0, 0.0, 0.0)


def test_shutdown_and_reset_never_raise_and_leave_no_thread(node, connectors) -> None:
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    offload_chain(conn, blocks, chain(2))
    conn.reset_prefix_cache()
    conn.poll_transfers()
    conn.lookup(chain(1))
    conn.shutdown()
    conn.shutdown()
    conn.reset_prefix_cache()
    conn.poll_transfers()
    assert not [t for t in threading.enumerate() if t.name == "dkv-connector"]


# ---- hints and the directory (real etcd) --------------------------------------------------------


def _cluster(etcd, node_factory, *ids: str):
    return [node_factory(*etcd.node_args(i)) for i in ids]


def _etcd_kwargs(etcd) -> dict:
    return {"etcd": etcd.url, "etcd_prefix": etcd.prefix}


def test_a_hint_naming_a_peer_loads_that_peers_blocks_bit_exact(etcd, node_factory, connectors) -> None:
    a, b = _cluster(etcd, node_factory, "a", "b")
    src = device_blocks(two_leaves())
    engine_a = connectors(a.address, blocks=src, **_etcd_kwargs(etcd))
    hashes = chain(5)
    offload_chain(engine_a, src, hashes)
    dst = device_blocks(two_leaves())
    engine_b = connectors(b.address, blocks=dst, **_etcd_kwargs(etcd))
    hint = routed_hint(engine_b, hashes)
    assert json.loads(hint)["actions"][0]["payload"]["dkv"]["peer_id"] == "a"
    assert engine_b.lookup(hashes) == {"full": [False] * 5, "swa": [False] * 5}, "without the hint: co-located only"
    handle = engine_b.start_lookup(hashes, hint=hint)
    assert answered(handle)["full"] == [True] * 5
    wait(engine_b.load_lookup(handle, {"full": [11, 12, 13, 14, 15]}, {"full": hashes}, hint=hint))
    assert torch.equal(dst[0]["full"][0][11:16], src[0]["full"][0][1:6])
    assert engine_b.counters.hits_peer == 1


def test_unusable_hints_are_counted_misses_by_reason_never_exceptions(etcd, node_factory, connectors) -> None:
    (a,) = _cluster(etcd, node_factory, "solo")
    blocks = device_blocks(two_leaves())
    conn = connectors(a.address, blocks=blocks, **_etcd_kwargs(etcd))
    hashes = chain(3)
    offload_chain(conn, blocks, hashes)
    good = json.loads(routed_hint(conn, hashes))

    def variant(mutate: Callable[[dict], None]) -> bytes:
        doc = json.loads(json.dumps(good))
        mutate(doc)
        return json.dumps(doc).encode()

    def dkv(doc: dict) -> dict:
        return doc["actions"][0]["payload"]["dkv"]

    cases = {
        UNPARSEABLE: b"\xff{not json",
        UNKNOWN_VERSION: variant(lambda d: d.update(protocol_version=7)),
        UNKNOWN_PEER: variant(lambda d: dkv(d).update(peer_id="ghost")),
        STALE_EPOCH: variant(lambda d: dkv(d).update(epoch="0-dead")),
        WRONG_NAMESPACE: variant(lambda d: dkv(d).update(namespace="other/ns")),
        MISMATCH: variant(lambda d: dkv(d).update(deepest_hash="00" * 32)),  # not among the request's blocks
    }
    for reason, hint in cases.items():
        masks = conn.lookup(hashes, hint=hint)
        assert masks["full"] == [True] * 3, f"{reason}: falls back to the co-located node"
        handle = conn.start_lookup(hashes, hint=hint)
        answered(handle)
        conn.abandon_lookup(handle)
        assert conn.counters.unusable_hints[reason] == 2, reason
    max_form = json.dumps({"version": 2, "instances": [{"instance_name": "solo"}]}).encode()
    assert conn.lookup(hashes, hint=max_form)["full"] == [True] * 3
    assert sum(conn.counters.unusable_hints.values()) == 12


async def test_probe_answers_every_replica_from_the_index_without_leases(etcd, node_factory, connectors) -> None:
    (a,) = _cluster(etcd, node_factory, "p")
    leaves = two_leaves()
    blocks = device_blocks(leaves, replicas=2)
    conn = connectors(a.address, leaves=leaves, blocks=blocks, **_etcd_kwargs(etcd))
    hashes = chain(4)
    offload_chain(conn, blocks, hashes[:3])
    routed_hint(conn, hashes[:3])
    answers = conn.probe(hashes, [0, 1])
    assert answers is not None and len(answers) == 2
    for answer in answers:
        assert answer["full"] == [True, True, True, False]
    assert (await node_stats(a.address))["leases"] == 0


def test_probe_is_none_only_without_a_directory(node, connectors) -> None:
    conn = connectors(node.address)
    assert conn.probe(chain(2), [0]) is None


def test_is_a_max_kv_connector_when_max_is_installed(node, connectors) -> None:
    try:
        from max.pipelines.kv_cache.kv_connector import KVConnector
    except ImportError:
        print("skipped: Modular MAX (package max) is not installed here")
        pytest.skip("Modular MAX (package max) is not installed")
    assert isinstance(connectors(node.address), KVConnector)


async def test_bad_block_ids_in_a_load_release_the_lookups_lease(node, connectors) -> None:
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks)
    hashes = chain(2)
    offload_chain(conn, blocks, hashes)
    handle = conn.start_lookup(hashes)
    answered(handle)
    with pytest.raises(ValueError) as refused:
        conn.load_lookup(handle, {"full": [0]}, {"full": hashes[:1]})  # row 0 is the null page
    assert isinstance(refused.value, KVLoadRefused), "an engine's allocator only catches the protocol's two types"
    with pytest.raises(KVLoadRefused, match="replica_idx"):
        conn.load({"full": [1]}, {"full": hashes[:1]}, replica_idx=3)
    conn.lookup(hashes)
    with pytest.raises(KVLoadRefused, match="block id 10000"):
        conn.load({"full": [10_000]}, {"full": hashes[:1]})
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0, "a load refused for bad input must hand the lease back"
