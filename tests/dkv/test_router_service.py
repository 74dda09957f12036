"""``dkv router serve`` as a real process, over real HTTP, against a real etcd and real ``dkv serve`` nodes.

The service runs as ``python -m dkv.cli router serve`` (its ready line read from
stdout, stopped by its PID with SIGTERM, which must end it with status 0); the
nodes publish the blocks a :class:`NodeClient` wrote, so the routes it answers
come from the directory entries a node's publisher wrote to etcd.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.etcd_process import EtcdProcess, start_etcd
from cluster.process import stop_process
from dkv.hints import parse_hint
from dkv.keys import BlockKey
from tests.ports import on_a_free_port_awaited

NS = "test/ns0"  # the clients fixture's namespace
WAIT = 20.0  # generous bound for anything that goes through etcd
START_BOUND = 30.0
BLOCK = b"r" * 4096
TOKEN = b"router-test-token-0123456789"


@dataclass
class Service:
    proc: subprocess.Popen[str]
    address: str
    log: Path

    @property
    def url(self) -> str:
        host, _, port = self.address.rpartition(":")
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '[::]') else host}:{port}"

    def alive(self) -> bool:
        return self.proc.poll() is None


def _start(args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "dkv.cli", "router", "serve", *args], stdout=subprocess.PIPE,
                            stderr=log.open("w"), stdin=subprocess.DEVNULL, text=True,
                            env={**os.environ, **(env or {})})


def _stop(proc: subprocess.Popen[str]) -> int:
    """SIGTERM by PID, bounded; SIGKILL if it does not end. Returns the exit status."""
    stop_process(proc, 15)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


@contextmanager
def router_service(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Service]:
    """Start the service on a free port, wait (bounded) for its ready line; SIGTERM it at the end (status 0)."""
    log = tmp_path / f"router-{uuid.uuid4().hex[:6]}.log"
    proc = _start(["--listen", "127.0.0.1:0", *args], log, env)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(START_BOUND), f"no ready line within {START_BOUND}s: {log.read_text()[-2000:]}"
        line = proc.stdout.readline()
        assert line, f"the router service exited ({proc.poll()}): {log.read_text()[-2000:]}"
        ready = json.loads(line)
        assert ready["pid"] == proc.pid
        yield Service(proc, ready["address"], log)
        assert proc.poll() is None, f"the service died: {log.read_text()[-2000:]}"
        assert _stop(proc) == 0, log.read_text()[-2000:]
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        _stop(proc)


@asynccontextmanager
async def http(service: Service, token: bytes | None = None) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {token.decode()}"} if token else {}
    async with httpx.AsyncClient(base_url=service.url, timeout=10.0, headers=headers) as client:
        yield client


async def _until(fetch: Any, predicate: Any, what: str, bound: float = WAIT) -> Any:
    """Poll ``await fetch()`` until ``predicate(value)``; the last value."""
    deadline = time.monotonic() + bound
    while True:
        value = await fetch()
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"not within {bound}s: {what} (last: {value})"
        await asyncio.sleep(0.1)


def _chain(n: int, size: int = 32) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def _hex(hashes: Sequence[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


async def _write(client: Any, hashes: Sequence[bytes]) -> None:
    result = await client.write([BlockKey("L", 0, h) for h in hashes], [BLOCK] * len(hashes))
    assert result.statuses == ["write"] * len(hashes), result.statuses


def _metrics(text: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# ---- routes ---------------------------------------------------------------------------------------


async def test_route_names_the_live_peer_with_the_longest_prefix_and_a_hint_for_it(
        etcd, node_factory, clients, tmp_path) -> None:
    hashes, short = _chain(6), _chain(3, size=8)
    nodes = {name: node_factory(*etcd.node_args(name)) for name in ("node-a", "node-b")}
    await _write(clients(nodes["node-a"].address), hashes[:2])
    await _write(clients(nodes["node-a"].address), short)
    await _write(clients(nodes["node-b"].address), hashes[:5])
    with router_service(tmp_path, *etcd.cli_args()) as service:
        async with http(service) as api:
            await _until(lambda: api.get("/readyz"), lambda r: r.status_code == 200, "ready")

            async def route(body: dict[str, Any]) -> dict[str, Any]:
                response = await api.post("/v1/route", json=body)
                assert response.status_code == 200, response.text
                return response.json()

            hit = await _until(lambda: route({"namespace": NS, "hashes": _hex(hashes)}),
                               lambda r: r["depth"] == 5, "node-b's five blocks routed")
            b = nodes["node-b"]
            assert hit["peer"] == {"node_id": "node-b", "address": b.address, "epoch": b.ready["epoch"]}
            hint = parse_hint(hit["hint"])
            assert (hint.peer_id, hint.epoch, hint.namespace, hint.depth, hint.deepest_hash, hint.blocks) == (
                "node-b", b.ready["epoch"], NS, 5, hashes[4], 6)
            assert hint.endpoint == f"ucx://{b.address}"

            excluded = await route({"namespace": NS, "hashes": _hex(hashes), "exclude": ["node-b"]})
            assert (excluded["peer"]["node_id"], excluded["depth"]) == ("node-a", 2)
            assert parse_hint(excluded["hint"]).deepest_hash == hashes[1]
            # the engine's own node named: only a peer holding more than it is routed to
            assert (await route({"namespace": NS, "hashes": _hex(hashes), "requester": "node-a"}))["peer"][
                "node_id"] == "node-b"
            assert await route({"namespace": NS, "hashes": _hex(hashes), "requester": "node-b"}) == {
                "peer": None, "depth": 0, "hint": None}
            eight = await _until(lambda: route({"namespace": NS, "hashes": _hex(short)}),
                                 lambda r: r["depth"] == 3, "node-a's 8-byte hashes routed")
            assert eight["peer"]["node_id"] == "node-a"
            assert await route({"namespace": NS, "hashes": _hex(_chain(4))}) == {"peer": None, "depth": 0, "hint": None}
            assert (await route({"namespace": "other/ns", "hashes": _hex(hashes)}))["peer"] is None
            assert (await route({"namespace": NS, "hashes": []}))["peer"] is None

            batch = await api.post("/v1/route/batch", json={"requests": [
                {"namespace": NS, "hashes": _hex(hashes)},
                {"namespace": NS, "hashes": _hex(hashes[:3]), "exclude": ["node-b"]},
                {"namespace": NS, "hashes": _hex(_chain(2))}]})
            assert batch.status_code == 200, batch.text
            routes = batch.json()["routes"]
            assert [(r["peer"] and r["peer"]["node_id"], r["depth"]) for r in routes] == [
                ("node-b", 5), ("node-a", 2), (None, 0)]
            assert parse_hint(routes[0]["hint"]).deepest_hash == hashes[4]
            assert (await api.post("/v1/route/batch", json={"requests": []})).json() == {"routes": []}

            metrics = _metrics((await api.get("/metrics")).text)
            assert metrics["dkv_router_members"] == 2
            assert metrics["dkv_router_index_entries"] == 2 + 3 + 5
            assert metrics["dkv_router_ready"] == 1
            assert metrics["dkv_router_resyncs_total"] == 0
            # the routes above: hits 5+1 (b, a, 8-byte; batch b, a) and misses (unknown chain, other ns,
            # empty, batch's unknown); _until may have polled more before the entries arrived
            assert metrics['dkv_router_routes_total{outcome="hit"}'] >= 5
            assert metrics['dkv_router_routes_total{outcome="miss"}'] >= 4
            assert metrics['dkv_router_requests_total{code="200",endpoint="/v1/route"}'] >= 6
            assert metrics['dkv_router_requests_total{code="200",endpoint="/v1/route/batch"}'] == 2
            assert metrics['dkv_router_request_duration_seconds_count{endpoint="/v1/route/batch"}'] == 2
            assert 0 < metrics['dkv_router_request_duration_seconds_sum{endpoint="/v1/route"}'] < 5
            assert metrics['dkv_router_routed_depth_blocks_bucket{le="4.0"}'] >= 1  # depth 2 and 3
            assert metrics['dkv_router_routed_depth_blocks_bucket{le="8.0"}'] >= 4  # and the 5s
            assert metrics["dkv_router_routed_depth_blocks_count"] == metrics['dkv_router_routes_total{outcome="hit"}']


async def test_bad_input_is_a_4xx_json_naming_the_problem_and_the_service_stays_up(etcd, tmp_path) -> None:
    h8, h32 = "ab" * 8, "cd" * 32
    cases: list[tuple[Any, int, str]] = [
        ({"namespace": NS, "hashes": [h32, "zz" * 32]}, 422, "hashes[1]: not hex"),
        ({"namespace": NS, "hashes": ["ab" * 7 + " a"]}, 422, "hashes[0]: not hex"),
        ({"namespace": NS, "hashes": [h8, "abc"]}, 422, "hashes[1]: String should have at least 16 characters"),
        ({"namespace": NS, "hashes": [h8, "ab" * 33]}, 422, "hashes[1]: String should have at most 64 characters"),
        ({"namespace": NS, "hashes": ["ab" * 12]}, 422, "hashes[0]: a hash is 16 or 64 hex digits"),
        ({"namespace": NS, "hashes": [h8, h32]}, 422, "all hashes of one request are one length"),
        ({"namespace": NS, "hashes": [h8, 7]}, 422, "hashes[1]: Input should be a valid string"),
        ({"namespace": NS, "hashes": [h32, h8, h8, h8, h8]}, 422, "hashes[1]: 16 hex digits where hashes[0] has 64"),
        ({"namespace": "", "hashes": [h8]}, 422, "namespace"),
        ({"namespace": NS}, 422, "hashes: Field required"),
        ({"namespace": NS, "hashes": [h8], "extra": 1}, 422, "extra"),
        ({"namespace": NS, "hashes": [h8] * 65_537}, 413, "at most 65536"),
        ([1, 2], 422, "body"),
    ]
    with router_service(tmp_path, *etcd.cli_args()) as service:
        async with http(service) as api:
            # bad input is judged after readiness (a request before the first snapshot is a 503 whatever it says)
            await _until(lambda: api.get("/readyz"), lambda r: r.status_code == 200, "ready")
            for body, status, says in cases:
                response = await api.post("/v1/route", json=body)
                assert response.status_code == status, (body if len(str(body)) < 300 else says, response.text)
                assert says in response.json()["detail"], response.text
            for raw in (b"{nope", b"", b"\xff\xfe"):
                response = await api.post("/v1/route", content=raw)
                assert response.status_code == 400 and response.json()["error"] == "invalid_json", response.text
            response = await api.post("/v1/route", content=b" " * (8 * 2**20 + 1))
            assert response.status_code == 413 and response.json()["error"] == "too_large", response.text
            batch = [{"namespace": NS, "hashes": [h8]}, {"namespace": NS, "hashes": [h8, "x"]}]
            response = await api.post("/v1/route/batch", json={"requests": batch})
            assert response.status_code == 422 and "requests[1].hashes[1]" in response.json()["detail"], response.text
            response = await api.post("/v1/route/batch", json={"requests": [{"namespace": NS, "hashes": [h8]}] * 1025})
            assert response.status_code == 413, response.text
            over = [{"namespace": NS, "hashes": [h8] * 40_000}] * 2
            response = await api.post("/v1/route/batch", json={"requests": over})
            assert response.status_code == 413 and "80000 hashes" in response.json()["detail"], response.text
            assert (await api.get("/v1/route")).status_code == 405

            # a client that goes away halfway through its body: nothing to answer, nothing logged as a crash
            host, _, port = service.address.rpartition(":")
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10)
            writer.write(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"namespace\": \"test/ns0\", \"hashes\": [")
            await asyncio.wait_for(writer.drain(), 10)
            await asyncio.sleep(0.2)
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 10)
            await _until(lambda: api.get("/metrics"),
                         lambda r: 'dkv_router_requests_total{code="499",endpoint="/v1/route"} 1.0' in r.text,
                         "the disconnect counted")

            assert (await api.get("/healthz")).json() == {"status": "ok"}
            ok = await api.post("/v1/route", json={"namespace": NS, "hashes": [h8]})
            assert ok.status_code == 200 and ok.json()["peer"] is None
            metrics = _metrics((await api.get("/metrics")).text)
            assert metrics['dkv_router_requests_total{code="422",endpoint="/v1/route"}'] == 12
            assert metrics['dkv_router_requests_total{code="413",endpoint="/v1/route"}'] == 2
            assert metrics['dkv_router_requests_total{code="400",endpoint="/v1/route"}'] == 3


def test_bulk_decoding_gives_the_same_hashes_and_routes_as_one_by_one() -> None:
    from dkv.router_service import HashRun, decode_hashes

    for size in (8, 32):
        chain = _chain(9, size)
        run = decode_hashes(_hex(chain))
        assert isinstance(run, HashRun) and len(run) == 9
        assert [run[i] for i in range(9)] == chain and run[-1] == chain[-1] and list(run) == chain
        assert run[:3] == chain[:3] and run[2:7:2] == chain[2:7:2] and run[-2:] == chain[-2:]
        assert run[:3] == chain[:3]  # after iterating, from the materialised list too
        with pytest.raises(IndexError):
            run[9]
    assert len(decode_hashes([])) == 0 and list(decode_hashes([])) == []
    with pytest.raises(Exception, match=r"hashes\[1\]: 64 hex digits where hashes\[0\] has 16"):
        decode_hashes(["ab" * 8, "ab" * 32, "ab" * 8])
    with pytest.raises(Exception, match=r"hashes\[0\]: a hash is 16 or 64 hex digits"):
        decode_hashes(["ab" * 10, "ab" * 10])
    with pytest.raises(Exception, match=r"hashes\[2\]: not hex"):
        decode_hashes(["ab" * 8, "ab" * 8, "ab" * 7 + "g0"])


# ---- auth, readiness, the API document ------------------------------------------------------------


async def test_beyond_loopback_a_token_is_required_to_start_and_on_every_v1_call(etcd, tmp_path) -> None:
    log = tmp_path / "refused.log"
    refused = _start([*etcd.cli_args(), "--listen", "0.0.0.0:0"], log, env={"DKV_TOKEN": ""})
    try:
        refused.wait(START_BOUND)
    finally:
        _stop(refused)
    text = " ".join(log.read_text().split())
    assert refused.returncode == 2 and "beyond loopback" in text and "Traceback" not in text, text

    (tmp_path / "token").write_bytes(TOKEN + b"\n")
    body = {"namespace": NS, "hashes": ["00" * 8]}
    with router_service(tmp_path, *etcd.cli_args(), "--listen", "0.0.0.0:0", "--token-file",
                        str(tmp_path / "token")) as service:
        assert service.address.startswith("0.0.0.0:")
        async with http(service) as api:
            for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"},
                            {"Authorization": TOKEN.decode()}, {"Authorization": f"Basic {TOKEN.decode()}"}):
                for path, payload in (("/v1/route", body), ("/v1/route/batch", {"requests": [body]})):
                    response = await api.post(path, json=payload, headers=headers)
                    assert response.status_code == 401, (headers, response.text)
                    assert response.json()["error"] == "unauthorized"
                    assert response.headers["www-authenticate"] == "Bearer"
            for path in ("/healthz", "/metrics", "/openapi.json"):  # open: no secrets there
                assert (await api.get(path)).status_code == 200, path
            await _until(lambda: api.get("/readyz"), lambda r: r.status_code == 200, "ready")
            doc = (await api.get("/openapi.json")).json()
            assert doc["paths"]["/v1/route"]["post"]["security"] == [{"bearer": []}]
        async with http(service, TOKEN) as api:
            response = await api.post("/v1/route", json=body)
            assert response.status_code == 200 and response.json()["peer"] is None, response.text
            assert (await api.post("/v1/route/batch", json={"requests": [body]})).status_code == 200


async def test_openapi_document_states_both_route_endpoints_and_their_bodies(etcd, tmp_path) -> None:
    async with AsyncExitStack() as stack:
        with router_service(tmp_path, *etcd.cli_args()) as service:
            api = await stack.enter_async_context(http(service))
            doc = (await api.get("/openapi.json")).json()
        # the service was stopped (SIGTERM, status 0) with this client's keep-alive connection still open
    paths = doc["paths"]
    assert {"/v1/route", "/v1/route/batch", "/healthz", "/readyz", "/metrics"} <= set(paths)
    schemas = doc["components"]["schemas"]
    for path, request, answer in (("/v1/route", "RouteRequest", "RouteAnswer"),
                                  ("/v1/route/batch", "BatchRequest", "BatchAnswer")):
        post = paths[path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{request}"}
        assert post["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{answer}"}
        assert {"400", "413", "422", "503"} <= set(post["responses"])
        assert "security" not in post  # on loopback without a token
    route = schemas["RouteRequest"]
    assert set(route["required"]) == {"namespace", "hashes"}
    assert route["properties"]["hashes"]["maxItems"] == 65_536
    assert route["properties"]["hashes"]["items"]["pattern"] == "^(?:[0-9a-fA-F]{16}|[0-9a-fA-F]{64})$"
    assert schemas["BatchRequest"]["properties"]["requests"]["items"] == {"$ref": "#/components/schemas/RouteRequest"}
    assert set(schemas["RouteAnswer"]["properties"]) == {"peer", "depth", "hint"}
    assert set(schemas["Peer"]["properties"]) == {"node_id", "address", "epoch"}


async def test_readyz_waits_for_the_snapshot_and_v1_answers_503_until_then(tmp_path) -> None:
    async def router_before_etcd(port: int) -> None:
        """The router told of an etcd on ``port`` that starts later (raises, saying so, if the port was taken)."""
        url = f"http://127.0.0.1:{port}"
        etcd_proc: EtcdProcess | None = None
        workdir = tmp_path / str(port)
        workdir.mkdir()
        try:
            with router_service(workdir, "--etcd", url, "--etcd-prefix", "/dkv-ready") as service:
                async with http(service) as api:
                    assert (await api.get("/healthz")).status_code == 200
                    not_ready = await api.get("/readyz")
                    assert not_ready.status_code == 503 and "no snapshot" in not_ready.json()["reason"], not_ready.text
                    early = await api.post("/v1/route", json={"namespace": NS, "hashes": ["00" * 8]})
                    assert early.status_code == 503 and early.json()["error"] == "not_ready", early.text
                    assert _metrics((await api.get("/metrics")).text)["dkv_router_ready"] == 0

                    etcd_proc = start_etcd(client_port=port)  # a port taken meanwhile: "address already in use"
                    await _until(lambda: api.get("/readyz"), lambda r: r.status_code == 200, "ready once etcd is up")
                    assert (await api.post("/v1/route", json={"namespace": NS, "hashes": ["00" * 8]})).status_code == 200
                    assert _metrics((await api.get("/metrics")).text)["dkv_router_ready"] == 1
        finally:
            if etcd_proc is not None:
                etcd_proc.stop()

    await on_a_free_port_awaited(router_before_etcd)


# ---- etcd restarts ----------------------------------------------------------------------------------


@pytest.fixture
def own_etcd() -> Iterator[list[EtcdProcess]]:
    """A dedicated etcd this test may stop and restart; every incarnation is stopped by its PID."""
    incarnations = [start_etcd()]
    yield incarnations
    for proc in incarnations[:-1]:
        if proc.alive():
            proc.stop(keep_data=True)
    incarnations[-1].stop()


async def test_an_etcd_restart_keeps_routes_answered_from_memory_and_new_publications_show_up_after(
        own_etcd, node_factory, clients, tmp_path) -> None:
    etcd = own_etcd[0]
    prefix = f"/dkv-router-restart/{uuid.uuid4().hex[:8]}"
    node = node_factory("--etcd", etcd.url, "--etcd-prefix", prefix, "--node-id", "n1", "--etcd-ttl", "10")
    writer = clients(node.address)
    before, after = _chain(4), _chain(3)
    await _write(writer, before)
    with router_service(tmp_path, "--etcd", etcd.url, "--etcd-prefix", prefix) as service:
        async with http(service) as api:
            async def depth(hashes: list[bytes]) -> int:
                response = await api.post("/v1/route", json={"namespace": NS, "hashes": _hex(hashes)})
                assert response.status_code == 200, response.text
                return response.json()["depth"]

            await _until(lambda: depth(before), lambda d: d == 4, "the first blocks routed")
            await _until(lambda: api.get("/readyz"), lambda r: r.status_code == 200, "ready")

            etcd.stop(keep_data=True)
            not_ready = await _until(lambda: api.get("/readyz"), lambda r: r.status_code == 503,
                                     "readyz 503 once the watch broke")
            assert "watch is down" in not_ready.json()["reason"], not_ready.text
            assert (await api.get("/healthz")).status_code == 200
            assert await depth(before) == 4, "answered from memory while etcd is away"
            assert _metrics((await api.get("/metrics")).text)["dkv_router_ready"] == 0

            own_etcd.append(etcd.restart())
            await _until(lambda: api.get("/readyz"), lambda r: r.status_code == 200, "ready again")
            await _write(writer, after)
            await _until(lambda: depth(after), lambda d: d == 3, "a publication made after the restart routed")
            assert await depth(before) == 4
            metrics = _metrics((await api.get("/metrics")).text)
            assert metrics["dkv_router_resyncs_total"] >= 1 and metrics["dkv_router_ready"] == 1
