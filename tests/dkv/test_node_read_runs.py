"""A read named by runs of places in its lease's lookup: real node processes, raw requests and the client.

The node announces ``read_runs`` in its handshake; a read by runs brings the
same bytes as by keys on both paths; one that names its blocks both ways, or
neither, is a protocol error; a place its lease does not hold is refused as
``lease_expired``, and the connection goes on. The client names its reads by
runs where the node announces them and the keys are its lookup's, by keys
otherwise (a node of an older build, keys it did not look up). The store's
side is ``test_store_read_runs.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from dkv.client import NodeClient, NodeInfo, _Session
from dkv.errors import LeaseExpired, TransportError
from dkv.keys import BlockKey
from dkv.wire import FEATURE_READ_RUNS
from tests.conftest import on_ucx
from tests.dkv.test_node_reads import _raw_session, _segment

BLOCK = 64 * 1024
COUNT = 12


async def _stored(writer: Any, leaves: tuple[str, ...] = ("L",)) -> tuple[list[bytes], dict[tuple[str, bytes], bytes]]:
    hashes = [os.urandom(32) for _ in range(COUNT)]
    data = {(leaf, h): os.urandom(BLOCK) for leaf in leaves for h in hashes}
    keys = [BlockKey(leaf, 0, h) for leaf in leaves for h in hashes]
    assert (await writer.write(keys, [data[(k.leaf, k.hash)] for k in keys])).stored == len(keys)
    return hashes, data


async def _lookup(conn: Any, hashes: list[bytes], leaves: list[str]) -> int:
    await conn.send_message({"op": "lookup", "hashes": hashes, "leaves": leaves, "shards": 1, "lease": True,
                             "group": 0})
    reply = await conn.recv_message(10)
    assert reply["ok"] is True and reply["lease"] is not None, reply
    return reply["lease"]


async def test_the_node_announces_reads_by_runs(node_factory) -> None:
    node = node_factory()
    conn, hello = await _raw_session(node.address, client="raw")
    assert FEATURE_READ_RUNS in hello["features"]
    await conn.close()


@pytest.mark.parametrize("shm", [False, True], ids=["listener", "same-host two-step"])
async def test_a_read_by_runs_brings_the_blocks_of_those_places(node_factory, clients, shm: bool) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, data = await _stored(clients(node.address, local=False), ("L", "M"))
    conn, hello = await _raw_session(node.address, client="raw")
    mapping = await on_ucx(_segment(hello)) if shm else None
    lease = await _lookup(conn, hashes, ["L", "M"])
    runs = [["M", 0, 3, 7], ["L", 0, 0, 2], ["L", 0, 10, 12]]  # any order, any leaf
    wanted = [(leaf, hashes[d]) for leaf, _, first, stop in runs for d in range(first, stop)]
    await conn.send_message({"op": "read", "lease": lease, "runs": runs, "end": True, "shm": shm})
    reply = await conn.recv_message(10)
    assert reply["ok"] is True and reply["sizes"] == [BLOCK] * len(wanted), reply
    if shm:
        try:
            got = [bytes(mapping.slot(o, n)) for o, n in zip(reply["offsets"], reply["sizes"])]
        finally:
            mapping.close()
        await conn.send_message({"op": "done", "read": reply["read"]})
        assert (await conn.recv_message(10))["intact"] is True
    else:
        dests = [bytearray(BLOCK) for _ in wanted]
        await conn.recv_payloads(dests, 10, None, reply.get("groups"))
        got = [bytes(d) for d in dests]
    assert got == [data[w] for w in wanted]
    await conn.close()


@pytest.mark.parametrize("named", [{}, {"keys": [], "runs": []}], ids=["neither", "both"])
async def test_a_read_that_names_its_blocks_neither_way_or_both_is_a_protocol_error(node_factory, named) -> None:
    node = node_factory()
    conn, _ = await _raw_session(node.address, client="raw")
    await conn.send_message({"op": "read", "lease": 1, **named, "end": True, "shm": False})
    reply = await conn.recv_message(5)
    assert reply["ok"] is False and reply["code"] == "protocol" and "exactly one" in reply["msg"]
    with pytest.raises(TransportError):
        await conn.recv_message(5)  # then the node closes the connection
    conn.abort()


async def test_a_run_its_lease_does_not_hold_is_refused_and_the_connection_goes_on(node_factory, clients) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, data = await _stored(clients(node.address, local=False))
    conn, _ = await _raw_session(node.address, client="raw")
    lease = await _lookup(conn, hashes + [os.urandom(32)], ["L"])  # the last place's hash is absent
    for run in (["L", 0, COUNT - 1, COUNT + 1], ["X", 0, 0, 1]):
        await conn.send_message({"op": "read", "lease": lease, "runs": [run], "end": False, "shm": False})
        reply = await conn.recv_message(5)
        assert reply["ok"] is False and reply["code"] == "lease_expired", reply
    await conn.send_message({"op": "read", "lease": lease, "runs": [["L", 0, 0, 1]], "end": True, "shm": False})
    reply = await conn.recv_message(5)
    assert reply["ok"] is True
    dest = bytearray(BLOCK)
    await conn.recv_payloads([dest], 10, None, reply.get("groups"))
    assert bytes(dest) == data[("L", hashes[0])]
    await conn.close()


# ---- the client -----------------------------------------------------------------------------------


@pytest.fixture
def sent_reads(monkeypatch) -> list[dict[str, Any]]:
    """Every read request a client sends, as sent."""
    reads: list[dict[str, Any]] = []
    request = _Session.request

    async def spy(self: _Session, message: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if message.get("op") == "read":
            reads.append(message)
        return await request(self, message, *args, **kwargs)

    monkeypatch.setattr(_Session, "request", spy)
    return reads


def _without_features(monkeypatch) -> None:
    """The client meets nodes as if of a build that announces nothing (``features`` absent)."""
    from_reply = NodeInfo.from_reply.__func__

    def old_node(cls: type[NodeInfo], reply: dict[str, Any]) -> NodeInfo:
        return from_reply(cls, {k: v for k, v in reply.items() if k != "features"})

    monkeypatch.setattr(NodeInfo, "from_reply", classmethod(old_node))


@pytest.mark.parametrize("announced", [True, False], ids=["node announces runs", "node of an older build"])
@pytest.mark.parametrize("local", [False, True], ids=["listener", "same-host two-step"])
async def test_the_client_reads_by_runs_where_the_node_announces_them(node_factory, clients, sent_reads,
                                                                       monkeypatch, announced: bool,
                                                                       local: bool) -> None:
    if not announced:
        _without_features(monkeypatch)
    node = node_factory("--pool", "16MiB")
    hashes, data = await _stored(clients(node.address, local=False))
    reader = clients(node.address, local=local, checksums=not local)  # same-host without checksums: two steps
    found = await reader.lookup(hashes, ["L"])
    wanted = hashes[2:9]
    dests = [bytearray(BLOCK) for _ in wanted]
    await reader.read(found.lease_id, [BlockKey("L", 0, h) for h in wanted], dests)
    assert [bytes(d) for d in dests] == [data[("L", h)] for h in wanted]
    assert len(sent_reads) == 1
    if announced:
        assert sent_reads[0]["runs"] == [["L", 0, 2, 9]] and "keys" not in sent_reads[0]
    else:
        assert "runs" not in sent_reads[0] and len(sent_reads[0]["keys"]) == len(wanted)


async def test_a_client_reading_keys_its_lookup_did_not_name_sends_them_and_is_refused(node_factory, clients,
                                                                                       sent_reads) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, _ = await _stored(clients(node.address, local=False))
    reader = clients(node.address, local=False)
    found = await reader.lookup(hashes[:4], ["L"])
    with pytest.raises(LeaseExpired):
        await reader.read(found.lease_id, [BlockKey("L", 0, hashes[5])], [bytearray(BLOCK)])
    assert "keys" in sent_reads[0] and "runs" not in sent_reads[0]


async def test_a_client_forgets_a_leases_lookup_once_it_is_read_released_or_replaced(node_factory, clients) -> None:
    node = node_factory("--pool", "16MiB")
    hashes, _ = await _stored(clients(node.address, local=False))
    reader: Any = clients(node.address, local=False)
    target: NodeClient = reader._target  # noqa: SLF001 - the bounded book of lookups kept for reads
    replaced = await reader.lookup(hashes[:2], ["L"], group=1)
    released = await reader.lookup(hashes[2:4], ["L"], group=2)
    assert set(target._lease_hashes) == {replaced.lease_id, released.lease_id}  # noqa: SLF001
    read = await reader.lookup(hashes[:2], ["L"], group=1)  # the node ends the group's previous lease
    assert set(target._lease_hashes) == {read.lease_id, released.lease_id}  # noqa: SLF001
    await reader.read(read.lease_id, [BlockKey("L", 0, h) for h in hashes[:2]], [bytearray(BLOCK) for _ in range(2)])
    await reader.release(released.lease_id)
    assert not target._lease_hashes  # noqa: SLF001
