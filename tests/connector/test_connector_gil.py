"""The connector keeps the GIL switch interval short while it lives (dkv.gil), against a real node."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from connector.dkv_connector import DKVConnector
from dkv import gil
from dkv.errors import ConfigError

from .conftest import PAGE_BYTES, device_blocks, two_leaves

BOUND = 30.0  # seconds: a generous bound on every wait, never a timing assertion


@pytest.fixture(autouse=True)
def default_interval() -> Iterator[None]:
    found = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default, whatever an earlier test left
    yield
    sys.setswitchinterval(found)


def test_a_connector_lowers_the_interval_while_it_lives_and_its_shutdown_puts_it_back(connectors, node) -> None:
    first = connectors(node.address)
    assert sys.getswitchinterval() == pytest.approx(gil.DEFAULT_SWITCH_INTERVAL)
    second = connectors(node.address, gil_switch_interval=0.0002)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    second.shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.0002), "the first connector still lives"
    first.shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_none_leaves_the_interpreter_alone(connectors, node) -> None:
    conn = connectors(node.address, gil_switch_interval=None)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    conn.shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_unusable_interval_is_refused_before_anything_starts(node) -> None:
    leaves = two_leaves()
    with pytest.raises(ConfigError, match="switch interval"):
        DKVConnector(leaves, device_blocks(leaves), namespace="test/gil", node=node.address, gil_switch_interval=0)
    assert gil._holders == 0 and sys.getswitchinterval() == pytest.approx(0.005)  # noqa: SLF001


def test_a_connector_that_fails_to_start_puts_the_interval_back() -> None:
    leaves = two_leaves()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(Exception):  # noqa: B017 - whatever the refused connect raises; the interval is the point
        DKVConnector(leaves, device_blocks(leaves), namespace="test/gil", node=address, timeout=1.0)
    assert gil._holders == 0 and sys.getswitchinterval() == pytest.approx(0.005)  # noqa: SLF001


def test_a_listener_load_lands_bit_exact_while_the_calling_thread_stays_busy_in_python(connectors, node) -> None:
    """A scheduler polls between runs of Python: the loop thread gets the GIL in turns and the load completes."""
    conn = connectors(node.address, local=False)
    blocks = conn._blocks[0]["full"][0]  # noqa: SLF001 - the rows the load writes
    hashes = [os.urandom(32) for _ in range(8)]
    for row in range(1, 9):
        blocks[row].copy_(torch_bytes(row))
    wait(conn.offload({"full": list(range(1, 9))}, {"full": hashes}))
    masks = conn.lookup(hashes)
    assert all(masks["full"])
    blocks[11:19].zero_()
    transfer = conn.load({"full": list(range(11, 19))}, {"full": hashes})
    deadline = time.monotonic() + BOUND
    while not transfer.is_complete():
        busy_python()
        assert time.monotonic() < deadline, "the load never completed while the caller was busy"
    for i in range(8):
        assert bytes(blocks[11 + i].numpy()) == bytes(torch_bytes(1 + i).numpy())


def torch_bytes(seed: int) -> torch.Tensor:
    return torch.full((PAGE_BYTES,), seed, dtype=torch.uint8)


def busy_python() -> int:
    total = 0
    for i in range(2000):
        total += i * i
    return total


def wait(transfer) -> None:  # noqa: ANN001
    deadline = time.monotonic() + BOUND
    while not transfer.is_complete():
        assert time.monotonic() < deadline, "the transfer never completed"
        time.sleep(0.002)
