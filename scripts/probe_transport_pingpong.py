#!/usr/bin/env python
"""Probe: dkv.transport vs plain asyncio TCP on loopback, two processes, interleaved rounds.

Measures (medians over rounds, each round interleaves every case):
  tcp_pp     plain asyncio-socket ping-pong of 16 bytes (length-prefixed)
  ucx_pp     Connection.send_message/recv_message ping-pong of a tiny msgpack map
  ucx_pp20k  the same with a ~20 KiB body
  tcp_S      a request, then N blocks of S bytes streamed back over a plain socket (GB/s)
  ucx_S      a request message, a reply message, then recv_payloads of N blocks of S (GB/s)

Usage: probe_transport_pingpong.py [--sizes 65536,262144,2097152] [--blocks 256] [--rounds 5]
Progress mode from DKV_UCX_PROGRESS (as the node's).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dkv import transport  # noqa: E402

PP_ITERS = 300


# ---------------------------------------------------------------- server (child) side
async def serve() -> None:
    transport.init_transport()
    blocks: dict[tuple[int, int], list[bytearray]] = {}

    def blocks_for(n: int, s: int) -> list[bytearray]:
        if (n, s) not in blocks:
            big = bytearray(os.urandom(s)) if s <= 1 << 20 else bytearray(s)
            blocks[(n, s)] = [bytearray(big) for _ in range(min(n, 8))]
        pool = blocks[(n, s)]
        return [pool[i % len(pool)] for i in range(n)]

    async def handler(conn: transport.Connection) -> None:
        try:
            while True:
                msg = await conn.recv_message(3600)
                op = msg["op"]
                if op == "ping":
                    await conn.send_message({"ok": True, "pad": msg.get("pad", b"")})
                elif op == "read":
                    await conn.send_message({"ok": True})
                    await conn.send_payloads(blocks_for(msg["n"], msg["s"]), 60)
                elif op == "bye":
                    conn.abort()
                    return
        except Exception:  # noqa: BLE001
            conn.abort()

    lst = transport.Listener(handler)

    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.setblocking(False)
    loop = asyncio.get_running_loop()

    async def tcp_client(s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(12)
        try:
            while True:
                await _recv_exact(loop, s, memoryview(hdr))
                op, n, size = struct.unpack("<III", hdr)
                if op == 0:  # ping: n bytes follow, echo them
                    body = bytearray(n)
                    await _recv_exact(loop, s, memoryview(body))
                    await loop.sock_sendall(s, bytes(hdr) + body)
                elif op == 1:  # stream n blocks of size
                    for b in blocks_for(n, size):
                        await loop.sock_sendall(s, b)
                else:
                    return
        except Exception:  # noqa: BLE001
            pass
        finally:
            s.close()

    async def tcp_accept() -> None:
        while True:
            s, _ = await loop.sock_accept(tcp)
            s.setblocking(False)
            asyncio.ensure_future(tcp_client(s))

    acc = asyncio.ensure_future(tcp_accept())
    print(f"{lst.port} {tcp.getsockname()[1]}", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    acc.cancel()
    lst.close()
    await transport.stop_progress()


async def _recv_exact(loop: asyncio.AbstractEventLoop, s: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = await loop.sock_recv_into(s, view)
        if not got:
            raise ConnectionError("closed")
        view = view[got:]


# ---------------------------------------------------------------- client (parent) side
async def client(args: argparse.Namespace) -> None:
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": ROOT})
    ucx_port, tcp_port = map(int, child.stdout.readline().split())
    transport.init_transport()
    loop = asyncio.get_running_loop()
    conn = await transport.connect("127.0.0.1", ucx_port)
    s = socket.create_connection(("127.0.0.1", tcp_port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    sizes = [int(x) for x in args.sizes.split(",")]
    dests = {sz: [bytearray(sz) for _ in range(args.blocks)] for sz in sizes}
    results: dict[str, list[float]] = {}

    async def tcp_pp() -> float:
        msg = struct.pack("<III", 0, 16, 0) + os.urandom(16)
        back = bytearray(len(msg))
        t = time.perf_counter()
        for _ in range(PP_ITERS):
            await loop.sock_sendall(s, msg)
            await _recv_exact(loop, s, memoryview(back))
        return (time.perf_counter() - t) / PP_ITERS * 1e3

    async def ucx_pp(pad: int) -> float:
        msg = {"op": "ping", "pad": os.urandom(pad)}
        t = time.perf_counter()
        for _ in range(PP_ITERS if pad < 4096 else PP_ITERS // 3):
            await conn.send_message(msg)
            await conn.recv_message()
        return (time.perf_counter() - t) / (PP_ITERS if pad < 4096 else PP_ITERS // 3) * 1e3

    async def tcp_stream(size: int) -> float:
        t = time.perf_counter()
        await loop.sock_sendall(s, struct.pack("<III", 1, args.blocks, size))
        for d in dests[size]:
            await _recv_exact(loop, s, memoryview(d))
        return args.blocks * size / (time.perf_counter() - t) / 1e9

    async def ucx_stream(size: int) -> float:
        t = time.perf_counter()
        await conn.send_message({"op": "read", "n": args.blocks, "s": size})
        await conn.recv_message()
        await conn.recv_payloads(dests[size], 60)
        return args.blocks * size / (time.perf_counter() - t) / 1e9

    async def ucx_one(size: int) -> float:  # one-block load latency (ms)
        t = time.perf_counter()
        for _ in range(20):
            await conn.send_message({"op": "read", "n": 1, "s": size})
            await conn.recv_message()
            await conn.recv_payloads(dests[size][:1], 60)
        return (time.perf_counter() - t) / 20 * 1e3

    for r in range(args.rounds + 1):
        cases = [("tcp_pp_ms", tcp_pp()), ("ucx_pp_ms", ucx_pp(0)), ("ucx_pp12k_ms", ucx_pp(12000)), ("ucx_pp20k_ms", ucx_pp(20000)),
                 ("ucx_one64k_ms", ucx_one(65536))]
        for sz in sizes:
            cases += [(f"tcp_{sz >> 10}K_GBs", tcp_stream(sz)), (f"ucx_{sz >> 10}K_GBs", ucx_stream(sz))]
        for name, coro in cases:
            v = await coro
            if r:  # round 0 is warm-up
                results.setdefault(name, []).append(v)
    med = {k: statistics.median(v) for k, v in results.items()}
    mode = os.environ.get("DKV_UCX_PROGRESS", "loop")
    print(f"mode={mode} rounds={args.rounds} blocks={args.blocks}")
    for k, v in med.items():
        print(f"  {k:16s} {v:8.4f}")
    print(f"  ucx_pp/tcp_pp      {med['ucx_pp_ms'] / med['tcp_pp_ms']:.2f}x")
    print(f"  one64k/tcp_pp      {med['ucx_one64k_ms'] / med['tcp_pp_ms']:.2f}x")
    for sz in sizes:
        print(f"  ucx/tcp {sz >> 10:5d}K     {med[f'ucx_{sz >> 10}K_GBs'] / med[f'tcp_{sz >> 10}K_GBs']:.2f}")
    await conn.send_message({"op": "bye"})
    conn.abort()
    s.close()
    child.stdin.close()
    child.wait(30)
    await transport.stop_progress()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true")
    p.add_argument("--sizes", default="65536,262144,2097152")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    asyncio.run(serve() if a.serve else client(a))
