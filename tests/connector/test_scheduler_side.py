"""The connector's scheduler side on its own: hints, backoff, leases, load and offload planning, counters.

No node and no loop: the scheduler side does no I/O, so every decision it
makes is checked here with plain objects, a fake directory and a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.held_blocks import HeldBlocks
from connector.scheduler_side import (
    LEASE_MARGIN,
    UNREACHABLE_BACKOFF,
    LeaseState,
    SchedulerSide,
    validate_device_blocks,
)
from connector.types import KVLoadInvalid, KVLoadRefused, full_attention, sliding_window
from dkv.errors import DKVError, LeaseExpired, PeerUnauthenticated, TransportError
from dkv.etcd import MemberRecord
from dkv.hints import (
    BEHIND_DEVICE,
    MISMATCH,
    PEER_UNREACHABLE,
    UNAUTHENTICATED_PEER,
    UNKNOWN_PEER,
    build_hint,
)
from dkv.store import EXISTS, WRITE

PAGES, PAGE_BYTES = 16, 64
LOCAL, PEER = "10.0.0.1:7420", "10.0.0.2:7420"
NAMESPACE = "test/sched"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRouter:
    """The two things the scheduler side reads of the directory: the member table and a chain's depth."""

    members: dict[str, MemberRecord] = field(default_factory=dict)
    depths: dict[str, int] = field(default_factory=dict)

    def depth_of(self, node_id: str, namespace: str, hashes: list[bytes]) -> int:
        return min(self.depths.get(node_id, 0), len(hashes))


def member(node_id: str, address: str, epoch: str = "e1") -> MemberRecord:
    return MemberRecord(node_id=node_id, address=address, epoch=epoch, protocol_version=1, started_at=0.0,
                        host_id="h")


def blocks(tp: int = 1, replicas: int = 1) -> list[dict[str, list[torch.Tensor]]]:
    return [{leaf: [torch.zeros(PAGES, PAGE_BYTES, dtype=torch.uint8) for _ in range(tp)]
             for leaf in ("full", "swa")} for _ in range(replicas)]


def leaves(tp: int = 1) -> dict:
    return {"full": full_attention(0, tp), "swa": sliding_window(1, 64, tp)}


def side(clock: Clock | None = None, tp: int = 1, replicas: int = 1, router: FakeRouter | None = None) -> SchedulerSide:
    s = SchedulerSide(leaves(tp), blocks(tp, replicas), namespace=NAMESPACE, node_address=LOCAL,
                      clock=clock or Clock())
    s.node_id = "local"
    s.router = router  # type: ignore[assignment]
    return s


def chain(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1000 + i + 1).to_bytes(8, "big") for i in range(n)]


def state(s: SchedulerSide, hashes: list[bytes], present: int | None = None, *, lease_id: int | None = 7,
          hint: bytes | None = None, address: str = LOCAL, ttl: float = 10.0) -> LeaseState:
    n = len(hashes) if present is None else present
    mask = [True] * n + [False] * (len(hashes) - n)
    slot = s.budget.take(address, 64, 20.0)
    return s.granted(address, slot, hashes, hint, address != LOCAL, {"full": list(mask), "swa": list(mask)},
                     lease_id, ttl, generation=0)


def never_lost(address: str, generation: int) -> bool:
    return False


# ---- construction --------------------------------------------------------------------------------


def test_device_blocks_are_validated_against_the_leaves() -> None:
    assert validate_device_blocks(leaves(2), blocks(2)) == 2
    with pytest.raises(ValueError, match="at least one replica"):
        validate_device_blocks(leaves(), [])
    with pytest.raises(ValueError, match="same TP shard count"):
        validate_device_blocks({"full": full_attention(0, 1), "swa": sliding_window(1, 64, 2)}, blocks())
    with pytest.raises(ValueError, match="differ from leaves"):
        validate_device_blocks({"full": full_attention(0, 1)}, blocks())
    with pytest.raises(ValueError, match="shard tensors"):
        validate_device_blocks(leaves(2), blocks(1))
    bad = blocks()
    bad[0]["full"] = [torch.zeros(PAGES, PAGE_BYTES, dtype=torch.float16)]
    with pytest.raises(ValueError, match="uint8"):
        validate_device_blocks(leaves(), bad)


def test_identity_replicas_and_handle_groups() -> None:
    s = side(replicas=2)
    assert s.leaf_groups() == {"full": 0, "swa": 1}
    assert s.probe_leaves == ["full"]
    s.check_replica(1)
    with pytest.raises(ValueError, match="replica_idx 2"):
        s.check_replica(2)
    first, second = s.next_handle_group(), s.next_handle_group()
    assert first >= 1024 and second == first + 1  # never a replica's own group
    assert s.empty_masks(3) == {"full": [False] * 3, "swa": [False] * 3}


# ---- sources, hints, backoff ---------------------------------------------------------------------


def test_no_hint_is_the_co_located_node() -> None:
    assert side().source(chain(4), None) == (LOCAL, False)


def test_a_usable_hint_names_the_peer_and_an_unusable_one_is_a_counted_local_miss() -> None:
    peer = member("b", PEER)
    router = FakeRouter({"b": peer, "local": member("local", LOCAL)})
    s = side(router=router)
    hashes = chain(4)
    hint = build_hint(peer, NAMESPACE, hashes, 4).encode()
    assert s.source(hashes, hint) == (PEER, True)
    # a hint naming this node itself is the local path, not a peer
    assert s.source(hashes, build_hint(router.members["local"], NAMESPACE, hashes, 4).encode()) == (LOCAL, False)
    # an unknown peer, another request's blocks, garbage: local, counted by reason
    assert s.source(hashes, build_hint(member("zz", "10.9.9.9:1"), NAMESPACE, hashes, 4).encode()) == (LOCAL, False)
    assert s.source(chain(4, salt=5), hint) == (LOCAL, False)
    assert s.source(hashes, b"\xff not json") == (LOCAL, False)
    assert s.counters.unusable_hints[UNKNOWN_PEER] == 1
    assert s.counters.unusable_hints[MISMATCH] == 1
    assert sum(s.counters.unusable_hints.values()) == 3
    # a hint that adds nothing past the device hit is counted apart, not as rejected
    long = chain(8)
    behind = build_hint(peer, NAMESPACE, long, 2).encode()
    assert s.source(long[4:], behind) == (LOCAL, False)
    assert s.counters.hints_behind_device == 1
    assert BEHIND_DEVICE not in s.counters.unusable_hints
    assert s.take_metrics().dkv_hints_rejected == 3


def test_an_unanswering_peer_is_left_alone_until_its_backoff_ends_or_it_re_registers() -> None:
    clock = Clock()
    peer = member("b", PEER, epoch="e1")
    router = FakeRouter({"b": peer})
    s = side(clock, router=router)
    hashes = chain(2)
    hint = build_hint(peer, NAMESPACE, hashes, 2).encode()

    s.unanswered(PEER, TransportError("connection refused"))
    assert s.backing_off(PEER)
    assert s.source(hashes, hint) == (LOCAL, False)
    assert s.counters.unusable_hints[PEER_UNREACHABLE] == 1
    assert s.take_metrics().dkv_peer_attach_failures == 1

    router.members = {"b": member("b", PEER, epoch="e2")}  # restarted: a new epoch is asked again
    assert s.source(hashes, build_hint(router.members["b"], NAMESPACE, hashes, 2).encode()) == (PEER, True)

    s.unanswered(PEER, TimeoutError())
    assert s.backing_off(PEER)
    clock.now += UNREACHABLE_BACKOFF + 0.01
    assert not s.backing_off(PEER)
    assert PEER not in s.unreachable


def test_an_error_reply_is_an_answer_and_shutdown_marks_nothing() -> None:
    s = side()
    s.unanswered(PEER, LeaseExpired("lease_expired", "lease 3 is not held"))
    s.unanswered(PEER, DKVError("refused"))
    s.unanswered(PEER, TransportError("closing"), closed=True)
    assert not s.unreachable


def test_a_peer_that_cannot_prove_the_credential_is_never_trusted() -> None:
    s = side()
    s.unanswered(PEER, PeerUnauthenticated("bad proof"), closed=True)
    assert s.backing_off(PEER)
    assert s.counters.unusable_hints[UNAUTHENTICATED_PEER] == 1
    s.unanswered(LOCAL, PeerUnauthenticated("bad proof"))  # the co-located node: backed off, not a hint
    assert s.backing_off(LOCAL)
    assert s.counters.unusable_hints[UNAUTHENTICATED_PEER] == 1


# ---- leases --------------------------------------------------------------------------------------


def test_the_lease_budget_is_taken_bound_and_given_back() -> None:
    s = side()
    limits = {"max_leases": 2, "lease_ttl": 5.0}
    a, b = s.take_lease_slot(LOCAL, limits), s.take_lease_slot(LOCAL, limits)
    assert a is not None and b is not None
    assert s.take_lease_slot(LOCAL, limits) is None
    assert s.counters.lookups_over_lease_budget == 1
    granted = s.granted(LOCAL, a, chain(2), None, False, {"full": [True, False], "swa": [True, False]}, 11, 5.0, 0)
    assert granted.slot == a and s.budget.held(LOCAL) == 2
    none = s.granted(LOCAL, b, chain(2), None, False, {"full": [False] * 2, "swa": [False] * 2}, None, 5.0, 0)
    assert none.slot is None and s.budget.held(LOCAL) == 1  # no lease granted: its slot is free at once
    s.budget.give_back_lease(LOCAL, 11)
    assert s.budget.held(LOCAL) == 0


def test_a_lease_state_knows_what_it_reported_per_leaf() -> None:
    s = side()
    hashes = chain(4)
    st = s.granted(LOCAL, None, hashes, None, False, {"full": [True, True, False, True], "swa": [False] * 4},
                   3, 10.0, 0)
    assert st.reported == {"full": frozenset({hashes[0], hashes[1], hashes[3]}), "swa": frozenset()}


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_lease_state_covers_a_run_exactly_when_the_lookup_reported_each_of_its_hashes(data: Any) -> None:
    pool = chain(6)
    hashes = data.draw(st.lists(st.sampled_from(pool), max_size=10))  # repeats possible, some never asked
    masks = {"full": data.draw(st.lists(st.booleans(), min_size=len(hashes), max_size=len(hashes)))}
    state = LeaseState(LOCAL, 1, masks, hashes, None, 10.0, False)
    runs = [data.draw(st.lists(st.sampled_from(pool), max_size=6))]
    if hashes:  # a slice of the lookup's own list, the usual shape of a load
        at = data.draw(st.integers(0, len(hashes) - 1))
        runs.append(hashes[at:data.draw(st.integers(at, len(hashes)))])
    for run in runs:
        want = all(h in {x for x, m in zip(hashes, masks["full"]) if m} for h in run)
        assert state.covers("full", run) is want, (hashes, masks, run)
        assert state.covers("full", tuple(run)) is want
        assert state.covers("swa", run) is (not run)  # a leaf the lookup did not ask of: nothing reported


def test_a_co_located_lookup_teaches_what_the_node_holds_and_a_peer_lookup_does_not() -> None:
    s = side()
    hashes = chain(3)
    s.granted(LOCAL, None, hashes, None, False, {"full": [True, True, False], "swa": [True] * 3}, 1, 10.0, 0)
    assert s.held.lacking("full", hashes) == [2]
    assert s.held.lacking("swa", hashes) == []
    s.granted(PEER, None, chain(2, salt=9), None, True, {"full": [True] * 2, "swa": [True] * 2}, 2, 10.0, 0)
    assert s.held.lacking("full", chain(2, salt=9)) == [0, 1]


def test_lookups_are_counted_by_where_they_hit() -> None:
    s = side()
    s.count_lookup(None)
    s.count_lookup(state(s, chain(3), 2))
    s.count_lookup(state(s, chain(3), 3, address=PEER))
    s.count_lookup(state(s, chain(3), 0))
    c = s.counters
    assert (c.lookups, c.lookup_failures, c.hits_local, c.hits_peer, c.blocks_reported) == (4, 1, 1, 1, 4 + 6)


# ---- loads ---------------------------------------------------------------------------------------


def test_a_covered_load_is_planned_without_counting_a_refusal() -> None:
    s = side()
    hashes = chain(4)
    st = state(s, hashes)
    plan = s.plan_load(st, {"full": [1, 2, 3, 4], "swa": [5, 6]}, {"full": hashes, "swa": hashes[2:]}, 0, None,
                       never_lost)
    assert plan is not None
    assert [(r.leaf, r.block_ids, r.hashes) for r in plan.runs] == [("full", [1, 2, 3, 4], hashes),
                                                                    ("swa", [5, 6], hashes[2:])]
    assert s.counters.loads_refused == 0


def test_a_load_that_moves_nothing_plans_nothing() -> None:
    s = side()
    assert s.plan_load(state(s, chain(2)), {"full": []}, {"full": []}, 0, None, never_lost) is None
    assert s.plan_load(None, {}, {}, 0, None, never_lost) is None
    assert s.counters.loads_refused == 0


@pytest.mark.parametrize("ids, hashes, match", [
    ({"nope": [1]}, {"nope": chain(1)}, "unknown leaf"),
    ({"full": [1, 2]}, {"full": chain(1)}, "2 block ids for 1 hashes"),
    ({"full": [0]}, {"full": chain(1)}, "outside 1..15"),
    ({"full": [PAGES]}, {"full": chain(1)}, "outside 1..15"),
    ({"full": [2, 2]}, {"full": chain(2)}, "appears more than once"),
    ({"full": [1.0]}, {"full": chain(1)}, "integers"),
    ({"full": [1]}, {"full": [b"short"]}, "8 bytes"),
    ({"full": [1]}, {"full": ["a string"]}, "must be bytes"),
])
def test_bad_input_is_an_invalid_load_counted_as_refused(ids, hashes, match) -> None:
    s = side()
    with pytest.raises(KVLoadInvalid, match=match):
        s.plan_load(state(s, chain(1)), ids, hashes, 0, None, never_lost)
    assert s.counters.loads_refused == 1
    assert s.take_metrics().connector_loads_refused == 1


def test_a_bad_replica_is_an_invalid_load() -> None:
    s = side()
    with pytest.raises(KVLoadInvalid, match="replica_idx 3"):
        s.plan_load(state(s, chain(1)), {"full": [1]}, {"full": chain(1)}, 3, None, never_lost)


def test_loads_the_lookup_cannot_serve_are_refused_and_name_the_block() -> None:
    clock = Clock()
    s = side(clock)
    hashes = chain(4)
    ids, want = {"full": [1, 2, 3]}, {"full": hashes[:3]}

    def refused(st: LeaseState | None, hint: bytes | None = None, lost=never_lost,
                ids=ids, want=want) -> KVLoadRefused:
        with pytest.raises(KVLoadRefused) as info:
            s.plan_load(st, ids, want, 0, hint, lost)
        return info.value

    assert "no completed lookup" in str(refused(None))
    assert "same hint" in str(refused(state(s, hashes), hint=b"{}"))
    assert "no lease" in str(refused(state(s, hashes, lease_id=None)))
    expiring = state(s, hashes, ttl=LEASE_MARGIN + 0.2)
    clock.now += 0.3
    assert "expired" in str(refused(expiring))
    assert "no longer holds" in str(refused(state(s, hashes), lost=lambda address, generation: True))
    partial = refused(state(s, hashes, 2))  # the third block was not reported
    assert "not reported" in str(partial)
    assert (getattr(partial, "leaf_id", "full"), getattr(partial, "block_hash", hashes[2])) == ("full", hashes[2])
    other = refused(state(s, hashes), ids={"swa": [1]}, want={"swa": chain(1, salt=3)})
    assert "not reported" in str(other)
    assert s.counters.loads_refused == 7


# ---- offloads ------------------------------------------------------------------------------------


def test_an_offload_skips_what_the_node_is_known_to_hold() -> None:
    s = side()
    hashes = chain(4)
    plan = s.plan_offload({"full": [1, 2, 3, 4]}, {"full": hashes}, 0)
    assert [r.block_ids for r in plan.runs] == [[1, 2, 3, 4]]
    # the node wrote 0 and 2, already had 1, and refused 3
    moved = s.learn_offload(plan, [WRITE, EXISTS, WRITE, "refused"])
    assert moved == 2 * PAGE_BYTES
    again = s.plan_offload({"full": [1, 2, 3, 4], "swa": [5]}, {"full": hashes, "swa": hashes[:1]}, 0)
    assert [(r.leaf, r.block_ids, r.hashes) for r in again.runs] == [("full", [4], hashes[3:]), ("swa", [5], hashes[:1])]
    assert s.plan_offload({"full": [1, 2, 3]}, {"full": hashes[:3]}, 0).runs == []
    with pytest.raises(ValueError):
        s.plan_offload({"full": [1]}, {"full": hashes[:1]}, 1)


def test_an_offload_the_node_holds_on_only_some_shards_is_not_known_held() -> None:
    s = side(tp=2)
    hashes = chain(2)
    plan = s.plan_offload({"full": [1, 2]}, {"full": hashes}, 0)
    # statuses are per shard, then per block: shard 0 took both, shard 1 only the first
    moved = s.learn_offload(plan, [WRITE, WRITE, EXISTS, "refused"])
    assert moved == 2 * PAGE_BYTES
    assert s.held.lacking("full", hashes) == [1]


def test_an_unchanged_offload_plan_is_the_same_plan() -> None:
    s = side()
    plan = s.plan_offload({"full": [1, 2]}, {"full": chain(2)}, 0)
    assert s.not_held(plan) is plan


def test_held_blocks_age_out_in_one_pass() -> None:
    clock = Clock()
    held = HeldBlocks(capacity=8, max_age=5.0, clock=clock)
    hashes = chain(4)
    assert held.lacking("full", hashes) == [0, 1, 2, 3]
    held.learn("full", held=[hashes[0], hashes[1]])
    clock.now += 3
    held.learn("full", held=[hashes[2]])
    assert held.lacking("full", hashes) == [3]
    clock.now += 3  # the first two are older than max_age now: lacking, and forgotten
    assert held.lacking("full", hashes) == [0, 1, 3]
    assert len(held) == 1
    assert held.holds("full", hashes[2]) and not held.holds("swa", hashes[2])


# ---- pricing -------------------------------------------------------------------------------------


def test_probe_answers_from_the_directory_for_full_attention_leaves() -> None:
    peer = member("b", PEER)
    router = FakeRouter({"b": peer}, depths={"local": 1, "b": 3})
    s = side(router=router)
    hashes = chain(4)
    local = s.probe(hashes, [0, 1])
    assert local is not None and len(local) == 2 and local[0] is local[1]
    assert local[0] == {"full": [True, False, False, False]}
    via_peer = s.probe(hashes, [0], build_hint(peer, NAMESPACE, hashes, 3).encode())
    assert via_peer == [{"full": [True, True, True, False]}]
    assert side().probe(hashes, [0]) is None  # no directory: nothing to answer from


def test_a_lookup_after_a_load_leaves_the_loaded_leases_group_alone() -> None:
    s = side(replicas=2)
    first = s.replica_group(1, ends_previous=False)
    assert first in (2, 3)
    assert s.replica_group(1, ends_previous=True) == first  # ends the unloaded previous lease: the same group
    after_load = s.replica_group(1, ends_previous=False)  # the loaded lease's read ends it, not this lookup
    assert after_load != first and after_load in (2, 3)
    assert s.replica_group(1, ends_previous=False) == first  # and back: two groups per replica, never more
    assert {s.replica_group(0, ends_previous=False) for _ in range(4)} == {0, 1}  # replicas never share one
