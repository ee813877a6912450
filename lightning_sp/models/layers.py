"""Transformer pieces shared by the demo models, built on ``SequenceParallelAttention``.

Every tensor here is this rank's shard of the sequence: ``S`` below is ``S_local`` under the strategy
and the full length without it. Position-dependent math (rotary) uses the global ``position_ids`` of
the batch, so a shard computes exactly what the unsharded model computes at those tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_sp.models._attention import SequenceParallelAttention, attention_group


@dataclass(kw_only=True)
class TransformerConfig:
    vocab_size: int
    """Embedding rows / output classes."""
    d_model: int = 128
    """Hidden width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads; head dim is ``d_model // n_heads``."""
    n_kv_heads: int | None = None
    """Key/value heads (GQA); ``None``: same as ``n_heads``."""
    mlp_ratio: float = 4.0
    """MLP hidden width / ``d_model``."""
    causal: bool = False
    """Causal (decoder) or bidirectional (encoder) attention."""
    rope_base: float = 10_000.0
    """Rotary frequency base."""
    attention_backend: str | None = None
    """``None``: the strategy's backend when bound, plain local attention otherwise."""
    dropout: float = 0.0
    """Must be 0: dropout is not supported (it would make sequence-parallel and local runs differ)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head dim d_model/n_heads={self.d_model // self.n_heads} must be even for rotary embeddings")
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if self.dropout != 0.0:
            raise NotImplementedError("dropout is not supported; use weight decay or a smaller model instead")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


def rotary(x: torch.Tensor, position_ids: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + D/2])`` by ``position * base^(-2i/D)``.

    ``x [B, S, H, D]``, ``position_ids [B, S]`` (global positions) -> ``[B, S, H, D]``, dtype of ``x``.
    """
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)  # [D/2]
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, S, D/2]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]  # [B, S, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, S, H, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim)
        self.attn = SequenceParallelAttention(causal=cfg.causal, backend=cfg.attention_backend)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape  # [B, S, C]
        h, hkv, d = self.cfg.n_heads, self.cfg.kv_heads, self.cfg.head_dim
        q, k, v = self.qkv(self.ln1(x)).split([h * d, hkv * d, hkv * d], dim=-1)  # [B, S, (H|Hkv)*D]
        q = rotary(q.view(b, s, h, d), position_ids, self.cfg.rope_base)  # [B, S, H, D]
        k = rotary(k.view(b, s, hkv, d), position_ids, self.cfg.rope_base)  # [B, S, Hkv, D]
        v = v.view(b, s, hkv, d)  # [B, S, Hkv, D]
        a = self.attn(q, k, v, cu_seqlens=cu_seqlens)  # [B, S, H, D]
        x = x + self.proj(a.reshape(b, s, h * d))  # [B, S, C]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Token embedding -> blocks -> final norm -> tied output head. ``[B, S]`` ids -> ``[B, S, V]`` logits."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)
        for blk in self.blocks:  # scale residual projections by depth (GPT-2)
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        if position_ids is None:  # unsharded use only: under the strategy positions come from the batch
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)  # [B, S, C]
        for blk in self.blocks:
            x = blk(x, position_ids, cu_seqlens)
        return F.linear(self.ln_f(x), self.embed.weight)  # [B, S, V]

    def sequence_parallel_group(self):
        """The process group the attention modules are bound to (``None``: not sequence parallel)."""
        return attention_group(self)
