"""The connector's memory of what the co-located node holds (connector.held_blocks): bounded, ageing, per leaf."""

from __future__ import annotations

import pytest

from connector.held_blocks import HeldBlocks


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 100_000 + i + 1).to_bytes(8, "big") for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_what_was_learned_is_known_per_leaf_and_absent_blocks_are_forgotten() -> None:
    held = HeldBlocks(capacity=64, clock=Clock())
    run = hashes(6)
    held.learn("full", held=run[:4])
    assert held.lacking("full", run) == [4, 5]
    assert held.lacking("swa", run) == list(range(6))  # another leaf learned nothing
    held.learn("full", absent=[run[1]])
    assert held.lacking("full", run) == [1, 4, 5]
    assert held.holds("full", run[0]) and not held.holds("full", run[1])
    held.forget()
    assert held.lacking("full", run) == list(range(6)) and len(held) == 0


def test_memory_never_exceeds_its_capacity_and_keeps_the_most_recent_batches() -> None:
    capacity = 40
    held = HeldBlocks(capacity=capacity, clock=Clock())
    learned: list[bytes] = []
    for batch in range(30):  # many generations' worth, over two leaves
        run = hashes(7, salt=batch)
        held.learn("full" if batch % 2 else "swa", held=run)
        learned += [("full" if batch % 2 else "swa", h) for h in run]
        assert len(held) <= capacity
    recent = learned[-(capacity // 7) * 7:]  # the newest batches that together name at most `capacity`
    for leaf, h in recent:
        assert held.holds(leaf, h), "a pair of the newest batches was forgotten"
    held.learn("full", held=hashes(capacity * 3, salt=99))  # one batch bigger than the memory: its tail kept
    assert len(held) <= capacity
    assert held.holds("full", hashes(capacity * 3, salt=99)[-1])


def test_a_pair_absent_since_is_forgotten_whichever_batch_learned_it() -> None:
    held = HeldBlocks(capacity=8, clock=Clock())
    first = hashes(3)
    held.learn("full", held=first)
    held.learn("full", held=hashes(3, salt=1))
    assert held.lacking("full", first) == []
    held.learn("full", absent=[first[0]])
    assert held.lacking("full", first) == [0]


def test_a_pair_learned_again_outlives_the_batch_that_first_learned_it() -> None:
    held = HeldBlocks(capacity=8, clock=Clock())  # a clock that never moves: each batch still has its own stamp
    first = hashes(4)
    held.learn("full", held=first)
    held.learn("full", held=first[:1])  # learned again
    held.learn("full", held=hashes(4, salt=1))  # 9 pairs queued: the first batch goes
    assert held.lacking("full", first) == [1, 2, 3]
    assert held.lacking("full", hashes(4, salt=1)) == []
    assert len(held) == 5


def test_learning_the_same_pairs_again_and_again_stays_bounded() -> None:
    held = HeldBlocks(capacity=16, clock=Clock())
    run = hashes(5)
    for _ in range(1000):
        held.learn("full", held=run)
        held.learn("swa", held=list(run))
    assert held._queued <= 16 and len(held._batches) <= 4  # noqa: SLF001 - the queue is what could grow
    assert held.lacking("full", run) == [] and held.lacking("swa", run) == []
    assert len(held) == 10


def test_a_learned_batch_is_kept_as_it_was_when_the_caller_changes_its_list() -> None:
    held = HeldBlocks(capacity=4, clock=Clock())
    run = hashes(4)
    batch = list(run)
    held.learn("full", held=batch)
    batch[:] = hashes(4, salt=1)  # the caller reuses its list
    held.learn("full", held=hashes(4, salt=2))  # the first batch goes: its own pairs, not the list's new ones
    assert held.lacking("full", run) == [0, 1, 2, 3] and len(held) == 4


def test_entries_older_than_max_age_are_lacking_whichever_batch_learned_them() -> None:
    clock = Clock()
    held = HeldBlocks(capacity=8, max_age=5.0, clock=clock)
    old, young = hashes(3), hashes(2, salt=1)
    held.learn("full", held=old)
    clock.now += 4
    held.learn("full", held=young)
    clock.now += 2  # `old` is 6 s old, `young` 2 s
    assert held.lacking("full", old + young) == [0, 1, 2]
    assert held.lacking("full", young) == []
    assert not held.holds("full", old[0])


def test_a_memory_too_small_to_hold_two_generations_is_refused() -> None:
    with pytest.raises(ValueError):
        HeldBlocks(capacity=1)
