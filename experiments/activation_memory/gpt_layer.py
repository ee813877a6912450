"""The GPT layer of Korthikanti et al. 2022 (arXiv 2205.05198, Sec. 4.1), built so that every term of
their activation-memory formula exists as a tensor autograd saves, on this project's tensor-parallel
layers (``lightning_sp.tensor_parallel``) and, for the context-parallel rows, its attention.

    x [b, s/t, h] -> LN -> qkv (column) -> QK^T -> softmax -> dropout -> .V -> proj (row) -> dropout -> + x
                  -> LN -> fc1 (column) -> GeLU -> fc2 (row) -> dropout -> + x

Paper accounting, bytes per layer with 16-bit activations (``b`` batch, ``s`` sequence, ``h`` hidden,
``a`` heads)::

    LayerNorm inputs              2 x 2sbh          QKV input (LN output)        2sbh
    Q, K (for QK^T)               4sbh              softmax output               2as^2b
    softmax dropout mask          as^2b             dropout output (for .V)      2as^2b
    V (for .V)                    2sbh              proj input                   2sbh
    attention / MLP dropout masks 2 x sbh           fc1 input                    2sbh
    GeLU input                    8sbh              fc2 input                    8sbh
                                                    total  sbh (34 + 5 a s / h)

Dropout here saves a one-byte ``bool`` mask (``MaskDropout``), as the CUDA kernel the paper measured
does; PyTorch's CPU ``native_dropout`` keeps the mask in the input dtype (2 bytes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_sp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelContext, bind_tensor_parallel

ATTENTION = ("materialized", "flash")
RECOMPUTE = ("none", "selective", "full")


class _MaskDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        keep = torch.rand_like(x, dtype=torch.float32) >= p  # bool: 1 byte per element
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None


def mask_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout that saves a ``bool`` mask for backward (what CUDA's fused dropout stores)."""
    if not training or p == 0:
        return x
    return _MaskDropout.apply(x, p)


class GPTLayer(nn.Module):
    """One pre-LN GPT layer. ``attention``: ``"materialized"`` (scores ``[b, a, s, s]`` as in the paper)
    or ``"flash"`` (this project's blockwise kernel via ``SequenceParallelAttention``: saves q, k, v,
    out and a float32 log-sum-exp, never the scores). ``recompute``: ``"selective"`` checkpoints the
    attention core (QK^T, softmax, dropout, .V), ``"full"`` the whole layer (both reentrant, so the
    inputs they keep go through the saved-tensor hooks)."""

    def __init__(self, *, hidden: int, heads: int, dropout: float = 0.1, attention: str = "materialized",
                 recompute: str = "none", causal: bool = False, attention_module: nn.Module | None = None) -> None:
        super().__init__()
        if attention not in ATTENTION or recompute not in RECOMPUTE:
            raise ValueError(f"attention must be one of {ATTENTION} and recompute one of {RECOMPUTE}")
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
        self.h, self.a, self.p = hidden, heads, dropout
        self.attention, self.recompute = attention, recompute
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, output_sizes=(hidden,) * 3)
        self.proj = RowParallelLinear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = ColumnParallelLinear(hidden, 4 * hidden)
        self.fc2 = RowParallelLinear(4 * hidden, hidden)
        if attention_module is None and attention == "flash":
            from lightning_sp import SequenceParallelAttention

            attention_module = SequenceParallelAttention(causal=causal, backend="local")
        self.attn = attention_module
        self.tp: TensorParallelContext | None = None
        self.global_seq_len: int | None = None  # for a context-parallel attention_module: the unsharded s

    def bind(self, ctx: TensorParallelContext) -> None:
        if self.a % ctx.world:
            raise ValueError(f"tensor parallel degree {ctx.world} must divide heads={self.a}")
        bind_tensor_parallel(self, ctx)
        self.tp = ctx

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v [b, s, a/t, d] -> [b, s, a/t, d]``."""
        if self.attention == "flash":
            return self.attn(q, k, v, seq_len=self.global_seq_len)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, a/t, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.size(-1)))  # [b, a/t, s, s]
        probs = mask_dropout(torch.softmax(scores, dim=-1), self.p, self.training)
        return torch.matmul(probs, v).transpose(1, 2)  # [b, s, a/t, d]

    def _layer(self, x: torch.Tensor, s: int) -> torch.Tensor:
        b = x.size(0)  # x [b, s/t (SP) or s, h]
        t = self.tp.world if self.tp is not None else 1
        a, d = self.a // t, self.h // self.a
        qkv = self.qkv(self.ln1(x), seq_len=s)  # [b, s, 3h/t]
        q, k, v = (y.view(b, s, a, d) for y in qkv.split(a * d, dim=-1))  # [b, s, a/t, d] views
        if self.recompute == "selective":
            o = checkpoint(self._core, q, k, v, use_reentrant=True)
        else:
            o = self._core(q, k, v)
        x = x + mask_dropout(self.proj(o.reshape(b, s, a * d)), self.p, self.training)  # [b, s/t, h]
        y = self.fc2(F.gelu(self.fc1(self.ln2(x), seq_len=s)))
        return x + mask_dropout(y, self.p, self.training)

    def forward(self, x: torch.Tensor, seq_len: int, global_seq_len: int | None = None) -> torch.Tensor:
        """``x [b, s/t (TP+SP) or s/P (CP) or s, h]``; ``seq_len``: the length inside the tensor-parallel
        region (``s``, or ``s/P`` under CP); ``global_seq_len``: ``s`` under CP."""
        self.global_seq_len = global_seq_len if global_seq_len is not None else seq_len
        if self.recompute == "full":
            return checkpoint(self._layer, x, seq_len, use_reentrant=True)
        return self._layer(x, seq_len)
