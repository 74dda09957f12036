"""Optional disk tier: blocks evicted from the host pool spill here, and hits are read back.

One file per block under a directory the node owns (created at start, emptied
at shutdown). A byte cap bounds it; when full, the oldest spilled block goes
first. Off by default. Files are written to a temporary name and renamed, so a
crash never leaves a half-written block that could be read back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import OrderedDict
from collections.abc import Hashable

from dkv.errors import ConfigError


class DiskTier:
    """Spill store keyed by the node's block keys; no eviction policy beyond oldest-first."""

    def __init__(self, directory: str, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError("--disk-size must be positive when --disk is given")
        self.root = os.path.join(directory, f"dkv-spill-{os.getpid()}")
        try:
            os.makedirs(self.root, exist_ok=False)
        except OSError as exc:
            raise ConfigError(f"cannot create the disk tier under {directory}: {exc}") from exc
        self.capacity = capacity
        self.used = 0
        self._files: OrderedDict[Hashable, tuple[str, int]] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._files

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def put(self, key: Hashable, data: memoryview) -> list[Hashable]:
        """Store ``data`` under ``key``; returns the keys dropped to make room (oldest first).

        A block larger than the whole tier is not stored (returns no drops and
        ``key`` is absent afterwards).
        """
        size = len(data)
        if size > self.capacity:
            return []
        dropped: list[Hashable] = []
        while self.used + size > self.capacity and self._files:
            old_key = next(iter(self._files))
            self.remove(old_key)
            dropped.append(old_key)
        path = os.path.join(self.root, hashlib.sha1(repr(key).encode()).hexdigest())
        tmp = path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        self._files[key] = (path, size)
        self.used += size
        return dropped

    def read_into(self, key: Hashable, dest: memoryview) -> None:
        """Copy the spilled block into ``dest`` (exactly its size)."""
        path, size = self._files[key]
        with open(path, "rb", buffering=0) as fh:
            got = fh.readinto(dest[:size])
        if got != size:
            raise OSError(f"spilled block {path} is short: {got} of {size} bytes")

    def remove(self, key: Hashable) -> None:
        path, size = self._files.pop(key)
        self.used -= size
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def clear(self) -> None:
        """Drop every spilled block and the tier's directory."""
        self._files.clear()
        self.used = 0
        shutil.rmtree(self.root, ignore_errors=True)
