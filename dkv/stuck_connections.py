"""Connections that UCX's TCP connection manager leaves stuck on a listener port: found and reset.

The defect (UCX 1.21, ``src/uct/tcp/tcp_sockcm_ep.c``). The listener reads a
connection request into a buffer of 2 KiB of private data plus a 16-byte
header, whose length field says how much is coming. A peer that sends more
than the buffer holds, with a length field that claims more still (any few
KiB of random bytes do), fills the buffer; from then on UCX asks ``recv`` for
0 bytes, which succeeds with 0 bytes. UCX never reads the peer's FIN, so it
never closes the socket: it stays in CLOSE_WAIT for the life of the node,
holding a descriptor, and since it stays readable UCX's async thread spins on
it. Measured on the 2-core machine: 10 such connections kept 1.0-1.8 cores
busy and 10 descriptors open, for good; 1 000 took 1 000 descriptors.

The remedy, :class:`StuckConnectionReaper`: every :data:`SCAN_INTERVAL`, the
sockets of this process whose local port is the listener's and that were in
CLOSE_WAIT at two scans in a row are each sent one byte, through a duplicate
of the descriptor that is checked to be the same socket (by inode) and closed
at once. The peer has closed its socket, so its kernel answers the byte with a
reset; the reset is an error on UCX's socket, and UCX's own error path closes
the socket and frees its endpoint, as for a peer that crashed.

Why this is safe while UCX owns the descriptor: nothing here closes UCX's
descriptor or reads from it, and a descriptor number reused meanwhile is never
touched (the duplicate's inode must match). A socket in CLOSE_WAIT has
received its peer's FIN, and to UCX's connection manager a FIN is the peer
going away: a healthy connection in that state is one UCX has already seen
end, or sees end at its next event, far sooner than two scans; the reset
changes nothing for it. Each socket is sent its byte once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

SCAN_INTERVAL = 1.0  # seconds between scans; a stuck socket is reset one to two intervals after it stuck
LOG_INTERVAL = 60.0  # at most one log line per this many seconds, however many were reset
RESET_TIMEOUT_MS = 10_000  # TCP_USER_TIMEOUT on the stuck socket: an unreachable peer fails it within this
TCP_CLOSE_WAIT = 8  # include/net/tcp_states.h
# sock_diag over netlink (linux/sock_diag.h, linux/inet_diag.h): the kernel reports only the sockets
# in the asked states: a scan took 1.7 ms with 2 400 sockets on the host, where reading
# /proc/net/tcp took 31 ms (on the event loop).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_DIAG_REQUEST = struct.Struct("=BBBxI48x")  # family, protocol, extensions, states, socket id (any)
_DIAG_MESSAGE = struct.Struct("=BBBBHH32xIQIIIII")  # family, state, timer, retrans, sport (be), dport, ..., inode


def close_wait_sockets(port: int) -> set[int]:
    """Inodes of the TCP sockets (this network namespace) in CLOSE_WAIT whose local port is ``port``."""
    inodes: set[int] = set()
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            found = _diagnose(family, 1 << TCP_CLOSE_WAIT)
        except OSError:
            if family == socket.AF_INET:
                raise
            continue  # a host without IPv6
        for state, local_port, inode in found:
            if state == TCP_CLOSE_WAIT and local_port == port and inode:  # inode 0: no descriptor holds it
                inodes.add(inode)
    return inodes


def _diagnose(family: int, states: int) -> list[tuple[int, int, int]]:
    """``(state, local port, inode)`` of the TCP sockets of ``family`` in ``states`` (a bit mask)."""
    request = _DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, states)
    header = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY,
                                _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    found: list[tuple[int, int, int]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(5.0)
        nl.sendall(header + request)
        while True:
            data = nl.recv(65536)
            offset = 0
            while offset + _NLMSG_HEADER.size <= len(data):
                length, kind = _NLMSG_HEADER.unpack_from(data, offset)[:2]
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR:
                    raise OSError(f"sock_diag refused the dump for family {family}")
                fields = _DIAG_MESSAGE.unpack_from(data, offset + _NLMSG_HEADER.size)
                found.append((fields[1], socket.ntohs(fields[4]), fields[-1]))
                offset += (length + 3) & ~3
            if not data:
                return found


def descriptors_of(inodes: Iterable[int]) -> dict[int, int]:
    """``inode -> descriptor`` for those of ``inodes`` that this process holds."""
    wanted = set(inodes)
    found: dict[int, int] = {}
    if not wanted:
        return found
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in wanted:
            found[int(target[8:-1])] = int(name)
    return found


def reset_peer(fd: int, inode: int) -> bool:
    """Send one byte on socket ``fd`` if it still is socket ``inode``, through a duplicate; True if sent.

    The descriptor itself is neither closed nor read: whoever owns it sees
    the peer's answer (a reset, for a peer that closed its socket) as an error.
    """
    try:
        duplicate = os.dup(fd)
    except OSError:  # closed meanwhile
        return False
    try:
        info = os.fstat(duplicate)
        is_it = stat.S_ISSOCK(info.st_mode) and info.st_ino == inode  # else the number was reused: not ours
        sock = socket.socket(fileno=duplicate) if is_it else None
    except OSError:
        sock = None
    if sock is None:
        os.close(duplicate)
        return False
    with sock:  # closes the duplicate only
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, RESET_TIMEOUT_MS)
            sock.send(b"\0", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError as exc:  # the socket failed meanwhile: its owner is told already
            log.debug("reset of socket %d: %s", inode, exc)
            return False
    return True


class StuckConnectionReaper:
    """Resets, on the running event loop, the connections UCX leaves stuck on listener ``port``.

    :meth:`start` schedules a scan every ``interval`` seconds (a timer, no
    task); :meth:`close` stops it. ``resets`` counts the sockets reset.
    What it resets is logged at most once per :data:`LOG_INTERVAL`.
    """

    def __init__(self, port: int, interval: float = SCAN_INTERVAL) -> None:
        self.port = port
        self.interval = interval
        self.resets = 0
        self._suspects: set[int] = set()  # in CLOSE_WAIT at the last scan
        self._reset: set[int] = set()  # sent their byte (and still in CLOSE_WAIT)
        self._timer: asyncio.TimerHandle | None = None
        self._unlogged = 0
        self._next_log = 0.0

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._log(force=True)

    def _tick(self) -> None:
        try:
            self.scan()
        except Exception as exc:  # noqa: BLE001 - no sock_diag here (a sandbox, say): said once, then no more scans
            log.warning("cannot look for connections stuck on port %d (%s: %s); a peer that sends UCX a "
                        "malformed connection request keeps a descriptor", self.port, type(exc).__name__, exc)
            self._timer = None
            return
        if self._timer is not None:
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def scan(self) -> int:
        """One pass: reset what was in CLOSE_WAIT at the last pass and still is; how many were reset."""
        now = close_wait_sockets(self.port)
        stuck = (now & self._suspects) - self._reset
        self._suspects = now
        self._reset &= now
        reset = 0
        for inode, fd in descriptors_of(stuck).items():
            if reset_peer(fd, inode):
                self._reset.add(inode)
                reset += 1
        if reset:
            self.resets += reset
            self._unlogged += reset
            self._log()
        return reset

    def _log(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._unlogged or (now < self._next_log and not force):
            return
        log.warning("reset %d connection(s) to port %d that sent UCX a malformed connection request "
                    "(at most one such line per %.0f s)", self._unlogged, self.port, LOG_INTERVAL)
        self._unlogged = 0
        self._next_log = now + LOG_INTERVAL
