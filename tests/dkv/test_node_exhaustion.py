"""A single client must not be able to exhaust a node: memory before authentication, one costly request, connections.

Every test runs against a real node process. Memory is read from the node's
``/proc/<pid>/status``; every wait is bounded, and the few durations measured
are bounded generously (a stalled node misses them by seconds).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from dkv.errors import OpTimeout, TransportError
from dkv.keys import BlockKey
from dkv.transport import connect
from dkv.units import parse_address
from dkv.wire import HEADER, MAGIC, PROTOCOL_VERSION
from tests.conftest import OnUcx, node_stats, on_ucx

TOKEN = b"cluster-token-0123456789"
BIG = 8 * 2**20  # what each header announces: the wire's largest frame
STRANGERS = 120  # connections announcing BIG: 960 MiB if each got its buffer
AUTHENTICATED = 24  # authenticated connections announcing BIG, then gone: 192 MiB if each kept its buffer
MEMORY_SLACK = 64 * 2**20  # the node may grow this much, no more
BOUND = 20.0  # generous bound of every wait
STALL_BOUND = 5.0  # a client's op completes within this while costly requests arrive (stalled: 10 s and more)


def _node_busy() -> type[Exception]:
    # here, not at the top: the memory tests also run against nodes that predate it
    from dkv.errors import NodeBusy

    return NodeBusy


def _status(pid: int, field: str) -> int:
    """A memory field of ``/proc/<pid>/status`` in bytes (VmRSS: now, VmHWM: the peak so far)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


async def _settles_below(pid: int, limit: int, field: str = "VmRSS") -> int:
    """Wait (bounded) until the node's ``field`` is below ``limit``; returns the last reading."""
    deadline = time.monotonic() + BOUND
    value = _status(pid, field)
    while value >= limit and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        value = _status(pid, field)
    return value


async def _round_trip(clients, address: str, **kwargs: Any) -> None:
    """A good client writes, looks up and reads back a block bit-exact."""
    client = clients(address, **kwargs)
    await _round_trip_on(client)
    await client.close()


async def _round_trip_on(client: Any) -> None:
    key = BlockKey("L", 0, os.urandom(32))
    data = os.urandom(256 * 1024)
    await client.write([key], [data])
    found = await client.lookup([key.hash], ["L"])
    assert found.masks == {"L": [True]}
    dest = bytearray(len(data))
    await client.read(found.lease_id, [key], [dest])
    assert dest == data


async def _errors(address: str, **kwargs: Any) -> int:
    stats = await node_stats(address, **kwargs)
    return sum(stats["errors"].values())


def _big_header() -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, BIG, 0)


async def _announce_big_frames(address: str, count: int) -> list[Any]:
    """``count`` raw connections that each send a header announcing BIG and nothing more (UCX loop)."""

    async def run() -> list[Any]:
        conns = []
        for _ in range(count):
            conn = await connect(*parse_address(address))
            conns.append(conn)
            try:
                await conn.send_raw(_big_header())
            except TransportError:
                pass  # already refused and closed: fine
        return conns

    return await on_ucx(run())


async def _abort_all(conns: list[Any]) -> None:
    async def run() -> None:
        for conn in conns:
            conn.abort()

    await on_ucx(run())


# ---- memory before (and after) authentication ------------------------------------------------


@pytest.mark.parametrize("token", [None, TOKEN], ids=["tokenless", "token"])
async def test_headers_announcing_big_frames_from_strangers_cost_the_node_no_memory(node_factory, clients,
                                                                                   token) -> None:
    node = node_factory(token=token)
    await _round_trip(clients, node.address, token=token)  # the node has served once: its baseline
    errors_before = await _errors(node.address, token=token)
    rss_before, peak_before = _status(node.pid, "VmRSS"), _status(node.pid, "VmHWM")

    stalled = await _announce_big_frames(node.address, STRANGERS)  # and they stay, sending nothing more
    try:
        deadline = time.monotonic() + 10  # until the node has answered each (refused), or gave up waiting
        while await _errors(node.address, token=token) - errors_before < STRANGERS and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        peak = _status(node.pid, "VmHWM")
        assert peak - max(peak_before, rss_before) < MEMORY_SLACK, (
            f"{STRANGERS} strangers announcing {BIG >> 20} MiB each took the node's memory "
            f"from {rss_before >> 20} MiB to a peak of {peak >> 20} MiB")
    finally:
        await _abort_all(stalled)
    rss = await _settles_below(node.pid, rss_before + MEMORY_SLACK)
    assert rss - rss_before < MEMORY_SLACK, f"the node kept {(rss - rss_before) >> 20} MiB after the strangers left"
    await _round_trip(clients, node.address, token=token)


@pytest.mark.parametrize("token", [None, TOKEN], ids=["tokenless", "token"])
async def test_a_frame_whose_sender_went_away_is_freed_after_authentication_too(node_factory, clients,
                                                                                token) -> None:
    node = node_factory(token=token)
    await _round_trip(clients, node.address, token=token)
    rss_before, size_before = _status(node.pid, "VmRSS"), _status(node.pid, "VmSize")
    holder = clients(node.address, token=token)

    async def announce() -> list[Any]:
        sessions = []
        for _ in range(AUTHENTICATED):
            session = await holder._target._open_session()  # authenticated, then raw: the frame never comes
            sessions.append(session.conn)
            await session.conn.send_raw(_big_header())
        return sessions

    conns = await on_ucx(announce())
    try:
        await asyncio.sleep(1.0)  # the node posts each receive (if its buffer cost memory, it does now)
    finally:
        await _abort_all(conns)  # gone: the node's receives are abandoned
    rss = await _settles_below(node.pid, rss_before + MEMORY_SLACK)
    assert rss - rss_before < MEMORY_SLACK, (
        f"{AUTHENTICATED} abandoned {BIG >> 20} MiB frames left the node {(rss - rss_before) >> 20} MiB larger")
    # their buffers are gone too, not merely untouched (an unwritten buffer costs address space only)
    size = await _settles_below(node.pid, size_before + MEMORY_SLACK, "VmSize")
    assert size - size_before < MEMORY_SLACK, (
        f"{AUTHENTICATED} abandoned {BIG >> 20} MiB frames left {(size - size_before) >> 20} MiB mapped in the node")
    await _round_trip(clients, node.address, token=token)


async def test_connections_still_authenticating_are_bounded_in_number(node_factory, clients) -> None:
    node = node_factory("--max-unauthenticated", "4")

    async def stall(count: int) -> list[Any]:
        conns = []
        for _ in range(count):  # each gets its challenge and answers nothing
            conn = await connect(*parse_address(node.address))
            conns.append(conn)
            assert (await conn.recv_message(5))["t"] == "challenge"
        return conns

    stalled = await on_ucx(stall(4))
    try:
        with pytest.raises(_node_busy(), match="max_unauthenticated"):
            await clients(node.address, retries=1).connect()
    finally:
        await _abort_all(stalled)
    deadline = time.monotonic() + BOUND  # the node notices they went (or their handshake time runs out)
    while True:
        try:
            await _round_trip(clients, node.address, retries=1)
            break
        except _node_busy():
            assert time.monotonic() < deadline, "the node never made room again"
            await asyncio.sleep(0.2)
    stats = await node_stats(node.address)
    assert stats["errors"].get("busy", 0) >= 1
    assert stats["unauthenticated"] == 0


async def test_a_connection_that_does_not_complete_its_handshake_in_time_is_closed(node, clients) -> None:
    async def stall() -> float:
        conn = await connect(*parse_address(node.address))
        try:
            assert (await conn.recv_message(5))["t"] == "challenge"
            started = time.monotonic()
            with pytest.raises(TransportError) as closed:  # we answer nothing: the node closes the connection
                await conn.recv_message(BOUND)
            assert not isinstance(closed.value, OpTimeout), "the node never closed a connection that said nothing"
            return time.monotonic() - started
        finally:
            conn.abort()

    waited = await on_ucx(stall())
    assert waited < BOUND
    stats = await node_stats(node.address)
    assert stats["errors"].get("handshake_timeout") == 1 and stats["unauthenticated"] == 0
    await _round_trip(clients, node.address)


# ---- one request must not stall the node -------------------------------------------------------


async def test_a_touch_over_max_cost_is_refused_and_does_not_stall_other_clients(node, clients) -> None:
    other = clients(node.address)
    held = BlockKey("L", 0, os.urandom(32))
    await other.write([held], [b"held"])
    holder = clients(node.address, pool_size=1)
    # 2 048 hashes x 64 leaves x 64 shards: 8 M key checks (a 140 KB request); four of them at once
    touch = {"op": "touch", "hashes": [os.urandom(32) for _ in range(2048)],
             "leaves": [f"leaf-{i:02d}" for i in range(64)], "shards": 64}
    sessions = [OnUcx((await on_ucx(holder._target._open_session())).conn) for _ in range(4)]
    try:
        await asyncio.gather(*(s.send_message(touch) for s in sessions))
        started = time.monotonic()
        assert await other.probe([held.hash], ["L"]) == {"L": [True]}
        waited = time.monotonic() - started
        replies = await asyncio.gather(*(s.recv_message(120) for s in sessions))
    finally:
        for s in sessions:
            s.abort()
    assert [(r.get("ok"), r.get("code")) for r in replies] == [(False, "too_costly")] * 4, replies[0]
    assert "max_cost" in replies[0]["msg"]
    assert waited < STALL_BOUND, f"another client's probe waited {waited:.1f}s behind the costly touches"
    stats = await node_stats(node.address)
    assert stats["errors"].get("too_costly") == 4
    assert stats["counters"]["touches"] == 0, "the refused touches did no work"


async def test_the_client_splits_presence_ops_to_fit_max_cost(node_factory, clients) -> None:
    from dkv.errors import RequestTooCostly

    node = node_factory("--max-cost", "256")
    client = clients(node.address)
    info = await client.connect()
    assert info.limits["max_cost"] == 256 and client.limit("max_cost") == 256
    leaves, shards = ["a", "b", "c"], 2
    hashes = [os.urandom(32) for _ in range(100)]  # 100 x 3 x 2 = 600: three requests of at most 42 hashes
    held = {(leaf, i) for leaf in leaves for i in range(0, 100, 7)} | {("b", 99), ("c", 41), ("c", 42)}
    await client.write([BlockKey(leaf, s, hashes[i]) for leaf, i in sorted(held) for s in range(shards)],
                       [b"x"] * (len(held) * shards))
    expected = {leaf: [(leaf, i) in held for i in range(100)] for leaf in leaves}

    async def ops(op: str) -> int:
        return (await client.stats())["ops"].get(op, 0)

    before = await ops("probe")
    assert await client.probe(hashes, leaves, shards) == expected
    assert await ops("probe") - before == 3
    found = await client.lookup(hashes, leaves, shards, lease=False)
    assert found.masks == expected and found.lease_id is None
    before = await ops("touch")
    assert await client.touch(hashes, leaves, shards) == len(held) * shards
    assert await ops("touch") - before == 3
    # more leaves of every shard than one hash may cost: the leaves are split too
    many = [f"leaf{i}" for i in range(8)]  # 8 x 64 shards = 512 for one hash: groups of 4 leaves
    await client.write([BlockKey("leaf7", s, hashes[5]) for s in range(64)], [b"y"] * 64)
    masks = await client.probe(hashes[:10], many, 64)
    assert masks == {leaf: [leaf == "leaf7" and i == 5 for i in range(10)] for leaf in many}
    # a leased lookup is one request: over max_cost it is refused before anything is sent
    before = await ops("lookup")
    with pytest.raises(ValueError, match="max_cost"):
        await client.lookup(hashes, leaves, shards)
    assert await ops("lookup") == before
    within = await client.lookup(hashes[:42], leaves, shards)  # 42 x 3 x 2 = 252
    assert within.masks == {leaf: mask[:42] for leaf, mask in expected.items()} and within.lease_id is not None
    await client.release(within.lease_id)
    # sent raw, over max_cost: refused with a typed error, the connection still serves
    with pytest.raises(RequestTooCostly, match="max_cost"):
        await client._request({"op": "probe", "hashes": hashes, "leaves": leaves, "shards": shards},
                              idempotent=True)
    assert await client.probe(hashes[:1], ["a"], shards) == {"a": [True]}
    stats = await client.stats()
    assert stats["errors"] == {"too_costly": 1}


# ---- connections --------------------------------------------------------------------------------


async def _connected(clients, address: str, count: int, **kwargs: Any) -> list[Any]:
    """``count`` clients of one connection each, connected (then idle)."""
    made = [clients(address, pool_size=1, retries=1, **kwargs) for _ in range(count)]
    for client in made:
        await client.connect()
    return made


async def _leased(client: Any) -> tuple[BlockKey, bytes, int]:
    """Write a block and hold a lease on it: the client's one connection now keeps a lease alive."""
    key, data = BlockKey("L", 0, os.urandom(32)), os.urandom(4096)
    await client.write([key], [data])
    found = await client.lookup([key.hash], ["L"])
    assert found.lease_id is not None
    return key, data, found.lease_id


@pytest.mark.parametrize("cap", ["node", "credential"])
async def test_at_a_connection_cap_a_new_client_gets_nodebusy_then_room_once_one_is_idle(node_factory, clients,
                                                                                         cap) -> None:
    node = node_factory("--max-connections", "4" if cap == "node" else "64", "--max-connections-per-credential", "4")
    holders = await _connected(clients, node.address, 4)
    leases = [await _leased(c) for c in holders]  # none of the four may be closed: each keeps a lease alive
    await asyncio.sleep(1.5)  # idle for longer than the node's grace: only their leases keep them
    with pytest.raises(_node_busy(), match="max_connections"):
        await clients(node.address, retries=1).probe([os.urandom(32)], ["L"])
    # reading under each lease still works: refusing the newcomer cost the holders nothing
    for client, (key, data, lease_id) in zip(holders, leases):
        dest = bytearray(len(data))
        await client.read(lease_id, [key], [dest])
        assert dest == data
    # leases ended (by the reads): idle connections that hold nothing make room for a new client
    await asyncio.sleep(1.5)
    newcomer = clients(node.address, retries=1)
    await newcomer.connect()
    stats = await node_stats(node.address)
    assert stats["reaped"].get("cap", 0) >= 1
    assert stats["errors"].get("busy", 0) >= 1
    await newcomer.close()
    # the closed ones' clients reconnect by themselves (into the room the newcomer and stats left)
    for client in holders:
        assert await client.probe([leases[0][0].hash], ["L"]) == {"L": [True]}


async def test_idle_connections_of_one_credential_fill_the_cap_and_a_new_client_still_gets_in(node_factory,
                                                                                             clients) -> None:
    node = node_factory("--max-connections", "8", "--max-connections-per-credential", "8")
    idle = await _connected(clients, node.address, 8)
    try:  # at once: they may not have been idle long enough to give way
        await clients(node.address, retries=1).connect()
    except _node_busy():
        pass  # typed, and at once: never a hang or an untyped error
    await asyncio.sleep(1.5)
    await _round_trip(clients, node.address, retries=1)  # idle beyond the grace: one gives way
    for client in idle:  # and every idle client still works, reconnecting if it was closed
        assert await client.probe([os.urandom(32)], ["L"]) == {"L": [False]}


async def test_idle_connections_are_reaped_and_their_clients_reconnect(node_factory, clients) -> None:
    node = node_factory("--idle-timeout", "1")
    idle = await _connected(clients, node.address, 6)
    keeper = clients(node.address, pool_size=1)
    key, data, lease_id = await _leased(keeper)  # its one connection keeps a lease: not reaped while it does
    deadline = time.monotonic() + BOUND
    stats = await node_stats(node.address)
    while stats["reaped"].get("idle", 0) < len(idle) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        stats = await node_stats(node.address)
    assert stats["reaped"].get("idle", 0) >= len(idle), stats
    assert stats["leases"] == 1
    dest = bytearray(len(data))
    await keeper.read(lease_id, [key], [dest])  # its lease outlived the idle timeout: the connection was kept
    assert dest == data
    for client in idle:  # reaped: each reconnects transparently (writes and reads too, never retried)
        await _round_trip_on(client)
        assert await client.probe([key.hash], ["L"]) == {"L": [True]}


async def test_connection_options_are_checked(node_factory) -> None:
    from cluster.process import NodeStartError

    for bad, why in ((("--max-cost", "8"), "max_cost must be at least 64"),
                     (("--idle-timeout", "0"), "idle_timeout must be positive"),
                     (("--max-unauthenticated", "0"), "max_unauthenticated must be at least 1"),
                     (("--max-connections-per-credential", "0"), "max_connections_per_credential must be at least 1")):
        with pytest.raises(NodeStartError, match=why):
            node_factory(*bad)
