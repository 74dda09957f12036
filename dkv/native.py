"""The native checked copy (``dkv._checked_copy``), or ``None`` where it is not built or is turned off.

Built at install where a C compiler and ``xxhash.h`` are present (Debian: gcc,
libxxhash-dev; ``scripts/run.sh`` installs them). Without them, or with
``DKV_NATIVE_COPY=0`` (to compare, or to rule it out), :mod:`dkv.lease_slots`
copies in Python, with the same bytes and the same checksums.

:data:`copy_and_checksum` is a same-host load's checked copy of a whole batch,
without the GIL, with XXH3's AVX2 code where the CPU has it (:data:`KERNEL`).
:data:`CheckedCopy` is the same batch made once and shared by the threads that
call its ``work()``: each claims a few blocks at a time, without the GIL, and
checks them against the writers' checksums as it goes. :data:`rows_copy` makes
one for a load into rows of one buffer straight from a lease's slot map.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

copy_and_checksum: Callable[..., bytes] | None = None
CheckedCopy: Callable[..., Any] | None = None  # the same batch shared by threads (see dkv._checked_copy)
rows_copy: Callable[..., Any] | None = None  # a CheckedCopy into rows of one buffer, from a packed slot map
KERNEL: str | None = None

if os.environ.get("DKV_NATIVE_COPY", "1") != "0":
    try:
        from dkv import _checked_copy
    except ImportError:
        pass
    else:
        copy_and_checksum = _checked_copy.copy_and_checksum
        CheckedCopy = _checked_copy.CheckedCopy
        rows_copy = _checked_copy.rows_copy
        KERNEL = _checked_copy.KERNEL

NATIVE = copy_and_checksum is not None
