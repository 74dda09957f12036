"""`dkv cluster up/status/down` and the demo, as a newcomer runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import local
from cluster.process import pid_alive
from tests.ports import first_pick_taken


def _dkv(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dkv.cli", *args], capture_output=True, text=True, timeout=timeout)


def _segments_of(pids: list[int]) -> set[str]:
    """The /dev/shm entries these processes named (``dkv-<label>-<pid>-<random>``); other runs' segments do not count."""
    marks = tuple(f"-{pid}-" for pid in pids)
    return {name for name in os.listdir("/dev/shm") if name.startswith("dkv-") and any(m in name for m in marks)}


def test_cluster_up_status_down_leaves_nothing_behind(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    up = _dkv("cluster", "up", "--nodes", "3", "--dir", str(directory), "--pool", "32MiB")
    try:
        assert up.returncode == 0, up.stderr
        status = _dkv("cluster", "status", "--dir", str(directory), "--json")
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert info["etcd"]["alive"] and len(info["nodes"]) == 3
        assert all(n["alive"] and n["registered"] for n in info["nodes"])
        pids = [info["etcd"]["pid"], *(n["pid"] for n in info["nodes"])]
        assert _segments_of(pids) == {n["shm"] for n in info["nodes"]}
    finally:
        down = _dkv("cluster", "down", "--dir", str(directory))
    assert down.returncode == 0, down.stderr
    assert not [p for p in pids if pid_alive(p)], "every recorded process must be gone"
    assert _segments_of(pids) == set(), "no shared-memory segment left"
    assert sorted(p.name for p in directory.iterdir()) == ["etcd.log", "node-0.log", "node-1.log", "node-2.log"]
    again = _dkv("cluster", "status", "--dir", str(directory))
    assert again.returncode == 2 and "no cluster recorded" in again.stderr


def test_second_up_in_the_same_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    assert _dkv("cluster", "up", "--nodes", "1", "--dir", str(directory), "--pool", "16MiB").returncode == 0
    try:
        again = _dkv("cluster", "up", "--nodes", "1", "--dir", str(directory), "--pool", "16MiB")
        assert again.returncode == 2 and "already records a cluster" in again.stderr
    finally:
        assert _dkv("cluster", "down", "--dir", str(directory)).returncode == 0


def test_demo_compares_three_configurations_bit_exact_and_cleans_up(tmp_path: Path) -> None:
    result = _dkv("demo", "--small", "--out", str(tmp_path / "out"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    per = report["configurations"]
    assert set(per) == {"recompute", "device", "dkv"}
    assert report["bit_exact"] is True
    requests = per["recompute"]["requests"]
    assert requests == 6 * 3 and all(p["requests"] == requests for p in per.values())
    assert report["requests"] == len(report["requests_detail"]) == 3 * requests
    # every continuation of the two caching configurations was compared with the recompute reference
    assert per["device"]["bit_exact_checked"] == per["dkv"]["bit_exact_checked"] == requests
    assert per["device"]["bit_exact"] is per["dkv"]["bit_exact"] is True
    # the reference recomputes everything; the baseline has its device caches and nothing else
    assert per["recompute"]["computed_blocks"] == per["recompute"]["prompt_blocks"]
    assert per["device"]["device_hit_blocks"] > 0
    assert per["device"]["local_hit_blocks"] == per["device"]["peer_hit_blocks"] == per["device"]["bytes_loaded"] == 0
    # with dKV, blocks come from peers through hints, and every hint has an outcome
    dkv = per["dkv"]
    assert dkv["peer_hit_blocks"] > 0 and dkv["peer_hits"] > 0 and dkv["bytes_loaded"] > 0
    assert dkv["computed_blocks"] < per["device"]["computed_blocks"]
    assert sum(dkv["hints"].values()) == requests and dkv["hints"].get("used", 0) > 0
    for p in per.values():
        assert (p["device_hit_blocks"] + p["local_hit_blocks"] + p["peer_hit_blocks"] + p["computed_blocks"]
                == p["prompt_blocks"])
        assert 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"]
    assert (tmp_path / "out" / "chart.png").stat().st_size > 1000
    assert "every loaded continuation bit-exact" in result.stdout
    assert len(report["cluster_pids"]) == 1 + 3, "etcd and a node per engine"
    assert not [p for p in report["cluster_pids"] if pid_alive(p)], "the demo's cluster must be torn down"
    left = _segments_of(report["cluster_pids"])
    assert left == set(), f"the demo's nodes left segments behind: {left}"
    assert len(report["engine_pids"]) == 3
    assert not [p for p in report["engine_pids"] if pid_alive(p)], "the demo's engine processes must be gone"


@pytest.mark.parametrize("missing", ["etcd"])
def test_cluster_up_without_etcd_names_the_package(tmp_path: Path, missing: str) -> None:
    env = {**os.environ, "PATH": "/nonexistent"}
    result = subprocess.run([sys.executable, "-m", "dkv.cli", "cluster", "up", "--dir", str(tmp_path / "c")],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "etcd-server" in result.stderr


# ---- etcd's ports ---------------------------------------------------------------------------------


def test_a_port_taken_before_etcd_binds_it_costs_a_second_pick_not_the_cluster(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "c"
    with first_pick_taken(monkeypatch, local) as taken:
        record = local.up(directory, nodes=1, pool="16MiB")
        try:
            assert not record.etcd_url.endswith(f":{taken}") and record.etcd_url.startswith("http://127.0.0.1:")
            assert "address already in use" in (directory / "etcd.log").read_text(), "the first etcd found it taken"
            info = local.status(directory)
            assert info["etcd"]["alive"] and all(n["alive"] and n["registered"] for n in info["nodes"]), info
        finally:
            local.down(directory)


def _start_fake_etcd(tmp_path: Path, script: str, timeout: float = 30.0) -> tuple[object, int]:
    """:func:`cluster.local._spawn_etcd_on_free_ports` with a stand-in for etcd that runs ``script``."""
    return local._spawn_etcd_on_free_ports(  # noqa: SLF001 - the start's own failure handling
        lambda client, peer: [sys.executable, "-c", script], tmp_path / "etcd.log", tmp_path / "data", timeout)


def test_an_etcd_that_exits_for_another_reason_is_not_started_again(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited with 3 \(attempt 1 of 5\):\n.*unknown flag"):
        _start_fake_etcd(tmp_path, "import sys; print('unknown flag: --bogus', flush=True); sys.exit(3)")


def test_an_etcd_that_finds_every_pick_taken_gives_up_after_its_attempts(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(RuntimeError, match=r"exited with 1 \(attempt 5 of 5\)"):
        _start_fake_etcd(tmp_path, "print('listen tcp: bind: address already in use', flush=True); raise SystemExit(1)")
    assert (tmp_path / "etcd.log").read_text().count("address already in use") == local.ETCD_PORT_ATTEMPTS
    assert not (tmp_path / "data").exists(), "each retry starts on a fresh data directory"


def test_an_etcd_that_never_listens_is_stopped_and_said_so(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    script = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(RuntimeError, match=r"did not listen on ports \d+ and \d+ within 1s"):
        _start_fake_etcd(tmp_path, script, timeout=1.0)
    assert not pid_alive(int(marker.read_text())), "the process that never listened is stopped"
