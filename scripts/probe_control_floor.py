#!/usr/bin/env python
"""Probe: the floor under a same-host control round trip, layer by layer, interleaved in one run.

Every contender is one request and its reply over an abstract Unix stream
socket, from a blocking client on this thread to a server in another process
(so each round trip wakes both, as a lookup does):

  socket         raw bytes: ``sendall`` + ``recv_into`` against a blocking echo server (the floor);
  direct         :class:`dkv.direct_channel.DirectChannel` (a framed msgpack request and reply)
                 against the same blocking server answering a canned framed reply;
  direct+uvloop  the same client against a server on uvloop built from the node's own stream
                 (:class:`dkv.stream_channel.StreamConnection`: ``recv_message``/``send_message``);
  node lookup    ``NodeClient.lookup_direct`` of ``--hashes`` held hashes against a real node;
  connector lookup  ``DKVConnector.lookup`` of the same hashes (in place, over the connector's own
                 direct channel);
  one-block load ``lookup`` + ``load`` of the first hash's block (``--block-size``) until complete:
                 what ``scripts/bench.py`` times as its same-host one-block load.

So ``direct - socket`` is the client's framing and checks, ``direct+uvloop -
direct`` the event loop and stream layer a node pays per request,
``node lookup - direct+uvloop`` the node's own handling of the op (schema
check, store, lease, reply) and the client's request and answer, ``connector
lookup - node lookup`` the connector's (lease budget, masks, lease state,
held-blocks memory), and the last step the load's plan and checked copy. Each round runs every contender ``--samples``
times, rotating who goes first; the first round is warm-up.

``--pause`` times each sample after a pause instead of back to back, as a
lookup that follows a load or an idle stretch: ``sleep`` (3 ms asleep, both
processes idle), ``memcpy`` (a 16 MiB copy on this thread first) or ``spin``
(3 ms busy on this thread). What a pause adds to each layer tells what the
round trip pays for caches and CPUs gone cold while it waited.

Usage: probe_control_floor.py [--hashes 1] [--samples 2000] [--rounds 4] [--pause none|sleep|memcpy|spin]
                              [--block-size 4KiB]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

REQUEST = {"op": "lookup", "hashes": [b"\x01" * 32], "leaves": ["a"], "shards": 1, "lease": True, "group": 0}
REPLY = {"ok": True, "masks": {"a": b"\x01"}, "lease": 1, "ttl": 10.0}
TIMEOUT = 10.0
PAUSE_SECONDS = 0.003
PAUSE_COPY_BYTES = 16 << 20


def pause_before_each(kind: str) -> Callable[[], None]:
    """What runs before each sample (``--pause``): nothing, a sleep, a memcpy or a spin on this thread."""
    if kind == "sleep":
        return lambda: time.sleep(PAUSE_SECONDS)
    if kind == "memcpy":
        import numpy as np

        source, target = np.ones(PAUSE_COPY_BYTES, np.uint8), np.empty(PAUSE_COPY_BYTES, np.uint8)
        return lambda: np.copyto(target, source)
    if kind == "spin":
        def spin() -> None:
            until = time.perf_counter() + PAUSE_SECONDS
            while time.perf_counter() < until:
                pass
        return spin
    return lambda: None


def _framed(message: dict) -> bytes:
    from dkv.wire import encode_body, encode_header

    body = encode_body(message)
    return encode_header(len(body)) + body


def _listen(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen(4)
    return sock


def serve_blocking(name: str) -> None:
    """Echo server: a thread per connection answers every read with the canned framed reply."""
    reply = _framed(REPLY)
    listener = _listen(name)

    def answer(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1 << 16):  # one request in flight at a time: one read is one request
                conn.sendall(reply)

    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


def serve_uvloop(name: str) -> None:
    """The node's stream layer without the node: a StreamConnection per client, on uvloop."""
    from dkv.event_loop import run
    from dkv.stream_channel import StreamConnection

    async def handle(conn: StreamConnection) -> None:
        try:
            while True:
                await conn.recv_message(600.0)
                await conn.send_message(REPLY, TIMEOUT)
        except Exception:  # noqa: BLE001 - the client went away
            conn.abort()

    async def main() -> None:
        listener = _listen(name)
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        print("ready", flush=True)
        tasks = set()
        while True:
            conn, _ = await loop.sock_accept(listener)
            task = asyncio.ensure_future(handle(StreamConnection(conn, "probe")))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    run(main())


def _server(kind: str) -> tuple[subprocess.Popen[str], str]:
    name = f"dkv-probe-{kind}-{secrets.token_hex(6)}"
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", kind, name],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit(f"the {kind} server did not start")
    return proc, name


def _connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hashes", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pause", choices=("none", "sleep", "memcpy", "spin"), default="none",
                        help="before each sample: nothing (back to back), 3 ms asleep, a 16 MiB memcpy, 3 ms busy")
    parser.add_argument("--block-size", default="4KiB", help="the blocks' size (the bench's one-block load: 64KiB)")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        (serve_blocking if args.serve[0] == "blocking" else serve_uvloop)(args.serve[1])
        return 0
    if not 1 <= args.hashes <= 1024 or args.samples < 1 or args.rounds < 2:
        parser.error("--hashes in [1, 1024], --samples >= 1, --rounds >= 2")

    import torch

    from bench_common import (chained_hashes, direct_client, interleaved_rounds, latency_summary_us, store_through,
                              wait_done)
    from cluster.process import start_node, stop_process
    from connector.dkv_connector import DKVConnector
    from connector.types import full_attention
    from dkv.direct_channel import DirectChannel
    from dkv.loop_thread import acquire_shared_loop, release_shared_loop
    from dkv.units import parse_size

    block_bytes = parse_size(args.block_size)

    servers = [_server("blocking"), _server("uvloop")]
    node = start_node("--log-level", "WARNING", pool="64MiB", exit_with_parent=True)
    loop = acquire_shared_loop()
    writer: DKVConnector | None = None
    reader: DKVConnector | None = None
    client: Any = None
    channels: list[DirectChannel] = []
    try:
        hashes = chained_hashes(args.hashes)
        rows = torch.ones(args.hashes + 1, block_bytes, dtype=torch.uint8)
        writer = DKVConnector({"a": full_attention(0)}, [{"a": [rows]}], namespace="probe",
                              node=str(node.address), timeout=TIMEOUT)
        store_through(writer, "a", hashes, TIMEOUT)
        client = direct_client(loop, str(node.address), "probe", TIMEOUT)
        reader = DKVConnector({"a": full_attention(0)}, [{"a": [torch.zeros_like(rows)]}], namespace="probe",
                              node=str(node.address), timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT  # its direct channel opens in the background, on its first lookup
        while reader.counters.lookups_in_place == 0:
            if time.monotonic() > deadline:
                raise SystemExit("the connector's direct channel never opened")
            reader.lookup(hashes)
            time.sleep(0.01)

        raw_sock = _connect(servers[0][1])
        request, buffer = _framed(REQUEST), bytearray(1 << 16)
        to_blocking = DirectChannel(_connect(servers[0][1]), "blocking")
        to_uvloop = DirectChannel(_connect(servers[1][1]), "uvloop")
        channels += [to_blocking, to_uvloop]

        def socket_round_trip() -> None:
            raw_sock.sendall(request)
            raw_sock.recv_into(buffer)

        def node_lookup() -> None:
            assert client is not None
            if not all(client.lookup_direct(hashes, ["a"], group=1).masks["a"]):
                raise SystemExit("the node's lookup missed")

        def connector_lookup() -> None:
            assert reader is not None
            if not all(reader.lookup(hashes)["a"]):
                raise SystemExit("the connector's lookup missed")

        def one_block_load() -> None:
            assert reader is not None
            if not reader.lookup(hashes[:1])["a"][0]:
                raise SystemExit("the one-block lookup missed")
            wait_done(reader.load({"a": [1]}, {"a": hashes[:1]}), "the one-block load", TIMEOUT)

        contenders: dict[str, Callable[[], object]] = {
            "socket": socket_round_trip,
            "direct": lambda: to_blocking.exchange(REQUEST, TIMEOUT),
            "direct+uvloop": lambda: to_uvloop.exchange(REQUEST, TIMEOUT),
            "node lookup": node_lookup,
            "connector lookup": connector_lookup,
            "one-block load": one_block_load,
        }
        pause = pause_before_each(args.pause)

        def timed(call: Callable[[], object]) -> Callable[[], list[int]]:
            def batch() -> list[int]:
                out = []
                for _ in range(args.samples):
                    pause()
                    t0 = time.perf_counter_ns()
                    call()
                    out.append(time.perf_counter_ns() - t0)
                return out
            return batch

        samples = interleaved_rounds({name: timed(call) for name, call in contenders.items()}, args.rounds)
        print(f"same-host control round trips, {args.rounds - 1} rounds x {args.samples}; lookups of "
              f"{args.hashes} hash(es), one-block load of {args.block_size}; each after a pause: {args.pause}; "
              f"load average {os.getloadavg()[0]:.2f}")
        summaries = {name: latency_summary_us(values) for name, values in samples.items()}
        previous = None
        for name, summary in summaries.items():
            added = f"   (+{summary['p50_us'] - previous:.1f} µs)" if previous is not None else ""
            print(f"  {name:17s} p50 {summary['p50_us']:8.1f} µs   p99 {summary['p99_us']:8.1f} µs{added}")
            previous = summary["p50_us"]
        raw_sock.close()
    finally:
        for channel in channels:
            channel.abort()
        if client is not None:
            loop.run(client.close(), TIMEOUT)
        for conn in (reader, writer):
            if conn is not None:
                conn.shutdown()
        release_shared_loop()
        node.stop()
        for proc, _ in servers:
            stop_process(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
