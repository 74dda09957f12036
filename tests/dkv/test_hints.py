"""The request's ``dkv_cache_hint``: build → parse round trip, the accepted forms, and every unusable reason.

Pure logic: no etcd, no node. A hint the connector cannot use must always come
back as :class:`UnusableHint` with a reason from :data:`REASONS`, never as any
other exception (the caller counts it and carries on as if there were no hint).
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from dkv.etcd import MemberRecord
from dkv.hints import (
    BEHIND_DEVICE,
    ACTION_TYPE,
    ENVELOPE_VERSION,
    HINT_VERSION,
    MAX_HINT_BYTES,
    MISMATCH,
    REASONS,
    STALE_EPOCH,
    UNKNOWN_PEER,
    UNKNOWN_VERSION,
    UNPARSEABLE,
    WRONG_NAMESPACE,
    Hint,
    UnusableHint,
    build_hint,
    parse_hint,
    resolve_hint,
)

NS = "tenant/0123456789abcdef"


def _member(node_id: str = "n1", epoch: str = "1700000000-deadbeef", address: str = "10.0.0.7:7420") -> MemberRecord:
    return MemberRecord(node_id=node_id, address=address, epoch=epoch, protocol_version=1,
                        started_at=1.0, host_id="h1")


def _chain(n: int, size: int = 32) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def _reason(raw: object, hashes: list[bytes], members: dict[str, MemberRecord], namespace: str = NS) -> str:
    """The reason resolve_hint gives; fails the test if it resolves or raises anything but UnusableHint."""
    with pytest.raises(UnusableHint) as info:
        resolve_hint(raw, namespace, hashes, members)  # type: ignore[arg-type]
    assert info.value.reason in (*REASONS, BEHIND_DEVICE)
    return info.value.reason


def _envelope() -> dict:
    """A well-formed envelope (as build_hint makes it) for _member() over a 4-block chain, to be mangled."""
    return json.loads(build_hint(_member(), NS, _chain(4), 3))


def _mangled(changes: dict[str, object]) -> dict:
    """The envelope with fields of its ``dkv`` object replaced."""
    doc = _envelope()
    doc["actions"][0]["payload"]["dkv"].update(changes)
    return doc


# ---- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hash_size", [8, 32])
def test_built_hint_carries_the_dynamo_envelope_and_round_trips(hash_size: int) -> None:
    member = _member()
    hashes = _chain(6, hash_size)
    raw = build_hint(member, NS, hashes, 4)
    doc = json.loads(raw)

    assert doc["protocol_version"] == ENVELOPE_VERSION == 1
    uuid.UUID(doc["message_id"])  # a real uuid
    assert isinstance(doc["actions"], list) and len(doc["actions"]) == 1
    action = doc["actions"][0]
    assert action["action_type"] == ACTION_TYPE == "kv.fetch"
    assert action["action_version"] == HINT_VERSION
    uuid.UUID(action["action_id"])
    payload = action["payload"]
    assert payload["source_control_endpoint"] == f"ucx://{member.address}"
    assert payload["block_hashes"] == [hashes[3].hex()], "block_hashes names the deepest covered block"
    assert payload["dkv"] == {"version": HINT_VERSION, "peer_id": "n1", "epoch": member.epoch,
                              "namespace": NS, "depth": 4, "deepest_hash": hashes[3].hex(),
                              "blocks": len(hashes)}

    hint = parse_hint(raw)
    assert hint == Hint(peer_id="n1", epoch=member.epoch, namespace=NS, depth=4, deepest_hash=hashes[3],
                        endpoint=f"ucx://{member.address}", blocks=len(hashes))
    # bytes in, same answer; and the hint resolves to the member for its own request
    assert parse_hint(raw.encode()) == hint
    assert resolve_hint(raw, NS, hashes, {"n1": member}) is member
    assert resolve_hint(raw.encode(), NS, hashes[:4], {"n1": member}) is member


def test_two_hints_for_the_same_route_have_distinct_message_ids() -> None:
    hashes = _chain(2)
    a, b = (json.loads(build_hint(_member(), NS, hashes, 2)) for _ in range(2))
    assert a["message_id"] != b["message_id"]
    assert a["actions"][0]["action_id"] != b["actions"][0]["action_id"]


@pytest.mark.parametrize("depth", [0, -1, 4])
def test_build_hint_refuses_a_depth_outside_the_chain(depth: int) -> None:
    with pytest.raises(ValueError):
        build_hint(_member(), NS, _chain(3), depth)


def test_max_minimal_form_names_the_peer() -> None:
    raw = json.dumps({"version": 2, "instances": [{"instance_name": "n1"}]})
    hint = parse_hint(raw)
    assert hint == Hint(peer_id="n1")
    assert hint.epoch is hint.namespace is hint.depth is hint.deepest_hash is None
    member = _member("n1")
    # no epoch, namespace or depth to check: the named live peer is the answer
    assert resolve_hint(raw, NS, _chain(3), {"n1": member}) is member
    assert _reason(raw, _chain(3), {"n2": _member("n2")}) == UNKNOWN_PEER


def test_no_hint_is_no_peer_and_no_error() -> None:
    assert resolve_hint(None, NS, _chain(2), {"n1": _member()}) is None


def test_a_foreign_kv_fetch_action_before_ours_is_skipped() -> None:
    doc = _envelope()
    doc["actions"].insert(0, {"action_type": "kv.fetch", "action_version": 7, "payload": {"other": {}}})
    doc["actions"].insert(0, {"action_type": "kv.push", "payload": {"dkv": {"version": 99}}})
    hint = parse_hint(json.dumps(doc))
    assert hint.peer_id == "n1" and hint.depth == 3


# ---- unusable hints: every reason -----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe\x00garbage",
        b"",
        "not json at all",
        "{",
        "[1, 2, 3]",
        '"a string"',
        "42",
        "null",
        b"x" * (MAX_HINT_BYTES + 1),
        "x" * (MAX_HINT_BYTES + 1),
        json.dumps({"padding": "p" * MAX_HINT_BYTES, "version": 2, "instances": [{"instance_name": "n1"}]}).encode(),
        json.dumps({"something": "else"}),
        json.dumps({"protocol_version": 1, "actions": "kv.fetch"}),
        json.dumps({"protocol_version": 1, "actions": []}),
        json.dumps({"protocol_version": 1, "actions": [{"action_type": "kv.fetch", "payload": "x"}]}),
        json.dumps({"version": 2, "instances": []}),
        json.dumps({"version": 2, "instances": [{"instance_name": ""}]}),
        json.dumps({"version": 2, "instances": ["n1"]}),
    ],
    ids=["garbage-bytes", "empty", "not-json", "truncated-json", "json-list", "json-string", "json-number",
         "json-null", "huge-bytes", "huge-str", "huge-valid-max-form", "neither-form", "actions-not-list",
         "no-actions", "payload-not-object", "max-no-instances", "max-empty-name", "max-instance-not-object"],
)
def test_unparseable_hints_are_counted_not_raised(raw: object) -> None:
    assert _reason(raw, _chain(4), {"n1": _member()}) == UNPARSEABLE


@pytest.mark.parametrize(
    "changes",
    [
        {"peer_id": ""},
        {"peer_id": 7},
        {"epoch": None},
        {"namespace": ""},
        {"depth": 0},
        {"depth": "3"},
        {"depth": True},
        {"depth": 2.0},
        {"deepest_hash": "zz"},
        {"deepest_hash": "abcd"},
        {"deepest_hash": 12},
    ],
    ids=lambda c: "-".join(f"{k}={v!r}" for k, v in c.items()),
)
def test_envelope_with_a_malformed_dkv_field_is_unparseable(changes: dict) -> None:
    assert _reason(json.dumps(_mangled(changes)), _chain(4), {"n1": _member()}) == UNPARSEABLE


def test_envelope_missing_a_dkv_field_is_unparseable() -> None:
    for field in ("peer_id", "epoch", "namespace", "depth", "deepest_hash"):
        doc = _envelope()
        del doc["actions"][0]["payload"]["dkv"][field]
        assert _reason(json.dumps(doc), _chain(4), {"n1": _member()}) == UNPARSEABLE, field


def test_deeply_nested_json_under_the_size_bound_is_unparseable_not_a_crash() -> None:
    # 60 000 brackets fit under the 64 KiB bound; a hint is request metadata an attacker controls
    for raw in (b"[" * 60_000, "[" * 60_000 + "]" * 1_000, '{"actions": ' + "[" * 30_000):
        assert len(raw) <= MAX_HINT_BYTES
        assert _reason(raw, _chain(4), {"n1": _member()}) == UNPARSEABLE


def test_the_64_kib_bound_is_on_bytes_whether_the_hint_comes_as_bytes_or_str() -> None:
    # a valid MAX hint padded with 2-byte characters: 40 000 characters, about 80 000 bytes of UTF-8
    raw = json.dumps({"version": 2, "instances": [{"instance_name": "n1"}], "pad": "\u00e9" * 40_000},
                     ensure_ascii=False)
    assert len(raw) <= MAX_HINT_BYTES < len(raw.encode())
    members = {"n1": _member()}
    assert _reason(raw.encode(), _chain(2), members) == UNPARSEABLE
    assert _reason(raw, _chain(2), members) == UNPARSEABLE, "the same hint as text must get the same answer"


def test_unknown_versions_are_their_own_reason() -> None:
    hashes, members = _chain(4), {"n1": _member()}
    envelope_v2 = _envelope()
    envelope_v2["protocol_version"] = 2
    assert _reason(json.dumps(envelope_v2), hashes, members) == UNKNOWN_VERSION
    no_version = _envelope()
    del no_version["protocol_version"]
    assert _reason(json.dumps(no_version), hashes, members) == UNKNOWN_VERSION
    assert _reason(json.dumps(_mangled({"version": 9})), hashes, members) == UNKNOWN_VERSION
    action_v2 = _envelope()
    action_v2["actions"][0]["action_version"] = 2
    assert _reason(json.dumps(action_v2), hashes, members) == UNKNOWN_VERSION
    for version in (3, 1, "2", None):
        doc = {"version": version, "instances": [{"instance_name": "n1"}]}
        assert _reason(json.dumps(doc), hashes, members) == UNKNOWN_VERSION, version


def test_hint_naming_a_peer_that_is_not_live_is_unknown_peer() -> None:
    hashes = _chain(4)
    raw = build_hint(_member("gone"), NS, hashes, 2)
    assert _reason(raw, hashes, {"n1": _member("n1")}) == UNKNOWN_PEER
    assert _reason(raw, hashes, {}) == UNKNOWN_PEER


def test_hint_from_a_previous_epoch_is_stale() -> None:
    hashes = _chain(4)
    raw = build_hint(_member("n1", epoch="100-aaaa"), NS, hashes, 2)
    restarted = _member("n1", epoch="200-bbbb")
    assert _reason(raw, hashes, {"n1": restarted}) == STALE_EPOCH


def test_a_peer_recently_live_at_the_hints_epoch_is_vouched_for_and_no_other() -> None:
    hashes = _chain(4)
    old = _member("n1", epoch="100-aaaa")
    raw = build_hint(old, NS, hashes, 2)
    registered_again = _member("n1", epoch="200-bbbb")

    def recent(peer_id: str, epoch: str | None) -> MemberRecord | None:
        return old if (peer_id, epoch) == ("n1", "100-aaaa") else None

    # left the table (its lease ran out), or back under a new epoch: the recent record serves the hint
    assert resolve_hint(raw, NS, hashes, {}, recent) is old
    assert resolve_hint(raw, NS, hashes, {"n1": registered_again}, recent) is old
    # a peer live now at the hint's epoch needs no voucher; nothing vouched for keeps its reason
    assert resolve_hint(raw, NS, hashes, {"n1": old}, lambda *_: None) is old
    other = build_hint(_member("n2", epoch="100-aaaa"), NS, hashes, 2)
    with pytest.raises(UnusableHint) as info:
        resolve_hint(other, NS, hashes, {}, recent)
    assert info.value.reason == UNKNOWN_PEER
    newer = build_hint(_member("n1", epoch="300-cccc"), NS, hashes, 2)
    with pytest.raises(UnusableHint) as info:
        resolve_hint(newer, NS, hashes, {"n1": registered_again}, recent)
    assert info.value.reason == STALE_EPOCH


def test_hint_for_another_namespace_is_wrong_namespace() -> None:
    hashes = _chain(4)
    member = _member()
    raw = build_hint(member, "other/ffffffffffffffff", hashes, 2)
    assert _reason(raw, hashes, {"n1": member}, namespace=NS) == WRONG_NAMESPACE


def test_hint_whose_deepest_block_is_not_among_the_requests_blocks_is_a_mismatch() -> None:
    member = _member()
    members = {"n1": member}
    hashes = _chain(6)
    raw = build_hint(member, NS, hashes, 4)
    # another request's chain
    assert _reason(raw, _chain(6), members) == MISMATCH
    # the request stops before the hint's deepest block
    assert _reason(raw, hashes[:3], members) == MISMATCH
    assert _reason(raw, [], members) == MISMATCH
    # the run an engine asks about past its device hit (a suffix) still matches
    assert resolve_hint(raw, NS, hashes[2:], members) is member
    # and the unchanged hint still resolves for its own request
    assert resolve_hint(raw, NS, hashes, members) is member


def test_hint_whose_peer_holds_less_than_the_device_is_behind_device_not_a_mismatch() -> None:
    member = _member()
    members = {"n1": member}
    hashes = _chain(6)
    raw = build_hint(member, NS, hashes, 4)
    assert json.loads(raw)["actions"][0]["payload"]["dkv"]["blocks"] == 6
    # the engine's device already holds blocks 0..3 (or more) and asks about the rest
    assert _reason(raw, hashes[4:], members) == BEHIND_DEVICE
    assert _reason(raw, hashes[5:], members) == BEHIND_DEVICE
    assert BEHIND_DEVICE not in REASONS  # not the hint's fault: never a rejected hint
    # a run that still includes the peer's deepest block uses the hint
    assert resolve_hint(raw, NS, hashes[3:], members) is member
    # a hint of another chain stays a mismatch
    assert _reason(raw, _chain(6), members) == MISMATCH


def test_hint_with_a_request_length_shorter_than_its_depth_is_unparseable() -> None:
    member = _member()
    doc = json.loads(build_hint(member, NS, _chain(6), 4))
    doc["actions"][0]["payload"]["dkv"]["blocks"] = 3
    assert _reason(json.dumps(doc), _chain(6), {"n1": member}) == UNPARSEABLE


def test_every_reason_constant_is_listed_and_distinct() -> None:
    assert set(REASONS) == {UNPARSEABLE, UNKNOWN_VERSION, UNKNOWN_PEER, STALE_EPOCH, WRONG_NAMESPACE, MISMATCH}
    assert len(set(REASONS)) == len(REASONS) == 6
    err = UnusableHint(MISMATCH, "detail")
    assert err.reason == MISMATCH and "detail" in str(err)
