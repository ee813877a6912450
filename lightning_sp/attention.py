"""``SequenceParallelAttention``: exact attention over a sequence split across ranks.

    attn = SequenceParallelAttention(causal=True, backend="zigzag_ring", group=sp_group)
    q_local = shard_sequence(q, sp_group, layout=attn.layout)      # [B, N/P, H, D]
    out_local = attn(q_local, k_local, v_local)                      # [B, N/P, H, D]

Built with ``backend=None`` it runs plain local attention until a ``SequenceParallelStrategy``
binds it (``bind``), so one model runs with and without sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_sp import choices
from lightning_sp.comm.agree import describe_disagreement, gather_rows, global_ranks, stable_hash
from lightning_sp.comm.stats import CommStats
from lightning_sp.context import SequenceParallelContext
from lightning_sp.cost_model import LAYOUT_BACKENDS, checked_layout, layout_backend_error
from lightning_sp.layout import Run, SequenceLayout, as_layout, global_seq_len_of, padded_length
from lightning_sp.masks import AttentionMask, route_table_gradient
from lightning_sp.ops import backends
from lightning_sp.ops.kernels import KERNELS, make_kernel, prefers_heads_major

log = logging.getLogger(__name__)

DEFAULT_KV_PIECES = "auto"
"""``SequenceParallelAttention(kv_pieces=)`` default: whole K/V blocks unless a memory budget binds, then the
fewest pieces that fit (Note [kv_pieces from a memory budget] in ``lightning_sp/choices.py``). ``kv_pieces=8``
gives the lowest peak measured (at P = 4, <= 0.35 of one process's for every backend but colossal;
benchmarks/README.md, section 4)."""

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}

KV_LAYOUTS = ("sharded", "replicated")
"""``forward(..., kv_layout=)``: ``"sharded"`` (default), ``k``/``v`` are this rank's shards of ``q``'s own
sequence (self-attention); ``"replicated"``, ``k``/``v`` are a memory held whole on every rank
(cross-attention; Note [Cross-attention over a replicated memory])."""


def _compiler_disabled(fn):
    """``torch.compiler.disable(fn)`` built at the first call under ``torch.compile``, not at import:
    decorating at import loads ``torch._dynamo`` (seconds; Note [A light import] in ``lightning_sp._registry``).
    Eager calls run ``fn`` itself; traced calls run it eagerly, one graph break per call as before."""
    disabled = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper


def default_ulysses_degree(group_size: int, *, ranks_per_node: int | None = None, num_heads: int | None = None) -> int:
    """For ``usp`` when none is given: the largest divisor ``u`` of ``P`` that leaves a ring of >= 2
    ranks, keeps the all-to-all inside a node (``u <= ranks_per_node`` when that is known) and, when
    ``num_heads`` is known, splits the heads (``num_heads % u == 0``)."""
    if group_size <= 1:
        return 1
    fits = [
        d for d in range(1, group_size // 2 + 1)
        if group_size % d == 0
        and (ranks_per_node is None or d <= ranks_per_node)
        and (num_heads is None or num_heads % d == 0)
    ]
    return max(fits)


def resolve_auto_backend(num_heads: int, group_size: int, *, ranks_per_node: int | None = None,
                         seq_len: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                         dtype: torch.dtype | None = None, batch: int = 1, causal: bool = True,
                         hardware=None, usp_allowed: bool = False, mask: AttentionMask | None = None) -> tuple[str, str]:
    """What ``backend="auto"`` runs, and why (the layout is zigzag either way).

    With the shapes (``seq_len``; ``num_kv_heads``, ``head_dim``, ``dtype`` default to MHA, 64, bf16)
    the choice is the cost model's (``lightning_sp.cost_model.choose_backend`` on ``hardware``, default
    ``default_profile``; ``ranks_per_node`` replaces the profile's): the fastest predicted among the
    backends exact on the zigzag layout, ``usp`` degrees only with ``usp_allowed``. The reason lists
    every candidate's predicted time. Returns ``(backend, why)``; ``why`` names ``usp``'s degree. ``mask``: every
    candidate priced under it (its window, chunks and spans; Note [Cost model under a mask]).

    Without ``seq_len``, the rule used before there was a model: Ulysses (``4*N*h/P`` per rank, no
    per-step merges) when the heads split over ``P`` and the group fits in a node (an all-to-all across
    nodes is bound by the slowest link); else the zigzag ring (no head limit, balanced causal work,
    traffic overlapped with compute)."""
    if seq_len is not None:
        choice = auto_choice(num_heads, group_size, seq_len=seq_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             dtype=dtype, batch=batch, causal=causal, ranks_per_node=ranks_per_node,
                             hardware=hardware, usp_allowed=usp_allowed, mask=mask)
        return choice.backend, choice.summary()
    if num_heads % group_size:
        return "zigzag_ring", f"num_heads={num_heads} is not divisible by the group size {group_size}"
    if ranks_per_node is not None and group_size > ranks_per_node:
        return "zigzag_ring", f"the group ({group_size} ranks) spans nodes of {ranks_per_node} ranks"
    return "ulysses", f"num_heads={num_heads} splits over {group_size} ranks inside a node"


def hardware_profile(hardware, device_type: str = "cpu"):
    """The cost model's ``HardwareProfile`` for ``hardware`` (a profile, a preset's name, or ``None``: the
    default for ``device_type``, a GPU preset matched by the device's name)."""
    from lightning_sp import cost_model

    if isinstance(hardware, str):
        return cost_model.preset(hardware)
    if hardware is None:
        name = torch.cuda.get_device_name() if device_type == "cuda" and torch.cuda.is_available() else None
        return cost_model.default_profile(device_type, name)
    return hardware


def auto_choice(num_heads: int, group_size: int, *, seq_len: int, num_kv_heads: int | None = None,
                head_dim: int | None = None, dtype: torch.dtype | None = None, batch: int = 1, causal: bool = True,
                ranks_per_node: int | None = None, hardware=None, usp_allowed: bool = False, device_type: str = "cpu",
                mask: AttentionMask | None = None):
    """The cost model's ``AutoChoice`` for these shapes (see ``resolve_auto_backend``), under ``mask``."""
    from dataclasses import replace

    from lightning_sp import cost_model

    hw = hardware_profile(hardware, device_type)
    if ranks_per_node is not None:
        hw = replace(hw, ranks_per_node=ranks_per_node)
    dtype = dtype or torch.bfloat16
    shape = cost_model.AttentionShape(
        seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads or num_heads, head_dim=head_dim or 64,
        batch=batch, dtype_bytes=torch.empty((), dtype=dtype).element_size(), causal=causal,
    )
    return cost_model.choose_backend(shape, group_size, hw, usp_allowed=usp_allowed, mask=mask)


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


# Sub-groups derived from a group, built once per (group, degree) and shared by every module that
# attends over that group. Keyed weakly on the ProcessGroup object, so nothing outlives its group;
# a cache of derived groups, not configuration (DESIGN.md: no groups or options in globals).
_USP_SUBGROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _group_timeout(group) -> timedelta | None:
    """The timeout ``group`` was created with (sub-groups inherit it), if the backend exposes it."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - backend without options, or no such device backend
            continue
    return None


def make_usp_groups(group, ulysses_degree: int):
    """Ulysses and ring sub-groups of ``group`` (Ulysses-inner), with ``group``'s timeout; built once per
    ``(group, ulysses_degree)``. Every rank of the *world* must call this in the same order, so it only
    works for a group spanning the world; the strategy builds them for every other case."""
    group = group if group is not None else dist.group.WORLD
    cached = _USP_SUBGROUPS.setdefault(group, {})
    if ulysses_degree in cached:
        return cached[ulysses_degree]
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            "usp on a group smaller than the world needs its Ulysses/ring sub-groups built on every rank: "
            "use SequenceParallelStrategy, or pass a SequenceParallelContext with ulysses_group and ring_group"
        )
    p, u = len(ranks), ulysses_degree
    timeout = _group_timeout(group)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    mine_u = mine_r = None
    for i in range(p // u):  # Ulysses groups: consecutive group ranks
        g = dist.new_group([ranks[i * u + j] for j in range(u)], **kwargs)
        if dist.get_rank() in ranks[i * u : (i + 1) * u]:
            mine_u = g
    for j in range(u):  # ring groups: stride u
        members = [ranks[i * u + j] for i in range(p // u)]
        g = dist.new_group(members, **kwargs)
        if dist.get_rank() in members:
            mine_r = g
    cached[ulysses_degree] = (mine_u, mine_r)
    return mine_u, mine_r


# Note [Cross-attention over a replicated memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Queries are shards of the sequence; the memory (an encoder's output, image tokens) is whole on every rank:
#
#     rank r:  q_r [B, S_local, H, D]  x  memory k, v [B, M, H_kv, D]  ->  out_r = softmax(q_r k^T) v
#
# Each query attends over all M memory tokens and nothing else, so a rank needs nothing from its peers:
# forward(..., kv_layout="replicated") is one local kernel call, whatever the backend. Backward: rank r's
# dK/dV are the part of its own queries, dK = sum_r dK_r. The attention does not sum them: the weights that
# computed the memory on every rank then hold partial gradients like every other weight, and the reduction
# that combines those (Note [Gradient reduction over dp x sp] in data_parallel.py: a mean over dp x sp of
# rank gradients scaled by P through the replicated loss) combines these the same way; summing in the
# attention as well would count each part P times. A memory gathered from shards with gather_sequence sums
# the parts in gather_sequence's backward.
#
# The default kv_layout="sharded" reads k, v as shards of q's sequence. A whole memory of another length
# fails the shape check (error 12). One of exactly the shard's length would be read as P copies of itself
# (silently wrong once causal masks or padding weight the copies differently), so the cross-rank check
# also gathers a few sums of each rank's q, k, v (_fingerprints: O(S_local * H * D), one host sync): k and v
# equal on every rank and varying along the sequence while q differs raises, naming kv_layout="replicated";
# with kv_layout="replicated", sums that differ across ranks (beyond bf16 noise) raise. Shards that happen
# to be equal (a sequence periodic in the layout's order) would be refused: validate_inputs=False skips the
# check.


class SequenceParallelAttention(nn.Module):
    """Exact (no approximation) softmax attention over the whole global sequence.

    Args:
        causal: mask future keys (decoders); ``False`` for bidirectional encoders.
        softmax_scale: defaults to ``1/sqrt(D)``; ``forward(..., softmax_scale=)`` overrides it per call.
        backend: one of ``"ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal",
            "local", "auto"``; ``None``: the bound strategy's choice, or local attention if unbound.
            ``"local"`` always attends over the tokens it is given (no collectives), also inside a
            strategy-bound model (e.g. a vision tower beside a sequence-parallel text decoder).
        group: the sequence-parallel process group (overrides a bound context's). Without a group and
            without a strategy the module is plain local attention, even when a process group exists
            (ordinary DDP/FSDP); a parallel ``backend`` then needs ``group=``.
        ulysses_degree: inner Ulysses degree for ``usp``.
        kernel: local kernel, ``"auto"``, ``"torch"``, ``"sdpa"`` or ``"flash_attn"``.
        dropout_p: not supported; anything but 0 raises (an exact dropout needs one random stream keyed by global
            (batch, head, query, key)).
        window_size: ``(left, right)`` sliding window, flash-attn's convention (query ``q`` sees keys ``q - left``
            to ``q + right``; ``-1``: unbounded): the same as ``mask=AttentionMask(window=window_size)``.
        layout: the ``SequenceLayout`` to shard for, with ``backend`` ``"ring"``, ``"zigzag_ring"``,
            ``"allgather_kv"`` or ``"usp"`` (``LAYOUT_BACKENDS``; ``usp``: built with its ``ulysses_degree``);
            ``None``: the backend's own (``layout_for_backend``). ``SequenceLayout.balanced_for(N, P, mask)``
            evens out a mask's work, e.g. a prefix-LM span, which unbalances zigzag (Note [Balancing a mask's
            work] in ``layout.py``). Shard inputs with ``attn.layout``; the strategy does.
        mask: an ``AttentionMask`` (``lightning_sp/masks.py``): windows, chunks, bidirectional spans in a causal
            stream, soft-capping, ALiBi, FlexAttention-style ``mask_mod``/``score_mod`` on global indices; exact on
            every backend; a ``forward(mask=)`` overrides its set fields per call. Blocks the mask leaves empty
            are neither computed nor, on the rings and ``allgather_kv``, sent (Note [Traffic follows the mask]
            in ``ops/ring_attention.py``).
        validate_inputs: ``True`` (default) or ``"always"`` (the same): at every call every rank of the
            group joins one tiny all-gather (a row of 29 numbers: shapes, dtype, lengths, the layout, a hash of the
            documents, what ``auto`` chose, a few sums of ``q``, ``k``, ``v`` that tell a memory held whole on
            every rank from shards: Note [Cross-attention over a replicated memory]) before anything can raise, so bad input on any rank, or
            inputs that differ across ranks at any step, raise on every rank at once, naming the ranks
            and their values (Note [Cross-rank checks are decided together] in ``comm/agree.py``).
            ``False``: no check and no collective, for inputs identical by construction (benchmarks):
            bad input then raises on its own rank only and its peers wait for the process-group
            timeout; inputs that differ across ranks hang or compute garbage.
        kv_pieces: ``ring``, ``zigzag_ring`` and the ring of ``usp``: each rank's K/V block is fetched
            from its owner in this many pieces and its dK/dV returned in as many, the backward also
            runs the queries in as many chunks, so a rank holds a few pieces instead of whole
            blocks: the peak memory per rank falls with ``P`` (Note [K/V in pieces] in
            ``ops/ring_attention.py``). Same bytes as the ring. Pieces are never shorter than
            ``MIN_PIECE_TOKENS`` (256) tokens, so short blocks use fewer; ``1``: the neighbour ring
            with whole blocks double-buffered (more memory, fewer kernel calls). ``ulysses``: the
            attention runs on up to this many groups of heads, gathered whole, each group in memory
            of its own; ``usp``: its all-to-alls and ring per group (the largest divisor of the K/V
            heads per rank that fits; Note [Heads in groups] in ``ops/backends.py``), so the backward
            holds one group's temporaries at a time. ``"auto"``
            (default): whole blocks unless ``memory_budget`` (or the context's, or on CUDA a share of the
            free memory) binds, then the fewest pieces that fit (Note [kv_pieces from a memory budget]);
            ``ulysses`` where memory does not bind: 2 head groups when the kernel reads head-major
            gathers (CPU) and the cost model prices them at <= 1.01x whole heads on shards of >= 2048
            tokens, else whole heads (Note [Ulysses' head groups by default] in ``choices.py``).
        memory_budget: bytes one attention fwd+bwd may peak at per rank (its inputs included), for
            ``kv_pieces="auto"``; ``None``: the context's ``memory_budget``.
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
        validate_inputs: bool | str = True,
        kv_pieces: int | str = DEFAULT_KV_PIECES,
        memory_budget: int | None = None,
        mask: AttentionMask | None = None,
        layout: SequenceLayout | str | None = None,
    ):
        super().__init__()
        if dropout_p:
            raise NotImplementedError(
                "attention dropout is not supported (it would need the same RNG stream on every rank); "
                "apply dropout to the attention output or the residual stream instead"
            )
        if mask is not None and not isinstance(mask, AttentionMask):
            raise ValueError(f"mask must be a lightning_sp.AttentionMask or None, got {type(mask).__name__}")
        if window_size is not None:
            if mask is not None and mask.window is not None and tuple(mask.window) != tuple(window_size):
                raise ValueError(f"window_size={window_size} and mask.window={mask.window} disagree: pass one of them")
            mask = (mask or AttentionMask()).merged(AttentionMask(window=tuple(window_size)))
        if backend is not None and backend not in backends.BACKENDS:
            raise ValueError(f"backend must be one of {backends.BACKENDS} or None, got {backend!r}")
        self.requested_layout = None if layout is None else as_layout(layout)
        if layout is not None and backend is not None and backend not in LAYOUT_BACKENDS + ("local",):
            raise ValueError(layout_backend_error(self.requested_layout, backend))
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if validate_inputs not in (True, False, "always"):
            raise ValueError(f"validate_inputs must be True, False or 'always', got {validate_inputs!r}")
        if ulysses_degree is not None and ulysses_degree < 1:
            raise ValueError(f"ulysses_degree must be >= 1, got {ulysses_degree}")
        if kv_pieces != "auto" and (isinstance(kv_pieces, bool) or not isinstance(kv_pieces, int) or kv_pieces < 1):
            raise ValueError(
                f"kv_pieces must be an int >= 1 (1: whole K/V blocks around the ring) or 'auto', got {kv_pieces!r}"
            )
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                          or memory_budget <= 0):
            raise ValueError(f"memory_budget must be a positive int (bytes per rank) or None, got {memory_budget!r}")
        self.kv_pieces = kv_pieces
        self.memory_budget = memory_budget
        self.mask = mask
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
            local_world = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun / Lightning launchers set it
            self._own_context = SequenceParallelContext(
                group=self.group, backend=self.backend or "local", ulysses_degree=self.ulysses_degree,
                ranks_per_node=int(local_world) if local_world and local_world.isdigit() else None,
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

    def _group_size(self) -> int:
        """Ranks this module attends over: 1 without a group, or for ``backend="local"``."""
        group = self.process_group
        if self.resolved_backend() == "local":
            return 1
        if group is None:
            if dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    f"SequenceParallelAttention(backend={self.backend!r}) has no process group: pass "
                    "group= (the sequence-parallel group, e.g. torch.distributed.group.WORLD) or train "
                    "under SequenceParallelStrategy; build it with backend=None for plain local attention"
                )
            return 1
        return dist.get_world_size(group)

    def _ulysses_degree(self, world: int) -> int:
        ctx = self.context
        u = self.ulysses_degree or ctx.ulysses_degree or default_ulysses_degree(world, ranks_per_node=ctx.ranks_per_node)
        if world % u:
            raise ValueError(f"ulysses_degree={u} must divide the sequence-parallel group size {world}")
        return u

    @property
    def layout(self) -> SequenceLayout:
        backend = self.resolved_backend()
        world = self._group_size()
        if backend == "local" or world == 1:
            return SequenceLayout("contiguous")
        if self.requested_layout is not None:
            return self._checked_layout(backend, world)
        return layout_for_backend(backend, group_size=world, ulysses_degree=self._ulysses_degree(world) if backend == "usp" else None)

    def _checked_layout(self, backend: str, world: int) -> SequenceLayout:
        """The ``layout=`` this module was built with, once it fits the resolved backend and group (the cost
        model's own check: ``cost_model.checked_layout``)."""
        return checked_layout(backend, world, self._ulysses_degree(world) if backend == "usp" else None,
                              self.requested_layout)

    def raise_on_every_rank(self, error: Exception, q: torch.Tensor):
        """Raise ``error``, a caller's rejection of this call's inputs made before ``forward`` (the
        transformers integration checks its arguments first), after joining the cross-rank check the
        peers run in their ``forward``: they raise naming this rank instead of waiting for the timeout."""
        world = self._group_size()
        if world > 1 and self.validate_inputs:
            gather_rows((_CALLER_ERROR,) + (0,) * (_ROW_LENGTH - 1), self.process_group, device=q.device)
        raise error

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens=None, seq_len: int | None = None,
        softmax_scale: float | None = None, kv_layout: str = "sharded", mask: AttentionMask | None = None,
        sinks: torch.Tensor | None = None, **unsupported,
    ) -> torch.Tensor:
        """``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]`` -> ``[B, S_local, H, D]``.

        ``kv_layout="replicated"``: cross-attention. ``k, v [B, M, H_kv, D]`` are a memory of any length
        ``M`` (encoder output, image tokens), the same on every rank; each rank's queries attend over the
        whole memory, with no communication (Note [Cross-attention over a replicated memory]). Not
        causal, no ``cu_seqlens``. ``k.grad``/``v.grad`` on each rank are that rank's part (its queries');
        their sum over the group is the gradient of the memory: weights that compute the memory on every
        rank get partial gradients like every other weight, which ``SequenceParallelStrategy``'s
        data-parallel reduction combines exactly; standalone, sum them over the group as the other
        weights' gradients, or build the memory with ``gather_sequence`` (its backward sums them).
        With the default ``"sharded"``, ``k``/``v`` must be shards of ``q``'s own sequence: a length that
        differs from ``q``'s raises naming ``kv_layout="replicated"``, and so does (with
        ``validate_inputs``) a ``k`` identical on every rank while ``q`` differs (a replicated memory of
        the shard's length, which would otherwise be read as ``P`` copies of itself).

        ``cu_seqlens``: int cumulative lengths ``[0, l1, ..., N]`` of the *global* packed sequence
        (``B == 1``), the same on every rank; it must end at the global length ``N``. ``seq_len``: the
        unpadded global length ``N``; positions at or beyond it are padding, never attended. Over more
        than one rank it defaults to the length ``shard_sequence`` recorded on ``q``/``k``/``v``, else the
        bound context's ``global_seq_len`` (see Note [The global length travels with the shard]); if
        none is known the call raises. ``softmax_scale``: overrides the constructor's for this call
        (Hugging Face passes ``scaling`` per call). ``mask``: an ``AttentionMask`` whose set fields override the
        constructor's for this call (e.g. the image spans of this batch), the same on every rank. ``sinks``: learned
        ``[H]`` per-query-head sink logits (gpt-oss), which get their gradient (each rank its rows' share, summed
        over the group like any parameter's).

        Runs with autocast disabled: the output has the dtype of ``q`` and forward and backward use
        the same precision (cast ``q``/``k``/``v`` yourself to attend in low precision).
        """
        if unsupported:
            names = ", ".join(sorted(unsupported))
            raise NotImplementedError(
                f"unsupported argument(s) {names}: arbitrary masks and biases are not supported; "
                "use causal=True and/or cu_seqlens for packed documents"
            )
        if mask is not None and not isinstance(mask, AttentionMask):
            raise ValueError(f"mask must be a lightning_sp.AttentionMask or None, got {type(mask).__name__}")
        attn_mask = mask if self.mask is None else self.mask.merged(mask)
        if attn_mask is not None and attn_mask.signature() == AttentionMask().signature():
            attn_mask = None
        world = self._group_size()
        if world == 1:
            return self._local_forward(q, k, v, cu_seqlens, seq_len, softmax_scale, kv_layout, attn_mask, sinks)
        return self._parallel_forward(q, k, v, cu_seqlens, seq_len, softmax_scale, world, kv_layout, attn_mask, sinks)

    def _local_forward(self, q, k, v, cu_seqlens, seq_len, softmax_scale, kv_layout="sharded", attn_mask=None,
                       sinks=None) -> torch.Tensor:
        """No group (or ``backend="local"``): attention over these tokens only, no collectives. Only an
        explicit ``seq_len`` marks padding here (a strategy's global length is not about these tokens)."""
        error = (_local_input_error(q, k, v, cu_seqlens, kv_layout, self.causal, attn_mask, sinks)
                 or _mask_input_error(q, attn_mask, sinks))
        if error is not None:
            raise ValueError(error[1])
        n = q.size(1)
        if seq_len is not None and not 0 < seq_len <= n:
            raise ValueError(f"seq_len={seq_len} must be in [1, {n}] for local attention over {n} tokens")
        scale = _resolve_scale(softmax_scale, self.softmax_scale, q.size(-1))
        if kv_layout == "replicated":
            return self._replicated_kv_attention(q, k, v, scale)
        kernel_name = self.kernel if self.kernel != "auto" else self.context.kernel
        if torch.compiler.is_compiling() and kernel_name in ("auto", "sdpa") and attn_mask is None and sinks is None:
            return _compiled_local_attention(q, k, v, cu_seqlens, seq_len, scale, self.causal)
        bounds = self.context.cu_bounds(cu_seqlens) if cu_seqlens is not None else None
        doc_bounds = _doc_bounds(bounds, n if seq_len is None else seq_len, n)
        call = backends.AttentionCall(
            kernel=self._make_kernel(q), scale=scale, causal=self.causal, layout=SequenceLayout("contiguous"),
            padded_len=n, doc_bounds=doc_bounds, stats=None, **_mask_fields(attn_mask, sinks, self.causal, doc_bounds, n,
                                                                            follow=False),
        )
        q = route_table_gradient(q, call.score_mods)  # Note [Relative-position bias gradient] in masks.py
        with torch.autocast(q.device.type, enabled=False):
            return backends.local_attention(q, k, v, call)

    @_compiler_disabled  # one graph break per call: collectives, host-side plans and checks
    def _parallel_forward(self, q, k, v, cu_seqlens, seq_len, softmax_scale, world, kv_layout="sharded",
                          attn_mask=None, sinks=None) -> torch.Tensor:
        group, ctx = self.process_group, self.context
        backend = self.resolved_backend()
        replicated = kv_layout == "replicated"
        # Every local problem becomes an error code, raised only after the cross-rank check that every
        # rank joins at every call (Note [Cross-rank checks are decided together] in comm/agree.py)
        error = (_local_input_error(q, k, v, cu_seqlens, kv_layout, self.causal, attn_mask, sinks)
                 or _mask_input_error(q, attn_mask, sinks, world))
        bounds = ctx.cu_bounds(cu_seqlens) if cu_seqlens is not None and error is None else None
        try:  # a replicated memory is no shard: only q's sequence has a global length
            seq_len = self._global_seq_len(seq_len, q, q, q) if replicated else self._global_seq_len(seq_len, q, k, v)
        except ValueError as e:
            error, seq_len = error or (8, str(e)), None
        if error is None and bounds is not None:
            error = _bounds_error(bounds, seq_len)
        scale = _resolve_scale(softmax_scale, self.softmax_scale, q.size(-1) if q.dim() else 1)
        layout = self.layout
        if self.validate_inputs:
            signature = _signature(q, k, error, self.causal, backend, self._decision_inputs(backend), layout, bounds,
                                   seq_len, scale, self.kv_pieces, attn_mask, sinks, kv_layout=kv_layout)
            _check_across_ranks(signature, error, group, q, fingerprints=_fingerprints(q, k, v, error))
        elif error is not None:
            raise ValueError(error[1])
        if replicated:  # Note [Cross-attention over a replicated memory]: no collective, whatever the backend
            return self._replicated_kv_attention(q, k, v, scale)
        auto_u = None
        if backend == "auto":  # after the check: measuring the candidates runs collectives on agreed shapes
            backend, auto_u = self._resolve_auto(q, k, v, cu_seqlens, seq_len, world, scale, layout, attn_mask)
        if backend in ("ulysses", "usp"):  # heads the all-to-all cannot split: say so before anything else
            u = world if backend == "ulysses" else (auto_u or layout.ulysses_degree)
            backends.kv_head_replication(q.size(2), k.size(2), u)
        padded_len = q.size(1) * world
        if seq_len is None:
            raise ValueError(
                f"SequenceParallelAttention over {world} ranks cannot tell the global sequence length: the "
                f"shards hold {q.size(1)} x {world} = {padded_len} positions, which may end in padding. Pass "
                f"seq_len=N (the unpadded global length), call it on tensors made by shard_sequence (which "
                f"records N), or train under SequenceParallelStrategy (which sets context.global_seq_len)"
            )
        if padded_length(seq_len, world, layout) != padded_len:
            raise ValueError(
                f"seq_len={seq_len} does not match the shards: layout {layout} over {world} ranks pads it to "
                f"{padded_length(seq_len, world, layout)} positions, but the shards hold {q.size(1)} x {world} = "
                f"{padded_len}. Pass the global length of the sequence these shards came from"
            )
        call = self._attention_call(q, k, backend, world, scale, layout, bounds, seq_len, ctx.comm, auto_u,
                                    attn_mask=attn_mask, sinks=sinks)
        return self._dispatch(backend, auto_u, q, k, v, call, group, world)

    def _attention_call(self, q, k, backend, world, scale, layout, bounds, seq_len, stats, auto_u, *,
                        attn_mask=None, sinks=None):
        padded_len = q.size(1) * world
        doc_bounds = _doc_bounds(bounds, seq_len, padded_len)
        return backends.AttentionCall(
            kernel=self._make_kernel(q), scale=scale, causal=self.causal, layout=layout,
            padded_len=padded_len, doc_bounds=doc_bounds, stats=stats,
            kv_pieces=self._kv_pieces(backend, q, k, world, auto_u),
            heads_major=self._memory_budget() is None,  # Note [Head-major blocks]: copies no budget predicts
            # packed documents or a mask with structure: the K/V traffic follows it (agreed: the inputs are checked)
            **_mask_fields(attn_mask, sinks, self.causal, doc_bounds, padded_len, follow=bounds is not None),
        )

    def _replicated_kv_attention(self, q, k, v, scale) -> torch.Tensor:
        """``q [B, S_local, H, D]`` over the whole memory ``k, v [B, M, H_kv, D]``: one local kernel call,
        no mask (Note [Cross-attention over a replicated memory])."""
        call = backends.AttentionCall(kernel=self._make_kernel(q), scale=scale, causal=False,
                                      layout=SequenceLayout("contiguous"), padded_len=q.size(1), doc_bounds=None,
                                      stats=None)
        queries, memory = [Run(0, 0, q.size(1))], [Run(0, 0, k.size(1))]
        with torch.autocast(q.device.type, enabled=False):
            return backends.block_attention(q, k, v, call.spec(queries, [memory]))

    def _dispatch(self, backend, auto_u, q, k, v, call, group, world) -> torch.Tensor:
        q = route_table_gradient(q, call.score_mods)  # Note [Relative-position bias gradient] in masks.py
        with torch.autocast(q.device.type, enabled=False):
            if backend == "ulysses":
                return backends.ulysses_attention(q, k, v, call, group=group)
            if backend in ("ring", "zigzag_ring"):
                return backends.ring_attention(q, k, v, call, group=group)
            if backend == "allgather_kv":
                return backends.allgather_kv_attention(q, k, v, call, group=group)
            if backend == "colossal":
                return backends.colossal(q, k, v, call, group=group)
            if backend == "usp":
                ug, rg = self._usp_groups(group, world, auto_u)
                return backends.usp_attention(q, k, v, call, ulysses_group=ug, ring_group=rg)
        raise AssertionError(f"unhandled backend {backend}")  # BACKENDS is checked in __init__/bind

    def _decision_inputs(self, backend: str) -> int:
        """A hash of what ``backend="auto"`` and ``kv_pieces="auto"`` decide from beyond the shapes, compared
        across ranks before they decide: the decisions are then the same on every rank (a measured ``auto``
        agrees by construction; the model's choice and the pieces are functions of these and the shapes)."""
        ctx = self.context
        auto = (choices.auto_policy(ctx.auto_policy, ctx.hardware), repr(ctx.hardware), ctx.ranks_per_node) \
            if backend == "auto" else None
        pieces = None
        if self.kv_pieces == "auto":
            pieces = self._memory_budget()
            if backend == "ulysses":  # its head groups also follow the hardware profile's predicted cost
                pieces = (pieces, repr(ctx.hardware))
        budget_in_force = self._memory_budget() is not None  # also decides head-major ring blocks
        if auto is None and pieces is None and not budget_in_force:
            return 0
        return stable_hash(auto, pieces, budget_in_force)

    def _memory_budget(self) -> int | None:
        """The module's ``memory_budget``, else the context's (the strategy's); ``None``: no budget."""
        return self.memory_budget if self.memory_budget is not None else self.context.memory_budget

    def _kv_pieces(self, backend, q, k, world, auto_u) -> int:
        """``kv_pieces`` as given, or for ``"auto"`` the fewest pieces whose predicted peak fits the memory
        budget (Note [kv_pieces from a memory budget]); decided once per shape, the same on every rank."""
        if self.kv_pieces != "auto":
            return self.kv_pieces
        ctx = self.context
        budget = self._memory_budget()
        if budget is None and q.device.type != "cuda" and backend != "ulysses":
            return 1
        key = (backend, auto_u, tuple(q.shape), tuple(k.shape), q.dtype, world, budget)
        pieces = ctx.kv_pieces_choices.get(key)
        if pieces is None:
            if budget is None and q.device.type == "cuda":  # every rank on CUDA: the minimum over the ranks
                free = int(torch.cuda.mem_get_info(q.device)[0] * choices.CUDA_FREE_MEMORY_SHARE)
                budget = choices.agreed_min(free, self.process_group, q.device)
            pieces, peak = choices.fewest_pieces_that_fit(
                lambda p: choices.predicted_peak_bytes(
                    backend, batch=q.size(0), shard_len=q.size(1), num_heads=q.size(2), num_kv_heads=k.size(2),
                    head_dim=q.size(3), element_size=q.element_size(), world=world, pieces=p,
                    ulysses_degree=auto_u or (self._ulysses_degree(world) if backend == "usp" else None)),
                budget)
            if pieces == 1 and backend == "ulysses":  # memory does not bind (Note [Ulysses' head groups by default])
                pieces = choices.ulysses_groups_when_memory_is_free(
                    batch=q.size(0), shard_len=q.size(1), num_heads=q.size(2), num_kv_heads=k.size(2),
                    head_dim=q.size(3), element_size=q.element_size(), world=world, causal=self.causal,
                    hardware=hardware_profile(ctx.hardware, q.device.type),
                    gather_copies=prefers_heads_major(self._make_kernel(q), q.device))
            log.info("lightning_sp: kv_pieces='auto' runs %s with %d piece(s): predicted peak %.3g MiB per rank, "
                     "budget %s", backend, pieces, peak / 2**20,
                     "none" if budget is None else f"{budget / 2**20:.3g} MiB")
            if len(ctx.kv_pieces_choices) > 64:
                ctx.kv_pieces_choices.clear()
            ctx.kv_pieces_choices[key] = pieces
        return pieces

    def _global_seq_len(self, seq_len, q, k, v) -> int | None:
        """Explicit ``seq_len``, else the length recorded on the shards, else the context's."""
        if seq_len is not None:
            return int(seq_len)
        recorded = {n for n in (global_seq_len_of(q), global_seq_len_of(k), global_seq_len_of(v)) if n is not None}
        if len(recorded) > 1:
            raise ValueError(f"q, k and v were sharded from sequences of different lengths {sorted(recorded)}")
        if recorded:
            return recorded.pop()
        return self.context.global_seq_len

    def _resolve_auto(self, q, k, v, cu_seqlens, seq_len, world, scale, layout,
                      attn_mask: AttentionMask | None = None) -> tuple[str, int | None]:
        """``(backend, usp degree or None)`` for ``backend="auto"``, among the backends exact on the zigzag
        layout ``auto`` shards for: the cost model names the candidates (Note [Cost model of one attention
        layer]); the fastest is measured on this machine (Note [auto measures its candidates] in
        ``lightning_sp/choices.py``), or predicted with ``auto_policy="model"``. Decided once per shape
        bucket, the same on every rank; logged whenever it changes. Under ``attn_mask`` the candidates are priced
        and timed with it (a sliding window's ring sends almost nothing; Ulysses' all-to-alls move every row);
        packed documents change every batch and are not priced (the measured trials run with this call's)."""
        ctx = self.context
        n = seq_len if seq_len is not None else q.size(1) * world
        policy = choices.auto_policy(ctx.auto_policy, ctx.hardware)
        key = (n if policy == "model" else choices.length_bucket(n), q.size(0), q.size(2), k.size(2), q.size(3),
               q.dtype, self.causal, world, ctx.ranks_per_node, q.device.type) \
            + (() if attn_mask is None else (attn_mask.signature(),)) + (policy,)  # unmasked: the cache's old keys
        choice = ctx.auto_choices.get(key)
        if choice is None:
            choice = auto_choice(
                q.size(2), world, seq_len=n, num_kv_heads=k.size(2), head_dim=q.size(3), dtype=q.dtype,
                batch=q.size(0), causal=self.causal, ranks_per_node=ctx.ranks_per_node, hardware=ctx.hardware,
                usp_allowed=self._usp_groups_available(world), device_type=q.device.type, mask=attn_mask,
            )
            if policy == "measure":
                choice = self._measured_choice(choice, key, q, k, v, cu_seqlens, n, world, scale, layout, attn_mask)
            if len(ctx.auto_choices) > 64:  # lengths that change every batch: bound the cache
                ctx.auto_choices.clear()
            ctx.auto_choices[key] = choice
        if ctx.resolved_backend != choice.label:
            log.info("lightning_sp: backend='auto' runs %s", choice.summary())
            ctx.resolved_backend = choice.label
            ctx.auto_choice = choice
        return choice.backend, choice.ulysses_degree

    def _measured_choice(self, model_choice, key, q, k, v, cu_seqlens, n, world, scale, layout, attn_mask=None):
        """The model's candidates timed on this call's shapes (every rank, same order): the fastest, agreed."""
        from dataclasses import replace

        group = self.process_group
        candidates = {p.label: (p.backend, p.ulysses_degree) for p in model_choice.predictions}
        labels = list(candidates)
        bounds = self.context.cu_bounds(cu_seqlens) if cu_seqlens is not None else None
        gen = torch.Generator(device=q.device).manual_seed(0)
        trial = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=gen) for t in (q, k, v, q)]

        def run(label: str) -> None:
            backend, u = candidates[label]
            tq, tk, tv = (t.detach().requires_grad_() for t in trial[:3])
            call = self._attention_call(tq, tk, backend, world, scale, layout, bounds, n, None, u,
                                        attn_mask=_without_learned_tables(attn_mask))
            # identity hooks: a trial inside activation checkpointing must not be packed for recomputation
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                self._dispatch(backend, u, tq, tk, tv, call, group, world).backward(trial[3])

        disk_key = f"{choices.machine_key(q.device)}|{key[:-1]}|kv_pieces={self.kv_pieces}|docs={bounds is not None}"
        label, measured = choices.agreed_fastest(disk_key, labels, run, group, q.device)
        backend, u = candidates[label]
        return replace(model_choice, backend=backend, ulysses_degree=u, measured=measured or {},
                       source="measured" if measured else "cached measurement", cache_key=disk_key)

    def _usp_groups_available(self, world: int) -> bool:
        """Whether ``auto`` may run ``usp``: its Ulysses/ring sub-groups are bound, or can be built here
        (``make_usp_groups``: a group spanning the world)."""
        ctx = self.context
        if ctx.ulysses_group is not None and ctx.ring_group is not None:
            return False  # bound for one degree only (backend="usp"); auto does not reuse them
        group = self.process_group
        return group is not None and dist.get_world_size(group) == dist.get_world_size()

    def _make_kernel(self, q):
        name = self.kernel if self.kernel != "auto" else self.context.kernel
        key = (name, q.device.type)
        if key not in self._kernel_cache:
            self._kernel_cache[key] = make_kernel(name)
        return self._kernel_cache[key]

    def _usp_groups(self, group, world, ulysses_degree: int | None = None):
        ctx = self.context
        u = ulysses_degree or self._ulysses_degree(world)
        if ctx.ulysses_group is not None and ctx.ring_group is not None:
            if dist.get_world_size(ctx.ulysses_group) != u:
                raise ValueError(
                    f"bound ulysses_group has {dist.get_world_size(ctx.ulysses_group)} ranks but ulysses_degree={u}"
                )
            return ctx.ulysses_group, ctx.ring_group
        return make_usp_groups(group, u)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, backend={self.backend}, kernel={self.kernel}"


def _resolve_scale(call_scale: float | None, module_scale: float | None, head_dim: int) -> float:
    """The per-call scale, else the module's, else ``1/sqrt(D)``."""
    for scale in (call_scale, module_scale):
        if scale is not None:
            return float(scale)
    return 1.0 / math.sqrt(head_dim)


def _compiled_local_attention(q, k, v, cu_seqlens, seq_len, scale, causal) -> torch.Tensor:
    """Local attention as one ``scaled_dot_product_attention`` call, which ``torch.compile`` traces
    without a graph break. Documents and padding become a dense ``[S, S]`` boolean mask here."""
    n = q.size(1)
    mask = None
    if cu_seqlens is not None or (seq_len is not None and seq_len < n):
        pos = torch.arange(n, device=q.device)
        ends = cu_seqlens.to(q.device, torch.long)[1:] if cu_seqlens is not None else pos.new_tensor([seq_len])
        doc = torch.bucketize(pos, ends, right=True)  # padding is a document of its own
        mask = doc[:, None] == doc[None, :]
        if causal:
            mask = mask & (pos[None, :] <= pos[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=causal and mask is None, scale=scale, enable_gqa=q.size(2) != k.size(2),
    )
    return out.transpose(1, 2)


# Local input errors have a code, so the ranks that passed their own checks can name what failed.
_LOCAL_ERRORS = ("", "q, k, v are not 4-D [B, S_local, H, D]", "q, k, v dtypes differ", "unsupported dtype",
                 "k and v shapes differ", "q and k differ in batch, sequence or head dim",
                 "num_heads not a multiple of num_kv_heads", "bad cu_seqlens",
                 "q, k, v sharded from sequences of different lengths", "(unused: auto decides after the check)",
                 "rejected by its caller (e.g. the transformers integration) before attention",
                 "kv_layout not one of 'sharded', 'replicated'",
                 "q and k lengths differ with kv_layout='sharded' (cross-attention needs kv_layout='replicated')",
                 "kv_layout='replicated' (cross-attention) with causal=True, cu_seqlens, a mask or sinks",
                 "mask or sinks do not fit the heads")
_CALLER_ERROR = 10  # SequenceParallelAttention.raise_on_every_rank


def _local_input_error(q, k, v, cu_seqlens, kv_layout="sharded", causal=False, attn_mask=None,
                       sinks=None) -> tuple[int, str] | None:
    """``(code, message)`` for inputs that cannot be attended, ``None`` when they are fine."""
    if kv_layout not in KV_LAYOUTS:
        return 11, f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return 1, f"q, k, v must be [B, S_local, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.dtype == k.dtype == v.dtype):
        return 2, f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in _DTYPE_CODES:
        return 3, f"attention needs a floating dtype (fp16/bf16/fp32/fp64); got {q.dtype}"
    if k.shape != v.shape:
        return 4, f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}"
    if (q.size(0), q.size(3)) != (k.size(0), k.size(3)):
        return 5, f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim"
    if kv_layout == "sharded" and q.size(1) != k.size(1):
        return 12, (
            f"k and v hold {k.size(1)} positions but q holds {q.size(1)} (q {tuple(q.shape)}, k {tuple(k.shape)}): "
            f"with kv_layout='sharded' (the default) k and v are the shards of q's own sequence (self-attention). "
            f"For cross-attention over a memory (an encoder's output, image tokens) held whole on every rank, "
            f"pass kv_layout='replicated': each rank's queries then attend over the whole memory"
        )
    if kv_layout == "replicated" and (causal or cu_seqlens is not None or attn_mask is not None or sinks is not None):
        what = ("causal=True" if causal else "cu_seqlens" if cu_seqlens is not None
                else "a mask" if attn_mask is not None else "sinks")
        return 13, (
            f"kv_layout='replicated' (cross-attention over a memory held whole on every rank) does not take "
            f"{what}: causal masks, documents and masks relate positions of one sequence, and the memory is "
            f"another. Build the cross-attention module with causal=False and call it without cu_seqlens, mask or sinks"
        )
    if q.size(2) % k.size(2):
        return 6, f"num_heads={q.size(2)} must be a multiple of num_kv_heads={k.size(2)} (GQA/MQA)"
    if cu_seqlens is not None:
        if q.size(0) != 1:
            return 7, f"packed documents (cu_seqlens) need batch size 1; got {q.size(0)}: pack the batch into one row"
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
            return 7, (f"cu_seqlens must be a 1-D int32 tensor of cumulative lengths [0, ..., N]; got "
                       f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    return None


def _bounds_error(bounds: tuple[int, ...], seq_len: int | None) -> tuple[int, str] | None:
    """``(code, message)`` when the host copy of ``cu_seqlens`` cannot describe documents of this
    ``seq_len``-token global sequence (``None``: unknown yet, checked once agreed)."""
    if bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        return 7, f"cu_seqlens must start at 0 and never decrease; got {list(bounds[:8])}..."
    if seq_len is not None and bounds[-1] != seq_len:
        return 7, (f"cu_seqlens ends at {bounds[-1]} but the global sequence has {seq_len} tokens: cu_seqlens must "
                   f"cover the whole (unpadded) global sequence, [0, ..., {seq_len}]")
    return None


def _doc_bounds(bounds: tuple[int, ...] | None, seq_len: int, padded_len: int) -> list[int] | None:
    """Global document boundaries, with padding (if any) as a last document of its own."""
    if bounds is None:
        return None if seq_len == padded_len else [0, seq_len, padded_len]
    error = _bounds_error(bounds, seq_len)
    if error is not None:
        raise ValueError(error[1])
    return list(bounds) + ([padded_len] if seq_len < padded_len else [])


def _mask_fields(attn_mask: AttentionMask | None, sinks, causal, doc_bounds, padded_len, *, follow: bool) -> dict:
    """``AttentionCall``'s mask fields: the mask resolved on global positions, its score modifiers, the sinks, and
    whether the K/V traffic follows the mask (packed documents, ``follow``, or a window, chunks or spans)."""
    if attn_mask is None:
        return dict(sinks=sinks, follow_mask=follow)
    structured = attn_mask.structured(causal=causal, doc_bounds=doc_bounds, padded_len=padded_len)
    return dict(mask=structured, score_mods=attn_mask.score_mods(), sinks=sinks,
                follow_mask=follow or not structured.is_plain() or attn_mask.chunk_size is not None)


def _without_learned_tables(attn_mask: AttentionMask | None) -> AttentionMask | None:
    """``attn_mask`` with its relative bias's table detached: a timed trial's backward must not add to the
    parameter's gradient."""
    bias = None if attn_mask is None else attn_mask.relative_bias
    if bias is None or not bias.table.requires_grad:
        return attn_mask
    return dataclasses.replace(attn_mask, relative_bias=dataclasses.replace(bias, table=bias.table.detach()))


def _mask_input_error(q, attn_mask: AttentionMask | None, sinks, world: int = 1) -> tuple[int, str] | None:
    """``(code, message)`` for a mask or sinks that do not fit ``q [B, S, H, D]`` (``world`` shards of it)."""
    if q.dim() != 4:
        return None  # reported by _local_input_error
    h = q.size(2)
    if attn_mask is not None and attn_mask.alibi_slopes is not None and len(attn_mask.alibi_slopes) != h:
        return 14, (f"mask.alibi_slopes has {len(attn_mask.alibi_slopes)} slopes but q has {h} heads: pass one slope "
                    f"per query head")
    bias = None if attn_mask is None else attn_mask.relative_bias
    if bias is not None and bias.num_heads != h:
        return 14, (f"mask.relative_bias.table has {bias.num_heads} columns but q has {h} heads: pass a "
                    f"[num_buckets, H] table, one column per query head")
    if bias is not None and bias.bucket_error(q.size(1) * world) is not None:
        return 14, f"mask.relative_bias: {bias.bucket_error(q.size(1) * world)}"
    if attn_mask is not None and attn_mask.key_padding is not None and len(attn_mask.key_padding) != q.size(0):
        return 14, (f"mask.key_padding has {len(attn_mask.key_padding)} (start, end) ranges but q has batch size "
                    f"{q.size(0)}: pass one range of real tokens per batch row")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.numel() != h
                              or not sinks.is_floating_point()):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        return 14, f"sinks must be a floating [H] = [{h}] tensor (one logit per query head); got {got}"
    return None


def _signature(q, k, error, causal, backend, decision_inputs, layout, bounds, seq_len, scale, kv_pieces,
               attn_mask=None, sinks=None, *, kv_layout="sharded") -> tuple:
    """What every rank of the group must agree on, as numbers (one all-gather compares them)."""
    shape = lambda t: (list(t.shape) + [-1] * 4)[:4] if t.dim() <= 4 else [-2] * 4  # noqa: E731
    return (
        error[0] if error is not None else 0, *shape(q), *shape(k), _DTYPE_CODES.get(q.dtype, 0), int(causal),
        backends.BACKENDS.index(backend), decision_inputs, layout.ulysses_degree,
        -1 if bounds is None else len(bounds), -1 if bounds is None else stable_hash(bounds),
        -1 if seq_len is None else seq_len, scale, 0 if kv_pieces == "auto" else kv_pieces,
        KV_LAYOUTS.index(kv_layout) if kv_layout in KV_LAYOUTS else -1,
        0 if attn_mask is None and sinks is None else stable_hash(
            None if attn_mask is None else attn_mask.signature(), None if sinks is None else tuple(sinks.shape)),
        stable_hash(layout.kind, layout.chunk_ranks),
    )


_SIGNATURE_NAMES = ("error", "B", "S_local", "H", "D", "kB", "kS", "H_kv", "kD", "dtype", "causal", "backend",
                    "hash(auto_policy, hardware, ranks_per_node, memory_budget)", "ulysses_degree", "len(cu_seqlens)",
                    "hash(cu_seqlens)", "seq_len", "softmax_scale", "kv_pieces (0: auto)", "kv_layout",
                    "hash(mask, sinks)", "hash(layout)")
_FINGERPRINT_NAMES = ("sum(q)", "sum(k)", "sum(k by position)", "sum|k per position|", "k varies along the sequence",
                      "sum(v)", "sum|v per position|")
"""Numbers of the inputs' values, gathered with the signature but judged apart from it (Note [Cross-attention
over a replicated memory])."""
_ROW_LENGTH = len(_SIGNATURE_NAMES) + len(_FINGERPRINT_NAMES)
_REPLICATED_RTOL = 1e-5
"""How far a replicated memory's sums may differ across ranks (a few ulps of bf16 noise, never other data)."""
_DTYPE_NAMES = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}
_SIGNATURE_WORDS = {
    "dtype": lambda c: _DTYPE_NAMES.get(c, "unsupported"),
    "backend": lambda i: repr(backends.BACKENDS[i]),
}


def _fingerprints(q, k, v, error) -> tuple[float, ...]:
    """``_FINGERPRINT_NAMES`` of this rank's inputs (zeros when they cannot be read): sums over the shard,
    ``O(S_local * H * D)``, read back in one host sync."""
    if error is not None:
        return (0.0,) * len(_FINGERPRINT_NAMES)
    with torch.no_grad():
        k_rows = k.sum(dim=(0, 2, 3), dtype=torch.float64)  # [S_k] one number per position
        v_rows = v.sum(dim=(0, 2, 3), dtype=torch.float64)
        weights = torch.arange(1, k_rows.numel() + 1, dtype=torch.float64, device=k_rows.device)
        values = torch.stack([
            q.sum(dtype=torch.float64), k_rows.sum(), (k_rows * weights).sum(), k_rows.abs().sum(),
            (k_rows.amax() != k_rows.amin()).to(torch.float64), v_rows.sum(), v_rows.abs().sum(),
        ])
    return tuple(values.tolist())


def _check_across_ranks(signature: tuple, error, group, q, fingerprints: tuple | None = None) -> None:
    """One small all-gather that every rank joins at every call, then every rank raises if any rank's
    inputs are bad or differ (Note [Cross-rank checks are decided together]), or if a memory passed as
    shards is replicated, or one passed as replicated is not (Note [Cross-attention over a replicated memory])."""
    fingerprints = fingerprints if fingerprints is not None else (0.0,) * len(_FINGERPRINT_NAMES)
    n = len(signature)
    rows = gather_rows(tuple(signature) + tuple(fingerprints), group, device=q.device)
    if error is not None:
        raise ValueError(error[1])
    ranks = global_ranks(group)
    failed = {ranks[r]: _LOCAL_ERRORS[row[0]] for r, row in enumerate(rows) if row[0]}
    if failed:
        raise ValueError(f"other ranks of the sequence-parallel group rejected their attention inputs "
                         f"(each raises the details; global rank: problem): {failed}")
    differ = describe_disagreement([row[:n] for row in rows], _SIGNATURE_NAMES[:n], ranks, show=_SIGNATURE_WORDS)
    if differ is not None:
        raise ValueError(f"ranks of the sequence-parallel group called attention with different inputs (global "
                         f"ranks; every rank raises this):\n{differ}")
    if n == len(_SIGNATURE_NAMES):
        _check_memory_layout(rows, n, ranks, kv_layout=KV_LAYOUTS[rows[0][_SIGNATURE_NAMES.index("kv_layout")]],
                             kv_len=rows[0][_SIGNATURE_NAMES.index("kS")])


def _check_memory_layout(rows, n: int, ranks, *, kv_layout: str, kv_len: int) -> None:
    """Every rank raises together when k/v cannot be what ``kv_layout`` says, judged from the gathered
    fingerprints (Note [Cross-attention over a replicated memory])."""
    fp = [dict(zip(_FINGERPRINT_NAMES, row[n:])) for row in rows]
    if kv_layout == "replicated":
        scale = max(max(f["sum|k per position|"], f["sum|v per position|"]) for f in fp)
        differ = [ranks[r] for r, f in enumerate(fp) if any(
            abs(f[name] - fp[0][name]) > _REPLICATED_RTOL * scale for name in ("sum(k)", "sum(k by position)", "sum(v)"))]
        if differ:
            raise ValueError(
                f"kv_layout='replicated' needs the same k and v (the whole memory) on every rank of the "
                f"sequence-parallel group, but global ranks {differ} hold other values than rank {ranks[0]} (every "
                f"rank raises this). Give every rank the whole memory (gather_sequence gathers a memory held in "
                f"shards); for k and v that are shards of q's own sequence, use kv_layout='sharded'")
        return
    same_memory = all(f["k varies along the sequence"] == 1 for f in fp) and all(
        f[name] == fp[0][name] for f in fp for name in ("sum(k)", "sum(k by position)", "sum(v)"))
    queries_differ = any(f["sum(q)"] != fp[0]["sum(q)"] for f in fp)
    if same_memory and queries_differ:
        raise ValueError(
            f"k and v are identical on every rank of the sequence-parallel group (global ranks {list(ranks)}) while "
            f"q differs: this looks like cross-attention over a memory of {kv_len} positions held whole on every "
            f"rank, which kv_layout='sharded' (the default) would read as {len(rows)} copies of it (every rank "
            f"raises this). Pass kv_layout='replicated': each rank's queries then attend over the whole memory, "
            f"exactly. If k and v really are shards of q's sequence that happen to be equal, pass "
            f"validate_inputs=False")
