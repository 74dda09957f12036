"""Which asyncio event loop dKV's own loops run on: uvloop by default, the standard one on request.

Contract:

* **Where.** The loops that carry dKV's traffic are made here: the node's
  (``dkv serve``, through :func:`run`) and the connector's loop thread
  (:mod:`dkv.loop_thread`, through :func:`new_event_loop`). The CLI's
  one-shot inspection commands keep ``asyncio.run``. A loop the embedding
  application made (a test's, an engine's) is used as it is: every dKV
  component works on either kind.
* **Choice.** ``DKV_EVENT_LOOP`` = ``uvloop`` (the default) or ``asyncio``.
  Anything else is a :class:`~dkv.errors.ConfigError`, raised when a loop is
  made. ``uvloop`` is a pinned dependency; where it cannot be imported (a
  platform without a wheel) the default falls back to ``asyncio`` with a
  warning, and an explicit ``DKV_EVENT_LOOP=uvloop`` is an error.
* **Why.** The control path is a chain of wake-ups: a socket becomes
  readable, a callback runs, a task resumes, a reply is written. uvloop runs
  that chain in C (libuv): measured here (``scripts/probe_event_loop.py``), a
  Unix-socket ping-pong between two loops took about 0.7x the time it takes
  on the standard loop, and a connector's thread hop 0.7-0.85x.
  UCX progress does not depend on it: the loop-driven mode
  (:mod:`dkv.transport`) only needs ``add_reader``, ``call_soon`` and
  ``call_later``, which both kinds have.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from dkv.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

EVENT_LOOP_ENV = "DKV_EVENT_LOOP"
EVENT_LOOPS = ("uvloop", "asyncio")
DEFAULT_EVENT_LOOP = "uvloop"

_warned_fallback = False


def chosen_event_loop() -> str:
    """The kind of loop :func:`new_event_loop` makes now (``DKV_EVENT_LOOP``, else the default)."""
    value = os.environ.get(EVENT_LOOP_ENV, "").strip().lower()
    if value and value not in EVENT_LOOPS:
        raise ConfigError(f"{EVENT_LOOP_ENV}={value!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if (value or DEFAULT_EVENT_LOOP) == "asyncio":
        return "asyncio"
    if _uvloop() is not None:
        return "uvloop"
    if value:
        raise ConfigError(f"{EVENT_LOOP_ENV}=uvloop, but uvloop cannot be imported here")
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        log.warning("uvloop cannot be imported: dKV's event loops run on the standard asyncio loop")
    return "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new, unset event loop of the chosen kind (see the module docstring)."""
    if chosen_event_loop() == "uvloop":
        return _uvloop().new_event_loop()  # type: ignore[no-any-return, union-attr]
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop of the chosen kind."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """``"uvloop"`` or ``"asyncio"``: what ``loop`` is (for stats and tests)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


__all__ = ["DEFAULT_EVENT_LOOP", "EVENT_LOOPS", "EVENT_LOOP_ENV", "chosen_event_loop", "loop_kind",
           "new_event_loop", "run"]
