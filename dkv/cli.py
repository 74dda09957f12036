"""The ``dkv`` command line: ``serve`` runs a node, ``stats`` inspects one."""

from __future__ import annotations

import asyncio
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
from dkv.units import format_size, parse_address, parse_size

app = typer.Typer(no_args_is_help=True, add_completion=False, help="dKV: distributed KV-cache store for LLM serving.")
DEFAULT_PORT = 7420


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


def _fail(message: str) -> None:
    Console(stderr=True).print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


@app.command()
def serve(
    listen: Annotated[str, typer.Option(help="HOST:PORT to advertise and listen on (port 0 = any free port).")] = f"127.0.0.1:{DEFAULT_PORT}",
    pool: Annotated[str, typer.Option(help="Host pool size, e.g. 512MiB, 8GiB.")] = "1GiB",
    disk: Annotated[Optional[Path], typer.Option(help="Directory of the optional disk tier.")] = None,
    disk_size: Annotated[str, typer.Option(help="Byte cap of the disk tier, e.g. 20GiB.")] = "0",
    token_file: Annotated[Optional[Path], typer.Option(help="File holding the cluster token (required beyond loopback). DKV_TOKEN also works.")] = None,
    node_id: Annotated[Optional[str], typer.Option(help="Node id (default: a random one).")] = None,
    namespace: Annotated[Optional[list[str]], typer.Option(help="Serve only these namespaces (repeatable; default: any).")] = None,
    lease_ttl: Annotated[float, typer.Option(help="Seconds a lookup's lease pins its blocks.")] = 10.0,
    max_leases: Annotated[int, typer.Option(help="Leases one client may hold; one more ends its oldest.")] = 64,
    ready_file: Annotated[Optional[Path], typer.Option(help="Write a JSON line with the bound address here once serving.")] = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Run a dKV node until SIGTERM or SIGINT (graceful: nothing is left behind)."""
    from dkv.server import NodeConfig, NodeServer

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        host, port = parse_address(listen, DEFAULT_PORT)
        config = NodeConfig(
            pool_size=parse_size(pool),
            host=host,
            port=port,
            token=read_token(token_file),
            namespaces=frozenset(namespace) if namespace else None,
            disk_dir=str(disk) if disk else None,
            disk_size=parse_size(disk_size),
            lease_ttl=lease_ttl,
            max_leases_per_client=max_leases,
            **({"node_id": node_id} if node_id else {}),
        )
        asyncio.run(_serve(config, ready_file))
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))


async def _serve(config: Any, ready_file: Path | None) -> None:
    from dkv.server import NodeServer

    server = NodeServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        ready = {"address": server.address, "port": server.port, "node_id": config.node_id,
                 "pid": os.getpid(), "shm": server.arena.shm_name, "epoch": server.epoch}
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ready) + "\n")
            tmp.replace(ready_file)
        print(f"dkv node {config.node_id} serving on {server.address} "
              f"(pool {format_size(server.arena.size)}, shm {server.arena.shm_name})", flush=True)
        await stop.wait()
    finally:
        await server.stop()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        print(f"dkv node {config.node_id} stopped", flush=True)


@app.command()
def stats(
    address: Annotated[str, typer.Argument(help="Node HOST:PORT.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    token_file: Annotated[Optional[Path], typer.Option(help="File holding the cluster token.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the node.")] = 5.0,
) -> None:
    """Show a node's tiers, index, leases and counters."""
    try:
        result = asyncio.run(_fetch_stats(address, read_token(token_file), timeout))
    except (DKVError, ValueError) as exc:
        _fail(f"{address}: {exc}")
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return
    table = Table(title=f"dKV node {result['node_id']} at {result['address']}", show_header=False)
    host, disk = result["host"], result["disk"]
    rows = [
        ("epoch", result["epoch"]),
        ("uptime", f"{result['uptime_s']:.0f} s"),
        ("host pool", f"{format_size(host['used'])} / {format_size(host['total'])} used"
                      f"{' (pinned)' if host['pinned'] else ''}"),
        ("disk tier", f"{format_size(disk['used'])} / {format_size(disk['total'])} used" if disk["total"] else "off"),
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
    Console().print(table)


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


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
