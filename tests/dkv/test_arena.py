"""Slot allocation and the shared-memory arena."""

from __future__ import annotations

import os

import pytest

from dkv.arena import PAGE, Arena, ArenaMapping, SlotAllocator, align_up
from dkv.errors import ConfigError


def test_every_slot_is_page_aligned() -> None:
    alloc = SlotAllocator(64 * PAGE)
    offsets = [alloc.alloc(n) for n in (1, 4097, 100, 8192, 3)]
    assert all(o is not None and o % PAGE == 0 for o in offsets)


def test_exhaustion_returns_none_and_free_makes_room() -> None:
    alloc = SlotAllocator(4 * PAGE)
    offsets = [alloc.alloc(PAGE) for _ in range(4)]
    assert alloc.alloc(1) is None
    alloc.free(offsets[2], PAGE)
    assert alloc.alloc(PAGE) == offsets[2]


def test_free_runs_coalesce_into_larger_slots() -> None:
    alloc = SlotAllocator(4 * PAGE)
    a, b, c, d = (alloc.alloc(PAGE) for _ in range(4))
    for off in (b, a, c):
        alloc.free(off, PAGE)
    assert alloc.alloc(3 * PAGE) == a
    assert alloc.used == 4 * PAGE and alloc.free_bytes == 0


def test_align_up() -> None:
    assert [align_up(n) for n in (0, 1, PAGE, PAGE + 1)] == [0, PAGE, PAGE, 2 * PAGE]


def test_arena_is_shared_with_a_mapping_and_unlinked_at_close() -> None:
    arena = Arena(16 * PAGE, label="unit")
    try:
        mapping = ArenaMapping(arena.info)
        arena.slot(PAGE, 5)[:] = b"hello"
        assert bytes(mapping.slot(PAGE, 5)) == b"hello"
        mapping.slot(0, 3)[:] = b"abc"
        assert bytes(arena.slot(0, 3)) == b"abc"
        mapping.close()
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


def test_mapping_refuses_slots_outside_the_arena() -> None:
    arena = Arena(4 * PAGE, label="unit")
    try:
        mapping = ArenaMapping(arena.info)
        with pytest.raises(ValueError):
            mapping.slot(3 * PAGE, 2 * PAGE)
        mapping.close()
    finally:
        arena.close()


def test_pool_too_small_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Arena(100)
