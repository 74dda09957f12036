"""``scripts/soak.py`` for one minute: faults happen, every loaded byte is right, nothing hangs, nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.process import pid_alive

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "soak.py"


def _soak(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run the soak for one minute; its process and report, once it is clean (no wrong byte, hang or crash)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--minutes", "1", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=160, check=False, stdin=subprocess.DEVNULL,
                          env={**os.environ, "COLUMNS": "160"})
    report = out / "soak.json"
    assert report.exists(), f"no report; exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    doc = json.loads(report.read_text())
    totals = doc["totals"]
    assert totals["wrong_bytes"] == 0, doc["incidents"]["wrong_bytes"]
    assert totals["hangs"] == 0, doc["incidents"]["hangs"]
    assert doc["crashes"] == [], doc["crashes"]
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc, doc


@pytest.mark.timeout(170)
def test_a_one_minute_soak_with_node_kills_and_an_etcd_restart_loads_only_right_bytes_and_never_hangs(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc, doc = _soak(out)
    totals = doc["totals"]

    kinds = [e["kind"] for e in doc["events"]]
    assert doc["kills"] >= 1 and doc["restarts"] >= 1, doc["events"]
    assert kinds.index("node_restart") > kinds.index("node_kill")
    assert doc["etcd_restarts"] >= 1, doc["events"]
    assert totals["requests"] > 0 and totals["hits"] > 0, totals
    assert totals["bytes_checked"] > 0
    for kind in ("offload", "load_local", "load_hint", "lookup_sync"):
        assert doc["by_kind"][kind]["requests"] > 0, kind
    assert any(source.startswith("hint:") for source in doc["by_kind"]["load_hint"]["sources"]), \
        "no load went through a router hint"
    assert {n for n in doc["rss"]} >= {"client-0", "client-1", "client-2", "node-a", "node-b", "node-c"}
    assert all(s[1] > 0 for samples in doc["rss"].values() for s in samples[:1])

    png = out / "soak.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrong bytes" in proc.stdout and "client-0" in proc.stdout  # the table was printed

    started = [*doc["pids"]["etcd"], *doc["pids"]["nodes"], *doc["pids"]["workers"]]
    assert len(doc["pids"]["workers"]) == 3 and len(doc["pids"]["nodes"]) >= 4 and len(doc["pids"]["etcd"]) >= 2
    assert doc["pids_left"] == []
    assert not [p for p in started if pid_alive(p)], "processes the soak started are still running"


@pytest.mark.timeout(170)
def test_a_soak_over_the_listeners_loads_from_the_blocks_lookups_bring_and_only_right_bytes(tmp_path: Path) -> None:
    _, doc = _soak(tmp_path / "out", "--listener")
    assert doc["kills"] >= 1 and doc["totals"]["bytes_checked"] > 0
    counters = [client["connector"] for client in doc["clients"]]
    assert all(c["loads_in_place"] > 0 for c in counters), counters  # copied from bytes a lookup's answer brought
