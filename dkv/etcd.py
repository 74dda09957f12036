"""etcd access for dKV: endpoints, the key layout, and a bounded client.

Key layout (DESIGN contract 10), everything under one prefix per cluster::

    <prefix>/<cluster>/nodes/<node_id>                        member record (JSON), on the node's lease
    <prefix>/<cluster>/blocks/<namespace>/<hash hex>/<node_id>  directory entry, on the node's lease

A namespace may itself contain ``/``; the hash and node id are the last two
components, so keys parse from the right. Values of directory entries are the
publishing epoch, so a reader can tell a stale entry from a fresh one.

How to reach etcd is one :class:`EtcdSettings` (endpoints, TLS files, user and
password file; ``EtcdSettings.from_env()`` reads ``DKV_ETCD*``), turned into a
client by :func:`make_client`; :func:`cluster_error` explains a refusal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from etcd3aio import Etcd3Client, EtcdConnectionError, EtcdPermissionDeniedError, EtcdUnauthenticatedError
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest, WatchStub

from dkv.errors import ClusterError, ConfigError, DKVError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/dkv"
DEFAULT_CLUSTER = "default"
DEFAULT_ETCD_TIMEOUT = 5.0
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


def parse_endpoints(text: str | Sequence[str]) -> list[str]:
    """``"http://a:2379,b:2379"`` → ``["a:2379", "b:2379"]`` (scheme stripped, port required)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    endpoints = []
    for item in items:
        item = item.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        item = item.rstrip("/")
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {item!r} must be HOST:PORT (or http://HOST:PORT)")
        endpoints.append(item)
    if not endpoints:
        raise ConfigError("at least one etcd endpoint is needed")
    return endpoints


def prefix_end(prefix: str) -> bytes:
    """The exclusive end of the key range under ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


RANGE_PAGE = 2000


async def get_prefix(client: Etcd3Client, prefix: str, *, keys_only: bool = False,
                     timeout: float = DEFAULT_ETCD_TIMEOUT, page: int = RANGE_PAGE) -> tuple[list[Any], int]:
    """Every key-value under ``prefix`` at one revision, read in pages (a directory outgrows one gRPC message).

    Returns ``(kvs, revision)``.
    """
    end = prefix_end(prefix)
    start = prefix.encode()
    revision = 0
    kvs: list[Any] = []
    while True:
        response = await client.kv.get(start, range_end=end, revision=revision, limit=page,
                                       keys_only=keys_only, timeout=timeout)
        revision = revision or response.header.revision
        kvs.extend(response.kvs)
        if not response.more or not response.kvs:
            return kvs, revision
        start = response.kvs[-1].key + b"\0"


def check_node_id(node_id: str) -> str:
    """A node id: 1-64 characters of ``[A-Za-z0-9._-]`` (it is one etcd key component)."""
    if not isinstance(node_id, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", node_id):
        raise ConfigError(f"node id must be 1-64 characters of [A-Za-z0-9._-]: {node_id!r}")
    return node_id


ETCD_ENV = {  # EtcdSettings field -> environment variable (the CLI options read the same ones)
    "endpoints": "DKV_ETCD",
    "ca_file": "DKV_ETCD_CA",
    "cert_file": "DKV_ETCD_CERT",
    "key_file": "DKV_ETCD_KEY",
    "user": "DKV_ETCD_USER",
    "password_file": "DKV_ETCD_PASSWORD_FILE",
    "server_name": "DKV_ETCD_SERVER_NAME",
}
AUTH_REFRESH = 30.0  # seconds between re-authentications (a restarted etcd forgets its tokens)
# How soon a client dials etcd again after losing it. gRPC's own reconnect backoff grows to 120 s
# (1 s x 1.6 per failed attempt) and etcd3aio's watch backoff to 5 s: after a 20 s outage a client
# came back 6-11 s after etcd did. Capped here, a client is back within about RECONNECT_MAX of etcd,
# at the cost of one connection attempt per RECONNECT_MAX per client while etcd is away.
RECONNECT_MIN = 0.1  # seconds
RECONNECT_MAX = 1.0  # seconds


@dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd: endpoints, and optionally TLS and user/password authentication.

    ``endpoints`` is ``URL[,URL...]``. An ``https://`` endpoint (or any endpoint
    with ``ca_file`` given) is reached over TLS, verified against ``ca_file``
    (PEM); ``cert_file``/``key_file`` are the client certificate and key that
    etcd's ``--client-cert-auth`` asks for. ``user`` authenticates with the
    password read from ``password_file`` (trailing newline dropped): a password
    is never a command-line value. ``password`` may be given instead by code
    (the connector), never printed. ``server_name`` is the name the server
    certificate must carry (default: the first endpoint's host).
    """

    endpoints: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password_file: str | None = None
    password: str | None = field(default=None, repr=False, compare=False)
    server_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.endpoints, str):  # a list of URLs is fine too
            object.__setattr__(self, "endpoints", ",".join(self.endpoints))
        for name in ("ca_file", "cert_file", "key_file", "password_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, str(value))  # a Path

    @classmethod
    def from_env(cls, endpoints: str | None = None, environ: Mapping[str, str] | None = None,
                 **overrides: Any) -> EtcdSettings:
        """Settings from ``DKV_ETCD``, ``DKV_ETCD_CA``, ``DKV_ETCD_CERT``, ``DKV_ETCD_KEY``, ``DKV_ETCD_USER``,
        ``DKV_ETCD_PASSWORD_FILE`` and ``DKV_ETCD_SERVER_NAME``; ``endpoints`` and non-None ``overrides`` win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {name: env.get(var) or None for name, var in ETCD_ENV.items()}
        values.update({k: v for k, v in overrides.items() if v is not None})
        if endpoints:
            values["endpoints"] = endpoints
        if not values["endpoints"]:
            raise ConfigError("no etcd endpoints: give --etcd URL (or set DKV_ETCD)")
        return cls(**values)

    # ---- derived ---------------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [u.strip() for u in self.endpoints.split(",") if u.strip()]

    @property
    def tls(self) -> bool:
        """True when the endpoints are reached over TLS (``https://``, or any TLS file given)."""
        return any(u.startswith("https://") for u in self.urls) or bool(self.ca_file or self.cert_file)

    def describe(self) -> str:
        """The endpoints and what secures them, for messages (never the password)."""
        parts = ["TLS" + (" + client certificate" if self.cert_file else "")] if self.tls else []
        if self.user:
            parts.append(f"user {self.user!r}")
        return self.endpoints + (f" ({', '.join(parts)})" if parts else "")

    def validate(self) -> EtcdSettings:
        """Check the settings hang together and their files are readable; returns ``self``. Raises ConfigError."""
        parse_endpoints(self.endpoints)
        schemes = {u.split("://", 1)[0] for u in self.urls if "://" in u}
        if not schemes <= {"http", "https"}:
            raise ConfigError(f"etcd endpoints must be http:// or https:// URLs (or HOST:PORT): {self.endpoints}")
        if schemes == {"http", "https"}:
            raise ConfigError(f"etcd endpoints mix http:// and https://: {self.endpoints}")
        if schemes == {"http"} and (self.ca_file or self.cert_file or self.key_file):
            raise ConfigError(f"--etcd-ca/--etcd-cert/--etcd-key are TLS settings but etcd is given as "
                              f"{self.endpoints}: use https://HOST:PORT endpoints")
        if self.tls and not self.ca_file:
            raise ConfigError(f"etcd at {self.endpoints} is reached over TLS: give --etcd-ca (DKV_ETCD_CA), "
                              f"the CA certificate (PEM) that signed etcd's server certificate")
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("--etcd-cert and --etcd-key go together: the client certificate and its key")
        for label, path in (("--etcd-ca", self.ca_file), ("--etcd-cert", self.cert_file),
                            ("--etcd-key", self.key_file)):
            if path:
                _read_file(label, path)
        if self.user and self.password is None and not self.password_file:
            raise ConfigError(f"--etcd-user {self.user} needs --etcd-password-file (DKV_ETCD_PASSWORD_FILE)")
        if (self.password is not None or self.password_file) and not self.user:
            raise ConfigError("an etcd password needs --etcd-user (DKV_ETCD_USER)")
        if self.user:
            self.read_password()
        return self

    def read_password(self) -> str | None:
        """The password (from ``password`` or ``password_file``), or ``None`` without a user."""
        if not self.user:
            return None
        if self.password is not None:
            return self.password
        assert self.password_file is not None
        password = _read_file("--etcd-password-file", self.password_file).decode().rstrip("\r\n")
        if not password:
            raise ConfigError(f"etcd password file {self.password_file} is empty")
        return password

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`etcd3aio.Etcd3Client` for TLS (empty without TLS)."""
        if not self.tls:
            return {}
        assert self.ca_file is not None
        kwargs: dict[str, Any] = {"ca_cert": _read_file("--etcd-ca", self.ca_file)}
        if self.cert_file and self.key_file:
            kwargs["cert_chain"] = _read_file("--etcd-cert", self.cert_file)
            kwargs["cert_key"] = _read_file("--etcd-key", self.key_file)
        kwargs["tls_server_name"] = self.server_name or parse_endpoints(self.endpoints)[0].rpartition(":")[0]
        return kwargs

    def cli_args(self) -> list[str]:
        """These settings as ``dkv`` command-line options (a password only by its file)."""
        if self.user and not self.password_file:
            raise ConfigError("etcd settings with an in-memory password cannot be passed on as options: "
                              "give password_file")
        args = ["--etcd", self.endpoints]
        for option, value in (("--etcd-ca", self.ca_file), ("--etcd-cert", self.cert_file),
                              ("--etcd-key", self.key_file), ("--etcd-user", self.user),
                              ("--etcd-password-file", self.password_file),
                              ("--etcd-server-name", self.server_name)):
            if value:
                args += [option, value]
        return args


def _read_file(label: str, path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"{label} {path}: cannot read it ({exc.strerror})") from exc


def _resolve(endpoint: str) -> str:
    """``host:port`` with the host as an IPv4 address (etcd3aio dials ``ipv4:`` targets only)."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.inet_aton(host)
        return endpoint
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"etcd endpoint {endpoint}: cannot resolve {host!r} to an IPv4 address ({exc})") from exc
    return f"{infos[0][4][0]}:{port}"


class EtcdClient(Etcd3Client):
    """An etcd3aio client made from :class:`EtcdSettings`.

    TLS is set up from the settings' files; with a user, :meth:`connect`
    authenticates (a refusal is a :class:`ClusterError` saying why) and a
    background task re-authenticates every ``AUTH_REFRESH`` seconds until
    :meth:`close`, so a long-lived client outlives token expiry and etcd restarts.
    After an outage the channel and its watches dial etcd again at most
    ``RECONNECT_MAX`` seconds apart, so they are back about that long after etcd is.
    """

    def __init__(self, settings: EtcdSettings, *, timeout: float = DEFAULT_ETCD_TIMEOUT, **extra: Any) -> None:
        self.settings = settings
        self.timeout = timeout
        tls = {**settings.client_kwargs(), **extra}
        super().__init__([_resolve(e) for e in parse_endpoints(settings.endpoints)], rpc_max_attempts=2,
                         watch_reconnect_backoff_seconds=RECONNECT_MIN,
                         watch_max_reconnect_backoff_seconds=RECONNECT_MAX, **tls)
        self._manager.grpc_options.extend(_reconnect_options())
        self._refresher: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await super().connect()
        if self.settings.user:
            try:
                await self.authenticate()
            except BaseException:
                await super().close()
                raise
            self._refresher = asyncio.create_task(self._refresh_forever(), name="dkv-etcd-auth")

    async def authenticate(self) -> None:
        """Get a token for the settings' user and send it with every call. Raises ClusterError."""
        assert self.auth is not None and self.settings.user
        try:
            response = await self.auth.authenticate(self.settings.user, self.settings.read_password() or "",
                                                    timeout=self.timeout)
        except (asyncio.CancelledError, ConfigError):
            raise
        except Exception as exc:  # noqa: BLE001 - translated, with what to check
            raise cluster_error(exc, self.settings, f"authenticating as {self.settings.user!r}") from None
        self.set_token(response.token)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(AUTH_REFRESH)
            try:
                await self.authenticate()
            except DKVError as exc:
                log.warning("etcd re-authentication failed (the current token is kept): %s", exc)

    async def watch_range(self, key: str, range_end: bytes, start_revision: int) -> AsyncIterator[Any]:
        """One watch stream of ``[key, range_end)`` from ``start_revision``: its responses, until it breaks.

        Raises whatever broke it; no reconnect here (the caller resumes).
        etcd3aio's own ``watch`` reconnects by itself, and each stream that
        fails leaves a task behind, waiting forever for its next request (gRPC
        cancels a call's request task only while the call is live); here the
        request side ends with the stream, so nothing is left.
        """
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[WatchRequest]:
            yield WatchRequest(create_request=WatchCreateRequest(key=key.encode(), range_end=range_end,
                                                                 start_revision=start_revision))
            await ended.wait()

        if self._channel is None:
            raise ClusterError("the etcd client is not connected")
        token = self._token
        stream = WatchStub(self._channel).Watch(requests(), metadata=(("token", token),) if token else None)
        try:
            async for response in stream:
                yield response
        finally:
            ended.set()
            stream.cancel()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None
        await super().close()


def _reconnect_options() -> list[tuple[str, int]]:
    """gRPC channel options that cap its reconnect backoff at ``RECONNECT_MAX`` (see there).

    Not ``grpc.min_reconnect_backoff_ms``: gRPC takes that as the shortest time
    one connection attempt is given (20 s by default), which a TLS handshake
    on a loaded machine may need.
    """
    return [("grpc.initial_reconnect_backoff_ms", int(RECONNECT_MIN * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX * 1000))]


def make_client(endpoints: str | Sequence[str] | EtcdSettings, **tls: Any) -> EtcdClient:
    """An unconnected etcd client (``await client.connect()``).

    ``endpoints`` is an :class:`EtcdSettings` (TLS, authentication), or a plain
    ``URL[,URL...]`` for a cluster with neither. ``tls`` (ca_cert, cert_key,
    cert_chain as bytes) is passed to etcd3aio as it is. Raises ConfigError.
    """
    settings = endpoints if isinstance(endpoints, EtcdSettings) else EtcdSettings(endpoints)
    if not tls:
        settings.validate()
    return EtcdClient(settings, **tls)


def _grpc_text(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    if callable(details) and callable(code):  # a raw grpc.aio.AioRpcError: its str() is a multi-line dump
        return f"{code().name}: {details()}"
    return str(exc)


def cluster_error(exc: BaseException, settings: EtcdSettings | None, doing: str = "talking to etcd") -> ClusterError:
    """A :class:`ClusterError` for an etcd failure: where, what etcd or gRPC said, and what to check."""
    if isinstance(exc, ClusterError):
        return exc
    text = _grpc_text(exc)
    low = text.lower()
    where = settings.describe() if settings else "etcd"
    hint = ""
    refused_auth = ("user name is empty", "invalid auth token", "authentication failed", "invalid user id or password",
                    "authentication is not enabled")
    if isinstance(exc, EtcdUnauthenticatedError) or any(s in low for s in refused_auth):
        hint = ("etcd refused the user name or password: check --etcd-user and --etcd-password-file"
                if settings and settings.user else
                "etcd requires authentication: give --etcd-user and --etcd-password-file "
                "(DKV_ETCD_USER, DKV_ETCD_PASSWORD_FILE)")
    elif isinstance(exc, EtcdPermissionDeniedError) or "permission denied" in low:
        hint = "the etcd user may not read and write this cluster's keys: grant its role readwrite on the prefix"
    elif "hostname verification" in low:
        hint = ("etcd's certificate does not name the host dialled: give --etcd-server-name, a name "
                "its certificate carries")
    elif settings is not None and settings.tls and any(
            s in low for s in ("handshake", "certificate", "ssl", "tls", "tsi_", "socket closed", "unavailable")):
        hint = ("the TLS handshake failed: --etcd-ca must be the CA that signed etcd's certificate, and with "
                "etcd's --client-cert-auth give --etcd-cert/--etcd-key signed by a CA etcd trusts")
    elif isinstance(exc, EtcdConnectionError) or "unavailable" in low:
        hint = ("is etcd running there? If it serves TLS, use https:// endpoints with --etcd-ca "
                "(and --etcd-cert/--etcd-key when it requires client certificates)")
    return ClusterError(f"{doing} at etcd {where} failed: {text}" + (f" — {hint}" if hint else ""))


@dataclass(frozen=True)
class Layout:
    """Where a cluster's keys live in etcd."""

    cluster: str = DEFAULT_CLUSTER
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.cluster or "/" in self.cluster:
            raise ConfigError(f"cluster name must be non-empty and contain no '/': {self.cluster!r}")

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.cluster}/"

    @property
    def nodes(self) -> str:
        return f"{self.root}nodes/"

    @property
    def blocks(self) -> str:
        return f"{self.root}blocks/"

    def node_key(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    def block_key(self, namespace: str, block_hash: bytes, node_id: str) -> str:
        return f"{self.blocks}{namespace}/{block_hash.hex()}/{node_id}"

    def block_prefix(self, namespace: str, block_hash: bytes) -> str:
        return f"{self.blocks}{namespace}/{block_hash.hex()}/"

    def parse_block_key(self, key: str) -> tuple[str, bytes, str] | None:
        """``(namespace, hash, node_id)`` of a directory key, or ``None`` if it is not one."""
        if not key.startswith(self.blocks):
            return None
        namespace, _, rest = key[len(self.blocks):].rpartition("/")
        namespace, _, hash_hex = namespace.rpartition("/")
        node_id = rest
        try:
            block_hash = bytes.fromhex(hash_hex)
        except ValueError:
            return None
        if not namespace or not node_id or len(block_hash) not in (8, 32):
            return None
        return namespace, block_hash, node_id

    def parse_node_key(self, key: str) -> str | None:
        if not key.startswith(self.nodes):
            return None
        node_id = key[len(self.nodes):]
        return node_id if node_id and "/" not in node_id else None


@dataclass
class MemberRecord:
    """What a node says about itself in etcd (the value of its member key)."""

    node_id: str
    address: str  # UCX listener host:port
    epoch: str
    protocol_version: int
    started_at: float
    host_id: str
    worker_address: str = ""  # hex of the UCX worker address, for same-host endpoints
    host_total: int = 0
    host_used: int = 0
    disk_total: int = 0
    disk_used: int = 0
    blocks: int = 0
    published: int = 0
    publish_every: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> MemberRecord | None:
        """Parse a member value; ``None`` when it is not a record this version understands."""
        try:
            data = json.loads(raw)
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            return cls(**known)
        except (ValueError, TypeError, KeyError):
            return None
