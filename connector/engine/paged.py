"""Paged KV cache: page allocation with a device prefix cache, and KV reads/writes over the pools.

:class:`PagePool` does the bookkeeping of one leaf on one replica (its page ids
are shared by every TP shard of that leaf). :class:`ReplicaKV` holds one
replica's pools -- ``tensors[leaf][shard]`` -- and moves KV between them and
the model.

Page states: *free*; *referenced* (``refcount > 0``: held by a running request
or pinned by an in-flight offload); *cached* (``hash -> page`` in the prefix
cache). A cached page with ``refcount == 0`` sits in an LRU and is evicted
(its hash forgotten) when a page is needed and none is free. Page 0 is the
null page: never allocated, never cached, never freed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

import torch

from connector.engine.layout import PageLayout
from connector.engine.model import KV

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """No page is free and none is evictable (every page is referenced)."""


class PagePool:
    """Allocator, refcounts and prefix cache of one leaf on one replica."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("a pool needs the null page and at least one more")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0, oldest first
        self.evictions = 0

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self) -> int:
        """A page with refcount 1: a free one, else the least recently used evictable cached one."""
        if self._free:
            page = self._free.popleft()
        elif self._lru:
            page, _ = self._lru.popitem(last=False)
            del self._by_hash[self._hash_of.pop(page)]
            self.evictions += 1
        else:
            raise OutOfPages(f"all {self.num_pages - 1} pages are referenced")
        self._refs[page] = 1
        return page

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` pages could be allocated now."""
        return len(self._free) + len(self._lru) >= n

    def acquire(self, page: int) -> None:
        """Add a reference to an allocated or cached page."""
        self._check(page)
        if self._refs[page] == 0:
            if page not in self._lru:
                raise ValueError(f"page {page} is free")
            del self._lru[page]
        self._refs[page] += 1

    def release(self, page: int) -> None:
        """Drop a reference; at zero a cached page becomes evictable (most recent), others become free."""
        self._check(page)
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not referenced")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._hash_of:
                self._lru[page] = None
            else:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # ---- prefix cache -------------------------------------------------------------------------

    def register(self, block_hash: bytes, page: int) -> bool:
        """Cache a referenced ``page`` under ``block_hash``; False (nothing changes) if either is cached already."""
        self._check(page)
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} must be referenced to be cached")
        if block_hash in self._by_hash or page in self._hash_of:
            return False
        self._by_hash[block_hash] = page
        self._hash_of[page] = block_hash
        return True

    def cached_page(self, block_hash: bytes) -> int | None:
        """The page cached under ``block_hash``, if any (no reference is taken)."""
        return self._by_hash.get(block_hash)

    def clear_cache(self) -> None:
        """Forget every hash: evictable pages become free, referenced ones free on their last release."""
        for page in self._lru:
            self._free.append(page)
        self._lru.clear()
        self._by_hash.clear()
        self._hash_of.clear()

    # ---- inspection ---------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        return len(self._by_hash)

    @property
    def referenced_pages(self) -> int:
        return sum(1 for r in self._refs if r > 0)

    def _check(self, page: int) -> None:
        if not 0 < page < self.num_pages:
            raise ValueError(f"page {page} is not an allocatable page")


class ReplicaKV:
    """One DP replica's KV pools and their allocators.

    ``tensors[leaf][shard]`` is that leaf's ``[num_pages, bytes_per_page]``
    uint8 pool on TP shard ``shard``; ``pools[leaf]`` its :class:`PagePool`.
    """

    def __init__(
        self, layouts: Mapping[str, PageLayout], tp: int, num_pages: int, device: str | torch.device
    ) -> None:
        self.layouts = dict(layouts)
        self.tp = tp
        self.tensors: dict[str, list[torch.Tensor]] = {
            leaf: [layout.allocate(num_pages, device) for _ in range(tp)] for leaf, layout in layouts.items()
        }
        self._views: dict[str, list[torch.Tensor]] = {
            leaf: [layouts[leaf].pool_view(t) for t in shards] for leaf, shards in self.tensors.items()
        }
        self.pools: dict[str, PagePool] = {leaf: PagePool(num_pages) for leaf in layouts}

    def write(self, leaf: str, page: int, slot: int, kv: Sequence[KV]) -> None:
        """Store ``kv[i]`` (the leaf's ``i``-th layer, ``[T, n_kv_heads, D]``) at ``slot..slot+T`` of ``page``."""
        layout = self.layouts[leaf]
        if page == NULL_PAGE:
            raise ValueError("never write the null page")
        hps = layout.heads_per_shard
        t = kv[0][0].shape[0]
        if slot + t > layout.block_size:
            raise ValueError("a write must stay within one block")
        for shard, view in enumerate(self._views[leaf]):
            heads = slice(shard * hps, (shard + 1) * hps)
            for li, (k, v) in enumerate(kv):
                view[page, li, 0, slot : slot + t] = k[:, heads]
                view[page, li, 1, slot : slot + t] = v[:, heads]

    def gather(self, leaf: str, pages: Sequence[int], length: int) -> list[KV]:
        """The leaf's KV per layer over ``pages`` (consecutive blocks), first ``length`` positions.

        Each result is ``[length, n_kv_heads, D]``; the shards' heads are
        concatenated back in order. ``length`` may stop inside the last page.
        """
        layout = self.layouts[leaf]
        n_layers = len(layout.layers)
        if length == 0 or not pages:
            empty = torch.empty(0, layout.heads_per_shard * self.tp, layout.head_dim,
                                dtype=torch.float32, device=self._views[leaf][0].device)
            return [(empty, empty) for _ in range(n_layers)]
        if length > len(pages) * layout.block_size:
            raise ValueError("length exceeds the pages given")
        index = torch.tensor(list(pages), dtype=torch.long, device=self._views[leaf][0].device)
        parts = [view[index] for view in self._views[leaf]]  # [nb, Ll, 2, bs, hps, D] each
        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=4)
        nb = len(pages)
        out: list[KV] = []
        for li in range(n_layers):
            k = whole[:, li, 0].reshape(nb * layout.block_size, -1, layout.head_dim)[:length]
            v = whole[:, li, 1].reshape(nb * layout.block_size, -1, layout.head_dim)[:length]
            out.append((k, v))
        return out

    def page_bytes(self, leaf: str, shard: int, page: int) -> torch.Tensor:
        """Row ``page`` of the leaf's pool on ``shard`` (a view)."""
        return self.tensors[leaf][shard][page]
