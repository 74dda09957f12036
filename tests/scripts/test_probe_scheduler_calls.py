"""``scripts/probe_scheduler_calls.py`` in a short run: both calls timed, split, and the collector's share counted."""

from __future__ import annotations

import re

import pytest

from tests.scripts.script_run import outcome, run_script

SCRIPT = "probe_scheduler_calls.py"


@pytest.mark.timeout(120)
def test_the_scheduler_call_probe_times_both_calls_beside_a_background_load_and_splits_the_slow_ones() -> None:
    # a bound of 0 µs makes every call a slow one: each must then be put in exactly one kind
    proc = run_script(SCRIPT, "--calls", "20", "--call-blocks", "8", "--bg-blocks", "8", "--bg-size", "64KiB",
                      "--slow-us", "0", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert re.search(r"^scheduler-thread calls, 8 x 16\.0 KiB, 20 each, while 8 x 64\.0 KiB same-host loads run "
                     r"\((\d+) loads, [0-9.]+ GB/s\)", proc.stdout, re.M), proc.stdout
    for name in ("load()", "load_lookup()"):
        line = re.search(rf"^\s+{re.escape(name)}\s+p50\s+([0-9.]+) µs\s+p99\s+([0-9.]+) µs\s+over 0 µs: (\d+) "
                         r"\(run queue (\d+), GC (\d+), on CPU (\d+)\)$", proc.stdout, re.M)
        assert line is not None, (name, proc.stdout)
        p50, p99, over, *kinds = (float(line.group(1)), float(line.group(2)), *map(int, line.groups()[2:]))
        assert 0 < p50 <= p99 and over == 20 and sum(kinds) == over, line.group(0)
    assert re.search(r"^\s+GC on this thread during the calls: \d+ collections \(.+\), [0-9.]+ ms$", proc.stdout,
                     re.M), proc.stdout


@pytest.mark.timeout(120)
def test_the_scheduler_call_probe_loads_over_the_listener_in_the_background_when_asked() -> None:
    proc = run_script(SCRIPT, "--calls", "10", "--call-blocks", "8", "--bg-blocks", "8", "--bg-size", "64KiB",
                      "--bg-listener", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    found = re.search(r"^scheduler-thread calls, 8 x 16\.0 KiB, 10 each, while 8 x 64\.0 KiB listener loads run "
                      r"\((\d+) loads, ", proc.stdout, re.M)
    assert found is not None and int(found.group(1)) >= 1, proc.stdout


def test_the_scheduler_call_probe_refuses_a_call_count_under_one() -> None:
    proc = run_script(SCRIPT, "--calls", "0", timeout=60)
    assert proc.returncode == 2 and "--calls" in proc.stderr
