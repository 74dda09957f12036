"""Run as a script: the connector with the package ``max`` made unimportable, so dKV's own protocol types stand in.

Usage: ``python without_max.py NODE_ADDRESS``. Offloads two blocks, looks them
up, refuses a load of an unreported block, loads the reported ones, and checks
the metrics and byte counts are dKV's own types; prints ``OK`` at the end.
"""

from __future__ import annotations

import os
import sys
import time

sys.modules["max"] = None  # type: ignore[assignment] - any "import max..." now raises ImportError

import torch  # noqa: E402

from connector import types  # noqa: E402
from connector.dkv_connector import DKVConnector  # noqa: E402
from connector.types import ByteCount, KVCacheMetrics, KVLoadRefused, full_attention  # noqa: E402


def wait(transfer) -> None:
    deadline = time.monotonic() + 30
    while not transfer.is_complete():
        assert time.monotonic() < deadline, "transfer did not settle"
        time.sleep(0.002)


def main(node: str) -> None:
    assert not types.MAX_AVAILABLE
    assert KVLoadRefused.__module__ == KVCacheMetrics.__module__ == ByteCount.__module__ == "connector.types"
    empty = ByteCount(free=0, total=0)
    assert (empty.used, empty.used_pct, empty.free_pct) == (0, 0.0, 0.0)
    blocks = [{"full": [torch.zeros(8, 256, dtype=torch.uint8)]}]
    conn = DKVConnector({"full": full_attention(0)}, blocks, namespace="test/nomax", node=node, timeout=3.0)
    try:
        blocks[0]["full"][0][1:3] = torch.arange(2 * 256, dtype=torch.int64).reshape(2, 256).to(torch.uint8)
        hashes = [os.urandom(8), os.urandom(8)]
        wait(conn.offload({"full": [1, 2]}, {"full": hashes}))
        assert conn.lookup(hashes) == {"full": [True, True]}
        try:
            conn.load({"full": [5]}, {"full": [os.urandom(8)]})
            raise AssertionError("a load of an unreported block must be refused")
        except KVLoadRefused as refused:
            assert refused.leaf_id == "full" and refused.block_hash is not None
        conn.lookup(hashes)
        wait(conn.load({"full": [4, 5]}, {"full": hashes}))
        assert torch.equal(blocks[0]["full"][0][4:6], blocks[0]["full"][0][1:3])
        conn.lookup(hashes, hint=b"{garbled")
        metrics = conn.take_metrics()
        assert type(metrics) is KVCacheMetrics and metrics.h2d_bytes_copied == 512
        assert metrics.connector_loads_refused == 1 and metrics.dkv_hints_rejected == 1
        assert type(conn.host_byte_count) is ByteCount
    finally:
        conn.shutdown()
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
