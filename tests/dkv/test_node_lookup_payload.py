"""A leased lookup that asks for its blocks' bytes (``send``) gets them with its answer: real node processes.

The node reads every leased block as a read that ends the lease would, sends
them after its answer (over UCX, or the node's TCP control socket where the
client asks there), and holds nothing for the lease afterwards; the
client checks each block as it lands and copies them for the lease's load
with no request (see :mod:`dkv.wire`). Where the node does not send (more
bytes than asked, a block without a checksum, the same-host path, a node
that never sends), the load takes the two-step read as before.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace
from typing import Any

import pytest

import dkv.client
from dkv import transport
from dkv.client import NodeClient
from dkv.errors import LeaseExpired, ProtocolError
from dkv.keys import BlockKey
from tests.conftest import node_stats

BLOCK = 16 * 1024
ASK = 1 << 20


async def _store(client: Any, leaves: dict[str, list[bytes]], shards: int = 1) -> dict[BlockKey, bytes]:
    """Write each leaf's hashes (every shard); returns every key with its bytes (sizes differ by leaf)."""
    data = {}
    for n, (leaf, hashes) in enumerate(leaves.items()):
        for shard in range(shards):
            for h in hashes:
                data[BlockKey(leaf, shard, h)] = os.urandom(BLOCK + 512 * n)
    result = await client.write(list(data), list(data.values()))
    assert result.stored == len(data)
    return data


async def _read(reader: Any, lease_id: int, keys: list[BlockKey], data: dict[BlockKey, bytes]) -> None:
    """Read ``keys`` under ``lease_id`` and check every byte."""
    dests = [bytearray(len(data[k])) for k in keys]
    await reader.read(lease_id, keys, dests)
    assert [bytes(d) for d in dests] == [data[k] for k in keys]


@pytest.fixture
def payload_receives(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every payload receive this process's UCX connections post (the blocks not in an answer's own message)."""
    posted: list[Any] = []
    real_recv_payloads = transport.Connection.recv_payloads

    async def recv_payloads(self: Any, *args: Any, **kwargs: Any) -> None:
        posted.append(args)
        await real_recv_payloads(self, *args, **kwargs)

    monkeypatch.setattr(transport.Connection, "recv_payloads", recv_payloads)
    return posted


@pytest.mark.parametrize("way", ["ucx-in-the-answer-s-message", "ucx-after-the-answer", "tcp-control-socket"])
async def test_a_lookup_that_asks_gets_its_blocks_and_their_load_asks_nothing_more(node_factory, clients, monkeypatch,
                                                                                  payload_receives: list[Any],
                                                                                  way: str) -> None:
    """Over UCX the blocks come in the answer's own message where the client made room, else as payload messages
    after it; over the node's TCP control socket, right after the answer on the stream."""
    node = node_factory(*(() if way == "tcp-control-socket" else ("--peer-control-port", "off")))
    if way == "ucx-after-the-answer":
        monkeypatch.setattr(dkv.client, "TRAILING_MAX", 0)  # the client makes no room: the node sends them after
    writer = clients(node.address)
    h = [os.urandom(32) for _ in range(5)]
    # two leaves, two shards; "b" lacks h[1] and h[3] (not a prefix): the blocks come leaf by leaf,
    # hash by hash where the mask is set, shard by shard
    data = await _store(writer, {"a": h, "b": [h[0], h[2], h[4]]}, shards=2)
    reader = clients(node.address, local=False)
    found = await reader.lookup(h, ["a", "b"], 2, send=ASK)
    assert found.received and found.rejected == 0
    assert found.masks == {"a": [True] * 5, "b": [True, False, True, False, True]}
    assert len(payload_receives) == (1 if way == "ucx-after-the-answer" else 0)
    assert bool(reader._target._control_idle) == (way == "tcp-control-socket")  # noqa: SLF001 - where it was asked
    stats = await node_stats(node.address)
    assert stats["lookups_with_payload"] == 1
    assert stats["leases"] == 0 and stats["reads"] == 0 and stats["pinned_blocks"] == 0  # nothing held for it
    reads_before = stats["ops"].get("read", 0)

    keys = [k for k in data if not (k.leaf == "a" and k.hash == h[4])]
    random.Random(7).shuffle(keys)  # any order, any subset of what the lease holds
    await _read(reader, found.lease_id, keys, data)
    assert reader.fast_reads == 1 and reader.lookups_with_payload == 1
    stats = await node_stats(node.address)
    assert stats["ops"].get("read", 0) == reads_before and stats["ops"].get("end", 0) == 0  # no request at all


@pytest.mark.parametrize("way", ["ucx", "tcp-control-socket"])
async def test_a_one_shard_lookup_s_lease_becomes_the_read_that_sends_its_blocks_a_repeated_hash_at_each_place(
        node_factory, clients, way: str) -> None:
    """One shard: the node hands the lease's pins to the read (Store.lease_into_read); the blocks still come in the
    lookup's order, leaf by leaf, hash by hash where the mask is set, a hash named twice at each of its places."""
    node = node_factory(*(() if way == "tcp-control-socket" else ("--peer-control-port", "off")))
    writer = clients(node.address)
    h = [os.urandom(32) for _ in range(4)]
    data = await _store(writer, {"a": h, "b": [h[0], h[2], h[3]]})
    reader = clients(node.address, local=False)
    looked_up = [h[0], h[1], h[0], h[2], h[3]]
    found = await reader.lookup(looked_up, ["a", "b"], send=ASK)
    assert found.received and found.rejected == 0
    assert found.masks == {"a": [True] * 5, "b": [True, False, True, True, True]}
    stats = await node_stats(node.address)
    assert stats["lookups_with_payload"] == 1
    assert stats["leases"] == 0 and stats["reads"] == 0 and stats["pinned_blocks"] == 0  # nothing held for it
    keys = [BlockKey(leaf, 0, x) for leaf in ("b", "a") for x in reversed(looked_up) if BlockKey(leaf, 0, x) in data]
    await _read(reader, found.lease_id, keys, data)
    assert reader.fast_reads == 1


async def test_an_answer_too_large_to_carry_its_blocks_sends_them_after_it_though_the_client_made_room(
        node_factory, clients, monkeypatch, payload_receives: list[Any]) -> None:
    """1,024 small blocks: their sizes and checksums make the answer's body larger than an inline one (over UCX)."""
    node = node_factory("--peer-control-port", "off")
    writer = clients(node.address)
    h = [os.urandom(32) for _ in range(1024)]
    data = {BlockKey("a", 0, x): os.urandom(64) for x in h}
    assert (await writer.write(list(data), list(data.values()))).stored == len(data)
    reader = clients(node.address, local=False)
    asked = []
    real_request_with = dkv.client._Session.request_with

    async def request_with(self: Any, message: dict[str, Any], *args: Any) -> Any:
        asked.append(message.get("inline_sent"))
        return await real_request_with(self, message, *args)

    monkeypatch.setattr(dkv.client._Session, "request_with", request_with)
    found = await reader.lookup(h, ["a"], send=ASK)
    assert asked == [True] and found.received and len(payload_receives) == 1
    keys = list(data)
    random.Random(5).shuffle(keys)
    await _read(reader, found.lease_id, keys, data)
    assert reader.fast_reads == 1


async def test_blocks_over_what_was_asked_for_are_not_sent_and_load_the_two_step_way(node, clients) -> None:
    writer = clients(node.address)
    h = [os.urandom(32) for _ in range(4)]
    data = await _store(writer, {"a": h})
    reader = clients(node.address, local=False)
    found = await reader.lookup(h, ["a"], send=4 * BLOCK - 1)
    assert not found.received and found.masks == {"a": [True] * 4}
    stats = await node_stats(node.address)
    assert stats["leases"] == 1 and stats["lookups_with_payload"] == 0 and stats["reads"] == 0
    await _read(reader, found.lease_id, list(data), data)
    stats = await node_stats(node.address)
    assert stats["ops"]["read"] == 1 and reader.fast_reads == 0 and stats["leases"] == 0


async def test_a_node_with_max_lookup_payload_zero_never_sends(node_factory, clients) -> None:
    node = node_factory("--max-lookup-payload", "0")
    writer = clients(node.address)
    h = [os.urandom(32)]
    data = await _store(writer, {"a": h})
    reader = clients(node.address, local=False)
    found = await reader.lookup(h, ["a"], send=ASK)
    assert not found.received and (await node_stats(node.address))["leases"] == 1
    await _read(reader, found.lease_id, list(data), data)


async def test_blocks_stored_without_a_checksum_are_not_sent(node, clients) -> None:
    writer = clients(node.address, checksums=False)
    h = [os.urandom(32) for _ in range(2)]
    await _store(writer, {"a": h})
    reader = clients(node.address, local=False)
    found = await reader.lookup(h, ["a"], send=ASK)
    assert not found.received and found.masks == {"a": [True, True]}
    stats = await node_stats(node.address)
    assert stats["lookups_with_payload"] == 0 and stats["leases"] == 1 and stats["reads"] == 0
    assert await reader.release(found.lease_id) is True


async def test_a_reader_without_checksums_or_on_the_same_host_path_does_not_ask(node, clients) -> None:
    writer = clients(node.address)
    h = [os.urandom(32)]
    data = await _store(writer, {"a": h})
    for reader in (clients(node.address, local=False, checksums=False), clients(node.address, local=True)):
        found = await reader.lookup(h, ["a"], send=ASK)
        assert not found.received and found.masks == {"a": [True]}
        await _read(reader, found.lease_id, list(data), data)
    assert (await node_stats(node.address))["lookups_with_payload"] == 0


async def test_releasing_a_lease_whose_blocks_came_with_the_answer_sends_nothing(node, clients) -> None:
    writer = clients(node.address)
    h = [os.urandom(32)]
    await _store(writer, {"a": h})
    reader = clients(node.address, local=False)
    found = await reader.lookup(h, ["a"], send=ASK)
    assert found.received
    assert await reader.release(found.lease_id) is False  # the node ended it when it sent the blocks
    assert (await node_stats(node.address))["ops"].get("release", 0) == 0
    with pytest.raises(LeaseExpired):  # its bytes are gone with it: a read asks the node, which refuses
        await reader.read(found.lease_id, [BlockKey("a", 0, h[0])], [bytearray(BLOCK)])


async def test_the_bytes_a_client_holds_for_loads_to_come_are_bounded(node, clients, monkeypatch) -> None:
    monkeypatch.setattr(dkv.client, "MAX_RECEIVED_BYTES", 3 * BLOCK)
    writer = clients(node.address)
    h = [os.urandom(32) for _ in range(4)]
    data = await _store(writer, {"a": h})
    reader = clients(node.address, local=False)
    first = await reader.lookup(h[:2], ["a"], send=ASK, group=1)
    assert first.received
    second = await reader.lookup(h[2:], ["a"], send=ASK, group=2)  # room for one block: asks for one, gets none
    assert not second.received
    await _read(reader, first.lease_id, [BlockKey("a", 0, x) for x in h[:2]], data)  # its bytes leave the book
    third = await reader.lookup(h[2:], ["a"], send=ASK, group=2)
    assert third.received
    await _read(reader, third.lease_id, [BlockKey("a", 0, x) for x in h[2:]], data)


class _LyingConn:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    async def recv_payloads(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("no receive may be posted for an answer that does not match its request")


@pytest.mark.parametrize("sent", [
    {"sizes": [BLOCK, BLOCK], "sums": [b"s" * 16] * 2, "groups": [2]},  # more bytes than asked for
    {"sizes": [BLOCK], "sums": [b"s" * 16], "groups": [1]},  # fewer blocks than the masks say
    {"sizes": [BLOCK, True], "sums": [b"s" * 16] * 2, "groups": [2]},  # not a size
    {"sizes": [1, 1], "sums": [b"s" * 16, None], "groups": [2]},  # a block without a checksum
    {"sizes": [1, 1], "sums": [b"s" * 15] * 2, "groups": [2]},  # not a checksum
    ["not", "a", "map"],
], ids=["too-many-bytes", "too-few-blocks", "bool-size", "no-checksum", "short-checksum", "not-a-map"])
async def test_an_answer_whose_sent_blocks_do_not_match_the_request_is_a_protocol_error(sent: Any) -> None:
    client = NodeClient("127.0.0.1:1", "ns")
    conn = _LyingConn()

    async def request(message: dict[str, Any], timeout: float) -> dict[str, Any]:
        return {"ok": True, "masks": {"a": b"\x01\x01"}, "lease": 7, "ttl": 10.0, "sent": sent}

    session = SimpleNamespace(mapping=None, conn=conn, request=request)
    message = {"op": "lookup", "hashes": [b"h" * 32, b"i" * 32], "leaves": ["a"], "shards": 1, "lease": True,
               "group": 0, "send": 2 * BLOCK - 1}
    with pytest.raises(ProtocolError, match="do not match the request"):
        await client._leased_lookup(session, message)  # noqa: SLF001
    assert conn.aborted
    assert client._lease_slots == {} and client._received_bytes == 0  # noqa: SLF001


async def test_an_answer_with_sent_blocks_but_no_lease_is_a_protocol_error() -> None:
    client = NodeClient("127.0.0.1:1", "ns")
    conn = _LyingConn()

    async def request(message: dict[str, Any], timeout: float) -> dict[str, Any]:
        return {"ok": True, "masks": {"a": b"\x01"}, "lease": None, "ttl": 10.0,
                "sent": {"sizes": [1], "sums": [b"s" * 16], "groups": [1]}}

    session = SimpleNamespace(mapping=None, conn=conn, request=request)
    message = {"op": "lookup", "hashes": [b"h" * 32], "leaves": ["a"], "shards": 1, "lease": True, "group": 0,
               "send": ASK}
    with pytest.raises(ProtocolError):
        await client._leased_lookup(session, message)  # noqa: SLF001
    assert conn.aborted


class _TrailingConn(transport.Connection):
    """A UCX connection's stand-in (the client makes room in its answers only on UCX connections)."""

    def __init__(self) -> None:  # (no endpoint: nothing here reaches UCX)
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("sent, trailing", [
    ({"sizes": [BLOCK, BLOCK], "sums": [b"s" * 16] * 2, "groups": [2]}, b"x" * (2 * BLOCK - 1)),  # short
    ({"sizes": [BLOCK, BLOCK], "sums": [b"s" * 16] * 2, "groups": [2]}, b"x" * (2 * BLOCK + 1)),  # long
    (None, b"x" * BLOCK),  # bytes the answer does not name
], ids=["fewer-bytes-than-named", "more-bytes-than-named", "bytes-without-sent"])
async def test_an_answer_whose_own_message_carries_other_bytes_than_it_names_is_a_protocol_error(
        sent: Any, trailing: bytes) -> None:
    client = NodeClient("127.0.0.1:1", "ns")
    conn = _TrailingConn()

    async def request_with(message: dict[str, Any], room: int, timeout: float) -> tuple[dict[str, Any], memoryview]:
        assert room == message["send"]
        reply = {"ok": True, "masks": {"a": b"\x01\x01"}, "lease": 7, "ttl": 10.0}
        if sent is not None:
            reply["sent"] = sent
        return reply, memoryview(trailing)

    session = SimpleNamespace(mapping=None, conn=conn, request_with=request_with)
    message = {"op": "lookup", "hashes": [b"h" * 32, b"i" * 32], "leaves": ["a"], "shards": 1, "lease": True,
               "group": 0, "send": ASK}
    with pytest.raises(ProtocolError):
        await client._leased_lookup(session, message)  # noqa: SLF001
    assert conn.aborted
    assert client._lease_slots == {} and client._received_bytes == 0  # noqa: SLF001
