"""``scripts/probe_control_floor.py`` in a short run: every layer is measured and every process it started is gone."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.scripts.script_run import outcome, run_script

SCRIPT = "probe_control_floor.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause", ["none", "memcpy"])
def test_the_control_floor_probe_reports_each_layer_back_to_back_or_after_a_pause(pause: str) -> None:
    proc = run_script(SCRIPT, "--hashes", "4", "--samples", "20", "--rounds", "2", "--pause", pause,
                      "--block-size", "16KiB", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert "lookups of 4 hash(es), one-block load of 16KiB" in proc.stdout
    assert f"each after a pause: {pause}" in proc.stdout
    for name in ("socket", "direct", "direct+uvloop", "node lookup", "connector lookup", "one-block load"):
        line = re.search(rf"^\s+{re.escape(name)}\s+p50\s+([0-9.]+) µs\s+p99\s+([0-9.]+) µs", proc.stdout, re.M)
        assert line is not None, (name, proc.stdout)
        assert 0 < float(line.group(1)) <= float(line.group(2))
    leftover = subprocess.run(["pgrep", "-f", f"{SCRIPT} --serve"], capture_output=True, text=True, check=False)
    assert leftover.stdout.strip() == "", f"servers left running: {leftover.stdout}"


def test_the_control_floor_probe_refuses_a_hash_count_out_of_range() -> None:
    proc = run_script(SCRIPT, "--hashes", "0", timeout=60)
    assert proc.returncode == 2 and "--hashes in [1, 1024]" in proc.stderr
