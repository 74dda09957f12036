"""Run as a script: a node stops answering while this client connects, then answers late.

Usage: ``python late_answer.py NODE_PID NODE_ADDRESS``. The node is stopped
(SIGSTOP) so that a request and the reconnect after it time out, then resumed
(SIGCONT): its late answers must not land anywhere in this process. Then a
write and a read of fresh blocks must come back bit-exact. Prints ``OK``; a
late answer landing in freed memory shows as a crash (exit by signal) or as
wrong bytes.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

from dkv.client import NodeClient
from dkv.errors import TransportError
from dkv.keys import BlockKey
from dkv.loop_thread import acquire_shared_loop, release_shared_loop

BOUND = 60.0


def main(pid: int, address: str) -> None:
    loop = acquire_shared_loop()
    try:
        client = NodeClient(address, "test/late", timeout=1.0)
        hashes = [os.urandom(32) for _ in range(4)]
        loop.run(client.lookup(hashes, ["full"], 1, lease=False), BOUND)
        os.kill(pid, signal.SIGSTOP)
        try:
            for _ in range(3):  # each: the pooled request times out, then the reconnect times out
                try:
                    loop.run(client.lookup(hashes, ["full"], 1, lease=False), BOUND)
                    raise AssertionError("a stopped node answered")
                except TransportError:
                    pass
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(2.0)  # the late answers arrive now
        gc.collect()
        blocks = [os.urandom(64 * 1024) for _ in hashes]
        keys = [BlockKey("full", 0, h) for h in hashes]
        result = loop.run(client.write(keys, blocks), BOUND)
        assert result.stored == len(keys), result.statuses
        back = [bytearray(len(b)) for b in blocks]
        found = loop.run(client.lookup(hashes, ["full"], 1, lease=True), BOUND)
        loop.run(client.read(found.lease_id, keys, back), BOUND)
        assert [bytes(b) for b in back] == blocks, "bytes came back wrong"
        loop.run(client.close(), BOUND)
    finally:
        release_shared_loop()
    print("OK")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
