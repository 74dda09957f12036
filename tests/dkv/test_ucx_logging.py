"""UCX's own log lines follow dKV's log level: a failed connect prints dKV's message, not UCX's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

UCX_LOG_VARIABLES = ("UCX_LOG_LEVEL", "UCXX_LOG_LEVEL", "UCXPY_LOG_LEVEL", "DKV_LOG_LEVEL")
UCX_LINE_MARKS = ("UCXX ERROR", "UCX  ERROR", "UCXPY  ERROR")


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stats_of_nothing(**env: str) -> subprocess.CompletedProcess[str]:
    """``dkv stats`` against a closed port, with only ``env`` of the UCX log settings."""
    clean = {k: v for k, v in os.environ.items() if k not in UCX_LOG_VARIABLES}
    address = f"127.0.0.1:{_closed_port()}"
    return subprocess.run([sys.executable, "-m", "dkv.cli", "stats", address, "--timeout", "2"],
                          capture_output=True, text=True, timeout=60, env={**clean, **env})


def test_a_failed_connect_prints_dkvs_message_and_no_ucx_error_line() -> None:
    done = _stats_of_nothing()
    assert done.returncode == 2, done
    assert "error:" in done.stderr and "127.0.0.1:" in done.stderr, done.stderr
    # UCX writes its lines to stdout (UCX_LOG_FILE's default): either stream reaches the terminal
    leaked = [line for line in (done.stdout + done.stderr).splitlines() if any(mark in line for mark in UCX_LINE_MARKS)]
    assert not leaked, f"UCX's own lines reached the terminal:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("env", [{"DKV_LOG_LEVEL": "debug"}, {"UCXX_LOG_LEVEL": "error"}],
                         ids=["dkv-debug", "operator-ucxx-level"])
def test_ucxs_own_lines_appear_at_debug_level_or_when_the_operator_asks(env: dict[str, str]) -> None:
    done = _stats_of_nothing(**env)
    assert done.returncode == 2, done
    assert "UCXX ERROR" in done.stdout + done.stderr, done
    assert "error:" in done.stderr, done.stderr
