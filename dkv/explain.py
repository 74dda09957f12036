"""``dkv explain``: why each block of a request would, or would not, be served.

Everything here is pure: :func:`explain_request` turns what the cluster said
(a :class:`Directory` read from etcd, :class:`NodeAnswer` s from the nodes
that were asked) and a request (namespace, block hashes root first, an
optional ``dkv_cache_hint``) into an :class:`Explanation`; :func:`compare_engines`
turns two engines' connector settings into the fields that differ and what
each difference does. The I/O lives in :mod:`dkv.cli_explain`.

What the directory can and cannot tell. A node publishes, of each run it
offloads, every ``publish_every``-th block and the run's last; hashes are
prefix-chained, so a node that published block *j* held blocks ``0..j`` when
it published. For a block nobody published, a deeper block's publisher is
therefore a holder *by inference* only (``how = "inferred"``): the directory
cannot tell whether that block was evicted since. Only the node can, which is
why explain asks it (``tier``: ``"host"``, ``"disk"`` or ``"absent"``) when
the leaves to ask about are known. An entry's value is the epoch its node
published it under: an entry whose epoch differs from the node's current one
was written before a restart.

The served blocks are the connector's: a request without a hint is routed as
:meth:`dkv.router.Router.route` routes it (the caller passes that route in);
a hint is resolved by :func:`dkv.hints.resolve_hint`, the connector's own
function, so explain never disagrees with it. The source then serves the
leading run of blocks it holds (a load takes a prefix).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dkv.etcd import MemberRecord
from dkv.hints import RecentMember, UnusableHint, parse_hint, resolve_hint

# ---- reason codes (stable: scripts and tests match on them) -----------------------------------

NOT_PUBLISHED = "not_published"  # no live peer published it or any deeper block
HOLDER_GONE = "holder_gone"  # only nodes that are no longer live members published it
EVICTED = "evicted"  # the node the directory names says it no longer holds it
HOLDER_UNREACHABLE = "holder_unreachable"  # the node the directory names did not answer
NOT_FROM_SOURCE = "not_from_source"  # held, but by a peer other than the one the request goes to
AFTER_MISS = "after_miss"  # an earlier block is missing: a load takes a prefix
NAMESPACE_DIFFERS = "namespace_differs"  # published, but under another namespace
HINT_UNUSABLE = "hint_unusable"  # the hint cannot be used, so nothing is fetched from a peer
NO_SOURCE = "no_source"  # no peer to fetch from at all

HOST, DISK, ABSENT = "host", "disk", "absent"


@dataclass(frozen=True)
class Entry:
    """One directory entry of a block: who published it, under which epoch (the entry's value)."""

    node_id: str
    epoch: str


@dataclass(frozen=True)
class Directory:
    """What etcd said about a request (read by the caller at one moment).

    ``entries[i]`` are every entry of ``hashes[i]`` in the namespace, live
    members' or not; ``lease_ttl`` the seconds left of each member's etcd lease
    (``None``: unknown); ``elsewhere[i]`` other namespaces where ``hashes[i]``
    is published (looked at only when nothing is published in the namespace);
    ``namespaces`` some namespaces the directory holds and ``in_namespace``
    how many entries the namespace holds per hash length in bytes (same condition).
    """

    members: Mapping[str, MemberRecord]
    entries: Sequence[Sequence[Entry]]
    lease_ttl: Mapping[str, int | None] = field(default_factory=dict)
    elsewhere: Mapping[int, Sequence[str]] = field(default_factory=dict)
    namespaces: Sequence[str] | None = None
    in_namespace: Mapping[int, int] | None = None


@dataclass(frozen=True)
class NodeAnswer:
    """A node's own answer for the request's hashes: per hash ``"host"``, ``"disk"`` or ``"absent"``.

    ``tiers`` is ``None`` and ``error`` says why when the node could not be
    asked or did not answer. ``missing_leaves[i]`` names the leaves the node
    lacks block ``i`` of while holding it for others (a partial block).
    """

    node_id: str
    tiers: Sequence[str] | None = None
    error: str | None = None
    missing_leaves: Mapping[int, Sequence[str]] = field(default_factory=dict)


def combine_leaf_tiers(per_leaf: Mapping[str, Sequence[str | None]], count: int) -> tuple[list[str], dict[int, list[str]]]:
    """Per hash, the tier of the whole block (every leaf): absent if a leaf lacks it, disk if one is off the host.

    Also, per hash held by some leaves but not all, the leaves that lack it.
    ``per_leaf`` is :meth:`dkv.client.NodeClient.tiers`'s answer.
    """
    tiers: list[str] = []
    partial: dict[int, list[str]] = {}
    for i in range(count):
        column = {leaf: row[i] for leaf, row in per_leaf.items()}
        lacking = sorted(leaf for leaf, tier in column.items() if tier is None)
        if lacking:
            tiers.append(ABSENT)
            if len(lacking) < len(column):
                partial[i] = lacking
        elif any(tier == DISK for tier in column.values()):
            tiers.append(DISK)
        else:
            tiers.append(HOST if column else ABSENT)
    return tiers, partial


@dataclass
class Holder:
    """A node the directory names for a block.

    ``how``: ``"published"`` (its entry names this block) or ``"inferred"``
    (it published a deeper block of the chain). ``tier`` is the node's own
    answer (``None``: not asked or no answer). ``stale_epoch`` is the epoch of
    an entry written before the node's restart.
    """

    node_id: str
    address: str | None
    live: bool
    how: str
    tier: str | None = None
    lease_ttl_left: int | None = None
    stale_epoch: str | None = None


@dataclass
class BlockExplanation:
    index: int
    hash: str
    published_by: list[str]
    holders: list[Holder]
    served: bool
    source: str | None
    tier: str | None  # where the source holds it (None: the node was not asked)
    reason_code: str | None
    reason: str | None


@dataclass
class HintVerdict:
    usable: bool
    reason_code: str | None  # one of dkv.hints.REASONS (or BEHIND_DEVICE) when unusable
    detail: str | None
    peer: str | None
    depth: int | None


@dataclass
class Explanation:
    namespace: str
    blocks: list[BlockExplanation]
    source: str | None
    source_address: str | None
    via: str  # "route" (the router's choice) or "hint"
    route: dict[str, Any]  # what the router would choose without a hint: {"peer": node id | None, "depth": int}
    hint: HintVerdict | None
    served: int
    tiers: dict[str, int]
    first_miss: int | None
    reason_code: str | None
    reason: str | None
    notes: list[str]

    @property
    def verdict(self) -> str:
        """One line: how many blocks a request gets and from where, and why the first miss is one."""
        n = len(self.blocks)
        where = f" from {self.source} ({self.source_address})" if self.source and self.served else ""
        split = ", ".join(f"{count} {tier}" for tier, count in self.tiers.items() if count)
        line = f"{self.served} of {n} blocks would be served{where}" + (f" [{split}]" if split else "")
        if self.first_miss is not None:
            line += f"; block {self.first_miss} is not: {self.reason}"
        return line

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["verdict"] = self.verdict
        return doc


# ---- the explanation -----------------------------------------------------------------------------


def explain_request(
    namespace: str,
    hashes: Sequence[bytes],
    directory: Directory,
    route: tuple[str | None, int],
    answers: Mapping[str, NodeAnswer] | None = None,
    *,
    hint: str | bytes | None = None,
    recent: RecentMember | None = None,
    asked: bool = False,
) -> Explanation:
    """Explain one request (see module docstring). Pure.

    ``route`` is ``(node id, depth)`` of :meth:`dkv.router.Router.route` for
    ``hashes`` (``(None, 0)``: nothing routed); with ``hint`` the hint decides
    instead, resolved by :func:`dkv.hints.resolve_hint` over ``directory.members``
    and ``recent``. ``answers`` are the nodes' own answers; ``asked`` says
    whether nodes were asked at all (False: the leaves were not given).
    """
    answers = answers or {}
    members = directory.members
    n = len(hashes)
    notes: list[str] = []
    published = [list(directory.entries[i]) if i < len(directory.entries) else [] for i in range(n)]

    # the deepest block each live member published: everything above it it held when it published
    deepest: dict[str, int] = {}
    for i, entries in enumerate(published):
        for entry in entries:
            if entry.node_id in members:
                deepest[entry.node_id] = i

    hint_verdict: HintVerdict | None = None
    via = "route"
    source, source_depth = route
    if hint is not None:
        via = "hint"
        source, source_depth, hint_verdict = _resolve(hint, namespace, hashes, members, recent)
        if hint_verdict.usable and source_depth < 0:  # MAX's minimal form names a peer, not a depth
            source_depth = deepest.get(source or "", -1) + 1
            hint_verdict.depth = source_depth

    def answer_tier(node_id: str, i: int) -> str | None:
        ans = answers.get(node_id)
        return ans.tiers[i] if ans is not None and ans.tiers is not None and i < len(ans.tiers) else None

    source_record = members.get(source) if source else None
    if source and source_record is None and recent is not None:
        source_record = recent(source, None)

    blocks: list[BlockExplanation] = []
    missed: tuple[int, str, str] | None = None  # the first miss: index, code, text
    served = 0
    tiers = {HOST: 0, DISK: 0, "unknown": 0}
    for i, h in enumerate(hashes):
        holders = _holders(i, published[i], deepest, members, directory.lease_ttl, answer_tier)
        tier = answer_tier(source, i) if source else None
        code = text = None
        if missed is not None:
            code, text = AFTER_MISS, f"block {missed[0]} is missing, and a load takes a prefix"
        else:
            code, text = _why_not(i, source, source_depth, hint_verdict, holders, published[i], answers, tier,
                                  directory, asked)
            if code is not None:
                missed = (i, code, text)  # type: ignore[assignment]
        ok = code is None
        if ok:
            served += 1
            tiers[tier if tier in (HOST, DISK) else "unknown"] += 1
        blocks.append(BlockExplanation(i, h.hex(), [e.node_id for e in published[i]], holders, ok,
                                       source if ok else None, tier, code, text))

    stale = sorted({h.node_id for b in blocks for h in b.holders if h.stale_epoch})
    if stale:
        notes.append(f"entries of {', '.join(stale)} were written under an earlier epoch, before a restart: "
                     f"ask the node (--leaf), the directory may be stale")
    if not asked:
        notes.append("nodes were not asked (give --leaf, the engine's leaf ids): holders and evictions are the "
                     "directory's view only")
    if directory.namespaces is not None and not any(published):
        shown = ", ".join(directory.namespaces) or "none"
        notes.append(f"nothing at all of this request is published in {namespace}; namespaces in the "
                     f"directory: {shown}")
    if directory.in_namespace and not any(published):
        lengths = {len(h) for h in hashes}
        held = ", ".join(f"{count} of {size}-byte hashes" for size, count in sorted(directory.in_namespace.items()))
        if lengths and not lengths & set(directory.in_namespace):
            notes.append(f"{namespace} holds entries ({held}) but this request's hashes are "
                         f"{'/'.join(str(n) for n in sorted(lengths))} bytes: the engines use different hash "
                         f"algorithms")
        else:
            notes.append(f"{namespace} holds entries ({held}) but none of this request's: if the same prompt was "
                         f"offloaded, the engines hash it differently (hash seed or algorithm, page size, tokenizer)")
    if hint is None and not hashes:
        notes.append("no hashes given")
    if hint_verdict is not None and route[0] and route[0] != source:
        notes.append(f"without the hint, the router would send this request to {route[0]} for {route[1]} block(s)")
    return Explanation(namespace, blocks, source, source_record.address if source_record else None, via,
                       {"peer": route[0], "depth": route[1]}, hint_verdict, served,
                       {k: v for k, v in tiers.items() if v}, missed[0] if missed else None,
                       missed[1] if missed else None, missed[2] if missed else None, notes)


def _resolve(hint: str | bytes, namespace: str, hashes: Sequence[bytes], members: Mapping[str, MemberRecord],
             recent: RecentMember | None) -> tuple[str | None, int, HintVerdict]:
    """The connector's own resolution of ``hint``: the source it names and how deep, or why it is unusable."""
    try:
        member = resolve_hint(hint, namespace, hashes, members, recent)
    except UnusableHint as exc:
        detail = str(exc).split(": ", 1)[1] if ": " in str(exc) else None
        return None, 0, HintVerdict(False, exc.reason, detail, None, None)
    assert member is not None  # a hint was given
    parsed = parse_hint(hint)
    if parsed.deepest_hash is not None:
        depth = hashes.index(parsed.deepest_hash) + 1
    else:  # MAX's minimal form names a peer only: the directory (or the peer's answer) says how deep
        depth = -1
    return member.node_id, depth, HintVerdict(True, None, None, member.node_id, depth)


def _holders(i: int, entries: Sequence[Entry], deepest: Mapping[str, int], members: Mapping[str, MemberRecord],
             lease_ttl: Mapping[str, int | None], tier_of: Any) -> list[Holder]:
    out: list[Holder] = []
    named = set()
    for entry in entries:
        member = members.get(entry.node_id)
        named.add(entry.node_id)
        tier = tier_of(entry.node_id, i) if member else None
        out.append(Holder(entry.node_id, member.address if member else None, member is not None, "published", tier,
                          lease_ttl.get(entry.node_id) if member else None,
                          entry.epoch if member and entry.epoch and entry.epoch != member.epoch else None))
    for node_id, j in sorted(deepest.items()):
        if j > i and node_id not in named:
            member = members[node_id]
            out.append(Holder(node_id, member.address, True, "inferred", tier_of(node_id, i), lease_ttl.get(node_id)))
    return out


def _why_not(i: int, source: str | None, depth: int, hint: HintVerdict | None, holders: Sequence[Holder],
             entries: Sequence[Entry], answers: Mapping[str, NodeAnswer], tier: str | None, directory: Directory,
             asked: bool) -> tuple[str | None, str | None]:
    """``(None, None)`` when the source serves block ``i``; else the reason code and its text."""
    live = [h for h in holders if h.live]
    if source is not None:
        ans = answers.get(source)
        if ans is not None and ans.error is not None:
            return HOLDER_UNREACHABLE, (f"{source} did not answer ({ans.error}): down, or refusing this "
                                        f"credential (--token-file); a holder that died stays in the directory "
                                        f"until its etcd lease runs out" + _ttl(directory.lease_ttl.get(source)))
        if ans is not None and ans.tiers is not None:
            if tier in (HOST, DISK):
                return None, None
            partial = ans.missing_leaves.get(i)
            if partial:
                return EVICTED, (f"{source} holds it for some leaves but not for {', '.join(partial)} (evicted, "
                                 f"or never written for every leaf or TP shard)")
            if i < depth:
                how = "published it" if any(e.node_id == source for e in entries) else "published a deeper block"
                return EVICTED, f"{source} {how} but no longer holds it (evicted since publication)"
        elif i < depth:
            return None, None  # the directory's view: the source covers it
    # not served by the source: why
    if source is None and hint is not None and not hint.usable:
        return HINT_UNUSABLE, (f"the hint is unusable ({hint.reason_code}"
                               + (f": {hint.detail}" if hint.detail else "") + "), so the connector asks only "
                               "its co-located node")
    others = [h for h in live if h.node_id != source and h.tier not in (ABSENT,)]
    if others:
        names = ", ".join(f"{h.node_id} ({h.how})" for h in others)
        return NOT_FROM_SOURCE, (f"held by {names}, but the request goes to {source}" if source else
                                 f"held by {names}, but nothing routes there")
    gone = [h for h in holders if not h.live]
    if gone:
        names = ", ".join(h.node_id for h in gone)
        return HOLDER_GONE, (f"published by {names}, which is no longer a live member (its lease expired or it "
                             f"left): the entry outlived it")
    if live and all(h.tier == ABSENT for h in live):
        names = ", ".join(h.node_id for h in live)
        return EVICTED, f"{names} published it or a deeper block but no longer holds it (evicted since publication)"
    if directory.elsewhere.get(i):
        return NAMESPACE_DIFFERS, (f"published under namespace {', '.join(directory.elsewhere[i])} instead: the "
                                   f"engines' namespaces differ (tenant, layout or DKV_NAMESPACE)")
    if source is not None and i >= depth:
        return NOT_PUBLISHED, (f"{source} published nothing this deep, and no live peer published this block or any "
                               f"deeper one")
    return NOT_PUBLISHED, ("no live peer published it or any deeper block (never offloaded, evicted everywhere, "
                           "or the hashes differ: hash algorithm or seed)")


def _ttl(ttl: int | None) -> str:
    return f" (in {ttl} s)" if ttl is not None and ttl > 0 else ""


# ---- comparing two engines' connector settings ------------------------------------------------------

# settings keys as a person may write them: the connector's environment, MAX's params, dKV's own
ALIASES = {
    "DKV_NAMESPACE": "namespace", "DKV_TENANT": "tenant", "DKV_CLUSTER": "cluster",
    "DKV_ETCD_PREFIX": "etcd_prefix", "DKV_ETCD": "etcd", "kv_hash_algo": "hash_algorithm",
    "kv_hash_seed": "hash_seed", "n_kv_heads": "num_kv_heads", "model_name": "model",
}
LAYOUT_FIELDS = ("model", "dtype", "page_size", "num_layers", "num_kv_heads", "head_dim")
MEANING = {
    "namespace": "the engines read and write different namespaces: neither ever sees the other's blocks",
    "tenant": "the tenant is the namespace's first part: engines of different tenants never share blocks",
    "hash_algorithm": ("the same prompt gets different block hashes, so no block ever matches, even in one "
                       "namespace"),
    "hash_seed": ("the same prompt gets different block hashes, so no block ever matches; MAX's namespace digest "
                  "does not cover the seed, so both engines use one namespace and miss silently"),
    "cluster": "the engines look in different directories: one's peers are invisible to the other",
    "etcd_prefix": "the engines look in different directories: one's peers are invisible to the other",
    "etcd": "the engines use different etcd endpoints: check that they reach the same etcd cluster",
    "leaves": ("blocks are stored per leaf id and TP shard: a lookup naming a leaf (or a shard count) the "
               "other engine never wrote misses"),
}
LAYOUT_MEANING = ("the KV bytes differ in shape ({field}), so the namespace digest differs by design: blocks of "
                  "one layout must never load into another")
DEFAULTS = {"tenant": "max", "cluster": "default", "etcd_prefix": "/dkv"}


def normalise_settings(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Settings keyed by dKV's names (aliases folded, a nested ``layout`` object flattened), defaults filled."""
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "layout" and isinstance(value, Mapping):
            for k, v in value.items():
                flat[ALIASES.get(k, k)] = v
        else:
            flat[ALIASES.get(key, key)] = value
    for key, value in DEFAULTS.items():
        if key != "tenant" or not flat.get("namespace"):  # an explicit namespace is used as it is
            flat.setdefault(key, value)
    if not flat.get("namespace") and all(k in flat for k in (*LAYOUT_FIELDS, "hash_algorithm")):
        from dkv.keys import derive_namespace

        flat["namespace"] = derive_namespace(
            str(flat["tenant"]), **{k: flat[k] for k in LAYOUT_FIELDS}, hash_algorithm=str(flat["hash_algorithm"]),
            hash_seed=flat.get("hash_seed", 0))
        flat["namespace_derived"] = True
    return flat


def compare_engines(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The fields two engines' connector settings differ in, each with what that does to the hit rate. Pure.

    Returns ``{"a": ..., "b": ... (normalised), "differences": [{"field", "a", "b", "meaning"}],
    "share": bool, "verdict": str}``. ``share`` is False when any difference keeps
    the engines from sharing blocks. A field only one side gives is compared with
    the default (``cluster`` default, ``etcd_prefix`` /dkv, ``hash_seed`` 0, and ``tenant`` max
    where no explicit ``namespace`` is given, as the MAX adapter does).

    Settings are a JSON object of any of: ``namespace`` (or ``DKV_NAMESPACE``), ``tenant``
    (``DKV_TENANT``), ``hash_algorithm`` (MAX's ``kv_hash_algo``), ``hash_seed``
    (``kv_hash_seed``), ``cluster`` (``DKV_CLUSTER``), ``etcd_prefix`` (``DKV_ETCD_PREFIX``),
    ``etcd`` (``DKV_ETCD``), ``leaves`` (leaf id -> TP shards), layout fields (``model``,
    ``dtype``, ``page_size``, ``num_layers``, ``num_kv_heads``, ``head_dim``, or any other),
    flat or under ``layout``. Without a namespace, one is derived from the layout with
    :func:`dkv.keys.derive_namespace` when every field it needs is given.
    """
    na, nb = normalise_settings(a), normalise_settings(b)
    diffs = []
    ordered = ["namespace", "tenant", "hash_algorithm", "hash_seed", "cluster", "etcd_prefix", "etcd", "leaves",
               *LAYOUT_FIELDS]
    rest = sorted((set(na) | set(nb)) - set(ordered) - {"namespace_derived"})
    for name in [*ordered, *rest]:
        if name not in na and name not in nb:
            continue
        va = na.get(name, 0 if name == "hash_seed" else None)
        vb = nb.get(name, 0 if name == "hash_seed" else None)
        if name == "etcd" and (va is None or vb is None):
            continue
        if _same(va, vb):
            continue
        meaning = MEANING.get(name) or LAYOUT_MEANING.format(field=name)
        diffs.append({"field": name, "a": va, "b": vb, "meaning": meaning})
    share = not diffs
    if share:
        verdict = "the engines' connector settings match: they share blocks"
    else:
        first = diffs[0]
        more = f"{', '.join(d['field'] for d in diffs)}; first, " if len(diffs) > 1 else ""
        verdict = (f"the engines differ in {more}{first['field']} ({first['a']!r} vs {first['b']!r}): "
                   f"{first['meaning']}")
    return {"a": na, "b": nb, "differences": diffs, "share": share, "verdict": verdict}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, str)) and isinstance(b, (int, str)) and not isinstance(a, bool) and not isinstance(b, bool):
        return str(a) == str(b)  # a seed written as 0 or "0"
    return bool(a == b)
