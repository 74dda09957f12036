"""``scripts/probe_control_floor.py`` in a short run: every layer is measured and every process it started is gone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "probe_control_floor.py"


@pytest.mark.timeout(120)
def test_the_control_floor_probe_reports_each_layer() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--hashes", "4", "--samples", "20", "--rounds", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=110, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert "node lookup of 4 hash(es)" in proc.stdout
    for name in ("socket", "direct", "direct+uvloop", "node lookup"):
        line = re.search(rf"^\s+{re.escape(name)}\s+p50\s+([0-9.]+) µs\s+p99\s+([0-9.]+) µs", proc.stdout, re.M)
        assert line is not None, (name, proc.stdout)
        assert 0 < float(line.group(1)) <= float(line.group(2))
    leftover = subprocess.run(["pgrep", "-f", f"{SCRIPT.name} --serve"], capture_output=True, text=True, check=False)
    assert leftover.stdout.strip() == "", f"servers left running: {leftover.stdout}"


def test_the_control_floor_probe_refuses_a_hash_count_out_of_range() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--hashes", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "--hashes in [1, 1024]" in proc.stderr
