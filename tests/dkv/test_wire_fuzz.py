"""Fuzzing the wire decoder and the framing of both transports: typed errors only, bounded allocation, round trips.

Pure functions (:mod:`dkv.wire`, :func:`dkv.transport.payload_plan`) are fed
arbitrary and mutated input directly. The framing of a UCX
:class:`~dkv.transport.Connection` runs over a scripted endpoint
(:class:`ScriptedEndpoint`: each posted receive takes the next queued message,
a message longer than its buffer fails as UCX's truncation does), and the
control socket's :class:`~dkv.stream_channel.StreamConnection` over a real
socket pair; neither needs a node or UCX.

Invariants: whatever the bytes, a decoder returns a valid value or raises a
:class:`~dkv.errors.DKVError` (a :class:`~dkv.errors.ProtocolError` for bad
input); no buffer larger than the bound is posted for a claimed length; a
body's decoding allocates in proportion to the bytes it has, never to the
lengths it claims; valid messages and payloads come back bit-exact.
"""

from __future__ import annotations

import tests.hypothesis_profiles  # noqa: F401  (first: loads the fuzz profile)

import asyncio
import socket
import struct
import tracemalloc
from collections import deque
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dkv import transport
from dkv.errors import DKVError, FrameTooLarge, ProtocolError
from dkv.stream_channel import StreamConnection
from dkv.wire import (
    FLAG_INLINE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_ENDS,
    MAX_FRAME,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    SCHEMAS,
    check_request,
    decode_body,
    decode_header,
    encode_body,
    encode_header,
)
from tests.hypothesis_profiles import examples

HANDSHAKE_FRAME = 4096  # the node's bound before authentication (dkv.server.HANDSHAKE_MAX_FRAME)
# What decoding a body may allocate beyond the body itself: Python objects for what the body
# holds (a few tens of bytes per msgpack byte at worst: a one-byte nil becomes a list slot and
# its bookkeeping) plus a constant. A body's claims (array and map lengths) must not count.
ALLOC_PER_BODY_BYTE = 64
ALLOC_CONSTANT = 256 * 1024


# ---- strategies ---------------------------------------------------------------------------------

hashes = st.one_of(st.binary(min_size=8, max_size=8), st.binary(min_size=32, max_size=32))
leaf_ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=64)
ids = st.integers(0, 2**63)
keys = st.lists(st.tuples(leaf_ids, st.integers(0, 63), hashes).map(list), max_size=8)
# a read's blocks by place in its lease's lookup: [leaf, shard, first, stop], first < stop
runs = st.lists(st.tuples(leaf_ids, st.integers(0, 63), st.integers(0, 1000), st.integers(1, 8)).map(
    lambda r: [r[0], r[1], r[2], r[2] + r[3]]), max_size=8)
namespaces = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:/=+-]{0,40}\Z")
short_text = st.text(min_size=1, max_size=256)
checksums = st.binary(min_size=16, max_size=16)


def _presence() -> dict[str, Any]:
    return {"hashes": st.lists(hashes, max_size=16), "leaves": st.lists(leaf_ids, min_size=1, max_size=4),
            "shards": st.integers(1, 64)}


@st.composite
def writes(draw: st.DrawFn) -> dict[str, Any]:
    ks = draw(keys)
    message = {"op": "write", "keys": ks, "sizes": draw(st.lists(st.integers(0, 2**40), min_size=len(ks),
                                                                  max_size=len(ks))),
               "shm": draw(st.booleans())}
    if draw(st.booleans()):
        message["sums"] = draw(st.lists(checksums, min_size=len(ks), max_size=len(ks)))
    return message


VALID_FIELDS: dict[str, dict[str, Any]] = {
    "hello": {"v": st.integers(0, 1 << 16), "ns": namespaces, "client": short_text, "host": short_text,
              "proof": st.none() | st.binary(max_size=64), "cnonce": st.binary(min_size=NONCE_SIZE,
                                                                                max_size=NONCE_SIZE),
              "tenant": st.none() | st.text(min_size=1, max_size=64)},
    "lookup": {**_presence(), "lease": st.booleans(), "group": st.integers(0, 1 << 20)},
    "probe": _presence(),
    "touch": _presence(),
    "read": {"lease": ids, "end": st.booleans(), "shm": st.booleans()},  # and keys or runs (valid_requests)
    "commit": {"write": ids},
    "abort": {"write": ids},
    "release": {"lease": ids},
    "end": {},
    "done": {"read": ids},
    "stats": {},
    "clear": {},
}


@st.composite
def valid_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A request every field of which its op's schema accepts (``ends`` sometimes)."""
    op = draw(st.sampled_from(sorted(SCHEMAS)))
    if op == "write":
        message = draw(writes())
    else:
        message = {"op": op, **{name: draw(value) for name, value in VALID_FIELDS[op].items()}}
    if op == "read":
        named = draw(st.sampled_from(["keys", "runs"]))
        message[named] = draw(keys if named == "keys" else runs)
    if op == "lookup" and draw(st.booleans()):
        message["slots"] = draw(st.booleans())
    if op == "lookup" and draw(st.booleans()):
        message["send"] = draw(st.integers(0, MAX_FRAME))
    if op == "lookup" and draw(st.booleans()):
        message["inline_sent"] = draw(st.booleans())
    if op != "hello" and draw(st.booleans()):
        message["ends"] = draw(st.lists(ids, max_size=8))
    return message


# anything msgpack can carry: the values a hostile peer may put in any field
wire_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
                | st.text(max_size=40) | st.binary(max_size=40))
wire_values = st.recursive(wire_scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=10)


@st.composite
def mutated_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request with fields dropped, replaced by anything, or added."""
    message = dict(draw(valid_requests()))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["drop", "replace", "add"]))
        names = sorted(message)
        if action == "drop" and names:
            message.pop(draw(st.sampled_from(names)))
        elif action == "replace" and names:
            message[draw(st.sampled_from(names))] = draw(wire_values)
        else:
            message[draw(st.text(max_size=10) | st.sampled_from(["op", "ends", "slots", "send", "inline_sent", "sums", "keys", "runs"]))] = draw(wire_values)
    return message


@st.composite
def container_claims(draw: st.DrawFn) -> bytes:
    """msgpack container headers claiming many elements, nested, with few or none of the elements sent."""
    parts = []
    for _ in range(draw(st.integers(1, 400))):
        kind = draw(st.sampled_from(["array16", "array32", "map16", "map32", "fixarray", "fixmap"]))
        n = draw(st.integers(0, 2**16 - 1))
        parts.append({"array16": b"\xdc" + struct.pack(">H", n), "array32": b"\xdd" + struct.pack(">I", n),
                      "map16": b"\xde" + struct.pack(">H", n), "map32": b"\xdf" + struct.pack(">I", n),
                      "fixarray": bytes([0x90 | n % 16]), "fixmap": bytes([0x80 | n % 16])}[kind])
        if draw(st.integers(0, 9)) == 0:
            parts.append(draw(st.binary(max_size=8)))
    return b"".join(parts)


def _mutate(data: bytes, draw: st.DrawFn) -> bytes:
    """Flip, insert, delete or truncate a few bytes of ``data``."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, len(out) - 1)))
        if action == "flip" and out:
            out[at] ^= draw(st.integers(1, 255))
        elif action == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete" and out:
            del out[at:at + draw(st.integers(1, 8))]
        else:
            del out[at:]
    return bytes(out)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    return _mutate(encode_body(draw(valid_requests())), draw)


# ---- the header -----------------------------------------------------------------------------


@settings(max_examples=examples(100))
@given(raw=st.binary(max_size=40), max_frame=st.integers(0, MAX_FRAME))
def test_any_bytes_decode_as_a_header_in_bounds_or_raise_a_protocol_error(raw: bytes, max_frame: int) -> None:
    try:
        length, flags = decode_header(raw, max_frame, with_flags=True)
    except ProtocolError:
        return
    assert 0 <= length <= max_frame and flags & ~FLAG_INLINE == 0


@settings(max_examples=examples(100))
@given(version=st.integers(0, 2**16 - 1), flags=st.integers(0, 2**16 - 1), length=st.integers(0, 2**32 - 1),
       reserved=st.integers(0, 2**32 - 1), max_frame=st.integers(0, MAX_FRAME))
def test_a_well_formed_header_is_accepted_only_within_its_bounds(version: int, flags: int, length: int,
                                                                  reserved: int, max_frame: int) -> None:
    raw = HEADER.pack(MAGIC, version, flags, length, reserved)
    acceptable = version == PROTOCOL_VERSION and flags & ~FLAG_INLINE == 0
    try:
        assert decode_header(raw, max_frame, with_flags=True) == (length, flags)
        assert acceptable and length <= max_frame
    except FrameTooLarge:
        assert acceptable and length > max_frame
    except ProtocolError:
        assert not acceptable


@settings(max_examples=examples(100))
@given(length=st.integers(0, MAX_FRAME), inline=st.booleans())
def test_headers_round_trip(length: int, inline: bool) -> None:
    flags = FLAG_INLINE if inline else 0
    assert decode_header(encode_header(length, flags), with_flags=True) == (length, flags)


# ---- bodies and requests --------------------------------------------------------------------


def _decode_or_protocol_error(raw: bytes) -> dict[str, Any] | None:
    try:
        message = decode_body(raw)
    except ProtocolError:
        return None
    assert isinstance(message, dict) and all(isinstance(k, str) for k in message)
    return message


@settings(max_examples=examples(100))
@given(raw=st.binary(max_size=2048) | mutated_bodies())
def test_any_bytes_decode_as_a_string_keyed_map_or_raise_a_protocol_error(raw: bytes) -> None:
    message = _decode_or_protocol_error(raw)
    if message is not None:
        _check_or_protocol_error(message)


def _peak_allocation(raw: bytes) -> int:
    tracemalloc.start()
    try:
        _decode_or_protocol_error(raw)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_handshake_sized_body_of_nested_array_claims_allocates_nothing_for_the_claims() -> None:
    # 1 365 nested "array of 65 535" headers: 4 095 bytes, within the node's pre-authentication
    # frame bound. msgpack allocated for each header's claim before any element arrived: about
    # 80 MiB for one stranger's 4 KiB.
    raw = b"\xdc\xff\xff" * 1365
    assert len(raw) <= HANDSHAKE_FRAME
    peak = _peak_allocation(raw)
    assert peak <= ALLOC_PER_BODY_BYTE * len(raw) + ALLOC_CONSTANT, (
        f"decoding a {len(raw)}-byte body allocated {peak >> 10} KiB")


@settings(max_examples=examples(15))
@given(raw=container_claims())
def test_decoding_allocates_in_proportion_to_the_body_never_to_its_claims(raw: bytes) -> None:
    peak = _peak_allocation(raw)
    assert peak <= ALLOC_PER_BODY_BYTE * len(raw) + ALLOC_CONSTANT, (
        f"decoding a {len(raw)}-byte body allocated {peak >> 10} KiB")


def _check_or_protocol_error(message: dict[str, Any]) -> str | None:
    try:
        op = check_request(message)
    except ProtocolError:
        return None
    assert op in SCHEMAS and message["op"] == op
    return op


@settings(max_examples=examples(60))
@given(message=mutated_requests() | st.dictionaries(st.text(max_size=10), wire_values, max_size=6))
def test_any_message_passes_its_schema_or_raises_a_protocol_error(message: dict[str, Any]) -> None:
    op = _check_or_protocol_error(message)
    if op is not None and "ends" in message and op != "hello":
        ends = message["ends"]
        assert isinstance(ends, list) and len(ends) <= MAX_ENDS


@settings(max_examples=examples(100))
@given(message=valid_requests())
def test_valid_requests_round_trip_through_the_wire_and_pass_their_schema(message: dict[str, Any]) -> None:
    decoded = decode_body(encode_body(message))
    assert decoded == message
    assert check_request(decoded) == message["op"]


# ---- payload plan ---------------------------------------------------------------------------


@settings(max_examples=examples(100))
@given(sizes=st.lists(st.sampled_from([1, 7, 8, 9, 4096, 64 * 1024, transport.DIRECT_MIN - 1,
                                       transport.DIRECT_MIN, 2**20, 3 * 2**20]) | st.integers(1, 2**21),
                      max_size=64))
def test_the_payload_plan_covers_every_buffer_once_in_order_within_the_group_bound(sizes: list[int]) -> None:
    plan = transport.payload_plan(sizes)
    assert [i for a, b in plan for i in range(a, b)] == list(range(len(sizes)))
    for a, b in plan:
        if b - a > 1:
            assert sum(sizes[a:b]) <= transport.GROUP_BYTES
            assert all(8 <= n < transport.DIRECT_MIN for n in sizes[a:b])
    for i, n in enumerate(sizes):
        if n >= transport.DIRECT_MIN or n < 8:
            assert (i, i + 1) in plan


@settings(max_examples=examples(100))
@given(blocks=st.lists(st.tuples(st.sampled_from([1, 8, 64 * 1024, transport.DIRECT_MIN - 1, transport.DIRECT_MIN,
                                                  transport.GROUP_BYTES // 4, transport.GROUP_BYTES - 8,
                                                  transport.GROUP_BYTES, 2**21]) | st.integers(1, 2**21),
                                 st.integers(0, 2) | st.just(0)),  # the gap before each buffer (mostly none)
                       max_size=64))
def test_a_plan_over_the_senders_offsets_joins_only_back_to_back_buffers_and_survives_its_announcement(
        blocks: list[tuple[int, int]]) -> None:
    sizes = [n for n, _ in blocks]
    offsets, at = [], 0
    for n, gap in blocks:
        at += gap * 4096
        offsets.append(at)
        at += n
    plan = transport.payload_plan(sizes, offsets)
    assert [i for a, b in plan for i in range(a, b)] == list(range(len(sizes)))
    for a, b in plan:
        if b - a > 1:
            assert sum(sizes[a:b]) <= transport.GROUP_BYTES and min(sizes[a:b]) >= 8
            if max(sizes[a:b]) >= transport.DIRECT_MIN:  # joined large buffers: all large, back to back
                assert min(sizes[a:b]) >= transport.DIRECT_MIN
                assert all(offsets[i] + sizes[i] == offsets[i + 1] for i in range(a, b - 1))
    assert transport.plan_from_groups(transport.plan_groups(plan), sizes) == plan
    assert len(plan) <= len(transport.payload_plan(sizes)), "joining never makes more messages"


@settings(max_examples=examples(200))
@given(size=st.sampled_from([1, 7, 8, 9, 4096, 64 * 1024, transport.DIRECT_MIN - 1, transport.DIRECT_MIN,
                             transport.DIRECT_MIN + 8, transport.GROUP_BYTES // 3, transport.GROUP_BYTES // 2,
                             transport.GROUP_BYTES - 8, transport.GROUP_BYTES, 2**21]) | st.integers(1, 2**21),
       count=st.integers(0, 300), layout=st.sampled_from(["none", "back to back", "a gap", "reversed"]),
       gap_at=st.integers(0, 299))
def test_a_plan_of_blocks_all_one_size_is_the_walks_plan(size: int, count: int, layout: str, gap_at: int) -> None:
    # (the counted-out plan of a read's usual blocks must cut exactly where the buffer-by-buffer walk does,
    # or the two sides of a read would disagree about its messages)
    sizes = [size] * count
    offsets = None if layout == "none" else [4096 + i * size for i in range(count)]
    if offsets is not None and layout == "a gap" and count:
        offsets = [o + (4096 if i >= gap_at % count else 0) for i, o in enumerate(offsets)]
    elif offsets is not None and layout == "reversed":
        offsets.reverse()
    plan = transport.payload_plan(sizes, offsets)
    assert plan == transport._walked_plan(sizes, offsets)  # noqa: SLF001
    # the receiver takes the cut as told, and refuses one more block in a message than the bound lets in
    assert transport.plan_from_groups(transport.plan_groups(plan), sizes) == plan
    if plan:  # the same counts as floats (4.0 == 4) or bools (True == 1) are not counts
        with pytest.raises(ProtocolError):
            transport.plan_from_groups([float(g) for g in transport.plan_groups(plan)], sizes)
        if set(transport.plan_groups(plan)) == {1}:
            with pytest.raises(ProtocolError):
                transport.plan_from_groups([True] * len(plan), sizes)
    if len(plan) > 1 and plan[0][1] - plan[0][0] > 1 and (plan[0][1] - plan[0][0] + 1) * size > transport.GROUP_BYTES:
        greedy = [plan[0][1] - plan[0][0] + 1] + transport.plan_groups(plan)[1:]
        greedy[1] -= 1
        if greedy[1] == 0:
            del greedy[1]
        with pytest.raises(ProtocolError):
            transport.plan_from_groups(greedy, sizes)


@settings(max_examples=examples(200))
@given(sizes=st.lists(st.sampled_from([1, 8, 64 * 1024, transport.GROUP_BYTES // 2, transport.GROUP_BYTES]),
                      max_size=16),
       groups=st.none() | st.integers() | st.text(max_size=4)
       | st.lists(st.integers(-2, 20) | st.booleans() | st.floats() | st.none(), max_size=20))
def test_an_announced_plan_is_either_refused_or_a_valid_cut(sizes: list[int], groups: Any) -> None:
    try:
        plan = transport.plan_from_groups(groups, sizes)
    except ProtocolError:
        return
    assert [i for a, b in plan for i in range(a, b)] == list(range(len(sizes)))
    assert all(b - a == 1 or (sum(sizes[a:b]) <= transport.GROUP_BYTES and min(sizes[a:b]) >= 8) for a, b in plan)


# ---- UCX framing over a scripted endpoint ---------------------------------------------------


class Truncated(Exception):
    """What UCX raises when a message is longer than the buffer posted for it."""


class ScriptedEndpoint:
    """A UCX endpoint stand-in: receives take queued messages in posting order; sends are recorded.

    ``posted`` records the size of every receive buffer the connection posted
    (what it allocated on the strength of a header). An empty queue fails the
    receive at once, as a peer that went away does.
    """

    def __init__(self, messages: list[bytes] | None = None) -> None:
        self.inbox: deque[bytes] = deque(messages or [])
        self.sent: list[bytes] = []
        self.posted: list[int] = []
        self.closed = False

    def recv(self, buffer: Any) -> Any:
        view = memoryview(buffer).cast("B")
        self.posted.append(view.nbytes)
        message = self.inbox.popleft() if self.inbox else None

        async def land() -> None:
            if message is None:
                raise ConnectionResetError("the peer went away")
            if len(message) > view.nbytes:
                raise Truncated(f"message of {len(message)} bytes into a buffer of {view.nbytes}")
            view[:len(message)] = message

        return land()

    def send(self, data: Any) -> Any:
        self.sent.append(bytes(memoryview(data).cast("B")))

        async def done() -> None:
            return None

        return done()

    def abort(self, period: int = 0) -> None:
        self.closed = True

    async def close(self, period: int = 0) -> None:
        self.closed = True


def _frames(message: dict[str, Any]) -> list[bytes]:
    """The UCX messages a sender makes of ``message`` (one inline, or header then body)."""
    body = encode_body(message)
    if len(body) <= transport.INLINE_MAX:
        return [encode_header(len(body), FLAG_INLINE) + body]
    return [encode_header(len(body)), body]


async def _receive_framed(messages: list[bytes], max_frame: int) -> tuple[dict[str, Any] | None, list[int], bool]:
    """Run one ``recv_message`` over scripted UCX messages: (message or None on a DKVError, posted sizes, aborted)."""
    endpoint = ScriptedEndpoint(messages)
    conn = transport.Connection(endpoint, "scripted", max_frame=max_frame)
    try:
        try:
            message = await conn.recv_message(2.0)
        except DKVError:
            message = None
        return message, endpoint.posted, conn.closed
    finally:
        conn.abort()


@st.composite
def ucx_message_runs(draw: st.DrawFn) -> list[bytes]:
    """The UCX messages of a valid request, mutated; or arbitrary ones; or a bare header claiming anything."""
    kind = draw(st.sampled_from(["mutated", "random", "claim"]))
    if kind == "mutated":
        frames = _frames(draw(valid_requests()))
        return [_mutate(f, draw) if draw(st.booleans()) else f for f in frames]
    if kind == "random":
        return draw(st.lists(st.binary(max_size=transport.HEADER_SIZE + 64), min_size=0, max_size=3))
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, draw(st.sampled_from([0, FLAG_INLINE])),
                         draw(st.integers(0, 2**32 - 1)), 0)
    return [header] + draw(st.lists(st.binary(max_size=64), max_size=1))


@settings(max_examples=examples(150))
@given(messages=ucx_message_runs(), max_frame=st.sampled_from([HANDSHAKE_FRAME, MAX_FRAME]))
def test_ucx_framing_of_garbage_raises_typed_errors_and_posts_no_buffer_beyond_the_bound(
        messages: list[bytes], max_frame: int) -> None:
    message, posted, _ = asyncio.run(_receive_framed(messages, max_frame))
    assert posted, "the fixed-size first receive is always posted"
    assert posted[0] == transport.HEADER_SIZE + transport.INLINE_MAX
    assert all(n <= max_frame for n in posted[1:]), f"posted {posted} under a bound of {max_frame}"
    if message is not None:
        _check_or_protocol_error(message)


@settings(max_examples=examples(60))
@given(message=valid_requests(), pad=st.sampled_from([0, 1, transport.INLINE_MAX, 3 * transport.INLINE_MAX]))
def test_valid_messages_round_trip_through_ucx_framing(message: dict[str, Any], pad: int) -> None:
    if pad:
        message = {**message, "pad": b"\xa5" * pad}  # a body beyond INLINE_MAX takes the two-message path

    async def run() -> None:
        endpoint = ScriptedEndpoint()
        sender = transport.Connection(endpoint, "sender")
        try:
            await sender.send_message(message, 2.0)
            await sender._settle(2.0)
        finally:
            sender.abort()
        got, posted, aborted = await _receive_framed(endpoint.sent, MAX_FRAME)
        assert got == message and not aborted

    asyncio.run(run())


def _payloads(draw: st.DrawFn) -> list[bytes]:
    sizes = draw(st.lists(st.sampled_from([8, 9, 100, 4096, 64 * 1024, transport.DIRECT_MIN, 1, 3]),
                          min_size=1, max_size=40))
    seed = draw(st.integers(0, 255))
    return [bytes((seed + i + j) % 251 for j in range(n)) if n < 256 else bytes([(seed + i) % 251]) * n
            for i, n in enumerate(sizes)]


@st.composite
def payload_cases(draw: st.DrawFn) -> tuple[list[bytes], list[int] | None, bool]:
    """Payload buffers; where a differently batching sender ends its messages (byte offsets into the
    buffers' bytes back to back; None: the messages :func:`payload_plan` gives); whether dests lie back to back."""
    sources = _payloads(draw)
    total = sum(len(s) for s in sources)
    ends = draw(st.none() | st.lists(st.integers(1, max(1, total - 1)), min_size=1, max_size=8))
    return sources, ends, draw(st.booleans())


def _recut(sources: list[bytes], ends: list[int]) -> list[bytes]:
    """The buffers' bytes, back to back, as messages that end at the byte offsets ``ends`` (and at the end)."""
    data = b"".join(sources)
    cuts = sorted({*(e for e in ends if 0 < e < len(data)), len(data)})
    out, start = [], 0
    for end in cuts:
        out.append(data[start:end])
        start = end
    return out


def _cut_where_no_canary_tells(sources: list[bytes], ends: list[int]) -> bool:
    """Whether a cut falls in the last 7 bytes of a receive (one per group of :func:`payload_plan`): a message
    that ends there overwrote part of the receive's canary, which then reads as data (a buffer under 8 bytes,
    received alone, is all such bytes). A cut anywhere else in a group, a buffer's tail included, is caught."""
    sizes = [len(s) for s in sources if s]
    at = 0
    for start, stop in transport.payload_plan(sizes):
        end = at + sum(sizes[start:stop])
        if any(end - transport._CANARY < e < end and e > at for e in ends):  # noqa: SLF001
            return True
        at = end
    return False


@settings(max_examples=examples(60))
@given(case=payload_cases())
def test_payloads_arrive_bit_exact_or_fail_typed_however_the_sender_cuts_its_messages(
        case: tuple[list[bytes], list[int] | None, bool]) -> None:
    # A message cut anywhere (inside a buffer too) is caught by the canaries: UCX does not say how long
    # a message was, so a group is one message and a short one is refused. Except a cut in a group's
    # last 7 bytes: the message then overwrote part of the 8-byte canary, and what is left of it reads
    # as data (telling it apart would refuse 1 in 256 good groups); the block's checksum catches that.
    sources, ends, adjacent = case
    assume(ends is None or not _cut_where_no_canary_tells(sources, ends))

    async def run() -> None:
        out = ScriptedEndpoint()
        sender = transport.Connection(out, "sender")
        try:
            await sender.send_payloads(sources, 2.0)
        finally:
            sender.abort()
        messages = out.sent if ends is None else _recut([s for s in sources if s], ends)
        if adjacent:
            whole = bytearray(sum(len(s) for s in sources))
            view, dests, at = memoryview(whole), [], 0
            for s in sources:
                dests.append(view[at:at + len(s)])
                at += len(s)
        else:
            dests = [bytearray(len(s)) for s in sources]
        receiver = transport.Connection(ScriptedEndpoint(messages), "receiver")
        try:
            await receiver.recv_payloads(dests, 2.0)
        except DKVError:
            assert ends is not None, "the sender's own messages must be received"
            return
        finally:
            receiver.abort()
        assert [bytes(d) for d in dests] == sources

    asyncio.run(run())


# ---- the control socket's framing ------------------------------------------------------------


async def _stream_receive(data: bytes, max_frame: int) -> dict[str, Any] | None:
    """Write ``data`` into a socket pair and close; one ``recv_message`` on the other end (None on a DKVError)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = StreamConnection(ours, "fuzz", max_frame=max_frame)
    try:
        theirs.sendall(data)
        theirs.close()
        try:
            return await conn.recv_message(2.0)
        except DKVError:
            return None
    finally:
        conn.abort()
        theirs.close()


@st.composite
def stream_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["mutated", "random", "claim"]))
    if kind == "random":
        return draw(st.binary(max_size=256))
    if kind == "claim":
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, draw(st.integers(0, 2**32 - 1)), 0) + draw(
            st.binary(max_size=64))
    body = encode_body(draw(valid_requests()))
    return _mutate(encode_header(len(body)) + body, draw)


@settings(max_examples=examples(100))
@given(data=stream_bytes(), max_frame=st.sampled_from([HANDSHAKE_FRAME, MAX_FRAME]))
def test_control_socket_framing_of_garbage_raises_typed_errors_and_allocates_within_the_bound(
        data: bytes, max_frame: int) -> None:
    allocated: list[int] = []
    real_mmap = transport.mmap.mmap

    def spy(fileno: int, length: int, *args: Any, **kwargs: Any) -> Any:
        allocated.append(length)
        return real_mmap(fileno, length, *args, **kwargs)

    import dkv.stream_channel as stream_channel
    stream_channel.mmap.mmap = spy  # (the one mmap module: restored below)
    try:
        message = asyncio.run(_stream_receive(data, max_frame))
    finally:
        stream_channel.mmap.mmap = real_mmap
    assert all(n <= max_frame for n in allocated), f"mapped {allocated} under a bound of {max_frame}"
    if message is not None:
        _check_or_protocol_error(message)


@settings(max_examples=examples(60))
@given(message=valid_requests())
def test_valid_messages_round_trip_through_the_control_socket(message: dict[str, Any]) -> None:
    body = encode_body(message)
    assert asyncio.run(_stream_receive(encode_header(len(body)) + body, MAX_FRAME)) == message


@pytest.mark.parametrize("length", [HEADER_SIZE, 0])
def test_a_control_socket_closed_mid_frame_is_a_transport_error_not_a_hang(length: int) -> None:
    frame = encode_header(100) + b"x" * 10  # announces 100 body bytes, sends 10, closes
    assert asyncio.run(_stream_receive(frame[:length or len(frame)], MAX_FRAME)) is None
