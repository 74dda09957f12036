"""``dkv cluster up|status|down`` and ``dkv demo``, plugged into the ``dkv`` command (entry points ``dkv.commands``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dkv.cli import fail as _fail

cluster_app = typer.Typer(no_args_is_help=True, add_completion=False,
                          help="A local cluster: etcd and N dKV nodes as processes.")


@cluster_app.command("up")
def cluster_up(
    nodes: Annotated[int, typer.Option(help="How many nodes.")] = 3,
    dir: Annotated[Path, typer.Option("--dir", help="Where the cluster records what it started.")] = Path("dkv-cluster"),
    pool: Annotated[str, typer.Option(help="Host pool per node.")] = "256MiB",
    cluster: Annotated[str, typer.Option(help="Cluster name.")] = "default",
    netns: Annotated[bool, typer.Option(help="Each process in its own network namespace on a private bridge (root).")] = False,
    etcd_tls: Annotated[bool, typer.Option("--etcd-tls", help="etcd serves TLS and requires client certificates (a private CA, made in DIR/etcd-tls).")] = False,
    etcd_auth: Annotated[bool, typer.Option("--etcd-auth", help="etcd requires a user and password (user dkv, password in DIR/etcd-password).")] = False,
) -> None:
    """Start etcd and N nodes, wait until all are registered, record them in DIR."""
    import shlex

    from cluster.etcd_process import EtcdNotFound
    from cluster.local import up

    try:
        record = up(dir, nodes, pool=pool, cluster=cluster, netns=netns, etcd_tls=etcd_tls, etcd_auth=etcd_auth)
    except (EtcdNotFound, FileExistsError, RuntimeError, TimeoutError) as exc:
        _fail(str(exc))
    print(f"cluster {record.cluster!r} up: etcd {record.etcd_url}, "
          + ", ".join(f"{n.node_id}@{n.address}" for n in record.nodes))
    prefix = " ".join(record.client_prefix())
    print(f"inspect: {prefix + ' ' if prefix else ''}dkv peers {shlex.join(record.etcd_settings().cli_args())}    "
          f"stop: dkv cluster down --dir {dir}")


@cluster_app.command("status")
def cluster_status(
    dir: Annotated[Path, typer.Option("--dir", help="The cluster's directory.")] = Path("dkv-cluster"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show what DIR records, which processes are alive and which nodes etcd lists."""
    from cluster.local import status

    try:
        info = status(dir)
    except FileNotFoundError as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(info, indent=2))
        return
    table = Table(title=f"cluster {info['cluster']!r} in {info['directory']}")
    for column in ("process", "pid", "address", "alive", "registered"):
        table.add_column(column)
    etcd = info["etcd"]
    table.add_row("etcd", str(etcd["pid"]), etcd["url"], str(etcd["alive"]), "-")
    for node in info["nodes"]:
        table.add_row(node["node_id"], str(node["pid"]), node["address"], str(node["alive"]), str(node["registered"]))
    Console(width=160).print(table)


@cluster_app.command("down")
def cluster_down(dir: Annotated[Path, typer.Option("--dir", help="The cluster's directory.")] = Path("dkv-cluster")) -> None:
    """Stop exactly what DIR records (graceful first, then by PID) and remove what it left."""
    from cluster.local import down

    stopped = down(dir)
    print("stopped: " + (", ".join(stopped) if stopped else "nothing recorded"))


def demo(
    out: Annotated[Path, typer.Option(help="Where the JSON report and the PNG chart go.")] = Path("dkv-demo-out"),
    etcd: Annotated[Optional[str], typer.Option(help="Run against an existing cluster instead of starting one.")] = None,
    cluster: Annotated[str, typer.Option(help="Cluster name (with --etcd).")] = "default",
    conversations: Annotated[Optional[int], typer.Option(help="Conversations in the workload (default 24; 6 with --small).")] = None,
    turns: Annotated[Optional[int], typer.Option(help="Turns per conversation (default 4; 3 with --small).")] = None,
    small: Annotated[bool, typer.Option(help="A small model and workload (tests, CI).")] = False,
) -> None:
    """The main job: the same chat workload with no prefix caching, with the engines' own device caches,
    and with device caches plus dKV, on a local 3-node cluster; compared by time to first token."""
    from cluster.demo import DemoConfig, run_demo

    config = DemoConfig.small() if small else DemoConfig()
    for name, value in (("conversations", conversations), ("turns", turns)):
        if value is not None:
            if value < 1:
                _fail(f"--{name} must be at least 1")
            setattr(config, name, value)
    report = run_demo(config, out, etcd=etcd, cluster=cluster)
    raise typer.Exit(0 if report["bit_exact"] else 1)
