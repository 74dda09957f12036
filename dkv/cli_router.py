"""``dkv router serve``: the router as an HTTP service (:mod:`dkv.router_service`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from dkv.cli import ClusterOption, EtcdOption, LogLevelOption, PrefixOption, etcd_options, fail, read_token, setup_logging
from dkv.errors import DKVError
from dkv.units import parse_address

router_app = typer.Typer(no_args_is_help=True, add_completion=False,
                         help="The router service: which peer holds a request's longest cached prefix, over HTTP.")


@router_app.command("serve")
@etcd_options
def serve(
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

    Prints one JSON line {"address": "host:port", "pid": N} to stdout once serving.
    """
    setup_logging(log_level)
    from dkv.router_service import DEFAULT_ROUTER_PORT, bind, check_listen

    try:
        host, port = parse_address(listen, DEFAULT_ROUTER_PORT)
        token = read_token(token_file)
        check_listen(host, token)
        settings = etcd_settings(etcd)
        from dkv.etcd import Layout

        layout = Layout(cluster, etcd_prefix)
        sock = bind(host, port)
        asyncio.run(_serve(settings, layout, sock, token))
    except (DKVError, ValueError) as exc:
        fail(str(exc))


async def _serve(settings: Any, layout: Any, sock: Any, token: bytes | None) -> None:
    from dkv.etcd import make_client
    from dkv.router import Router
    from dkv.router_service import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = make_client(settings)
    await client.connect()
    try:
        await serve(Router(client, layout), sock, token=token, stop=stop,
                    on_ready=lambda address: print(json.dumps({"address": address, "pid": os.getpid()}), flush=True))
    finally:
        await client.close()
        print("dkv router stopped", flush=True)
