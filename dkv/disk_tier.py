"""Optional disk tier: blocks evicted from the host pool spill here, and hits are read back.

One file per spilled block under a directory the node owns (created at start,
emptied at shutdown). A byte cap bounds it. Spilled blocks are as private as
the arena: the tier's directory (``DIR/dkv-spill-<pid>``, always a new one) is
mode 0700 and each file 0600, whatever the umask; ``DIR`` itself is created
0700 when the node makes it, and left as it is when it exists (the 0700
directory beneath keeps other users out). Files are written to a temporary
name and renamed, so a crash never leaves a half-written block that could be
read back. Every file gets a fresh name, so a late write, read or unlink of a
block's old file can never touch a newer file of the same block.

The tier has two halves for two threads (DESIGN §6: the store decides, the
server moves):

* **Accounting** — :meth:`DiskTier.allocate`, :meth:`~DiskTier.admit`,
  :meth:`~DiskTier.detach`, :meth:`~DiskTier.release`,
  :meth:`~DiskTier.remove`, :meth:`~DiskTier.oldest`,
  :meth:`~DiskTier.take_garbage` — runs on the node's event-loop thread and
  does no I/O. Space is reserved when a spill is planned, before its file is
  written, so ``used`` never exceeds ``capacity``; released files are
  collected as garbage for the server to unlink.
* **File I/O** — :meth:`DiskTier.write_file`, :meth:`~DiskTier.read_file`,
  :meth:`~DiskTier.unlink_files`, :meth:`~DiskTier.root_intact`,
  :meth:`~DiskTier.reopen`, :meth:`~DiskTier.clear` — runs on the server's
  disk thread and touches no accounting (``clear`` excepted: it runs at
  shutdown, once nothing else uses the tier).

**Health.** A tier whose disk is full or whose directory vanished is
*degraded*: the store spills nothing (evictions drop their blocks, so the node
runs memory only), except one *probe* spill per ``retry_interval``. A probe
that is written ends the degradation; before it is written the disk thread
makes the tier's directory again if it vanished (:meth:`~DiskTier.reopen`),
but never on another filesystem than the one the node started on (an
unmounted disk is not replaced by the filesystem beneath it). The state
(:attr:`DiskTier.state`) belongs to the accounting half; :func:`fault_of`
names the fault an ``OSError`` means.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import stat
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from dkv.errors import ConfigError

HEALTHY = "ok"  # spills are written
FULL = "full"  # the filesystem (or a quota, or a file-size limit) has no room
MISSING = "missing"  # the tier's directory vanished: every file in it is gone
FAILING = "failing"  # any other write error (I/O error, read-only, permissions)
DEFAULT_RETRY_INTERVAL = 1.0  # seconds between probe spills while degraded

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ESTALE, errno.ENODEV})


def fault_of(error: BaseException) -> str:
    """The tier state a failed spill write means: :data:`FULL`, :data:`MISSING` or :data:`FAILING`."""
    code = error.errno if isinstance(error, OSError) else None
    if code in _FULL_ERRNOS:
        return FULL
    if code in _MISSING_ERRNOS:
        return MISSING
    return FAILING


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


@dataclass(eq=False, slots=True)
class DiskEntry:
    """Space reserved in the tier for one file; one entry is one file's life (compared by identity)."""

    path: str
    size: int
    live: bool = True  # False once released: its space is free again


class DiskTier:
    """Spill store keyed by the node's block keys; no eviction policy beyond oldest-first."""

    def __init__(self, directory: str, capacity: int, *, retry_interval: float = DEFAULT_RETRY_INTERVAL) -> None:
        if capacity <= 0:
            raise ConfigError("--disk-size must be positive when --disk is given")
        self.directory = os.path.abspath(directory)
        self.root = os.path.join(self.directory, f"dkv-spill-{os.getpid()}")
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)  # 0700 if made here (parents: the umask's)
            os.mkdir(self.root, 0o700)  # never an existing one: it could be someone else's, or wider
            os.chmod(self.root, 0o700)  # exactly 0700, whatever the umask
            self._device = os.stat(self.directory).st_dev  # the filesystem the tier lives on (disk thread)
            self._root_id = _identity(os.lstat(self.root))  # the directory this tier made (disk thread)
        except OSError as exc:
            raise ConfigError(f"cannot create the disk tier under {directory}: {exc}") from exc
        self.capacity = capacity
        self.state = HEALTHY  # HEALTHY, or the fault that degraded the tier (event-loop thread)
        self.retry_interval = retry_interval
        self._retry_at = 0.0
        self.used = 0  # every live entry: written files and files being written
        self.indexed = 0  # bytes of the written, indexed files (what dropping the oldest can free)
        self._files: OrderedDict[Hashable, DiskEntry] = OrderedDict()  # written, oldest first
        self._names = itertools.count()
        self._garbage: list[str] = []

    # ---- accounting: event-loop thread, no I/O ------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        """True when ``key``'s file is written and indexed (readable)."""
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def entry(self, key: Hashable) -> DiskEntry | None:
        """The written file of ``key``, or ``None``."""
        return self._files.get(key)

    def oldest(self) -> Hashable | None:
        """The key whose written file is the oldest (the first to drop for room), or ``None``."""
        return next(iter(self._files), None)

    def allocate(self, size: int) -> DiskEntry | None:
        """Reserve ``size`` bytes for a file to be written; ``None`` when they are not free.

        The caller makes room first (:meth:`oldest`, :meth:`remove`); later it
        either admits the entry (:meth:`admit`: written) or releases it (:meth:`release`).
        """
        if size > self.free:
            return None
        self.used += size
        return DiskEntry(os.path.join(self.root, f"{next(self._names):016x}"), size)

    def admit(self, key: Hashable, entry: DiskEntry) -> None:
        """Index ``entry`` (its file is written) under ``key``, as the newest file."""
        if not entry.live or key in self._files:
            raise ValueError(f"cannot admit {key!r}: entry released or key already on disk")
        self._files[key] = entry
        self.indexed += entry.size

    def detach(self, key: Hashable) -> DiskEntry:
        """Take ``key``'s entry out of the index (so it cannot be dropped for room); still counted."""
        entry = self._files.pop(key)
        self.indexed -= entry.size
        return entry

    def release(self, entry: DiskEntry, *, written: bool = True) -> None:
        """Free an entry's space; its file (if ``written`` may have made one) becomes garbage. Idempotent."""
        if not entry.live:
            return
        entry.live = False
        self.used -= entry.size
        if written:
            self._garbage.append(entry.path)

    def reclaim(self, entry: DiskEntry) -> bool:
        """Count a released entry's space again (its file was kept); False when that space is not free."""
        if entry.live:
            return True
        if entry.size > self.free:
            return False
        entry.live = True
        self.used += entry.size
        return True

    def unlink_later(self, path: str) -> None:
        """Leave a file that no entry counts any more to the disk thread (:meth:`take_garbage`)."""
        self._garbage.append(path)

    def remove(self, key: Hashable) -> None:
        """Drop ``key``'s written file: out of the index, space freed, file to unlink."""
        self.release(self.detach(key))

    def keys(self) -> list[Hashable]:
        """The keys of every written, indexed file, oldest first (a copy)."""
        return list(self._files)

    # ---- health: event-loop thread, no I/O ----------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self.state != HEALTHY

    def spill_allowed(self, now: float) -> bool:
        """May a block be staged for a spill now? Healthy: yes. Degraded: once per ``retry_interval`` (a probe)."""
        if self.state == HEALTHY:
            return True
        if now < self._retry_at:
            return False
        self._retry_at = now + self.retry_interval
        return True

    def degrade(self, fault: str, now: float) -> bool:
        """A spill failed with ``fault`` (:func:`fault_of`): spill only probes from now on. True when newly degraded."""
        was_healthy = self.state == HEALTHY
        self.state = fault
        if was_healthy:
            self._retry_at = now + self.retry_interval
        return was_healthy

    def recover(self) -> bool:
        """A spill was written: the tier is healthy. True when it was degraded."""
        was_degraded = self.state != HEALTHY
        self.state = HEALTHY
        return was_degraded

    def take_garbage(self) -> list[str]:
        """Paths of released files, for the disk thread to unlink (:meth:`unlink_files`)."""
        garbage, self._garbage = self._garbage, []
        return garbage

    # ---- file I/O: the disk thread -------------------------------------------------------------

    @staticmethod
    def write_file(path: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` to ``path`` (temporary name, then rename). Raises ``OSError``; leaves no partial file.

        The file is created mode 0600 (owner only, like the arena), never through an existing file or link.
        """
        tmp = path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @staticmethod
    def read_file(path: str, size: int) -> bytearray:
        """The ``size`` bytes of the file at ``path``. Raises ``OSError`` (also when it is short)."""
        data = bytearray(size)
        with open(path, "rb", buffering=0) as fh:
            got = fh.readinto(data)
        if got != size:
            raise OSError(f"spilled block {path} is short: {got} of {size} bytes")
        return data

    @staticmethod
    def unlink_files(paths: list[str]) -> None:
        """Unlink released files; a file already gone (or any error) is ignored."""
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    def root_intact(self) -> bool:
        """True while the tier's directory is the one it made: not removed, not another inode. Never raises.

        A directory made again at once at the same path may get the old
        one's inode number and pass; its blocks then fail one by one when
        read (each dropped, unpublished).
        """
        try:
            st = os.lstat(self.root)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and _identity(st) == self._root_id

    def reopen(self) -> bool:
        """Make the tier's directory again if it vanished (0700, like at start); True when it did. Raises ``OSError``.

        Only on the filesystem the tier started on: when ``--disk``'s
        directory now lies on another one (its disk was unmounted) nothing is
        made. A directory found at the tier's path is taken only when it is a
        real directory of this user (then made 0700); the tier's files are
        never assumed to be in it.
        """
        if self.root_intact():
            return False
        try:
            st = os.stat(self.directory)
        except FileNotFoundError:
            if os.stat(os.path.dirname(self.directory)).st_dev != self._device:
                raise OSError(errno.ENODEV, "the disk tier's filesystem is gone", self.directory) from None
            os.mkdir(self.directory, 0o700)
        else:
            if st.st_dev != self._device:
                raise OSError(errno.ENODEV, "the disk tier's filesystem is gone", self.directory)
        try:
            os.mkdir(self.root, 0o700)
        except FileExistsError:
            st = os.lstat(self.root)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise
        os.chmod(self.root, 0o700)
        self._root_id = _identity(os.lstat(self.root))
        return True

    def clear(self) -> None:
        """Drop every spilled block and the tier's directory (shutdown, or a test's cleanup)."""
        self._files.clear()
        self._garbage.clear()
        self.used = self.indexed = 0
        shutil.rmtree(self.root, ignore_errors=True)
