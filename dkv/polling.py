"""Short polls without the GIL before a thread sleeps: a blocking call's reply, seen without a wake-up.

A thread asleep (in ``recv``, or on a lock) is woken by the kernel when its
reply lands; where the core it slept on had gone idle, that wake-up is an
interrupt to a halted core, which on a virtual machine without guest halt
polling costs tens of µs (measured here: ~60 µs of a ~220 µs one-block
same-host load; a hop to the connector's loop thread and back with nothing
to do there 73 µs, 47 µs with the way back polled). A thread that polls
stays on its core and sees the reply at once, for the price of that core's
time while it waits.

Contract:

* **Where.** Only calls the scheduler thread blocks on for a reply anyway:
  the connector's ``lookup()`` (its same-host round trip on the calling
  thread, :mod:`dkv.direct_channel`; its hop to the loop thread,
  :meth:`dkv.loop_thread.LoopThread.run`). Each polls for at most its
  bound, then sleeps as before: the answer, the bounds and the errors are
  the same either way.
* **Cost.** The polling thread's core, for as long as it polls (the reply's
  time, at most the bound). The GIL is free throughout: the process's other
  threads run meanwhile.
* **Where not built.** ``dkv._spin`` is an optional native build, like the
  others; without it (:data:`NATIVE` false) nothing polls.
* **The bound.** :data:`REPLY_SPIN` by default, the connector's
  ``reply_spin`` (0 never polls; at most :data:`MAX_REPLY_SPIN`).
"""

from __future__ import annotations

from collections.abc import Callable

# Long enough for a one-block listener lookup's answer (~0.5 ms here) and a same-host lookup of a few
# hundred hashes (~0.2 ms); a slower reply is polled for this long and then slept on.
REPLY_SPIN = 1e-3
MAX_REPLY_SPIN = 10e-3

recv_spin: Callable[[int, bytearray, int], int] | None = None
wait_flag: Callable[[bytearray, int], bool] | None = None
peer_closed: Callable[[int], bool] | None = None  # a peek for a stream's end that never raises (dkv._spin)
try:
    from dkv._spin import peer_closed, recv_spin, wait_flag
except ImportError:  # not built: every wait sleeps at once
    pass

NATIVE = wait_flag is not None


def check_reply_spin(seconds: float) -> float:
    """``seconds`` when it is a polling bound this module takes (0 to :data:`MAX_REPLY_SPIN`); ``ValueError`` otherwise."""
    if not 0 <= seconds <= MAX_REPLY_SPIN:
        raise ValueError(f"reply_spin must be from 0 to {MAX_REPLY_SPIN} s, not {seconds}")
    return seconds


def spin_ns(seconds: float) -> int:
    """A bound in nanoseconds for the native polls: 0 where they are not built (nothing polls then)."""
    return int(seconds * 1e9) if NATIVE and seconds > 0 else 0


__all__ = ["MAX_REPLY_SPIN", "NATIVE", "REPLY_SPIN", "check_reply_spin", "peer_closed", "recv_spin", "spin_ns",
           "wait_flag"]
