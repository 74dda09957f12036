#!/usr/bin/env python3
"""Run the fuzz tests under the ``long`` hypothesis profile for about ``--minutes`` minutes, then print a summary.

    .venv/bin/python scripts/fuzz.py [--minutes M] [--scale N] [--files F ...]

Each round runs every fuzz test file (``tests/**/test_*_fuzz.py``) once with
``DKV_FUZZ_PROFILE=long`` (``DKV_FUZZ_SCALE`` times each test's CI count of
examples) and a fresh random seed, so rounds explore different inputs. Rounds
go on until the budget is spent; the last is stopped at the deadline (counted
as cut short, not as a failure). A failing round's seed and output are kept:
``pytest ... -p no:cacheprovider --hypothesis-seed=SEED`` with the same
environment reproduces it. Exit status 1 when any round failed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE = 30.0  # a round may run this long past the deadline before it is stopped


@dataclass
class Round:
    seed: int
    seconds: float
    status: str  # "passed", "failed", "cut short"
    summary: str
    output: str = field(repr=False, default="")


def fuzz_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*_fuzz.py"))


def run_round(files: list[str], seed: int, scale: int, deadline: float) -> Round:
    env = {**os.environ, "DKV_FUZZ_PROFILE": "long", "DKV_FUZZ_SCALE": str(scale)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}",
           "-o", "timeout=0", *files]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(1.0, deadline + GRACE - started))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the nodes it started go with it
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        return Round(seed, time.monotonic() - started, "cut short", "stopped at the deadline", output)
    lines = [line for line in output.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else "(no output)"
    return Round(seed, time.monotonic() - started, "passed" if proc.returncode == 0 else "failed", summary, output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    parser.add_argument("--scale", type=int, default=20, help="examples per test, times its CI count (default 20)")
    parser.add_argument("--files", nargs="*", default=None, help="fuzz test files (default: every test_*_fuzz.py)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.scale < 1:
        parser.error("--minutes must be positive and --scale at least 1")
    files = args.files or fuzz_files()
    deadline = time.monotonic() + args.minutes * 60
    rounds: list[Round] = []
    print(f"fuzzing {len(files)} file(s) for {args.minutes:g} min at {args.scale}x the CI examples", flush=True)
    while not rounds or time.monotonic() < deadline:
        seed = random.SystemRandom().randrange(2**32)
        result = run_round(files, seed, args.scale, deadline)
        rounds.append(result)
        print(f"round {len(rounds)}: seed {seed}: {result.status} in {result.seconds:.0f} s: {result.summary}",
              flush=True)
        if result.status == "failed":
            print(result.output[-6000:], flush=True)
        if result.status == "cut short":
            break
    failed = [r for r in rounds if r.status == "failed"]
    passed = sum(r.status == "passed" for r in rounds)
    print(f"summary: {len(rounds)} round(s), {passed} passed, {len(failed)} failed, "
          f"{sum(r.status == 'cut short' for r in rounds)} cut short")
    for r in failed:
        print(f"  failed: seed {r.seed} (DKV_FUZZ_PROFILE=long DKV_FUZZ_SCALE={args.scale} "
              f"pytest -p no:cacheprovider --hypothesis-seed={r.seed} {' '.join(files)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
