"""The request's ``dkv_cache_hint``: building it, parsing it, and judging whether it is usable.

dKV speaks the KV-hint envelope that Dynamo uses and that TensorRT-LLM and vLLM
accept as request metadata::

    {"protocol_version": 1,
     "message_id": "<uuid4>",
     "actions": [{
        "action_id": "<uuid4>",
        "action_type": "kv.fetch",
        "action_version": 1,
        "payload": {
          "source_control_endpoint": "ucx://HOST:PORT",
          "block_hashes": ["<hex of the deepest covered block>"],
          "dkv": {"version": 1, "peer_id": "...", "epoch": "...", "namespace": "...",
                  "depth": 12, "deepest_hash": "<hex>"}}}]}

``block_hashes`` names the deepest block the peer covers: hashes are
prefix-chained, so that one hash names the whole prefix. The ``dkv`` object lets
the connector detect a stale hint (the peer restarted: new epoch), a foreign one
(another namespace) or a mismatched one (the deepest hash is not among the
request's hashes; an engine may ask about only the blocks past its device hit).
``blocks`` (optional) is how many blocks the routed request had: an engine asks
about the run from its device hit to the end of the prompt, so a deepest block
at ``depth <= blocks - len(run)`` lies before that run — the peer holds nothing
the device lacks. That hint is not wrong, it has nothing to add: it is served
as no hint and counted apart (:data:`BEHIND_DEVICE`), not as a mismatch.

MAX's minimal form is accepted too, its instance name read as a peer id::

    {"version": 2, "instances": [{"instance_name": "node-a"}]}

Anything else is unusable. An unusable hint is never an error: the caller
treats it as no hint and counts the reason (:data:`REASONS`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dkv.etcd import MemberRecord

HINT_VERSION = 1
ENVELOPE_VERSION = 1
MAX_HINT_BYTES = 64 * 1024
ACTION_TYPE = "kv.fetch"

UNPARSEABLE = "unparseable"
UNKNOWN_VERSION = "unknown_version"
UNKNOWN_PEER = "unknown_peer"
STALE_EPOCH = "stale_epoch"
WRONG_NAMESPACE = "wrong_namespace"
MISMATCH = "mismatch"
REASONS = (UNPARSEABLE, UNKNOWN_VERSION, UNKNOWN_PEER, STALE_EPOCH, WRONG_NAMESPACE, MISMATCH)
# Not the hint's fault, so not among REASONS: a usable hint names a peer that recently failed to
# answer, and the connector serves it as a miss rather than wait on that peer again.
PEER_UNREACHABLE = "peer_unreachable"
# Not the hint's fault either: the peer's deepest block lies before the run the engine asks about
# (its device already holds more than the peer has to offer).
BEHIND_DEVICE = "behind_device"
# The hinted peer answered but could not prove the cluster credential (a fake member record, or
# an address that now belongs to something else): never asked for bytes, backed off like a dead one.
UNAUTHENTICATED_PEER = "unauthenticated_peer"


class UnusableHint(Exception):
    """A hint that cannot be used; ``reason`` is one of :data:`REASONS`. Callers count it, never raise it on."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Hint:
    """A parsed hint. Fields other than ``peer_id`` are ``None`` in MAX's minimal form."""

    peer_id: str
    epoch: str | None = None
    namespace: str | None = None
    depth: int | None = None
    deepest_hash: bytes | None = None
    endpoint: str | None = None
    blocks: int | None = None  # how many blocks the routed request had


def build_hint(member: MemberRecord, namespace: str, hashes: Sequence[bytes], depth: int) -> str:
    """The hint JSON naming ``member`` as holder of ``hashes[:depth]`` (``depth >= 1``)."""
    if not 1 <= depth <= len(hashes):
        raise ValueError(f"depth {depth} outside 1..{len(hashes)}")
    deepest = hashes[depth - 1].hex()
    payload = {
        "source_control_endpoint": f"ucx://{member.address}",
        "block_hashes": [deepest],
        "dkv": {
            "version": HINT_VERSION,
            "peer_id": member.node_id,
            "epoch": member.epoch,
            "namespace": namespace,
            "depth": depth,
            "deepest_hash": deepest,
            "blocks": len(hashes),
        },
    }
    envelope = {
        "protocol_version": ENVELOPE_VERSION,
        "message_id": str(uuid.uuid4()),
        "actions": [{"action_id": str(uuid.uuid4()), "action_type": ACTION_TYPE,
                     "action_version": HINT_VERSION, "payload": payload}],
    }
    return json.dumps(envelope, separators=(",", ":"))


def parse_hint(raw: bytes | str) -> Hint:
    """Parse either accepted form; :class:`UnusableHint` otherwise."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        if len(raw) > MAX_HINT_BYTES:
            raise UnusableHint(UNPARSEABLE, "hint too large")
        try:
            raw = raw.decode()
        except UnicodeDecodeError as exc:
            raise UnusableHint(UNPARSEABLE, "not UTF-8") from exc
    if not isinstance(raw, str):
        raise UnusableHint(UNPARSEABLE, "hint must be JSON text")
    if len(raw) > MAX_HINT_BYTES // 4 and len(raw.encode(errors="replace")) > MAX_HINT_BYTES:
        raise UnusableHint(UNPARSEABLE, "hint too large")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise UnusableHint(UNPARSEABLE, "not JSON") from exc
    if not isinstance(doc, dict):
        raise UnusableHint(UNPARSEABLE, "not a JSON object")
    if "actions" in doc:
        return _parse_envelope(doc)
    if "instances" in doc:
        return _parse_max(doc)
    raise UnusableHint(UNPARSEABLE, "neither the kv.fetch envelope nor MAX's instances form")


def _is_int(value: object, expected: int) -> bool:
    """``value == expected`` for a real int (JSON ``true`` is not version 1)."""
    return type(value) is int and value == expected


def _parse_envelope(doc: dict) -> Hint:
    if not _is_int(doc.get("protocol_version"), ENVELOPE_VERSION):
        raise UnusableHint(UNKNOWN_VERSION, f"envelope protocol_version {doc.get('protocol_version')!r}")
    actions = doc.get("actions")
    if not isinstance(actions, list):
        raise UnusableHint(UNPARSEABLE, "actions must be a list")
    for action in actions:
        if not isinstance(action, dict) or action.get("action_type") != ACTION_TYPE:
            continue
        payload = action.get("payload")
        dkv = payload.get("dkv") if isinstance(payload, dict) else None
        if not isinstance(dkv, dict):
            continue  # a kv.fetch for another store
        if not (_is_int(dkv.get("version"), HINT_VERSION) and _is_int(action.get("action_version"), HINT_VERSION)):
            raise UnusableHint(UNKNOWN_VERSION, f"dkv hint version {dkv.get('version')!r}")
        try:
            peer_id, epoch, namespace = dkv["peer_id"], dkv["epoch"], dkv["namespace"]
            depth, deepest = dkv["depth"], bytes.fromhex(dkv["deepest_hash"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UnusableHint(UNPARSEABLE, f"dkv payload field: {exc}") from exc
        if not all(isinstance(v, str) and v for v in (peer_id, epoch, namespace)):
            raise UnusableHint(UNPARSEABLE, "peer_id, epoch and namespace must be non-empty strings")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1 or len(deepest) not in (8, 32):
            raise UnusableHint(UNPARSEABLE, "depth must be a positive int and deepest_hash 8 or 32 bytes")
        endpoint = payload.get("source_control_endpoint")
        blocks = dkv.get("blocks")
        if blocks is not None and (type(blocks) is not int or blocks < depth):
            raise UnusableHint(UNPARSEABLE, "blocks must be an int no smaller than depth")
        return Hint(peer_id, epoch, namespace, depth, deepest, endpoint if isinstance(endpoint, str) else None,
                    blocks)
    raise UnusableHint(UNPARSEABLE, "no kv.fetch action with a dkv payload")


def _parse_max(doc: dict) -> Hint:
    if not _is_int(doc.get("version"), 2):
        raise UnusableHint(UNKNOWN_VERSION, f"MAX hint version {doc.get('version')!r}")
    instances = doc.get("instances")
    if not isinstance(instances, list) or not instances:
        raise UnusableHint(UNPARSEABLE, "instances must be a non-empty list")
    first = instances[0]
    name = first.get("instance_name") if isinstance(first, dict) else None
    if not isinstance(name, str) or not name:
        raise UnusableHint(UNPARSEABLE, "instance_name must be a non-empty string")
    return Hint(peer_id=name)


RecentMember = Callable[[str, str | None], MemberRecord | None]  # (peer id, epoch) -> record


def resolve_hint(
    raw: bytes | str | None,
    namespace: str,
    hashes: Sequence[bytes],
    members: Mapping[str, MemberRecord],
    recent: RecentMember | None = None,
) -> MemberRecord | None:
    """The live peer a hint names for this request, ``None`` for no hint.

    Raises :class:`UnusableHint` (to be counted, not propagated) when the hint
    is present but cannot be used: unparseable, unknown version, a peer that is
    not a live member, a stale epoch, another namespace, or a deepest hash that
    is not this request's hash at ``depth - 1``.

    ``recent(peer_id, epoch)`` (a router's :meth:`~dkv.router.Router.recently_live`)
    may vouch for a peer that is not in ``members`` at the hint's epoch but
    was a live member at it a short, bounded while ago: its record is returned.
    """
    if raw is None:
        return None
    hint = parse_hint(raw)
    member = members.get(hint.peer_id)
    if member is None or (hint.epoch is not None and hint.epoch != member.epoch):
        vouched = recent(hint.peer_id, hint.epoch) if recent is not None else None
        if vouched is not None:
            member = vouched
        elif member is None:
            raise UnusableHint(UNKNOWN_PEER, f"peer {hint.peer_id!r} is not a live member")
        else:
            raise UnusableHint(STALE_EPOCH,
                               f"peer {hint.peer_id!r} is at epoch {member.epoch}, hint says {hint.epoch}")
    if hint.namespace is not None and hint.namespace != namespace:
        raise UnusableHint(WRONG_NAMESPACE, f"hint is for namespace {hint.namespace!r}")
    if hint.deepest_hash is not None and hint.deepest_hash not in hashes:
        # an engine asks about the blocks past its device hit, so the run may start anywhere
        # in the prompt; hashes are prefix-chained, so the deepest block being among them is
        # what ties the hint to this request
        if hashes and hint.blocks is not None and hint.depth is not None and hint.depth <= hint.blocks - len(hashes):
            raise UnusableHint(BEHIND_DEVICE, f"the peer covers {hint.depth} blocks; the engine asks from block "
                                              f"{hint.blocks - len(hashes) + 1}: nothing to add")
        raise UnusableHint(MISMATCH, "the hint's deepest block is not among this request's blocks")
    return member
