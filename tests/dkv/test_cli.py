"""The ``dkv`` command line against real node processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cluster.process import start_node


def _dkv(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dkv.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_stats_json_and_table(node) -> None:
    result = _dkv("stats", node.address, "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["address"] == node.address and stats["host"]["total"] == 64 * 2**20
    assert stats["node_id"] == node.ready["node_id"]
    table = _dkv("stats", node.address)
    assert table.returncode == 0 and "host pool" in table.stdout and node.ready["node_id"] in table.stdout


def test_stats_of_a_dead_address_fails_clearly_and_quickly() -> None:
    result = _dkv("stats", "127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 2
    assert "127.0.0.1:1" in result.stderr


def test_listening_beyond_loopback_requires_a_token() -> None:
    result = _dkv("serve", "--listen", "0.0.0.0:0", "--pool", "1MiB")
    assert result.returncode == 2
    assert "token" in result.stderr


def test_bad_pool_size_is_a_clear_error() -> None:
    result = _dkv("serve", "--pool", "lots")
    assert result.returncode == 2 and "size" in result.stderr


def test_a_bad_peer_control_port_is_a_clear_error() -> None:
    for value in ("tcp", "70000"):
        result = _dkv("serve", "--pool", "1MiB", "--peer-control-port", value)
        assert result.returncode == 2 and "peer" in result.stderr.lower() and "port" in result.stderr, result.stderr


def test_a_peer_control_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _dkv("serve", "--pool", "1MiB", "--peer-control-port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port}" in result.stderr and "--peer-control-port" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "╭" not in result.stderr, result.stderr


def test_sigterm_is_a_graceful_shutdown_that_leaves_nothing(tmp_path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    node = start_node("--disk", str(spill), "--disk-size", "1MiB", workdir=tmp_path / "n", exit_with_parent=True)
    shm = f"/dev/shm/{node.shm_name}"
    assert os.path.exists(shm) and os.listdir(spill)
    assert node.stop() == 0
    assert not os.path.exists(shm), "the arena must be unlinked"
    assert not os.listdir(spill), "the disk tier must be removed"
    assert not (tmp_path / "n" / "ready.json").exists()
    assert "stopped" in node.log_tail()
