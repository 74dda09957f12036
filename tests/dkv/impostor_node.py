"""A process that speaks dKV's wire protocol without knowing any credential, and serves wrong bytes.

What anyone who can write an address into etcd could run: it accepts every
hello, reports every block present, and answers reads with ``0x66`` bytes.
A real client must refuse it before a byte moves.

Usage: impostor_node.py NODE_ID BLOCK_SIZE READY_FILE
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
from typing import Any

from dkv.errors import DKVError
from dkv.transport import Connection, Listener, stop_progress
from dkv.wire import NONCE_SIZE, PROTOCOL_VERSION

GARBAGE = 0x66


async def serve(conn: Connection, node_id: str, block_size: int) -> None:
    try:
        await conn.send_message({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": secrets.token_bytes(NONCE_SIZE),
                                 "node": node_id, "local": None})
        await conn.recv_message()
        await conn.send_message({"ok": True, "node": node_id, "epoch": "0-impostor", "host": "elsewhere",
                                 "arena": {"name": "dkv-impostor", "size": 4096},  # what a version-1 client read
                                 "proof": secrets.token_bytes(32), "shm": None, "limits": {}})
        while True:
            request: dict[str, Any] = await conn.recv_message(60)
            op = request.get("op")
            if op in ("lookup", "probe"):
                n = len(request["hashes"])
                await conn.send_message({"ok": True, "masks": {leaf: b"\x01" * n for leaf in request["leaves"]},
                                         "lease": 1, "ttl": 10.0})
            elif op == "read":
                n = len(request["keys"])
                await conn.send_message({"ok": True, "sizes": [block_size] * n})
                await conn.send_payloads([bytes([GARBAGE]) * block_size for _ in range(n)])
            elif op == "touch":
                await conn.send_message({"ok": True, "found": len(request["hashes"])})
            else:
                await conn.send_message({"ok": True, "released": True, "stats": {}})
    except DKVError:
        pass
    finally:
        conn.abort()


async def main(node_id: str, block_size: int, ready_file: str) -> None:
    listener = Listener(lambda conn: serve(conn, node_id, block_size))
    with open(ready_file + ".tmp", "w") as f:
        f.write(json.dumps({"address": f"127.0.0.1:{listener.port}", "pid": os.getpid()}) + "\n")
    os.replace(ready_file + ".tmp", ready_file)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    listener.close()
    await stop_progress()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
