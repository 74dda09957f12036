"""System calls that cannot block, made without letting go of the GIL (libc through ``ctypes.PyDLL``).

Python lets go of the GIL around every socket call and ``os.write``. For a
call that cannot block (a non-blocking pipe, ``MSG_DONTWAIT``) that gains
nothing, and it costs the calling thread whenever another thread waits for
the GIL: that thread takes it, and the caller gets it back only when that
thread waits on something or a switch interval later (0.5 ms while a
connector lives, see :mod:`dkv.gil`). An engine's scheduler thread polling
a handle between its steps (``is_complete()``) must not hand the GIL to the
connector's loop thread at every poll. Each function here makes the
call holding the GIL and answers as its ``socket``/``os`` counterpart does
(a receive that finds nothing says so with -1 instead of an exception); where
``ctypes`` cannot reach libc it falls back to that counterpart. The receive
is native where ``dkv._spin`` is built (no ``ctypes`` call, no exception made
for a poll that finds nothing: three of them per same-host batch load).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from typing import Any

_RECV_NOW = socket.MSG_DONTWAIT
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)

try:
    _libc: Any = ctypes.PyDLL(None, use_errno=True)
    _write = _libc.write
    _write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    _write.restype = ctypes.c_ssize_t
    _recv = _libc.recv
    _recv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _recv.restype = ctypes.c_ssize_t
except (OSError, AttributeError):  # no libc to call (not Linux, say): the GIL is let go of, as usual
    _libc = _write = _recv = None

HOLDS_GIL = _libc is not None

try:
    from dkv._spin import recv_now as _recv_native  # (holds the GIL: it never waits)
except ImportError:  # not built: through ctypes, or the socket
    _recv_native = None


def write(fd: int, data: bytes) -> int:
    """``os.write`` holding the GIL: for a descriptor that never blocks (a non-blocking pipe)."""
    if _write is None:
        return os.write(fd, data)
    while True:
        n = int(_write(fd, data, len(data)))
        if n >= 0:
            return n
        _raise_unless_interrupted()


def recv_into_now(sock: socket.socket, view: memoryview) -> int:
    """Read what has arrived into ``view`` (``MSG_DONTWAIT``), holding the GIL: the bytes read, 0 when the peer
    closed, -1 when nothing has arrived.

    ``view`` is a writable, contiguous byte view. ``OSError`` as
    ``socket.recv_into`` raises it (never ``BlockingIOError``: that is -1).
    """
    if _recv_native is not None:
        return int(_recv_native(sock.fileno(), view))
    size = len(view)
    if _recv is None or size == 0:
        try:
            return sock.recv_into(view, size, _RECV_NOW)
        except BlockingIOError:
            return -1
    target = (ctypes.c_char * size).from_buffer(view)
    while True:
        n = int(_recv(sock.fileno(), target, size, _RECV_NOW))
        if n >= 0:
            return n
        if ctypes.get_errno() in _AGAIN:
            return -1
        _raise_unless_interrupted()


def _raise_unless_interrupted() -> None:
    code = ctypes.get_errno()
    if code == errno.EINTR:
        return
    if code in _AGAIN:
        raise BlockingIOError(code, os.strerror(code))
    raise OSError(code, os.strerror(code))
