"""A client's direct channel (NodeClient.lookup_direct) against real node processes: same-host and over TCP.

The direct channel is one more control connection of the client, handshaken on
the loop like the others, then driven from the calling thread. These pin that
it answers exactly as a lookup on the loop does (masks, lease, slot map, the
carried lease ends), that it belongs to the client (its leases are the
client's while any connection is open), and that every way it can end — the
node closing it, a hung node, a node without a TCP control port — costs a
bounded error the caller can act on, never a lost lease end or a hang. On the
listener path it is the node's TCP control socket, and a lookup that asks for
its blocks gets them after the answer on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from dkv.checksum import block_checksum
from dkv.client import DIRECT_RETRY_AFTER, DIRECT_RETRY_MAX, NodeClient, NodeInfo, _Session
from dkv.direct_channel import ChannelBusy, ChannelClosed, DirectChannel, _peer_closed
from dkv.errors import ChecksumMismatch, ConfigError, NodeBusy, OpTimeout, ProtocolError, RemoteError
from dkv.wire import HEADER_SIZE, decode_body, decode_header, encode_body, encode_header
from dkv.keys import BlockKey
from dkv.lease_slots import RowRun
from tests.conftest import node_stats, wait_for_stats
from tests.ports import on_a_free_port

BLOCK = 64 * 1024
HELD = 8

pytestmark = pytest.mark.timeout(120)


async def _stored(writer: object) -> tuple[list[bytes], list[bytes]]:
    hashes = [os.urandom(32) for _ in range(HELD)]
    data = [os.urandom(BLOCK) for _ in range(HELD)]
    result = await writer.write([BlockKey("L", 0, h) for h in hashes], data)  # type: ignore[attr-defined]
    assert result.stored == HELD
    return hashes, data


@dataclass
class Held:
    """A node holding ``HELD`` blocks, and a same-host reader of it with its direct channel open."""

    node: Any
    hashes: list[bytes]
    data: list[bytes]
    reader: Any  # the test's proxy (coroutines on the UCX loop)
    raw: NodeClient  # the client behind it: lookup_direct runs on the calling thread, as the connector calls it


async def _held(node_factory: Any, clients: Any, *node_args: str, **reader_kwargs: Any) -> Held:
    node = node_factory("--pool", "16MiB", *node_args)
    hashes, data = await _stored(clients(node.address, local=False))
    reader = clients(node.address, local=True, **reader_kwargs)
    await reader.connect()
    assert await reader.open_direct()
    return Held(node, hashes, data, reader, reader._target)  # noqa: SLF001


async def test_a_direct_lookup_answers_as_a_lookup_does_and_its_load_takes_no_round_trip(
        node_factory, clients, monkeypatch) -> None:
    monkeypatch.setattr("dkv.client.END_FLUSH_DELAY", 600.0)  # a loaded lease ends only with the next request
    held = await _held(node_factory, clients)
    node, hashes, data, reader, raw = held.node, held.hashes, held.data, held.reader, held.raw
    assert raw.direct_ready and raw.direct_open == 1

    found = raw.lookup_direct(hashes + [os.urandom(32)], ["L", "other"], group=1)
    assert found.masks == {"L": [True] * HELD + [False], "other": [False] * (HELD + 1)}
    assert found.lease_id is not None
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
    assert [bytes(d) for d in dests] == data
    assert raw.fast_reads == 1  # copied under the direct lookup's lease, from its slot map
    stats = await node_stats(node.address)
    assert stats["ops"]["lookup"] == 1 and "read" not in stats["ops"], stats["ops"]
    assert stats["leases"] == 1, stats  # the loaded lease waits for the next request to end it

    again = raw.lookup_direct(hashes[:2], ["L"], group=2)  # another group: only the carried end ends the first
    stats = await node_stats(node.address)
    assert stats["leases"] == 1 and stats["pinned_blocks"] == 2, stats  # only the new lookup's lease
    assert "end" not in stats["ops"], stats["ops"]
    assert await reader.release(again.lease_id)


async def test_the_direct_channel_is_the_clients_own_connection_for_its_leases(node_factory, clients) -> None:
    held = await _held(node_factory, clients)
    node, hashes, reader, raw = held.node, held.hashes, held.reader, held.raw
    generation = raw.lease_generation
    found = raw.lookup_direct(hashes, ["L"], group=1)
    assert found.lease_id is not None
    before = (await node_stats(node.address))["connections"]
    pooled = list(raw._idle)  # noqa: SLF001 - every pooled connection closes; the direct one stays
    assert pooled
    for session in pooled:
        session.conn.abort()
    stats = await wait_for_stats(node.address, lambda s: s["connections"] <= before - len(pooled))
    assert stats["connections"] <= before - len(pooled), "the node never saw the pooled connections close"
    assert stats["leases"] == 1, "the node ended a lease while the client still had a connection open"
    assert not raw.leases_lost_since(generation)
    await reader.close()  # the last connection: the node ends the client's leases
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0, stats


async def test_a_listener_client_opens_its_direct_channel_on_the_nodes_tcp_control_port(node_factory, clients) -> None:
    port, node = on_a_free_port(lambda port: node_factory("--pool", "16MiB", "--peer-control-port", str(port)))
    hashes, data = await _stored(clients(node.address, local=False))
    reader = clients(node.address, local=False)
    await reader.connect()
    raw = reader._target  # noqa: SLF001
    assert not raw.uses_shared_memory and raw.direct_possible
    assert await reader.open_direct()
    assert raw._direct.conn.peer == f"tcp:127.0.0.1:{port}"  # noqa: SLF001 - the port the node was told to use
    keys = [BlockKey("L", 0, h) for h in hashes]

    # asking for no bytes: a lease, whose read goes over UCX (two steps)
    found = raw.lookup_direct(hashes + [os.urandom(32)], ["L"], group=1)
    assert found.masks == {"L": [True] * HELD + [False]} and found.lease_id is not None and not found.received
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.read(found.lease_id, keys, dests)
    assert [bytes(d) for d in dests] == data
    stats = await node_stats(node.address)
    assert stats["ops"]["lookup"] == 1 and stats["ops"]["read"] == 1, stats["ops"]

    # asking for them: they follow the answer on the channel, checked, and the read needs no request
    found = raw.lookup_direct(hashes, ["L"], group=2, send=HELD * BLOCK)
    assert found.masks == {"L": [True] * HELD} and found.received and found.rejected == 0
    assert raw.lookups_with_payload == 1
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.read(found.lease_id, keys, dests)
    assert [bytes(d) for d in dests] == data
    stats = await node_stats(node.address)
    assert stats["ops"]["lookup"] == 2 and stats["ops"]["read"] == 1, stats["ops"]
    assert stats["leases"] == 0, stats  # the node ended the lease as it sent them

    # asking for fewer bytes than the blocks come to: a lease, as without
    found = raw.lookup_direct(hashes, ["L"], group=3, send=BLOCK)
    assert found.masks == {"L": [True] * HELD} and not found.received
    assert await reader.release(found.lease_id)
    assert raw._direct.conn.exchanges == 3 and raw.direct_ready  # noqa: SLF001 - in step all along


async def test_a_node_with_its_tcp_control_port_off_leaves_listener_lookups_on_the_loop(node_factory, clients) -> None:
    node = node_factory("--pool", "16MiB", "--peer-control-port", "off")
    reader = clients(node.address, local=False)
    await reader.connect()
    raw = reader._target  # noqa: SLF001
    assert not raw.direct_possible
    assert not await reader.open_direct()
    with pytest.raises(ChannelClosed):
        raw.lookup_direct([os.urandom(32)], ["L"])


async def test_a_same_host_client_opens_its_direct_channel_on_the_unix_control_socket(node_factory, clients) -> None:
    held = await _held(node_factory, clients)
    assert held.raw._direct.conn.peer.startswith("local:")  # noqa: SLF001 - not the TCP one the node announces too


async def test_a_direct_channel_the_node_closed_is_found_out_before_sending_and_no_end_is_lost(
        node_factory, clients, monkeypatch) -> None:
    monkeypatch.setattr("dkv.client.END_FLUSH_DELAY", 600.0)
    monkeypatch.setattr("dkv.client.DIRECT_RETRY_AFTER", 0.0)
    held = await _held(node_factory, clients, "--idle-timeout", "0.5")
    node, hashes, reader, raw = held.node, held.hashes, held.reader, held.raw
    found = await reader.lookup(hashes, ["L"], group=1)  # on the loop; held by the client's pooled connection
    dests = [bytearray(BLOCK) for _ in range(HELD)]
    await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
    assert raw.fast_reads == 1 and raw._ends == [found.lease_id]  # noqa: SLF001 - its end waits for a request
    # the direct channel is the reader's connection idle longest, and not its last: the node closes it
    deadline = time.monotonic() + 30
    while not _peer_closed(raw._direct.conn._sock):  # noqa: SLF001 - a peek, as the exchange's own
        assert time.monotonic() < deadline, "the node never closed the idle direct channel"
        await asyncio.sleep(0.1)
    with pytest.raises(ChannelClosed):
        raw.lookup_direct(hashes, ["L"], group=2)
    assert raw._ends == [found.lease_id], "an end the node never saw was dropped"  # noqa: SLF001
    assert not raw.direct_ready and raw.direct_possible
    assert await reader.open_direct()  # a new one opens
    again = raw.lookup_direct(hashes, ["L"], group=2)  # and carries the end this time
    assert raw._ends == []  # noqa: SLF001
    stats = await node_stats(node.address)
    assert stats["leases"] == 1, stats  # the loaded lease ended; the new lookup's holds
    assert await reader.release(again.lease_id)


def _answered(pending: Any) -> Any:
    """Poll a begun direct lookup until it answers (each poll reads what arrived, never blocking)."""
    deadline = time.monotonic() + 30
    while (result := pending.poll()) is None:
        assert time.monotonic() < deadline, "the begun lookup never answered"
        time.sleep(0.001)
    return result


@pytest.mark.parametrize("listener", [False, True], ids=["same-host", "listener"])
async def test_a_lookup_that_finds_every_channel_busy_is_not_sent_and_one_more_channel_takes_it(
        node_factory, clients, listener) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, data = await _stored(clients(node.address, local=False))
    reader = clients(node.address, local=not listener, direct_channels=2)
    await reader.connect()
    assert await reader.open_direct()
    raw = reader._target  # noqa: SLF001
    first = raw.start_lookup_direct(hashes, ["L"], group=1)  # holds the one channel until its answer is read
    with pytest.raises(ChannelBusy):
        raw.start_lookup_direct(hashes, ["L"], group=2)
    with pytest.raises(ChannelBusy):
        raw.lookup_direct(hashes, ["L"], group=2)
    raw._direct_tried_at = -1e9  # noqa: SLF001 - as if the wait between attempts had passed
    assert raw.direct_possible  # one more may open: one of two is
    reader.want_direct()
    deadline = time.monotonic() + 30
    while raw.direct_open < 2:
        assert time.monotonic() < deadline, "the second channel never opened"
        await asyncio.sleep(0.01)
    second = raw.start_lookup_direct(hashes, ["L"], group=2)  # on the second channel, the first still held
    with pytest.raises(ChannelBusy):
        raw.start_lookup_direct(hashes, ["L"], group=3)
    raw._direct_tried_at = -1e9  # noqa: SLF001
    assert not raw.direct_possible  # at the cap
    assert not await reader.open_direct(another=True)
    assert raw.direct_open == 2
    answers = [_answered(second), _answered(first)]  # read in either order: each channel its own stream
    for answer in answers:
        assert answer.masks == {"L": [True] * HELD}
    assert answers[0].lease_id != answers[1].lease_id
    stats = await node_stats(node.address)
    assert stats["leases"] == 2 and stats["ops"]["lookup"] == 2, stats
    for answer in answers:  # each lease loads what it found
        dests = [bytearray(BLOCK) for _ in range(HELD)]
        await reader.read(answer.lease_id, [BlockKey("L", 0, h) for h in hashes], dests)
        assert [bytes(d) for d in dests] == data
    third = raw.lookup_direct(hashes[:1], ["L"], group=3)  # both answered: the channels are free again
    assert third.masks == {"L": [True]}
    await reader.release(third.lease_id)


@pytest.mark.parametrize("channels", [0, -2])
def test_a_client_needs_at_least_one_direct_channel(channels: int) -> None:
    with pytest.raises(ConfigError, match="direct_channels"):
        NodeClient("127.0.0.1:1", "ns", direct_channels=channels)


async def test_a_closed_direct_channel_is_forgotten_and_another_opens_in_its_place(node_factory, clients) -> None:
    held = await _held(node_factory, clients, direct_channels=2)
    hashes, reader, raw = held.hashes, held.reader, held.raw
    generation = raw.lease_generation
    assert await reader.open_direct(another=True)
    assert raw.direct_open == 2
    first = raw._direct.conn  # noqa: SLF001
    found = raw.lookup_direct(hashes, ["L"], group=1)
    first.abort()  # the first goes: the second serves, and the lease stays (the client has connections open)
    assert raw.direct_open == 1 and raw._direct.conn is not first  # noqa: SLF001
    again = raw.lookup_direct(hashes, ["L"], group=2)
    assert again.masks == {"L": [True] * HELD}
    assert not raw.leases_lost_since(generation)
    assert await reader.open_direct(another=True)  # one opens in its place: the closed one no longer counts
    assert raw.direct_open == 2 and len(raw._directs) == 2  # noqa: SLF001
    assert await reader.release(found.lease_id) and await reader.release(again.lease_id)


async def test_failed_attempts_at_a_direct_channel_back_off_and_one_that_opens_resets_the_wait(
        node_factory, clients, monkeypatch) -> None:
    held = await _held(node_factory, clients)
    reader, raw = held.reader, held.raw
    attempts = []

    async def refused(*_: Any) -> Any:
        attempts.append(time.monotonic())
        raise NodeBusy("at the connection cap")

    monkeypatch.setattr(raw, "_open_local_session", refused)
    raw._direct.conn.abort()  # noqa: SLF001 - the channel is gone: lookups want a new one
    assert not raw.direct_ready and raw._direct_retry_after == DIRECT_RETRY_AFTER  # noqa: SLF001
    waits = []
    for _ in range(8):
        raw._direct_tried_at = -1e9  # noqa: SLF001 - as if the wait had passed (the test does not sit it out)
        reader.want_direct()
        deadline = time.monotonic() + 30
        while raw._direct_opening is not None:  # noqa: SLF001
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        waits.append(raw._direct_retry_after)  # noqa: SLF001
        assert not raw.direct_possible, "asked again before the wait passed"
    assert len(attempts) == 8
    assert waits == [min(DIRECT_RETRY_AFTER * 2 ** n, DIRECT_RETRY_MAX) for n in range(1, 9)]
    assert waits[-1] == DIRECT_RETRY_MAX
    monkeypatch.undo()
    raw._direct_tried_at = -1e9  # noqa: SLF001
    assert await reader.open_direct()
    assert raw.direct_ready and raw._direct_retry_after == DIRECT_RETRY_AFTER  # noqa: SLF001


async def test_a_hung_node_times_a_direct_lookup_out_within_its_bound(node_factory, clients) -> None:
    held = await _held(node_factory, clients, timeout=1.0)
    node, hashes, raw = held.node, held.hashes, held.raw
    node.pause()
    try:
        started = time.monotonic()
        with pytest.raises(OpTimeout):
            raw.lookup_direct(hashes, ["L"])
        assert time.monotonic() - started < 10.0  # the 1 s bound, generously on a noisy machine
        assert not raw.direct_ready  # a failed exchange closes the channel: the stream may be out of step
    finally:
        node.resume()


class _FakeNode:
    """The node's end of a socket pair under a client's direct channel: answers each lookup with ``answer(request)``."""

    def __init__(self, answer: Any) -> None:
        ours, self.theirs = socket.socketpair()
        self.channel = DirectChannel(ours, "fake")
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.channel.abort()
        with contextlib.suppress(OSError):
            self.theirs.shutdown(socket.SHUT_RDWR)
        self.theirs.close()
        self.thread.join(10)
        assert not self.thread.is_alive()

    def _serve(self) -> None:
        try:
            while True:
                header = self._exactly(HEADER_SIZE)
                request = decode_body(self._exactly(decode_header(header)))
                reply, blocks = self.answer(request)
                body = encode_body(reply)
                self.theirs.sendall(encode_header(len(body)) + body + blocks)
        except OSError:
            pass

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.theirs.recv(n - len(data))
            if not chunk:
                raise ConnectionResetError
            data += chunk
        return data

    def client(self) -> NodeClient:
        client = NodeClient("127.0.0.1:1", "ns")
        info = NodeInfo("fake", "1", "elsewhere", {})
        client.info = info
        direct = _Session(self.channel, info)
        client._directs = [direct]  # noqa: SLF001
        client._sessions.add(direct)  # noqa: SLF001
        return client


@pytest.fixture
def fake_node() -> Iterator[Callable[[Any], _FakeNode]]:
    """Makes fake nodes (see :class:`_FakeNode`), each closed and its thread joined after the test."""
    made: list[_FakeNode] = []

    def make(answer: Any) -> _FakeNode:
        made.append(_FakeNode(answer))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def _sent_answer(request: dict, blocks: list[bytes], sums: list[bytes]) -> tuple[dict, bytes]:
    masks = {"L": b"\x01" * len(request["hashes"])}
    return ({"ok": True, "masks": masks, "lease": 7, "ttl": 10.0,
             "sent": {"sizes": [len(b) for b in blocks], "sums": sums, "groups": [len(blocks)]}}, b"".join(blocks))


def test_blocks_over_a_tcp_direct_channel_that_fail_their_checksum_are_reported_absent_never_kept(fake_node) -> None:
    hashes = [os.urandom(32) for _ in range(3)]
    data = [os.urandom(BLOCK) for _ in hashes]
    sums = [block_checksum("L", 0, h, d) for h, d in zip(hashes, data)]
    corrupted = [data[0], data[1][:-1] + bytes([data[1][-1] ^ 1]), data[2]]
    fake = fake_node(lambda request: _sent_answer(request, corrupted, sums))
    client = fake.client()
    found = client.lookup_direct(hashes, ["L"], group=1, send=len(hashes) * BLOCK)
    assert found.received and found.rejected == 1
    assert found.masks == {"L": [True, False, True]}  # the garbled block is absent: its load cannot use it
    slots = client.claim_slots(found.lease_id)
    assert slots is not None and slots.received
    dests = [bytearray(BLOCK) for _ in hashes]
    assert not slots.copy_here([BlockKey("L", 0, h) for h in hashes], [memoryview(d) for d in dests])
    assert not fake.channel.closed  # the stream was in step: only the block was bad


@pytest.mark.parametrize("lie", ["fewer-blocks-than-the-masks", "more-bytes-than-asked", "no-checksum"])
def test_blocks_over_a_tcp_direct_channel_that_do_not_match_the_request_are_a_protocol_error(fake_node,
                                                                                            lie: str) -> None:
    hashes = [os.urandom(32) for _ in range(2)]
    block = os.urandom(1000)

    def answer(request: dict) -> tuple[dict, bytes]:
        if lie == "fewer-blocks-than-the-masks":
            return _sent_answer(request, [block], [b"s" * 16])
        if lie == "more-bytes-than-asked":
            return _sent_answer(request, [block * 2, block * 2], [b"s" * 16] * 2)
        return _sent_answer(request, [block, block], [b"s" * 16, None])

    fake = fake_node(answer)
    client = fake.client()
    with pytest.raises(ProtocolError):
        client.lookup_direct(hashes, ["L"], group=1, send=2 * len(block) + 1)
    assert fake.channel.closed and not client.direct_ready
    assert client._lease_slots == {} and client._received_bytes == 0  # noqa: SLF001
    assert client.lease_generation == 1  # its last connection closed: the node ended its leases


# ---- a read over a direct channel, received natively into rows (NodeClient.read_rows_direct) ------------------


def _rows_run(hashes: list[bytes], rows: Any, ids: list[int] | None = None) -> list[RowRun]:
    return [RowRun("L", 0, hashes, ids or list(range(1, len(hashes) + 1)), memoryview(rows).cast("B"), BLOCK)]


@pytest.mark.parametrize("listener", [False, True], ids=["same-host", "listener"])
async def test_a_read_over_a_direct_channel_lands_in_the_rows_and_ends_the_lease(
        node_factory, clients, listener) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, data = await _stored(clients(node.address, local=False))
    reader = clients(node.address, local=not listener)
    await reader.connect()
    assert await reader.open_direct()
    raw = reader._target  # noqa: SLF001
    found = raw.lookup_direct(hashes, ["L"], group=1)
    assert found.lease_id is not None and found.masks == {"L": [True] * HELD}
    rows = np.zeros((HELD + 2, BLOCK), np.uint8)
    ids = [HELD + 1, *range(2, HELD + 1)]  # any rows, row 1 left alone
    answered: list[float] = []
    raw.read_rows_direct(found.lease_id, _rows_run(hashes, rows, ids), lambda: answered.append(time.monotonic()))
    assert len(answered) == 1
    assert [rows[i].tobytes() for i in ids] == data
    assert not rows[[0, 1]].any()
    stats = await wait_for_stats(node.address, lambda s: s["leases"] == 0)
    assert stats["leases"] == 0 and stats["ops"]["read"] == 1, stats  # the read ended the lease
    again = raw.lookup_direct(hashes[:1], ["L"], group=2)  # the channel is in step and free again
    assert again.masks == {"L": [True]}
    await reader.release(again.lease_id)


async def test_a_read_over_a_direct_channel_waits_for_a_free_one_never_and_a_hung_node_times_it_out(
        node_factory, clients) -> None:
    held = await _held(node_factory, clients, timeout=1.0)
    node, hashes, raw = held.node, held.hashes, held.raw
    found = raw.lookup_direct(hashes, ["L"], group=1)
    rows = np.zeros((HELD + 1, BLOCK), np.uint8)
    pending = raw.start_lookup_direct(hashes, ["L"], group=2)  # holds the one channel
    raw._ends.append(12345)  # noqa: SLF001 - a loaded lease to end with the next request
    with pytest.raises(ChannelBusy):
        raw.read_rows_direct(found.lease_id, _rows_run(hashes, rows))
    assert raw._ends == [12345], "the ends of a read never sent were lost"  # noqa: SLF001
    raw._ends.clear()  # noqa: SLF001
    _answered(pending)
    node.pause()
    try:
        started = time.monotonic()
        assert found.lease_id in raw._lease_hashes  # noqa: SLF001 - kept for its read, which the busy channel refused
        with pytest.raises(OpTimeout):
            raw.read_rows_direct(found.lease_id, _rows_run(hashes, rows))
        assert time.monotonic() - started < 10  # the 1 s bound, generously
        assert not raw.direct_ready  # the stream may be out of step: closed
        assert found.lease_id not in raw._lease_hashes  # noqa: SLF001 - its read was sent: nothing kept for it now
    finally:
        node.resume()


def _read_answer(data: list[bytes], sums: list[Any], sizes: list[int] | None = None) -> Any:
    def answer(request: dict) -> tuple[dict, bytes]:
        assert request["op"] == "read" and request["end"] is True and request["shm"] is False
        return ({"ok": True, "sizes": sizes or [len(d) for d in data], "sums": sums, "groups": [len(data)]},
                b"".join(data))

    return answer


def test_a_read_whose_block_fails_its_checksum_is_a_mismatch_and_the_channel_stays_in_step(fake_node) -> None:
    hashes = [os.urandom(32) for _ in range(3)]
    data = [os.urandom(BLOCK) for _ in hashes]
    sums = [block_checksum("L", 0, h, d) for h, d in zip(hashes, data)]
    corrupted = [data[0], data[1][:-1] + bytes([data[1][-1] ^ 1]), data[2]]
    fake = fake_node(_read_answer(corrupted, sums))
    client = fake.client()
    rows = np.zeros((4, BLOCK), np.uint8)
    with pytest.raises(ChecksumMismatch) as caught:
        client.read_rows_direct(5, _rows_run(hashes, rows))
    assert caught.value.count == 1 and caught.value.first_key == ("L", 0, hashes[1])
    assert not fake.channel.closed  # every byte was read: only the block was bad
    fake.answer = _read_answer(data, [sums[0], None, sums[2]])  # a block the node names no checksum for fails too
    with pytest.raises(ChecksumMismatch):
        client.read_rows_direct(6, _rows_run(hashes, rows))
    fake.answer = _read_answer(data, sums)
    client.read_rows_direct(7, _rows_run(hashes, rows))
    assert [rows[i].tobytes() for i in (1, 2, 3)] == data


@pytest.mark.parametrize("sizes", [[BLOCK, BLOCK - 1, BLOCK], [BLOCK, BLOCK]], ids=["another size", "fewer blocks"])
def test_a_read_reply_that_does_not_match_the_rows_closes_the_channel(fake_node, sizes: list[int]) -> None:
    hashes = [os.urandom(32) for _ in range(3)]
    data = [os.urandom(n) for n in sizes]
    fake = fake_node(_read_answer(data, [bytes(16)] * len(sizes), sizes))
    client = fake.client()
    rows = np.zeros((4, BLOCK), np.uint8)
    with pytest.raises(ProtocolError):
        client.read_rows_direct(5, _rows_run(hashes, rows))
    assert fake.channel.closed and not client.direct_ready
    assert not rows.any(), "bytes of a refused reply were written"


def test_a_refused_read_raises_the_nodes_error_and_the_channel_stays_in_step(fake_node) -> None:
    fake = fake_node(lambda request: ({"ok": False, "code": "lease", "msg": "no such lease"}, b""))
    client = fake.client()
    rows = np.zeros((2, BLOCK), np.uint8)
    with pytest.raises(RemoteError, match="no such lease"):
        client.read_rows_direct(5, _rows_run([os.urandom(32)], rows))
    assert not fake.channel.closed
