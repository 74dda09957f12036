"""``scripts/probe_instructions.py`` in a short run: both sides counted under callgrind, and nothing left running."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.scripts.script_run import outcome, run_script

SCRIPT = "probe_instructions.py"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("path", "blocks", "sides"), [("local", 1, "both"), ("listener", 1, "both"),
                                                       ("local", 4, "node")])  # (a batch load: the node's side)
def test_the_instruction_probe_counts_the_node_and_the_client_per_load(tmp_path, path: str, blocks: int,
                                                                      sides: str) -> None:
    assert shutil.which("valgrind"), "valgrind is not installed (.ci/run and scripts/run.sh setup install it)"
    out = tmp_path / "counts.json"
    proc = run_script(SCRIPT, "--ops", "20", "--warmup", "20", "--block-size", "16KiB", "--top", "3",
                      "--path", path, "--blocks", str(blocks), "--side", sides, "--json", str(out), timeout=580,
                      env={"TMPDIR": str(tmp_path)})  # (its work, and so its processes' command lines, under tmp_path)
    assert proc.returncode == 0, outcome(proc)
    written = json.loads(out.read_text())
    assert written["path"] == path and f"{path} path" in proc.stdout and written["blocks"] == blocks
    assert ("one-block loads" if blocks == 1 else f"loads of {blocks} blocks") in proc.stdout
    counts = written["instructions_per_op"]
    counted = ("node", "client") if sides == "both" else (sides,)
    assert set(counts) == set(counted)
    for side in counted:
        line = re.search(rf"^{side}\s+([0-9,]+) instructions per op", proc.stdout, re.M)
        assert line is not None, proc.stdout
        assert int(line.group(1).replace(",", "")) == counts[side]
        # an op is a leased lookup round trip and a checked copy: tens of thousands of instructions at least,
        # and not millions (a count that took in the start-up or the warm-up)
        assert 20_000 < counts[side] < 3_000_000, counts
    assert len(re.findall(r"^\s+[0-9,]+ \(\s*[0-9.]+%\)\s+\S+:\S+", proc.stdout, re.M)) == 3 * len(counted), proc.stdout
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True,  # nodes too
                              check=False)
    assert leftover.stdout.strip() == "", f"processes left running: {leftover.stdout}"


def test_the_instruction_probe_refuses_no_ops() -> None:
    proc = run_script(SCRIPT, "--ops", "0", timeout=60)
    assert proc.returncode == 2 and "--ops >= 1" in proc.stderr


@pytest.mark.parametrize("blocks", ["0", "4097"])
def test_the_instruction_probe_refuses_a_batch_out_of_bounds(blocks: str) -> None:
    proc = run_script(SCRIPT, "--blocks", blocks, timeout=60)
    assert proc.returncode == 2 and "--blocks in [1, 4096]" in proc.stderr


def test_the_instruction_probe_refuses_a_batch_its_pool_cannot_hold() -> None:
    proc = run_script(SCRIPT, "--blocks", "1024", "--block-size", "64KiB", timeout=60)
    assert proc.returncode == 2 and "half the probe's pool" in proc.stderr
