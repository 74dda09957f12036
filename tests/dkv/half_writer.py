"""A writer that reserves two blocks, sends or copies only part of them, then waits to be killed.

Usage: half_writer.py ADDRESS LOCAL(0|1) HASH_HEX...
Prints ``reserved`` once the node has reserved the slots and the partial bytes are out.
"""

from __future__ import annotations

import asyncio
import sys

from dkv.client import NodeClient

SIZE = 1 << 20  # blocks of GROUP_BYTES travel one UCX message each: the first is sent whole, the second never


async def main(address: str, local: bool, hashes: list[bytes]) -> None:
    client = NodeClient(address, "test/ns0", local=local)
    await client.connect()
    session = await client._open_session()  # a raw session: we stop half-way on purpose
    keys = [["L", 0, h] for h in hashes]
    shm = session.mapping is not None
    reply = await session.request({"op": "write", "keys": keys, "sizes": [SIZE] * len(keys), "shm": shm}, 10)
    if shm:
        session.mapping.slot(reply["offsets"][0], SIZE)[:] = b"\x01" * SIZE  # first block only, no commit
    else:
        assert reply.get("groups") == [1, 1], reply.get("groups")  # the node's cut: one message a block
        await session.conn._ep.send(bytearray(b"\x01" * SIZE))  # first block's message only
    print("reserved", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] == "1", [bytes.fromhex(h) for h in sys.argv[3:]]))
