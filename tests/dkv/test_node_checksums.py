"""End-to-end block checksums against real node processes: corrupted or substituted bytes are failed, never delivered.

A block's checksum (:mod:`dkv.checksum`) is computed by its writer, checked by
the node before the block becomes visible, kept beside it (through the disk
tier too) and checked again by every reader on the bytes it received.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from dkv.checksum import block_checksum
from dkv.client import NodeClient, _check_reply
from dkv.errors import ChecksumMismatch, DKVError
from dkv.keys import BlockKey
from tests.conftest import on_ucx, wait_for_stats

BLOCK = 64 * 1024


def _blocks(n: int, size: int = BLOCK) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(32) for _ in range(n)], [os.urandom(size) for _ in range(n)]


def _keys(hashes: list[bytes], leaf: str = "L") -> list[BlockKey]:
    return [BlockKey(leaf, 0, h) for h in hashes]


async def _read(client: Any, hashes: list[bytes], size: int = BLOCK) -> list[bytes]:
    found = await client.lookup(hashes, ["L"])
    assert found.masks["L"] == [True] * len(hashes)
    dests = [bytearray(size) for _ in hashes]
    await client.read(found.lease_id, _keys(hashes), dests)
    return [bytes(d) for d in dests]


async def _read_fails(client: Any, hashes: list[bytes]) -> ChecksumMismatch:
    found = await client.lookup(hashes, ["L"])
    with pytest.raises(ChecksumMismatch) as caught:
        await client.read(found.lease_id, _keys(hashes), [bytearray(BLOCK) for _ in hashes])
    return caught.value


async def _slots(client: NodeClient, hashes: list[bytes], leaf: str = "L") -> list[int]:
    """Where the node keeps these blocks in the client's segment (a same-host read's reply; the read is ended)."""

    async def run(session: Any, lease_id: int) -> list[int]:
        reply = await session.request({"op": "read", "lease": lease_id, "keys": [[leaf, 0, h] for h in hashes],
                                       "end": True, "shm": True}, 10)
        await session.request({"op": "done", "read": reply["read"]}, 10)
        return reply["offsets"]

    async def lookup_and_read() -> list[int]:
        found = await client.lookup(hashes, [leaf])
        return await client._call(lambda session: run(session, found.lease_id), idempotent=False)  # noqa: SLF001

    return await on_ucx(lookup_and_read())


async def _raw_write(client: NodeClient, hashes: list[bytes], sizes: list[int], sums: list[bytes] | None,
                     payloads: list[bytes], *, shm: bool = False) -> dict[str, Any]:
    """A write on the wire as a client that declares ``sums`` and then sends (or copies) ``payloads``."""

    async def run(session: Any) -> dict[str, Any]:
        request = {"op": "write", "keys": [["L", 0, h] for h in hashes], "sizes": sizes, "shm": shm}
        if sums is not None:
            request["sums"] = sums
        reply = await session.request(request, 10)
        assert reply["status"] == ["write"] * len(hashes)
        if shm:
            assert session.mapping is not None and session.mapping.writable
            for offset, payload in zip(reply["offsets"], payloads):
                session.mapping.slot(offset, len(payload))[:] = payload
            return await session.request({"op": "commit", "write": reply["write"]}, 10)
        await session.conn.send_payloads([bytearray(p) for p in payloads], 10)
        return _check_reply(await session.conn.recv_message(10))

    return await on_ucx(client._call(run, idempotent=False))  # noqa: SLF001


# ---- (a) a block changed in the node after its commit -------------------------------------------------


@pytest.mark.parametrize("change", ["bit flip", "another block's bytes"])
async def test_block_changed_in_the_node_after_commit_fails_the_read_on_both_paths(node, clients, change) -> None:
    writer = clients(node.address, local=True)
    hashes, data = _blocks(3)
    assert (await writer.write(_keys(hashes), data)).stored == 3
    assert writer.uses_shared_memory
    offsets = await _slots(writer._target, hashes)  # noqa: SLF001
    slot = writer._target._mapping.slot(offsets[1], BLOCK)  # noqa: SLF001 - behind the node's back
    if change == "bit flip":
        slot[BLOCK // 2] ^= 0x01
    else:
        slot[:] = data[2]  # block 2's exact bytes, served under block 1's key
    for local in (True, False):
        reader = clients(node.address, local=local)
        mismatch = await _read_fails(reader, hashes)
        assert reader.uses_shared_memory is local
        assert mismatch.count == 1 and mismatch.first_key == ("L", 0, hashes[1]), mismatch
        assert hashes[1].hex() in str(mismatch)
    unchecked = clients(node.address, local=False, checksums=False)  # without the check, wrong KV gets through
    assert (await _read(unchecked, hashes))[1] != data[1]


# ---- (b) a listener write whose payload is shorter than declared --------------------------------------


# A payload message that stops within a block's last 7 bytes leaves part of the block's canary looking like
# data (dkv.transport): the transport cannot tell it from a whole block, and the checksum is what catches it.
UNSEEN_SHORT = BLOCK - 3


async def test_listener_write_with_a_short_payload_message_is_refused_and_nothing_is_committed(node, clients) -> None:
    client = clients(node.address, local=False)
    hashes, data = _blocks(1)
    declared = [block_checksum("L", 0, hashes[0], data[0])]
    with pytest.raises(DKVError):  # one byte where a block was due: a protocol error, the node hangs up
        await _raw_write(client._target, hashes, [BLOCK], declared, [data[0][:1]])  # noqa: SLF001
    assert await client.probe(hashes, ["L"]) == {"L": [False]}
    stats = await wait_for_stats(node.address, lambda s: s["reservations"] == 0)
    assert stats["counters"]["commits"] == 0
    assert (await client.write(_keys(hashes), data)).stored == 1  # the key and its slot are free again
    assert await _read(client, hashes) == data


async def test_listener_write_with_a_short_payload_is_not_committed(node, clients) -> None:
    client = clients(node.address, local=False)
    hashes, data = _blocks(1)
    declared = [block_checksum("L", 0, hashes[0], data[0])]  # of the whole block; a few bytes fewer follow
    reply = await _raw_write(client._target, hashes, [BLOCK], declared, [data[0][:UNSEEN_SHORT]])  # noqa: SLF001
    assert (reply["committed"], reply["rejected"]) == (0, 1)
    assert await client.probe(hashes, ["L"]) == {"L": [False]}
    stats = await wait_for_stats(node.address, lambda s: s["reservations"] == 0)
    assert stats["counters"]["checksum_rejects"] == 1 and stats["counters"]["commits"] == 0
    assert (await client.write(_keys(hashes), data)).stored == 1  # the key and its slot are free again
    assert await _read(client, hashes) == data


async def test_without_node_verification_a_short_write_is_stored_and_every_reader_fails_it(node_factory,
                                                                                            clients) -> None:
    node = node_factory("--no-verify-writes")
    client = clients(node.address, local=False)
    hashes, data = _blocks(1)
    declared = [block_checksum("L", 0, hashes[0], data[0])]  # of the whole block; a few bytes fewer follow
    reply = await _raw_write(client._target, hashes, [BLOCK], declared, [data[0][:UNSEEN_SHORT]])  # noqa: SLF001
    assert (reply["committed"], reply["rejected"]) == (1, 0)
    for local in (True, False):
        mismatch = await _read_fails(clients(node.address, local=local), hashes)
        assert mismatch.count == 1


# ---- (c) a wrong declared checksum ----------------------------------------------------------------------


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "listener"])
async def test_write_with_a_wrong_declared_checksum_is_rejected_and_counted(node, clients, shm: bool) -> None:
    client = clients(node.address, local=shm)
    await client.connect()
    hashes, data = _blocks(2)
    sums = [block_checksum("L", 0, hashes[0], data[0]), block_checksum("L", 0, hashes[0], data[1])]  # 2nd: wrong key
    reply = await _raw_write(client._target, hashes, [BLOCK] * 2, sums, data, shm=shm)  # noqa: SLF001
    assert (reply["committed"], reply["rejected"]) == (1, 1)
    assert await client.probe(hashes, ["L"]) == {"L": [True, False]}
    stats = await wait_for_stats(node.address, lambda s: s["reservations"] == 0)
    assert stats["counters"]["checksum_rejects"] == 1 and stats["counters"]["commits"] == 1
    assert await _read(client, hashes[:1]) == data[:1]


async def test_client_whose_bytes_change_before_the_node_sees_them_gets_checksum_mismatch(node, clients,
                                                                                            monkeypatch) -> None:
    """The client raises when the node refuses blocks of its write; what the node did store is intact."""
    client = clients(node.address, local=False)
    hashes, data = _blocks(2)
    real = block_checksum
    monkeypatch.setattr("dkv.client.block_checksum",
                        lambda leaf, shard, h, view: real(leaf, shard, h, b"x" if h == hashes[1] else view))
    with pytest.raises(ChecksumMismatch, match="refused 1 of 2") as caught:
        await client.write(_keys(hashes), data)
    assert caught.value.count == 1
    assert await client.probe(hashes, ["L"]) == {"L": [True, False]}


# ---- writers without checksums -------------------------------------------------------------------------


async def test_write_without_checksums_is_stored_counted_and_failed_by_checking_readers(node, clients) -> None:
    old = clients(node.address, local=False, checksums=False)
    hashes, data = _blocks(2)
    assert (await old.write(_keys(hashes), data)).stored == 2
    stats = await wait_for_stats(node.address, lambda s: s["reservations"] == 0)
    assert stats["counters"]["unverified_commits"] == 2 and stats["counters"]["checksum_rejects"] == 0
    assert await _read(old, hashes) == data  # a reader that does not check reads them as before
    mismatch = await _read_fails(clients(node.address, local=False), hashes)
    assert mismatch.count == 2 and "without one" in str(mismatch)


# ---- honest traffic, through the disk tier -------------------------------------------------------------


async def test_blocks_spilled_to_disk_and_promoted_back_keep_their_checksum(node_factory, clients, tmp_path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    node = node_factory("--disk", str(spill), "--disk-size", str(64 * BLOCK), pool=str(16 * BLOCK))
    client = clients(node.address, local=False)
    hashes, data = _blocks(40)
    for i in range(0, 40, 8):
        assert (await client.write(_keys(hashes[i:i + 8]), data[i:i + 8])).stored == 8
    stats = await wait_for_stats(node.address, lambda s: s["staging"]["blocks"] == 0 and s["counters"]["spills"] > 0)
    assert stats["counters"]["spills"] > 0, stats
    for i in range(0, 40, 4):  # oldest first: these come back from disk
        assert await _read(client, hashes[i:i + 4]) == data[i:i + 4]
    stats = await wait_for_stats(node.address, lambda s: s["counters"]["disk_hits"] > 0)
    assert stats["counters"]["disk_hits"] > 0 and stats["counters"]["checksum_rejects"] == 0


async def test_honest_blocks_of_every_shape_read_back_exactly_on_both_paths(node, clients) -> None:
    sizes = [0, 1, 4095, 4096, BLOCK, 3 * BLOCK + 17]
    hashes = [os.urandom(8) for _ in sizes]
    data = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)]
    writer = clients(node.address, local=True)
    assert (await writer.write(_keys(hashes), data)).stored == len(sizes)
    for local in (True, False):
        reader = clients(node.address, local=local)
        found = await reader.lookup(hashes, ["L"])
        dests = [np.empty(n, np.uint8) for n in sizes]
        await reader.read(found.lease_id, _keys(hashes), dests)
        assert all(np.array_equal(d, want) for d, want in zip(dests, data))
