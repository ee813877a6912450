"""``SequenceParallelAttention``: exact attention over a sequence split across ranks.

    attn = SequenceParallelAttention(causal=True, backend="zigzag_ring", group=sp_group)
    q_local = shard_sequence(q, sp_group, layout=attn.layout)      # [B, N/P, H, D]
    out_local = attn(q_local, k_local, v_local)                      # [B, N/P, H, D]

Built with ``backend=None`` it runs plain local attention until a ``SequenceParallelStrategy``
binds it (``bind``), so one model runs with and without sequence parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from lightning_sp.comm.stats import CommStats
from lightning_sp.context import SequenceParallelContext
from lightning_sp.layout import SequenceLayout, group_size_and_rank
from lightning_sp.ops import backends
from lightning_sp.ops.kernels import KERNELS, make_kernel

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def default_ulysses_degree(group_size: int) -> int:
    """For ``usp`` when none is given: the largest divisor of P that leaves a ring of >= 2 ranks."""
    return max(d for d in range(1, group_size // 2 + 1) if group_size % d == 0) if group_size > 1 else 1


def layout_for_backend(backend: str, *, group_size: int | None = None, ulysses_degree: int | None = None) -> SequenceLayout:
    """How the global sequence must be split across the group for ``backend``."""
    if backend not in backends.BACKENDS:
        raise ValueError(f"backend must be one of {backends.BACKENDS}, got {backend!r}")
    if backend in ("zigzag_ring", "allgather_kv", "auto"):
        return SequenceLayout("zigzag")
    if backend == "usp":
        if ulysses_degree is None:
            if group_size is None:
                raise ValueError("backend='usp' needs ulysses_degree (or a group to choose one from)")
            ulysses_degree = default_ulysses_degree(group_size)
        return SequenceLayout("zigzag", ulysses_degree=ulysses_degree)
    return SequenceLayout("contiguous")


def make_usp_groups(group, ulysses_degree: int):
    """Ulysses and ring sub-groups of ``group`` (Ulysses-inner). Every rank of the *world* must call
    this in the same order, so it only works for a group spanning the world; the strategy builds
    them for every other case."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            "usp on a group smaller than the world needs its Ulysses/ring sub-groups built on every rank: "
            "use SequenceParallelStrategy, or pass a SequenceParallelContext with ulysses_group and ring_group"
        )
    p, u = len(ranks), ulysses_degree
    mine_u = mine_r = None
    for i in range(p // u):  # Ulysses groups: consecutive group ranks
        g = dist.new_group([ranks[i * u + j] for j in range(u)])
        if dist.get_rank() in ranks[i * u : (i + 1) * u]:
            mine_u = g
    for j in range(u):  # ring groups: stride u
        members = [ranks[i * u + j] for i in range(p // u)]
        g = dist.new_group(members)
        if dist.get_rank() in members:
            mine_r = g
    return mine_u, mine_r


class SequenceParallelAttention(nn.Module):
    """Exact (no approximation) softmax attention over the whole global sequence.

    Args:
        causal: mask future keys (decoders); ``False`` for bidirectional encoders.
        softmax_scale: defaults to ``1/sqrt(D)``.
        backend: one of ``"ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal",
            "local", "auto"``; ``None``: the bound strategy's choice, or local attention if unbound.
        group: the sequence-parallel process group (overrides a bound context's).
        ulysses_degree: inner Ulysses degree for ``usp``.
        kernel: local kernel, ``"auto"``, ``"torch"``, ``"sdpa"`` or ``"flash_attn"``.
        dropout_p, window_size: not supported; anything but the defaults raises.
        validate_inputs: check at every call that all ranks pass matching shapes and dtypes (one
            tiny all-gather); a mismatch raises instead of hanging or computing garbage.
    """

    def __init__(
        self,
        *,
        causal: bool = False,
        softmax_scale: float | None = None,
        backend: str | None = None,
        group=None,
        ulysses_degree: int | None = None,
        kernel: str = "auto",
        dropout_p: float = 0.0,
        window_size: tuple[int, int] | None = None,
        validate_inputs: bool = True,
    ):
        super().__init__()
        if dropout_p:
            raise NotImplementedError(
                "attention dropout is not supported (it would need the same RNG stream on every rank); "
                "apply dropout to the attention output or the residual stream instead"
            )
        if window_size is not None:
            raise NotImplementedError(
                "sliding-window attention is not supported; use cu_seqlens to restrict attention to documents"
            )
        if backend is not None and backend not in backends.BACKENDS:
            raise ValueError(f"backend must be one of {backends.BACKENDS} or None, got {backend!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if ulysses_degree is not None and ulysses_degree < 1:
            raise ValueError(f"ulysses_degree must be >= 1, got {ulysses_degree}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.group = group
        self.ulysses_degree = ulysses_degree
        self.kernel = kernel
        self.validate_inputs = validate_inputs
        self._context: SequenceParallelContext | None = None
        self._own_context: SequenceParallelContext | None = None
        self._kernel_cache: dict = {}

    # -- binding -------------------------------------------------------------------------------

    def bind(self, context: SequenceParallelContext) -> None:
        """Attach to a strategy's groups/backend (``backend=None`` modules then use its backend)."""
        self._context = context

    @property
    def context(self) -> SequenceParallelContext:
        """The bound context, or one built from this module's own arguments."""
        if self._context is not None:
            return self._context
        if self._own_context is None:
            self._own_context = SequenceParallelContext(
                group=self.group, backend=self.backend or "local", ulysses_degree=self.ulysses_degree
            )
        return self._own_context

    @property
    def comm_stats(self) -> CommStats:
        return self.context.comm

    @property
    def process_group(self):
        """The sequence-parallel group this module attends over (``None``: no parallelism)."""
        return self.group if self.group is not None else self.context.group

    def resolved_backend(self) -> str:
        if self.backend is not None:
            return self.backend
        if self._context is not None:
            return self._context.backend
        return "local"

    def _ulysses_degree(self, world: int) -> int:
        u = self.ulysses_degree or self.context.ulysses_degree or default_ulysses_degree(world)
        if world % u:
            raise ValueError(f"ulysses_degree={u} must divide the sequence-parallel group size {world}")
        return u

    @property
    def layout(self) -> SequenceLayout:
        backend = self.resolved_backend()
        world, _ = group_size_and_rank(self.process_group)
        if backend in ("local",) or world == 1:
            return SequenceLayout("contiguous")
        return layout_for_backend(backend, group_size=world, ulysses_degree=self._ulysses_degree(world) if backend == "usp" else None)

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens=None, seq_len: int | None = None,
        softmax_scale: float | None = None, **unsupported,
    ) -> torch.Tensor:
        """``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` -> ``[B, S_local, H, D]``.

        ``cu_seqlens``: int cumulative lengths ``[0, l1, ..., N]`` of the *global* packed sequence
        (``B == 1``), the same on every rank. ``seq_len``: unpadded global length (defaults to the
        bound context's ``global_seq_len``); positions at or beyond it are padding, never attended.
        ``softmax_scale``: overrides the constructor's for this call (Hugging Face passes ``scaling``
        per call).
        """
        if unsupported:
            names = ", ".join(sorted(unsupported))
            raise NotImplementedError(
                f"unsupported argument(s) {names}: arbitrary masks and biases are not supported; "
                "use causal=True and/or cu_seqlens for packed documents"
            )
        _check_local_inputs(q, k, v, cu_seqlens)
        group = self.process_group
        world, _ = group_size_and_rank(group)
        backend = self.resolved_backend()
        if world == 1:
            backend = "local"
        if seq_len is None:
            seq_len = self.context.global_seq_len
        padded_len = q.size(1) * world
        doc_bounds = _doc_bounds(cu_seqlens, seq_len, padded_len)
        if self.validate_inputs and world > 1:
            _check_across_ranks(q, k, self.causal, backend, cu_seqlens, seq_len, group)
        if backend == "auto":  # lowest traffic when the heads split; else the balanced ring
            backend = "ulysses" if q.size(2) % world == 0 else "zigzag_ring"
        layout = self.layout
        call = backends.AttentionCall(
            kernel=self._make_kernel(q), scale=_resolve_scale(softmax_scale, self.softmax_scale, q.size(-1)),
            causal=self.causal, layout=layout, padded_len=padded_len, doc_bounds=doc_bounds,
            stats=self.context.comm,
        )
        if backend == "local":
            return backends.local_attention(q, k, v, call)
        if backend == "ulysses":
            return backends.ulysses_attention(q, k, v, call, group=group)
        if backend in ("ring", "zigzag_ring"):
            return backends.ring_attention(q, k, v, call, group=group)
        if backend == "allgather_kv":
            return backends.allgather_kv_attention(q, k, v, call, group=group)
        if backend == "colossal":
            return backends.colossal(q, k, v, call, group=group)
        if backend == "usp":
            ug, rg = self._usp_groups(group, world)
            return backends.usp_attention(q, k, v, call, ulysses_group=ug, ring_group=rg)
        raise AssertionError(f"unhandled backend {backend}")  # BACKENDS is checked in __init__/bind

    def _make_kernel(self, q):
        name = self.kernel if self.kernel != "auto" else self.context.kernel
        key = (name, q.device.type)
        if key not in self._kernel_cache:
            self._kernel_cache[key] = make_kernel(name)
        return self._kernel_cache[key]

    def _usp_groups(self, group, world):
        ctx = self.context
        u = self._ulysses_degree(world)
        if ctx.ulysses_group is not None and ctx.ring_group is not None:
            if dist.get_world_size(ctx.ulysses_group) != u:
                raise ValueError(
                    f"bound ulysses_group has {dist.get_world_size(ctx.ulysses_group)} ranks but ulysses_degree={u}"
                )
            return ctx.ulysses_group, ctx.ring_group
        ctx.ulysses_group, ctx.ring_group = make_usp_groups(group, u)
        return ctx.ulysses_group, ctx.ring_group

    def extra_repr(self) -> str:
        return f"causal={self.causal}, backend={self.backend}, kernel={self.kernel}"


def _resolve_scale(call_scale: float | None, module_scale: float | None, head_dim: int) -> float:
    """The per-call scale, else the module's, else ``1/sqrt(D)``."""
    for scale in (call_scale, module_scale):
        if scale is not None:
            return float(scale)
    return 1.0 / math.sqrt(head_dim)


def _check_local_inputs(q, k, v, cu_seqlens) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, S_local, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(f"attention needs a floating dtype (fp16/bf16/fp32/fp64); got {q.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if (q.size(0), q.size(1), q.size(3)) != (k.size(0), k.size(1), k.size(3)):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, sequence or head dim")
    if q.size(2) % k.size(2):
        raise ValueError(f"num_heads={q.size(2)} must be a multiple of num_kv_heads={k.size(2)} (GQA/MQA)")
    if cu_seqlens is not None:
        if q.size(0) != 1:
            raise ValueError(f"packed documents (cu_seqlens) need batch size 1; got {q.size(0)}: pack the batch into one row")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of cumulative lengths; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")


def _doc_bounds(cu_seqlens, seq_len: int | None, padded_len: int) -> list[int] | None:
    """Global document boundaries, with padding (if any) as a last document of its own."""
    if cu_seqlens is None:
        if seq_len is None or seq_len == padded_len:
            return None
        bounds = [0, seq_len]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seqlens must start at 0 and never decrease; got {bounds[:8]}...")
        if seq_len is not None and bounds[-1] != seq_len:
            raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the global sequence has {seq_len} tokens")
    if bounds[-1] > padded_len:
        raise ValueError(
            f"cu_seqlens/seq_len cover {bounds[-1]} tokens but the sharded sequence holds only {padded_len} "
            "(S_local x group size): cu_seqlens must describe the global sequence"
        )
    if bounds[-1] < padded_len:
        bounds.append(padded_len)
    return bounds


def _check_across_ranks(q, k, causal, backend, cu_seqlens, seq_len, group) -> None:
    """One small all-gather so mismatched inputs fail with a message instead of a hang."""
    cu = cu_seqlens.to(torch.float64) if cu_seqlens is not None else None
    sig = torch.tensor(
        [q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), _DTYPE_CODES[q.dtype], int(causal),
         backends.BACKENDS.index(backend), -1 if cu is None else cu.numel(), -1 if cu is None else float((cu * torch.arange(1, cu.numel() + 1, dtype=torch.float64)).sum()),
         -1 if seq_len is None else seq_len],
        dtype=torch.float64,
    )
    device = q.device if q.is_cuda else torch.device("cpu")
    sig = sig.to(device)
    gathered = [torch.empty_like(sig) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, sig, group=group)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        names = "B, S_local, H, H_kv, D, dtype, causal, backend, len(cu_seqlens), hash(cu_seqlens), seq_len"
        rows = "\n".join(f"  rank {r}: {[int(x) if float(x).is_integer() else float(x) for x in g.tolist()]}" for r, g in enumerate(gathered))
        raise ValueError(f"ranks of the sequence-parallel group called attention with different inputs ({names}):\n{rows}")
