"""Connector loads check every block's end-to-end checksum: a corrupted block is a failed load, never wrong KV."""

from __future__ import annotations

import os
import time

import pytest
import torch

from connector.types import KVLoadFailed, KVLoadRefused
from tests.conftest import node_stats
from tests.connector.conftest import NAMESPACE, PAGE_BYTES, device_blocks, two_leaves
from tests.dkv.test_node_checksums import _slots

BOUND = 20.0


def _wait(transfer) -> None:
    deadline = time.monotonic() + BOUND
    while not transfer.is_complete():
        assert time.monotonic() < deadline, "transfer did not settle within the bound"
        time.sleep(0.002)


def _offload(conn, blocks, hashes: list[bytes], ids: list[int]) -> None:
    for leaf in blocks[0]:
        for tensor in blocks[0][leaf]:
            tensor[ids] = torch.randint(0, 256, (len(ids), tensor.shape[1]), dtype=torch.uint8)
    _wait(conn.offload({leaf: ids for leaf in blocks[0]}, {leaf: hashes for leaf in blocks[0]}))


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
async def test_load_of_a_corrupted_block_fails_and_is_counted_and_an_honest_load_is_bit_exact(
        node, connectors, clients, local: bool) -> None:
    src = device_blocks(two_leaves())
    writer = connectors(node.address, blocks=src)
    hashes = [os.urandom(32) for _ in range(4)]
    _offload(writer, src, hashes, ids=[1, 2, 3, 4])
    dst = device_blocks(two_leaves())
    # listener: the load reads from the node (a lookup that brings the bytes: the next test)
    reader = connectors(node.address, blocks=dst, local=local, lookup_payload_bytes=0)

    # honest: bit-exact
    assert reader.lookup(hashes) == {"full": [True] * 4, "swa": [True] * 4}
    _wait(reader.load({"full": [10, 11, 12, 13]}, {"full": hashes}))
    assert torch.equal(dst[0]["full"][0][10:14], src[0]["full"][0][1:5])
    assert reader.counters.checksum_failures == 0

    # one byte of "full"'s third block changes in the node, behind its back
    raw = clients(node.address, namespace=NAMESPACE, local=True)
    offset = (await _slots(raw._target, hashes[2:3], leaf="full"))[0]  # noqa: SLF001
    raw._target._mapping.slot(offset, PAGE_BYTES)[7] ^= 0xFF  # noqa: SLF001

    assert reader.lookup(hashes)["full"] == [True] * 4
    transfer = reader.load({"full": [20, 21, 22, 23]}, {"full": hashes})
    with pytest.raises(KVLoadFailed, match="checksum") as caught:
        _wait(transfer)
    assert hashes[2].hex() in str(caught.value)
    with pytest.raises(KVLoadFailed):
        transfer.is_complete()  # every later poll reports it too
    assert reader.counters.checksum_failures == 1 and reader.counters.loads_failed == 1

    # the uncorrupted leaf still loads exactly
    assert reader.lookup(hashes)["swa"] == [True] * 4
    _wait(reader.load({"swa": [24, 25, 26, 27]}, {"swa": hashes}))
    assert torch.equal(dst[0]["swa"][0][24:28], src[0]["swa"][0][1:5])
    assert reader.counters.checksum_failures == 1


async def test_a_corrupted_block_sent_with_a_lookup_s_answer_is_reported_absent_and_counted(
        node, connectors, clients) -> None:
    src = device_blocks(two_leaves())
    writer = connectors(node.address, blocks=src)
    hashes = [os.urandom(32) for _ in range(4)]
    _offload(writer, src, hashes, ids=[1, 2, 3, 4])
    dst = device_blocks(two_leaves())
    reader = connectors(node.address, blocks=dst, local=False)

    # honest: the bytes come with the answer, and the load copies them, bit-exact
    assert reader.lookup(hashes) == {"full": [True] * 4, "swa": [True] * 4}
    _wait(reader.load({"full": [10, 11, 12, 13]}, {"full": hashes}))
    assert torch.equal(dst[0]["full"][0][10:14], src[0]["full"][0][1:5])
    assert reader.counters.loads_in_place == 1 and reader.counters.checksum_failures == 0

    # one byte of "full"'s third block changes in the node, behind its back
    raw = clients(node.address, namespace=NAMESPACE, local=True)
    offset = (await _slots(raw._target, hashes[2:3], leaf="full"))[0]  # noqa: SLF001
    raw._target._mapping.slot(offset, PAGE_BYTES)[7] ^= 0xFF  # noqa: SLF001

    # that block is a miss, counted; nothing of it reaches a row, and the rest still loads exactly
    assert reader.lookup(hashes) == {"full": [True, True, False, True], "swa": [True] * 4}
    assert reader.counters.checksum_failures == 1
    with pytest.raises(KVLoadRefused):
        reader.load({"full": [20, 21, 22]}, {"full": hashes[:3]})
    assert not dst[0]["full"][0][20:23].any()
    assert reader.lookup(hashes)["full"] == [True, True, False, True]
    _wait(reader.load({"full": [24, 25], "swa": [26, 27, 28, 29]}, {"full": hashes[:2], "swa": hashes}))
    assert torch.equal(dst[0]["full"][0][24:26], src[0]["full"][0][1:3])
    assert torch.equal(dst[0]["swa"][0][26:30], src[0]["swa"][0][1:5])
    assert reader.counters.checksum_failures == 2 and reader.counters.loads_failed == 0


async def test_offloads_declare_checksums_the_node_checks(node, connectors) -> None:
    src = device_blocks(two_leaves())
    writer = connectors(node.address, blocks=src)
    _offload(writer, src, [os.urandom(32) for _ in range(3)], ids=[1, 2, 3])
    assert writer.counters.blocks_offloaded == 6 and writer.counters.offloads_failed == 0
    stats = await node_stats(node.address)
    assert stats["counters"]["unverified_commits"] == 0 and stats["counters"]["checksum_rejects"] == 0
