"""A local cluster: one etcd and N ``dkv serve`` processes, recorded in a directory, stopped by PID.

``up`` starts etcd (data under the cluster directory) and the nodes (each in
its own session, so they outlive the command that started them), waits until
every node is registered in etcd, and writes ``cluster.json`` with what it
started: PIDs, addresses, arena names. ``down`` stops exactly that: nodes
gracefully (SIGTERM, then SIGKILL after a bound), then etcd, then removes the
arena files the record names and the etcd data, leaving no process,
shared-memory segment or temporary file behind. ``status`` reads the record
and checks each PID and etcd's membership. ``up`` can secure etcd with TLS and
client certificates and/or user/password authentication, and gives the nodes
the same settings (see :func:`up`).

:func:`topology` is the single description of what a cluster runs (services,
commands, ports, environment); ``docker-compose.yml`` is checked against it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.etcd_process import etcd_binary, etcd_tls_args, free_port, log_since, make_certificates
from cluster.netns import NETNS_ENV, NetnsLayout
from cluster.process import listening_on

if TYPE_CHECKING:
    from dkv.etcd import EtcdSettings

STATE_FILE = "cluster.json"
DEFAULT_CLUSTER = "default"
NODE_PORT_BASE = 7420
# node-i's TCP control socket (``dkv serve --peer-control-port``): a number of its own, so that behind
# published ports (docker-compose) the port a node announces is the one a client on the host reaches
PEER_CONTROL_PORT_BASE = 7440
METRICS_PORT = 9420  # a node's /metrics, /healthz, /readyz (``dkv serve --metrics-listen``)
ROUTER_PORT = 7430  # the router service (``dkv router serve``)
STOP_TIMEOUT = 10.0
READY_TIMEOUT = 60.0
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380  # etcd's in its own network namespace (up --netns)
ETCD_PORT_ATTEMPTS = 5  # etcd started on ports picked free, again on others while it finds one taken
ETCD_TLS_DIR = "etcd-tls"  # CA, etcd's and the clients' certificates (up --etcd-tls)
ETCD_USER = "dkv"  # the nodes' etcd user (up --etcd-auth), allowed ETCD_AUTH_PREFIX only
ETCD_AUTH_PREFIX = "/dkv/"
ETCD_PASSWORD_FILES = ("etcd-password", "etcd-root-password")


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
    netns: dict[str, Any] | None = None  # NetnsLayout fields when the cluster runs in namespaces
    token_file: str | None = None
    # how etcd is secured (EtcdSettings fields but the endpoints: TLS files, user, password file), or None
    etcd_security: dict[str, str] | None = None

    def etcd_settings(self) -> EtcdSettings:
        """How a client reaches this cluster's etcd: its URL plus the TLS files and user ``up`` made."""
        from dkv.etcd import EtcdSettings

        return EtcdSettings(self.etcd_url, **(self.etcd_security or {}))

    def netns_layout(self) -> NetnsLayout | None:
        if not self.netns:
            return None
        layout = NetnsLayout(self.netns["tag"], list(self.netns["members"]), tuple(self.netns["subnet"]))
        layout.created = [layout.bridge_namespace, *map(layout.namespace, layout.members)]
        return layout

    def client_prefix(self) -> list[str]:
        """How to run a process that talks to this cluster (inside the client namespace with --netns)."""
        layout = self.netns_layout()
        return layout.exec_prefix("client") if layout else []

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

    Addresses are symbolic (``etcd``, ``node-i``, ``router``): the local
    launcher binds loopback ports, docker-compose uses service names, the
    Kubernetes manifests (``cluster/k8s/``) the pod's address. All of them run
    these commands (tests/cluster/test_compose.py, tests/cluster/test_k8s.py).
    Every node serves its metrics and health endpoints on ``METRICS_PORT``, and
    node-i its TCP control socket on ``PEER_CONTROL_PORT_BASE + i``; the
    router service answers routes on ``ROUTER_PORT``.
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
                        "--etcd", "http://etcd:2379", "--node-id", node_id, "--cluster", cluster,
                        "--metrics-listen", f"{node_id}:{METRICS_PORT}",
                        "--peer-control-port", str(PEER_CONTROL_PORT_BASE + i)],
            "ports": [NODE_PORT_BASE, PEER_CONTROL_PORT_BASE + i, METRICS_PORT],
            "environment": {"UCX_TLS": "tcp", "DKV_TOKEN": "${DKV_TOKEN}"},
        }
    services["router"] = {
        "command": ["dkv", "router", "serve", "--listen", f"router:{ROUTER_PORT}", "--etcd", "http://etcd:2379",
                    "--cluster", cluster],
        "ports": [ROUTER_PORT],
        "environment": {"DKV_TOKEN": "${DKV_TOKEN}"},
    }
    return services


def local_command(command: list[str], etcd_url: str, listen: str = "127.0.0.1:0",
                  metrics_listen: str | None = None) -> list[str]:
    """A topology command as the local launcher runs it: this interpreter, a local address, local etcd.

    ``metrics_listen`` is where a node serves ``/metrics`` and its health
    (e.g. ``127.0.0.1:0``); ``None`` drops ``--metrics-listen`` from the command,
    so the local node runs without that endpoint. A node's TCP control socket
    takes a free port (local nodes share one host).
    """
    local = [sys.executable, "-m", "dkv.cli", *command[1:]]
    if "--metrics-listen" in local:
        at = local.index("--metrics-listen")
        if metrics_listen is None:
            del local[at:at + 2]
        else:
            local[at + 1] = metrics_listen
    for flag, value in (("--listen", listen), ("--etcd", etcd_url)):
        local[local.index(flag) + 1] = value
    if "--peer-control-port" in local:
        local[local.index("--peer-control-port") + 1] = "0"
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


def _spawn_etcd_on_free_ports(command: Callable[[int, int], list[str]], log: Path, data_dir: Path,
                              ready_timeout: float) -> tuple[subprocess.Popen[bytes], int]:
    """etcd on client and peer ports free when picked; ``(process, client port)`` once it listens on both.

    A port free when picked can be taken by another process before etcd
    binds it (the machine runs other work); etcd then exits saying so, and it
    is started again on other ports, on a fresh ``data_dir``, up to
    :data:`ETCD_PORT_ATTEMPTS` times.
    Any other exit, or etcd not listening within ``ready_timeout``, raises
    ``RuntimeError`` with what etcd logged (a process still running is killed).
    """
    for attempt in range(1, ETCD_PORT_ATTEMPTS + 1):
        client_port, peer_port = free_port(), free_port()
        logged = log.stat().st_size if log.exists() else 0
        proc = _spawn(command(client_port, peer_port), log)
        deadline = time.monotonic() + ready_timeout
        while proc.poll() is None and not listening_on(proc.pid, (client_port, peer_port)):
            if time.monotonic() > deadline:
                _stop_pid(proc.pid)
                raise RuntimeError(f"etcd did not listen on ports {client_port} and {peer_port} within "
                                   f"{ready_timeout:.0f}s:\n{log_since(log, logged)}")
            time.sleep(0.05)
        if proc.poll() is None:
            return proc, client_port
        said = log_since(log, logged)
        if "address already in use" not in said or attempt == ETCD_PORT_ATTEMPTS:
            raise RuntimeError(f"etcd exited with {proc.returncode} (attempt {attempt} of {ETCD_PORT_ATTEMPTS}):\n"
                               f"{said}")
        shutil.rmtree(data_dir, ignore_errors=True)  # (a member named for the ports that failed must not remain)
    raise AssertionError("unreachable")



def up(directory: str | Path, nodes: int = 3, *, pool: str = "256MiB", cluster: str = DEFAULT_CLUSTER,
       ready_timeout: float = READY_TIMEOUT, extra_node_args: tuple[str, ...] = (),
       netns: bool = False, etcd_tls: bool = False, etcd_auth: bool = False) -> ClusterRecord:
    """Start etcd and ``nodes`` nodes; return (and record) what was started. Cleans up if anything fails.

    With ``netns`` (root only) every process gets a network namespace and a private
    address of its own (:mod:`cluster.netns`), the nodes listen on those addresses
    with a generated cluster token, and UCX runs over TCP.

    With ``etcd_tls`` etcd serves TLS only and requires client certificates: a
    private CA, etcd's certificate and one client certificate are made in
    ``DIR/etcd-tls/``. With ``etcd_auth`` etcd's user/password authentication is
    on: user ``dkv`` may read and write ``/dkv/`` only; its password is in
    ``DIR/etcd-password`` (root's in ``DIR/etcd-root-password``), mode 0600. The
    nodes get the same settings (``--etcd-ca`` ... ``--etcd-password-file``);
    :meth:`ClusterRecord.etcd_settings` gives them to clients.
    """
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / STATE_FILE).exists():
        raise FileExistsError(f"{directory} already records a cluster: run `dkv cluster down --dir {directory}` first")
    binary = etcd_binary()
    node_ids = [f"node-{i}" for i in range(nodes)]
    layout = NetnsLayout.new(["etcd", *node_ids, "client"]) if netns else None
    if layout is not None:
        layout.create()
        etcd_host = layout.address("etcd")
    else:
        etcd_host = "127.0.0.1"
    scheme = "https" if etcd_tls else "http"
    etcd_data = directory / "etcd-data"
    etcd_url = f"{scheme}://{etcd_host}:{ETCD_CLIENT_PORT}" if layout else ""  # (off a namespace: once etcd listens)
    record = ClusterRecord(str(directory), cluster, etcd_url, 0, str(etcd_data), started_at=time.time(),
                           netns=asdict(layout) if layout else None)
    record.save()
    try:
        certs = None
        if etcd_tls:
            certs = make_certificates(directory / ETCD_TLS_DIR, hosts=tuple(dict.fromkeys((etcd_host, "127.0.0.1",
                                                                                          "localhost"))))
            record.etcd_security = {"ca_file": str(certs.ca), "cert_file": str(certs.client_cert),
                                    "key_file": str(certs.client_key)}
            record.save()

        def etcd_command(client_port: int, peer_port: int) -> list[str]:
            url, peer = f"{scheme}://{etcd_host}:{client_port}", f"http://{etcd_host}:{peer_port}"
            return [*(layout.exec_prefix("etcd") if layout else []), binary, "--name", "dkv",
                    "--data-dir", str(etcd_data), "--listen-client-urls", url, "--advertise-client-urls", url,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"dkv={peer}", "--log-level", "warn", *etcd_tls_args(certs)]

        if layout is not None:  # its own network namespace: the usual ports are its alone
            etcd = _spawn(etcd_command(ETCD_CLIENT_PORT, ETCD_PEER_PORT), directory / "etcd.log")
        else:
            etcd, client_port = _spawn_etcd_on_free_ports(etcd_command, directory / "etcd.log", etcd_data,
                                                          ready_timeout)
            record.etcd_url = f"{scheme}://{etcd_host}:{client_port}"
        etcd_url = record.etcd_url
        record.etcd_pid = etcd.pid
        record.save()
        if etcd_auth:
            password_file = _enable_auth(record, ready_timeout)
            record.etcd_security = {**(record.etcd_security or {}), "user": ETCD_USER,
                                    "password_file": str(password_file)}
        node_args = list(extra_node_args)
        node_args += record.etcd_settings().cli_args()[2:]  # the TLS and auth options (--etcd is set below)
        if layout is not None:
            token = directory / "token"
            token.write_text(os.urandom(24).hex())
            token.chmod(0o600)
            record.token_file = str(token)
            node_args += ["--token-file", str(token)]
        record.save()
        procs = []
        for node_id in node_ids:
            ready = directory / f"{node_id}.ready"
            cmd = local_command(topology(nodes, pool=pool, cluster=cluster)[node_id]["command"], etcd_url,
                                listen=f"{layout.address(node_id)}:{NODE_PORT_BASE}" if layout else "127.0.0.1:0")
            cmd = [*(layout.exec_prefix(node_id) if layout else []), *cmd, "--ready-file", str(ready), *node_args]
            procs.append((node_id, ready, _spawn(cmd, directory / f"{node_id}.log",
                                                 NETNS_ENV if layout else None)))
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
        _wait_registered(record, max(1.0, deadline - time.monotonic()))
    except BaseException:
        down(directory)
        raise
    return record


_ENABLE_AUTH = (
    "import asyncio, json, sys\n"
    "from pathlib import Path\n"
    "from cluster.etcd_process import enable_auth\n"
    "from dkv.etcd import EtcdSettings\n"
    "settings = EtcdSettings(**json.loads(sys.argv[1]))\n"
    "print(asyncio.run(enable_auth(settings, Path(sys.argv[2]), user=sys.argv[3], prefix=sys.argv[4],"
    " timeout=float(sys.argv[5]))))\n"
)


def _enable_auth(record: ClusterRecord, timeout: float) -> Path:
    """Turn on etcd's authentication (:func:`cluster.etcd_process.enable_auth`), from where clients run
    (inside the client namespace with --netns); returns the node user's password file."""
    settings = {"endpoints": record.etcd_url, **(record.etcd_security or {})}
    result = subprocess.run(
        [*record.client_prefix(), sys.executable, "-c", _ENABLE_AUTH, json.dumps(settings), record.directory,
         ETCD_USER, ETCD_AUTH_PREFIX, str(timeout)],
        capture_output=True, text=True, timeout=timeout + 30, env={**os.environ, **NETNS_ENV}, check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"cannot enable etcd authentication: {result.stderr.strip()[-800:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def _members(record: ClusterRecord, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """The member records etcd holds, read by ``dkv peers --json`` (inside the client namespace with --netns)."""
    result = subprocess.run(
        [*record.client_prefix(), sys.executable, "-m", "dkv.cli", "peers", *record.etcd_settings().cli_args(),
         "--cluster", record.cluster, "--json"],
        capture_output=True, text=True, timeout=timeout + 20, env={**os.environ, **NETNS_ENV},
    )
    if result.returncode != 0:
        raise RuntimeError(f"cannot read the cluster's members: {result.stderr.strip()[-300:]}")
    return {m["node_id"]: m for m in json.loads(result.stdout)}


def _wait_registered(record: ClusterRecord, timeout: float) -> None:
    wanted = {n.node_id for n in record.nodes}
    deadline = time.monotonic() + timeout
    while True:
        try:
            if wanted <= set(_members(record)):
                return
        except Exception:  # noqa: BLE001 - etcd may still be starting
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes {sorted(wanted)} not all registered in etcd after {timeout:.0f}s")
        time.sleep(0.2)


def status(directory: str | Path) -> dict[str, Any]:
    """What the record says, which PIDs are alive, and which nodes etcd lists."""
    record = ClusterRecord.load(directory)
    try:
        members = _members(record) if _alive(record.etcd_pid) else {}
        etcd_ok = _alive(record.etcd_pid)
    except Exception:  # noqa: BLE001
        members, etcd_ok = {}, False
    return {
        "directory": record.directory,
        "cluster": record.cluster,
        "etcd": {"url": record.etcd_url, "pid": record.etcd_pid, "alive": etcd_ok},
        "netns": record.netns,
        "nodes": [
            {**asdict(n), "alive": _alive(n.pid), "registered": n.node_id in members,
             "epoch": members[n.node_id]["epoch"] if n.node_id in members else None}
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
        if node.shm:  # a tokenless node's local credential file
            Path("/dev/shm", node.shm).unlink(missing_ok=True)
        stopped.append(node.node_id)
    for ready in directory.glob("node-*.ready*"):
        ready.unlink(missing_ok=True)
    if record.etcd_pid:
        _stop_pid(record.etcd_pid)
    stopped.append("etcd")
    shutil.rmtree(record.etcd_data, ignore_errors=True)
    layout = record.netns_layout()
    if layout is not None:
        layout.destroy()
        stopped.append(f"namespaces {layout.tag}-*")
    if record.token_file:
        Path(record.token_file).unlink(missing_ok=True)
    shutil.rmtree(Path(directory, ETCD_TLS_DIR), ignore_errors=True)
    for secret in ETCD_PASSWORD_FILES:
        Path(directory, secret).unlink(missing_ok=True)
    Path(directory, STATE_FILE).unlink(missing_ok=True)
    return stopped
