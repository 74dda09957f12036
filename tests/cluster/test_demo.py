"""The demo's parts: the workload plan, the report's arithmetic, the engine process's protocol, and an
interrupted run that leaves no process behind. (The whole demo runs in test_local_cluster.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.demo import DemoConfig, plan_workload
from cluster.demo_report import RequestRecord, summarize
from cluster.process import pid_alive
from connector.engine.model import ModelConfig


def test_the_workload_plan_is_the_same_for_a_seed_balanced_per_turn_and_moves_conversations() -> None:
    config = DemoConfig()
    plan = plan_workload(config)
    assert plan == plan_workload(config)
    assert plan != plan_workload(DemoConfig(seed=1))
    assert len(plan) == config.conversations and all(len(turns) == config.turns for turns in plan)
    for turn in range(config.turns):
        load = [sum(1 for turns in plan if turns[turn].engine == e) for e in range(config.engines)]
        assert max(load) - min(load) <= 2, (turn, load)  # the seed's plan: within one or two requests
    moves = sum(a.engine != b.engine for turns in plan for a, b in zip(turns, turns[1:]))
    stays = sum(a.engine == b.engine for turns in plan for a, b in zip(turns, turns[1:]))
    assert moves > 0 and stays > 0
    assert [turns[0].think for turns in plan] == [c * config.stagger for c in range(config.conversations)]
    low, high = config.think
    assert all(low <= t.think <= high for turns in plan for t in turns[1:])
    assert all(len(t.user) == config.user_tokens and all(0 <= x < config.model.vocab for x in t.user)
               for turns in plan for t in turns)


def _record(configuration: str, ttft: float, device: int, local: int, peer: int, computed: int,
            hint: str = "none", exact: bool | None = True, loaded: int = 0, load_s: float = 0.0,
            prefill: float = 0.1) -> RequestRecord:
    return RequestRecord(configuration, 0, 0, 0, 0.0, ttft, device + local + peer + computed, device, local, peer,
                         computed, loaded, load_s, prefill, hint, None, 0, 0, exact)


def test_the_summary_splits_blocks_compares_dkv_with_the_device_baseline_and_counts_hints() -> None:
    records = {
        "recompute": [_record("recompute", 1.0, 0, 0, 0, 10, exact=None, prefill=1.0),
                      _record("recompute", 3.0, 0, 0, 0, 10, exact=None, prefill=1.0)],
        "device": [_record("device", 0.4, 6, 0, 0, 4), _record("device", 0.8, 6, 0, 0, 4)],
        "dkv": [_record("dkv", 0.2, 6, 2, 0, 2, loaded=2 << 20, load_s=0.002),
                _record("dkv", 0.4, 6, 0, 3, 1, hint="used", loaded=3 << 20, load_s=0.003)],
    }
    summary = summarize(ModelConfig(), 4, records, {"recompute": 4.0, "device": 2.0, "dkv": 1.0})
    per = summary["configurations"]
    assert per["dkv"]["split"] == {"device": 0.6, "co-located node": 0.1, "peer (hint)": 0.15, "recomputed": 0.15}
    assert per["dkv"]["hints"] == {"none": 1, "used": 1}
    assert per["dkv"]["load_gbps"] == pytest.approx((5 << 20) / 0.005 / 1e9)
    assert per["device"]["bytes_loaded"] == 0 and per["device"]["load_gbps"] == 0.0
    assert per["recompute"]["bit_exact"] is None and per["dkv"]["bit_exact"] is True
    head = summary["headline"]
    assert head["ttft_p50_speedup"] == pytest.approx(0.6 / 0.3)
    assert (head["recomputed_blocks_baseline"], head["recomputed_blocks_dkv"]) == (8, 3)
    assert head["recompute_avoided"] == pytest.approx(1 - 3 / 8)
    assert summary["block_costs"]["recompute_ms_per_block"] == pytest.approx(100.0)
    assert summary["block_costs"]["load_ms_per_block"] == pytest.approx(1.0)
    assert summary["bit_exact"] is True
    records["dkv"][1].bit_exact = False
    assert summarize(ModelConfig(), 4, records, {"recompute": 4.0, "device": 2.0, "dkv": 1.0})["bit_exact"] is False


def _engine() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "cluster.demo_engine"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ask(proc: subprocess.Popen[bytes], message: dict) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


@pytest.mark.timeout(120)
def test_the_engine_process_says_what_was_wrong_with_a_request_and_goes_on_serving() -> None:
    settings = {"model": {"window_layers": [1, 3], "sliding_window": 8, "seed": 1}, "block_size": 4,
                "num_pages": 24, "prefix_caching": True, "dkv": None}
    proc = _engine()
    try:
        assert "error" in _ask(proc, {"id": "early", "prompt": [1, 2, 3], "new_tokens": 2, "hint": None})
        ready = _ask(proc, {"settings": settings})
        assert ready == {"ready": True, "pid": proc.pid}
        bad = _ask(proc, {"id": "bad", "prompt": [10_000], "new_tokens": 2, "hint": None})
        assert bad["id"] == "bad" and "vocabulary" in bad["error"]
        prompt = list(range(1, 18))
        first = _ask(proc, {"id": "a", "prompt": prompt, "new_tokens": 3, "hint": None})
        assert (first["id"], first["prompt_blocks"], first["device_hit_blocks"], first["hint"]) == ("a", 4, 0, "none")
        assert len(first["tokens"]) == 3 and first["first_token"] >= first["started"]
        again = _ask(proc, {"id": "b", "prompt": prompt, "new_tokens": 3, "hint": None})
        assert again["device_hit_blocks"] == 4  # its own device prefix cache
        assert (again["tokens"], again["logits_sha256"]) == (first["tokens"], first["logits_sha256"])
        # a fresh engine for the next configuration: nothing carries over
        assert _ask(proc, {"settings": {**settings, "prefix_caching": False}})["ready"] is True
        cold = _ask(proc, {"id": "c", "prompt": prompt, "new_tokens": 3, "hint": None})
        assert cold["device_hit_blocks"] == 0 and cold["logits_sha256"] == first["logits_sha256"]
        assert proc.stdin is not None
        proc.stdin.close()  # EOF: the engine drains and exits
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.timeout(240)
def test_a_demo_stopped_mid_run_stops_its_engines_nodes_and_etcd(tmp_path: Path) -> None:
    demo = subprocess.Popen([sys.executable, "-m", "dkv.cli", "demo", "--small", "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and demo.poll() is None:
            started |= _descendants(demo.pid)
            engines = [p for p in started if "cluster.demo_engine" in _cmdline(p)]
            nodes = [p for p in started if " serve " in _cmdline(p)]
            if len(engines) == 3 and len(nodes) == 3:
                break
            time.sleep(0.2)
        assert demo.poll() is None, "the demo ended before its engines were seen"
        assert len(engines) == 3 and len(nodes) == 3, [_cmdline(p) for p in started]
        time.sleep(1.0)  # into the run
        started |= _descendants(demo.pid)
        os.kill(demo.pid, signal.SIGTERM)  # as a supervisor stops it (Ctrl-C takes the same path)
        demo.wait(120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    left = [p for p in started if pid_alive(p)]
    assert left == [], [_cmdline(p) for p in left]
    assert not (tmp_path / "out" / "report.json").exists()
