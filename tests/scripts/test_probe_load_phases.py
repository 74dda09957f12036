"""``scripts/probe_load_phases.py`` in a short run: it checks and splits the load and times both limits."""

from __future__ import annotations

import re

import pytest

from tests.scripts.script_run import outcome, run_script

SCRIPT = "probe_load_phases.py"


@pytest.mark.timeout(120)
def test_the_load_phase_probe_reports_the_limits_the_phases_and_both_same_host_paths_split() -> None:
    # 32 x 16 KiB: over the bound of a load copied in place, so the load goes to the copy threads;
    # --loop-path times it posted to the loop thread as well, --busy-caller with the caller running Python
    proc = run_script(SCRIPT, "--blocks", "32", "--block-size", "16KiB", "--rounds", "2", "--loop-path",
                      "--busy-caller", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert "same-host load of 32 x 16.0 KiB, 2 rounds" in proc.stdout
    assert "switch interval 0.5 ms" in proc.stdout, "the connector's GIL switch interval, while it lives"
    for name in ("memcpy", "copy+checksum", "lookup (start_lookup -> complete)", "whole load",
                 "whole load, posted to the loop thread", "lookup, the caller busy in Python",
                 "load, the caller busy in Python"):
        line = re.search(rf"^\s+{re.escape(name)}\s+([0-9.]+)\s+([0-9.]+) x memcpy$", proc.stdout, re.M)
        assert line is not None, (name, proc.stdout)
        assert float(line.group(1)) > 0
    # the copy made from the slot map on the calling thread; the loop path's keyed plan and copy (512 KiB:
    # copied on the loop thread itself)
    # the handles' lookups sent in place and their answers judged once whole (the direct channel opens in the
    # warm-up)
    for label in ("NodeClient.start_lookup_direct", "NodeClient._direct_answer", "LeaseSlots.rows_copy", "LeaseSlots._plan", "LeaseSlots._copy_and_verify",
                  "NodeClient.read", "WorkerSide._read"):
        line = re.search(rf"^\s+{re.escape(label)}\s+([0-9.]+)\s+\((\d+) calls\)$", proc.stdout, re.M)
        assert line is not None, (label, proc.stdout)
        assert float(line.group(1)) > 0 and int(line.group(2)) >= 2  # the same-host paths ran, every round
    assert re.search(r"load / memcpy [0-9.]+; at most [0-9.]+ for a checked copy", proc.stdout), proc.stdout


def test_the_load_phase_probe_refuses_a_block_size_that_is_not_whole_pages() -> None:
    proc = run_script(SCRIPT, "--block-size", "1000", timeout=60)
    assert proc.returncode == 2 and "multiple of 4 KiB" in proc.stderr


def test_the_load_phase_probe_refuses_the_loop_path_over_the_listener() -> None:
    proc = run_script(SCRIPT, "--listener", "--loop-path", timeout=60)
    assert proc.returncode == 2 and "--loop-path" in proc.stderr


@pytest.mark.timeout(120)
def test_the_load_phase_probe_can_leave_cpythons_switch_interval_for_the_before_and_after() -> None:
    proc = run_script(SCRIPT, "--listener", "--blocks", "4", "--block-size", "16KiB", "--rounds", "1", "--busy-caller",
                      "--gil-switch-interval", "off", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert "listener load of 4 x 16.0 KiB" in proc.stdout and "switch interval 5 ms" in proc.stdout, proc.stdout
    for name in ("lookup, the caller busy in Python", "load, the caller busy in Python"):
        assert re.search(rf"^\s+{re.escape(name)}\s+[0-9.]+", proc.stdout, re.M), (name, proc.stdout)


@pytest.mark.timeout(120)
def test_the_load_phase_probe_prints_a_listener_direct_reads_timeline() -> None:
    # 32 x 16 KiB: more than a lookup's answer brings (256 KiB), so the load is read over a direct channel
    # (UCX has no RDMA here) on a read thread, and each step of that read is timed
    proc = run_script(SCRIPT, "--listener", "--blocks", "32", "--block-size", "16KiB", "--rounds", "2", timeout=110)
    assert proc.returncode == 0, outcome(proc)
    assert "listener load of 32 x 16.0 KiB" in proc.stdout, proc.stdout
    heading = re.search(r"^\s+the direct read, from load_lookup's return \((\d+) loads\):$", proc.stdout, re.M)
    assert heading is not None and int(heading.group(1)) >= 1, proc.stdout
    for step in ("to the read thread", "request and the node's answer", "the answer judged", "the blocks received",
                 "completion seen"):
        line = re.search(rf"^\s+{re.escape(step)}\s+([0-9.]+)$", proc.stdout, re.M)
        assert line is not None, (step, proc.stdout)
    line = re.search(r"^\s+NodeClient.read_rows_direct\s+([0-9.]+)\s+\((\d+) calls\)$", proc.stdout, re.M)
    assert line is not None and int(line.group(2)) >= 1, proc.stdout


def test_the_load_phase_probe_refuses_a_garbled_switch_interval() -> None:
    proc = run_script(SCRIPT, "--gil-switch-interval", "fast", timeout=60)
    assert proc.returncode == 2 and "--gil-switch-interval='fast'" in proc.stderr
