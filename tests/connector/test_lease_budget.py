"""The connector's per-node lease slots (connector.lease_budget.LeaseBudget), on a clock the tests move."""

from __future__ import annotations

from connector.lease_budget import LeaseBudget


def _budget() -> tuple[LeaseBudget, list[float]]:
    now = [100.0]
    return LeaseBudget(clock=lambda: now[0]), now


def test_no_more_slots_than_the_limit_and_a_lease_given_back_frees_its_slot() -> None:
    budget, now = _budget()
    first, second = budget.take("a", 2, 10.0), budget.take("a", 2, 10.0)
    assert None not in (first, second) and budget.take("a", 2, 10.0) is None
    assert budget.take("b", 2, 10.0) is not None  # per node
    budget.bind("a", first, 7, now[0] + 10.0)
    budget.give_back_lease("a", 7)
    budget.give_back_lease("a", 7)  # idempotent
    budget.give_back_lease("a", 99)  # unknown: ignored
    assert budget.held("a") == 1 and budget.take("a", 2, 10.0) is not None
    budget.give_back("a", second)
    budget.give_back("a", None)
    assert budget.held("a") == 1


def test_a_slot_lapses_with_its_lease_and_the_next_take_finds_room() -> None:
    budget, now = _budget()
    slot = budget.take("a", 1, 10.0)
    budget.bind("a", slot, 1, now[0] + 5.0)
    assert budget.take("a", 1, 10.0) is None
    now[0] += 5.0
    assert budget.take("a", 1, 10.0) is not None


def test_the_leases_of_lapsed_slots_are_forgotten_as_slots_are_given_back() -> None:
    """Leases whose slots lapsed (never given back) leave the lease index once it outgrows the live slots."""
    budget, now = _budget()
    for lease in range(5000):
        slot = budget.take("a", 4, 1.0)
        assert slot is not None
        budget.bind("a", slot, lease, now[0] + 1.0)
        if lease % 10 == 0:
            budget.give_back_lease("a", lease)
        now[0] += 2.0  # the rest lapse
        assert len(budget._by_lease) <= 4 * 4 + 64 + 1
