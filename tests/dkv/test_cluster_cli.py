"""The cluster inspection commands (``dkv peers/where/route/watch``) against a real etcd and live nodes.

Every command runs as a subprocess (``python -m dkv.cli``) with a 60 s bound,
the way an operator runs it; the nodes are real ``dkv serve`` processes that
joined the test's etcd prefix.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest

from dkv.etcd import Layout, make_client
from dkv.hints import parse_hint, resolve_hint
from dkv.keys import BlockKey
from dkv.router import Router

NS = "test/ns0"  # the clients fixture's namespace
WAIT = 20.0
CLI_TIMEOUT = 60
BLOCK = b"c" * 4096


def _dkv(*args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dkv.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


async def _adkv(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI without blocking the test's loop (its UCX clients keep working meanwhile)."""
    return await asyncio.to_thread(_dkv, *args)


def _flat(text: str) -> str:
    """The text with rich's line wrapping undone."""
    return " ".join(text.split())


@asynccontextmanager
async def _router(url: str, prefix: str) -> AsyncIterator[Router]:
    client = make_client(url)
    await client.connect()
    router = Router(client, Layout(prefix=prefix))
    try:
        await router.start(follow=True)
        yield router
    finally:
        await router.stop()
        await client.close()


async def _until(router: Router, predicate, what: str) -> None:
    if not await router.wait_until(predicate, WAIT):
        raise AssertionError(f"not within {WAIT}s: {what} (members {sorted(router.members)}, entries {router.entries})")


def _chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


async def _write(client, hashes: Sequence[bytes]) -> None:
    result = await client.write([BlockKey("L", 0, h) for h in hashes], [BLOCK] * len(hashes))
    assert result.statuses == ["write"] * len(hashes), result.statuses


# ---- peers --------------------------------------------------------------------------------------


async def test_peers_lists_live_nodes_as_a_table_and_as_json(etcd, node_factory, clients) -> None:
    nodes = {name: node_factory(*etcd.node_args(name, ttl=10)) for name in ("peer-b", "peer-a")}
    async with _router(etcd.url, etcd.prefix) as router:
        await _until(router, lambda r: set(r.members) == set(nodes), "both nodes registered")

    table = await _adkv("peers", *etcd.cli_args())
    assert table.returncode == 0, table.stderr
    for name, node in nodes.items():
        assert name in table.stdout and node.address in table.stdout
    assert "2 peer(s)" in table.stdout

    result = await _adkv("peers", *etcd.cli_args(), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["node_id"] for r in rows] == ["peer-a", "peer-b"], "sorted by node id"
    for row in rows:
        node = nodes[row["node_id"]]
        assert row["address"] == node.address
        assert row["epoch"] == node.ready["epoch"]
        assert row["host_total"] == 64 * 2**20
        assert isinstance(row["lease_ttl_left"], int) and 0 < row["lease_ttl_left"] <= 10
        assert row["state"] == "up"

    # another cluster name under the same prefix has no peers
    other = await _adkv("peers", *etcd.cli_args(), "--cluster", "elsewhere", "--json")
    assert other.returncode == 0 and json.loads(other.stdout) == []


# ---- where / route ------------------------------------------------------------------------------


async def test_where_shows_which_node_holds_which_hash(etcd, node_factory, clients) -> None:
    hashes = _chain(3)
    unknown = os.urandom(8)
    first = node_factory(*etcd.node_args("where-1"))
    second = node_factory(*etcd.node_args("where-2"))
    await _write(clients(first.address), hashes[:2])
    await _write(clients(second.address), hashes[:1])
    async with _router(etcd.url, etcd.prefix) as router:
        await _until(router, lambda r: r.entries == 3, "three entries")

    args = ["where", "--ns", NS, *etcd.cli_args(), *(h.hex() for h in hashes), unknown.hex()]
    result = await _adkv(*args, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        hashes[0].hex(): ["where-1", "where-2"],
        hashes[1].hex(): ["where-1"],
        hashes[2].hex(): [],
        unknown.hex(): [],
    }

    table = await _adkv(*args)
    assert table.returncode == 0, table.stderr
    lines = {line.split()[1]: line for line in table.stdout.splitlines()
             if len(line.split()) > 1 and len(line.split()[1]) in (16, 64)}
    assert "where-1" in lines[hashes[0].hex()] and "where-2" in lines[hashes[0].hex()]
    assert "where-1" in lines[hashes[1].hex()] and "where-2" not in lines[hashes[1].hex()]
    assert "where" not in lines[hashes[2].hex()] and "-" in lines[hashes[2].hex()]
    assert "where" not in lines[unknown.hex()]

    # the same hashes in another namespace are held by nobody
    foreign = await _adkv("where", "--ns", "other/ns", *etcd.cli_args(), hashes[0].hex(), "--json")
    assert foreign.returncode == 0 and json.loads(foreign.stdout) == {hashes[0].hex(): []}


async def test_route_gives_the_peer_the_depth_and_a_hint_the_connector_accepts(etcd, node_factory, clients) -> None:
    hashes = _chain(6)
    shallow = node_factory(*etcd.node_args("route-a"))
    deep = node_factory(*etcd.node_args("route-b"))
    await _write(clients(shallow.address), hashes[:2])
    await _write(clients(deep.address), hashes[:5])
    async with _router(etcd.url, etcd.prefix) as router:
        await _until(router, lambda r: r.entries == 7 and len(r.members) == 2, "seven entries")

        result = await _adkv("route", "--ns", NS, *etcd.cli_args(), *(h.hex() for h in hashes), "--json")
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert (out["peer"], out["address"], out["depth"], out["of"]) == ("route-b", deep.address, 5, 6)
        raw_hint = json.dumps(out["hint"])
        hint = parse_hint(raw_hint)
        assert (hint.peer_id, hint.epoch, hint.namespace, hint.depth, hint.deepest_hash) == (
            "route-b", deep.ready["epoch"], NS, 5, hashes[4])
        assert resolve_hint(raw_hint, NS, hashes, router.members) is router.members["route-b"]

        # the text form: who, where, how deep, then the hint itself on the last line
        text = await _adkv("route", "--ns", NS, *etcd.cli_args(), *(h.hex() for h in hashes))
        assert text.returncode == 0, text.stderr
        assert "route-b" in text.stdout and deep.address in text.stdout and "5 of 6" in _flat(text.stdout)
        assert parse_hint(text.stdout.strip().splitlines()[-1]).peer_id == "route-b"

    miss = await _adkv("route", "--ns", NS, *etcd.cli_args(), os.urandom(32).hex(), "--json")
    assert miss.returncode == 0, miss.stderr
    out = json.loads(miss.stdout)
    assert (out["peer"], out["depth"], out["hint"]) == (None, 0, None)
    miss_text = await _adkv("route", "--ns", NS, *etcd.cli_args(), os.urandom(32).hex())
    assert miss_text.returncode == 0 and "no live peer" in miss_text.stdout


# ---- watch --------------------------------------------------------------------------------------


async def _readline(proc: subprocess.Popen[str], bound: float = WAIT, stream: str = "stdout") -> str:
    line = await asyncio.wait_for(asyncio.to_thread(getattr(proc, stream).readline), bound)
    if not line:
        raise AssertionError(f"watch ended early (rc {proc.poll()}): {proc.stderr.read() if proc.poll() is not None else ''}")
    return line


async def test_watch_shows_publish_events_and_a_leave(etcd, node_factory, clients) -> None:
    # a long TTL: the node refreshes its member record only every TTL/3, so no "update" event
    # falls inside this test and the event count is exact: 3 publish, 3 unpublish, 1 leave
    node = node_factory(*etcd.node_args("watched", ttl=60))
    hashes = _chain(3)
    proc = subprocess.Popen([sys.executable, "-m", "dkv.cli", "watch", *etcd.cli_args(), "--count", "7", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    events: list[dict] = []
    try:
        banner = await _readline(proc, stream="stderr")  # with --json, stdout carries only events
        assert "1 peer(s)" in banner, banner  # the watch has its snapshot: what follows is live
        writer = clients(node.address)
        await _write(writer, hashes)
        while len(events) < 3:
            events.append(json.loads(await _readline(proc)))
        assert {(e["event"], e["node"], e["namespace"], e["hash"]) for e in events} == {
            ("publish", "watched", NS, h.hex()) for h in hashes}

        await writer.close()
        assert node.stop() == 0  # graceful: the lease is revoked, member key and entries go at once
        while len(events) < 7:
            events.append(json.loads(await _readline(proc)))
        rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), WAIT)
        assert rc == 0, proc.stderr.read()
        assert proc.stdout.read() == "", "--count 7 stops after the seventh event"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    later = events[3:]
    assert {(e["event"], e["node"], e["hash"]) for e in later} == {
        ("unpublish", "watched", h.hex()) for h in hashes} | {("leave", "watched", None)}


async def test_watch_with_a_duration_ends_by_itself_on_a_quiet_cluster(etcd) -> None:
    result = await _adkv("watch", *etcd.cli_args(), "--duration", "1")
    assert result.returncode == 0, result.stderr
    assert "0 peer(s), 0 entries" in result.stdout


# ---- bad input, unreachable etcd ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["where", "route"])
@pytest.mark.parametrize("bad", ["zz", "abcd", "0" * 15, "0" * 63, "0" * 66, "g" * 16])
async def test_a_bad_hash_argument_exits_2_with_a_clear_message(etcd, command: str, bad: str) -> None:
    result = await _adkv(command, "--ns", NS, *etcd.cli_args(), os.urandom(8).hex(), bad)
    assert result.returncode == 2, (result.stdout, result.stderr)
    message = _flat(result.stderr)
    assert f"hash {bad!r}" in message and "16 or 64 hex digits" in message, message
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("command", [("peers",), ("where", "--ns", NS, "00" * 8), ("route", "--ns", NS, "00" * 8),
                                     ("watch", "--count", "1")], ids=lambda c: c[0])
async def test_an_unreachable_etcd_fails_quickly_naming_the_endpoint(command: tuple[str, ...]) -> None:
    result = await _adkv(*command, "--etcd", "127.0.0.1:1")  # subprocess.TimeoutExpired past 60 s
    assert result.returncode != 0
    assert "127.0.0.1:1" in _flat(result.stderr), result.stderr
    assert "Traceback" not in result.stderr + result.stdout


async def test_a_malformed_etcd_endpoint_is_a_clear_error() -> None:
    result = await _adkv("peers", "--etcd", "no-port-here")
    assert result.returncode == 2
    assert "no-port-here" in _flat(result.stderr) and "HOST:PORT" in result.stderr
    assert "Traceback" not in result.stderr
