"""Peer implementations of the algorithms lightning-sp runs, called the way their authors call them, for the
side-by-side benchmarks (``benchmarks/peers/run.py``, ``benchmarks/attention/run.py``). Never imported by the
library. Every peer takes and returns this rank's shard as ``[B, S/P, H, D]`` (the project's layout), so a
benchmark times both sides on the same tensors.

- ``deepspeed_ulysses(group, causal)``: DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` around
  ``F.scaled_dot_product_attention`` (``SDPALocal``). Raises ``ImportError`` without the ``bench`` extra.
- ``TorchRing(group, causal=..., load_balance=..., rotate=...)``: PyTorch's own ring attention, the code
  torchtitan runs under ``context_parallel()``:
  ``torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention`` and
  ``_templated_ring_attention_backward`` with the CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``) as the block op. They are
  called on plain tensors and a process group, as ``_scaled_dot_product_ring_flash_attention`` calls them
  on CUDA; the public ``context_parallel()`` has no CPU sharding rule (its dispatcher maps only the CUDA
  flash / efficient / cuDNN ops). ``load_balance=True`` is its head-tail layout (``_HeadTailLoadBalancer``:
  rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``, the same split as the ``zigzag`` layout);
  ``rotate`` is ``_cp_options.rotate_method``: ``"alltoall"`` passes K/V to the next rank each step
  (``_AllToAllRotater``, ``permute_tensor``), ``"allgather"`` (PyTorch's default) gathers all K/V once
  (``_AllGatherRotater``). Its backward always returns dK/dV around the ring by all-to-all.
  ``positions(seq_len)`` gives the global positions of this rank's shard in PyTorch's own layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class SDPALocal(torch.nn.Module):
    """DeepSpeed's local attention. ``DistributedAttention(scatter_idx=2, gather_idx=1)`` with
    ``batch_dim_idx=0`` hands it ``[B, N, H/P, D]`` and expects the same layout back."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, *args, **kwargs):
        # [B, N, H/P, D] -> [B, H/P, N, D] (SDPA's layout) -> back
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal
        )
        return out.transpose(1, 2)


def deepspeed_ulysses(group, causal: bool):
    """``(call, version)``: ``call(q, k, v) -> out``, all ``[B, S/P, H, D]``, through DeepSpeed's
    ``DistributedAttention`` (its all-to-alls, then ``SDPALocal``). Initialises ``deepspeed.comm`` on the
    existing gloo process group. Raises ``ImportError`` if DeepSpeed is not installed."""
    import deepspeed
    import deepspeed.comm as ds_comm
    from deepspeed.sequence.layer import DistributedAttention

    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    peer = DistributedAttention(SDPALocal(causal=causal), group, scatter_idx=2, gather_idx=1)
    return (lambda q, k, v, **_ignored: peer(q, k, v, 0)), deepspeed.__version__  # batch_dim_idx=0: [B, S, H, D]


def _cp():
    """PyTorch's private context-parallel module (2.9+: ``_context_parallel/_attention.py``)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError:  # torch < 2.9
        from torch.distributed.tensor.experimental import _attention as cp
    return cp


@contextlib.contextmanager
def _cp_options(*, load_balance: bool, rotate: str):
    """Set PyTorch's module-level ``_cp_options`` for one call and restore them after."""
    cp = _cp()
    opts = cp._cp_options
    old = (opts.enable_load_balance, opts.rotate_method)
    opts.enable_load_balance = load_balance
    opts.rotate_method = {"alltoall": cp._RotateMethod.ALL_TO_ALL, "allgather": cp._RotateMethod.ALL_GATHER}[rotate]
    try:
        yield cp
    finally:
        opts.enable_load_balance, opts.rotate_method = old


class _TorchRingFunction(torch.autograd.Function):
    """Forward and backward of PyTorch's ring on ``[B, H, S/P, D]`` (seq dim 2), saving what SDPA's own
    autograd node saves (``q, k, v, out, lse``)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, load_balance, rotate):
        aten = torch.ops.aten
        with _cp_options(load_balance=load_balance, rotate=rotate) as cp:
            out, lse = cp._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu, query=q, key=k, value=v,
                is_causal=causal, scale=scale,
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, load_balance, rotate)
        return out

    @staticmethod
    def backward(ctx, dout):
        aten = torch.ops.aten
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, load_balance, rotate = ctx.args
        with _cp_options(load_balance=load_balance, rotate=rotate) as cp:
            dq, dk, dv = cp._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout,
                grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=causal,
                dropout_p=0.0, scale=scale,
            )
        return dq, dk, dv, None, None, None, None, None


class TorchRing:
    """PyTorch's ring attention on this rank's shard ``[B, S/P, H, D]`` -> ``[B, S/P, H, D]`` (see the module
    docstring for what is called). ``load_balance=True`` needs causal attention and the head-tail shard
    (``positions``)."""

    def __init__(self, group, *, causal: bool, load_balance: bool, rotate: str, scale: float | None = None):
        if rotate not in ("alltoall", "allgather"):
            raise ValueError(f"rotate must be 'alltoall' or 'allgather', got {rotate!r}")
        if load_balance and not causal:
            raise ValueError("PyTorch's load balancing needs causal=True (its ring raises otherwise)")
        self.group, self.causal, self.load_balance, self.rotate, self.scale = group, causal, load_balance, rotate, scale

    @property
    def name(self) -> str:
        balance = "head-tail load-balanced" if self.load_balance else "no load balancing"
        return f"torch _templated_ring_attention ({balance}, rotate={self.rotate})"

    def positions(self, seq_len: int) -> torch.Tensor:
        """Global positions ``[S/P]`` of this rank's shard in PyTorch's layout."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.load_balance:
            from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

            order = _HeadTailLoadBalancer(seq_len, world, "cpu")._generate_indices()[0]  # [N], rank-major
        else:
            order = torch.arange(seq_len)
        return order.view(world, -1)[rank].long()

    def __call__(self, q, k, v, **_ignored):
        # [B, S/P, H, D] -> [B, H, S/P, D] (views; PyTorch's ring makes K/V contiguous itself)
        out = _TorchRingFunction.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.group,
                                       self.causal, self.scale, self.load_balance, self.rotate)
        return out.transpose(1, 2)  # [B, H, S/P, D] -> [B, S/P, H, D]
