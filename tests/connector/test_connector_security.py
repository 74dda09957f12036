"""A connector never loads from a peer that cannot prove the cluster credential (real etcd, real processes).

Anyone who can write etcd can add a member record and directory entries that
name any address. The hinted "peer" must then prove the credential in the
handshake; one that cannot is an unusable hint (``unauthenticated_peer``),
backed off, and not one byte of it reaches a device block.
"""

from __future__ import annotations

import os
import time

import torch

from dkv.etcd import DEFAULT_CLUSTER, Layout, MemberRecord
from dkv.hints import UNAUTHENTICATED_PEER
from dkv.wire import PROTOCOL_VERSION
from tests.conftest import etcd_client, etcd_lease, run_impostor
from tests.connector.conftest import NAMESPACE, PAGE_BYTES, device_blocks, routed_hint, two_leaves
from tests.connector.test_connector import answered, wait

TOKEN = b"cluster-token-0123456789"


async def test_a_fake_member_in_etcd_is_an_unusable_hint_and_serves_no_byte(etcd, node_factory, connectors,
                                                                           tmp_path) -> None:
    node = node_factory(*etcd.node_args("a"), token=TOKEN)
    hashes = [os.urandom(32) for _ in range(4)]
    layout = Layout(DEFAULT_CLUSTER, etcd.prefix)
    with run_impostor(tmp_path, PAGE_BYTES) as evil:
        async with etcd_client(etcd.url) as client, etcd_lease(client) as lease:
            record = MemberRecord("evil", evil["address"], "0-impostor", PROTOCOL_VERSION, time.time(), "elsewhere")
            await client.kv.put(layout.node_key("evil"), record.to_json(), lease=lease)
            for h in hashes:
                await client.kv.put(layout.block_key(NAMESPACE, h, "evil"), "0-impostor", lease=lease)
            blocks = device_blocks(two_leaves())
            before = [t.clone() for t in blocks[0]["full"]]
            conn = connectors(node.address, blocks=blocks, etcd=etcd.url, etcd_prefix=etcd.prefix, token=TOKEN)
            hint = routed_hint(conn, hashes, holder="evil")
            assert conn.lookup(hashes, hint=hint)["full"] == [False] * 4, "the impostor's presence was believed"
            handle = conn.start_lookup(hashes, hint=hint)
            masks = answered(handle)
            if any(masks["full"]):  # believed: the load would copy the impostor's bytes into the device
                wait(conn.load_lookup(handle, {"full": [1, 2, 3, 4]}, {"full": hashes}, hint=hint))
            else:
                conn.abandon_lookup(handle)
            assert all(torch.equal(a, b) for a, b in zip(before, blocks[0]["full"])), "impostor bytes reached a device"
            assert conn.counters.unusable_hints[UNAUTHENTICATED_PEER] >= 1
