"""What the soak's orchestrator (``scripts/soak.py``) and its connector processes (``scripts/soak_worker.py``) share.

* The workload's names and bytes: every block's hash is a pure function of
  (run, writer, chain, position) and every block's bytes a pure function of its
  hash (:func:`block_bytes`), so any process can check every byte it loaded,
  whoever wrote it and whichever node served it. Chains start with one of a few
  shared "system prompt" prefixes (:data:`SHARED_PREFIXES` of
  :data:`SHARED_BLOCKS` blocks), so the same block is written by several
  writers to several nodes.
* Memory probes of a process: ``/proc/PID/status`` (RSS split anonymous / file /
  shared), and for the calling process glibc's ``mallinfo2`` (heap in use and
  heap kept free) and the number of threads.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import numpy as np

from bench_common import die_with_parent, pid_alive  # noqa: F401 - shared with the benchmark; the soak imports them from here

LEAF = "full"
NAMESPACE = "soak/blocks"
BLOCK_BYTES = 32 * 1024
SHARED_PREFIXES = 4  # distinct shared prefixes ("system prompts")
SHARED_BLOCKS = 2  # blocks each shared prefix has
MIN_CHAIN, MAX_CHAIN = 4, 16  # blocks in one chain, shared prefix included
OP_BOUND = 15.0  # seconds any one operation may take before it counts as a hang (3x the connector's timeout)
CONNECTOR_TIMEOUT = 5.0
HEARTBEAT = 1.0  # seconds between a worker's status lines


def chain_length(writer: int, chain: int) -> int:
    """How many blocks chain ``chain`` of ``writer`` has (deterministic)."""
    return MIN_CHAIN + (chain * 7919 + writer * 104729) % (MAX_CHAIN - MIN_CHAIN + 1)


def chain_hashes(run: str, writer: int, chain: int) -> list[bytes]:
    """The 32-byte prefix-chained hashes of one chain: a shared prefix, then blocks of this writer's own."""
    hashes: list[bytes] = []
    prev = hashlib.sha256(f"soak/{run}/prefix/{chain % SHARED_PREFIXES}".encode()).digest()
    for i in range(chain_length(writer, chain)):
        if i == SHARED_BLOCKS:
            prev = hashlib.sha256(prev + f"/{writer}/{chain}".encode()).digest()
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).digest()
        hashes.append(prev)
    return hashes


def block_bytes(block_hash: bytes, size: int = BLOCK_BYTES) -> np.ndarray:
    """The bytes block ``block_hash`` holds: pseudo-random, seeded by the hash (``uint8[size]``)."""
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(block_hash[:16], "big")))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def leading_hits(mask: Any) -> int:
    """How many blocks from the root a lookup's mask reports present (a chain loads from its root)."""
    n = 0
    for present in mask:
        if not present:
            break
        n += 1
    return n


# ---- memory probes ------------------------------------------------------------------------------------

_STATUS_KEYS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "hwm",
                "Threads": "threads"}


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and its split (anon / file / shmem), VmHWM in bytes, and the thread count; empty once the process is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                name = _STATUS_KEYS.get(key)
                if name == "threads":
                    out[name] = int(rest.split()[0])
                elif name is not None:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2_fn() -> Any:
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = ()
    return fn


_mallinfo2 = _mallinfo2_fn()


def malloc_info() -> dict[str, int]:
    """This process's glibc heap (``mallinfo2``, every arena): bytes in use, kept free, and mmapped chunks."""
    if _mallinfo2 is None:
        return {}
    m = _mallinfo2()
    return {"heap_arena": int(m.arena), "heap_in_use": int(m.uordblks), "heap_free": int(m.fordblks),
            "heap_mmapped": int(m.hblkhd)}


def segment_mappings(pid: int) -> dict[int, tuple[str, int]]:
    """The node pool segments (``/memfd:dkv-*``) a process maps: inode -> (name, resident bytes)."""
    out: dict[int, tuple[str, int]] = {}
    inode = 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if inode and line.startswith("Rss:"):
                    name, rss = out[inode]
                    out[inode] = (name, rss + int(line.split()[1]) * 1024)
                    inode = 0
                    continue
                parts = line.split()
                if len(parts) >= 6 and "-" in parts[0] and parts[5].startswith("/memfd:dkv-"):
                    inode = int(parts[4])
                    out.setdefault(inode, (parts[5][len("/memfd:"):], 0))
                elif len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
                    inode = 0
    except (OSError, ValueError, IndexError):
        return {}
    return out
