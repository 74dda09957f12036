#!/usr/bin/env python
"""The control path's floor on each event loop kind (dkv.event_loop): the standard asyncio loop and uvloop.

Usage::

    python scripts/probe_event_loop.py [--samples 3000] [--rounds 5]

Measures, for each kind, in interleaved rounds (medians of per-round p50s):

* **ping-pong**: a 16-byte Unix-socket ping-pong between two processes, each
  running a loop of that kind (asyncio streams) — what a same-host control
  request costs before dKV does any work;
* **blocking client**: the same, with the client a plain blocking socket
  (only the server on the loop);
* **thread hop**: ``run_coroutine_threadsafe`` of an empty coroutine from
  another thread, waited on — the connector's scheduler-to-loop hop.

Prints one table with the uvloop / asyncio ratio of each. Nothing is left
running: the server processes are killed by PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dkv import event_loop  # noqa: E402

KINDS = ("asyncio", "uvloop")
MESSAGE = 16


def _serve(sock: socket.socket, kind: str) -> None:
    os.environ[event_loop.EVENT_LOOP_ENV] = kind

    async def main() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        while True:
            writer.write(await reader.readexactly(MESSAGE))

    try:
        event_loop.run(main())
    finally:
        os._exit(0)


def _server(kind: str) -> tuple[socket.socket, int]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        _serve(theirs, kind)
    theirs.close()
    return ours, pid


class LoopInThread:
    def __init__(self, kind: str) -> None:
        os.environ[event_loop.EVENT_LOOP_ENV] = kind
        self.loop = event_loop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: object, timeout: float = 30.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def measure(kind: str, samples: int) -> dict[str, float]:
    out: dict[str, float] = {}
    sock, pid = _server(kind)
    loop = LoopInThread(kind)
    try:
        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_unix_connection(sock=sock)

        reader, writer = loop.call(connect())  # type: ignore[misc]

        async def pings(n: int) -> list[int]:
            got = []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                writer.write(b"p" * MESSAGE)
                await reader.readexactly(MESSAGE)
                got.append(time.perf_counter_ns() - t0)
            return got

        loop.call(pings(200))
        out["ping-pong"] = statistics.median(loop.call(pings(samples))) / 1e3  # type: ignore[arg-type]
        writer.transport.pause_reading()

        async def nothing() -> None:
            return None

        hops = []
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            loop.call(nothing())
            hops.append(time.perf_counter_ns() - t0)
        out["thread hop"] = statistics.median(hops) / 1e3
        writer.close()
    finally:
        loop.stop()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        sock.close()
    sock, pid = _server(kind)
    try:
        sock.setblocking(True)
        got = []
        for i in range(samples + 200):
            t0 = time.perf_counter_ns()
            sock.sendall(b"p" * MESSAGE)
            n = 0
            while n < MESSAGE:
                n += len(sock.recv(MESSAGE - n))
            if i >= 200:
                got.append(time.perf_counter_ns() - t0)
        out["blocking client"] = statistics.median(got) / 1e3
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        sock.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    per_round: dict[str, dict[str, list[float]]] = {k: {} for k in KINDS}
    for round_no in range(args.rounds):
        for kind in KINDS[round_no % 2:] + KINDS[:round_no % 2]:  # who goes first alternates
            for name, value in measure(kind, args.samples).items():
                per_round[kind].setdefault(name, []).append(value)
    print(f"p50 µs, median of {args.rounds} interleaved rounds x {args.samples} samples")
    print(f"{'measure':<18}{'asyncio':>10}{'uvloop':>10}{'uvloop/asyncio':>16}")
    for name in per_round["asyncio"]:
        a = statistics.median(per_round["asyncio"][name])
        u = statistics.median(per_round["uvloop"][name])
        print(f"{name:<18}{a:>10.1f}{u:>10.1f}{u / a:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
