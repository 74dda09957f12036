"""Slot allocation and the shared-memory arena."""

from __future__ import annotations

import os

import pytest

import mmap

from dkv.arena import PAGE, Arena, SegmentMapping, SlotAllocator, align_up
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


def test_a_namespace_segment_is_shared_with_a_mapping_of_its_descriptor() -> None:
    arena = Arena(16 * PAGE, label="unit")
    try:
        offset = arena.allocate("ns/a", 5)
        fd = arena.segment("ns/a").share(writable=True)
        try:
            mapping = SegmentMapping(fd, os.fstat(fd).st_size, writable=True)
        finally:
            os.close(fd)
        arena.slot("ns/a", offset, 5)[:] = b"hello"
        assert bytes(mapping.slot(offset, 5)) == b"hello"
        mapping.slot(offset, 3)[:] = b"abc"
        assert bytes(arena.slot("ns/a", offset, 3)) == b"abc"
        mapping.close()
    finally:
        arena.close()


def test_namespaces_live_in_separate_segments_within_one_budget() -> None:
    arena = Arena(4 * PAGE, label="unit")
    try:
        a = arena.allocate("ns/a", 2 * PAGE)
        b = arena.allocate("ns/b", 2 * PAGE)
        assert a is not None and b is not None
        arena.slot("ns/a", a, 4)[:] = b"AAAA"
        arena.slot("ns/b", b, 4)[:] = b"BBBB"
        assert arena.segments == 2 and arena.free_bytes == 0
        assert arena.allocate("ns/a", 1) is None, "the budget is the pool's, across namespaces"
        fd = arena.segment("ns/b").share(writable=False)
        try:
            mapping = SegmentMapping(fd, os.fstat(fd).st_size, writable=False)
        finally:
            os.close(fd)
        assert b"AAAA" not in bytes(mapping.view), "ns/b's segment holds nothing of ns/a"
        mapping.close()
    finally:
        arena.close()


def test_a_freed_slot_reads_as_zeros_when_handed_out_again() -> None:
    arena = Arena(4 * PAGE, label="unit")
    try:
        offset = arena.allocate("ns/a", PAGE)
        arena.slot("ns/a", offset, PAGE)[:] = b"\xee" * PAGE
        arena.free("ns/a", offset, PAGE)
        again = arena.allocate("ns/a", PAGE)
        assert again == offset
        assert bytes(arena.slot("ns/a", again, PAGE)) == bytes(PAGE)
    finally:
        arena.close()


def test_a_read_only_share_cannot_be_mapped_writable() -> None:
    arena = Arena(4 * PAGE, label="unit")
    try:
        fd = arena.segment("ns/a").share(writable=False)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            mapping = SegmentMapping(fd, 4 * PAGE, writable=False)
        finally:
            os.close(fd)
        with pytest.raises(TypeError):
            mapping.slot(0, 4)[:] = b"evil"
        mapping.close()
    finally:
        arena.close()


def test_mapping_refuses_slots_outside_the_segment() -> None:
    arena = Arena(4 * PAGE, label="unit")
    try:
        fd = arena.segment("ns/a").share(writable=True)
        try:
            mapping = SegmentMapping(fd, 4 * PAGE, writable=True)
        finally:
            os.close(fd)
        with pytest.raises(ValueError):
            mapping.slot(3 * PAGE, 2 * PAGE)
        mapping.close()
    finally:
        arena.close()


def test_the_namespace_bound_is_kept_and_only_an_unused_unheld_segment_makes_room() -> None:
    arena = Arena(4 * PAGE, label="unit", max_namespaces=2)
    try:
        a = arena.allocate("ns/a", 1)
        assert a is not None and arena.segment("ns/b") is not None
        arena.hold("ns/b")  # a connection was handed ns/b's (empty) segment
        assert arena.allocate("ns/c", 1) is None and arena.segment("ns/c") is None
        arena.let_go("ns/b")  # that connection ended: the empty segment may go
        assert arena.allocate("ns/c", 1) is not None and arena.segments == 2
        arena.free("ns/a", a, 1)
        assert arena.segment("ns/d") is not None, "ns/a holds nothing any more and nobody maps it"
    finally:
        arena.close()


def test_pool_too_small_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Arena(100)


def test_one_namespace_that_frees_and_refills_keeps_its_pages_however_much_it_frees() -> None:
    arena = Arena(8 * PAGE, label="unit")
    arena.trim_slack = PAGE
    try:
        slots = [arena.allocate("ns/a", PAGE) for _ in range(8)]
        for offset in slots:
            arena.slot("ns/a", offset, PAGE)[:] = b"\x01" * PAGE
            arena.free("ns/a", offset, PAGE)
        assert arena.trims == 0 and arena.resident_free == 8 * PAGE, "kept for the namespace's next blocks"
        assert all(bytes(arena.slot("ns/a", o, PAGE)) == bytes(PAGE) for o in slots), "zeroed all the same"
        again = [arena.allocate("ns/a", PAGE) for _ in range(8)]
        assert sorted(again) == sorted(slots) and arena.resident_free == 0
    finally:
        arena.close()


def test_memory_freed_by_one_namespace_goes_back_once_another_grows_past_the_slack() -> None:
    arena = Arena(8 * PAGE, label="unit")
    arena.trim_slack = 2 * PAGE
    try:
        a = [arena.allocate("ns/a", PAGE) for _ in range(6)]
        for offset in a[:5]:
            arena.free("ns/a", offset, PAGE)
        b = [arena.allocate("ns/b", PAGE) for _ in range(4)]
        assert arena.trims == 0, "in use plus freed-but-mapped: 5 + 5 pages, within 8 + 2"
        b.append(arena.allocate("ns/b", PAGE))  # 6 + 5: past 8 + 2
        assert arena.trims == 1 and arena.resident_free == 0, "ns/a's freed pages went back"
    finally:
        arena.close()
