"""Library use ends cleanly: a script that used dKV through the README's snippets exits once it is done.

UCX runs threads of its own (progress, and a non-daemon notifier); closing the
last client, or shutting the last connector down, must stop them, or the
interpreter waits for them forever. Each snippet runs in a process of its own
with a bounded wait.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXIT_BOUND = 60.0  # seconds: a script that is done but does not exit is killed after this


def _readme_snippet(heading: str) -> str:
    """The first Python block of the README after ``heading``."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(heading)
    block = re.search(r"```python\n(.*?)```", readme[start:], re.DOTALL)
    assert block, f"no python block after {heading!r} in README.md"
    return block.group(1)


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "snippet.py"
    path.write_text(script)
    try:
        return subprocess.run([sys.executable, str(path)], check=False, cwd=ROOT, capture_output=True, text=True,
                              timeout=EXIT_BOUND, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise AssertionError(f"the script did not exit within {EXIT_BOUND:.0f} s (UCX threads left running?)\n"
                             f"stdout: {out[-2000:]}\nstderr: {err[-3000:]}") from None


def _client_script(address: str, runs: int = 1) -> str:
    snippet = _readme_snippet("### Client")
    assert "127.0.0.1:7420" in snippet, "the README's client snippet no longer names the node it talks to"
    body = textwrap.indent(snippet.replace("127.0.0.1:7420", address), "    ")
    return (
        "import asyncio, os\n\n"
        "async def main():\n"
        "    h = os.urandom(32)\n"
        "    block_bytes = os.urandom(4096)\n"
        "    dest = bytearray(4096)\n"
        f"{body}"
        "    print('RESULT', found.masks, bytes(dest) == block_bytes, flush=True)\n\n"
        + "asyncio.run(main())\n" * runs
    )


def test_the_readme_client_snippet_exits_once_its_client_is_closed(node, tmp_path: Path) -> None:
    done = _run(_client_script(node.address), tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "RESULT {'full': [True]} True" in done.stdout, done.stdout + done.stderr[-3000:]


def test_a_second_asyncio_run_after_the_last_client_closed_starts_the_transport_again(node, tmp_path: Path) -> None:
    done = _run(_client_script(node.address, runs=2), tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.stdout.count("RESULT {'full': [True]} True") == 2, done.stdout + done.stderr[-3000:]


def test_the_readme_connector_snippet_exits_once_the_connector_is_shut_down(node, etcd, tmp_path: Path) -> None:
    snippet = _readme_snippet("## The KV connector")
    assert "127.0.0.1:7420" in snippet and "127.0.0.1:2379" in snippet, "the README's connector snippet changed"
    snippet = snippet.replace("127.0.0.1:7420", node.address).replace('"127.0.0.1:2379"', repr(etcd.url))
    script = (
        "prompt_tokens = list(range(1, 23))\n"
        "hint_json_bytes_or_None = None\n"
        f"{snippet}"
        "print('RESULT', len(result.tokens), result.stats.prompt_blocks, flush=True)\n"
    )
    done = _run(script, tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "RESULT 16 5" in done.stdout, done.stdout + done.stderr[-3000:]
