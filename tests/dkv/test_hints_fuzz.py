"""Fuzzing the request's hint: whatever arrives, a usable peer, no hint, or an unusable hint with its reason.

:func:`dkv.hints.resolve_hint` (and :func:`~dkv.hints.parse_hint` under it) is
fed arbitrary text and bytes, arbitrary JSON documents, and well-formed hints
with parts mangled; the connector's scheduler side
(:meth:`connector.scheduler_side.SchedulerSide.source`) is fed the same and
must turn each into a counted miss on the co-located node, counted under the
reason :func:`resolve_hint` gives (never a catch-all). Valid hints round-trip.
Pure logic: no etcd, no node.
"""

from __future__ import annotations

import tests.hypothesis_profiles  # noqa: F401  (first: loads the fuzz profile)

import json
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.scheduler_side import SchedulerSide
from connector.types import full_attention
from dkv.etcd import MemberRecord
from dkv.hints import BEHIND_DEVICE, REASONS, Hint, UnusableHint, build_hint, parse_hint, resolve_hint
from tests.hypothesis_profiles import examples

NS = "tenant/0123456789abcdef"
LOCAL = "10.0.0.1:7420"
REASONS_ALL = (*REASONS, BEHIND_DEVICE)

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
hashes_of = st.sampled_from([8, 32]).flatmap(
    lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=1, max_size=12, unique=True))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=15)


def _member(node_id: str = "n1", epoch: str = "1700000000-deadbeef") -> MemberRecord:
    return MemberRecord(node_id=node_id, address="10.0.0.7:7420", epoch=epoch, protocol_version=1,
                        started_at=1.0, host_id="h1")


MEMBERS = {"n1": _member(), "n2": _member("n2", "e2")}
HASHES = [bytes([i]) * 32 for i in range(8)]


def _resolved_or_reason(raw: Any, hashes: list[bytes] = HASHES, members: dict[str, MemberRecord] = MEMBERS,
                        namespace: str = NS) -> MemberRecord | str | None:
    """A member, None (no hint) or the unusable hint's reason; anything else raised fails the test."""
    try:
        member = resolve_hint(raw, namespace, hashes, members)
    except UnusableHint as exc:
        assert exc.reason in REASONS_ALL, f"reason {exc.reason!r} is not a known one"
        return exc.reason
    assert member is None or member in members.values()
    return member


@st.composite
def mangled_hints(draw: st.DrawFn) -> str:
    """A well-formed hint for HASHES with one to three of its values replaced, dropped, or added."""
    doc = json.loads(build_hint(draw(st.sampled_from(list(MEMBERS.values()))), NS, HASHES,
                                draw(st.integers(1, len(HASHES)))))
    for _ in range(draw(st.integers(1, 3))):
        # walk down to a random container of the document
        node: Any = doc
        while True:
            children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            containers = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
            if not containers or draw(st.booleans()):
                break
            node = draw(st.sampled_from(containers))[1]
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        if action == "replace" and keys:
            node[draw(st.sampled_from(keys))] = draw(json_values)
        elif action == "drop" and keys:
            del node[draw(st.sampled_from(keys))]
        elif isinstance(node, dict):
            node[draw(st.text(max_size=12))] = draw(json_values)
        else:
            node.append(draw(json_values))
    return json.dumps(doc)


any_raw = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200),
    json_values.map(json.dumps),
    mangled_hints(),
    mangled_hints().map(str.encode),
    mangled_hints().map(lambda s: s[: len(s) // 2]),  # cut short
    json_values,  # not text at all: a caller handing over whatever it got
)


@settings(max_examples=examples(150))
@given(raw=any_raw)
def test_any_hint_resolves_to_a_member_or_is_unusable_with_a_reason(raw: Any) -> None:
    if raw is None:
        assert _resolved_or_reason(raw) is None
        return
    assert _resolved_or_reason(raw) is not None, "a present hint names a member or is unusable"


@settings(max_examples=examples(20))
@given(depth=st.integers(900, 1100), where=st.sampled_from(["protocol_version", "version", "dkv", "instances"]),
       opener=st.sampled_from(["[", '{"a":']))
def test_nesting_near_the_recursion_limit_is_unusable_never_a_recursion_error(depth: int, where: str,
                                                                             opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    nested = opener * depth + "0" * (opener != "[") + closer * depth
    if where == "dkv":
        raw = ('{"protocol_version":1,"actions":[{"action_type":"kv.fetch","action_version":1,'
               '"payload":{"dkv":{"version":%s}}}]}' % nested)
    elif where == "instances":
        raw = '{"version":2,"instances":[{"instance_name":%s}]}' % nested
    else:
        raw = '{"%s":%s,"%s":[]}' % (where, nested, "actions" if where == "protocol_version" else "instances")
    assert _resolved_or_reason(raw) in REASONS_ALL


@settings(max_examples=examples(80))
@given(node_id=names, epoch=names, hashes=hashes_of, data=st.data(), as_bytes=st.booleans())
def test_valid_hints_round_trip_and_resolve_to_their_member(node_id: str, epoch: str, hashes: list[bytes],
                                                            data: st.DataObject, as_bytes: bool) -> None:
    member = _member(node_id, epoch)
    depth = data.draw(st.integers(1, len(hashes)))
    raw = build_hint(member, NS, hashes, depth)
    hint = parse_hint(raw.encode() if as_bytes else raw)
    assert hint == Hint(peer_id=node_id, epoch=epoch, namespace=NS, depth=depth, deepest_hash=hashes[depth - 1],
                        endpoint=f"ucx://{member.address}", blocks=len(hashes))
    # the engine may ask about any run from its device hit on that still holds the deepest block
    start = data.draw(st.integers(0, depth - 1))
    assert resolve_hint(raw, NS, hashes[start:], {node_id: member}) is member


# ---- the connector's use of it --------------------------------------------------------------


def _scheduler_side() -> SchedulerSide:
    side = SchedulerSide({"full": full_attention(0, 1)}, [{"full": [torch.zeros(4, 16, dtype=torch.uint8)]}],
                         namespace=NS, node_address=LOCAL, clock=lambda: 1000.0)
    side.node_id = "local"

    class Directory:
        members = MEMBERS

    side.router = Directory()  # type: ignore[assignment]
    return side


@settings(max_examples=examples(100))
@given(raw=any_raw.filter(lambda r: isinstance(r, (str, bytes))))
def test_the_connector_serves_an_unusable_hint_as_a_miss_counted_under_its_own_reason(raw: str | bytes) -> None:
    side = _scheduler_side()
    expected = _resolved_or_reason(raw)
    address, is_peer = side.source(HASHES, raw if isinstance(raw, bytes) else raw.encode())
    counted = dict(side.counters.unusable_hints)
    if isinstance(expected, MemberRecord):
        assert (address, is_peer) == (expected.address, True) and not counted
        return
    assert (address, is_peer) == (LOCAL, False)
    if expected == BEHIND_DEVICE:
        assert side.counters.hints_behind_device == 1 and not counted
    else:
        assert counted == {expected: 1}, f"counted {counted}, resolve_hint says {expected!r}"
