"""The connector's memory of what the co-located node holds (connector.held_blocks): bounded, ageing, per leaf."""

from __future__ import annotations

import pytest

from connector import held_blocks
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


def test_memory_never_exceeds_its_capacity_and_keeps_the_most_recent_half() -> None:
    capacity = 40
    held = HeldBlocks(capacity=capacity, clock=Clock())
    learned: list[bytes] = []
    for batch in range(30):  # many generations' worth, over two leaves
        run = hashes(7, salt=batch)
        held.learn("full" if batch % 2 else "swa", held=run)
        learned += [("full" if batch % 2 else "swa", h) for h in run]
        assert len(held) <= capacity
    recent = learned[-capacity // 2:]
    for leaf, h in recent:
        assert held.holds(leaf, h), "a pair among the last capacity/2 learned was forgotten"
    held.learn("full", held=hashes(capacity * 3, salt=99))  # one batch bigger than the memory: its tail kept
    assert len(held) <= capacity
    assert held.holds("full", hashes(capacity * 3, salt=99)[-1])


def test_a_pair_absent_since_is_forgotten_in_both_generations() -> None:
    held = HeldBlocks(capacity=8, clock=Clock())
    first = hashes(3)
    held.learn("full", held=first)
    held.learn("full", held=hashes(3, salt=1))  # the young generation ages: `first` is now the old one
    assert held.lacking("full", first) == []
    held.learn("full", absent=[first[0]])
    assert held.lacking("full", first) == [0]


def test_entries_older_than_max_age_are_lacking_whichever_generation_holds_them() -> None:
    clock = Clock()
    held = HeldBlocks(capacity=8, max_age=5.0, clock=clock)
    old, young = hashes(3), hashes(2, salt=1)
    held.learn("full", held=old)
    clock.now += 4
    held.learn("full", held=young)  # 3 + 2 > 8 // 2: `old` moved to the old generation
    clock.now += 2  # `old` is 6 s old, `young` 2 s
    assert held.lacking("full", old + young) == [0, 1, 2]
    assert held.lacking("full", young) == []
    assert not held.holds("full", old[0])


def test_a_memory_too_small_to_hold_two_generations_is_refused() -> None:
    with pytest.raises(ValueError):
        HeldBlocks(capacity=1)


def test_learning_a_hot_prefix_again_and_again_does_not_push_out_what_else_was_learned() -> None:
    held = HeldBlocks(capacity=64, clock=Clock())
    offloaded, hot = hashes(20, salt=1), hashes(20, salt=2)
    held.learn("full", held=offloaded)
    for _ in range(1000):  # every lookup of the hot prefix teaches it again
        held.learn("full", held=hot)
    assert held.lacking("full", offloaded) == [] and held.lacking("full", hot) == []


@pytest.mark.parametrize("seed", range(8))
def test_a_mix_of_old_young_and_new_pairs_reports_exactly_the_new_ones(seed: int) -> None:
    """Whatever the order, pairs known in either generation are held and only the others lack (the usual
    offload, nothing known, takes a shortcut: it must not hide a pair one generation knows)."""
    import random

    rng = random.Random(seed)
    held = HeldBlocks(capacity=16, clock=Clock())
    old = hashes(5, salt=1)
    held.learn("full", held=old)
    held.learn("full", held=hashes(4, salt=2))  # the young generation ages: `old` is now the old one
    young = hashes(3, salt=3)
    held.learn("full", held=young)
    new = hashes(6, salt=4)
    for picks in ([new], [new, old[:1]], [new, young[-1:]], [old, young], [new, old, young]):
        mixed = [h for group in picks for h in group]
        rng.shuffle(mixed)
        assert held.lacking("full", mixed) == [i for i, h in enumerate(mixed) if h in new]
        assert held.lacking("swa", mixed) == list(range(len(mixed)))  # another leaf knows none of them


def test_the_filter_before_the_dicts_is_built() -> None:
    assert held_blocks._filter_maybe is not None, (
        "dkv._hash_filter was not built: install a C compiler, then `pip install -e .` again (scripts/run.sh does both)")
    assert HeldBlocks(capacity=64)._young_bits is not None


@pytest.mark.parametrize("filter_bits", [64, 1, 0])
@pytest.mark.parametrize("seed", range(6))
def test_with_or_without_its_filter_the_memory_answers_alike(seed: int, filter_bits: int) -> None:
    """Learning, forgetting absent pairs, ageing out and generations turning over, in a random order: a memory
    with a filter (the default, and one so small that most hashes pass it: the dicts decide) answers every
    question exactly as one without."""
    import random

    rng = random.Random(seed)
    clock = Clock()
    exact = HeldBlocks(capacity=48, max_age=20.0, clock=clock, filter_bits=0)
    filtered = HeldBlocks(capacity=48, max_age=20.0, clock=clock, filter_bits=filter_bits)
    universe = {leaf: hashes(60, salt=salt) + [bytes(rng.getrandbits(8) for _ in range(32)) for _ in range(30)]
                for salt, leaf in enumerate(("full", "swa"))}
    for _ in range(300):
        leaf = rng.choice(("full", "swa"))
        pool = universe[leaf]
        action = rng.random()
        if action < 0.45:
            picked = rng.sample(pool, rng.randint(1, 12))
            for memory in (exact, filtered):
                memory.learn(leaf, held=picked)
        elif action < 0.6:
            picked = rng.sample(pool, rng.randint(1, 6))
            for memory in (exact, filtered):
                memory.learn(leaf, absent=picked)
        elif action < 0.65:
            clock.now += rng.choice((1.0, 8.0, 25.0))
        elif action < 0.67:
            for memory in (exact, filtered):
                memory.forget()
        asked = rng.sample(pool, rng.randint(0, 20))
        assert filtered.lacking(leaf, asked) == exact.lacking(leaf, asked)
        assert filtered.lacking(leaf, tuple(asked)) == exact.lacking(leaf, asked)
    assert len(filtered) == len(exact)


def test_hashes_the_filter_cannot_take_are_answered_by_the_dicts() -> None:
    held = HeldBlocks(capacity=64, clock=Clock())
    run = hashes(4)
    held.learn("full", held=run[:2])
    assert held.lacking("full", run[1:] + [b"xy"]) == [1, 2, 3]  # one too short for the filter: the dicts answer
    held.learn("full", held=[b"xy"])  # not one the filter takes: it is dropped, the dicts go on alone
    assert held._young_bits is None and held.lacking("full", run + [b"xy"]) == [2, 3]


def test_a_negative_filter_size_is_refused() -> None:
    with pytest.raises(ValueError):
        HeldBlocks(capacity=64, filter_bits=-1)

