"""Transformer pieces shared by the demo models, built on ``SequenceParallelAttention``.

Every tensor here is this rank's shard of the sequence: ``S`` below is ``S_local`` under the strategy
and the full length without it. Position-dependent math (rotary) uses the global ``position_ids`` of
the batch, so a shard computes exactly what the unsharded model computes at those tokens.

Under tensor parallelism (``SequenceParallelStrategy(tensor_parallel_size=t)``) the linears, the
embedding and the tied head split their weights over the ``tp`` group and the residual stream holds
``S_t = ceil(S / t)`` rows (Note [Megatron tensor + sequence parallelism]); unbound, they are the plain
``nn`` layers, so one model runs under every combination of degrees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lightning_sp.models._attention import (
    AttentionMask,
    SequenceParallelAttention,
    attention_group,
    sequence_parallel_cross_entropy,
)
from lightning_sp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelContext,
    TensorParallelModule,
    VocabParallelEmbedding,
    column_parallel_linear,
    tensor_parallel_cross_entropy,
    vocab_parallel_argmax,
)


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
    mlp_chunk_size: int | None = None
    """Tokens per tile of the sequence-tiled MLP (Note [Sequence-tiled MLP]): the MLP keeps only its input
    for backward and recomputes each tile there, so its ``[B, S, mlp_ratio * d_model]`` hidden activations
    never exist whole. Exact (same math per token). ``None``: the plain MLP. Not with tensor parallelism."""
    dense_attention: bool = False
    """Vanilla attention: materialise the ``[B, H, S, S]`` scores (matmul, softmax, matmul), as the memory
    baseline of Ring Attention's Table 3. Only where the attention is not sequence parallel."""
    activation_checkpointing: bool = False
    """Full activation checkpointing: each block keeps only its input for backward and runs its forward
    again there (``torch.utils.checkpoint``, non-reentrant), so a layer's activations exist for one
    layer at a time. Exact; the attention's collectives run again in the recomputation (same order on
    every rank), so its forward traffic is paid twice."""

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
        if self.mlp_chunk_size is not None and self.mlp_chunk_size < 1:
            raise ValueError(f"mlp_chunk_size must be >= 1 tokens (or None for the plain MLP), got {self.mlp_chunk_size}")

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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class MLP(nn.Sequential):
    """``fc1`` (column-parallel) -> GELU -> ``fc2`` (row-parallel); a ``Sequential`` so parameter names
    stay ``mlp.0.*`` / ``mlp.2.*``. ``chunk_size``: run it sequence-tiled (Note [Sequence-tiled MLP])."""

    def __init__(self, fc1: nn.Module, act: nn.Module, fc2: nn.Module, *, chunk_size: int | None = None) -> None:
        super().__init__(fc1, act, fc2)
        self.chunk_size = chunk_size

    def dense(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:  # [B, S_t, C] -> [B, S_t, C]
        return self[2](self[1](self[0](x, seq_len=seq_len)))

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:  # [B, S_t, C] -> [B, S_t, C]
        if self.chunk_size is None:
            return self.dense(x, seq_len)
        if self[0].tp_bound or self[2].tp_bound:
            raise NotImplementedError(
                "mlp_chunk_size does not combine with tensor parallelism (the MLP's collectives span the whole "
                "sequence); set mlp_chunk_size=None or tensor_parallel_size=1"
            )
        if x.size(1) <= self.chunk_size:
            return self.dense(x, seq_len)
        params = [p for p in self.parameters() if p.requires_grad]
        return _TiledMLP.apply(x, self, self.chunk_size, *params)


class _TiledMLP(torch.autograd.Function):
    """Note [Sequence-tiled MLP]

    The MLP acts on each token alone, so it can run tile by tile along the sequence (the blockwise
    feed-forward of Ring Attention / BPT, DeepSpeed ALST's TiledMLP)::

        forward:  x [B, S, C] -> for each tile x[:, i:i+c]: y[:, i:i+c] = fc2(gelu(fc1(x_tile)))   (no graph)
        backward: for each tile: recompute fc1 -> gelu -> fc2 on x_tile with a graph, backprop dy_tile,
                  write dx[:, i:i+c], add the tile's weight gradients

    Only ``x`` is saved, so the ``[B, S, mlp_ratio * C]`` hidden activations (two of them: fc1's output and
    GELU's) exist one ``[B, c, mlp_ratio * C]`` tile at a time, for one extra MLP forward in backward.
    Per token the math is the plain MLP's: outputs and gradients agree to round-off (the weight
    gradients are summed tile by tile).
    """

    @staticmethod
    def forward(ctx, x, mlp, chunk_size, *params):  # x [B, S, C] -> [B, S, C]
        ctx.save_for_backward(x)
        ctx.mlp, ctx.chunk_size, ctx.params = mlp, chunk_size, params
        out = torch.empty_like(x)
        for start in range(0, x.size(1), chunk_size):
            n = min(chunk_size, x.size(1) - start)
            out.narrow(1, start, n).copy_(mlp.dense(x.narrow(1, start, n), n))
        return out

    @staticmethod
    def backward(ctx, dout):  # dout [B, S, C]
        (x,) = ctx.saved_tensors
        mlp, chunk_size, params = ctx.mlp, ctx.chunk_size, ctx.params
        dx = torch.empty_like(x)
        dparams = [torch.zeros_like(p) for p in params]
        for start in range(0, x.size(1), chunk_size):
            n = min(chunk_size, x.size(1) - start)
            x_tile = x.narrow(1, start, n).detach().requires_grad_()  # [B, c, C]
            with torch.enable_grad():
                y_tile = mlp.dense(x_tile, n)  # [B, c, C]
            grads = torch.autograd.grad(y_tile, (x_tile, *params), dout.narrow(1, start, n))
            dx.narrow(1, start, n).copy_(grads[0])
            for acc, g in zip(dparams, grads[1:]):
                acc += g
        return dx, None, None, *dparams


class Block(TensorParallelModule):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = None
        self.ln1 = nn.LayerNorm(cfg.d_model)
        h, hkv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.d_model, (h + 2 * hkv) * d, output_sizes=(h * d, hkv * d, hkv * d))
        self.attn = SequenceParallelAttention(causal=cfg.causal, backend=cfg.attention_backend)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        self.mlp = MLP(ColumnParallelLinear(cfg.d_model, hidden), nn.GELU(), RowParallelLinear(hidden, cfg.d_model),
                       chunk_size=cfg.mlp_chunk_size)

    def bind_tensor_parallel(self, ctx: TensorParallelContext) -> None:
        """Check that the heads divide across TP first, then Ulysses (the linears split themselves)."""
        t, u, h, hkv = ctx.world, ctx.ulysses_degree, self.cfg.n_heads, self.cfg.kv_heads
        if h % t or hkv % t:
            raise ValueError(
                f"tensor_parallel_size={t} must divide both n_heads={h} and n_kv_heads={hkv} (each rank keeps "
                f"n_heads/t query and n_kv_heads/t key/value heads); tensor_parallel_size in "
                f"{_divisors(math.gcd(h, hkv))} would work"
            )
        if (h // t) % u:
            raise ValueError(
                f"after tensor parallelism each rank has n_heads/tensor_parallel_size = {h}/{t} = {h // t} query heads, "
                f"which ulysses_degree={u} does not divide (heads divide across TP first, then Ulysses); "
                f"ulysses_degree in {_divisors(h // t)} or tensor_parallel_size in "
                f"{[d for d in _divisors(math.gcd(h, hkv)) if (h // d) % u == 0]} would work"
            )
        self.tp = ctx

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                mask: AttentionMask | None = None) -> torch.Tensor:
        b, s = position_ids.shape  # x [B, S_t, C]: S_t = S without TP+SP, ceil(S / t) with it
        t = self.tp.world if self.tp is not None else 1
        h, hkv, d = self.cfg.n_heads // t, self.cfg.kv_heads // t, self.cfg.head_dim  # this rank's heads
        q, k, v = self.qkv(self.ln1(x), seq_len=s).split([h * d, hkv * d, hkv * d], dim=-1)  # [B, S, (H|Hkv)/t*D]
        q = rotary(q.view(b, s, h, d), position_ids, self.cfg.rope_base)  # [B, S, H/t, D]
        k = rotary(k.view(b, s, hkv, d), position_ids, self.cfg.rope_base)  # [B, S, Hkv/t, D]
        v = v.view(b, s, hkv, d)  # [B, S, Hkv/t, D]
        if self.cfg.dense_attention:
            a = self._dense_attention(q, k, v, cu_seqlens, mask)  # [B, S, H/t, D]
        else:
            a = self.attn(q, k, v, cu_seqlens=cu_seqlens, mask=mask)  # [B, S, H/t, D]
        x = x + self.proj(a.reshape(b, s, h * d))  # [B, S_t, C]
        return x + self.mlp(self.ln2(x), s)

    def _dense_attention(self, q, k, v, cu_seqlens, mask=None) -> torch.Tensor:
        """Vanilla attention with the scores materialised (``TransformerConfig.dense_attention``).
        ``q [B, S, H, D]``, ``k, v [B, S, H_kv, D]`` -> ``[B, S, H, D]``."""
        group = self.attn.process_group
        if group is not None and self.attn.resolved_backend() != "local" and torch.distributed.get_world_size(group) > 1:
            raise ValueError(
                "dense_attention=True attends only over this rank's tokens, but the attention is sequence "
                f"parallel (backend {self.attn.resolved_backend()!r}): set dense_attention=False under sequence parallelism"
            )
        if cu_seqlens is not None:
            raise NotImplementedError("dense_attention=True does not take cu_seqlens; use dense_attention=False")
        if mask is not None:
            raise NotImplementedError("dense_attention=True does not take an AttentionMask; use dense_attention=False")
        groups = q.size(2) // k.size(2)
        qh = q.transpose(1, 2)  # [B, H, S, D]
        kh = k.repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, H, S, D]
        vh = v.repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, H, S, D]
        scores = (qh @ kh.transpose(-2, -1)) * (q.size(-1) ** -0.5)  # [B, H, S, S]
        if self.cfg.causal:
            keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = scores.softmax(dim=-1)  # [B, H, S, S]
        return (probs @ vh).transpose(1, 2)  # [B, S, H, D]


class Transformer(TensorParallelModule):
    """Token embedding -> blocks -> final norm -> tied output head. ``[B, S]`` ids -> ``[B, S, V]`` logits
    (``[B, S, V_r]``, this rank's vocabulary range, under tensor parallelism: use ``cross_entropy`` and
    ``argmax``, which know)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = None
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model)
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
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """``mask``: this batch's ``AttentionMask`` on global positions (the same on every rank), passed to every
        attention layer over its constructor's fields."""
        if position_ids is None:  # unsharded use only: under the strategy positions come from the batch
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)  # [B, S_t, C]
        recompute = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for blk in self.blocks:
            if recompute:
                x = torch.utils.checkpoint.checkpoint(blk, x, position_ids, cu_seqlens, mask, use_reentrant=False)
            else:
                x = blk(x, position_ids, cu_seqlens, mask)
        # tied head: column-parallel over the vocabulary, [B, S_t, C] -> [B, S, V_r]
        return column_parallel_linear(self.ln_f(x), self.embed.weight, None, self.tp, seq_len=input_ids.size(1))

    def bind_tensor_parallel(self, ctx: TensorParallelContext) -> None:
        self.tp = ctx

    def sequence_parallel_group(self):
        """The process group the attention modules are bound to (``None``: not sequence parallel)."""
        return attention_group(self)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """Mean token cross-entropy of the global batch from this rank's ``logits [B, S, V(_r)]``, same on
        every rank: vocabulary-parallel under TP, summed over the sequence-parallel group under CP."""
        group = self.sequence_parallel_group()
        if self.tp_bound:
            return tensor_parallel_cross_entropy(logits, labels, tp=self.tp, vocab_start=self.embed.vocab_start,
                                                 ignore_index=ignore_index, group=group)
        return sequence_parallel_cross_entropy(logits, labels, ignore_index=ignore_index, group=group)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` predicted token ids (over the whole vocabulary under TP)."""
        if self.tp_bound:
            return vocab_parallel_argmax(logits, self.tp, vocab_start=self.embed.vocab_start)
        return logits.argmax(-1)
