"""A local cluster: one etcd and N ``dkv serve`` processes, recorded in a directory, stopped by PID.

``up`` starts etcd (data under the cluster directory) and the nodes (each in
its own session, so they outlive the command that started them), waits until
every node is registered in etcd, and writes ``cluster.json`` with what it
started: PIDs, addresses, arena names. ``down`` stops exactly that: nodes
gracefully (SIGTERM, then SIGKILL after a bound), then etcd, then removes the
arena files the record names and the etcd data, leaving no process,
shared-memory segment or temporary file behind. ``status`` reads the record
and checks each PID and etcd's membership.

:func:`topology` is the single description of what a cluster runs (services,
commands, ports, environment); ``docker-compose.yml`` is checked against it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cluster.etcd_process import etcd_binary, free_port

STATE_FILE = "cluster.json"
DEFAULT_CLUSTER = "default"
NODE_PORT_BASE = 7420
STOP_TIMEOUT = 10.0
READY_TIMEOUT = 60.0


@dataclass
class NodeRecord:
    node_id: str
    pid: int
    address: str
    shm: str
    log: str


@dataclass
class ClusterRecord:
    """What ``up`` started (``cluster.json``)."""

    directory: str
    cluster: str
    etcd_url: str
    etcd_pid: int
    etcd_data: str
    nodes: list[NodeRecord] = field(default_factory=list)
    started_at: float = 0.0

    def save(self) -> None:
        path = Path(self.directory, STATE_FILE)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, directory: str | Path) -> ClusterRecord:
        path = Path(directory, STATE_FILE)
        if not path.exists():
            raise FileNotFoundError(f"no cluster recorded in {directory} (missing {STATE_FILE})")
        data = json.loads(path.read_text())
        data["nodes"] = [NodeRecord(**n) for n in data.get("nodes", [])]
        return cls(**data)


def topology(nodes: int, *, pool: str = "1GiB", cluster: str = DEFAULT_CLUSTER) -> dict[str, dict[str, Any]]:
    """The services of an N-node cluster: what runs, with which arguments, ports and environment.

    Addresses are symbolic (``etcd``, ``node-i``): the local launcher binds
    loopback ports, docker-compose uses service names. Both run these commands.
    """
    services: dict[str, dict[str, Any]] = {
        "etcd": {
            "command": ["etcd", "--name", "dkv", "--listen-client-urls", "http://0.0.0.0:2379",
                        "--advertise-client-urls", "http://etcd:2379"],
            "ports": [2379],
            "environment": {},
        }
    }
    for i in range(nodes):
        node_id = f"node-{i}"
        services[node_id] = {
            "command": ["dkv", "serve", "--listen", f"{node_id}:{NODE_PORT_BASE}", "--pool", pool,
                        "--etcd", "http://etcd:2379", "--node-id", node_id, "--cluster", cluster],
            "ports": [NODE_PORT_BASE],
            "environment": {"UCX_TLS": "tcp", "DKV_TOKEN": "${DKV_TOKEN}"},
        }
    return services


def local_command(command: list[str], etcd_url: str) -> list[str]:
    """A topology command as the local launcher runs it: this interpreter, a free loopback port, local etcd."""
    local = [sys.executable, "-m", "dkv.cli", *command[1:]]
    for flag, value in (("--listen", "127.0.0.1:0"), ("--etcd", etcd_url)):
        local[local.index(flag) + 1] = value
    return local


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _stop_pid(pid: int, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, wait, SIGKILL: the process is gone when this returns."""
    if not _alive(pid):
        return
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})


def up(directory: str | Path, nodes: int = 3, *, pool: str = "256MiB", cluster: str = DEFAULT_CLUSTER,
       ready_timeout: float = READY_TIMEOUT, extra_node_args: tuple[str, ...] = ()) -> ClusterRecord:
    """Start etcd and ``nodes`` nodes; return (and record) what was started. Cleans up if anything fails."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / STATE_FILE).exists():
        raise FileExistsError(f"{directory} already records a cluster: run `dkv cluster down --dir {directory}` first")
    binary = etcd_binary()
    client_port, peer_port = free_port(), free_port()
    etcd_data = directory / "etcd-data"
    etcd = _spawn([binary, "--name", "dkv", "--data-dir", str(etcd_data),
                   "--listen-client-urls", f"http://127.0.0.1:{client_port}",
                   "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
                   "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                   "--initial-cluster", f"dkv=http://127.0.0.1:{peer_port}", "--log-level", "warn"],
                  directory / "etcd.log")
    record = ClusterRecord(str(directory), cluster, f"http://127.0.0.1:{client_port}", etcd.pid, str(etcd_data),
                           started_at=time.time())
    record.save()
    try:
        procs = []
        for i in range(nodes):
            node_id = f"node-{i}"
            ready = directory / f"{node_id}.ready"
            cmd = local_command(topology(nodes, pool=pool, cluster=cluster)[node_id]["command"],
                                record.etcd_url) + ["--ready-file", str(ready), *extra_node_args]
            procs.append((node_id, ready, _spawn(cmd, directory / f"{node_id}.log")))
        deadline = time.monotonic() + ready_timeout
        for node_id, ready, proc in procs:
            while not ready.exists():
                if proc.poll() is not None:
                    tail = (directory / f"{node_id}.log").read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"{node_id} exited with {proc.returncode}:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node_id} not ready after {ready_timeout}s")
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            record.nodes.append(NodeRecord(node_id, proc.pid, info["address"], info["shm"],
                                           str(directory / f"{node_id}.log")))
            record.save()
        asyncio.run(_wait_registered(record, max(1.0, deadline - time.monotonic())))
    except BaseException:
        down(directory)
        raise
    return record


async def _members(record: ClusterRecord) -> dict[str, Any]:
    from dkv.etcd import Layout, MemberRecord, get_prefix, make_client

    client = make_client(record.etcd_url)
    await client.connect()
    try:
        layout = Layout(record.cluster)
        kvs, _ = await get_prefix(client, layout.nodes, timeout=5.0)
        return {m.node_id: m for kv in kvs if (m := MemberRecord.from_json(kv.value)) is not None}
    finally:
        await client.close()


async def _wait_registered(record: ClusterRecord, timeout: float) -> None:
    wanted = {n.node_id for n in record.nodes}
    deadline = time.monotonic() + timeout
    while True:
        try:
            if wanted <= set(await _members(record)):
                return
        except Exception:  # noqa: BLE001 - etcd may still be starting
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes {sorted(wanted)} not all registered in etcd after {timeout:.0f}s")
        await asyncio.sleep(0.1)


def status(directory: str | Path) -> dict[str, Any]:
    """What the record says, which PIDs are alive, and which nodes etcd lists."""
    record = ClusterRecord.load(directory)
    try:
        members = asyncio.run(_members(record)) if _alive(record.etcd_pid) else {}
        etcd_ok = _alive(record.etcd_pid)
    except Exception:  # noqa: BLE001
        members, etcd_ok = {}, False
    return {
        "directory": record.directory,
        "cluster": record.cluster,
        "etcd": {"url": record.etcd_url, "pid": record.etcd_pid, "alive": etcd_ok},
        "nodes": [
            {**asdict(n), "alive": _alive(n.pid), "registered": n.node_id in members,
             "epoch": members[n.node_id].epoch if n.node_id in members else None}
            for n in record.nodes
        ],
    }


def down(directory: str | Path) -> list[str]:
    """Stop exactly what the record names and remove what it left; returns what was stopped."""
    directory = Path(directory)
    try:
        record = ClusterRecord.load(directory)
    except FileNotFoundError:
        return []
    stopped = []
    for node in record.nodes:
        _stop_pid(node.pid)
        Path("/dev/shm", node.shm).unlink(missing_ok=True)
        stopped.append(node.node_id)
    for ready in directory.glob("node-*.ready*"):
        ready.unlink(missing_ok=True)
    _stop_pid(record.etcd_pid)
    stopped.append("etcd")
    shutil.rmtree(record.etcd_data, ignore_errors=True)
    Path(directory, STATE_FILE).unlink(missing_ok=True)
    return stopped
