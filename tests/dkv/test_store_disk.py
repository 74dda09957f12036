"""The disk tier's store logic: spills and promotions are plans, and no error path leaks.

The store does no file I/O: an eviction stages the block's bytes in memory and
queues a spill job; a leased lookup promotes from staging, or from bytes the
server read beforehand. The helpers below play the server's part
synchronously (write the spill files, read files back before a lookup), so a
failure can be injected exactly where it happens on a node. The last tests
run the real mover (:class:`dkv.disk_worker.DiskWorker`) on the event loop
over a disk whose I/O blocks.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dkv.arena import PAGE, Arena, align_up
from dkv.disk_tier import FAILING, FULL, HEALTHY, MISSING, DiskTier, fault_of
from dkv.store import BUSY, WRITE, Store, StoreKey
from tests.dkv.conftest import Clock

NS = "t/disk"
BLOCK = PAGE
SLOTS = 8  # the arena fixture of tests/dkv/conftest.py
BOUND = 20.0  # generous bound on every wait


@pytest.fixture
def disk(tmp_path) -> Iterator[DiskTier]:
    tier = DiskTier(str(tmp_path), 4 * BLOCK)
    yield tier
    tier.clear()


class FailingDisk(DiskTier):
    """A disk tier whose file writes and/or reads fail (disk full, I/O error)."""

    def __init__(self, directory: str, capacity: int, *, writes: bool = True, reads: bool = True) -> None:
        super().__init__(directory, capacity)
        self.fail_writes, self.fail_reads = writes, reads

    def write_file(self, path: str, data: Any) -> None:  # type: ignore[override]
        if self.fail_writes:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        DiskTier.write_file(path, data)

    def read_file(self, path: str, size: int) -> bytearray:  # type: ignore[override]
        if self.fail_reads:
            raise OSError(errno.EIO, "Input/output error", path)
        return DiskTier.read_file(path, size)


class BlockingDisk(DiskTier):
    """A disk tier whose writes (and, if asked, reads) block until ``gate`` opens (bounded)."""

    def __init__(self, directory: str, capacity: int, *, block_reads: bool = False) -> None:
        super().__init__(directory, capacity)
        self.gate = threading.Event()
        self.writing = threading.Event()  # a write has started and is blocked
        self.reading = threading.Event()
        self.block_reads = block_reads

    def write_file(self, path: str, data: Any) -> None:  # type: ignore[override]
        self.writing.set()
        if not self.gate.wait(BOUND):
            raise OSError(errno.EIO, "test gate never opened", path)
        DiskTier.write_file(path, data)

    def read_file(self, path: str, size: int) -> bytearray:  # type: ignore[override]
        if self.block_reads:
            self.reading.set()
            if not self.gate.wait(BOUND):
                raise OSError(errno.EIO, "test gate never opened", path)
        return DiskTier.read_file(path, size)


def chain(n: int, tag: bytes) -> list[bytes]:
    return [(tag + bytes([i])).rjust(8, b"\0") for i in range(n)]


def keys(hashes: list[bytes], leaf: str = "L") -> list[StoreKey]:
    return [StoreKey(NS, leaf, 0, h) for h in hashes]


def fill(key: StoreKey) -> bytes:
    return bytes([key.hash[-1] ^ key.hash[-2]]) * BLOCK


def put(store: Store, ks: list[StoreKey]) -> list[str]:
    res, statuses = store.reserve("w", ks, [BLOCK] * len(ks))
    for k, off, n in zip(res.keys, res.offsets, res.sizes):
        store.arena.slot(k.namespace, off, n)[:] = fill(k)
    store.commit(res.write_id, "w")
    return statuses


def make_store(arena: Arena, disk: DiskTier | None, **kwargs: Any) -> tuple[Store, list[StoreKey]]:
    store = Store(arena, disk, clock=Clock(), **kwargs)
    unpublished: list[StoreKey] = []
    store.on_evict.append(unpublished.extend)
    return store, unpublished


def spill_all(store: Store) -> int:
    """The server's spill task, synchronously: write every queued spill and report it; unlink garbage."""
    disk = store.disk
    assert disk is not None
    n = 0
    while (job := store.take_spill()) is not None:
        try:
            disk.write_file(job.entry.path, job.data)
        except OSError as exc:
            store.finish_spill(job, exc)
        else:
            store.finish_spill(job)
        n += 1
    disk.unlink_files(disk.take_garbage())
    return n


def leased_lookup(store: Store, hashes: list[bytes], owner: str = "c") -> tuple[dict[str, list[bool]], Any]:
    """The server's leased lookup, synchronously: read what is only on disk, then look up with those bytes."""
    from dkv.store import Promoted

    disk = store.disk
    promoted = {}
    if disk is not None:
        for read in store.disk_reads(NS, hashes, ["L"], 1, 2**30):
            try:
                promoted[read.key] = Promoted(read.entry, disk.read_file(read.entry.path, read.entry.size))
            except OSError as exc:
                store.disk_read_failed(read, exc)
    return store.lookup(NS, hashes, ["L"], 1, owner=owner, promoted=promoted)


def assert_bytes(store: Store, lease: Any, ks: list[StoreKey]) -> None:
    """Read ``ks`` under ``lease`` (which it ends) and check each block's bytes."""
    read = store.begin_read(lease.lease_id, "c", ks)
    try:
        for key, plan in zip(ks, read.slots):
            assert bytes(store.arena.slot(key.namespace, plan.offset, plan.size)) == fill(key)
    finally:
        store.end_read(read.read_id)
        store.end_lease(lease.lease_id)


def end(store: Store, lease: Any) -> None:
    """End ``lease`` if one was granted (a lookup that found nothing grants none)."""
    if lease is not None:
        store.end_lease(lease.lease_id)


def pins(store: Store) -> int:
    return sum(b.pins for b in store.blocks.values())


def assert_no_leaks(store: Store) -> None:
    """Nothing reserved or pinned; every slot and every byte of disk space belongs to a block."""
    assert not store.reservations and not store.reserved_keys
    assert pins(store) == 0
    host = [b for b in store.blocks.values() if b.on_host]
    assert store.arena.used == sum(align_up(b.size) for b in host if b.size)
    if store.disk is not None and store.staging_usage() == (0, 0):
        off_host = {b.key for b in store.blocks.values() if not b.on_host}
        assert off_host == {k for k in off_host if k in store.disk}, "an off-host block is neither staged nor on disk"
        assert len(store.disk) == len(off_host)
        assert store.disk.used == store.disk.indexed == sum(b.size for b in store.blocks.values() if not b.on_host)


def files_in(disk: DiskTier) -> list[str]:
    return sorted(os.listdir(disk.root)) if os.path.isdir(disk.root) else []


# ---- the happy path, as plans ----------------------------------------------------------------


def test_disk_tier_spills_evicted_blocks_and_reads_them_back(arena: Arena, disk: DiskTier) -> None:
    store, unpublished = make_store(arena, disk)
    first = keys(chain(4, b"a"))
    put(store, first)
    put(store, keys(chain(8, b"b")))  # pushes the first four out: staged, not yet written
    assert store.counters.evictions == 4 and store.counters.spills == 0
    assert store.staging_usage() == (4, 4 * BLOCK) and store.disk_bytes() == (0, 4 * BLOCK)
    assert spill_all(store) == 4
    assert store.counters.spills == 4 and not unpublished and store.staging_usage() == (0, 0)
    assert len(files_in(disk)) == 4
    assert store.presence(NS, [k.hash for k in first], ["L"], 1) == {"L": [True] * 4}
    masks, lease = leased_lookup(store, [k.hash for k in first])
    assert masks == {"L": [True] * 4} and lease is not None
    assert_bytes(store, lease, first)
    assert store.counters.disk_hits == 4
    spill_all(store)  # the blocks pushed out by the promotions
    assert_no_leaks(store)


def test_tiers_say_host_or_disk_per_block_without_pinning_or_stamping(arena: Arena, disk: DiskTier) -> None:
    from dkv.store import TIER_ABSENT, TIER_DISK, TIER_HOST

    store, _ = make_store(arena, disk)
    first, second = keys(chain(4, b"a")), keys(chain(8, b"b"))
    put(store, first)
    put(store, second)  # pushes the first four off the host pool (staged)
    stamps = {k: b.stamp for k, b in store.blocks.items()}
    hashes = [first[0].hash, second[0].hash, b"\xff" * 8]
    assert store.tiers(NS, hashes, ["L", "other"], 1) == {
        "L": bytes([TIER_DISK, TIER_HOST, TIER_ABSENT]), "other": bytes([TIER_ABSENT] * 3)}
    spill_all(store)
    assert store.tiers(NS, hashes[:1], ["L"], 1) == {"L": bytes([TIER_DISK])}
    assert store.tiers(NS, hashes[1:2], ["L"], 2) == {"L": bytes([TIER_ABSENT])}  # shard 1 missing
    assert pins(store) == 0 and {k: b.stamp for k, b in store.blocks.items()} == stamps
    assert_no_leaks(store)


def test_disk_tier_drops_its_oldest_when_full_and_unpublishes(arena: Arena, tmp_path) -> None:
    disk = DiskTier(str(tmp_path), 2 * BLOCK)
    store, unpublished = make_store(arena, disk)
    put(store, keys(chain(8, b"a")))
    for k in keys(chain(4, b"b")):
        put(store, [k])
        spill_all(store)
    assert store.counters.spills == 4 and store.counters.disk_drops == 2
    assert len(unpublished) == 2 and len(store.blocks) == 10
    assert len(files_in(disk)) == 2
    assert_no_leaks(store)
    disk.clear()


def test_staging_full_drops_the_evicted_block_instead_of_waiting(arena: Arena, disk: DiskTier) -> None:
    store, unpublished = make_store(arena, disk, staging_bytes=2 * BLOCK)
    put(store, keys(chain(8, b"a")))
    assert put(store, keys(chain(4, b"b"))) == [WRITE] * 4  # nothing waits for the disk
    assert store.staging_usage() == (2, 2 * BLOCK)
    assert store.counters.spill_drops == 2 and len(unpublished) == 2
    assert spill_all(store) == 2
    assert_no_leaks(store)


def test_staged_block_is_promoted_from_memory_without_disk_io(arena: Arena, tmp_path) -> None:
    disk = FailingDisk(str(tmp_path), 4 * BLOCK)  # any file I/O would fail
    store, unpublished = make_store(arena, disk)
    staged = keys(chain(2, b"a"))
    put(store, staged)
    put(store, keys(chain(8, b"b")))
    assert store.staging_usage() == (2, 2 * BLOCK)
    masks, lease = store.lookup(NS, [k.hash for k in staged], ["L"], 1, owner="c")
    assert masks == {"L": [True, True]} and lease is not None
    assert_bytes(store, lease, staged)
    assert store.counters.disk_hits == 2 and store.counters.disk_errors == 0
    # the promotions pushed two other blocks out; the promoted ones' spills were cancelled
    assert store.staging_usage() == (2, 2 * BLOCK)
    assert all(k not in store._staging for k in staged)
    assert spill_all(store) == 2  # these fail: the disk is full
    assert store.counters.disk_errors == 2 and len(unpublished) == 2
    assert_no_leaks(store)


# ---- write failures --------------------------------------------------------------------------


def test_disk_full_spill_write_drops_the_block_and_leaks_no_reservation(arena: Arena, tmp_path) -> None:
    disk = FailingDisk(str(tmp_path), 4 * BLOCK)
    store, unpublished = make_store(arena, disk)
    evicted = keys(chain(4, b"a"))
    put(store, evicted)
    assert put(store, keys(chain(8, b"b"))) == [WRITE] * 8
    assert spill_all(store) == 4
    assert store.counters.disk_errors == 4 and store.counters.spills == 0
    assert sorted(unpublished) == sorted(evicted), "a block whose spill failed is unpublished"
    assert all(k not in store.blocks for k in evicted)
    assert store.disk_bytes() == (4 * BLOCK, 4 * BLOCK) and store.staging_usage() == (0, 0)
    assert files_in(disk) == []
    assert put(store, evicted) == [WRITE] * 4, "the dropped keys can be written again (never BUSY)"
    assert store.presence(NS, [k.hash for k in evicted], ["L"], 1) == {"L": [True] * 4}
    spill_all(store)
    assert_no_leaks(store)


def test_failing_unpublish_callback_during_eviction_leaks_no_reservation_or_slot(arena: Arena) -> None:
    store, _ = make_store(arena, None)

    def broken(_: list[StoreKey]) -> None:
        raise RuntimeError("publisher failed")

    store.on_evict.append(broken)
    put(store, keys(chain(8, b"a")))
    statuses = [None]
    try:
        statuses = put(store, keys(chain(2, b"b")))
    finally:
        assert_no_leaks(store)
    assert statuses == [WRITE, WRITE]
    res, again = store.reserve("w2", keys(chain(2, b"b")), [BLOCK, BLOCK])
    assert BUSY not in again
    store.abort(res.write_id)
    assert_no_leaks(store)


# ---- read failures and lookups that fail midway ---------------------------------------------


def test_disk_directory_removed_mid_run_leaks_no_reservation_or_pin(arena: Arena, disk: DiskTier) -> None:
    store, unpublished = make_store(arena, disk)
    spilled = keys(chain(4, b"a"))
    put(store, spilled)
    put(store, keys(chain(8, b"b")))
    assert spill_all(store) == 4
    shutil.rmtree(disk.root)
    masks, lease = leased_lookup(store, [k.hash for k in spilled])
    assert masks == {"L": [False] * 4}, "an unreadable block is reported absent"
    assert pins(store) == 0
    assert store.counters.disk_errors == 4 and sorted(unpublished) == sorted(spilled)
    end(store, lease)
    # writes go on: evictions now fail to spill and drop their blocks instead
    assert put(store, keys(chain(4, b"c"))) == [WRITE] * 4
    assert spill_all(store) == 4 and store.counters.disk_errors == 8
    assert put(store, spilled) == [WRITE] * 4, "the lost keys can be written again"
    spill_all(store)
    masks, lease = leased_lookup(store, [k.hash for k in spilled])
    assert masks == {"L": [True] * 4}
    assert_bytes(store, lease, spilled)
    assert_no_leaks(store)


def test_promotion_read_error_promotes_nothing_and_leaks_nothing(arena: Arena, tmp_path) -> None:
    disk = FailingDisk(str(tmp_path), 4 * BLOCK, writes=False, reads=True)
    store, unpublished = make_store(arena, disk)
    spilled = keys(chain(3, b"a"))
    put(store, spilled)
    put(store, keys(chain(7, b"b")))  # the spilled chain's first two go to disk
    spill_all(store)
    on_disk = [k for k in spilled if k in disk]
    assert len(on_disk) == 2
    host_before = store.host_bytes()
    masks, lease = leased_lookup(store, [k.hash for k in spilled])
    assert [m for k, m in zip(spilled, masks["L"]) if k in on_disk] == [False, False]
    assert lease is not None and set(lease.keys) == set(spilled) - set(on_disk)
    assert store.host_bytes() == host_before, "a failed read takes no slot"
    assert store.counters.disk_errors == 2 and sorted(unpublished) == sorted(on_disk)
    store.end_lease(lease.lease_id)
    assert put(store, on_disk) == [WRITE, WRITE]
    spill_all(store)
    assert_no_leaks(store)


class _Unbufferable:
    """Claims a block's length but cannot be copied: makes a promotion raise midway."""

    def __len__(self) -> int:
        return BLOCK


def test_lookup_that_raises_midway_gives_back_its_pins_and_its_slot(arena: Arena, disk: DiskTier) -> None:
    from dkv.store import Promoted

    store, _ = make_store(arena, disk)
    run = keys(chain(3, b"a"))
    put(store, run)
    put(store, keys(chain(7, b"b")))
    spill_all(store)
    assert [k in disk for k in run] == [False, True, True]  # the root is pinned first, then promotions
    hashes = [k.hash for k in run]
    bad = {run[1]: Promoted(disk.entry(run[1]), _Unbufferable())}  # type: ignore[arg-type]
    reads = {r.key: r for r in store.disk_reads(NS, hashes, ["L"], 1, 2**30)}
    good = {run[2]: Promoted(reads[run[2]].entry, disk.read_file(reads[run[2]].entry.path, BLOCK))}
    with pytest.raises(TypeError):
        store.lookup(NS, hashes, ["L"], 1, owner="c", promoted={**good, **bad})
    assert not store.leases and pins(store) == 0
    assert run[1] in disk, "the block whose promotion failed is still on disk"
    spill_all(store)
    assert_no_leaks(store)
    masks, lease = leased_lookup(store, hashes)
    assert masks == {"L": [True] * 3} and lease is not None
    store.end_lease(lease.lease_id)
    spill_all(store)
    assert_no_leaks(store)


def test_promoted_bytes_of_a_replaced_file_are_not_used(arena: Arena, disk: DiskTier) -> None:
    from dkv.store import Promoted

    store, _ = make_store(arena, disk)
    key = keys(chain(1, b"a"))[0]
    put(store, [key])
    put(store, keys(chain(8, b"b")))
    spill_all(store)
    (read,) = store.disk_reads(NS, [key.hash], ["L"], 1, 2**30)
    stale = Promoted(read.entry, disk.read_file(read.entry.path, BLOCK))
    store.clear(NS)  # meanwhile the block goes, and comes back as a new file
    put(store, [key])
    put(store, keys(chain(8, b"c")))
    spill_all(store)
    assert key in disk and disk.entry(key) is not read.entry
    masks, lease = store.lookup(NS, [key.hash], ["L"], 1, owner="c", promoted={key: stale})
    assert masks == {"L": [False]}, "bytes read from a file the block no longer uses are not promoted"
    end(store, lease)
    assert_no_leaks(store)


# ---- blocks in flight ------------------------------------------------------------------------


def test_block_promoted_while_its_spill_is_written_leaves_no_file_behind(arena: Arena, disk: DiskTier) -> None:
    store, _ = make_store(arena, disk)
    key = keys(chain(1, b"a"))[0]
    put(store, [key])
    put(store, keys(chain(8, b"b")))
    job = store.take_spill()
    assert job is not None and job.key == key
    masks, lease = store.lookup(NS, [key.hash], ["L"], 1, owner="c")  # from staging, mid-write
    assert masks == {"L": [True]}
    store.end_lease(lease.lease_id)
    disk.write_file(job.entry.path, job.data)
    store.finish_spill(job)  # the write ends after the block went back to the host
    assert key not in disk and store.counters.spills == 0
    spill_all(store)  # the block the promotion pushed out, and the stale file's unlink
    assert len(files_in(disk)) == 1
    assert_no_leaks(store)


def test_clear_drops_staged_spilling_and_spilled_blocks_and_frees_their_space(arena: Arena, disk: DiskTier) -> None:
    store, unpublished = make_store(arena, disk)
    put(store, keys(chain(3, b"a")))
    put(store, keys(chain(6, b"b")))  # one block spills
    spill_all(store)
    put(store, keys(chain(2, b"c")))  # two more are staged
    in_flight = store.take_spill()
    assert in_flight is not None
    assert (len(disk), store.staging_usage()) == (1, (2, 2 * BLOCK))
    unpublished.clear()
    assert store.clear(NS) == len(unpublished) == 11
    assert store.staging_usage() == (0, BLOCK), "the buffer being written stays counted until its write ends"
    disk.write_file(in_flight.entry.path, in_flight.data)
    store.finish_spill(in_flight)
    assert store.staging_usage() == (0, 0) and store.disk_bytes() == (4 * BLOCK, 4 * BLOCK)
    spill_all(store)
    assert files_in(disk) == []
    assert not store.blocks
    assert_no_leaks(store)


# ---- a degraded tier: full, or its directory gone --------------------------------------------


@pytest.mark.parametrize(("code", "fault"), [
    (errno.ENOSPC, FULL), (errno.EDQUOT, FULL), (errno.EFBIG, FULL),
    (errno.ENOENT, MISSING), (errno.ENOTDIR, MISSING), (errno.ENODEV, MISSING),
    (errno.EIO, FAILING), (errno.EROFS, FAILING), (errno.EACCES, FAILING),
])
def test_a_failed_write_names_the_fault_it_means(code: int, fault: str) -> None:
    assert fault_of(OSError(code, os.strerror(code))) == fault
    assert fault_of(RuntimeError("not an OSError")) == FAILING


def test_a_failed_spill_degrades_the_tier_to_memory_only_until_a_probe_spill_is_written(arena: Arena, tmp_path) -> None:
    disk = FailingDisk(str(tmp_path), 4 * BLOCK, reads=False)
    store, unpublished = make_store(arena, disk)
    put(store, keys(chain(8, b"a")))
    put(store, keys(chain(1, b"b")))  # one eviction, staged while the tier is healthy
    assert spill_all(store) == 1
    counters = store.counters
    assert (counters.disk_spill_failed, counters.disk_degraded, counters.disk_errors) == (1, 1, 1)
    assert disk.state == FULL and store.disk_state() == "full"

    put(store, keys(chain(3, b"c")))  # memory only: evicted blocks are dropped, never staged
    assert store.staging_usage() == (0, 0) and counters.disk_degraded_drops == 3
    assert len(unpublished) == 4 and all(k not in store.blocks for k in unpublished)

    store.clock.now += disk.retry_interval  # a probe is due: the next eviction is staged, the one after dropped
    put(store, keys(chain(2, b"d")))
    assert store.staging_usage() == (1, BLOCK) and counters.disk_degraded_drops == 4
    assert spill_all(store) == 1 and counters.disk_spill_failed == 2, "the disk is still full"
    assert counters.disk_degraded == 1 and disk.state == FULL

    disk.fail_writes = False  # space returns
    store.clock.now += disk.retry_interval
    probe = keys(chain(1, b"e"))
    put(store, probe)
    assert spill_all(store) == 1
    assert (counters.disk_recovered, counters.spills) == (1, 1) and disk.state == HEALTHY
    put(store, keys(chain(2, b"f")))  # healthy: every eviction spills again
    assert store.staging_usage() == (2, 2 * BLOCK) and spill_all(store) == 2 and counters.spills == 3
    assert counters.disk_degraded == 1 and counters.disk_degraded_drops == 4
    assert len(files_in(disk)) == 3 and not [f for f in files_in(disk) if f.endswith(".tmp")]
    assert_no_leaks(store)


def test_a_vanished_tier_directory_drops_every_on_disk_block_and_keeps_the_staged_ones(
        arena: Arena, disk: DiskTier) -> None:
    store, unpublished = make_store(arena, disk)
    on_disk = keys(chain(2, b"a"))
    put(store, on_disk)
    put(store, keys(chain(8, b"b")))  # the two spill
    assert spill_all(store) == 2
    staged = keys(chain(1, b"b"))  # the oldest "b" block: evicted next, staged, not written
    put(store, keys(chain(1, b"c")))
    assert store.staging_usage() == (1, BLOCK)
    shutil.rmtree(disk.root)

    store.disk_vanished()
    assert store.counters.disk_lost == 2 and store.counters.disk_degraded == 1 and disk.state == MISSING
    assert sorted(unpublished) == sorted(on_disk), "blocks whose files are gone are unpublished at once"
    assert store.presence(NS, [k.hash for k in on_disk], ["L"], 1) == {"L": [False, False]}
    assert store.presence(NS, [k.hash for k in staged], ["L"], 1) == {"L": [True]}, "staged bytes are in memory"
    assert store.disk_bytes() == (3 * BLOCK, 4 * BLOCK), "only the staged block's file is counted"
    store.disk_vanished()  # again: nothing more to drop, not counted twice
    assert store.counters.disk_lost == 2 and store.counters.disk_degraded == 1

    assert spill_all(store) == 1 and store.counters.disk_spill_failed == 1  # the staged write fails: no directory
    assert disk.reopen() is True and disk.root_intact()  # what the disk thread does before a probe
    store.clock.now += disk.retry_interval
    put(store, keys(chain(1, b"d")))
    assert spill_all(store) == 1 and store.counters.disk_recovered == 1 and disk.state == HEALTHY
    assert len(files_in(disk)) == 1
    assert_no_leaks(store)


def test_reopen_makes_the_tier_directory_again_0700_but_only_on_its_own_filesystem(tmp_path) -> None:
    parent = tmp_path / "tier"
    tier = DiskTier(str(parent), 4 * BLOCK)
    try:
        assert tier.root_intact() and tier.reopen() is False, "an intact directory is left as it is"
        shutil.rmtree(parent)
        assert not tier.root_intact()
        assert tier.reopen() is True and tier.root_intact()
        assert stat.S_IMODE(os.stat(parent).st_mode) == stat.S_IMODE(os.stat(tier.root).st_mode) == 0o700

        os.rmdir(tier.root)
        os.symlink(tmp_path, tier.root)  # something else at the tier's path: not taken
        assert not tier.root_intact()
        with pytest.raises(FileExistsError):
            tier.reopen()
        os.unlink(tier.root)

        shutil.rmtree(parent)
        tier._device = -1  # as if --disk's directory had been a mount point whose disk is now unmounted
        with pytest.raises(OSError) as raised:
            tier.reopen()
        assert raised.value.errno == errno.ENODEV and fault_of(raised.value) == MISSING
        assert not parent.exists(), "nothing is made on the filesystem beneath an unmounted disk"
    finally:
        tier.clear()


# ---- the mover on the event loop ------------------------------------------------------------


async def _until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_slow_disk_write_does_not_block_the_event_loop(arena: Arena, tmp_path) -> None:
    from dkv.disk_worker import DiskWorker

    disk = BlockingDisk(str(tmp_path), 8 * BLOCK)
    store, _ = make_store(arena, disk)
    worker = DiskWorker(store)
    worker.start()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    ticking = asyncio.create_task(ticker())
    try:
        staged = keys(chain(2, b"a"))
        put(store, staged)
        put(store, keys(chain(8, b"b")))  # two spills queued; the first write blocks
        await _until(disk.writing.is_set, "the spill write to start")
        seen = ticks
        await _until(lambda: ticks >= seen + 5, "the loop to run other work")
        # the store keeps serving while the write is stuck: writes, evictions, lookups
        assert put(store, keys(chain(2, b"c"))) == [WRITE, WRITE]
        masks, lease = store.lookup(NS, [staged[1].hash], ["L"], 1, owner="c")
        assert masks == {"L": [True]}
        store.end_lease(lease.lease_id)
        assert not disk.gate.is_set() and store.counters.spills == 0
        disk.gate.set()
        await _until(lambda: store.staging_usage() == (0, 0), "the spills to finish")
        assert store.counters.spills >= 1 and store.counters.disk_errors == 0
        assert_no_leaks(store)
    finally:
        disk.gate.set()
        ticking.cancel()
        await asyncio.gather(ticking, return_exceptions=True)
        assert await worker.stop()
    assert not os.path.exists(disk.root)


async def test_stuck_disk_write_does_not_hang_shutdown(arena: Arena, tmp_path) -> None:
    from dkv.disk_worker import DiskWorker

    disk = BlockingDisk(str(tmp_path), 8 * BLOCK)
    store, _ = make_store(arena, disk)
    worker = DiskWorker(store, close_timeout=0.2)
    worker.start()
    try:
        put(store, keys(chain(8, b"a")))
        put(store, keys(chain(1, b"b")))
        await _until(disk.writing.is_set, "the spill write to start")
        store.close()
        assert await worker.stop() is False, "a stuck write is left behind, not waited for"
    finally:
        disk.gate.set()
    # once the disk answers, the thread finishes its work (the directory's removal) and exits
    await _until(lambda: not any(t.name == "dkv-disk-io" for t in threading.enumerate()), "the disk thread to exit")
    assert not os.path.exists(disk.root)


async def test_stuck_promotion_read_costs_one_bounded_wait_and_no_pin(arena: Arena, tmp_path) -> None:
    from dkv.disk_worker import DiskWorker

    disk = BlockingDisk(str(tmp_path), 8 * BLOCK, block_reads=True)
    disk.gate.set()  # writes pass; reads will block once the gate closes
    store, _ = make_store(arena, disk)
    worker = DiskWorker(store, read_timeout=0.2)
    worker.start()
    try:
        spilled = keys(chain(2, b"a"))
        put(store, spilled)
        put(store, keys(chain(8, b"b")))
        await _until(lambda: store.counters.spills == 2, "the spills")
        disk.gate.clear()
        hashes = [k.hash for k in spilled]
        promoted = await worker.promotions(NS, hashes, ["L"], 1)
        assert promoted == {} and store.counters.disk_read_timeouts == 1
        masks, lease = store.lookup(NS, hashes, ["L"], 1, owner="c", promoted=promoted)
        assert masks == {"L": [False, False]} and pins(store) == 0
        end(store, lease)
        disk.gate.set()  # the late read finishes in the background; its bytes are discarded
        await _until(lambda: worker.reading_bytes == 0, "the late read to end")
        assert all(k in disk for k in spilled)
        worker.read_timeout = BOUND
        promoted = await worker.promotions(NS, hashes, ["L"], 1)
        masks, lease = store.lookup(NS, hashes, ["L"], 1, owner="c", promoted=promoted)
        assert masks == {"L": [True, True]}
        store.end_lease(lease.lease_id)
        await _until(lambda: store.staging_usage() == (0, 0), "the spills of the blocks pushed out")
        assert_no_leaks(store)
    finally:
        disk.gate.set()
        assert await worker.stop()


async def test_the_mover_notices_a_removed_directory_at_once_and_a_probe_makes_it_again(
        arena: Arena, disk: DiskTier) -> None:
    from dkv.disk_worker import DiskWorker

    store, unpublished = make_store(arena, disk)
    worker = DiskWorker(store, check_interval=0.02)
    worker.start()
    try:
        on_disk = keys(chain(2, b"a"))
        put(store, on_disk)
        put(store, keys(chain(8, b"b")))
        await _until(lambda: store.counters.spills == 2 and store.staging_usage() == (0, 0), "the spills")
        shutil.rmtree(disk.root)
        await _until(lambda: store.counters.disk_lost == 2, "the removed directory to be noticed")
        assert sorted(unpublished) == sorted(on_disk) and disk.state == MISSING
        put(store, keys(chain(1, b"c")))  # degraded: dropped, not staged
        assert store.counters.disk_degraded_drops == 1 and store.staging_usage() == (0, 0)
        store.clock.now += disk.retry_interval
        put(store, keys(chain(1, b"d")))  # the probe: the mover makes the directory again, then writes
        await _until(lambda: store.counters.disk_recovered == 1, "the probe spill")
        assert disk.root_intact() and len(files_in(disk)) == 1 and store.counters.disk_degraded == 1
        assert stat.S_IMODE(os.stat(disk.root).st_mode) == 0o700
        await asyncio.sleep(0.1)  # a few more directory checks: the new directory is the tier's
        assert store.counters.disk_lost == 2 and disk.state == HEALTHY
        assert_no_leaks(store)
    finally:
        assert await worker.stop()


class CountedWritesDisk(DiskTier):
    """A disk tier whose spill writes wait for a permit each (:meth:`allow`), bounded."""

    def __init__(self, directory: str, capacity: int) -> None:
        super().__init__(directory, capacity)
        self._permits = threading.Semaphore(0)
        self.waiting = threading.Event()  # a write is waiting for its permit

    def allow(self, writes: int = 1) -> None:
        for _ in range(writes):
            self._permits.release()

    def write_file(self, path: str, data: Any) -> None:  # type: ignore[override]
        self.waiting.set()
        if not self._permits.acquire(timeout=BOUND):
            raise OSError(errno.EIO, "test permit never came", path)
        self.waiting.clear()
        DiskTier.write_file(path, data)


async def test_a_block_whose_spill_lands_while_a_lookup_reads_is_read_too_not_missed(arena: Arena, tmp_path) -> None:
    """Found once under CI load: the lookup planned its reads while one block was still staged, that
    block's spill landed during the reads (so it left staging for disk, unread), and the lookup missed it."""
    from dkv.disk_worker import DiskWorker

    disk = CountedWritesDisk(str(tmp_path), 8 * BLOCK)
    store, _ = make_store(arena, disk)
    worker = DiskWorker(store)
    worker.start()
    try:
        spilled = keys(chain(2, b"a"))
        put(store, spilled)
        put(store, keys(chain(8, b"b")))  # both of "a" are evicted: two spills queued
        disk.allow()  # the first spill is written; the second waits on the disk thread
        await _until(lambda: store.counters.spills == 1 and disk.waiting.is_set(), "one spill written, one waiting")
        on_disk = [k for k in spilled if k in disk]
        assert len(on_disk) == 1, "one block on disk, the other still staged (its write in flight)"
        hashes = [k.hash for k in spilled]
        reading = asyncio.ensure_future(worker.promotions(NS, hashes, ["L"], 1))  # plans the one on-disk read
        await asyncio.sleep(0.05)
        assert not reading.done(), "the read waits behind the spill write on the one disk thread"
        disk.allow()  # the second spill lands first: its block moves onto disk while the lookup's read waits
        promoted = await asyncio.wait_for(reading, BOUND)
        assert store.counters.spills == 2
        assert set(promoted) == set(spilled), "the block that landed during the reads was read as well"
        masks, lease = store.lookup(NS, hashes, ["L"], 1, owner="c", promoted=promoted)
        assert masks == {"L": [True, True]}
        for key in spilled:
            assert bytes(store.arena.slot(NS, store.blocks[key].offset, BLOCK)) == fill(key)
        end(store, lease)
        disk.allow(16)  # the blocks these promotions pushed out spill in turn
        await _until(lambda: store.staging_usage() == (0, 0), "the spills of the blocks pushed out")
        assert_no_leaks(store)
    finally:
        disk.allow(64)
        assert await worker.stop()
