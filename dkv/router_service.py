"""The router as an HTTP service: a gateway asks it, per request, which peer holds the longest cached prefix.

``dkv router serve`` runs this module: a FastAPI app over one
:class:`dkv.router.Router` whose index is fed by an etcd watch, served by
uvicorn on the same asyncio loop as the router (no threads). Every answer comes
from memory; etcd is never asked on a request's path.

API (the OpenAPI document at ``/openapi.json`` is generated from the models below):

- ``POST /v1/route`` ``{"namespace", "hashes": [hex, ...] (root first), "exclude"?, "requester"?}``
  → ``{"peer": {"node_id", "address", "epoch"} | null, "depth", "hint"}``
- ``POST /v1/route/batch`` ``{"requests": [<route body>, ...]}`` → ``{"routes": [<answer>, ...]}``
- ``GET /healthz`` (the process serves), ``GET /readyz`` (snapshot loaded and watch live),
  ``GET /metrics`` (Prometheus text).

Bad input is a 4xx JSON body ``{"error": code, "detail": text}`` naming the
problem; it never reaches the router. With a token (required when the service
listens beyond loopback), ``/v1/*`` need ``Authorization: Bearer <token>``.

Speed: a request's hashes are checked and decoded in a few C-speed passes (one
``bytes.fromhex`` over the joined string) rather than one by one; the router
then reads them through :class:`HashRun`, which cuts out a hash only when it is
asked for one, so a full hit costs one lookup whatever the request's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, overload

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, WithJsonSchema

from dkv.errors import ConfigError, DKVError
from dkv.keys import HASH_LENGTHS, check_namespace
from dkv.router import Route, Router
from dkv.units import is_loopback

log = logging.getLogger(__name__)

DEFAULT_ROUTER_PORT = 7430
MAX_HASHES = 65_536  # per request, and across all requests of one batch
MAX_BATCH = 1_024  # requests in one batch
MAX_EXCLUDE = 256  # node ids one request may exclude
MAX_BODY = 8 * 2**20  # bytes of request body (65,536 hashes of 32 bytes in hex are about 4.3 MiB)
HEX_WIDTHS = tuple(2 * n for n in HASH_LENGTHS)  # 16 or 64 hex digits
HASH_PATTERN = "^(?:[0-9a-fA-F]{16}|[0-9a-fA-F]{64})$"
SHUTDOWN_GRACE = 5.0  # seconds open connections get to finish when the service stops
LOAD_RETRY_MAX = 2.0  # seconds between attempts to load the first snapshot while etcd is away
DURATION_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)
DEPTH_BUCKETS = tuple(float(2**i) for i in range(17))  # 1 .. 65536 blocks


# ---- the API's models (what the OpenAPI document states) ----------------------------------------

# The length bounds are checked by pydantic (in Rust, cheap); the pattern by :func:`decode_hashes`
# (a regex per string in pydantic costs four times the whole parse). The schema states the whole rule.
HexHash = Annotated[str, StringConstraints(min_length=16, max_length=64), WithJsonSchema({
    "type": "string", "pattern": HASH_PATTERN, "minLength": 16, "maxLength": 64,
    "description": "A block hash in hex: 16 digits (8-byte ahash64, big-endian) or 64 digits (32-byte SHA-256).",
})]


class RouteRequest(BaseModel):
    """One request to route: its namespace and its block hashes, root first, all of one length."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(description="The dKV namespace the request's blocks live in (dkv.keys.check_namespace).",
                           examples=["tenant-a/5f1c0e6b2a9d4c71"])
    hashes: list[HexHash] = Field(
        max_length=MAX_HASHES,
        description=f"The request's block hashes in hex, root first, all 8-byte or all 32-byte "
                    f"(at most {MAX_HASHES}; more is answered 413).")
    exclude: list[str] = Field(default_factory=list, max_length=MAX_EXCLUDE,
                               description="Node ids not to route to (say, one that just failed this request).")
    requester: str | None = Field(
        default=None, max_length=256,
        description="The node id co-located with the engine the request goes to, where the gateway knows it: "
                    "the answer then names a peer only if it holds more than that node (the engine's own "
                    "connector already asks it), else no peer.")


class BatchRequest(BaseModel):
    """Many requests routed in one call; at most ``MAX_HASHES`` hashes across all of them."""

    model_config = ConfigDict(extra="forbid")

    requests: list[RouteRequest] = Field(
        max_length=MAX_BATCH,
        description=f"At most {MAX_BATCH} requests and {MAX_HASHES} hashes in all (more is answered 413).")


class Peer(BaseModel):
    """The chosen peer, as its member record in etcd names it."""

    node_id: str
    address: str = Field(description="The node's UCX listener, HOST:PORT.")
    epoch: str = Field(description="The node's epoch: a restarted node has a new one, and hints naming the old are stale.")


class RouteAnswer(BaseModel):
    """The live peer holding the longest prefix of the request's hashes, or none."""

    peer: Peer | None = Field(description="null when no live peer holds even the root block.")
    depth: int = Field(ge=0, description="How many leading blocks of the request the peer holds (0 with no peer).")
    hint: str | None = Field(description="The request's dkv_cache_hint JSON, to pass to the engine; null with no peer.")


class BatchAnswer(BaseModel):
    routes: list[RouteAnswer] = Field(description="One answer per request, in the requests' order.")


class ErrorAnswer(BaseModel):
    error: str = Field(description="A machine-readable code: invalid_request, invalid_json, too_large, "
                                   "unauthorized, not_ready.")
    detail: str = Field(description="What is wrong, for a person.")


class HealthAnswer(BaseModel):
    status: str
    reason: str | None = None


# ---- hashes: checked and decoded in bulk ---------------------------------------------------------


class BadRequest(Exception):
    """A request the service refuses: ``status`` (4xx), ``code`` and a ``detail`` naming the problem."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


_CUTTERS = {n: re.compile(b"(?s).{%d}" % n) for n in HASH_LENGTHS}  # cut bytes into hashes of n


class HashRun(Sequence[bytes]):
    """``n`` hashes of ``width`` bytes (8 or 32) held as one bytes object; a hash is cut out only when asked for.

    :meth:`Router.route` reads the last hash first, so a full hit never
    touches the others; iterating materialises the list once.
    """

    __slots__ = ("raw", "width", "n", "_list")

    def __init__(self, raw: bytes, width: int) -> None:
        self.raw, self.width = raw, width
        self.n = len(raw) // width if width else 0
        self._list: list[bytes] | None = None

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            if self._list is not None:
                return self._list[index]
            raw, w = self.raw, self.width
            return [raw[i * w:(i + 1) * w] for i in range(self.n)[index]]
        if index < 0:
            index += self.n
        if not 0 <= index < self.n:
            raise IndexError("hash index out of range")
        w = self.width
        return self.raw[index * w:(index + 1) * w]

    def as_list(self) -> list[bytes]:
        if self._list is None:
            # one C-speed pass (a third faster than a comprehension of slices)
            self._list = _CUTTERS[self.width].findall(self.raw) if self.width else []
        return self._list

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.as_list())


def decode_hashes(values: list[str], where: str = "hashes") -> HashRun:
    """Hex strings → a :class:`HashRun`; :class:`BadRequest` (422) naming the first bad one.

    Every string must be 16 or 64 hex digits, all of one length. Checked in
    bulk, for speed: the request model already bounds each string to 16..64
    characters, so a joined length of ``n`` times the first one's (16 or 64,
    the ends of that range) means every one has that length; one
    ``bytes.fromhex`` over the joined string then checks the digits, its output
    length catching the whitespace ``fromhex`` would skip. Only a bad request
    takes the slow path that finds the culprit.
    """
    if not values:
        return HashRun(b"", 0)
    width = len(values[0])
    joined = "".join(values)
    if width in HEX_WIDTHS and len(joined) == width * len(values):
        try:
            raw = bytes.fromhex(joined)
        except ValueError:
            raw = b""
        if len(raw) * 2 == len(joined):
            return HashRun(raw, width // 2)
    for i, value in enumerate(values):
        if len(value) not in HEX_WIDTHS:
            raise BadRequest(422, "invalid_request", f"{where}[{i}]: a hash is 16 or 64 hex digits "
                             f"(8 or 32 bytes), got {len(value)} characters")
        if len(value) != width:
            raise BadRequest(422, "invalid_request", f"{where}[{i}]: {len(value)} hex digits where {where}[0] "
                             f"has {width}; all hashes of one request are one length")
        try:
            if len(bytes.fromhex(value)) * 2 == len(value):
                continue
        except ValueError:
            pass
        raise BadRequest(422, "invalid_request", f"{where}[{i}]: not hex: {value[:70]!r}")
    raise BadRequest(422, "invalid_request", f"{where}: not hex")  # unreachable: some value failed above


def _validation_detail(exc: ValidationError) -> BadRequest:
    """A pydantic error → 422 naming the field (413 for a list over its cap); the input is never echoed whole."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".") or "body"
    if first["type"] == "json_invalid":
        return BadRequest(400, "invalid_json", f"the body is not JSON: {first['msg']}")
    if first["type"] == "too_long" and first["loc"] and first["loc"][-1] in ("hashes", "requests"):
        return BadRequest(413, "too_large", f"{loc}: {first['msg']}")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return BadRequest(422, "invalid_request", f"{loc}: {first['msg']}{more}")


# ---- metrics ------------------------------------------------------------------------------------


class RouterMetrics:
    """The service's Prometheus metrics, on its own registry (names as issue 14's interface fixes them)."""

    def __init__(self, router: Router, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("dkv_router_requests_total", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "code"], registry=self.registry)
        self.duration = Histogram("dkv_router_request_duration_seconds",
                                  "Handler time: from the request's body in hand to its answer built "
                                  "(parse, check, route, hint); not the HTTP transfer.",
                                  ["endpoint"], buckets=DURATION_BUCKETS, registry=self.registry)
        self.routes = Counter("dkv_router_routes_total", "Requests routed, by outcome (hit: some live peer holds "
                              "at least the root block).", ["outcome"], registry=self.registry)
        self.depth = Histogram("dkv_router_routed_depth_blocks", "Depth of each hit, in blocks.",
                               buckets=DEPTH_BUCKETS, registry=self.registry)
        self.hits, self.misses = self.routes.labels("hit"), self.routes.labels("miss")
        for endpoint in ("/v1/route", "/v1/route/batch"):
            self.duration.labels(endpoint)
        self.registry.register(_RouterState(router))

    def observe(self, route: Route) -> None:
        if route.peer is None:
            self.misses.inc()
        else:
            self.hits.inc()
            self.depth.observe(route.depth)


class _RouterState:
    """The router's own state, read at scrape time: members, index entries, ready, resyncs."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def describe(self) -> list[Any]:
        return []  # collected only at scrape time (the registry then needs no names up front)

    def collect(self) -> Iterator[Any]:
        router = self.router
        yield GaugeMetricFamily("dkv_router_members", "Live members in the index.", value=len(router.members))
        yield GaugeMetricFamily("dkv_router_index_entries", "Directory entries (namespace, hash, holder) in the index.",
                                value=router.entries)
        yield GaugeMetricFamily("dkv_router_ready", "1 when a snapshot is loaded and the etcd watch is live.",
                                value=1 if router.ready else 0)
        yield CounterMetricFamily("dkv_router_resyncs", "Snapshot reloads after the etcd watch broke.",
                                  value=router.resyncs)


# ---- the app --------------------------------------------------------------------------------------


@dataclass
class ServiceState:
    """What /readyz and the handlers need beyond the router: why it is not ready yet."""

    load_error: str | None = None
    stopping: bool = False


def _error(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps({"error": code, "detail": detail}), status_code=status,
                    media_type="application/json", headers=headers)


def _answer(route: Route) -> dict[str, Any]:
    peer = route.peer
    if peer is None:
        return {"peer": None, "depth": 0, "hint": None}
    return {"peer": {"node_id": peer.node_id, "address": peer.address, "epoch": peer.epoch},
            "depth": route.depth, "hint": route.hint}


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "The body is not JSON.", 401: "No or wrong bearer token.", 413: "Body, hashes or batch over the caps.",
            422: "A field is invalid (the detail names it).", 503: "No snapshot of the cluster loaded yet."}
    return {code: {"model": ErrorAnswer, "description": text[code]} for code in codes}


class RouteHandler:
    """What ``/v1/route`` and ``/v1/route/batch`` do with a body once it is in hand (the timed handler part).

    :meth:`route` and :meth:`batch` take the raw JSON body and return the JSON
    answer; bad input raises :class:`BadRequest`. No I/O: the benchmark times
    exactly this beside the HTTP round trip.
    """

    def __init__(self, router: Router, metrics: RouterMetrics | None = None) -> None:
        self.router = router
        self.metrics = metrics

    def route_one(self, body: RouteRequest) -> Route:
        try:
            namespace = check_namespace(body.namespace)
        except ValueError as exc:
            raise BadRequest(422, "invalid_request", f"namespace: {exc}") from None
        return self.router.route(namespace, decode_hashes(body.hashes), exclude=body.exclude,
                                 requester=body.requester)

    def _observe(self, route: Route) -> dict[str, Any]:
        if self.metrics is not None:
            self.metrics.observe(route)
        return _answer(route)

    def route(self, body: bytes) -> str:
        try:
            parsed = RouteRequest.model_validate_json(body)
        except ValidationError as exc:
            raise _validation_detail(exc) from None
        return json.dumps(self._observe(self.route_one(parsed)))

    def batch(self, body: bytes) -> str:
        try:
            parsed = BatchRequest.model_validate_json(body)
        except ValidationError as exc:
            raise _validation_detail(exc) from None
        total = sum(len(r.hashes) for r in parsed.requests)
        if total > MAX_HASHES:
            raise BadRequest(413, "too_large", f"{total} hashes in the batch, over the cap of {MAX_HASHES}")
        routes = []
        for i, one in enumerate(parsed.requests):
            try:
                routes.append(self.route_one(one))
            except BadRequest as exc:
                raise BadRequest(exc.status, exc.code, f"requests[{i}].{exc.detail}") from None
        return json.dumps({"routes": [self._observe(route) for route in routes]})  # counted once all are good


def create_app(router: Router, *, token: bytes | None = None, metrics: RouterMetrics | None = None,
               state: ServiceState | None = None) -> FastAPI:
    """The service's FastAPI app over ``router`` (started by the caller). ``token``: required on /v1/*."""
    metrics = metrics or RouterMetrics(router)
    state = state or ServiceState()
    app = FastAPI(title="dKV router", version="1",
                  description="Routes LLM requests to the dKV peer holding the longest cached prefix of their "
                              "KV blocks, from an in-memory index fed by an etcd watch.")
    app.state.metrics, app.state.router, app.state.service = metrics, router, state
    expected = b"Bearer " + token if token else None
    handler = RouteHandler(router, metrics)
    requests_total = metrics.requests

    def count(endpoint: str, code: int) -> None:
        requests_total.labels(endpoint, str(code)).inc()

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY:
            raise BadRequest(413, "too_large", f"body of {length} bytes is over the cap of {MAX_BODY}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise BadRequest(413, "too_large", f"body over the cap of {MAX_BODY} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def v1(request: Request, endpoint: str, answer: Callable[[bytes], str]) -> Response:
        code = 500
        try:
            if expected is not None:
                given = request.headers.get("authorization", "").encode("latin-1")
                if not hmac.compare_digest(given, expected):
                    code = 401
                    return _error(401, "unauthorized", "send the cluster token: Authorization: Bearer <token>",
                                  {"WWW-Authenticate": "Bearer"})
            body = await read_body(request)
            if not router.loaded:
                code = 503
                return _error(503, "not_ready", "no snapshot of the cluster loaded yet"
                              + (f" ({state.load_error})" if state.load_error else ""))
            started = time.perf_counter()
            content = answer(body)
            metrics.duration.labels(endpoint).observe(time.perf_counter() - started)
            code = 200
            return Response(content, media_type="application/json")
        except BadRequest as exc:
            code = exc.status
            return _error(exc.status, exc.code, exc.detail)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer (counted as nginx does, 499)
            code = 499
            return Response(status_code=400)
        finally:
            count(endpoint, code)

    secured = {"security": [{"bearer": []}]} if token else {}

    def body_schema(model: type[BaseModel]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}, **secured}

    @app.post("/v1/route", response_model=RouteAnswer, openapi_extra=body_schema(RouteRequest),
              responses=_error_responses(400, 401, 413, 422, 503), summary="Route one request")
    async def route(request: Request) -> Response:
        """The live peer holding the longest prefix of the request's hashes, how deep, and its dkv_cache_hint."""
        return await v1(request, "/v1/route", handler.route)

    @app.post("/v1/route/batch", response_model=BatchAnswer, openapi_extra=body_schema(BatchRequest),
              responses=_error_responses(400, 401, 413, 422, 503), summary="Route many requests")
    async def route_batch(request: Request) -> Response:
        """Each request routed as by /v1/route; answers in the requests' order."""
        return await v1(request, "/v1/route/batch", handler.batch)

    @app.get("/healthz", response_model=HealthAnswer, summary="Liveness")
    async def healthz() -> Response:
        """200 while the process serves (its event loop answers)."""
        count("/healthz", 200)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz", response_model=HealthAnswer, responses={503: {"model": HealthAnswer}}, summary="Readiness")
    async def readyz() -> Response:
        """200 once a snapshot of the cluster is loaded and the etcd watch is live; 503 with the reason otherwise."""
        if router.ready and not state.stopping:
            count("/readyz", 200)
            return JSONResponse({"status": "ready"})
        if state.stopping:
            reason = "stopping"
        elif not router.loaded:
            reason = "no snapshot of the cluster loaded yet" + (f": {state.load_error}" if state.load_error else "")
        else:
            reason = "the etcd watch is down: answering from the last snapshot while it reconnects"
        count("/readyz", 503)
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text exposition."}})
    async def prometheus_metrics() -> Response:
        count("/metrics", 200)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the request models the /v1 bodies refer to (parsed by hand, for speed)."""
        if app.openapi_schema is None:
            doc = default_openapi()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (RouteRequest, BatchRequest):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            if token:
                doc["components"].setdefault("securitySchemes", {})["bearer"] = {
                    "type": "http", "scheme": "bearer", "description": "The cluster token."}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# ---- running it -----------------------------------------------------------------------------------


def check_listen(host: str, token: bytes | None) -> None:
    """A service listening beyond loopback must have a token (ConfigError otherwise)."""
    if token is None and not is_loopback(host):
        raise ConfigError(f"listening on {host} (beyond loopback) needs the cluster token: "
                          "give --token-file or set DKV_TOKEN")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound here, so a taken port is a clear ConfigError rather than uvicorn's exit)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve listen host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ConfigError(f"cannot listen on {shown}: {exc.strerror}") from None
    return sock


async def _load(router: Router, state: ServiceState) -> None:
    """Start the router (snapshot, then watch), retrying while etcd is away; /readyz says why meanwhile."""
    delay = 0.1
    while True:
        try:
            await router.start(follow=True)
            state.load_error = None
            log.info("router snapshot loaded: %d members, %d entries", len(router.members), router.entries)
            return
        except DKVError as exc:
            state.load_error = str(exc)
            log.warning("cannot load the cluster snapshot (again in %.1f s): %s", delay, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, LOAD_RETRY_MAX)


async def serve(router: Router, sock: socket.socket, *, token: bytes | None, stop: asyncio.Event,
                on_ready: Callable[[str], None] | None = None) -> None:
    """Serve the app on ``sock`` until ``stop`` is set; the router is started here and stopped on the way out.

    uvicorn runs on this loop beside the router's watch; its own signal
    handling is off (the caller sets ``stop``). ``on_ready(address)`` is called
    once the socket accepts requests. Open connections get ``SHUTDOWN_GRACE``
    seconds to finish.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the caller owns SIGTERM/SIGINT
            yield

    state = ServiceState()
    app = create_app(router, token=token, state=state)
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning", log_config=None,
                            timeout_graceful_shutdown=int(SHUTDOWN_GRACE), server_header=False)
    server = _Server(config)
    loader = asyncio.create_task(_load(router, state), name="dkv-router-load")
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="dkv-router-http")
    stopped = asyncio.create_task(stop.wait(), name="dkv-router-stop")
    try:
        while not server.started and not serving.done() and not stop.is_set():
            await asyncio.sleep(0.01)
        if server.started and on_ready is not None:
            host, port = sock.getsockname()[:2]
            on_ready(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        state.stopping = True
        server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(serving), SHUTDOWN_GRACE + 2)
        for task in (serving, loader, stopped):
            task.cancel()
        await asyncio.gather(serving, loader, stopped, return_exceptions=True)
        await router.stop()
        sock.close()
    if serving.done() and not serving.cancelled() and serving.exception() is not None and not stop.is_set():
        raise ConfigError(f"the HTTP server failed: {serving.exception()}")


async def run(settings: Any, layout: Any, sock: socket.socket, token: bytes | None) -> None:
    """``dkv router serve``: connect to etcd, serve on ``sock`` until SIGTERM or SIGINT, print the ready line.

    ``settings`` are the :class:`dkv.etcd.EtcdSettings`, ``layout`` the cluster's :class:`dkv.etcd.Layout`.
    The ready line is one JSON object on stdout: ``{"address": "host:port", "pid": N}``.
    """
    from dkv.etcd import make_client

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = make_client(settings)
    try:
        await client.connect()
        await serve(Router(client, layout), sock, token=token, stop=stop,
                    on_ready=lambda address: print(json.dumps({"address": address, "pid": os.getpid()}), flush=True))
    finally:
        sock.close()
        await client.close()
        print("dkv router stopped", flush=True)


__all__ = [
    "BatchAnswer", "BatchRequest", "DEFAULT_ROUTER_PORT", "HashRun", "MAX_BATCH", "MAX_BODY", "MAX_HASHES",
    "RouteAnswer", "RouteHandler", "RouteRequest", "RouterMetrics", "bind", "check_listen", "create_app", "decode_hashes", "run",
    "serve",
]
