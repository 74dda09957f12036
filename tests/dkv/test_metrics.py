"""A real node's /metrics, /healthz and /readyz: the numbers move by what the clients did, and nothing kills it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dkv.keys import BlockKey
from dkv.metrics import NODE_METRICS
from dkv.metrics_http import MAX_CONNECTIONS
from dkv.wire import PROTOCOL_VERSION
from tests.conftest import WAIT_BOUND, node_stats
from tests.ports import on_a_free_port
from tests.prometheus import Scrape, scrape

BLOCK = 4096
NAME = re.compile(r"^dkv_(node|connector|router)_[a-z0-9_]+$")
UNIT_SUFFIXES = ("_seconds", "_bytes", "_blocks")


def metrics_node(node_factory, *args: str):
    node = node_factory("--metrics-listen", "127.0.0.1:0", *args)
    return node, str(node.ready["metrics_address"])


def get(address: str, path: str) -> httpx.Response:
    return httpx.get(f"http://{address}{path}", timeout=10.0)


def delta(after: Scrape, before: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def check_conventions(scraped: Scrape, prefix: str) -> None:
    """Prefix and charset, ``_total`` on every counter sample, a unit at the end of every histogram."""
    for family, kind in scraped.types.items():
        assert NAME.match(family) and family.startswith(prefix), family
        if kind == "counter":
            assert not family.endswith("_total")  # the parser strips it: the samples carry it
        if kind == "histogram":
            assert family.endswith(UNIT_SUFFIXES), f"histogram {family} names no unit"
        if kind == "gauge":
            assert not family.endswith("_total"), f"gauge {family} is named like a counter"
    for name in scraped.sample_names:
        family = max((f for f in scraped.types if name == f or name.startswith(f + "_")), key=len)
        if scraped.types[family] == "counter":
            assert name.endswith("_total") or name.endswith("_created"), name


async def test_counters_and_histograms_move_by_what_clients_did_on_both_paths(node_factory, clients) -> None:
    node, metrics = metrics_node(node_factory)
    before = scrape(metrics)
    remote = clients(node.address, local=False)
    hashes = [os.urandom(32) for _ in range(3)]
    keys = [BlockKey("full", 0, h) for h in hashes]
    assert (await remote.write(keys, [os.urandom(BLOCK) for _ in keys])).stored == 3
    absent = os.urandom(32)
    found = await remote.lookup([*hashes, absent], ["full"])
    assert found.masks == {"full": [True, True, True, False]}
    await remote.read(found.lease_id, keys, [bytearray(BLOCK) for _ in keys])
    after = scrape(metrics)

    assert delta(after, before, "dkv_node_blocks_committed_total") == 3
    assert delta(after, before, "dkv_node_bytes_total", direction="in", path="listener") == 3 * BLOCK
    assert delta(after, before, "dkv_node_bytes_total", direction="out", path="listener") == 3 * BLOCK
    assert delta(after, before, "dkv_node_lookups_total") == 1
    assert delta(after, before, "dkv_node_blocks_hit_total", tier="host") == 3
    assert delta(after, before, "dkv_node_blocks_hit_total", tier="disk") == 0
    assert delta(after, before, "dkv_node_blocks_missed_total") == 1
    assert delta(after, before, "dkv_node_leases_total", event="granted") == 1
    assert delta(after, before, "dkv_node_requests_total", op="lookup") == 1
    assert delta(after, before, "dkv_node_requests_total", op="read") == 1
    for op in ("write", "lookup", "read"):
        count = after.value("dkv_node_request_duration_seconds_count", op=op)
        assert count == after.value("dkv_node_requests_total", op=op) >= 1, op
        assert after.value("dkv_node_request_duration_seconds_bucket", op=op, le="+Inf") == count
        assert after.value("dkv_node_request_duration_seconds_sum", op=op) > 0
    assert after.value("dkv_node_blocks", tier="host") == 3
    assert after.value("dkv_node_pool_bytes", state="used") >= 3 * BLOCK
    assert after.value("dkv_node_pool_bytes", state="total") == 64 * 2**20

    local = clients(node.address, local=True)
    await local.connect()
    assert local.uses_shared_memory
    more = [BlockKey("full", 0, os.urandom(32)) for _ in range(2)]
    assert (await local.write(more, [os.urandom(BLOCK) for _ in more])).stored == 2
    found = await local.lookup([k.hash for k in more], ["full"])
    await local.read(found.lease_id, more, [bytearray(BLOCK) for _ in more])
    await local.lookup([absent], ["full"])  # carries the load's end on the same-host path, if it copied itself
    last = scrape(metrics)
    assert delta(last, after, "dkv_node_bytes_total", direction="in", path="local") == 2 * BLOCK
    assert delta(last, after, "dkv_node_bytes_total", direction="out", path="local") == 2 * BLOCK
    assert delta(last, after, "dkv_node_bytes_total", direction="in", path="listener") == 0
    stats = await node_stats(node.address)
    assert stats["bytes"] == {"in": {"local": 2 * BLOCK, "listener": 3 * BLOCK},
                              "out": {"local": 2 * BLOCK, "listener": 3 * BLOCK}}
    assert delta(last, before, "dkv_node_lookups_with_payload_total") == 0

    sent = await remote.lookup(hashes, ["full"], send=3 * BLOCK)  # the bytes come with the answer
    assert sent.received
    await remote.read(sent.lease_id, keys, [bytearray(BLOCK) for _ in keys])  # copied here: no request
    final = scrape(metrics)
    assert delta(final, last, "dkv_node_lookups_with_payload_total") == 1
    assert delta(final, last, "dkv_node_bytes_total", direction="out", path="listener") == 3 * BLOCK
    assert delta(final, last, "dkv_node_requests_total", op="read") == 0
    check_conventions(final, "dkv_node_")


async def test_an_expired_lease_and_an_error_reply_are_counted(node_factory, clients) -> None:
    node, metrics = metrics_node(node_factory, "--lease-ttl", "0.3")
    client = clients(node.address, local=False)
    key = BlockKey("full", 0, os.urandom(32))
    await client.write([key], [os.urandom(BLOCK)])
    found = await client.lookup([key.hash], ["full"])
    deadline = time.monotonic() + WAIT_BOUND
    while scrape(metrics).value("dkv_node_leases_total", event="expired") < 1:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    with pytest.raises(Exception, match="lease"):
        await client.read(found.lease_id, [key], [bytearray(BLOCK)])
    scraped = scrape(metrics)
    assert scraped.value("dkv_node_errors_total", code="lease_expired") == 1
    assert scraped.value("dkv_node_reads_total", event="refused") == 1
    assert scraped.value("dkv_node_leases_held") == 0


async def test_every_declared_family_is_exported_with_etcd_and_follows_the_conventions(etcd, node_factory) -> None:
    node = node_factory(*etcd.node_args("metrics-a"), env={"DKV_METRICS_LISTEN": "127.0.0.1:0"})
    metrics = str(node.ready["metrics_address"])  # from the environment variable alone
    scraped = scrape(metrics)
    assert set(scraped.types) == {name.removesuffix("_total") for name in NODE_METRICS}
    for name, (kind, _, _) in NODE_METRICS.items():
        assert scraped.types[name.removesuffix("_total")] == kind, name
        assert (kind == "counter") == name.endswith("_total"), name
    check_conventions(scraped, "dkv_node_")
    assert scraped.value("dkv_node_registered") == 1
    assert scraped.value("dkv_node_ready") == 1
    assert scraped.value("dkv_node_registrations_total") == 1
    assert scraped.value("dkv_node_info", node_id="metrics-a", protocol_version=str(PROTOCOL_VERSION)) == 1
    ready = get(metrics, "/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert get(metrics, "/healthz").json() == {"status": "ok"}


def test_readyz_is_503_while_the_node_cannot_register_in_etcd(tmp_path: Path) -> None:
    """An etcd that accepts connections and never answers: the node is alive (/healthz) but not ready (/readyz)."""
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(1)  # never accepted: gRPC's calls wait out their deadline
    node_id = f"unready-{os.urandom(3).hex()}"
    started: list[subprocess.Popen[bytes]] = []

    def start(port: int) -> tuple[subprocess.Popen[bytes], httpx.Response]:
        """The node serving metrics on ``port`` and its first /healthz; raises with its log if it exits."""
        cmd = [sys.executable, "-m", "dkv.cli", "serve", "--listen", "127.0.0.1:0", "--pool", "16MiB",
               "--node-id", node_id, "--etcd", f"http://127.0.0.1:{black_hole.getsockname()[1]}",
               "--metrics-listen", f"127.0.0.1:{port}", "--exit-with-parent"]
        with open(tmp_path / "node.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(proc)
        deadline = time.monotonic() + WAIT_BOUND
        while True:
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "node.log").read_text())
            try:
                return proc, get(f"127.0.0.1:{port}", "/healthz")
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the metrics endpoint never answered"
                time.sleep(0.05)

    try:
        port, (proc, health) = on_a_free_port(start)
        metrics = f"127.0.0.1:{port}"
        assert proc.poll() is None, (tmp_path / "node.log").read_text()
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ready = get(metrics, "/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["status"] == "not ready" and "etcd" in ready.json()["reason"]
        assert scrape(metrics).value("dkv_node_ready") == 0
    finally:
        for proc in started:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        black_hole.close()
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"dkv-{node_id}-"):  # this node's own arena and credential files (unique id)
                Path("/dev/shm", name).unlink(missing_ok=True)


def _exchange(address: str, data: bytes, *, read: bool = True) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if not read:
            return b""
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def test_garbage_http_is_answered_4xx_and_never_kills_the_node(node_factory) -> None:
    node, metrics = metrics_node(node_factory)
    cases = {
        b"garbage\r\n\r\n": b"400",
        b"\x00\xff\x16\x03\x01 binary \r\n\r\n": b"400",
        b"GET /metrics HTTP/9.9\r\n\r\n": b"400",
        b"DELETE /metrics HTTP/1.1\r\n\r\n": b"405",
        b"GET /etc/passwd HTTP/1.1\r\n\r\n": b"404",
        b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n": b"431",
        b"GET /healthz HTTP/1.1\r\n": b"",  # no end of head before the peer's FIN: dropped
    }
    for request, status in cases.items():
        answer = _exchange(metrics, request)
        assert answer.startswith(b"HTTP/1.1 " + status) if status else answer == b"", (request[:40], answer[:80])
        if status:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"application/json" in head and "error" in json.loads(body), answer
    head = _exchange(metrics, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
    # more connections than the cap at once, saying nothing: the one over it is closed unanswered at once
    held = [socket.create_connection(tuple(metrics.rsplit(":", 1)), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        try:
            over = _exchange(metrics, b"GET /healthz HTTP/1.1\r\n\r\n")
        except OSError:  # reset, or closed before our shutdown: unanswered
            over = b""
        assert over == b"", over[:80]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + WAIT_BOUND
    while True:  # the held ones end with their close (or the read timeout): served again
        try:
            health = _exchange(metrics, b"GET /healthz HTTP/1.1\r\n\r\n")
        except OSError:  # reset, or closed before our shutdown: unanswered
            health = b""
        if health:
            break
        assert time.monotonic() < deadline, "the held connections were never let go"
        time.sleep(0.1)
    assert health.startswith(b"HTTP/1.1 200")
    assert node.alive()
    assert (await node_stats(node.address))["node_id"]  # the node's own listener still serves


def test_an_unusable_metrics_address_is_a_clear_error_at_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        for address, message in ((f"127.0.0.1:{port}", "cannot listen for metrics"), ("127.0.0.1:x", "HOST:PORT")):
            done = subprocess.run([sys.executable, "-m", "dkv.cli", "serve", "--listen", "127.0.0.1:0", "--pool",
                                   "16MiB", "--metrics-listen", address], capture_output=True, text=True, timeout=60,
                                  cwd=tmp_path)
            assert done.returncode != 0
            assert message in done.stderr + done.stdout and "Traceback" not in done.stderr, done.stderr
