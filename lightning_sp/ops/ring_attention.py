"""Blockwise attention over K/V blocks that visit this rank around a ring (or all sit here).

One loop serves ``local``, ``ring``, ``zigzag_ring``, ``allgather_kv`` and the ring part of ``usp``;
they differ only in where the K/V blocks come from and in the global positions of the tokens:

    for each source rank s (ring order; s = this rank when there is no ring):
        calls = plan_blocks(q_runs, k_runs[s])          # fully masked blocks are skipped
        for each call: (out_b, lse_b) = kernel(q[call], k_s[call], v_s[call]); merge

The backward replays the same plan with the merged ``out``/``lse`` (flash-attention style) and
sends dK/dV partial sums around the ring behind the K/V blocks (``ring_pass_accumulating``, Note
[Gradient partial sums around the ring] in ``comm/ring.py``), so no rank ever holds more than two
K/V blocks and one dK/dV partial sum: activation memory stays O(N/P).

Memory per rank (``u`` = one local ``[B, S/P, H, D]`` shard), whole blocks (``kv_pieces=1``):
forward: ``out`` + ``lse`` (kept for backward), the K/V block in flight and the one computed on
(``4u`` when both are received copies), one kernel result per call, merged in place. Backward:
``dq`` (fp32 accumulator, which *is* the returned gradient for fp32 inputs), the two K/V blocks, one
dK/dV partial sum (``2u``) and the kernel's per-call ``dq, dk, dv`` results. In pieces: below.

Note [First write assigns]
    Sums start from the first kernel result that covers them, not from zeros: the merged forward
    ``out, lse`` is the first result over every query (``_MergedResult``), ``dq`` the first ``dq`` over
    every query, a K/V block's dK/dV partial sum the first ``dk, dv`` over every key (``add_rows``);
    plans are reordered so such a call comes first. A sum whose first write covers only part of it
    is zero-filled then (a query chunk, a plan split at documents). With whole blocks every ring
    step's first call covers the block (the diagonal at step 0, the off-diagonal block after), so the
    ring-ish backends fill no accumulator with zeros and run no merge or add for the first result:
    one zero fill, one ``lerp``/``logaddexp`` or one ``add_`` of a ``[B, S/P, H, D]`` tensor fewer per sum,
    and the kernel's own result is the only allocation (it used to be a transient next to the
    zeroed sum). The sums may then be the kernel's strided ``[B, H, S, D] -> [B, S, H, D]`` views, as
    the one-call local path has always returned; sends make them contiguous.

Note [Head-major blocks]
    The CPU SDPA flash op reads q/K/V 3-4% faster (N/P = 4096, H = 8, D = 64, fwd and bwd) when their
    memory is head-major, ``[B, H, S, D]`` contiguous, than through the strided ``[B, S, H, D]`` views the
    ring otherwise hands it. So with whole blocks (``kv_pieces = 1``) on a ring and no memory budget in
    force (``BlockAttentionSpec.heads_major``: a budget's predicted peak does not count the copies), when the kernel
    ``prefers_heads_major`` (``SDPAKernel`` on CPU), each call copies this rank's q, k, v once into
    head-major memory (``heads_major``; the tensors keep their ``[B, S, H, D]`` shape), and K/V travel the
    ring in that memory (``RingComm.start(heads_major=True)``: no copy to send, received as such). The
    dK/dV partial sums are not converted: the op returns dQ/dK/dV as ``[B, S, H, D]`` memory whatever the
    inputs' layout, and they travel so. Memory: the head-major q copy (``u``) lives through the loop; the
    k, v copies only until step 0's blocks are replaced by received ones (the caller's k, v are the
    ring's step-0 blocks otherwise). Bytes and messages on the wire are unchanged. The kernel writes the
    output in q's head-major memory; it is copied back to ``[B, S, H, D]`` memory once at the end, else the
    output projection's reshape to ``[B, S, H*D]`` copies it and both are kept for backward (+1 ``sbh/P``
    per layer: ``tests/unit/test_activation_memory.py`` caught it).

Note [K/V in pieces]
    A ring that only talks to its neighbours cannot hold less than about one whole K/V block of
    another rank: rank ``r`` uses piece ``j`` of a block one step (``m`` pieces) after rank ``r-1``
    did, so someone keeps it for that long; the same holds for the dK/dV partial sums travelling
    behind. Ring-ish backends therefore sat at ``>= 4u`` of buffers on top of the ``4u`` every
    backend needs at the end of its backward (``out`` and the three gradients).

    With ``kv_pieces = m > 1`` (``BlockAttentionSpec.pieces_for``) each rank's K/V block is cut into
    ``m`` row ranges and, at step ``t``, piece ``j`` of rank ``r - t``'s block comes straight from
    its owner while rank ``r`` sends its own piece ``j`` to rank ``r + t`` (``RingComm.exchange``):
    a rank only ever sends its *input* K/V (no received copy is kept to forward on), holds the
    piece it computes on and the next one in flight, and sends exactly the ring's K/V bytes. In
    backward the queries also run in ``m`` chunks (the kernel's per-call ``dq`` is a chunk); the
    dK/dV contribution to another rank's piece is summed over the chunks and sent straight to the
    piece's owner, which adds it into its own ``dk, dv`` (``P - 1`` contributions per rank, one
    fewer than the ring's partial sums). Per rank, beyond ``out, dq, dk, dv``: about ``9u / m``
    (two K/V pieces, one contribution being summed and the one received, the kernel's per-tile
    results). The contribution exchange waits before the next piece (it does not overlap compute,
    which would cost ``4u / m`` more); the K/V exchange of the next piece does.

    The price is more, smaller kernel calls (``m^2`` tiles per step in backward) and ``m`` times as
    many messages; ``piece_count`` keeps pieces at least ``MIN_PIECE_TOKENS`` long, so short blocks
    use fewer pieces and blocks under ``2 * MIN_PIECE_TOKENS`` tokens run the neighbour ring.
    Measured (benchmarks/README.md, section 4): P = 4, N = 8192, peak per rank 0.69 -> 0.33 (ring)
    of one process's. Under a mask whose traffic is followed (``spec.follow_mask``) the pieces carry only the
    rows the mask needs (Note [Traffic follows the mask]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_sp.comm.ring import RingComm, ring_pass, ring_pass_accumulating
from lightning_sp.comm.selective import exchange_rows
from lightning_sp.comm.stats import CommStats
from lightning_sp.layout import Run
from lightning_sp.ops.precision import autocast_off
from lightning_sp.masks import ScoreMods, StructuredMask
from lightning_sp.ops.kernels import LocalKernel, kernel_for_call, prefers_heads_major
from lightning_sp.ops.merge import accumulation_dtype, merge_into
from lightning_sp.ops.plan import MaskKind, masked_dense, plan_blocks


MIN_PIECE_TOKENS = 256
"""Default shortest K/V piece (tokens): below it the per-call overhead outweighs the memory saved."""


def piece_count(kv_pieces: int, block_len: int, min_piece_tokens: int | None = None) -> int:
    """``kv_pieces``, reduced so that no piece of a ``block_len``-token block is shorter than
    ``min_piece_tokens`` (``None``: ``MIN_PIECE_TOKENS``); at least 1."""
    shortest = MIN_PIECE_TOKENS if min_piece_tokens is None else min_piece_tokens
    return max(1, min(kv_pieces, block_len // shortest))


@dataclass(frozen=True, eq=False)
class BlockAttentionSpec:
    """Everything but the tensors: what a forward/backward pair needs to agree on."""

    kernel: LocalKernel
    scale: float
    causal: bool
    q_runs: list[Run]
    """Global positions of the local queries."""
    k_runs_by_rank: list[list[Run]]
    """Global positions of the K/V block owned by each ring rank (index = ring rank)."""
    doc_bounds: list[int] | None = None
    group: object = None
    """Ring group; ``None``: K/V are all local (a single step)."""
    stats: CommStats | None = None
    kv_pieces: int = 1
    """Ring only: fetch each K/V block from its owner in this many pieces (Note [K/V in pieces]);
    1: the neighbour ring with whole blocks."""
    heads_major: bool = True
    """Whether whole-block rings may copy q, k, v to head-major memory for a kernel that prefers it (Note
    [Head-major blocks]); ``False`` where a memory budget is in force, whose predicted peak does not count
    the copies."""
    min_piece_tokens: int | None = None
    """A piece is never shorter than this (shorter blocks use fewer pieces); ``None``:
    ``MIN_PIECE_TOKENS``, read at call time."""
    mask: StructuredMask | None = None
    """Plan under this mask (``plan_blocks(mask=)``; it carries causality and documents); ``None``: ``causal``
    and ``doc_bounds``."""
    score_mods: ScoreMods | None = None
    """Per-score modifiers: every call runs ``score_mod_kernel``'s kernel (FlexAttention under ``kernel="flex"`` on
    CUDA, else ``ScoreModKernel``; needs ``mask``, whose calls are contiguous)."""
    head_offset: int = 0
    """Global index of the first local query head (Ulysses ranks hold a slice): for score modifiers and sinks."""
    follow_mask: bool = False
    """Ring only: exchange only the K/V rows each rank's queries see, pairwise (Note [Traffic follows the
    mask]); decided by the caller from global inputs, the same on every rank."""

    def __post_init__(self):
        if not (isinstance(self.kv_pieces, int) and self.kv_pieces >= 1):
            raise ValueError(f"kv_pieces must be an int >= 1, got {self.kv_pieces!r}")
        if self.min_piece_tokens is not None and not (isinstance(self.min_piece_tokens, int) and self.min_piece_tokens >= 1):
            raise ValueError(f"min_piece_tokens must be an int >= 1, got {self.min_piece_tokens!r}")

    def comm(self) -> RingComm | None:
        return None if self.group is None else RingComm(self.group, self.stats)

    def pieces_for(self, block_len: int) -> int:
        """How many pieces a ``block_len``-token K/V block travels in (1: the neighbour ring)."""
        if self.group is None:
            return 1
        return piece_count(self.kv_pieces, block_len, self.min_piece_tokens)


class AttentionResult(NamedTuple):
    out: torch.Tensor  # [B, S_q, H, D], accumulation dtype
    lse: torch.Tensor  # [B, H, S_q], accumulation dtype


def heads_major(x: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` with ``[B, H, S, D]`` contiguous memory (a copy unless already so); same shape."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _heads_major_ring(spec: BlockAttentionSpec, q, pieces: int) -> bool:
    """Whether this call runs the ring on head-major blocks (Note [Head-major blocks]): the same on every
    rank (the kernel, the device type and the piece count are)."""
    return spec.heads_major and spec.group is not None and pieces == 1 and prefers_heads_major(spec.kernel, q.device)


def _mask_for(call, spec: BlockAttentionSpec, device):
    if call.kind is not MaskKind.DENSE:
        return None
    if spec.mask is not None:
        return masked_dense(call, spec.mask, device)
    return call.dense_mask(spec.causal, spec.doc_bounds, device)


def _plan(spec: BlockAttentionSpec, q_runs, k_runs):
    return plan_blocks(q_runs, k_runs, causal=spec.causal, doc_bounds=spec.doc_bounds, mask=spec.mask)


def _kernel_for(spec: BlockAttentionSpec, call):
    """The kernel of one call: ``spec.kernel``, or one that knows the call's global positions (``kernel_for_call``:
    with score modifiers FlexAttention under ``kernel="flex"`` on CUDA, else ``ScoreModKernel``; under
    ``flash_attn`` the call's window and soft-cap passed to flash-attn where they are exact)."""
    if spec.score_mods is None and (call.kind is not MaskKind.DENSE or spec.mask is None):
        return spec.kernel
    return kernel_for_call(spec.kernel, spec.score_mods, mask=spec.mask, call=call, head_offset=spec.head_offset)


def _call_forward(spec, call, q, k, v):
    return _kernel_for(spec, call).forward(q, k, v, scale=spec.scale, kind=call.kind,
                                           mask=_mask_for(call, spec, q.device))


def _call_backward(spec, call, dout, q, k, v, out, lse):
    return _kernel_for(spec, call).backward(dout, q, k, v, out, lse, scale=spec.scale, kind=call.kind,
                                            mask=_mask_for(call, spec, q.device))


def _single_call(spec: BlockAttentionSpec, q, k):
    """The one kernel call that covers all queries and keys, when there is no ring and no split."""
    if spec.group is not None:
        return None
    calls = _plan(spec, spec.q_runs, spec.k_runs_by_rank[0])
    if len(calls) == 1 and (calls[0].q_start, calls[0].q_len, calls[0].k_start, calls[0].k_len) == (0, q.size(1), 0, k.size(1)):
        return calls[0]
    return None


class _MergedResult:
    """The merged ``out [B, Sq, H, D]`` and ``lse [B, H, Sq]`` (accumulation dtype) of one forward,
    built from kernel results without a zero-filled start: the first kernel result that covers every
    query *becomes* the accumulator (Note [First write assigns]); only a first result that covers
    part of the queries makes it allocate ``out = 0, lse = -inf`` and merge."""

    def __init__(self, q, head_dim_v: int, acc: torch.dtype):
        b, self.sq, h, _ = q.shape
        self.shape, self.acc, self.device = (b, self.sq, h, head_dim_v), acc, q.device
        self.out = self.lse = None

    def first_write_first(self, calls):
        """``calls`` with one that covers every query moved to the front while nothing is written."""
        if self.out is None:
            calls = sorted(calls, key=lambda c: c.q_len != self.sq)  # stable: the plan's order otherwise
        return calls

    def absorb(self, qs: slice, o_b, lse_b) -> None:
        if self.out is None:
            if qs.start == 0 and qs.stop == self.sq:
                self.out, self.lse = o_b.to(self.acc), lse_b.to(self.acc)
                return
            self._allocate()
        merge_into(self.out[:, qs], self.lse[:, :, qs], o_b, lse_b)

    def _allocate(self):
        self.out = torch.zeros(self.shape, dtype=self.acc, device=self.device)
        self.lse = torch.full((self.shape[0], self.shape[2], self.sq), -math.inf, dtype=self.acc, device=self.device)

    def result(self) -> AttentionResult:
        if self.out is None:  # no kernel call at all: every row saw no key
            self._allocate()
        return AttentionResult(self.out, self.lse)


def add_rows(total, rows: slice, value, shape, dtype):
    """``total[:, rows] += value`` and return ``total``; ``total is None``: nothing written yet. A first
    write that covers every row (``rows`` = all of ``shape[1]``) becomes the total (the kernel's own
    result: no zero fill, no add); another first write allocates zeros first (Note [First write assigns])."""
    if total is None:
        if rows.start == 0 and rows.stop == shape[1]:
            return value if value.dtype == dtype else value.to(dtype)
        total = torch.zeros(shape, dtype=dtype, device=value.device)
    total[:, rows] += value
    return total


def block_attention_forward(spec: BlockAttentionSpec, q, k, v) -> AttentionResult:
    """``q [B, Sq, H, D]``, ``k, v [B, Sk, H_kv, D]`` (this rank's block) -> merged ``(out, lse)``."""
    acc = accumulation_dtype(q.dtype)
    single = _single_call(spec, q, k)
    if single is not None:  # one kernel call covers everything: nothing to merge
        o, l = _call_forward(spec, single, q, k, v)
        return AttentionResult(o, l.to(acc))
    merged = _MergedResult(q, v.size(-1), acc)
    pieces = spec.pieces_for(k.size(1))
    if spec.follow_mask and spec.group is not None:  # Note [Traffic follows the mask] (in pieces too)
        _selective_forward(spec, q, k, v, merged, pieces)
        return merged.result()
    if pieces > 1:  # Note [K/V in pieces]
        _pieces_forward(spec, q, k, v, merged, pieces)
        return merged.result()
    hm = _heads_major_ring(spec, q, pieces)
    if hm:  # Note [Head-major blocks]: one copy of each; k, v held by the ring only until step 0 is done
        q = heads_major(q)

    def step(_step, src, blocks):
        k_blk, v_blk = blocks
        calls = _plan(spec, spec.q_runs, spec.k_runs_by_rank[src])
        for c in merged.first_write_first(calls):
            qs, ks = slice(c.q_start, c.q_start + c.q_len), slice(c.k_start, c.k_start + c.k_len)
            o_b, lse_b = _call_forward(spec, c, q[:, qs], k_blk[:, ks], v_blk[:, ks])
            merged.absorb(qs, o_b, lse_b)
            del o_b, lse_b

    ring_pass(spec.comm(), (heads_major(k), heads_major(v)) if hm else (k, v), step, heads_major=hm)
    res = merged.result()
    if hm:  # the kernel wrote out in q's head-major memory: back to [B, S, H, D] memory, or the caller's
        # reshape to [B, S, H*D] (the output projection's input) would copy it and both would be kept for backward
        res = AttentionResult(res.out.contiguous(), res.lse)
    return res


def block_grad_contribution(spec: BlockAttentionSpec, src: int, dout, q, k_blk, v_blk, out, lse, dq):
    """This rank's queries' gradients against source ``src``'s K/V block ``[B, Sk, H_kv, D]``: added into
    ``dq [B, Sq, H, D]`` (``None``: not written yet), and the block's dK/dV contribution restricted to the key
    rows the plan touches. Returns ``(dq, rows, (dk, dv))``: ``rows`` a ``slice`` of the block's rows, ``dk, dv``
    ``[B, rows, H_kv, D]`` (accumulation dtype; started by the first covering kernel result, Note [First write
    assigns]), or ``rows = None`` when every pair is masked (no kernel call). Only the touched rows are
    allocated: the zigzag ring's off-diagonal step attends to half of a block."""
    k_runs = spec.k_runs_by_rank[src]
    calls = _plan(spec, spec.q_runs, k_runs)
    if not calls:
        return dq, None, (None, None)
    lo, hi = min(c.k_start for c in calls), max(c.k_start + c.k_len for c in calls)
    dq, (dk, dv) = accumulate_tile_grads(spec, [(0, spec.q_runs)], slice_runs(k_runs, lo, hi), dout, q,
                                         k_blk[:, lo:hi], v_blk[:, lo:hi], out, lse, dq, (None, None))
    return dq, slice(lo, hi), (dk, dv)


def block_attention_backward(spec: BlockAttentionSpec, dout, q, k, v, out, lse):
    """Gradients of the merged attention for this rank's ``q`` and its own ``k, v`` block."""
    acc = accumulation_dtype(q.dtype)
    single = _single_call(spec, q, k)
    if single is not None:
        grads = _call_backward(spec, single, dout, q, k, v, out, lse)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
    pieces = spec.pieces_for(k.size(1))
    if spec.follow_mask and spec.group is not None:  # Note [Traffic follows the mask] (in pieces too)
        return _selective_backward(spec, dout, q, k, v, out, lse, pieces)
    if pieces > 1:
        return _pieces_backward(spec, dout, q, k, v, out, lse, pieces)
    hm = _heads_major_ring(spec, q, pieces)
    q_in = q
    if hm:  # Note [Head-major blocks]
        q = heads_major(q)
    dq = None  # first write assigns (Note [First write assigns])

    def grads(_step, src, blocks, complete):
        nonlocal dq
        k_blk, v_blk = blocks
        # this rank's dK/dV for the block, on the key rows it touches; the ring adds it into the partial sum of
        # the ranks before (received meanwhile). complete: a whole-block tensor is needed (nothing to add into)
        dq, rows, contribution = block_grad_contribution(spec, src, dout, q, k_blk, v_blk, out, lse, dq)
        if complete and (rows is None or (rows.start, rows.stop) != (0, k_blk.size(1))):
            whole = zeros_if_unwritten((None, None), blocks, acc)
            if rows is not None:
                for w, c in zip(whole, contribution):
                    w[:, rows] = c
            return slice(None), whole
        return rows, contribution

    dk, dv = ring_pass_accumulating(  # the head-major k, v unnamed: held by the ring only until step 0 is done
        spec.comm(), (heads_major(k), heads_major(v)) if hm else (k, v), grads, heads_major=hm
    )
    dq = zeros_if_unwritten((dq,), (q_in,), acc)[0]
    return dq.to(q_in.dtype), dk.to(k.dtype), dv.to(v.dtype)


def zeros_if_unwritten(sums, like, dtype):
    """``sums`` with every ``None`` (no kernel call wrote it: all masked) replaced by zeros shaped as ``like``."""
    return tuple(torch.zeros(t.shape, dtype=dtype, device=t.device) if s is None else s for s, t in zip(sums, like))


# ----------------------------------------------------------------------------------------------
# K/V in pieces (Note [K/V in pieces])
# ----------------------------------------------------------------------------------------------


def piece_bounds(n: int, parts: int) -> list[int]:
    """``parts + 1`` cut points splitting ``range(n)`` into near-equal contiguous slices."""
    return [n * i // parts for i in range(parts + 1)]


def slice_runs(runs, start: int, stop: int) -> tuple[Run, ...]:
    """The part of ``runs`` (local rows of a block) inside local rows ``[start, stop)``, with local
    offsets relative to ``start``."""
    out = []
    for r in runs:
        lo, hi = max(r.local_start, start), min(r.local_start + r.length, stop)
        if lo < hi:
            out.append(Run(lo - start, r.global_start + lo - r.local_start, hi - lo))
    return tuple(out)


def _piece_schedule(comm: RingComm, k, v, pieces: int):
    """Yield ``(step, source_rank, piece, (k_piece, v_piece))`` for every piece of every rank's K/V
    block, in ring order of the sources (step ``t``: source ``rank - t``). Step 0 is this rank's own
    block (views, no copy); at step ``t > 0`` piece ``j`` comes straight from its owner while this
    rank's own piece ``j`` goes to rank ``rank + t`` (the same bytes as the ring). The next piece is
    in flight while the caller computes on the current one."""
    kb = piece_bounds(k.size(1), pieces)
    order = [(t, j) for t in range(comm.world) for j in range(pieces)]

    def fetch(t, j):
        own = (k[:, kb[j]:kb[j + 1]], v[:, kb[j]:kb[j + 1]])
        return own if t == 0 else comm.exchange(own, t)

    nxt = fetch(*order[0])
    for i, (t, j) in enumerate(order):
        cur, nxt = nxt, (fetch(*order[i + 1]) if i + 1 < len(order) else None)
        blocks = cur if t == 0 else cur.wait()
        del cur
        yield t, (comm.rank - t) % comm.world, j, blocks
        del blocks  # freed before the piece after next is allocated


def _pieces_forward(spec: BlockAttentionSpec, q, k, v, merged: _MergedResult, pieces: int) -> None:
    """Forward over K/V pieces, merged into ``merged``."""
    comm = spec.comm()
    kb = piece_bounds(k.size(1), pieces)
    for _t, src, j, (k_p, v_p) in _piece_schedule(comm, k, v, pieces):
        piece_runs = slice_runs(spec.k_runs_by_rank[src], kb[j], kb[j + 1])
        calls = _plan(spec, spec.q_runs, piece_runs)
        for c in merged.first_write_first(calls):
            qs, ks = slice(c.q_start, c.q_start + c.q_len), slice(c.k_start, c.k_start + c.k_len)
            o_b, lse_b = _call_forward(spec, c, q[:, qs], k_p[:, ks], v_p[:, ks])
            merged.absorb(qs, o_b, lse_b)
            del o_b, lse_b
        del k_p, v_p


def query_chunks(q_runs, q_len: int, chunks: int) -> list[tuple[int, tuple[Run, ...]]]:
    """``q_runs`` cut into ``chunks`` near-equal row ranges: ``[(first local row, runs relative to
    it)]`` for ``accumulate_tile_grads``."""
    qb = piece_bounds(q_len, chunks)
    return [(qb[i], slice_runs(q_runs, qb[i], qb[i + 1])) for i in range(chunks)]


def accumulate_tile_grads(spec: BlockAttentionSpec, q_chunks, k_runs, dout, q, k_blk, v_blk, out, lse, dq, dkv):
    """The gradients of this rank's queries against a K/V block (or piece) whose positions are ``k_runs``,
    one query chunk (``query_chunks``) at a time, so the kernel's per-call ``dq`` is a chunk, not
    all of ``q``. ``dq [B, Sq, H, D]``, ``dkv = (dk, dv)`` each ``[B, Sk, H_kv, D]``: tensors are added
    into in place; ``None`` (not written yet) is assigned by a first kernel result that covers it
    (``add_rows``). Returns ``(dq, (dk, dv))``."""
    dk, dv = dkv
    acc = accumulation_dtype(q.dtype)
    for q0, chunk_runs in q_chunks:
        calls = _plan(spec, chunk_runs, k_runs)
        if dk is None:  # a call covering every key first, so its result starts the dK/dV sum
            calls.sort(key=lambda c: c.k_len != k_blk.size(1))
        for c in calls:
            qs = slice(q0 + c.q_start, q0 + c.q_start + c.q_len)
            ks = slice(c.k_start, c.k_start + c.k_len)
            dq_c, dk_c, dv_c = _call_backward(spec, c, dout[:, qs], q[:, qs], k_blk[:, ks], v_blk[:, ks], out[:, qs],
                                              lse[:, :, qs])
            dq = add_rows(dq, qs, dq_c, q.shape, acc)
            dk = add_rows(dk, ks, dk_c, k_blk.shape, acc)
            dv = add_rows(dv, ks, dv_c, v_blk.shape, acc)
            del dq_c, dk_c, dv_c  # free the kernel's results before the next call allocates its own
    return dq, (dk, dv)


def _pieces_backward(spec: BlockAttentionSpec, dout, q, k, v, out, lse, pieces: int):
    """Backward over K/V pieces and query chunks: ``dq`` and this rank's ``dk, dv`` accumulate in
    place; the dK/dV contribution to another rank's piece is summed over the query chunks and sent
    straight back to that piece's owner, which adds it into its own ``dk, dv``."""
    comm = spec.comm()
    acc = accumulation_dtype(q.dtype)
    dq = None  # first write assigns (Note [First write assigns])
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    kb = piece_bounds(k.size(1), pieces)
    q_chunks = query_chunks(spec.q_runs, q.size(1), pieces)
    for t, src, j, (k_p, v_p) in _piece_schedule(comm, k, v, pieces):
        piece_runs = slice_runs(spec.k_runs_by_rank[src], kb[j], kb[j + 1])
        if t == 0:  # this rank's own piece: straight into its gradient
            dk_p, dv_p = dk[:, kb[j]:kb[j + 1]], dv[:, kb[j]:kb[j + 1]]
        else:  # another rank's piece: the contribution starts as the first covering kernel result
            dk_p = dv_p = None
        dq, (dk_p, dv_p) = accumulate_tile_grads(spec, q_chunks, piece_runs, dout, q, k_p, v_p, out, lse, dq, (dk_p, dv_p))
        dk_p, dv_p = zeros_if_unwritten((dk_p, dv_p), (k_p, v_p), acc)
        del k_p, v_p
        if t > 0:  # send this contribution to the piece's owner; receive the one for our own piece j
            got_k, got_v = comm.exchange((dk_p, dv_p), -t, op="ring_send_grad").wait()
            del dk_p, dv_p
            dk[:, kb[j]:kb[j + 1]] += got_k
            dv[:, kb[j]:kb[j + 1]] += got_v
            del got_k, got_v
    dq = zeros_if_unwritten((dq,), (q,), acc)[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------
# attention sinks
# ----------------------------------------------------------------------------------------------


def absorb_sinks(res: AttentionResult, sinks: torch.Tensor | None, head_offset: int) -> AttentionResult:
    """Note [Attention sinks]: the merged ``(out, lse)`` over every key, with each query head's sink logit
    (``sinks [H_total]``; this rank's heads start at ``head_offset``) joined as one more key of value 0."""
    if sinks is None:
        return res
    h = res.lse.size(1)
    sink = sinks[head_offset:head_offset + h].detach().to(res.lse.dtype).view(1, h, 1)
    lse = torch.logaddexp(res.lse, sink)  # [B, H, Sq]
    keep = torch.exp(res.lse - lse)  # the keys' share of the row; 0 where no key is visible
    return AttentionResult(res.out * keep.transpose(1, 2).unsqueeze(-1).to(res.out.dtype), lse)


def sink_grad(dout, out, lse, sinks: torch.Tensor | None, head_offset: int):
    """``d loss / d sinks [H_total]`` from this rank's rows: ``-sum_rows p_sink * (dout . out)`` for its heads,
    zero for the others (Note [Attention sinks])."""
    if sinks is None:
        return None
    acc = lse.dtype
    h = lse.size(1)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, Sq]
    p_sink = torch.exp(sinks[head_offset:head_offset + h].to(acc).view(1, h, 1) - lse)
    grad = torch.zeros(sinks.shape, dtype=acc, device=sinks.device)
    grad[head_offset:head_offset + h] = -(p_sink * delta).sum((0, 2)).to(sinks.device)
    return grad.to(sinks.dtype)


class BlockAttentionFunction(torch.autograd.Function):
    """Thin autograd wrapper: saves tensors, calls the two loops above.

    Note [Attention sinks]
        A sink is one more logit per query head in every row's softmax with a zero value vector (gpt-oss). Over
        disjoint key sets softmax results merge by their log-sum-exp, so the sink joins the merged result once,
        after every key block: ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``. The backward
        then needs nothing new: the blockwise backward with ``lse'`` gives the keys' probabilities in the extended
        softmax, and ``delta = dout . out'`` is the extended row's expectation (the sink's value is 0). The sink's
        own gradient is ``-sum_rows p_sink * delta``, ``p_sink = exp(sink - lse')``; each rank adds its rows' share
        (a parameter's gradient summed over the sequence shards, as every other parameter's)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec: BlockAttentionSpec):
        res = absorb_sinks(block_attention_forward(spec, q, k, v), sinks, spec.head_offset)
        out = res.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, res.lse, sinks)
        ctx.spec = spec
        return out

    @staticmethod
    @autocast_off
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = block_attention_backward(ctx.spec, dout, q, k, v, out, lse)
        return dq, dk, dv, sink_grad(dout, out, lse, sinks, ctx.spec.head_offset), None


def block_attention(q, k, v, spec: BlockAttentionSpec, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return BlockAttentionFunction.apply(q, k, v, sinks, spec)


# ----------------------------------------------------------------------------------------------
# Note [Traffic follows the mask]
# ----------------------------------------------------------------------------------------------
#
# A neighbour ring forwards every K/V block through every rank, whatever the mask. Under a mask (packed
# documents, windows, spans, chunks) most (query rank, key rank) pairs may see few or no keys of each other, so
# with ``spec.follow_mask`` the ring instead exchanges directly: at step ``t`` rank ``r`` sends to ``r + t``
# only the rows of its own K/V block that ``r + t``'s queries see (``kv_rows_needed``: the span of the key rows
# of their plan; nothing when the plan is empty) and receives from ``r - t`` the rows its own queries see. Both
# ends compute the same rows from the same global inputs (runs, documents, window, spans), so every send has
# its receive and no size travels. Step ``t + 1``'s exchange is in flight while step ``t`` computes (two
# received blocks at most, as the ring). Backward: the same K/V exchanges, and each step's dK/dV contribution
# goes straight back to the rows' owner (tag 2), which adds it into its gradient: ``P - 1`` contributions, the
# rows that were sent. Packed documents that never cross a shard boundary send nothing at all; a causal sliding
# window sends to the ranks within the window of its keys only, the rows the window reaches.
#
# In pieces (``kv_pieces = m > 1``, Note [K/V in pieces]) the same exchange runs once per piece: at step ``t``,
# piece ``j`` (block rows ``piece_bounds``) moves only the needed rows inside it (``piece_rows_needed``: the
# needed span cut to the piece), in the pieces path's order (every piece of step ``t`` before step ``t + 1``),
# the next piece in flight while the current one computes, the queries in ``m`` chunks in backward, and each
# piece's dK/dV contribution goes back to its owner before the next piece. The pieces of a span add up to the
# span: the bytes are those of whole blocks (``tests/distributed/test_masks.py``), the memory that of pieces.


_KV_TAG, _GRAD_TAG = 1, 2


def rows_needed(q_runs, k_runs, *, causal: bool, doc_bounds, mask, piece: tuple[int, int] | None = None
                ) -> tuple[int, int] | None:
    """Rows ``[lo, hi)`` of the K/V block of ``k_runs`` that the queries of ``q_runs`` see (``plan_blocks`` under
    ``causal``, ``doc_bounds``, ``mask``), cut to the block rows ``piece = (start, stop)`` if given (``None``:
    none): a pure function of global inputs, the same on every rank, and what the cost model counts."""
    calls = plan_blocks(q_runs, k_runs, causal=causal, doc_bounds=doc_bounds, mask=mask)
    if not calls:
        return None
    lo, hi = min(c.k_start for c in calls), max(c.k_start + c.k_len for c in calls)
    if piece is not None:
        lo, hi = max(lo, piece[0]), min(hi, piece[1])
    return (lo, hi) if lo < hi else None


def kv_rows_needed(spec: BlockAttentionSpec, dst: int, src: int) -> tuple[int, int] | None:
    """Rows ``[lo, hi)`` of ring rank ``src``'s K/V block that ring rank ``dst``'s queries see under the spec's
    mask (``None``: none)."""
    return rows_needed(spec.k_runs_by_rank[dst], spec.k_runs_by_rank[src], causal=spec.causal,
                       doc_bounds=spec.doc_bounds, mask=spec.mask)


def piece_rows_needed(spec: BlockAttentionSpec, dst: int, src: int, piece: tuple[int, int]) -> tuple[int, int] | None:
    """``kv_rows_needed(spec, dst, src)`` inside the block rows ``piece = (start, stop)`` (``None``: none)."""
    return rows_needed(spec.k_runs_by_rank[dst], spec.k_runs_by_rank[src], causal=spec.causal,
                       doc_bounds=spec.doc_bounds, mask=spec.mask, piece=piece)


def _kv_exchange(spec, comm, k, v, t, piece):
    """Step ``t``'s K/V exchange of the block rows ``piece = (start, stop)``: ``(pending, source rank, rows
    received or None)``."""
    dst, src = (comm.rank + t) % comm.world, (comm.rank - t) % comm.world
    send_rows = piece_rows_needed(spec, dst, comm.rank, piece)
    recv_rows = piece_rows_needed(spec, comm.rank, src, piece)
    shapes = ()
    if recv_rows is not None:
        n = recv_rows[1] - recv_rows[0]
        shapes = ((k.size(0), n, *k.shape[2:]), (v.size(0), n, *v.shape[2:]))
    send = () if send_rows is None else (k[:, send_rows[0]:send_rows[1]], v[:, send_rows[0]:send_rows[1]])
    pending = exchange_rows(spec.group, spec.stats, send_to=None if send_rows is None else dst, send=send,
                            recv_from=None if recv_rows is None else src, recv_shapes=shapes, like=k,
                            op="ring_send", tag=_KV_TAG)
    return pending, src, recv_rows


def _selective_steps(spec, k, v, pieces: int = 1):
    """Yield ``(step, source rank, piece, rows, (k_rows, v_rows))`` for every step and piece (Note [Traffic
    follows the mask]; step 0: this rank's own block, each piece whole; ``rows`` are the source block's rows
    received, ``None`` with no blocks where this rank's queries see none of that piece), the next exchange in
    flight meanwhile. ``pieces > 1``: each block in ``piece_bounds`` row ranges, one exchange per piece, so a rank
    holds at most two received piece-sized row ranges (Note [K/V in pieces])."""
    comm = spec.comm()
    kb = piece_bounds(k.size(1), pieces)
    order = [(t, j) for t in range(comm.world) for j in range(pieces)]

    def fetch(t, j):
        if t == 0:
            return None, comm.rank, (kb[j], kb[j + 1])
        return _kv_exchange(spec, comm, k, v, t, (kb[j], kb[j + 1]))

    nxt = fetch(*order[0])
    for i, (t, j) in enumerate(order):
        (pending, src, rows), nxt = nxt, (fetch(*order[i + 1]) if i + 1 < len(order) else None)
        if pending is None:  # this rank's own piece: views, no copy
            blocks = (k[:, rows[0]:rows[1]], v[:, rows[0]:rows[1]])
        else:
            blocks = pending.wait()
        del pending
        yield t, src, j, rows, blocks
        del blocks  # freed before the piece after next is allocated


def _selective_forward(spec: BlockAttentionSpec, q, k, v, merged: _MergedResult, pieces: int = 1) -> None:
    for _t, src, _j, rows, blocks in _selective_steps(spec, k, v, pieces):
        if rows is None:
            continue
        (lo, hi), (k_r, v_r) = rows, blocks
        calls = _plan(spec, spec.q_runs, slice_runs(spec.k_runs_by_rank[src], lo, hi))
        for c in merged.first_write_first(calls):
            qs, ks = slice(c.q_start, c.q_start + c.q_len), slice(c.k_start, c.k_start + c.k_len)
            o_b, lse_b = _call_forward(spec, c, q[:, qs], k_r[:, ks], v_r[:, ks])
            merged.absorb(qs, o_b, lse_b)
            del o_b, lse_b
        del k_r, v_r, blocks


def _selective_backward(spec: BlockAttentionSpec, dout, q, k, v, out, lse, pieces: int = 1):
    comm = spec.comm()
    acc = accumulation_dtype(q.dtype)
    dq = None  # first write assigns (Note [First write assigns])
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    kb = piece_bounds(k.size(1), pieces)
    q_chunks = query_chunks(spec.q_runs, q.size(1), pieces)  # pieces: the kernel's per-call dq is a chunk
    for t, src, j, rows, blocks in _selective_steps(spec, k, v, pieces):
        send = None
        if rows is not None:
            (lo, hi), (k_r, v_r) = rows, blocks
            runs = slice_runs(spec.k_runs_by_rank[src], lo, hi)
            if t == 0:  # this rank's own rows: straight into its gradient (views of dk, dv)
                dq, _ = accumulate_tile_grads(spec, q_chunks, runs, dout, q, k_r, v_r, out, lse, dq,
                                              (dk[:, lo:hi], dv[:, lo:hi]))
                continue
            dq, contribution = accumulate_tile_grads(spec, q_chunks, runs, dout, q, k_r, v_r, out, lse, dq,
                                                     (None, None))
            send = zeros_if_unwritten(contribution, (k_r, v_r), acc)
            del k_r, v_r, contribution
        if t == 0:
            continue
        del blocks
        # this step's contribution goes straight back to its owner; the one for this rank's rows comes from the
        # rank that received them (the same pairs as the K/V exchange, reversed)
        owner, asker = src, (comm.rank + t) % comm.world
        mine = piece_rows_needed(spec, asker, comm.rank, (kb[j], kb[j + 1]))  # rows `asker` computed on
        shapes = () if mine is None else tuple((k.size(0), mine[1] - mine[0], *t_.shape[2:]) for t_ in (k, v))
        got = exchange_rows(spec.group, spec.stats, send_to=None if send is None else owner, send=send or (),
                            recv_from=None if mine is None else asker, recv_shapes=shapes, like=k, dtype=acc,
                            op="ring_send_grad", tag=_GRAD_TAG).wait()
        del send
        if mine is not None:
            dk[:, mine[0]:mine[1]] += got[0]
            dv[:, mine[0]:mine[1]] += got[1]
        del got
    dq = zeros_if_unwritten((dq,), (q,), acc)[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
