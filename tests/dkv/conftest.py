"""Fixtures of the store's logic tests: a page-sized arena of 8 slots and a clock the test moves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dkv.arena import PAGE, Arena
from dkv.store import Store

BLOCK = PAGE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(8 * BLOCK, label="unit")
    yield a
    a.close()


@pytest.fixture
def store(arena: Arena, clock: Clock) -> Store:
    return Store(arena, clock=clock, lease_ttl=10.0, reservation_ttl=30.0, max_leases_per_owner=4)
