"""``scripts/fuzz.py`` with a tiny budget: one round of one fuzz file under the long profile, then its summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(110)
def test_the_fuzz_script_runs_a_round_under_the_long_profile_and_summarises_it() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz.py"), "--minutes", "0.01", "--scale", "1",
                           "--files", "tests/dkv/test_store_fuzz.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=100, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "round 1: seed " in proc.stdout and "passed" in proc.stdout
    assert "summary: 1 round(s), 1 passed, 0 failed, 0 cut short" in proc.stdout, proc.stdout
