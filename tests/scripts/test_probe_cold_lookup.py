"""``scripts/probe_cold_lookup.py`` in a short run: three contenders, the whole lookup and its steps for each."""

from __future__ import annotations

import re

import pytest

from tests.scripts.script_run import outcome, run_script

SCRIPT = "probe_cold_lookup.py"
CONTENDERS = ("back to back", "asleep", "evicted")


@pytest.mark.timeout(120)
def test_the_cold_lookup_probe_times_each_contender_and_its_steps_on_the_calling_thread() -> None:
    proc = run_script(SCRIPT, "--hashes", "16", "--samples", "3", "--rounds", "2", "--sleep-ms", "1",
                      "--evict-mib", "4", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert "leased lookup of 16 hashes on the listener path" in proc.stdout, proc.stdout
    assert re.search(r"contender\s+lookup\(\)\s+exchange\s+request built\s+answer taken", proc.stdout), proc.stdout
    for name in CONTENDERS:
        row = re.search(rf"^\s+{re.escape(name)}\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$",
                        proc.stdout, re.M)
        assert row is not None, (name, proc.stdout)
        whole, exchange, request, answer, ratio = map(float, row.groups())
        # each step ran inside the lookup it is part of, and took time
        assert 0 < request < whole and 0 < answer < whole and 0 < exchange < whole and ratio > 0, (name, proc.stdout)
    assert re.search(r"^\s+back to back(\s+[0-9.]+){4}\s+1\.00$", proc.stdout, re.M), proc.stdout
    timed = re.search(r"on the calling thread: (\d+) of (\d+) timed lookups", proc.stdout)
    assert timed is not None and timed.group(1) == timed.group(2) == str(len(CONTENDERS) * 3 * 2), proc.stdout


def test_the_cold_lookup_probe_refuses_a_bad_size() -> None:
    proc = run_script(SCRIPT, "--hashes", "0", timeout=60)
    assert proc.returncode == 2 and "--hashes in [1, 1024]" in proc.stderr, outcome(proc)
