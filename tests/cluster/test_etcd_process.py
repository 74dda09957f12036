"""``cluster.etcd_process.start_etcd``: the etcd it returns is the one it started, listening on the ports it names."""

from __future__ import annotations

import socket
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


def test_fixed_ports_that_are_taken_are_an_error_that_shows_etcd_s_log_and_leaves_nothing(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    made = tmp_path / "dkv-etcd-made"  # where the start's own data directory (and, beside it, its log) go

    def mkdtemp(**_kwargs: object) -> str:
        made.mkdir()
        return str(made)

    monkeypatch.setattr(etcd_process.tempfile, "mkdtemp", mkdtemp)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)did not start after 1 attempt.*address already in use"):
            etcd_process.start_etcd(client_port=held.getsockname()[1])
    finally:
        held.close()
    assert not made.exists() and not made.with_suffix(".log").exists(), "a start that failed leaves no etcd files"
