"""Shared fixtures: real node processes (stopped by PID), clients, and a leak check after every test."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster.etcd_process import EtcdProcess, start_etcd
from cluster.process import NodeProcess, start_node, stop_process
from dkv.client import NodeClient
from dkv.server import ADMIN_NAMESPACE
from dkv.loop_thread import LoopThread, acquire_shared_loop, release_shared_loop
from dkv.transport import _live, open_connections

NAMESPACE = "test/ns0"


@dataclass
class EtcdUnderTest:
    """A real etcd for one test: its endpoint, a fresh key prefix, and the process (``None`` if external)."""

    url: str
    prefix: str
    process: EtcdProcess | None

    def node_args(self, node_id: str, *extra: str, ttl: int = 2) -> tuple[str, ...]:
        """``dkv serve`` arguments joining this etcd under this test's prefix."""
        return ("--etcd", self.url, "--etcd-prefix", self.prefix, "--node-id", node_id, "--etcd-ttl", str(ttl), *extra)

    def cli_args(self) -> tuple[str, ...]:
        return ("--etcd", self.url, "--etcd-prefix", self.prefix)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdProcess | None]:
    """One etcd process for the session (data under /dev/shm), or ``None`` with ``DKV_TEST_ETCD`` set."""
    if os.environ.get("DKV_TEST_ETCD"):
        yield None
        return
    proc = start_etcd()
    yield proc
    proc.stop()


@pytest.fixture
async def etcd(etcd_server: EtcdProcess | None, request: pytest.FixtureRequest) -> AsyncIterator[EtcdUnderTest]:
    """A fresh key prefix per test; at teardown (after the test's nodes stopped) the prefix must be empty."""
    url = os.environ.get("DKV_TEST_ETCD") or (etcd_server.url if etcd_server else "")
    prefix = f"/dkv-test/{uuid.uuid4().hex[:12]}"
    under_test = EtcdUnderTest(url, prefix, etcd_server)
    yield under_test
    from dkv.etcd import make_client, prefix_end

    client = make_client(url)
    await client.connect()
    try:
        deadline = time.monotonic() + WAIT_BOUND
        while True:
            left = await client.kv.get(prefix + "/", range_end=prefix_end(prefix + "/"), keys_only=True, timeout=5)
            if not left.kvs or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert not left.kvs, f"etcd keys left under {prefix}: {[kv.key for kv in left.kvs][:5]}"
    finally:
        await client.close()
WAIT_BOUND = 20.0  # generous: these machines are shared and noisy


@asynccontextmanager
async def etcd_client(url: str) -> AsyncIterator[Any]:
    """A connected etcd client for a test's own reads and writes, closed at the end."""
    from dkv.etcd import make_client

    client = make_client(url)
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


@asynccontextmanager
async def etcd_lease(client: Any, ttl: int = 60) -> AsyncIterator[int]:
    """A lease for the test's keys; revoked at the end, so the test's prefix is left empty."""
    grant = await client.lease.grant(ttl, timeout=5)
    try:
        yield grant.ID
    finally:
        await client.lease.revoke(grant.ID, timeout=5)


_UCX: LoopThread | None = None


@pytest.fixture(scope="session", autouse=True)
def ucx_loop() -> Iterator[LoopThread]:
    """The process's shared UCX loop thread, started before any test counts threads.

    Every UCX call of the test process runs there (see :func:`on_ucx`), never on
    pytest's own loop: a second loop registered for UCX progress that sits idle
    between tests would stall the connectors' endpoints.
    """
    global _UCX
    _UCX = acquire_shared_loop()
    yield _UCX
    release_shared_loop()


async def on_ucx(coro: Any) -> Any:
    """Await ``coro`` on the shared UCX loop."""
    assert _UCX is not None
    return await asyncio.wrap_future(_UCX.submit(coro))


class OnUcx:
    """Proxy whose methods run on the shared UCX loop (coroutines awaited, plain methods waited for)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if inspect.iscoroutinefunction(attr):
            async def call_async(*args: Any, **kwargs: Any) -> Any:
                return await on_ucx(attr(*args, **kwargs))
            return call_async
        if callable(attr) and not isinstance(attr, type):
            def call(*args: Any, **kwargs: Any) -> Any:
                async def run() -> Any:
                    return attr(*args, **kwargs)
                assert _UCX is not None
                return _UCX.run(run(), 60)
            return call
        return attr


def _dkv_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("dkv-")}


@pytest.fixture
async def node_factory(tmp_path: Path) -> AsyncIterator[Callable[..., NodeProcess]]:
    """Start real ``dkv serve`` processes.

    ``token=b"..."`` writes a token file and passes ``--token-file``. At
    teardown every node still alive must hold no lease, reservation or pinned
    block once its clients are gone; then each is stopped by its PID, and no
    arena file may be left behind.
    """
    started: list[NodeProcess] = []

    def factory(*args: str, token: bytes | None = None, **kwargs: Any) -> NodeProcess:
        workdir = tmp_path / f"node{len(started)}"
        workdir.mkdir(parents=True, exist_ok=True)
        if token is not None:
            (workdir / "token").write_bytes(token)
            args = (*args, "--token-file", str(workdir / "token"))
        node = start_node(*args, workdir=workdir, exit_with_parent=True, **kwargs)
        node.ready["test_token"] = token
        started.append(node)
        return node

    yield factory
    try:
        for node in started:
            if node.alive():
                token = node.ready.get("test_token")
                stats = await wait_for_stats(
                    node.address,
                    lambda s: s["leases"] == 0 and s["reservations"] == 0 and s["clients"] <= 1,
                    token=token,
                )
                assert stats["leases"] == 0, f"node {node.address} still holds leases: {stats}"
                assert stats["reservations"] == 0, f"node {node.address} still holds reservations: {stats}"
                assert stats["pinned_blocks"] == 0, f"node {node.address} still pins blocks: {stats}"
    finally:
        for node in started:
            node.stop()
    leftovers = {n.shm_name for n in started} & _dkv_shm()
    assert not leftovers, f"arena files left behind: {leftovers}"


@contextmanager
def run_impostor(workdir: Path, block_size: int, node_id: str = "evil") -> Iterator[dict[str, Any]]:
    """Run ``tests/dkv/impostor_node.py`` (speaks the wire, knows no credential, serves 0x66 bytes); yields its ready info."""
    ready = workdir / f"{node_id}.ready"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "dkv" / "impostor_node.py"), node_id,
                             str(block_size), str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the impostor did not start"
            time.sleep(0.05)
        yield json.loads(ready.read_text())
    finally:
        stop_process(proc)


@pytest.fixture
def node(node_factory: Callable[..., NodeProcess]) -> NodeProcess:
    return node_factory()


@pytest.fixture
async def clients(node_factory: Callable[..., NodeProcess]) -> AsyncIterator[Callable[..., NodeClient]]:
    """Make :class:`NodeClient`s; all are closed at teardown (before any node is checked or stopped)."""
    made: list[NodeClient] = []

    def make(address: str, namespace: str = NAMESPACE, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", 10.0)
        client = OnUcx(NodeClient(address, namespace, **kwargs))
        made.append(client)
        return client

    yield make
    await asyncio.gather(*(c.close() for c in made))


async def failure_of(awaitable: Any) -> str | None:
    """``None`` if it succeeds, else the error as text (no live gRPC objects kept by a traceback)."""
    try:
        await awaitable
    except Exception as exc:  # noqa: BLE001 - reported as a plain assertion
        return f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        gc.collect()
    return None


async def node_stats(address: str, **kwargs: Any) -> dict[str, Any]:
    """A node's stats over a fresh admin connection (closed before returning)."""
    async def fetch() -> dict[str, Any]:
        admin = NodeClient(address, ADMIN_NAMESPACE, pool_size=1, **kwargs)
        try:
            return await admin.stats()
        finally:
            await admin.close()

    return await on_ucx(fetch())


async def wait_for_stats(address: str, predicate: Callable[[dict[str, Any]], bool], **kwargs: Any) -> dict[str, Any]:
    """Poll a node's stats until ``predicate`` holds (bounded by ``WAIT_BOUND``); returns the last stats."""
    deadline = time.monotonic() + WAIT_BOUND
    stats = await node_stats(address, **kwargs)
    while not predicate(stats) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        stats = await node_stats(address, **kwargs)
    return stats


async def _ucx_loop_tasks() -> list[str]:
    deadline = time.monotonic() + 5
    while True:
        current = asyncio.current_task()
        left = [repr(t) for t in asyncio.all_tasks()
                if t is not current and not t.done() and "ucxx" not in _coro_file(t)]
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.05)


def _open_peers() -> list[str]:
    return [c.peer + getattr(c, "created_at", "") for c in list(_live)]


def _coro_file(task: asyncio.Task[Any]) -> str:
    code = getattr(task.get_coro(), "cr_code", None)
    return code.co_filename if code is not None else ""


def _owned_tasks() -> set[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return {
        t for t in asyncio.all_tasks()
        if t is not current and not t.done() and "ucxx" not in _coro_file(t)
    }


@pytest.fixture(autouse=True)
async def leak_check() -> AsyncIterator[None]:
    """After each test: no open UCX endpoints, no stray tasks, no stray threads in this process."""
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    assert open_connections() == 0, f"{open_connections()} UCX connection(s) left open: {_open_peers()}"
    deadline = time.monotonic() + 5
    while _owned_tasks() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _owned_tasks(), f"tasks left running: {_owned_tasks()}"
    assert _UCX is not None
    ucx_tasks = await on_ucx(_ucx_loop_tasks())
    assert not ucx_tasks, f"tasks left running on the UCX loop: {ucx_tasks}"
    def stray_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()
                and not t.name.startswith(("asyncio_", "uvloop_", "dkv-copy", "dkv-read"))]  # a loop's own
    # default executor (either kind), and the process's copy and read threads (dkv.copy_threads): made as work
    # first comes, then shared by every copy and every direct channel's read

    deadline = time.monotonic() + 5  # a thread told to stop (gRPC's poller, say) may take a moment to end
    while stray_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stray = stray_threads()
    assert not stray, f"threads left running: {stray}"
