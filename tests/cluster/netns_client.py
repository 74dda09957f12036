"""Engine side of the --netns end-to-end test; runs inside the cluster's client namespace.

Usage: netns_client.py CLUSTER_DIR. Engine A (on node-0) offloads a prefix, the
router names node-0 in a hint, engine C (on the last node) loads it over TCP
across namespaces. Prints one JSON line: hit counts and bit-exactness.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from cluster.local import ClusterRecord
from connector.dkv_connector import DKVConnector
from connector.engine.engine import Engine
from connector.engine.hashing import block_hashes
from connector.engine.model import ModelConfig
from dkv.etcd import Layout, make_client
from dkv.loop_thread import acquire_shared_loop, release_shared_loop
from dkv.router import Router

MODEL = ModelConfig(window_layers=(1, 3), sliding_window=8, seed=9)
PROMPT = [(3 * i + 2) % MODEL.vocab for i in range(29)]
NS = "netns/e2e"


def main(directory: str) -> dict:
    torch.set_num_threads(1)
    record = ClusterRecord.load(directory)
    token = open(record.token_file).read().strip().encode() if record.token_file else None
    ucx = acquire_shared_loop()
    conns = []
    try:
        engines = []
        for node in (record.nodes[0], record.nodes[-1]):
            engine = Engine(MODEL, block_size=4, num_pages=64)
            conn = DKVConnector(engine.leaf_specs, engine.device_blocks, namespace=NS, node=node.address,
                                node_id=node.node_id, etcd=record.etcd_url, token=token, local=False)
            engine.attach_connector(conn)
            engines.append(engine)
            conns.append(conn)
        a, c = engines
        a.generate(PROMPT, 5)
        assert a.drain(30)
        hashes = block_hashes(PROMPT, 4)

        async def router() -> tuple:
            client = make_client(record.etcd_url)
            await client.connect()
            r = Router(client, Layout(record.cluster))
            await r.start()
            return client, r

        client, r = ucx.run(router(), 30)
        deadline = time.monotonic() + 20
        while (route := r.route(NS, hashes)).depth < len(hashes) - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        result = c.generate(PROMPT, 5, hint=route.hint.encode() if route.hint else None)
        reference = c.recompute_reference(PROMPT, 5)

        async def stop() -> None:
            await r.stop()
            await client.close()

        ucx.run(stop(), 10)
        return {
            "peer": route.peer.node_id if route.peer else None,
            "peer_address": route.peer.address if route.peer else None,
            "connector_hit_blocks": result.stats.connector_hit_blocks,
            "hits_peer": c.connector.counters.hits_peer,
            "shared_memory_used": any(cl.uses_shared_memory for cn in conns for cl in cn._clients.values()),
            "bit_exact": result.tokens == reference.tokens and torch.equal(result.logits, reference.logits),
        }
    finally:
        for conn in conns:
            conn.shutdown()
        release_shared_loop()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
