"""Packed hashes on the wire (dkv.wire, "packed_hashes"): the node answers a packed lookup, probe and touch as
it answers the list, refuses a malformed packing as a protocol error, and the client packs only for a node
that lists the feature, on the loop and on its direct channel alike."""

from __future__ import annotations

import os
from typing import Any

import pytest

from dkv import client as dkv_client
from dkv.client import NodeInfo, on_the_wire
from dkv.direct_channel import DirectChannel
from dkv.keys import BlockKey
from dkv.wire import FEATURE_PACKED_HASHES, FEATURES, MAX_KEYS
from tests.dkv.test_node_bad_input import _expect_closed_with_error, _good_round_trip, _raw_session

pytestmark = pytest.mark.timeout(120)

LEAF = "L"


async def _stored(clients: Any, address: str, count: int, size: int = 32) -> list[bytes]:
    writer = clients(address, local=False)
    hashes = [os.urandom(size) for _ in range(count)]
    result = await writer.write([BlockKey(LEAF, 0, h) for h in hashes], [b"b" * 64] * count)
    assert result.stored == count
    return hashes


def test_a_node_of_this_build_lists_the_feature() -> None:
    assert FEATURE_PACKED_HASHES in FEATURES


@pytest.mark.parametrize("size", [8, 32])
async def test_a_packed_lookup_probe_and_touch_are_answered_as_their_lists_are(node, clients, size: int) -> None:
    held = await _stored(clients, node.address, 5, size)
    asked = held[:3] + [os.urandom(size)] + held[3:]  # one absent among them
    conn = await _raw_session(node.address)
    try:
        for op, extra in (("lookup", {"lease": False, "group": 0}), ("probe", {}), ("touch", {}),
                          ("lookup", {"lease": True, "group": 1})):
            base = {"op": op, "leaves": [LEAF, "other"], "shards": 1, **extra}
            await conn.send_message({**base, "hashes": asked})
            as_list = await conn.recv_message(5)
            await conn.send_message({**base, "hashes": b"".join(asked), "hash_size": size})
            as_packed = await conn.recv_message(5)
            assert as_list["ok"] and as_packed["ok"], (op, as_list, as_packed)
            if op == "lookup" and extra["lease"]:  # the second lease (same group) ended the first
                assert as_packed["lease"] != as_list["lease"]
                as_list.pop("lease"), as_packed.pop("lease")
            assert as_packed == as_list, op
        assert as_packed["masks"][LEAF] != as_packed["masks"]["other"]
    finally:
        conn.abort()


@pytest.mark.parametrize("op", ["lookup", "probe", "touch"])
@pytest.mark.parametrize("packing", [
    {"hashes": b"x" * 64},  # no hash_size
    {"hashes": b"x" * 64, "hash_size": 16},  # neither 8 nor 32
    {"hashes": b"x" * 64, "hash_size": "32"},
    {"hashes": b"x" * 64, "hash_size": True},
    {"hashes": b"x" * 60, "hash_size": 32},  # not a multiple
    {"hashes": b"x" * 8 * (MAX_KEYS + 1), "hash_size": 8},  # more hashes than any request may carry
], ids=["no-size", "size-16", "size-str", "size-bool", "ragged", "too-many"])
async def test_a_malformed_packing_is_a_protocol_error_and_the_node_serves_on(node, clients, op: str,
                                                                             packing: dict) -> None:
    conn = await _raw_session(node.address)
    extra = {"lease": True, "group": 0} if op == "lookup" else {}
    await conn.send_message({"op": op, "leaves": [LEAF], "shards": 1, **extra, **packing})
    assert await _expect_closed_with_error(conn) == "protocol"
    await _good_round_trip(clients, node.address)


def test_the_client_packs_only_for_a_node_that_takes_packed_hashes() -> None:
    hashes = [os.urandom(32) for _ in range(4)]
    message = {"op": "lookup", "hashes": hashes, "leaves": [LEAF], "shards": 1, "lease": True, "group": 0}
    taking = NodeInfo("n", "e", "h", {}, features=frozenset({FEATURE_PACKED_HASHES}))
    older = NodeInfo("n", "e", "h", {}, features=frozenset())
    packed = on_the_wire(message, taking)
    assert packed["hashes"] == b"".join(hashes) and packed["hash_size"] == 32
    assert message["hashes"] is hashes  # the caller's message (judging the answer) keeps its list
    assert on_the_wire(message, older) is message
    for unpackable in ([], [hashes[0], os.urandom(8)]):  # none, or of mixed lengths: sent as the list
        assert on_the_wire({**message, "hashes": unpackable}, taking)["hashes"] == unpackable
    for op in ("read", "write", "stats"):
        other = {"op": op, "hashes": hashes}
        assert on_the_wire(other, taking) is other


async def test_the_clients_lookups_travel_packed_on_the_loop_and_on_the_direct_channel(node, clients,
                                                                                      monkeypatch) -> None:
    held = await _stored(clients, node.address, 6)
    sent: list[dict] = []
    real_on_the_wire = dkv_client.on_the_wire

    def recording(message: dict, info: NodeInfo) -> dict:
        wire = real_on_the_wire(message, info)
        sent.append(wire)
        return wire

    monkeypatch.setattr(dkv_client, "on_the_wire", recording)
    real_exchange = DirectChannel.exchange_with
    exchanged: list[dict] = []

    def exchange_with(self: DirectChannel, message: dict, *args: Any) -> Any:
        exchanged.append(message)
        return real_exchange(self, message, *args)

    monkeypatch.setattr(DirectChannel, "exchange_with", exchange_with)
    reader = clients(node.address, local=True)
    await reader.connect()
    raw = reader._target  # noqa: SLF001
    assert FEATURE_PACKED_HASHES in raw.info.features

    found = await reader.lookup(held + [os.urandom(32)], [LEAF], group=1)  # on the loop
    assert found.masks == {LEAF: [True] * 6 + [False]}
    probed = await reader.probe(held, [LEAF])
    assert probed == {LEAF: [True] * 6}
    assert await reader.open_direct()
    direct = raw.lookup_direct(held[:4], [LEAF], group=2)  # on the calling thread
    assert direct.masks == {LEAF: [True] * 4}
    presence = [m for m in sent if m.get("op") in ("lookup", "probe")]
    assert len(presence) >= 3 and all(type(m["hashes"]) is bytes and m["hash_size"] == 32 for m in presence)
    assert [type(m["hashes"]) for m in exchanged] == [bytes]  # the direct channel's request was packed too
    dests = [bytearray(64) for _ in range(4)]  # the lease the packed lookup granted reads back its blocks
    await reader.read(direct.lease_id, [BlockKey(LEAF, 0, h) for h in held[:4]], dests)
    assert all(d == b"b" * 64 for d in dests)
