#!/usr/bin/env python
"""Probe: CPU an idle UCX listener burns, per ucxx progress mode.

For each mode a child process runs a dkv.transport Listener (DKV_UCX_PROGRESS=mode) whose handler
waits in recv_message on the one connection this process opens (an idle node's state); the
child's CPU time (utime+stime from /proc) is read over --seconds.

Usage: probe_transport_idle.py [--modes loop,thread,thread-delayed,blocking,polling] [--seconds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def serve() -> None:
    from dkv import transport
    transport.init_transport()

    async def handler(conn: transport.Connection) -> None:
        try:
            await conn.recv_message(3600)
        except Exception:  # noqa: BLE001
            pass
        conn.abort()

    lst = transport.Listener(handler)
    print(lst.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    lst.close()
    await transport.stop_progress()


async def measure(args: argparse.Namespace) -> None:
    from dkv import transport
    transport.init_transport()
    for mode in args.modes.split(","):
        env = {**os.environ, "PYTHONPATH": ROOT, "DKV_UCX_PROGRESS": mode.replace("-delayed", "")}
        if mode.endswith("-delayed"):
            env["DKV_UCX_DELAYED_SUBMISSION"] = "1"
        child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, env=env)
        port = int(child.stdout.readline())
        conn = await transport.connect("127.0.0.1", port)
        await asyncio.sleep(1.0)  # settle
        c0, t0 = _cpu(child.pid), time.monotonic()
        await asyncio.sleep(args.seconds)
        c1, t1 = _cpu(child.pid), time.monotonic()
        print(f"{mode:16s} idle listener CPU: {100 * (c1 - c0) / (t1 - t0):5.1f} % of a core", flush=True)
        conn.abort()
        child.stdin.close()
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()
    await transport.stop_progress()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true")
    p.add_argument("--modes", default="loop,thread,thread-delayed,blocking,polling")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    asyncio.run(serve() if a.serve else measure(a))
