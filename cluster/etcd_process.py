"""Start and stop a real ``etcd`` process on free loopback ports (tests, local clusters).

The data directory lives under ``/dev/shm`` by default (etcd is ready in well
under a second there). :meth:`EtcdProcess.stop` kills it by PID and, unless
``keep_data`` is asked for, removes the data directory.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT = 30.0


class EtcdNotFound(RuntimeError):
    """No ``etcd`` binary on PATH."""


def etcd_binary() -> str:
    """Path of the ``etcd`` binary, or :class:`EtcdNotFound` naming the package that provides it."""
    path = shutil.which("etcd")
    if path is None:
        raise EtcdNotFound("etcd is not on PATH: install it (Debian/Ubuntu: apt-get install etcd-server)")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (the caller binds it soon; a clash makes the start fail and retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EtcdProcess:
    """A running etcd member."""

    proc: subprocess.Popen[bytes]
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, keep_data: bool = False, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if needed; remove the data directory unless ``keep_data``."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if not keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)

    def restart(self) -> EtcdProcess:
        """Start etcd again on the same ports and data (after :meth:`stop` with ``keep_data``)."""
        return start_etcd(data_dir=self.data_dir, client_port=self.client_port, peer_port=self.peer_port,
                          log_path=self.log_path, host=self.host)


def _ready(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start_etcd(
    *,
    data_dir: Path | None = None,
    client_port: int | None = None,
    peer_port: int | None = None,
    log_path: Path | None = None,
    host: str = "127.0.0.1",
    ready_timeout: float = READY_TIMEOUT,
) -> EtcdProcess:
    """Start a single-member etcd and wait until its client port answers."""
    binary = etcd_binary()
    data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dkv-etcd-", dir="/dev/shm"))
    log_path = Path(log_path or data_dir.with_suffix(".log"))
    for attempt in range(5):
        cport = client_port or free_port(host)
        pport = peer_port or free_port(host)
        cmd = [
            binary, "--name", "dkv", "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://{host}:{cport}", "--advertise-client-urls", f"http://{host}:{cport}",
            "--listen-peer-urls", f"http://{host}:{pport}", "--initial-advertise-peer-urls", f"http://{host}:{pport}",
            "--initial-cluster", f"dkv=http://{host}:{pport}", "--log-level", "warn",
        ]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        etcd = EtcdProcess(proc, cport, pport, data_dir, log_path, host)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline and etcd.alive():
            if _ready(host, cport):
                return etcd
            time.sleep(0.05)
        etcd.stop(keep_data=True)
        if client_port is not None:
            break  # fixed ports: nothing to retry with
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise RuntimeError(f"etcd did not start after {attempt + 1} attempt(s):\n{tail}")
