"""Run as a script: one side of a dkv.transport connection, in the progress mode of ``DKV_UCX_PROGRESS``,
on the event loop of ``DKV_EVENT_LOOP`` (:mod:`dkv.event_loop`).

``python transport_peer.py serve PORT_FILE`` listens, writes its port to
``PORT_FILE`` (whole, by a rename), and serves
connections until one sends ``{"op": "bye"}``: ``echo`` is answered with the
same message; ``blocks`` (``sizes``, ``seed``) with ``{"ok": true}`` and then
payloads of those sizes filled from :func:`pattern`.

``python transport_peer.py ping HOST PORT`` connects, checks an echo of a small
and of a large message and a payload exchange of mixed sizes bit-exact, asks
the server to stop, and prints ``OK <its progress mode> <its event loop>``.
"""

from __future__ import annotations

import asyncio
import os
import sys

from dkv import transport
from dkv.event_loop import loop_kind, run

SIZES = [100, 64 * 1024, 5, 300 * 1024, 64 * 1024, 1 << 20, 7]


def pattern(size: int, seed: int) -> bytes:
    """Deterministic bytes that differ per size and seed."""
    block = bytes((seed * 31 + size + i) % 251 for i in range(min(size, 4096)))
    return (block * (size // len(block) + 1))[:size] if size else b""


async def serve(port_file: str) -> None:
    transport.init_transport()
    stop = asyncio.Event()

    async def handler(conn: transport.Connection) -> None:
        try:
            while True:
                msg = await conn.recv_message(3600)
                if msg["op"] == "echo":
                    await conn.send_message(msg)
                elif msg["op"] == "blocks":
                    await conn.send_message({"ok": True})
                    await conn.send_payloads([pattern(n, msg["seed"]) for n in msg["sizes"]], 60)
                elif msg["op"] == "bye":
                    await conn.send_message({"ok": True})
                    stop.set()
                    return
        except Exception:  # noqa: BLE001 - the peer went away
            pass
        finally:
            await conn.close()

    listener = transport.Listener(handler)
    with open(port_file + ".part", "w") as f:
        f.write(str(listener.port))
    os.replace(port_file + ".part", port_file)
    try:
        await asyncio.wait_for(stop.wait(), 300)
    finally:
        listener.close()
        await transport.stop_progress()


async def ping(host: str, port: int) -> None:
    conn = await transport.connect(host, port)
    mode = transport.active_progress_mode()
    try:
        for pad in (b"x" * 10, os.urandom(3 * transport.INLINE_MAX)):
            await conn.send_message({"op": "echo", "pad": pad})
            assert await conn.recv_message() == {"op": "echo", "pad": pad}, "echo differs"
        await conn.send_message({"op": "blocks", "sizes": SIZES, "seed": 3})
        assert await conn.recv_message() == {"ok": True}
        buffers = [bytearray(n) for n in SIZES]
        await conn.recv_payloads(buffers)
        assert all(bytes(b) == pattern(n, 3) for b, n in zip(buffers, SIZES)), "payloads differ"
        await conn.send_message({"op": "bye"})
        assert await conn.recv_message() == {"ok": True}
    finally:
        await conn.close()
        await transport.stop_progress()
    print(f"OK {mode} {loop_kind(asyncio.get_running_loop())}")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        run(serve(sys.argv[2]))
    else:
        run(ping(sys.argv[2], int(sys.argv[3])))
