"""``scripts/probe_lookup_split.py`` in a short run: it measures every contender and leaves no node behind."""

from __future__ import annotations

import re

import pytest

from tests.scripts.script_run import outcome, run_script

SCRIPT = "probe_lookup_split.py"


@pytest.mark.timeout(120)
def test_the_lookup_split_probe_reports_both_connector_paths_both_raw_clients_and_the_hop() -> None:
    proc = run_script(SCRIPT, "--hashes", "4", "--samples", "5", "--rounds", "2", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert "leased lookup of 4 hash(es)" in proc.stdout
    for name in ("connector", "conn_loop", "raw_on_loop", "raw_direct", "hop"):
        line = re.search(rf"^\s+{name}\s+p50\s+([0-9.]+) µs\s+p99\s+([0-9.]+) µs$", proc.stdout, re.M)
        assert line is not None, proc.stdout
        assert 0 < float(line.group(1)) <= float(line.group(2))
    assert "the connector adds (p50)" in proc.stdout and "around the round trip in place" in proc.stdout
    assert "ran in place" not in proc.stdout  # every timed connector lookup took the direct channel


def test_the_lookup_split_probe_refuses_a_hash_count_out_of_range() -> None:
    proc = run_script(SCRIPT, "--hashes", "0", timeout=60)
    assert proc.returncode == 2 and "--hashes in [1, 4096]" in proc.stderr
