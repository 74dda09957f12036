"""``cluster.etcd_process.start_etcd``: the etcd it returns is the one it started, listening on the ports it names."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import etcd_process
from cluster.process import listening_on, pid_alive
from tests.ports import first_pick_taken


def test_a_port_taken_before_etcd_binds_it_is_picked_again_not_mistaken_for_etcd(monkeypatch) -> None:
    etcd = None
    try:
        with first_pick_taken(monkeypatch, etcd_process) as taken:  # a connect on it reaches the listener held there
            etcd = etcd_process.start_etcd()
            assert etcd.client_port != taken and listening_on(etcd.proc.pid, (etcd.client_port, etcd.peer_port))
            assert "address already in use" in etcd.log_path.read_text(), "the first etcd found the port taken"
    finally:
        if etcd is not None:
            etcd.stop()
    assert etcd is not None and not pid_alive(etcd.proc.pid)


@pytest.fixture
def made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where a start's own data directory goes (and, beside it, its log); attempts 0.05 s apart."""
    made = tmp_path / "dkv-etcd-made"

    def mkdtemp(**_kwargs: object) -> str:
        made.mkdir()
        return str(made)

    monkeypatch.setattr(etcd_process.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(etcd_process, "FIXED_PORT_PAUSE", 0.05)
    return made


@pytest.fixture
def held() -> Iterator[socket.socket]:
    """A port another process listens on (as far as etcd can tell)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock
    sock.close()


def test_fixed_ports_that_are_taken_are_an_error_that_shows_etcd_s_log_and_leaves_nothing(made: Path,
                                                                                          held: socket.socket) -> None:
    try:
        with pytest.raises(RuntimeError, match=r"(?s)did not start after 5 attempt.*address already in use"):
            etcd_process.start_etcd(client_port=held.getsockname()[1])
    finally:
        held.close()
    assert not made.exists() and not made.with_suffix(".log").exists(), "a start that failed leaves no etcd files"


def test_fixed_ports_held_for_a_while_by_another_process_are_waited_for(made: Path, held: socket.socket,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart on its old ports, one of them briefly someone else's (an outgoing connection's): it comes up there."""
    monkeypatch.setattr(etcd_process, "FIXED_PORT_PAUSE", 0.5)  # ample time for the holder to let go in between
    port = held.getsockname()[1]

    def let_go_once_refused() -> None:  # the first attempt found the port taken: the holder lets go
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            log = made.with_suffix(".log")
            if log.exists() and "address already in use" in log.read_text(errors="replace"):
                break
            time.sleep(0.01)
        held.close()

    releaser = threading.Thread(target=let_go_once_refused, daemon=True)
    releaser.start()
    etcd = None
    try:
        etcd = etcd_process.start_etcd(client_port=port)
        assert etcd.client_port == port and listening_on(etcd.proc.pid, (port, etcd.peer_port))
        assert "address already in use" in etcd.log_path.read_text(), "the first attempt found the port taken"
    finally:
        releaser.join(30)
        held.close()
        if etcd is not None:
            etcd.stop()
    assert etcd is not None and not pid_alive(etcd.proc.pid)
