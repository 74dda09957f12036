"""``scripts/bench_common.py``: the order in which a benchmark's round runs its contenders, and the method timer."""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# bench.py's throughput contenders, in the order it lists them
CONTENDERS = ["memcpy", "tcp_stream", "ucx_stream", "redis_mget", "redis_pipe_get", "redis_pipe_set",
              "dkv_load_local", "dkv_load_listener", "dkv_offload_local", "dkv_offload_listener"]
QUICK_ROUNDS = 10  # bench.py --quick: one warm-up round and nine timed ones


@pytest.fixture()
def bench_common(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    module = importlib.import_module("bench_common")
    yield module
    sys.modules.pop("bench_common", None)


def predecessors(order_of: object, rounds: int) -> dict[str, set[str]]:
    """Who ran just before each contender, over ``rounds`` rounds of ``order_of(items, round_no)``."""
    before: dict[str, set[str]] = defaultdict(set)
    for round_no in range(rounds):
        order = order_of(CONTENDERS, round_no)  # type: ignore[operator]
        for first, second in zip(order, order[1:]):
            before[second].add(first)
    return before


def test_every_round_runs_every_contender_once_in_an_order_the_same_on_every_run(bench_common: ModuleType) -> None:
    for round_no in range(QUICK_ROUNDS):
        order = bench_common.round_order(CONTENDERS, round_no)
        assert sorted(order) == sorted(CONTENDERS), order
        assert order == bench_common.round_order(list(CONTENDERS), round_no), "drawn from a fixed seed"
    assert CONTENDERS == sorted(CONTENDERS, key=CONTENDERS.index), "the caller's list is left as it was"
    firsts = {bench_common.round_order(CONTENDERS, round_no)[0] for round_no in range(QUICK_ROUNDS)}
    assert len(firsts) >= 4, firsts


def test_no_contender_always_follows_the_same_one_as_it_did_rotated(bench_common: ModuleType) -> None:
    rotated = predecessors(bench_common.rotate, QUICK_ROUNDS)
    # rotated, the listener load always ran just after the same-host load, the TCP stream after memcpy
    assert rotated["dkv_load_listener"] == {"dkv_load_local"} and rotated["tcp_stream"] == {"memcpy"}
    shuffled = predecessors(bench_common.round_order, QUICK_ROUNDS)
    for name in CONTENDERS:
        assert len(shuffled[name]) >= 3, (name, shuffled[name])


class _Timed:
    def plain(self, x: int) -> int:
        return x + 1

    async def awaited(self, x: int) -> int:
        return x * 2

    def fails(self) -> None:
        raise ValueError("as it always did")


def test_timed_methods_times_plain_and_async_calls_and_puts_the_methods_back(bench_common: ModuleType) -> None:
    import asyncio

    originals = {name: _Timed.__dict__[name] for name in ("plain", "awaited", "fails")}
    into: dict[str, list[float]] = {}
    with bench_common.timed_methods([(_Timed, name) for name in originals], into):
        timed = _Timed()
        assert timed.plain(1) == 2 and asyncio.run(timed.awaited(3)) == 6
        with pytest.raises(ValueError, match="as it always did"):
            timed.fails()  # a call that raises is timed too, and raises as before
        assert timed.plain(2) == 3
    assert {label: len(samples) for label, samples in into.items()} == {
        "_Timed.plain": 2, "_Timed.awaited": 1, "_Timed.fails": 1}
    assert all(seconds >= 0 for samples in into.values() for seconds in samples)
    assert {name: _Timed.__dict__[name] for name in originals} == originals, "every method is put back"
