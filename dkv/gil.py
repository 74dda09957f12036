"""The interpreter's GIL switch interval, lowered while a connector's loop thread needs the GIL promptly.

A connector's transfers over the listener path run on its loop thread
(:mod:`dkv.loop_thread`): each step of a load (sending the request, each
completion UCX reports, the checks of landed blocks) needs the GIL. While the
engine's scheduler thread runs Python, a thread that wakes up for the GIL gets
it only when the scheduler thread blocks or when the interpreter's switch
interval (``sys.getswitchinterval()``, 5 ms by default) forces a hand-off.
A load takes several such steps, so with a busy scheduler thread every step
costs up to a whole interval: measured with ``scripts/probe_load_phases.py
--listener --busy-caller`` on the 2-core machine, a one-block load took
37 ms instead of 0.7 ms, and 256 x 64 KiB took 131 ms instead of 10 ms.

The interval only matters when a thread waits for the GIL, so a shorter one
costs nothing while dKV is idle; under contention it makes more, shorter
hand-offs (the loop thread's work per step is tens of µs). The same-host
path's copies run on native threads that never take the GIL, and need none of
this.

:func:`hold_switch_interval` lowers the interval (never raises it: an engine
that set a shorter one keeps it) for as long as anyone holds it;
:func:`release_switch_interval` by the last holder puts back the interval it
found, unless someone else changed it meanwhile. Any thread. A child forked
from a holding process holds nothing (no connector's loop thread survives a
fork): it starts with the interval that was found.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading

from dkv.errors import ConfigError

log = logging.getLogger(__name__)

# Seconds. With the scheduler thread busy in Python (probe_load_phases.py --listener --busy-caller), a
# one-block listener load took 37 ms at CPython's 5 ms, 6.3 ms at 1 ms, 3.8 ms at 0.5 ms and 2.3 ms at
# 0.2 ms; 256 x 64 KiB took 131, 16.6 and 9.7 ms at 5, 0.5 and 0.2 ms. The scheduler thread's own calls
# (probe_scheduler_calls.py) were no slower at 0.5 or 0.2 ms. 0.5 ms: a tenth of CPython's, most of the gain.
DEFAULT_SWITCH_INTERVAL = 0.0005
ENVIRONMENT = "DKV_GIL_SWITCH_INTERVAL"  # seconds, or "off" to leave the interpreter's alone (connector.max_adapter)

_lock = threading.Lock()
_holders = 0
_found: float | None = None  # the interval before the first holder lowered it (None: it was not lowered)
_set: float | None = None  # the interval the holders set


def parse_switch_interval(text: str | None, what: str = ENVIRONMENT) -> float | None:
    """A switch interval as configured: seconds (``"0.0005"``), ``"off"`` (None: leave it), unset: the default.

    :class:`~dkv.errors.ConfigError` for anything else (not a number, not
    positive, not finite), naming ``what`` was set.
    """
    if text is None or not text.strip():
        return DEFAULT_SWITCH_INTERVAL
    if text.strip().lower() == "off":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(f"{what}={text!r}: give seconds (e.g. 0.0005) or 'off'") from None
    try:
        return check_switch_interval(seconds)
    except ConfigError:
        raise ConfigError(f"{what}={text!r}: give a positive number of seconds (e.g. 0.0005) or 'off'") from None


def check_switch_interval(seconds: float) -> float:
    """``seconds`` when it is a usable switch interval (positive, finite); :class:`ConfigError` otherwise."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ConfigError(f"GIL switch interval {seconds!r}: give a positive number of seconds, or None to leave it")
    return float(seconds)


def hold_switch_interval(seconds: float | None) -> None:
    """Count a holder; lower the interpreter's switch interval to ``seconds`` if it is longer. None: count only.

    Pair each call with :func:`release_switch_interval`. A holder asking for a
    shorter interval than the one set lowers it further.
    """
    global _holders, _found, _set
    if seconds is not None:
        seconds = check_switch_interval(seconds)
    with _lock:
        _holders += 1
        if seconds is None:
            return
        current = sys.getswitchinterval()
        if current <= seconds:
            return
        if _found is None:
            _found = current
        sys.setswitchinterval(seconds)
        _set = sys.getswitchinterval()  # as the interpreter rounded it
        log.info("GIL switch interval lowered from %.2g s to %.2g s while dKV transfers run (see dkv.gil)",
                 current, _set)


def release_switch_interval() -> None:
    """Drop a holder; the last one puts back the interval found, if the interval is still the one set here."""
    global _holders, _found, _set
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders or _found is None:
            return
        if sys.getswitchinterval() == _set:
            sys.setswitchinterval(_found)
        _found = _set = None


def _forget_holders_in_child() -> None:
    """After a fork, in the child: no holder came along, so put back the interval found (as the last release would)."""
    global _lock, _holders, _found, _set
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _found is not None and sys.getswitchinterval() == _set:
        sys.setswitchinterval(_found)
    _holders, _found, _set = 0, None, None


os.register_at_fork(after_in_child=_forget_holders_in_child)
