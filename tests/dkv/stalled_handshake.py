"""Run as a script: a client that stalls its side of the UCX handshake, then completes it.

Usage: ``python stalled_handshake.py NODE_HOST NODE_PORT STALL_SECONDS``. The
client's handshake is held back for longer than any handshake timeout a node
might have, then completes; the connection must then work. Prints ``OK``.
"""

from __future__ import annotations

import asyncio
import sys

import ucxx
from ucxx._lib_async import application_context

from dkv.transport import Connection, init_transport, stop_progress


async def main(host: str, port: int, stall: float) -> None:
    init_transport()
    original = application_context.exchange_peer_info

    async def stalled(*args, **kwargs):
        await asyncio.sleep(stall)  # the node's half of the handshake waits meanwhile
        return await original(*args, **kwargs)

    application_context.exchange_peer_info = stalled
    try:
        endpoint = await ucxx.create_endpoint(host, port, endpoint_error_handling=True, connect_timeout=60.0)
    finally:
        application_context.exchange_peer_info = original
    conn = Connection(endpoint, f"{host}:{port}")
    await conn.close()
    await stop_progress()
    print("OK")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
