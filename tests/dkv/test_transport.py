"""The UCX transport: a peer that answers late never writes into this process's memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_node_that_stops_answering_and_then_answers_late_writes_nothing_into_the_client(node) -> None:
    # in a process of its own, so that a late write into freed memory shows as that process's crash
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("late_answer.py")), str(node.pid),
                           node.address], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}")
    assert node.alive()


def test_a_client_that_stalls_its_handshake_and_then_completes_it_leaves_the_node_serving(node) -> None:
    host, port = node.address.rsplit(":", 1)
    stall = 7.0  # longer than the handshake timeout a listener could have had (CONNECT_TIMEOUT)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("stalled_handshake.py")), host, port,
                           str(stall)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr[-3000:]
    assert node.alive(), "the node must survive a client that answered its handshake late"
    late = subprocess.run([sys.executable, str(Path(__file__).with_name("late_answer.py")), str(node.pid),
                           node.address], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert late.returncode == 0 and late.stdout.strip().endswith("OK"), late.stdout + late.stderr[-3000:]
    assert node.alive()
