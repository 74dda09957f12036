"""dkv.stay_awake: the loop is kept polling only after back-to-back requests, for at most its bound."""

from __future__ import annotations

import asyncio

import pytest

from dkv.errors import ConfigError
from dkv.server import NodeConfig
from dkv.stay_awake import MAX_BOUND, StayAwake

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _turns(turns: int) -> None:
    """Let the loop turn ``turns`` times (the tests' clock stands still meanwhile)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_only_a_request_that_came_back_to_back_keeps_the_loop_polling_and_only_for_the_bound() -> None:
    clock = Clock()
    awake = StayAwake(300e-6, clock)
    awake.arrived()  # the first request ever: after no other
    awake.served()
    assert not awake.polling
    clock.now += 100e-6
    awake.arrived()  # 100 µs after the last one was served: back to back
    clock.now += 20e-6
    awake.served()
    assert awake.polling
    await _turns(5)
    assert awake.polling and awake.polls >= 4  # it polled while the clock stood within the bound
    clock.now += 301e-6  # past the bound after the last request served
    await _turns(3)
    assert not awake.polling
    polled = awake.polls
    clock.now += 5e-3
    awake.arrived()  # 5 ms after: not back to back (a batch load's next lookup, an idle node's first)
    awake.served()
    await _turns(3)
    assert not awake.polling and awake.polls == polled


async def test_each_request_served_moves_the_end_on() -> None:
    clock = Clock()
    awake = StayAwake(300e-6, clock)
    awake.served()
    for _ in range(5):  # requests 200 µs apart: each within the bound of the last
        clock.now += 200e-6
        awake.arrived()
        awake.served()
        await _turns(2)
        assert awake.polling


async def test_a_zero_bound_never_polls_and_close_ends_the_polling() -> None:
    clock = Clock()
    never = StayAwake(0.0, clock)
    for _ in range(3):
        never.arrived()
        never.served()
    await _turns(3)
    assert not never.polling and never.polls == 0
    awake = StayAwake(300e-6, clock)
    awake.served()
    awake.arrived()
    awake.served()
    assert awake.polling
    awake.close()
    await _turns(2)
    assert not awake.polling


@pytest.mark.parametrize("bound", [-1e-6, MAX_BOUND * 2])
def test_a_bound_out_of_range_is_refused(bound: float) -> None:
    with pytest.raises(ValueError):
        StayAwake(bound)
    with pytest.raises(ConfigError, match="stay_awake"):
        NodeConfig(pool_size=1 << 20, stay_awake=bound).validate()


@pytest.mark.parametrize("bound_us", [10_000, 0])  # (the most it takes: these lookups go over UCX, ~0.3 ms or more)
async def test_a_node_polls_between_back_to_back_lookups_unless_told_not_to(node_factory, clients,
                                                                         bound_us: int) -> None:
    node = node_factory("--stay-awake-us", str(bound_us))
    client = clients(node.address)
    hashes = [bytes([i]) * 32 for i in range(4)]
    for _ in range(50):  # back to back: each the moment the last was answered
        await client.lookup(hashes, ["L"])
    stats = await client.stats()
    assert stats["stay_awake"]["bound_us"] == bound_us
    assert (stats["stay_awake"]["polls"] > 0) == (bound_us > 0), stats["stay_awake"]
