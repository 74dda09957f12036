"""The ``dkv`` command line: ``serve`` runs a node, ``stats`` inspects one."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from dkv.errors import ConfigError, DKVError
from dkv.event_loop import run as run_loop
from dkv.stay_awake import DEFAULT_BOUND as STAY_AWAKE_BOUND
from dkv.units import format_size, parse_address, parse_size

app = typer.Typer(no_args_is_help=True, add_completion=False, help="dKV: distributed KV-cache store for LLM serving.")
DEFAULT_PORT = 7420
DEFAULT_METRICS_PORT = 9420


def read_token(token_file: Path | None) -> bytes | None:
    """The cluster token from a file (whitespace stripped); ``None`` without a file."""
    if token_file is None:
        env = os.environ.get("DKV_TOKEN")
        return env.encode() if env else None
    try:
        token = token_file.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {token_file}: {exc.strerror}") from exc
    if len(token) < 16:
        raise ConfigError(f"token in {token_file} is too short: use at least 16 characters")
    return token


LogLevelOption = Annotated[str, typer.Option(
    envvar="DKV_LOG_LEVEL",
    help="Logging level (debug, info, warning, error); UCX's own logging follows it (see README, Logging).")]


def setup_logging(level: str) -> None:
    """Log dKV at ``level`` (a name: debug, info, warning, error, critical) to stderr.

    Called before anything imports :mod:`dkv.transport`: UCX, UCXX and UCX-Py
    take their own levels from this one as ucxx is loaded
    (:func:`dkv.transport.ucx_log_levels`); an operator's ``UCX_LOG_LEVEL``,
    ``UCXX_LOG_LEVEL`` or ``UCXPY_LOG_LEVEL`` still wins.
    """
    name = level.strip().upper()
    if not isinstance(logging.getLevelName(name), int):
        fail(f"unknown log level {level!r}: use debug, info, warning, error or critical")
    logging.basicConfig(level=name, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _peer_control_port(value: str) -> int | None:
    """``--peer-control-port``: a port number (0: a free one) or ``off``."""
    if value.strip().lower() == "off":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--peer-control-port takes a port number or off, not {value!r}") from None


def _console() -> Console:
    """Stdout console; wide enough for the tables when stdout is not a terminal."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def fail(message: str) -> None:
    """Print a one-line error (no traceback) and exit with status 2."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


# ---- etcd connection options: one set, given to every command that takes --etcd ------------------

ETCD_OPTIONS: dict[str, Any] = {
    "etcd_ca": Annotated[Optional[Path], typer.Option(
        "--etcd-ca", envvar="DKV_ETCD_CA",
        help="CA certificate (PEM) that signed etcd's server certificate: turns on TLS (needed for https://).")],
    "etcd_cert": Annotated[Optional[Path], typer.Option(
        "--etcd-cert", envvar="DKV_ETCD_CERT",
        help="Client certificate (PEM) for an etcd with --client-cert-auth (with --etcd-key).")],
    "etcd_key": Annotated[Optional[Path], typer.Option(
        "--etcd-key", envvar="DKV_ETCD_KEY", help="The client certificate's private key (PEM).")],
    "etcd_user": Annotated[Optional[str], typer.Option(
        "--etcd-user", envvar="DKV_ETCD_USER", help="etcd user, for an etcd with authentication enabled.")],
    "etcd_password_file": Annotated[Optional[Path], typer.Option(
        "--etcd-password-file", envvar="DKV_ETCD_PASSWORD_FILE",
        help="File holding the etcd user's password (trailing newline ignored).")],
    "etcd_server_name": Annotated[Optional[str], typer.Option(
        "--etcd-server-name", envvar="DKV_ETCD_SERVER_NAME",
        help="Name etcd's TLS certificate must carry (default: the first endpoint's host).")],
}


def etcd_options(command: Any) -> Any:
    """Add the :data:`ETCD_OPTIONS` (TLS, authentication) to a command that takes ``--etcd``.

    The command declares ``etcd_settings: Any = None`` and receives a function
    that turns its ``--etcd`` endpoints into validated :class:`dkv.etcd.EtcdSettings`
    (it raises ConfigError, so call it where DKVError is reported).
    """
    signature = inspect.signature(command, eval_str=True)
    shown = [p for name, p in signature.parameters.items() if name != "etcd_settings"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
             for name, annotation in ETCD_OPTIONS.items()]

    @functools.wraps(command)
    def with_etcd_options(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name, None) for name in ETCD_OPTIONS}

        def settings(endpoints: str) -> Any:
            from dkv.etcd import EtcdSettings

            return EtcdSettings(endpoints, ca_file=given["etcd_ca"], cert_file=given["etcd_cert"],
                                key_file=given["etcd_key"], user=given["etcd_user"],
                                password_file=given["etcd_password_file"],
                                server_name=given["etcd_server_name"]).validate()

        return command(*args, etcd_settings=settings, **kwargs)

    with_etcd_options.__signature__ = signature.replace(parameters=[*shown, *added])  # type: ignore[attr-defined]
    with_etcd_options.__annotations__ = {**{p.name: p.annotation for p in shown}, **ETCD_OPTIONS,
                                         "return": signature.return_annotation}
    return with_etcd_options


@app.command()
@etcd_options
def serve(
    listen: Annotated[str, typer.Option(help="HOST:PORT to advertise and listen on (port 0 = any free port).")] = f"127.0.0.1:{DEFAULT_PORT}",
    pool: Annotated[str, typer.Option(help="Host pool size, e.g. 512MiB, 8GiB.")] = "1GiB",
    disk: Annotated[Optional[Path], typer.Option(help="Directory of the optional disk tier.")] = None,
    disk_size: Annotated[str, typer.Option(help="Byte cap of the disk tier, e.g. 20GiB.")] = "0",
    token_file: Annotated[Optional[Path], typer.Option(help="File holding the cluster token (required beyond loopback; without one only same-host clients of this OS user get in). DKV_TOKEN also works.")] = None,
    tenants: Annotated[Optional[Path], typer.Option(help="TOML file of tenant credentials: secret, namespaces, access, quotas (see README, Security).")] = None,
    max_namespaces: Annotated[int, typer.Option(help="Namespaces whose blocks the pool may hold at once (one memory segment each).")] = 256,
    node_id: Annotated[Optional[str], typer.Option(help="Node id (default: a random one).")] = None,
    namespace: Annotated[Optional[list[str]], typer.Option(help="Serve only these namespaces (repeatable; default: any).")] = None,
    lease_ttl: Annotated[float, typer.Option(help="Seconds a lookup's lease pins its blocks.")] = 10.0,
    max_leases: Annotated[int, typer.Option(help="Leases one client may hold; one more ends its oldest.")] = 64,
    max_leases_total: Annotated[int, typer.Option(help="Leases the node holds in all; at it a leased lookup is refused (busy) rather than end anyone's lease.")] = 65536,
    max_blocks: Annotated[Optional[int], typer.Option(help="Blocks the node indexes (any tier, reserved included; zero-byte ones too); at it the oldest go. Default: pool / 16 KiB, at least 16384.")] = None,
    max_reserved_per_connection: Annotated[Optional[str], typer.Option(help="Bytes one connection's uncommitted writes may reserve; beyond, keys are answered full. Default: pool/8, at least 256MiB.")] = None,
    read_ttl: Annotated[float, typer.Option(help="Seconds a read's own pins may last (a same-host copy that takes longer is failed).")] = 30.0,
    verify_writes: Annotated[bool, typer.Option("--verify-writes/--no-verify-writes", help="Check each written block against the checksum its writer declared before it becomes visible (a mismatch is not stored).")] = True,
    max_connections: Annotated[int, typer.Option(help="Connections the node holds in all; at it the longest-idle one that holds nothing live is closed for a new one, else the new one is refused (busy).")] = 1024,
    max_connections_per_credential: Annotated[Optional[int], typer.Option(help="Connections one credential may hold where its tenants entry sets none (default: half of --max-connections).")] = None,
    max_unauthenticated: Annotated[int, typer.Option(help="Connections still in their handshake at once; beyond, new ones are refused (busy).")] = 64,
    idle_timeout: Annotated[float, typer.Option(help="Seconds a connection may sit idle; then it is closed once it holds nothing live (clients reconnect by themselves).")] = 60.0,
    max_cost: Annotated[int, typer.Option(help="Hashes x leaves x shards one lookup, probe or touch may cost; more is refused (clients split unleased ones).")] = 16384,
    max_lookup_payload: Annotated[str, typer.Option(help="Block bytes a leased lookup's answer may carry for a client that asks (its load then needs no round trip); 0: never.")] = "1MiB",
    stay_awake_us: Annotated[int, typer.Option(help="Microseconds the node keeps polling for the next request after one that came back to back (a sleeping node's wake-up costs that much on a VM); 0: never.")] = round(STAY_AWAKE_BOUND * 1e6),
    peer_control_port: Annotated[str, typer.Option(help="TCP port, on the --listen host, of the control socket clients on other hosts send their control requests to (lookups, releases; lookups on their calling thread too). 0: a free one, announced in the handshake; off: none (they use UCX).")] = "0",
    etcd: Annotated[Optional[str], typer.Option(help="etcd endpoints URL[,URL...]: join a cluster (membership + directory).")] = None,
    cluster: Annotated[str, typer.Option(help="Cluster name (etcd keys live under PREFIX/CLUSTER/).")] = "default",
    etcd_prefix: Annotated[str, typer.Option(help="etcd key prefix.")] = "/dkv",
    etcd_ttl: Annotated[int, typer.Option(help="Seconds a dead node's membership and entries outlive it.")] = 10,
    publish_every: Annotated[int, typer.Option(help="Announce every k-th block of an offloaded run plus its last (1 = all).")] = 1,
    ready_file: Annotated[Optional[Path], typer.Option(help="Write a JSON line with the bound address here once serving.")] = None,
    metrics_listen: Annotated[Optional[str], typer.Option(envvar="DKV_METRICS_LISTEN", help="HOST:PORT of an HTTP endpoint serving /metrics (Prometheus), /healthz and /readyz; unauthenticated (metrics carry no secrets). Default port 9420; off unless given.")] = None,
    exit_with_parent: Annotated[bool, typer.Option(help="Stop (gracefully) once the process that started this node has exited.")] = False,
    log_level: LogLevelOption = "INFO",
    etcd_settings: Any = None,  # from @etcd_options: --etcd-ca, --etcd-cert, --etcd-key, --etcd-user, ...
) -> None:
    """Run a dKV node until SIGTERM or SIGINT (graceful: nothing is left behind)."""
    setup_logging(log_level)  # first: UCX reads its log level as dkv.transport is imported
    from dkv.credentials import load_tenants
    from dkv.server import NodeConfig

    try:
        host, port = parse_address(listen, DEFAULT_PORT)
        config = NodeConfig(
            pool_size=parse_size(pool),
            host=host,
            port=port,
            token=read_token(token_file),
            tenants=load_tenants(tenants) if tenants else None,
            max_namespaces=max_namespaces,
            namespaces=frozenset(namespace) if namespace else None,
            disk_dir=str(disk) if disk else None,
            disk_size=parse_size(disk_size),
            lease_ttl=lease_ttl,
            max_leases_per_client=max_leases,
            max_leases=max_leases_total,
            max_blocks=max_blocks,
            max_reserved_bytes_per_connection=parse_size(max_reserved_per_connection) if max_reserved_per_connection else None,
            read_ttl=read_ttl,
            verify_writes=verify_writes,
            max_connections=max_connections,
            max_connections_per_credential=max_connections_per_credential,
            max_unauthenticated=max_unauthenticated,
            idle_timeout=idle_timeout,
            max_cost=max_cost,
            max_lookup_payload=parse_size(max_lookup_payload),
            stay_awake=stay_awake_us / 1e6,
            peer_control_port=_peer_control_port(peer_control_port),
            **({"node_id": node_id} if node_id else {}),
        )
        cluster_config = None
        if etcd:
            from dkv.presence import ClusterConfig

            if not node_id:
                raise ConfigError("--etcd needs --node-id: the cluster knows a node by its id")
            cluster_config = ClusterConfig(etcd=etcd_settings(etcd), cluster=cluster, prefix=etcd_prefix, ttl=etcd_ttl,
                                           publish_every=publish_every)
        metrics_at = parse_address(metrics_listen, DEFAULT_METRICS_PORT) if metrics_listen else None
        run_loop(_serve(config, cluster_config, ready_file, exit_with_parent, metrics_at))
    except (DKVError, ValueError) as exc:
        fail(str(exc))


PARENT_CHECK_INTERVAL = 1.0


async def _when_parent_exits(parent: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once this process is no longer ``parent``'s child (the parent exited, however it died)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_INTERVAL)
    logging.getLogger(__name__).warning("the process that started this node (pid %d) exited: stopping", parent)
    stop.set()


async def _serve(config: Any, cluster_config: Any, ready_file: Path | None, exit_with_parent: bool = False,
                 metrics_at: tuple[str, int] | None = None) -> None:
    from dkv.server import NodeServer

    server = NodeServer(config, cluster_config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_when_parent_exits(os.getppid(), stop)) if exit_with_parent else None
    endpoint = None
    try:
        if metrics_at is not None:  # first: /healthz answers (and /readyz says why not) while the node starts
            endpoint = await _start_metrics(server, *metrics_at)
        await server.start()
        # "shm": the one file the node keeps under /dev/shm (a tokenless node's local credential), or ""
        credential = server.local_credential
        ready = {"address": server.address, "port": server.port, "node_id": config.node_id,
                 "pid": os.getpid(), "shm": credential.name if credential else "", "epoch": server.epoch,
                 "cluster": cluster_config.cluster if cluster_config else None}
        if endpoint is not None:
            ready["metrics_address"] = endpoint.address
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ready) + "\n")
            tmp.replace(ready_file)
        access = f"same-host clients only (credential {credential.path})" if credential else "cluster token"
        metrics = f"; metrics on http://{endpoint.address}/metrics" if endpoint is not None else ""
        print(f"dkv node {config.node_id} serving on {server.address} "
              f"(pool {format_size(server.arena.size)}, {access}){metrics}", flush=True)
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        if endpoint is not None:
            await endpoint.close()  # before the store it reads goes
        await server.stop()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        print(f"dkv node {config.node_id} stopped", flush=True)


async def _start_metrics(server: Any, host: str, port: int) -> Any:
    """The node's /metrics, /healthz and /readyz endpoint (dkv.metrics_http), serving; ConfigError if it cannot bind."""
    from dkv.metrics import node_registry
    from dkv.metrics_http import MetricsEndpoint

    endpoint = MetricsEndpoint(node_registry(server), server.not_ready)
    try:
        await endpoint.start(host, port)
    except OSError as exc:
        raise ConfigError(f"cannot listen for metrics on {host}:{port}: {exc.strerror or exc}") from None
    return endpoint


@app.command()
def stats(
    address: Annotated[str, typer.Argument(help="Node HOST:PORT.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    token_file: Annotated[Optional[Path], typer.Option(help="File holding the cluster token.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the node.")] = 5.0,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Show a node's tiers, index, leases and counters."""
    setup_logging(log_level)
    try:
        result = asyncio.run(_fetch_stats(address, read_token(token_file), timeout))
    except (DKVError, ValueError) as exc:
        fail(f"{address}: {exc}")
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return
    table = Table(title=f"dKV node {result['node_id']} at {result['address']}", show_header=False)
    host, disk = result["host"], result["disk"]
    rows = [
        ("epoch", result["epoch"]),
        ("uptime", f"{result['uptime_s']:.0f} s"),
        ("host pool", f"{format_size(host['used'])} / {format_size(host['total'])} used"
                      f" in {host['segments']} namespace segment(s)"),
        ("disk tier", (f"{format_size(disk['used'])} / {format_size(disk['total'])} used"
                       + (f" ({disk['state']})" if disk.get("state", "ok") != "ok" else "")) if disk["total"] else "off"),
        ("blocks", f"{result['blocks']} ({result['blocks_on_disk']} on disk)"),
        ("leases", f"{result['leases']} ({result['pinned_blocks']} blocks pinned)"),
        ("writes in flight", str(result["reservations"])),
        ("connections", f"{result['connections']} from {result['clients']} clients"),
        ("ops", ", ".join(f"{k}={v}" for k, v in sorted(result["ops"].items())) or "-"),
        ("errors", ", ".join(f"{k}={v}" for k, v in sorted(result["errors"].items())) or "-"),
    ]
    rows += [(name.replace("_", " "), str(value)) for name, value in result["counters"].items()]
    for name, value in rows:
        table.add_row(name, value)
    _console().print(table)


async def _fetch_stats(address: str, token: bytes | None, timeout: float) -> dict[str, Any]:
    from dkv.client import NodeClient
    from dkv.server import ADMIN_NAMESPACE
    from dkv.transport import stop_progress

    client = NodeClient(address, ADMIN_NAMESPACE, token=token, timeout=timeout, pool_size=1, retries=1)
    try:
        return await client.stats()
    finally:
        await client.close()
        await stop_progress()


# ---- cluster inspection ----------------------------------------------------------------------

EtcdOption = Annotated[str, typer.Option("--etcd", help="etcd endpoints URL[,URL...].", envvar="DKV_ETCD")]
ClusterOption = Annotated[str, typer.Option(help="Cluster name.")]
PrefixOption = Annotated[str, typer.Option("--etcd-prefix", help="etcd key prefix.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


async def _with_router(etcd: Any, cluster: str, prefix: str, fn: Any, *, follow: bool = False,
                       on_event: Any = None) -> Any:
    """Run ``fn(router, client)`` on a router of the cluster; ``etcd`` is an EtcdSettings (or a URL)."""
    from dkv.etcd import Layout, cluster_error, make_client
    from dkv.router import Router

    client = make_client(etcd)
    await client.connect()
    router = Router(client, Layout(cluster, prefix), on_event=on_event)
    try:
        await router.start(follow=follow)
        return await fn(router, client)
    except DKVError:
        raise
    except Exception as exc:  # etcd errors: say which endpoint and why, no traceback
        raise cluster_error(exc, getattr(client, "settings", None)) from exc
    finally:
        await router.stop()
        await client.close()


def _hashes(values: list[str]) -> list[bytes]:
    from dkv.keys import check_hash

    out = []
    for value in values:
        try:
            out.append(check_hash(bytes.fromhex(value)))
        except ValueError as exc:
            raise ConfigError(f"hash {value!r}: give 16 or 64 hex digits ({exc})") from exc
    return out


@app.command()
@etcd_options
def peers(etcd: EtcdOption, cluster: ClusterOption = "default", etcd_prefix: PrefixOption = "/dkv",
          as_json: JsonOption = False, etcd_settings: Any = None) -> None:
    """List the cluster's live peers: address, epoch, tiers, published blocks, lease TTL left."""

    async def collect(router: Any, client: Any) -> list[dict[str, Any]]:
        rows = []
        for node_id in sorted(router.members):
            member = router.members[node_id]
            ttl = None
            lease = router.lease_of.get(node_id)
            if lease:
                try:
                    ttl = int((await client.lease.time_to_live(lease, timeout=5.0)).TTL)
                except Exception:  # noqa: BLE001 - the peer may vanish between the two reads
                    ttl = None
            rows.append({**vars(member), "lease_ttl_left": ttl,
                         "state": "up" if ttl is None or ttl > 0 else "expiring"})
        return rows

    try:
        rows = asyncio.run(_with_router(etcd_settings(etcd), cluster, etcd_prefix, collect))
    except DKVError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return
    table = Table(title=f"dKV cluster {cluster!r}: {len(rows)} peer(s)")
    for column in ("id", "address", "epoch", "host used/total", "disk used/total", "published", "lease TTL", "state"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["node_id"], r["address"], r["epoch"],
                      f"{format_size(r['host_used'])} / {format_size(r['host_total'])}",
                      f"{format_size(r['disk_used'])} / {format_size(r['disk_total'])}" if r["disk_total"] else "off",
                      str(r["published"]), "-" if r["lease_ttl_left"] is None else f"{r['lease_ttl_left']} s",
                      r["state"])
    _console().print(table)


@app.command()
@etcd_options
def where(hashes: Annotated[list[str], typer.Argument(help="Block hashes in hex.")],
          ns: Annotated[str, typer.Option("--ns", help="Namespace.")], etcd: EtcdOption,
          cluster: ClusterOption = "default", etcd_prefix: PrefixOption = "/dkv", as_json: JsonOption = False,
          etcd_settings: Any = None) -> None:
    """Which live peers announced each hash."""
    try:
        wanted = _hashes(hashes)
        found = asyncio.run(_with_router(etcd_settings(etcd), cluster, etcd_prefix,
                                         lambda r, c: _async_value({h.hex(): sorted(r.holders(ns, h)) for h in wanted})))
    except DKVError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(found, indent=2))
        return
    table = Table(title=f"namespace {ns}")
    table.add_column("hash")
    table.add_column("peers")
    for h, holders in found.items():
        table.add_row(h, ", ".join(holders) or "-")
    _console().print(table)


@app.command()
@etcd_options
def route(hashes: Annotated[list[str], typer.Argument(help="The request's block hashes in hex, root first.")],
          ns: Annotated[str, typer.Option("--ns", help="Namespace.")], etcd: EtcdOption,
          cluster: ClusterOption = "default", etcd_prefix: PrefixOption = "/dkv", as_json: JsonOption = False,
          etcd_settings: Any = None) -> None:
    """The peer holding the longest prefix, how deep, and the request's dkv_cache_hint."""
    try:
        wanted = _hashes(hashes)
        chosen = asyncio.run(_with_router(etcd_settings(etcd), cluster, etcd_prefix,
                                          lambda r, c: _async_value(r.route(ns, wanted))))
    except DKVError as exc:
        fail(str(exc))
    result = {"peer": chosen.peer.node_id if chosen.peer else None,
              "address": chosen.peer.address if chosen.peer else None,
              "depth": chosen.depth, "of": len(wanted),
              "hint": json.loads(chosen.hint) if chosen.hint else None}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    if chosen.peer is None:
        _console().print(f"no live peer holds the root of these {len(wanted)} hashes in {ns}")
        return
    _console().print(f"peer [bold]{result['peer']}[/] at {result['address']} covers {chosen.depth} of {len(wanted)}")
    print(chosen.hint)


@app.command()
@etcd_options
def watch(etcd: EtcdOption, cluster: ClusterOption = "default", etcd_prefix: PrefixOption = "/dkv",
          count: Annotated[int, typer.Option(help="Stop after this many events (0 = never).")] = 0,
          duration: Annotated[float, typer.Option(help="Stop after this many seconds (0 = never).")] = 0.0,
          as_json: JsonOption = False, etcd_settings: Any = None) -> None:
    """Print join/leave/update/publish/unpublish events live (Ctrl-C to stop)."""
    done = asyncio.Event()
    seen = 0

    def show(event: Any) -> None:
        nonlocal seen
        seen += 1
        record = {"event": event.kind, "node": event.node_id, "namespace": event.namespace or None,
                  "hash": event.block_hash.hex() or None}
        print(json.dumps(record) if as_json else
              f"{event.kind:9s} {event.node_id}" + (f" {event.namespace} {event.block_hash.hex()}" if event.namespace else ""),
              flush=True)
        if count and seen >= count:
            done.set()

    async def follow(router: Any, client: Any) -> None:
        print(f"watching cluster {cluster!r}: {len(router.members)} peer(s), {router.entries} entries",
              file=sys.stderr if as_json else sys.stdout, flush=True)
        try:
            await asyncio.wait_for(done.wait(), duration or None)
        except asyncio.TimeoutError:
            pass

    try:
        asyncio.run(_with_router(etcd_settings(etcd), cluster, etcd_prefix, follow, follow=True, on_event=show))
    except DKVError as exc:
        fail(str(exc))


async def _async_value(value: Any) -> Any:
    return value


# ---- the router service -------------------------------------------------------------------------

router_app = typer.Typer(no_args_is_help=True, add_completion=False,
                         help="The router service: which peer holds a request's longest cached prefix, over HTTP.")
app.add_typer(router_app, name="router")


@router_app.command("serve")
@etcd_options
def router_serve(
    etcd: EtcdOption,
    listen: Annotated[str, typer.Option(
        envvar="DKV_ROUTER_LISTEN",
        help="HOST:PORT to listen on (port 0 = any free port). Beyond loopback a token is required.")] = "127.0.0.1:7430",
    cluster: ClusterOption = "default",
    etcd_prefix: PrefixOption = "/dkv",
    token_file: Annotated[Optional[Path], typer.Option(
        help="File holding the cluster token: /v1/* then need 'Authorization: Bearer <token>'. "
             "DKV_TOKEN also works.")] = None,
    log_level: LogLevelOption = "INFO",
    etcd_settings: Any = None,
) -> None:
    """Serve POST /v1/route, /v1/route/batch, /healthz, /readyz and /metrics until SIGTERM or SIGINT.

    Prints one JSON line {"address": "host:port", "pid": N} to stdout once serving (dkv.router_service).
    """
    setup_logging(log_level)
    from dkv.etcd import Layout
    from dkv.router_service import DEFAULT_ROUTER_PORT, bind, check_listen, run

    try:
        host, port = parse_address(listen, DEFAULT_ROUTER_PORT)
        token = read_token(token_file)
        check_listen(host, token)
        settings = etcd_settings(etcd)
        layout = Layout(cluster, etcd_prefix)
        asyncio.run(run(settings, layout, bind(host, port), token))
    except (DKVError, ValueError) as exc:
        fail(str(exc))


# ---- dkv explain (dkv.cli_explain) -------------------------------------------------------------

from dkv import cli_explain as _cli_explain  # noqa: E402 - `dkv explain`; it imports this module when registering

_cli_explain.register(app)


def _plug_in_commands() -> None:
    """Add commands other packages register under the ``dkv.commands`` entry-point group.

    ``dkv`` imports nothing of ``cluster`` or ``connector``; they plug in here
    (``dkv cluster ...``, ``dkv demo``).
    """
    from importlib.metadata import entry_points

    for entry in entry_points(group="dkv.commands"):
        try:
            command = entry.load()
        except ImportError as exc:
            logging.getLogger(__name__).debug("command %s unavailable: %s", entry.name, exc)
            continue
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=entry.name)
        else:
            app.command(entry.name)(command)


def main() -> None:
    _plug_in_commands()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
