"""A tiny deterministic transformer that prefills block by block over a paged KV cache.

Contracts:

* **Fixed weights.** Weights are drawn from a ``torch.Generator`` seeded with
  ``ModelConfig.seed`` on the CPU and then moved to the device, so one config
  gives the same weights everywhere.
* **Float32 everywhere**, no fused or shape-dispatching kernels in attention:
  it is written out as matmul + mask + softmax + matmul.
* **Chunks.** :meth:`TinyTransformer.forward_block` runs ``T`` new tokens at
  positions ``[offset, offset + T)`` against the past KV of each layer. Past KV
  of layer ``l`` covers positions ``[offset - L_l, offset)`` (``L_l`` may be
  shorter than ``offset`` for a windowed layer). A full-attention layer attends
  to every past position and causally within the chunk; a windowed layer with
  window ``W`` lets query ``q`` see key ``k`` iff ``q - W < k <= q``.
* **Bit-exactness.** The output is a pure function of the inputs' values and
  shapes. The engine calls it with the same shapes whether the past KV was just
  computed or loaded from bytes, so loaded KV gives bit-identical logits.
* **RoPE** angles come from a table built once at construction, indexed by
  position, so a position's rotation never depends on the chunk it is in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values, each ``[positions, n_kv_heads, head_dim]`` float32 (keys after RoPE)."""

FLOAT_BYTES = 4


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny transformer.

    ``window_layers`` are the indices of the layers that use a sliding window of
    ``sliding_window`` tokens; every other layer is full attention.
    """

    vocab: int = 64
    d_model: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 8
    mlp_hidden: int = 64
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = field(default_factory=tuple)
    max_positions: int = 4096
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "window_layers", tuple(sorted(set(self.window_layers))))
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        if any(not 0 <= layer < self.n_layers for layer in self.window_layers):
            raise ValueError("window_layers must be layer indices")
        if self.window_layers and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError("windowed layers need a positive sliding_window")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers, ascending."""
        return tuple(i for i in range(self.n_layers) if i not in self.window_layers)

    def layer_window(self, layer: int) -> int | None:
        """The window of ``layer`` in tokens, or ``None`` for full attention."""
        return self.sliding_window if layer in self.window_layers else None

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token leaves behind, over all layers (float32)."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * FLOAT_BYTES


def prefill_flops(config: ModelConfig, n_tokens: int) -> int:
    """Multiply-add FLOPs (2 per MAC) to prefill ``n_tokens`` tokens from scratch.

    Counts the projections, MLP and LM head for every token, and attention
    scores and weighted values over each query's visible keys (its window for a
    windowed layer). Norms, RoPE and softmax are left out.
    """
    c = config
    per_token_linear = 0
    per_token_linear += c.d_model * c.n_heads * c.head_dim  # q
    per_token_linear += 2 * c.d_model * c.n_kv_heads * c.head_dim  # k, v
    per_token_linear += c.n_heads * c.head_dim * c.d_model  # o
    per_token_linear += 3 * c.d_model * c.mlp_hidden  # gate, up, down
    linear = 2 * c.n_layers * per_token_linear * n_tokens + 2 * c.d_model * c.vocab * n_tokens
    attention = 0
    for layer in range(c.n_layers):
        window = c.layer_window(layer)
        visible = sum(min(p + 1, window) if window else p + 1 for p in range(n_tokens))
        attention += 2 * 2 * c.n_heads * c.head_dim * visible
    return linear + attention


def prefill_flops_per_kv_byte(config: ModelConfig, n_tokens: int) -> float:
    """FLOPs a prefill of ``n_tokens`` spends per byte of KV it produces.

    A load beats recompute when moving a byte costs less than computing it:
    compare ``bytes/s`` of a tier with ``FLOP/s / prefill_flops_per_kv_byte``.
    """
    if n_tokens <= 0:
        raise ValueError("n_tokens must be positive")
    return prefill_flops(config, n_tokens) / (config.kv_bytes_per_token() * n_tokens)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, heads, D]`` with ``cos``/``sin`` ``[T, D/2]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class TinyTransformer:
    """Decoder-only transformer: RMSNorm, GQA attention with RoPE, SwiGLU MLP, untied LM head."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        c = config

        def draw(*shape: int, fan_in: int) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32) / math.sqrt(fan_in)
            return w.to(self.device)

        self.embed = draw(c.vocab, c.d_model, fan_in=1)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(c.n_layers):
            self.layers.append(
                {
                    "attn_norm": torch.ones(c.d_model, device=self.device),
                    "wq": draw(c.d_model, c.n_heads * c.head_dim, fan_in=c.d_model),
                    "wk": draw(c.d_model, c.n_kv_heads * c.head_dim, fan_in=c.d_model),
                    "wv": draw(c.d_model, c.n_kv_heads * c.head_dim, fan_in=c.d_model),
                    "wo": draw(c.n_heads * c.head_dim, c.d_model, fan_in=c.n_heads * c.head_dim),
                    "mlp_norm": torch.ones(c.d_model, device=self.device),
                    "w_gate": draw(c.d_model, c.mlp_hidden, fan_in=c.d_model),
                    "w_up": draw(c.d_model, c.mlp_hidden, fan_in=c.d_model),
                    "w_down": draw(c.mlp_hidden, c.d_model, fan_in=c.mlp_hidden),
                }
            )
        self.final_norm = torch.ones(c.d_model, device=self.device)
        self.lm_head = draw(c.d_model, c.vocab, fan_in=c.d_model)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.arange(c.max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self._cos = angles.cos().to(torch.float32).to(self.device)
        self._sin = angles.sin().to(torch.float32).to(self.device)

    def weights(self) -> list[torch.Tensor]:
        """Every weight tensor, in a fixed order (for comparing two models)."""
        out = [self.embed]
        for layer in self.layers:
            out.extend(layer[k] for k in sorted(layer))
        out.extend([self.final_norm, self.lm_head])
        return out

    def empty_past(self) -> list[KV]:
        """Past KV of length 0 for every layer."""
        c = self.config
        empty = torch.empty(0, c.n_kv_heads, c.head_dim, dtype=torch.float32, device=self.device)
        return [(empty, empty) for _ in range(c.n_layers)]

    @torch.inference_mode()
    def forward_block(
        self, tokens: torch.Tensor | Sequence[int], position_offset: int, past_kv: Sequence[KV]
    ) -> tuple[torch.Tensor, list[KV]]:
        """Run ``T`` tokens at positions ``[position_offset, position_offset + T)``.

        ``past_kv[l]`` holds layer ``l``'s keys and values for the positions right
        before ``position_offset`` (see module docstring). Returns the logits
        ``[T, vocab]`` and this chunk's ``(k, v)`` per layer, each
        ``[T, n_kv_heads, head_dim]`` (contiguous).
        """
        c = self.config
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        t = ids.shape[0]
        if t == 0:
            raise ValueError("forward_block needs at least one token")
        if position_offset < 0 or position_offset + t > c.max_positions:
            raise ValueError(f"positions [{position_offset}, {position_offset + t}) exceed max_positions")
        if len(past_kv) != c.n_layers:
            raise ValueError(f"past_kv has {len(past_kv)} layers, the model {c.n_layers}")
        cos = self._cos[position_offset : position_offset + t]
        sin = self._sin[position_offset : position_offset + t]
        q_pos = torch.arange(position_offset, position_offset + t, device=self.device)
        group = c.n_heads // c.n_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)

        x = self.embed[ids]
        new_kv: list[KV] = []
        for index, (w, (past_k, past_v)) in enumerate(zip(self.layers, past_kv)):
            past_len = past_k.shape[0]
            if past_len > position_offset or past_v.shape[0] != past_len:
                raise ValueError(f"layer {index}: bad past KV length {past_len} at offset {position_offset}")
            h = _rms_norm(x, w["attn_norm"])
            q = _rotate((h @ w["wq"]).view(t, c.n_heads, c.head_dim), cos, sin)
            k = _rotate((h @ w["wk"]).view(t, c.n_kv_heads, c.head_dim), cos, sin).contiguous()
            v = (h @ w["wv"]).view(t, c.n_kv_heads, c.head_dim).contiguous()
            new_kv.append((k, v))
            keys = torch.cat((past_k, k), dim=0).repeat_interleave(group, dim=1)  # [S, H, D]
            values = torch.cat((past_v, v), dim=0).repeat_interleave(group, dim=1)
            k_pos = torch.arange(position_offset - past_len, position_offset + t, device=self.device)
            visible = k_pos[None, :] <= q_pos[:, None]
            window = c.layer_window(index)
            if window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - window
            scores = torch.matmul(q.transpose(0, 1), keys.permute(1, 2, 0)) * scale  # [H, T, S]
            scores = scores.masked_fill(~visible[None, :, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            attn = torch.matmul(probs, values.transpose(0, 1))  # [H, T, D]
            x = x + attn.transpose(0, 1).reshape(t, c.n_heads * c.head_dim) @ w["wo"]
            h = _rms_norm(x, w["mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        logits = _rms_norm(x, self.final_norm) @ self.lm_head
        return logits, new_kv
