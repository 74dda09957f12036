"""Which event loop dKV's own loops run on (dkv.event_loop): uvloop by default, the standard loop on request.

The rest of the suite runs the nodes and the connectors' loop threads on the
default (uvloop) and the tests' own loops on the standard one, so every
contract test already crosses the two kinds; these pin the choice itself and
a node on the standard loop serving both paths.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dkv import event_loop
from dkv.errors import ConfigError
from dkv.event_loop import DEFAULT_EVENT_LOOP, EVENT_LOOP_ENV, chosen_event_loop, loop_kind, new_event_loop
from dkv.keys import BlockKey
from tests.conftest import node_stats, on_ucx

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16 * 1024


@pytest.fixture
def no_choice(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    return monkeypatch


def test_uvloop_is_the_default_and_the_standard_loop_is_one_setting_away(no_choice: pytest.MonkeyPatch) -> None:
    assert DEFAULT_EVENT_LOOP == "uvloop" and chosen_event_loop() == "uvloop"
    for value, kind in (("uvloop", "uvloop"), ("asyncio", "asyncio"), (" AsyncIO ", "asyncio"), ("", "uvloop")):
        no_choice.setenv(EVENT_LOOP_ENV, value)
        loop = new_event_loop()
        try:
            assert chosen_event_loop() == kind and loop_kind(loop) == kind, value
            assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
        finally:
            loop.close()


def test_run_runs_a_coroutine_to_its_end_on_the_chosen_loop(no_choice: pytest.MonkeyPatch) -> None:
    async def kind() -> str:
        await asyncio.sleep(0)
        return loop_kind(asyncio.get_running_loop())

    assert event_loop.run(kind()) == "uvloop"
    no_choice.setenv(EVENT_LOOP_ENV, "asyncio")
    assert event_loop.run(kind()) == "asyncio"


def test_an_unknown_loop_is_a_config_error_that_names_the_choices(no_choice: pytest.MonkeyPatch) -> None:
    no_choice.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ConfigError, match=r"DKV_EVENT_LOOP='trio'.*uvloop, asyncio"):
        new_event_loop()


def test_without_uvloop_the_default_falls_back_with_a_warning_and_an_explicit_ask_fails(
        no_choice: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    no_choice.setattr(event_loop, "_uvloop", lambda: None)
    no_choice.setattr(event_loop, "_warned_fallback", False)
    with caplog.at_level("WARNING", logger="dkv.event_loop"):
        assert chosen_event_loop() == "asyncio"
    assert "uvloop cannot be imported" in caplog.text
    no_choice.setenv(EVENT_LOOP_ENV, "uvloop")
    with pytest.raises(ConfigError, match="cannot be imported"):
        chosen_event_loop()


async def test_the_connector_loop_thread_runs_on_the_chosen_loop() -> None:
    async def kind() -> str:
        return loop_kind(asyncio.get_running_loop())

    assert await on_ucx(kind()) == os.environ.get(EVENT_LOOP_ENV, DEFAULT_EVENT_LOOP).strip().lower()


async def test_a_node_reports_its_loop_and_progress_mode(node) -> None:
    runtime = (await node_stats(node.address))["runtime"]
    assert runtime == {"event_loop": os.environ.get(EVENT_LOOP_ENV, DEFAULT_EVENT_LOOP).strip().lower(),
                       "ucx_progress": os.environ.get("DKV_UCX_PROGRESS", "loop")}


@pytest.mark.parametrize("local", [True, False], ids=["same-host", "listener"])
async def test_a_node_on_the_standard_loop_serves_both_paths_bit_exact(node_factory, clients, local: bool) -> None:
    node = node_factory(env={EVENT_LOOP_ENV: "asyncio"})
    assert (await node_stats(node.address))["runtime"]["event_loop"] == "asyncio"
    client = clients(node.address, local=local)
    hashes, data = [os.urandom(32) for _ in range(5)], [os.urandom(BLOCK) for _ in range(5)]
    keys = [BlockKey("L", 0, h) for h in hashes]
    assert (await client.write(keys, data)).stored == 5
    found = await client.lookup(hashes, ["L"])
    assert found.masks["L"] == [True] * 5
    dests = [bytearray(BLOCK) for _ in hashes]
    await client.read(found.lease_id, keys, dests)
    assert [bytes(d) for d in dests] == data
    assert client.uses_shared_memory is local


def test_the_cli_fails_cleanly_on_an_unknown_loop(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "dkv.cli", "serve", "--listen", "127.0.0.1:0", "--pool", "8MiB"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, EVENT_LOOP_ENV: "bogus"})
    assert done.returncode != 0
    assert "DKV_EVENT_LOOP='bogus'" in done.stderr + done.stdout and "Traceback" not in done.stderr
