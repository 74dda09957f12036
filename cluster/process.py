"""Start and stop ``dkv serve`` processes, found by PID and stopped by PID.

A :class:`NodeProcess` is a real node in its own process. It is ready when it
has written its ready file (bound address, PID, shm name); it is stopped with
SIGTERM (graceful: the node unlinks its arena) and, if it does not exit within
a bound, SIGKILL, after which whatever it left under ``/dev/shm`` is removed
by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class NodeStartError(RuntimeError):
    """The node process exited or did not become ready in time; carries its log tail."""


@dataclass
class NodeProcess:
    """A running ``dkv serve`` process."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path
    ready: dict[str, object] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    @property
    def shm_name(self) -> str:
        return str(self.ready["shm"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def pause(self) -> None:
        """SIGSTOP: the node hangs (a peer that stops answering mid-transfer)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL now (a crash, as a test wants it); the arena file stays until :meth:`stop`."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; then remove anything left in /dev/shm. Returns the exit code."""
        stop_process(self.proc, timeout)
        if self.ready.get("shm"):
            Path("/dev/shm", str(self.ready["shm"])).unlink(missing_ok=True)
        return self.proc.returncode


class FdLines:
    """Lines from a file descriptor (a child's stdout, a pipe), with a bounded wait for each.

    Reads the descriptor itself, never through a buffered file object: a
    ``select`` on a buffered reader misses lines it has already read ahead
    (a ready line that came in one chunk behind a log line waits for ever).
    """

    def __init__(self, fd: int, max_line: int = 1 << 20) -> None:
        self.fd = fd
        self.max_line = max_line
        self.buffer = b""
        self.eof = False

    def next(self, timeout: float) -> bytes | None:
        """The next line (without its newline), ``None`` if none came within ``timeout``; ``b""`` at EOF.

        ``ValueError`` when a line grows past ``max_line`` bytes.
        """
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if self.eof:
                line, self.buffer = self.buffer, b""
                return line
            if len(self.buffer) > self.max_line:
                raise ValueError(f"a line over {self.max_line} bytes")
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                self.eof = True
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it runs nothing and holds nothing but its entry)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


TCP_LISTEN = "0A"  # a socket's state in /proc/net/tcp (include/net/tcp_states.h)


def tcp_sockets() -> Iterator[tuple[int, str, str]]:
    """``(local port, state, inode)`` of every TCP socket of this network namespace (``/proc/net/tcp`` and ``tcp6``).

    The state is the kernel's two hex digits (:data:`TCP_LISTEN`, ...); a
    socket no process owns any more (one closing, in TIME_WAIT) has inode "0".
    """
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            yield int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]


def listening_on(pid: int, ports: tuple[int, ...]) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on each of ``ports`` (read from ``/proc``).

    Its own sockets, not whichever process answers on a port: a server
    started on a port picked free is known to have it only this way (another
    process may have bound it first, and the server is then about to exit).
    """
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # it exited
        return False
    inodes = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # (closed meanwhile: the listing's own descriptor, say)
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    listening = {port for port, state, inode in tcp_sockets() if state == TCP_LISTEN and inode in inodes}
    return all(port in listening for port in ports)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (kept across exec: usable as a preexec_fn).

    If the parent already died before that took effect, exit at once.
    """
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)


def stop_process(proc: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> int | None:
    """Stop a process this one started, by its PID: SIGCONT (a paused one cannot act on SIGTERM), SIGTERM,
    wait up to ``timeout``, then SIGKILL. It is gone when this returns; its exit status (``None``: unknown)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)
    return proc.returncode


def start_node(
    *args: str,
    pool: str = "64MiB",
    listen: str = "127.0.0.1:0",
    workdir: Path | None = None,
    env: dict[str, str] | None = None,
    ready_timeout: float = READY_TIMEOUT,
    exit_with_parent: bool = False,
    wrapper: Sequence[str] = (),
) -> NodeProcess:
    """Start ``dkv serve`` with the given extra arguments and wait until it serves.

    ``exit_with_parent``: the node stops by itself once this process has exited,
    however it died (test runs and benchmarks, so that none of their nodes
    outlives them); a cluster's nodes are started without it, to outlive the
    command that started them. ``wrapper``: a command the node runs under
    (a profiler that then runs the node in its own process, as
    ``scripts/probe_instructions.py`` runs it under valgrind).
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix="dkv-node-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ready_file = workdir / "ready.json"
    ready_file.unlink(missing_ok=True)
    log_path = workdir / "node.log"
    cmd = [*wrapper, sys.executable, "-m", "dkv.cli", "serve", "--listen", listen, "--pool", pool,
           "--ready-file", str(ready_file), *(("--exit-with-parent",) if exit_with_parent else ()), *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    node = NodeProcess(proc, workdir, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if ready_file.exists():
            node.ready = json.loads(ready_file.read_text())
            return node
        if not node.alive():
            raise NodeStartError(f"dkv serve exited with {proc.returncode}:\n{node.log_tail()}")
        time.sleep(0.05)
    node.stop()
    raise NodeStartError(f"dkv serve not ready after {ready_timeout}s:\n{node.log_tail()}")
