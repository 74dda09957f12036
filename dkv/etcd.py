"""etcd access for dKV: endpoints, the key layout, and a bounded client.

Key layout (DESIGN contract 10), everything under one prefix per cluster::

    <prefix>/<cluster>/nodes/<node_id>                        member record (JSON), on the node's lease
    <prefix>/<cluster>/blocks/<namespace>/<hash hex>/<node_id>  directory entry, on the node's lease

A namespace may itself contain ``/``; the hash and node id are the last two
components, so keys parse from the right. Values of directory entries are the
publishing epoch, so a reader can tell a stale entry from a fresh one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from etcd3aio import Etcd3Client

from dkv.errors import ConfigError

DEFAULT_PREFIX = "/dkv"
DEFAULT_CLUSTER = "default"
DEFAULT_ETCD_TIMEOUT = 5.0
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


def parse_endpoints(text: str | Sequence[str]) -> list[str]:
    """``"http://a:2379,b:2379"`` → ``["a:2379", "b:2379"]`` (scheme stripped, port required)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    endpoints = []
    for item in items:
        item = item.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        item = item.rstrip("/")
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {item!r} must be HOST:PORT (or http://HOST:PORT)")
        endpoints.append(item)
    if not endpoints:
        raise ConfigError("at least one etcd endpoint is needed")
    return endpoints


def prefix_end(prefix: str) -> bytes:
    """The exclusive end of the key range under ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


RANGE_PAGE = 2000


async def get_prefix(client: Etcd3Client, prefix: str, *, keys_only: bool = False,
                     timeout: float = DEFAULT_ETCD_TIMEOUT, page: int = RANGE_PAGE) -> tuple[list[Any], int]:
    """Every key-value under ``prefix`` at one revision, read in pages (a directory outgrows one gRPC message).

    Returns ``(kvs, revision)``.
    """
    end = prefix_end(prefix)
    start = prefix.encode()
    revision = 0
    kvs: list[Any] = []
    while True:
        response = await client.kv.get(start, range_end=end, revision=revision, limit=page,
                                       keys_only=keys_only, timeout=timeout)
        revision = revision or response.header.revision
        kvs.extend(response.kvs)
        if not response.more or not response.kvs:
            return kvs, revision
        start = response.kvs[-1].key + b"\0"


def check_node_id(node_id: str) -> str:
    """A node id: 1-64 characters of ``[A-Za-z0-9._-]`` (it is one etcd key component)."""
    if not isinstance(node_id, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", node_id):
        raise ConfigError(f"node id must be 1-64 characters of [A-Za-z0-9._-]: {node_id!r}")
    return node_id


def make_client(endpoints: str | Sequence[str], **tls: Any) -> Etcd3Client:
    """An unconnected etcd client (``await client.connect()``); ``tls`` takes ca_cert, cert_key, cert_chain."""
    return Etcd3Client(parse_endpoints(endpoints), rpc_max_attempts=2, **tls)


@dataclass(frozen=True)
class Layout:
    """Where a cluster's keys live in etcd."""

    cluster: str = DEFAULT_CLUSTER
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.cluster or "/" in self.cluster:
            raise ConfigError(f"cluster name must be non-empty and contain no '/': {self.cluster!r}")

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.cluster}/"

    @property
    def nodes(self) -> str:
        return f"{self.root}nodes/"

    @property
    def blocks(self) -> str:
        return f"{self.root}blocks/"

    def node_key(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    def block_key(self, namespace: str, block_hash: bytes, node_id: str) -> str:
        return f"{self.blocks}{namespace}/{block_hash.hex()}/{node_id}"

    def block_prefix(self, namespace: str, block_hash: bytes) -> str:
        return f"{self.blocks}{namespace}/{block_hash.hex()}/"

    def parse_block_key(self, key: str) -> tuple[str, bytes, str] | None:
        """``(namespace, hash, node_id)`` of a directory key, or ``None`` if it is not one."""
        if not key.startswith(self.blocks):
            return None
        namespace, _, rest = key[len(self.blocks):].rpartition("/")
        namespace, _, hash_hex = namespace.rpartition("/")
        node_id = rest
        try:
            block_hash = bytes.fromhex(hash_hex)
        except ValueError:
            return None
        if not namespace or not node_id or len(block_hash) not in (8, 32):
            return None
        return namespace, block_hash, node_id

    def parse_node_key(self, key: str) -> str | None:
        if not key.startswith(self.nodes):
            return None
        node_id = key[len(self.nodes):]
        return node_id if node_id and "/" not in node_id else None


@dataclass
class MemberRecord:
    """What a node says about itself in etcd (the value of its member key)."""

    node_id: str
    address: str  # UCX listener host:port
    epoch: str
    protocol_version: int
    started_at: float
    host_id: str
    worker_address: str = ""  # hex of the UCX worker address, for same-host endpoints
    host_total: int = 0
    host_used: int = 0
    disk_total: int = 0
    disk_used: int = 0
    blocks: int = 0
    published: int = 0
    publish_every: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> MemberRecord | None:
        """Parse a member value; ``None`` when it is not a record this version understands."""
        try:
            data = json.loads(raw)
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            return cls(**known)
        except (ValueError, TypeError, KeyError):
            return None
