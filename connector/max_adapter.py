"""Drop-in for Modular MAX: a ``create_connector`` with MAX's factory signature that builds a DKVConnector.

MAX's KV cache manager builds its connector through one factory call,
``create_connector(leaves, devices, replica_kv_memory, params,
device_memory_bytes)``. ``replica_kv_memory[replica][leaf]`` carries one 2-D
``uint8`` buffer per TP shard (``.buffers``), shaped ``[pages, bytes per page]``,
whose rows are the block ids ``load``/``offload`` name; MAX's buffers speak
DLPack, so ``torch.from_dlpack`` views them without a copy.

MAX has no plug-in registry: :func:`install` replaces the factory name in MAX's
modules with one that builds a DKVConnector when the connector type is ``dkv``
and defers to MAX's own factory otherwise. Configuration comes from the
connector config's ``block_store_endpoint`` (the co-located node) and the
environment: ``DKV_NODE`` (default ``127.0.0.1:7420``), ``DKV_ETCD``,
``DKV_ETCD_PREFIX``, ``DKV_CLUSTER``, ``DKV_NAMESPACE`` (default:
``DKV_TENANT``, default ``max``, plus a digest of the cache params), ``DKV_TOKEN``;
an etcd with TLS or authentication also reads ``DKV_ETCD_CA``, ``DKV_ETCD_CERT``,
``DKV_ETCD_KEY``, ``DKV_ETCD_USER``, ``DKV_ETCD_PASSWORD_FILE``
(:meth:`dkv.etcd.EtcdSettings.from_env`); ``DKV_GIL_SWITCH_INTERVAL`` (seconds, or
``off``: see :mod:`dkv.gil`).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from connector.dkv_connector import DKVConnector
from connector.types import LeafSpec, full_attention, sliding_window
from dkv.etcd import DEFAULT_CLUSTER, DEFAULT_PREFIX, EtcdSettings
from dkv.gil import ENVIRONMENT as GIL_ENVIRONMENT, parse_switch_interval
from dkv.keys import check_namespace

FACTORY_MODULES = (
    "max.pipelines.kv_cache.connectors",
    "max.pipelines.kv_cache.paged_kv_cache.jenga_cache_manager",
    "max.pipelines.kv_cache.paged_kv_cache.cache_manager",
)
DEFAULT_NODE = "127.0.0.1:7420"


def view_buffer(buffer: Any) -> torch.Tensor:
    """A torch view of a MAX buffer (or any DLPack / torch tensor), without copying."""
    if isinstance(buffer, torch.Tensor):
        return buffer
    return torch.from_dlpack(buffer)


def leaf_spec(group_id: Any, tp_shards: int) -> LeafSpec:
    """The LeafSpec for one of MAX's cache groups, keeping MAX's group id as the leaf's group id.

    MAX names a group by a ``KVCacheGroupId`` whose ``type`` is ``full`` or
    ``sliding_window`` (with ``window_size`` tokens); a plain int is taken as a
    full-attention group. Recurrent and scratch groups carry no block hashes,
    so MAX never hands them to a connector; one that arrives is refused.
    """
    kind = getattr(group_id, "type", "full")
    if kind == "full":
        return full_attention(group_id, tp_shards)
    if kind == "sliding_window":
        return sliding_window(group_id, int(group_id.window_size), tp_shards)
    raise ValueError(f"dKV serves attention leaves only, not a {kind!r} cache group")


def namespace_for(params: Any) -> str:
    """``DKV_NAMESPACE``, else a namespace derived from everything in the cache params that shapes KV bytes."""
    explicit = os.environ.get("DKV_NAMESPACE")
    if explicit:
        return check_namespace(explicit)
    fields = [f"{name}={getattr(params, name)!r}" for name in sorted(dir(params))
              if not name.startswith("_") and name in _LAYOUT_FIELDS and hasattr(params, name)]
    digest = hashlib.sha256("\n".join(fields).encode()).hexdigest()[:16]
    return check_namespace(f"{os.environ.get('DKV_TENANT', 'max')}/{digest}")


_LAYOUT_FIELDS = {
    "dtype", "page_size", "num_layers", "n_kv_heads", "n_kv_heads_per_device", "head_dim",
    "cache_strategy", "num_q_heads", "model_name", "enable_prefix_caching", "data_parallel_degree",
    "kvcache_quant_config", "is_mla",
}


def create_connector(
    leaves: Mapping[str, Any],
    devices: Sequence[Any],
    replica_kv_memory: Sequence[Mapping[str, Any]],
    params: Any,
    device_memory_bytes: int,
) -> DKVConnector:
    """Build a DKVConnector over MAX's device buffers (MAX's factory signature)."""
    if not replica_kv_memory:
        raise ValueError("replica_kv_memory names no replica")
    specs = {leaf: leaf_spec(group_id, len(replica_kv_memory[0][leaf].buffers))
             for leaf, group_id in leaves.items()}
    device_blocks = [
        {leaf: [view_buffer(b) for b in memory.buffers] for leaf, memory in replica.items() if leaf in specs}
        for replica in replica_kv_memory
    ]
    config = getattr(params, "kv_connector_config", None)
    node = getattr(config, "block_store_endpoint", None) or os.environ.get("DKV_NODE", DEFAULT_NODE)
    # a tenant's own credential (DKV_TENANT + DKV_TENANT_SECRET), else the cluster token (DKV_TOKEN)
    tenant_secret = os.environ.get("DKV_TENANT_SECRET")
    tenant = os.environ.get("DKV_TENANT") if tenant_secret else None
    if tenant_secret and not tenant:
        raise ValueError("DKV_TENANT_SECRET needs DKV_TENANT: the tenant the secret belongs to")
    token = tenant_secret or os.environ.get("DKV_TOKEN")
    return DKVConnector(
        specs,
        device_blocks,
        namespace=namespace_for(params),
        node=node,
        etcd_settings=EtcdSettings.from_env() if os.environ.get("DKV_ETCD") else None,  # + DKV_ETCD_CA etc.
        etcd_prefix=os.environ.get("DKV_ETCD_PREFIX", DEFAULT_PREFIX),
        cluster=os.environ.get("DKV_CLUSTER", DEFAULT_CLUSTER),
        token=token.encode() if token else None,
        tenant=tenant,
        gil_switch_interval=parse_switch_interval(os.environ.get(GIL_ENVIRONMENT)),
    )


def install() -> list[str]:
    """Route MAX's connector factory to dKV for connector type ``dkv``; returns the modules patched."""
    patched = []
    for name in FACTORY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(module, "create_connector", None)
        if original is None or getattr(original, "_dkv_wrapped", False):
            continue
        module.create_connector = _dispatch(original)
        patched.append(name)
    return patched


def _dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    def create(leaves: Any, devices: Any, replica_kv_memory: Any, params: Any, device_memory_bytes: int) -> Any:
        kind = getattr(getattr(params, "kv_connector_config", None), "type", None)
        if str(getattr(kind, "value", kind)) == "dkv":
            return create_connector(leaves, devices, replica_kv_memory, params, device_memory_bytes)
        return original(leaves, devices, replica_kv_memory, params, device_memory_bytes)

    create._dkv_wrapped = True  # type: ignore[attr-defined]
    return create
