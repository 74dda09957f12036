"""The wire protocol: frame header, msgpack bodies, and validation before allocation.

Every control message starts with a fixed 16-byte header (magic, protocol
version, flags, body length). A body of at most ``INLINE_MAX`` bytes (see
:mod:`dkv.transport`) travels in the same UCX message, after the header, with
flag ``FLAG_INLINE``; a larger one follows as a second UCX message of exactly
the announced length. The receiver posts one fixed-size receive for the first
message, and checks the header (magic, version, known flags, length bound)
before any larger buffer is allocated; the body is decoded with msgpack's own
length limits, then checked field by field against the op's schema. Block
bytes never pass through msgpack: after a ``read`` reply the node sends the
blocks, and after a ``write`` reply the client sends the accepted blocks, as
a sequence of UCX messages (:func:`dkv.transport.payload_plan`: small blocks
batched into one message, large ones each in their own), straight from and
into arena slots where they lie back to back. The node cuts them, by their
sizes and by where its slots lie: it also joins blocks under 1 MiB whose
slots lie back to back (protocol 4). A listener ``read`` or ``write`` reply
carries that cut as ``"groups"``, each message's count of (non-empty)
blocks, and the client checks it (:func:`dkv.transport.plan_from_groups`)
before it posts a receive or sends a byte; a reply without it means the cut
from the sizes alone.

Handshake (mutual: each side proves the credential over the other's nonce)::

    node   → client   {"t": "challenge", "v": 4, "nonce": <16 bytes>, "node": id,
                       "local": path of a tokenless node's credential file | None}
    client → node     {"op": "hello", "v": 4, "ns": namespace, "client": id,
                       "tenant": tenant name | None (None: the cluster credential),
                       "cnonce": <16 bytes>, "proof": client_proof(...) | None, "host": host id}
    node   → client   {"ok": true, "node": id, "epoch": str, "host": host id,
                       "proof": node_proof(...), "limits": {...},
                       "shm": {"socket", "ticket", "access", "control"} | None,
                       "peer_control": TCP port | None, "features": [str, ...]}

``shm`` is offered only to a client on the node's host: redeeming the
one-time ``ticket`` on the node's Unix socket (:mod:`dkv.handover`) hands
over the client's own namespace segment by file descriptor, read-only for a
read-only credential, and only then may the connection use ``shm`` reads and
writes. ``control`` names the node's control socket (:mod:`dkv.stream_channel`):
the same protocol, framed the same way, over an abstract Unix stream socket,
where a same-host client opens its connections once it has met the node over
UCX (it checks that the node id and epoch there are the same).
``peer_control`` is the port of the same control protocol over TCP, on the
host the client dialled, for a client on another host (or on the listener
path): it opens its calling-thread channel there (:mod:`dkv.direct_channel`).
A leased lookup there that asks for its blocks (``send``) gets them right
after the answer on that stream. ``features`` lists what the node serves
beyond the base protocol (:data:`FEATURES`); a client of a newer build uses
a feature only where its node lists it, and reads an absent or malformed
list as none.

Ops after the handshake (each answered by ``{"ok": true, ...}`` or
``{"ok": false, "code": str, "msg": str}``): ``lookup``, ``probe``, ``read``,
``done``, ``write``, ``commit``, ``abort``, ``touch``, ``release``, ``end``,
``stats``, ``clear``.

One round trip per same-host load: a leased ``lookup`` with ``"slots": true``
on a connection handed its segment is answered with ``"slots"`` as well, per
leaf ``[offsets, sizes, sums]`` over hashes x shards (offsets and sizes as
native int64 arrays, sums as 16-byte checksums back to back; offset ``-1``
where the lease holds no block or the block has no checksum). The client
copies those slots itself under the lease's pins and checks every copied
block against its checksum: a match proves the bytes are the block's, so no
``read``/``done`` is needed; a block that does not match (the lease ended
meanwhile, and its slot was reused) is read the two-step way below, which
tells an ended lease from corruption. A client copies only while it knows
the lease live (before its TTL, before its own next lookup of the group or
release); otherwise it reads the two-step way, which the node refuses.

The client then ends the lease without a round trip of its own: any request
after the handshake may carry ``"ends"``, a list of (at most 1024) lease ids
the client loaded from; before the op itself, the node ends them, and stamps
their blocks as one use (before the op, or for a lookup on a node without a
disk tier right after its reply is sent, off the lookup's critical path;
a request that runs while that send waits sees those blocks' previous
stamps, which can change eviction order only). A client with no request to send soon
sends an empty ``end`` op to carry them.

One round trip per small listener load: a leased ``lookup`` may ask for
its blocks' bytes with ``"send": N``. Where the leased blocks come to at
most N bytes (and the node's ``max_lookup_payload``; at most 1,024 blocks,
each stored with a checksum) and the connection was not handed its segment,
the node reads every leased block as a ``read`` with ``end`` would (its own
pins; the lease ends at once) and answers with ``"sent": {"sizes": [...],
"sums": [...], "groups": [...]}`` besides the masks, lease id and TTL, then
sends the blocks as a ``read`` reply's payload (on a stream connection, the
node's TCP control socket, right after the answer in the same write, with no
``groups``: a stream has no messages to cut). Their order: leaf by leaf as
asked, hash by hash where that leaf's mask is set, shard by shard. The client
checks every block against its checksum as it lands and keeps the bytes for
the lease's load, which then copies them without asking the node; the lease
id names that load, and the node holds nothing for it any more (a
``release`` of it is not sent). Otherwise the answer is a plain one (no
``sent``) and the load reads the two-step way. A UCX client that also says
``"inline_sent": true`` posts its receive for the answer with room for
``send`` bytes after the largest inline body; the node may then put the
blocks in the answer's own message, after its body (flag ``FLAG_TRAILING``,
their total in the header's last field, ``groups`` then moot), when the body
is inline: one message instead of two, each side posting and completing one
UCX request fewer. A receiver that made no such room refuses a header with
``FLAG_TRAILING`` (:func:`decode_header`).

A ``read`` names its blocks (all held by its ``lease``) either by key,
``"keys": [[leaf, shard, hash], ...]``, or, where the node's handshake reply
lists ``"read_runs"`` in its ``"features"``, by their place in the lookup
that granted the lease: ``"runs": [[leaf, shard, first, stop], ...]``, each
the blocks of that leaf and shard whose hashes were at ``first`` ..
``stop - 1`` in the lookup's hash list (a hash the lookup named twice is
held at each of its places where the lookup was of one shard, at its last
otherwise), in that order. Exactly one of the two. A run of 256 blocks is a
few bytes where their keys are ~10 KB (over UCX's eager size: a rendezvous
more), and the node finds their blocks without building or looking up a key
per block. A place the lease does not hold is refused as an uncovered key
is (``lease_expired``).

Reads pin for themselves: a ``read`` takes its own pins on its blocks (and,
with ``end``, ends its lease at once), held until the bytes have left. On the
listener path that is when the node's sends finish; on the same-host path
(``shm``) the reply carries the slots' offsets and a ``read`` id, the client
copies out of the mapped arena and then sends ``{"op": "done", "read": id}``,
answered ``{"intact": bool}``: False when the read's pins had already ended
(read TTL, or a reconnect), so the copy may be torn and must be discarded.

Block checksums (:mod:`dkv.checksum`): ``write`` may carry ``"sums"``, one
16-byte checksum per key (absent from a client that sends none: such blocks
are stored without one). Before the reserved blocks become visible the node
checks each declared checksum against the bytes now in its slot (unless it
runs with ``--no-verify-writes``); a block that does not match is not
committed, and the commit reply (of ``commit``, or the listener path's final
reply to ``write``) says ``{"committed": n, "rejected": m}``. Every ``read``
reply (both paths) carries ``"sums"``: per block its checksum, or ``None``
for a block stored without one; the client checks the bytes it received.

Packed hashes: where the node lists ``"packed_hashes"`` in its ``features``,
a ``lookup``, ``probe`` or ``touch`` may carry its hashes as one byte string,
``"hashes": <bytes>``, all of one length given by ``"hash_size"`` (8 or 32),
back to back, instead of a list: for 256 hashes one msgpack item each way
instead of 256 (the client's encoding ~10 → ~2 µs, the node's decoding and
check ~15 → ~9 µs). The node cuts them into the list before it checks the
request against its schema (:func:`check_request`), so everything after
sees the same request either way; a packed string whose length is not a
multiple of ``hash_size``, a missing or other ``hash_size``, or more than
``MAX_KEYS`` hashes is malformed (:class:`ProtocolError`). Hashes of mixed
lengths travel as a list.

Optional fields: a schema may mark a field :func:`optional`; it may then be
absent, and is validated like any other field when present. Every other
field is required.
"""

from __future__ import annotations

import hashlib
import hmac
import operator
import struct
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from dkv.checksum import CHECKSUM_SIZE
from dkv.errors import FrameTooLarge, ProtocolError
from dkv.keys import HASH_LENGTHS, MAX_LEAF_ID_LENGTH, MAX_TP_SHARDS, check_namespace, pack_hashes, plain_hashes, split_hashes

PROTOCOL_VERSION = 4  # 3: bodies inline with their header (FLAG_INLINE), batched payload messages;
# 4: a listener read's or write's payload messages as the node cut them ("groups")
MAGIC = b"dKV\x01"
HEADER = struct.Struct("<4sHHII")  # magic, protocol version, flags, body length, reserved
HEADER_SIZE = HEADER.size
FLAG_INLINE = 0x1  # the body follows the header in the same UCX message (else: as the next message)
# (with FLAG_INLINE) more bytes follow the body in the same UCX message, as many as the header's last field
# says: the blocks a lookup sends with its answer, to a client that asked for them so ("inline_sent")
FLAG_TRAILING = 0x2
HEADER_FLAGS = FLAG_INLINE | FLAG_TRAILING  # every flag this side knows; a header with another is refused
MAX_FRAME = 8 * 2**20
MAX_KEYS = 65536
MAX_LEAVES = 64
NONCE_SIZE = 16

_UNPACK_LIMITS = dict(
    max_bin_len=MAX_FRAME,
    max_str_len=1 << 16,
    max_array_len=MAX_KEYS,
    max_map_len=1024,
    max_ext_len=0,
)


def encode_header(body_length: int, flags: int = 0, trailing: int = 0) -> bytes:
    """A header announcing ``body_length`` bytes; ``flags`` 0 (body as the next message) or ``FLAG_INLINE``.

    ``trailing``: with ``FLAG_INLINE | FLAG_TRAILING``, how many bytes follow
    the body in the same message.
    """
    if body_length > MAX_FRAME or trailing > MAX_FRAME:
        raise FrameTooLarge(f"frame of {max(body_length, trailing)} bytes exceeds the {MAX_FRAME}-byte bound")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, flags, body_length, trailing)


def decode_frame_header(raw: bytes | bytearray | memoryview, max_frame: int = MAX_FRAME) -> tuple[int, int, int]:
    """``(body length, flags, trailing bytes)`` a header announces (``raw`` may run on: only its first HEADER_SIZE bytes count).

    :class:`ProtocolError` if the header is not ours, carries a flag this
    side does not know, or announces trailing bytes without an inline body
    (or more than ``MAX_FRAME`` of them); :class:`FrameTooLarge` for a body
    over ``max_frame``. Trailing bytes are 0 unless ``FLAG_TRAILING`` is set.
    """
    if len(raw) < HEADER_SIZE:
        raise ProtocolError(f"frame header of {len(raw)} bytes, not {HEADER_SIZE}")
    magic, version, flags, length, trailing = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic: not a dKV peer, or a garbled stream")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})")
    if flags & ~HEADER_FLAGS:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if flags & FLAG_TRAILING and (not flags & FLAG_INLINE or trailing > MAX_FRAME):
        raise ProtocolError(f"a frame's {trailing} trailing bytes need an inline body and at most {MAX_FRAME}")
    if length > max_frame:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the {max_frame}-byte bound")
    return length, flags, trailing if flags & FLAG_TRAILING else 0


def decode_header(raw: bytes | bytearray | memoryview, max_frame: int = MAX_FRAME, *,
                  with_flags: bool = False) -> int | tuple[int, int]:
    """Body length announced by a header (see :func:`decode_frame_header`), for a receiver that takes no trailing bytes.

    With ``with_flags``, ``(length, flags)``. :class:`ProtocolError` also for
    a header that announces trailing bytes (``FLAG_TRAILING``): only a
    receiver that made room for them may take them.
    """
    length, flags, _ = decode_frame_header(raw, max_frame)
    if flags & FLAG_TRAILING:
        raise ProtocolError("a frame with trailing bytes where none were asked for")
    return (length, flags) if with_flags else length


def encode_body(message: Mapping[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


# msgpack allocates each array or map it meets for the length its header claims, before any
# element is read: a 4 KiB body of nested headers each claiming 65 535 elements made it allocate
# about 80 MiB (tracemalloc's peak), and a node's memory peak rose 68 MiB. A body over this size
# is first walked without building anything (Unpacker.skip), which fails on a claim the body does
# not back; at or under it, claims are capped by the body's length, so decoding allocates a few
# hundred KiB at most.
_PRESCAN_OVER = 512


def decode_body(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode a body; :class:`ProtocolError` unless it is a msgpack map with string keys.

    Allocates in proportion to the body's bytes, never to the lengths it
    claims: a claim the body does not back is refused before anything is
    built for it.
    """
    size = len(raw)
    try:
        if size > _PRESCAN_OVER:
            walker = msgpack.Unpacker(max_buffer_size=size)  # its own length limits: the body's size
            walker.feed(raw)
            walker.skip()  # builds nothing: raises OutOfData where a claim outruns the body
            message = msgpack.unpackb(raw, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
        else:
            # unpackb's own limits are then the tighter ones: every length at most the body's size, maps
            # half of it (msgpack >= 1.0; str keys and no raw are its defaults too). Passed as keywords
            # they cost a µs of argument parsing on every message either end receives.
            message = msgpack.unpackb(raw, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message body: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("message body must be a map")
    return message


def client_proof(secret: bytes | None, nonce: bytes, cnonce: bytes, namespace: str, tenant: str | None) -> bytes | None:
    """The client's HMAC-SHA256 over both nonces, the namespace and the tenant; ``None`` without a secret."""
    if secret is None:
        return None
    message = b"dkv2-client\0" + nonce + cnonce + namespace.encode() + b"\0" + (tenant or "").encode()
    return hmac.new(secret, message, hashlib.sha256).digest()


def node_proof(secret: bytes, nonce: bytes, cnonce: bytes, node_id: str) -> bytes:
    """The node's HMAC-SHA256 over both nonces and its id: proves to the client that it holds the credential too."""
    return hmac.new(secret, b"dkv2-node\0" + cnonce + nonce + node_id.encode(), hashlib.sha256).digest()


def proof_equals(expected: bytes | None, proof: object) -> bool:
    """Constant-time comparison of a received proof with the expected one."""
    return isinstance(proof, bytes) and expected is not None and hmac.compare_digest(expected, proof)


# ---- schema checks --------------------------------------------------------------------------


def _int(lo: int, hi: int) -> Callable[[object], bool]:
    return lambda v: type(v) is int and lo <= v <= hi  # (exactly int: a bool is not one here)


# The checks of per-key fields run on every lookup, read and write of up to MAX_KEYS keys: each is a
# few C-speed passes (map, set, min, max; for hashes dkv.keys.plain_hashes, one native pass) over the
# list, not a Python step per key. Types are compared exactly (msgpack builds plain int, str, bytes and
# list), which also keeps bool out of the ints.


def _all_of_type(values: Any, kind: type) -> bool:
    return set(map(type, values)) <= {kind}


def _ints_within(values: Any, lo: int, hi: int) -> bool:
    if len(values) == 1:  # the usual one lease ended, one shard: no passes to set up
        value = values[0]
        return type(value) is int and lo <= value <= hi
    return not values or (_all_of_type(values, int) and lo <= min(values) and max(values) <= hi)


def _leaf_list(values: Any) -> bool:
    if len(values) == 1:  # the usual one leaf
        leaf = values[0]
        return type(leaf) is str and 0 < len(leaf) <= MAX_LEAF_ID_LENGTH
    return not values or (_all_of_type(values, str) and min(map(len, values)) > 0
                          and max(map(len, values)) <= MAX_LEAF_ID_LENGTH)


def _hashes(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_KEYS and plain_hashes(v)


def _leaves(v: object) -> bool:
    return isinstance(v, list) and 0 < len(v) <= MAX_LEAVES and _leaf_list(v)


def _columns(v: object, width: int) -> list[tuple[Any, ...]] | None:
    """The columns of ``v`` when it is a list of at most MAX_KEYS lists of ``width`` items each ([] for an empty
    list), else None."""
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        return None
    if not v:
        return []
    if not _all_of_type(v, list) or set(map(len, v)) != {width}:
        return None
    return list(zip(*v))


def _keys(v: object) -> bool:
    columns = _columns(v, 3)
    if not columns:
        return columns is not None
    leaves, shards, hashes = columns
    return _leaf_list(leaves) and _ints_within(shards, 0, MAX_TP_SHARDS - 1) and plain_hashes(hashes)


def _runs(v: object) -> bool:
    """A read's blocks by place (``[leaf, shard, first, stop]`` each, ``first < stop``), at most MAX_KEYS in all."""
    columns = _columns(v, 4)
    if not columns:
        return columns is not None
    leaves, shards, firsts, stops = columns
    return (_leaf_list(leaves) and _ints_within(shards, 0, MAX_TP_SHARDS - 1) and _ints_within(firsts, 0, MAX_KEYS - 1)
            and _ints_within(stops, 1, MAX_KEYS) and all(map(operator.lt, firsts, stops))
            and sum(stops) - sum(firsts) <= MAX_KEYS)


def _sizes(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_KEYS and _ints_within(v, 0, 2**40)


def _sums(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_KEYS and _all_of_type(v, bytes) and set(map(len, v)) <= {CHECKSUM_SIZE}


# What a node of this build serves beyond the base protocol, listed in its handshake reply ("features"):
# a client uses one only where its node lists it (a fleet mid-upgrade mixes builds)
FEATURE_READ_RUNS = "read_runs"  # a read may name its blocks by "runs" (see the module docstring)
FEATURE_PACKED_HASHES = "packed_hashes"  # a lookup's, probe's or touch's hashes may travel packed (ditto)
FEATURES = (FEATURE_READ_RUNS, FEATURE_PACKED_HASHES)
PACKED_HASH_OPS = frozenset({"lookup", "probe", "touch"})


def packed_hashes(hashes: list[bytes]) -> dict[str, Any] | None:
    """The fields that carry ``hashes`` packed (``hashes`` as one bytes, ``hash_size``); ``None`` where they cannot
    travel so (none, or of mixed lengths): the list is sent as it is."""
    packed = pack_hashes(hashes)
    return None if packed is None else {"hashes": packed, "hash_size": len(hashes[0])}


def _unpack_hashes(op: str, message: dict[str, Any]) -> None:
    """A packed ``hashes`` (see the module docstring) made the list the op's schema and handler read, in place."""
    packed, size = message["hashes"], message.pop("hash_size", None)
    if type(size) is not int or size not in HASH_LENGTHS or len(packed) % size or len(packed) > MAX_KEYS * size:
        raise ProtocolError(f"{op}: packed hashes of {len(packed)} bytes with hash_size {size!r} are malformed "
                            "or out of bounds")
    message["hashes"] = split_hashes(packed, size)

MAX_ENDS = 1024  # leases one request may end besides its own work (see "ends")


def _lease_ids(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_ENDS and _ints_within(v, 0, 2**63)


class _Optional:
    """A schema field that may be absent (see :func:`optional`); validated like any other when present."""

    __slots__ = ("valid",)

    def __init__(self, valid: Callable[[object], bool]) -> None:
        self.valid = valid

    def __call__(self, value: object) -> bool:
        return self.valid(value)


def optional(valid: Callable[[object], bool]) -> Callable[[object], bool]:
    """Mark a schema field optional: absent is accepted, present must pass ``valid``."""
    return _Optional(valid)


def _namespace(v: object) -> bool:
    try:
        check_namespace(v)
    except ValueError:
        return False
    return True


_is_bool = lambda v: type(v) is bool  # noqa: E731
_is_id = _int(0, 2**63)
_is_shards = _int(1, MAX_TP_SHARDS)
_optional_bytes = lambda v: v is None or (isinstance(v, bytes) and len(v) <= 64)  # noqa: E731
_short_str = lambda v: isinstance(v, str) and 0 < len(v) <= 256  # noqa: E731

_PRESENCE = {"hashes": _hashes, "leaves": _leaves, "shards": _is_shards}
SCHEMAS: dict[str, dict[str, Callable[[object], bool]]] = {
    "hello": {"v": _int(0, 1 << 16), "ns": _namespace, "client": _short_str, "proof": _optional_bytes,
              "host": _short_str, "cnonce": lambda v: isinstance(v, bytes) and len(v) == NONCE_SIZE,
              "tenant": lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 64)},
    "lookup": {**_PRESENCE, "lease": _is_bool, "group": _int(0, 1 << 20), "slots": optional(_is_bool),
               "send": optional(_int(0, MAX_FRAME)),  # send: the blocks' bytes with the answer, up to so many
               "inline_sent": optional(_is_bool)},  # ... in the answer's own message (FLAG_TRAILING)
    "probe": {**_PRESENCE, "tiers": optional(_is_bool)},  # tiers: also say host or disk per block
    "touch": _PRESENCE,
    # a read names its blocks by key, or (a node that announces "read_runs") by their place in the lease's lookup
    "read": {"lease": _is_id, "keys": optional(_keys), "runs": optional(_runs), "end": _is_bool, "shm": _is_bool},
    "write": {"keys": _keys, "sizes": _sizes, "shm": _is_bool, "sums": optional(_sums)},
    "commit": {"write": _is_id},
    "abort": {"write": _is_id},
    "release": {"lease": _is_id},
    "end": {},
    "done": {"read": _is_id},
    "stats": {},
    "clear": {},
}


# SCHEMAS as the node walks them: per op, (field, check, optional) with an optional field's own check
_ABSENT = object()
_CHECKS: dict[str, tuple[tuple[str, Callable[[object], bool], bool], ...]] = {
    op: tuple((name, valid.valid if isinstance(valid, _Optional) else valid, isinstance(valid, _Optional))
              for name, valid in schema.items())
    for op, schema in SCHEMAS.items()
}


def check_request(message: dict[str, Any]) -> str:
    """Validate a request against its op's schema; returns the op. :class:`ProtocolError` otherwise.

    A lookup's, probe's or touch's packed ``hashes`` are first cut into the list, in ``message`` itself
    (``hash_size`` removed), so the schema and the handler see the request as if the list had been sent.
    """
    op = message.get("op")
    checks = _CHECKS.get(op) if type(op) is str else None
    if checks is None:
        raise ProtocolError(f"unknown op {op!r}")
    ends = message.get("ends", _ABSENT)
    if ends is not _ABSENT and op != "hello" and not _lease_ids(ends):
        raise ProtocolError(f"{op}: field 'ends' is malformed or out of bounds")
    if op in PACKED_HASH_OPS and type(message.get("hashes")) is bytes:
        _unpack_hashes(op, message)
    for name, valid, optional in checks:
        value = message.get(name, _ABSENT)
        if value is _ABSENT:
            if optional:
                continue
            raise ProtocolError(f"{op}: missing field {name!r}")
        if not valid(value):
            raise ProtocolError(f"{op}: field {name!r} is malformed or out of bounds")
    return op


def error_reply(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "code": code, "msg": message}
