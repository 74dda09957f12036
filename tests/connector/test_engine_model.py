"""The tiny transformer: fixed weights, correct chunked attention, bit-exact with KV that went through bytes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from connector.engine.layout import PageLayout
from connector.engine.model import KV, ModelConfig, TinyTransformer, prefill_flops, prefill_flops_per_kv_byte

CONFIG = ModelConfig(sliding_window=5, window_layers=(0, 2), seed=3)
BS = 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _blockwise(model: TinyTransformer, tokens: list[int], through_bytes: bool) -> torch.Tensor:
    """Prefill block by block; the past of each block is the earlier blocks' KV, optionally packed into
    page bytes and unpacked again (as a load from another engine would deliver it)."""
    c = model.config
    layout = PageLayout("all", tuple(range(c.n_layers)), BS, c.n_kv_heads, c.head_dim)
    pages: list[torch.Tensor] = []
    logits = []
    for start in range(0, len(tokens), BS):
        chunk = tokens[start : start + BS]
        past: list[KV] = []
        for layer in range(c.n_layers):
            window = c.layer_window(layer)
            first = 0 if window is None else max(0, start // BS - (-(-window // BS)))
            ks = [p[layer, 0] for p in pages[first:]]
            vs = [p[layer, 1] for p in pages[first:]]
            empty = torch.empty(0, c.n_kv_heads, c.head_dim)
            past.append((torch.cat(ks) if ks else empty, torch.cat(vs) if vs else empty))
        out, kv = model.forward_block(chunk, start, past)
        logits.append(out)
        page = torch.zeros(layout.page_shape)
        for layer, (k, v) in enumerate(kv):
            page[layer, 0, : len(chunk)] = k
            page[layer, 1, : len(chunk)] = v
        if through_bytes:
            raw = bytes(layout.pack_page(page).numpy().tobytes())
            page = layout.unpack_page(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        pages.append(page)
    return torch.cat(logits)


def test_same_seed_same_weights() -> None:
    a, b = TinyTransformer(CONFIG), TinyTransformer(CONFIG)
    assert all(torch.equal(x, y) for x, y in zip(a.weights(), b.weights()))
    c = TinyTransformer(ModelConfig(sliding_window=5, window_layers=(0, 2), seed=4))
    assert not all(torch.equal(x, y) for x, y in zip(a.weights(), c.weights()))


def test_chunked_matches_one_shot() -> None:
    model = TinyTransformer(CONFIG)
    tokens = [(5 * i + 1) % CONFIG.vocab for i in range(18)]
    whole, _ = model.forward_block(tokens, 0, model.empty_past())
    chunked = _blockwise(model, tokens, through_bytes=False)
    assert torch.allclose(whole, chunked, atol=1e-4, rtol=1e-4)
    # the window matters: the same model with every layer full attention differs
    full = TinyTransformer(ModelConfig(seed=3))
    assert not torch.allclose(full.forward_block(tokens, 0, full.empty_past())[0], whole, atol=1e-3)


def test_kv_through_bytes_is_bit_exact() -> None:
    model = TinyTransformer(CONFIG)
    tokens = [(3 * i + 2) % CONFIG.vocab for i in range(22)]
    computed = _blockwise(model, tokens, through_bytes=False)
    loaded = _blockwise(model, tokens, through_bytes=True)
    assert torch.equal(computed, loaded)
    assert torch.equal(computed.argmax(-1), loaded.argmax(-1))


def test_config_validation_and_flops() -> None:
    with pytest.raises(ValueError):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError):
        ModelConfig(window_layers=(1,))
    assert CONFIG.full_layers == (1, 3) and CONFIG.layer_window(0) == 5 and CONFIG.layer_window(1) is None
    assert CONFIG.kv_bytes_per_token() == 4 * 2 * 2 * 8 * 4
    assert prefill_flops(CONFIG, 64) > prefill_flops(CONFIG, 32) > 0
    full = ModelConfig()
    # attention grows with context in full layers, so the ratio grows with the prompt
    assert prefill_flops_per_kv_byte(full, 256) > prefill_flops_per_kv_byte(full, 16) > 0
