"""Reads and writes larger than one request may carry are split to fit the node's limits (real node).

Before, a load of more than 65 536 leaf x shard x block keys got a protocol
error and a closed connection. (With 64-character leaf ids at most, 65 536 keys
fit one 8 MiB frame, so the count is the limit that binds; the client splits by
the announced frame size too.)
"""

from __future__ import annotations

import os

from dkv.keys import BlockKey

LEAVES = ["a", "b"]
SHARDS = 2


async def test_read_and_write_of_more_keys_than_max_keys_are_split_not_refused(node, clients) -> None:
    client = clients(node.address, timeout=60.0)
    hashes = [os.urandom(8) for _ in range(17_000)]  # 2 leaves x 2 shards: 68 000 keys
    keys = [BlockKey(leaf, shard, h) for leaf in LEAVES for shard in range(SHARDS) for h in hashes]
    tagged = {0: b"first", len(keys) - 1: b"last!"}  # two blocks with bytes, the rest empty
    sources = [tagged.get(i, b"") for i in range(len(keys))]
    assert len(keys) > 65_536
    result = await client.write(keys, sources)
    assert result.stored == len(keys)
    found = await client.lookup(hashes, LEAVES, SHARDS)
    assert all(all(mask) for mask in found.masks.values())
    dests = [bytearray(len(s)) for s in sources]
    await client.read(found.lease_id, keys, dests)
    assert dests[0] == b"first" and dests[-1] == b"last!"
    stats = await client.stats()
    assert stats["leases"] == 0, "the last run of the read ends the lease"

