"""``scripts/probe_listener_cpu.py`` in a short run: three contenders, their wall and CPU on both ends."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

from tests.scripts.script_run import outcome, run_script

SCRIPT = "probe_listener_cpu.py"
CONTENDERS = ("dkv checked", "dkv unchecked", "tcp stream")


@pytest.mark.timeout(120)
def test_the_listener_cpu_probe_reports_wall_and_cpu_on_both_ends_for_each_contender() -> None:
    workdirs = set(Path(tempfile.gettempdir()).glob("dkv-probe-cpu-*"))
    proc = run_script(SCRIPT, "--blocks", "16", "--block-size", "64KiB", "--rounds", "2", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert set(Path(tempfile.gettempdir()).glob("dkv-probe-cpu-*")) <= workdirs, "its work directory is removed"
    assert "listener load of 16 x 64.0 KiB (1.0 MiB), 2 rounds" in proc.stdout, proc.stdout
    for name in CONTENDERS:
        row = re.search(rf"^\s+{re.escape(name)}\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$",
                        proc.stdout, re.M)
        assert row is not None, (name, proc.stdout)
        wall_ms, gbps, cpu_here, cpu_server, _busy = map(float, row.groups())
        # every contender moved its bytes, and both ends spent CPU on it (schedstat: ns, never a whole tick)
        assert wall_ms > 0 and gbps > 0 and cpu_here > 0 and cpu_server > 0, (name, proc.stdout)
        assert re.search(rf"^\s+{re.escape(name)}\s+here\s+(\d+%|-)\s+server\s+(\d+%|-)$", proc.stdout, re.M), \
            (name, proc.stdout)
    assert re.search(r"the checks: -?[0-9.]+ ms of CPU here per load; checked / tcp stream [0-9.]+, "
                     r"unchecked / tcp stream [0-9.]+", proc.stdout), proc.stdout


@pytest.mark.timeout(120)
def test_the_listener_cpu_probe_pauses_before_each_contender_when_asked() -> None:
    proc = run_script(SCRIPT, "--blocks", "16", "--block-size", "64KiB", "--rounds", "2", "--pause", "idle",
                      timeout=110)
    assert proc.returncode == 0, outcome(proc)
    found = re.search(r"^\s+each contender timed after a pause \(idle\): ([0-9.]+) ms asleep \(median\)$",
                      proc.stdout, re.M)
    assert found is not None and float(found.group(1)) >= 40.0, proc.stdout  # (the pause was taken, not only named)


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pin needs two CPUs (it refuses otherwise)")
def test_the_listener_cpu_probe_pins_the_servers_apart_from_the_reader_when_asked() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    proc = run_script(SCRIPT, "--blocks", "16", "--block-size", "64KiB", "--rounds", "2", "--pin", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    found = re.search(r"^\s+pinned: the node on CPU (\S+), the TCP helper on CPU (\S+), this process on CPU (\S+) "
                      r"\(as read back\)$", proc.stdout, re.M)
    assert found is not None, proc.stdout
    node, helper, here = found.groups()
    assert node == helper == str(cpus[-1]), proc.stdout  # the kernel's own read-back, not what was asked
    assert str(cpus[-1]) not in here.replace("-", ",").split(","), proc.stdout
    assert re.search(r"^\s+dkv checked\s+[0-9.]+", proc.stdout, re.M), proc.stdout


def test_the_listener_cpu_probe_refuses_a_block_size_that_is_not_whole_pages() -> None:
    proc = run_script(SCRIPT, "--block-size", "1000", timeout=60)
    assert proc.returncode == 2 and "multiple of 4 KiB" in proc.stderr
