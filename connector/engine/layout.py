"""Byte layout of one page (one block of one leaf on one TP shard).

A leaf's device memory, per replica and per TP shard, is one contiguous 2-D
``uint8`` tensor ``[num_pages, bytes_per_page]``; row ``p`` is page (block id)
``p`` and row 0 is the null page, never allocated. A page holds, as float32 in
row-major order::

    [leaf_layer, kv, slot, head, dim]  =  [len(layers), 2, block_size, heads_per_shard, head_dim]

where ``leaf_layer`` indexes the leaf's model layers in ascending order, ``kv``
is 0 for keys (after RoPE) and 1 for values, ``slot`` is the token's position
within the block, and ``head`` is the shard's KV heads
``[shard * heads_per_shard, (shard + 1) * heads_per_shard)``. So::

    bytes_per_page = len(layers) * 2 * block_size * (n_kv_heads // tp) * head_dim * 4

Every accessor returns a view of the pool (no copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from connector.engine.model import FLOAT_BYTES


@dataclass(frozen=True)
class PageLayout:
    """The page layout of one leaf (identical on every shard and replica)."""

    leaf_id: str
    layers: tuple[int, ...]
    block_size: int
    heads_per_shard: int
    head_dim: int

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """``(leaf_layers, 2, block_size, heads_per_shard, head_dim)``."""
        return (len(self.layers), 2, self.block_size, self.heads_per_shard, self.head_dim)

    @property
    def bytes_per_page(self) -> int:
        """``len(layers) * 2 * block_size * heads_per_shard * head_dim * 4``."""
        return len(self.layers) * 2 * self.block_size * self.heads_per_shard * self.head_dim * FLOAT_BYTES

    def allocate(self, num_pages: int, device: str | torch.device) -> torch.Tensor:
        """A zeroed pool ``[num_pages, bytes_per_page]`` uint8 (row 0 is the null page)."""
        if num_pages < 2:
            raise ValueError("a pool needs the null page and at least one more")
        return torch.zeros(num_pages, self.bytes_per_page, dtype=torch.uint8, device=device)

    def check_pool(self, pool: torch.Tensor) -> None:
        """``ValueError`` unless ``pool`` is a contiguous 2-D uint8 tensor of this layout's rows."""
        if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
            raise ValueError("a pool must be a contiguous 2-D uint8 tensor")
        if pool.shape[1] != self.bytes_per_page:
            raise ValueError(f"pool rows are {pool.shape[1]} bytes, the layout needs {self.bytes_per_page}")

    def pool_view(self, pool: torch.Tensor) -> torch.Tensor:
        """The whole pool as float32 ``[num_pages, leaf_layers, 2, block_size, heads_per_shard, head_dim]``."""
        return pool.view(torch.float32).view(pool.shape[0], *self.page_shape)

    def unpack_page(self, row: torch.Tensor) -> torch.Tensor:
        """One page's bytes (``[bytes_per_page]`` uint8) as float32 ``page_shape`` (a view)."""
        if row.dtype != torch.uint8 or row.numel() != self.bytes_per_page:
            raise ValueError("not one page of this layout")
        return row.view(torch.float32).view(self.page_shape)

    def pack_page(self, page: torch.Tensor) -> torch.Tensor:
        """Float32 ``page_shape`` KV as its ``[bytes_per_page]`` uint8 bytes (a view when contiguous)."""
        if page.dtype != torch.float32 or tuple(page.shape) != self.page_shape:
            raise ValueError(f"expected float32 {self.page_shape}, got {page.dtype} {tuple(page.shape)}")
        return page.contiguous().view(torch.uint8).view(-1)
