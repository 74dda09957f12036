"""What an etcd outage costs the KV connector: hit rates during it, and how soon hints recover after it.

    python scripts/measure_etcd_outage.py [OUTAGE_SECONDS]    # default 20; about OUTAGE + 30 s in all

etcd (a process of its own) is SIGKILLed for OUTAGE seconds, then restarted on the same ports and data
directory. Two nodes join it (etcd lease TTL 10 s, the default); a reader connector sits beside node a,
a writer beside node b. Every 0.2 s the reader asks (1) for its co-located chain, no hint; (2) for b's
chain with the hint made before the outage, and loads it (checked bit for bit); (3) for b's chain with
a hint freshly routed by a separate request router, as the demo's. It prints the hit rate of each per
phase, the longest call, and how long after etcd was back a block stored during the outage became
routable and the routers saw b's new epoch. Everything started is stopped by PID at the end.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from cluster.etcd_process import start_etcd
from cluster.process import start_node
from connector.dkv_connector import DKVConnector
from connector.types import full_attention, sliding_window
from dkv.etcd import Layout, make_client
from dkv.loop_thread import acquire_shared_loop, release_shared_loop
from dkv.router import Router

NAMESPACE = "measure/outage"
PAGES, PAGE_BYTES = 32, 4096
LEAVES = {"full": full_attention(0), "swa": sliding_window(1, 64)}


def chain(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def wait(transfer, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not transfer.is_complete():
        if time.monotonic() > deadline:
            raise TimeoutError("transfer did not settle")
        time.sleep(0.002)


def connector(address: str, etcd_url: str, prefix: str) -> DKVConnector:
    blocks = [{leaf: [torch.zeros(PAGES, PAGE_BYTES, dtype=torch.uint8)] for leaf in LEAVES}]
    return DKVConnector(LEAVES, blocks, namespace=NAMESPACE, node=address, etcd=etcd_url, etcd_prefix=prefix,
                        timeout=3.0)


def offload(conn: DKVConnector, ids: list[int], hashes: list[bytes]) -> None:
    for leaf in LEAVES:
        conn._blocks[0][leaf][0][ids] = torch.randint(0, 256, (len(ids), PAGE_BYTES), dtype=torch.uint8)
    wait(conn.offload({leaf: ids for leaf in LEAVES}, {leaf: hashes for leaf in LEAVES}))


def main(outage: float) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="dkv-outage-"))
    prefix = f"/dkv-measure/{uuid.uuid4().hex[:6]}"
    incarnations = [start_etcd()]
    nodes, conns = [], []
    ucx = acquire_shared_loop()
    request_router = request_client = None
    try:
        url = incarnations[0].url
        for node_id in ("a", "b"):
            nodes.append(start_node("--etcd", url, "--etcd-prefix", prefix, "--node-id", node_id,
                                    workdir=workdir / node_id, exit_with_parent=True))
        writer = connector(nodes[1].address, url, prefix)
        reader = connector(nodes[0].address, url, prefix)
        conns += [writer, reader]
        on_peer, own = chain(4), chain(4)
        offload(writer, [1, 2, 3, 4], on_peer)
        offload(reader, [1, 2, 3, 4], own)

        async def start_router() -> tuple[object, Router]:
            client = make_client(url)
            await client.connect()
            router = Router(client, Layout(prefix=prefix))
            await router.start()
            return client, router

        request_client, request_router = ucx.run(start_router(), 30)
        deadline = time.monotonic() + 20
        while (request_router.route(NAMESPACE, on_peer).peer is None
               or reader._router.route(NAMESPACE, on_peer).peer is None):
            if time.monotonic() > deadline:
                raise TimeoutError("b's chain never became routable")
            time.sleep(0.05)
        old_hint = request_router.route(NAMESPACE, on_peer).hint.encode()
        b_epoch = request_router.members["b"].epoch
        into = [10, 11, 12, 13]
        samples: list[tuple[float, bool, bool, bool, float]] = []
        seen: dict[str, float] = {}
        stored_late: list[bytes] = []
        start = time.monotonic()
        killed = back = None
        while True:
            now = time.monotonic() - start
            if killed is None and now >= 3:
                incarnations[-1].proc.kill()
                incarnations[-1].proc.wait(10)
                killed = now
                stored_late = chain(3)
                offload(writer, [20, 21, 22], stored_late)
            if killed is not None and back is None and now >= killed + outage:
                incarnations.append(incarnations[-1].restart())
                back = time.monotonic() - start
            if back is not None:
                checks = {
                    "a block stored during the outage is routable": request_router.route(
                        NAMESPACE, stored_late).peer is not None,
                    "the request router sees b's new epoch": request_router.members.get("b") is not None
                    and request_router.members["b"].epoch != b_epoch,
                    "the connector's router sees b's new epoch": reader._router.members.get("b") is not None
                    and reader._router.members["b"].epoch != b_epoch,
                }
                for name, ok in checks.items():
                    if ok and name not in seen:
                        seen[name] = now - back
                if now > back + 20:
                    break
            longest = 0.0
            t = time.monotonic()
            local = reader.lookup(own)
            longest = max(longest, time.monotonic() - t)
            t = time.monotonic()
            hinted = reader.lookup(on_peer, hint=old_hint)
            longest = max(longest, time.monotonic() - t)
            loaded = all(all(mask) for mask in hinted.values())
            if loaded:
                t = time.monotonic()
                transfer = reader.load({leaf: into for leaf in LEAVES}, {leaf: on_peer for leaf in LEAVES},
                                       hint=old_hint)
                longest = max(longest, time.monotonic() - t)
                wait(transfer)
                loaded = all(torch.equal(reader._blocks[0][leaf][0][into], writer._blocks[0][leaf][0][[1, 2, 3, 4]])
                             for leaf in LEAVES)
            route = request_router.route(NAMESPACE, on_peer)
            fresh = False
            if route.hint is not None:
                t = time.monotonic()
                fresh = all(reader.lookup(on_peer, hint=route.hint.encode())["full"])
                longest = max(longest, time.monotonic() - t)
            samples.append((now, all(local["full"]), loaded, fresh, longest))
            time.sleep(0.2)

        def phase(name: str, low: float, high: float) -> None:
            chosen = [s for s in samples if low <= s[0] < high]
            rates = " · ".join(f"{100 * sum(s[i] for s in chosen) / len(chosen):.0f} %" for i in (1, 2, 3))
            print(f"{name:<14} {len(chosen):>4} samples  {rates}  longest call {1000 * max(s[4] for s in chosen):.0f} ms")

        print(f"etcd away {outage:.0f} s (SIGKILLed at {killed:.1f} s, back at {back:.1f} s)")
        print("hit rates: co-located · pre-outage hint (hit and bit-exact load) · fresh hint")
        phase("before", 0, killed)
        phase("during", killed, back)
        phase("after 0-5 s", back, back + 5)
        phase("after 5-20 s", back + 5, float("inf"))
        for name, after in seen.items():
            print(f"{name}: {after:.2f} s after etcd was back")
        print("unusable hints:", dict(reader.counters.unusable_hints))
    finally:
        for conn in conns:
            conn.shutdown()
        if request_router is not None:
            async def stop_router() -> None:
                await request_router.stop()
                await request_client.close()

            ucx.run(stop_router(), 10)
        release_shared_loop()
        for node in nodes:
            node.stop()
        for proc in incarnations[:-1]:
            if proc.alive():
                proc.proc.kill()
                proc.proc.wait(10)
        incarnations[-1].stop()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)
