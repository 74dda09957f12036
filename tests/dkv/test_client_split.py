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


async def test_read_and_write_of_more_keys_than_max_keys_are_split_not_refused(node_factory, clients) -> None:
    # 68 000 blocks, each run up to 65 536 keys: past a 64 MiB pool's default block bound (16 384) and a
    # connection's share of reserved keys (an eighth of it), so the node is given room for them
    # and a max_cost that takes its leased lookup (one request: 17 000 hashes x 2 leaves x 2 shards) whole
    node = node_factory("--max-blocks", str(8 * 65_536), "--max-cost", str(68_000))
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



async def test_split_write_still_evicts_its_chain_deepest_first_and_root_last(node_factory, clients) -> None:
    """Runs of a split write are separate uses: the root's run must be the newest, not the oldest."""
    block, slots = 64 * 1024, 16
    node = node_factory(pool=str(slots * block))
    client = clients(node.address)
    await client.connect()
    client._target.info.limits["max_keys"] = 2  # noqa: SLF001 - a node that takes two keys a request
    chain = [os.urandom(32) for _ in range(4)]
    result = await client.write([BlockKey("L", 0, h) for h in chain], [b"\x01" * block] * 4)
    assert result.statuses == ["write"] * 4
    gone: list[int] = []
    for _ in range(slots + 4):
        await client.write([BlockKey("F", 0, os.urandom(32))], [b"\x00" * block])
        mask = (await client.probe(chain, ["L"]))["L"]
        gone += [i for i, present in enumerate(mask) if not present and i not in gone]
    assert gone == [3, 2, 1, 0], "a split write must not leave the root's run older than the rest of its chain"


async def test_a_write_bigger_than_one_connections_reservation_bound_is_split_not_refused(node_factory,
                                                                                        clients) -> None:
    node = node_factory("--pool", "64MiB", "--max-reserved-per-connection", "4MiB")
    client = clients(node.address, local=False)
    block = 2**20
    keys = [BlockKey("L", 0, os.urandom(32)) for _ in range(16)]
    data = [os.urandom(block) for _ in keys]
    written = await client.write(keys, data)
    assert written.statuses == ["write"] * 16, "16 MiB in one write, through a 4 MiB reservation bound"
    found = await client.lookup([k.hash for k in keys], ["L"])
    dests = [bytearray(block) for _ in keys]
    await client.read(found.lease_id, keys, dests)
    assert [bytes(d) for d in dests] == data
