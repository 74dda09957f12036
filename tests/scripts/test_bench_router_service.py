"""``scripts/bench_router_service.py`` end to end in a short run: it runs and reports every layer of every case."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_router_service.py"


@pytest.mark.timeout(120)
def test_bench_router_service_reports_every_layer_of_every_case(tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--repeat", "5", "--warmup", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=110, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    doc = json.loads(out.read_text())
    assert set(doc["cases"]) == {f"{n} {case}" for n in (1024, 8192) for case in ("full hit", "half hit", "miss")} | {
        "batch 8 x 1024 full hit"}
    for name, case in doc["cases"].items():
        for layer in ("router_route", "handler", "http"):
            for stat in ("p50_us", "p99_us"):
                value = case[layer][stat]
                assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, layer, stat, value)
    assert "Router.route" in proc.stdout and "HTTP end to end" in proc.stdout
