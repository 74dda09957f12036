"""Reference engine: a tiny deterministic transformer over a paged KV cache that drives a KV connector.

Used by tests, the demo and benchmarks. See :class:`Engine` for the loop and
:mod:`connector.engine.layout` for the page byte layout.
"""

from connector.engine.engine import FULL_LEAF, SWA_LEAF, Engine, GenerationResult, GenerationStats
from connector.engine.hashing import block_hashes, hash_block, root_hash
from connector.engine.layout import PageLayout
from connector.engine.model import ModelConfig, TinyTransformer, prefill_flops, prefill_flops_per_kv_byte
from connector.engine.null import CompletedLookup, NullConnector
from connector.engine.paged import NULL_PAGE, OutOfPages, PagePool, ReplicaKV
from connector.engine.prefix import reconcile
from connector.engine.protocol import PROTOCOL_MEMBERS, Connector, KVLookup

__all__ = [
    "FULL_LEAF", "SWA_LEAF", "Engine", "GenerationResult", "GenerationStats", "block_hashes", "hash_block",
    "root_hash", "PageLayout", "ModelConfig", "TinyTransformer", "prefill_flops", "prefill_flops_per_kv_byte",
    "CompletedLookup", "NullConnector", "NULL_PAGE", "OutOfPages", "PagePool", "ReplicaKV", "reconcile",
    "PROTOCOL_MEMBERS", "Connector", "KVLookup",
]
