"""Page layout, the page allocator with its prefix cache, and the prefix-hit rules."""

from __future__ import annotations

import pytest
import torch

from connector.engine.layout import PageLayout
from connector.engine.paged import OutOfPages, PagePool, ReplicaKV
from connector.engine.prefix import reconcile
from connector.types import full_attention, sliding_window


def test_layout_views_and_formula() -> None:
    layout = PageLayout("full", (0, 2, 3), block_size=4, heads_per_shard=2, head_dim=8)
    assert layout.bytes_per_page == 3 * 2 * 4 * 2 * 8 * 4
    pool = layout.allocate(5, "cpu")
    layout.check_pool(pool)
    view = layout.pool_view(pool)
    assert view.shape == (5, 3, 2, 4, 2, 8) and view.data_ptr() == pool.data_ptr()
    view[2, 1, 0, 3, 1, 7] = 1.5
    page = layout.unpack_page(pool[2])
    assert page.data_ptr() == pool[2].data_ptr() and page[1, 0, 3, 1, 7] == 1.5
    packed = layout.pack_page(page)
    assert packed.data_ptr() == page.data_ptr() and torch.equal(packed, pool[2])
    with pytest.raises(ValueError):
        layout.check_pool(torch.zeros(5, 7, dtype=torch.uint8))


def test_replica_kv_splits_heads_across_shards() -> None:
    layouts = {"full": PageLayout("full", (0, 1), 4, heads_per_shard=1, head_dim=2)}
    rep = ReplicaKV(layouts, tp=2, num_pages=4, device="cpu")
    k = torch.arange(3 * 2 * 2, dtype=torch.float32).view(3, 2, 2)
    v = -k
    rep.write("full", 1, 0, [(k, v), (k + 100, v - 100)])
    shard0 = layouts["full"].unpack_page(rep.page_bytes("full", 0, 1))
    shard1 = layouts["full"].unpack_page(rep.page_bytes("full", 1, 1))
    assert torch.equal(shard0[0, 0, :3, 0], k[:, 0]) and torch.equal(shard1[0, 0, :3, 0], k[:, 1])
    assert torch.equal(shard1[1, 1, :3, 0], v[:, 1] - 100)
    (k0, v0), (k1, _) = rep.gather("full", [1], 3)
    assert torch.equal(k0, k) and torch.equal(v0, v) and torch.equal(k1, k + 100)


def test_page_pool_refcounts_and_lru() -> None:
    pool = PagePool(4)  # pages 1..3
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert sorted((a, b, c)) == [1, 2, 3]
    with pytest.raises(OutOfPages):
        pool.allocate()
    assert pool.register(b"A", a) and pool.register(b"B", b)
    assert not pool.register(b"A", c)  # hash cached already
    pool.release(b)
    pool.release(a)  # LRU order: b, then a
    pool.release(c)  # uncached: free
    assert pool.allocate() == c
    assert pool.allocate() == b and pool.cached_page(b"B") is None  # evicted oldest
    pool.acquire(a)  # a cached page is taken back out of the LRU
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.release(a)
    pool.clear_cache()
    assert pool.cached_page(b"A") is None and pool.free_pages == 1
    with pytest.raises(ValueError):
        pool.acquire(0)


def test_reconcile_rules() -> None:
    leaves = {"full": full_attention(0), "swa": sliding_window(1, window=6)}  # 2 window blocks at bs=4
    t, f = True, False
    assert reconcile({"full": [t, t, t, f, t], "swa": [f, t, t, t, t]}, leaves, 4, 0) == 3
    assert reconcile({"full": [t, t, t, t], "swa": [f, f, t, f]}, leaves, 4, 0) == 0
    assert reconcile({"full": [t, t, t, t], "swa": [f, t, t, f]}, leaves, 4, 1) == 3  # hit 4 needs swa 2..3
    assert reconcile({"full": [t, t], "swa": [f, f]}, leaves, 4, 2) == 0
    assert reconcile({"full": [t, t, t]}, leaves, 4, 0, require_all_leaves=False) == 3
    with pytest.raises(ValueError):
        reconcile({"full": [t, t, t]}, leaves, 4, 0)
    with pytest.raises(ValueError):
        reconcile({"full": [t], "swa": [t, t]}, leaves, 4, 0)
