#!/usr/bin/env python
"""Probe: does a ucxx 0.52 tag receive into a buffer LARGER than the sent message complete,
and what does it leave in the rest of the buffer / return?  Also: a message larger than the
posted receive (truncation) must fail cleanly."""
from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dkv import transport  # noqa: E402


async def main() -> None:
    transport.init_transport()
    got: asyncio.Queue = asyncio.Queue()

    async def handler(conn):
        await got.put(conn)

    lst = transport.Listener(handler)
    client = await transport.connect("127.0.0.1", lst.port)
    server = await asyncio.wait_for(got.get(), 5)
    for size, post in ((16, 65536), (1000, 65536), (40000, 65536), (0, 64), (1, 64)):
        buf = bytearray(b"\xee" * post)
        msg = os.urandom(size)
        recv = asyncio.ensure_future(server._ep.recv(buf))
        await client._ep.send(msg)
        ret = await asyncio.wait_for(recv, 5)
        ok = bytes(buf[:size]) == msg and bytes(buf[size:]) == b"\xee" * (post - size)
        print(f"sent {size:6d} into {post:6d}: completed, returned {ret!r}, bytes ok={ok}")
    # truncation: message larger than the posted receive
    buf = bytearray(16)
    recv = asyncio.ensure_future(server._ep.recv(buf))
    await client._ep.send(os.urandom(1000))
    try:
        await asyncio.wait_for(recv, 5)
        print("truncation: completed?!")
    except Exception as exc:  # noqa: BLE001
        print(f"truncation: {type(exc).__name__}: {exc}")
    client.abort()
    server.abort()
    lst.close()
    await transport.stop_progress()


asyncio.run(main())
