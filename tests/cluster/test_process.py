"""Node processes: a node started with ``exit_with_parent`` never outlives the process that started it;
a child's lines are read off its descriptor, none missed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.process import FdLines

ROOT = Path(__file__).resolve().parents[2]
BOUND = 60.0

PARENT = """
import json, sys, time
from cluster.process import start_node
node = start_node(pool="16MiB", exit_with_parent=True)
print(json.dumps({"pid": node.pid, "shm": node.ready["shm"]}), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_node_started_with_exit_with_parent_stops_gracefully_when_its_starter_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    node_pid = None
    try:
        line = parent.stdout.readline()  # the starter prints once its node serves
        started = json.loads(line)
        node_pid = started["pid"]
        assert _running(node_pid)
        parent.send_signal(signal.SIGKILL)  # no chance to stop its node
        parent.wait(BOUND)
        deadline = time.monotonic() + BOUND
        while _running(node_pid):
            assert time.monotonic() < deadline, "the node outlived the process that started it"
            time.sleep(0.1)
        assert not Path("/dev/shm", started["shm"]).exists(), "the node stopped gracefully: its arena is gone"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(BOUND)
        if node_pid is not None and _running(node_pid):
            os.kill(node_pid, signal.SIGKILL)


def test_lines_that_arrive_in_one_chunk_are_each_returned_without_waiting() -> None:
    """A log line and the ready line in one write: the second must not wait for more input (a select on a
    buffered reader that had read both would wait for ever)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"warning: etcd is slow\n{\"address\": \"127.0.0.1:1\"}\npart")
        lines = FdLines(read_end)
        assert lines.next(BOUND) == b"warning: etcd is slow"
        assert lines.next(0.0) == b'{"address": "127.0.0.1:1"}', "the line already read must come without a wait"
        assert lines.next(0.05) is None, "a partial line is not a line"
        os.write(write_end, b"ial\nlast")
        assert lines.next(BOUND) == b"partial"
        os.close(write_end)
        write_end = -1
        assert lines.next(BOUND) == b"last" and lines.next(BOUND) == b"", "EOF: what is left, then b''"
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def test_a_line_past_its_bound_is_refused() -> None:
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"x" * 64)
        with pytest.raises(ValueError, match="over 16 bytes"):
            FdLines(read_end, max_line=16).next(BOUND)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_listening_on_sees_only_the_process_own_listening_sockets() -> None:
    import socket

    from cluster.process import listening_on

    mine, bound_only = socket.socket(), socket.socket()
    mine.bind(("127.0.0.1", 0))
    mine.listen(1)
    bound_only.bind(("127.0.0.1", 0))  # bound, not listening
    other = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\n"
                              "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
                              "print(s.getsockname()[1], flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        theirs = int(other.stdout.readline())
        port, idle = mine.getsockname()[1], bound_only.getsockname()[1]
        assert listening_on(os.getpid(), (port,))
        assert not listening_on(os.getpid(), (port, idle)), "a bound socket that does not listen does not count"
        assert not listening_on(os.getpid(), (theirs,)), "another process's listener is not this one's"
        assert listening_on(other.pid, (theirs,))
    finally:
        other.kill()
        other.wait(10)
        mine.close()
        bound_only.close()
    assert not listening_on(other.pid, (theirs,)), "a process that is gone listens on nothing"
