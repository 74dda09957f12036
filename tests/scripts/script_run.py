"""Running one of ``scripts/`` as a user would, for the scripts' tests: a subprocess in the project root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, timeout: float = 110,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python scripts/<name> <args>`` from the project root, its output captured, bounded by ``timeout`` seconds.

    ``env``: variables set for it on top of this process's.
    """
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL,
                          env=None if env is None else {**os.environ, **env})


def outcome(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed run printed: the exit status and the tails of both streams."""
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
