"""``scripts/bench.py`` end to end in its tiny mode: it runs, reports every number, draws its charts, leaves nothing."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.process import pid_alive
from tests.ports import first_pick_taken

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench.py"

THROUGHPUT = ("memcpy", "tcp_stream", "ucx_stream", "redis_mget", "redis_pipe_get", "redis_pipe_set",
              "dkv_load_local", "dkv_load_listener", "dkv_offload_local", "dkv_offload_listener")
LATENCY = ("tcp_ping", "ucx_ping", "redis_exists_256", "redis_exists_4096", "dkv_lookup_256", "dkv_lookup_4096",
           "dkv_probe_256", "dkv_probe_4096", "dkv_one_block_local", "dkv_one_block_listener",
           "dkv_one_block_listener_busy", "dkv_one_block_listener_busy_5ms", "dkv_step_lookups_listener_busy")


def _positive(value: object, what: str) -> None:
    assert isinstance(value, float) and math.isfinite(value) and value > 0, f"{what} = {value!r}"


@pytest.mark.timeout(150)
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=140, check=False, stdin=subprocess.DEVNULL,
                          env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    doc = json.loads((out / "bench.json").read_text())

    assert doc["throughput"], "no throughput entry"
    for entry in doc["throughput"]:
        assert set(entry["contenders"]) == set(THROUGHPUT)
        for name, numbers in entry["contenders"].items():
            _positive(numbers["median_gbps"], f"{entry['size_label']} {name} median")
            _positive(numbers["best_gbps"], f"{entry['size_label']} {name} best")
            for run in numbers["runs_gbps"]:
                _positive(run, f"{entry['size_label']} {name} run")
    for name in LATENCY:
        for stat in ("p50_us", "p99_us"):
            _positive(doc["latency"][name][stat], f"{name} {stat}")
    for op in ("load", "load_lookup", "offload"):
        for stat in ("p50_us", "p99_us"):
            _positive(doc["scheduler"][op][stat], f"scheduler {op} {stat}")
        over, queued = doc["scheduler"][op]["over_p99_goal"], doc["scheduler"][op]["over_p99_goal_mostly_queued"]
        assert 0 <= queued <= over <= doc["scheduler"][op]["n"], f"scheduler {op}: slow calls {over}, queued {queued}"
    assert doc["latency"]["switch_interval_s"] == pytest.approx(0.0005), "the connectors' GIL switch interval"
    assert doc["latency"]["step_lookups_in_place"] == 1.0, "a step's lookups did not all go over direct channels"
    assert doc["scheduler"]["background"]["loads_completed"] >= 1
    assert {(s["nodes"], s["path"]) for s in doc["scaling"]} == {(k, p) for k in (1, 2, 3)
                                                                  for p in ("local", "listener")}
    for s in doc["scaling"]:
        _positive(s["median_gbps"], f"scaling {s['nodes']} {s['path']}")
    assert {r["node"] for r in doc["rss"]} == {"a", "b", "c"}
    for r in doc["rss"]:
        assert r["max_rss_bytes"] > 0 and r["pool_bytes"] > 0
    for ratios in doc["ratios"].values():
        if isinstance(ratios, dict):
            per_round = ratios.pop("per_round")
            assert set(per_round) == {"local_load_vs_memcpy", "listener_load_vs_tcp_stream"}
            for name, value in (*ratios.items(), *per_round.items()):
                _positive(value, f"ratio {name}")
    assert doc["targets"] and all(isinstance(t["pass"], bool) for t in doc["targets"])
    assert all(doc["verified"].values()), doc["verified"]

    for chart in ("throughput.png", "latency.png", "scaling.png"):
        path = out / chart
        assert path.stat().st_size > 1000, f"{chart} is empty"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    pids = doc["pids"]
    started = [pids["etcd"], pids["redis"], pids["helper"], *pids["nodes"].values(), *pids["engines"]]
    assert len(started) == 9 and all(isinstance(p, int) for p in started)
    assert doc["pids_left"] == []
    assert not [p for p in started if pid_alive(p)], "processes the benchmark started are still running"
    assert "dKV load, same-host" in proc.stdout  # the table was printed


@pytest.mark.timeout(60)
def test_the_bench_starts_redis_on_another_port_when_the_one_it_picked_was_taken_first(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    bench = importlib.import_module("bench")
    procs = bench.Procs(tmp_path)
    try:
        with first_pick_taken(monkeypatch, bench) as taken:
            procs.start_redis()
            assert procs.redis_port != taken and "already in use" in (tmp_path / "redis" / "redis.log").read_text()
            assert pid_alive(procs.redis.pid)
            client = bench.RedisBench(procs.redis_port)  # the server the bench measures is the one it started
            assert client.r.ping()
            client.close()
    finally:
        procs.stop_all()
        sys.modules.pop("bench", None)
