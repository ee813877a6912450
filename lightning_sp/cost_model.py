"""A small analytic model of one attention layer per sequence-parallel backend: compute + communication with
each backend's overlap rule, and per-rank activation memory. (Whole transformer layers and training steps, for the
papers' numbers, are built on it in ``experiments/cost_model/papers.py``.)

    hw = preset("a100-80gb")                                           # or a profile calibrated on CPU
    shape = AttentionShape(seq_len=65536, num_heads=32, num_kv_heads=8, head_dim=128)
    predict_attention("zigzag_ring", shape, world=8, hw=hw).total_s    # model output, seconds
    choose_backend(shape, world=16, hw=hw)                              # what backend="auto" runs
    predict_attention("zigzag_ring", shape, 8, hw, mask=AttentionMask(window=(4095, 0)))  # under a mask

Everything this module returns is *model output*, never a measurement; experiments label it so
(``experiments/cost_model/run.py`` puts it beside measured times and the papers' numbers).

Note [Cost model of one attention layer]
    What runs is counted, not re-derived: ``lightning_sp.ops.schedule.rank_schedule`` walks each
    backend's loops on each rank with the backends' own plan code (``plan_blocks`` on the layout's
    runs, ``piece_count``/``query_chunks`` for K/V pieces, ``head_group_count`` for Ulysses' head
    groups) and returns its steps: kernel calls ``(q_len, k_len, mask, heads, fwd|bwd)``, merges,
    in-place gradient sums, copies, ring exchanges (overlapped K/V, waited dK/dV), collectives, and
    the cross-rank check of every call (one small all-gather). So fully masked blocks are skipped
    exactly as the code skips them (zigzag: half a block per step; plain ring: the last rank's full
    block bounds each step), and a change to the loops changes the prediction with it.

    Time of one step, per rank ``r``: ``cpu_r`` = its kernel calls (Note [Per-call terms]) + merges +
    sums + copies; its ring exchange overlaps the K/V transfer with compute and waits for the dK/dV
    partial sum after it (Note [Gradient partial sums around the ring]):

        t_r   = max(cpu_r, K/V transfer) + messages x message_time + dK/dV transfer
        step  = max( max_r t_r ,  sum_r cpu_r / compute_slots + max_r (its exposed comm) )

    The first term: a step ends when its slowest rank ends. The second: ranks that share
    ``compute_slots`` cores (``P`` gloo ranks on a 2-core CPU) serialise their compute, so a step
    cannot end before the cores have done every rank's work. A calibrated profile measures the
    sharing instead (``compute_sharing``: one kernel loop on each of ``P`` ranks at once, the ranks' mean
    time per call over the time alone, which also sees memory bandwidth and other jobs on the machine) and uses
    ``mean_r cpu_r x stretch(P)`` for the second term. ``compute_slots=None`` and no sharing (one
    device per rank): the first term only. A collective step is its calibrated time (latency + bytes /
    bandwidth, measured at that group size); when more ranks run than the group (usp's sub-groups)
    and they share cores, it stretches by ``max(1, P/C) / max(1, g/C)``. Communication bytes per
    tensor are those of ``lightning_sp.comm.volume`` (checked against ``CommStats`` in the tests).

    Ranks modelled: all up to 16, beyond that ranks 0, 1, P/2 and P-1 (the backends' extremes), so
    ``backend="auto"`` stays cheap at large P.

Note [Cost model under a mask]
    ``predict_attention(..., mask=AttentionMask(...), cu_seqlens=...)`` (and ``choose_backend``, ``rank_counts``)
    price a call under a sliding window (left/right), chunks, bidirectional spans and packed documents as the
    backends run it: ``rank_schedule(mask=, doc_bounds=)`` resolves them as ``SequenceParallelAttention`` does and
    plans every kernel call with the library's ``plan_blocks(mask=)`` on global ranges (``StructuredMask.classify``),
    and the K/V rows a ring that follows the mask exchanges are ``kv_rows_needed``'s (Note [Schedules under a mask]
    in ``ops/schedule.py``). Nothing here re-derives a formula for a mask, so the prediction cannot drift from the
    code: ``tests/distributed/test_cost_model_counts.py`` checks calls, pairs and bytes per ``CommStats`` operation
    equal on real ranks, and ``tests/unit/test_cost_model_masks.py`` the committed mask benchmark's bytes.

    What follows: compute is the visible blocks' calls (a window leaves ``~N W H / P`` pairs per rank; its partial
    tiles are ``MASK_TILE``-sized DENSE calls, priced at that block's rate); traffic shrinks only where it follows
    the mask (rings, ``allgather_kv`` and ``usp``'s ring with whole K/V blocks: a window's rows, nothing for a
    document inside one shard), never for Ulysses' all-to-alls, K/V in pieces or the all-gather. So under a
    window ``W << N`` ``backend="auto"`` prefers a ring that sends ``~W`` rows per neighbour over all-to-alls that
    move every row. Chunks (Llama 4's chunked layers, ``chunk_size``) are documents cut at every multiple of the
    chunk: pairs and bytes exact as for documents. Score modifiers and sinks: Note [Cost model of score modifiers].
    ``comm_bytes`` is counted the same way with or without a mask (``rank_counts``: dK/dV sums in the accumulation
    dtype), so the two compare.

Note [Cost model on a given layout]
    ``predict_attention``, ``rank_counts``, ``choose_backend`` (and ``ops.schedule.rank_schedule``) take ``layout=``,
    the ``SequenceLayout`` given to ``SequenceParallelAttention(layout=)`` (``ring``, ``zigzag_ring``,
    ``allgather_kv``, ``usp``: ``LAYOUT_BACKENDS``), e.g. ``SequenceLayout.balanced_for`` a prefix-LM span (Note
    [Balancing a mask's work] in ``layout.py``). Nothing else changes: every rank's runs are the layout's
    (``runs_for_ranks``), planned by the same ``plan_blocks``, so the pairs, calls and bytes are what the backends
    do on that layout (``tests/distributed/test_cost_model_counts.py``: a balanced table under a span, P = 2 and 4,
    equal on real ranks). It is checked as the module checks it (``checked_layout``), with its errors. A chunk table
    with more chunks per rank is priced with its extra runs: more, smaller kernel calls.

Note [Cost model of score modifiers]
    A call whose mask has score modifiers (``AttentionMask.score_mods()``: softcap, ALiBi, a relative-position bias,
    ``score_mod``, ``mask_mod``) runs ``ops.kernels.ScoreModKernel``, the pure-PyTorch blockwise path, not the plain
    kernel (FlexAttention only under ``kernel="flex"``, opt-in, not modelled). Its calls, pairs and bytes are those
    of the same mask without modifiers (one plan: any mask plans on global ranges); each call's time is the plain
    call's times a factor, forward and backward apart:

        factor(mods) = f_blockwise + sum over mods of max(0, f_mod - f_blockwise)

    ``f_*``: ``HardwareProfile.score_mod_factors`` rows ``(modifier, kind, D, side, fwd, bwd)``, interpolated
    log-linearly in the call's side ``sqrt(q_len k_len)`` and in D (clamped outside; a DENSE tile and a missing
    kind read the FULL rows; a modifier without rows adds nothing). ``blockwise`` is the path with no modifier set,
    the others each modifier alone; ``relative_bias`` with a learned table (its backward accumulates the table's
    gradient). ``score_mod``/``mask_mod`` callables are priced as the path alone (their own work is the caller's).
    CPU: measured, ``experiments/cost_model/score_mods.py`` (each kernel timed in turn with the plain one, so the
    ratio carries to a profile measured on another day). GPU presets: an assumption, no measurement
    (``assumed_cuda_score_mod_factors``: the tiles' fp32 matmuls on CUDA cores and their score passes at HBM
    bandwidth over the preset's flash-style rate), labelled in the preset's ``source``. No rows: the plain price.
    Sinks (gpt-oss) add one logit per row after every key block (``ops.ring_attention.absorb_sinks`` and, in
    backward, ``sink_grad``): ``sinks_s``, seconds per output element at the rank's ``E = B x N/P x H x D``
    (measured at several ``E``: per element it grows ~5x once the output leaves the caches), work on every rank at
    the forward's end; no pairs, no bytes.

Note [Per-call terms]
    What a calibrated profile (``experiments/cost_model/calibrate.py``) adds to FLOPs / rate; every
    term is a microbenchmark of a primitive or of a backend with its compute stubbed out, never a fit to
    a validation row:

        kernel_table    one kernel call per head vs (q_len, k_len) for FULL rectangles and CAUSAL
                        squares at several D (log-linear in between, time per element constant
                        beyond the table); GPU presets: FLOPs at ``attention_curve(q_len)``
        kernel_call_s   fixed time of a call (a tiny one), forward and backward
        merge_s, elementwise_s   merge_into / an in-place add: per call + per element
        message_s       one RingComm exchange of a tiny tensor at that world size (Python, gloo, wait),
                        measured with every rank computing between exchanges (a message waits for its
                        peer to get a core when ranks outnumber cores)
        collective_fits all-to-all / all-gather latency + bandwidth at each group size (least squares
                        in relative error, so the small messages set the latency)
        collective_busy_s  a tiny all-to-all / all-gather with every rank computing between them:
                        replaces the idle latency
        colossal_table  ``ops/colossal.py``'s own local compute (its forward and hand-written backward
                        on one rank, the ring's messages stubbed out) per score element, at several
                        sizes of the rank's ``[H, S/P, N]`` scores and D (``colossal_s``: one line
                        ``a + E (b + c D)``, used when no table is given)
        layer_latency_s what one layer call (fwd+bwd) costs beyond all of the above, per backend and world:
                        the backend run with its kernel stubbed out (zeros of the real calls' shapes) at a tiny
                        shape on idle ranks, less what the other terms price there
                        (``calibrate.with_layer_latency``).
                        Python, autograd and plan bookkeeping, hand-overs between threads: latency on each
                        rank's own path, so it is spread over the layer's steps as a fixed time on every rank
                        (``t_r``), not as work in the cores' shared term. Where ranks share cores, another
                        rank's compute fills that time (grid 1 with the term as work added everywhere: mean
                        |error| 11.4%, max 42%; as latency on the path: 9.6%, 28.6%; offline, 2026-11-24)
        sync_delay_s    the delay a synchronisation meets after a stretch of compute, per world: synthetic
                        steps of kernel calls each ended by a ring exchange or a tiny all-to-all, timed in
                        rotated rounds as the validation rows are, (median round - fastest round) per
                        synchronisation (``calibrate.measure_sync_delay``). The other terms price a step's
                        fastest round (no rank late); a row is its rounds' median, and this VM's ranks reach a
                        synchronisation at different times from one round to the next. Added once at every
                        collective or ring wait that follows kernel (or ``colossal`` score) compute, and at the
                        layer's end; a collective right after another collective meets none (Ulysses' three
                        all-to-alls after one call count once). Added after the layer latency is fitted: the
                        stubbed layers compute nothing

    ``fwd+bwd`` FLOPs for the GPU presets: backward = 2.5x forward (flash-style recompute), so
    ``3.5 x`` the forward's ``4 N^2 H D`` (halved for a causal square); ``megatron_sp`` keeps its
    closed form (all-gather/reduce-scatter around one local call on ``H/t`` heads).

    Memory (per rank, one layer, bytes): Korthikanti et al.'s activation formula ``s b h (34 + 5 a
    s / h)`` (REFERENCES.md), the ``5as/h`` score term replaced by flash attention's ``4a/h`` (LSE)
    term for every backend except ``colossal`` (which keeps the scores on purpose), divided by the
    sequence-parallel degree (``/t`` with TP+SP); plus the transient communication buffers (ring:
    two K/V blocks in flight; allgather_kv: the gathered K/V; ulysses: the head-split q/k/v).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from typing import TYPE_CHECKING

from lightning_sp.comm.volume import replicated_kv_heads

if TYPE_CHECKING:
    from lightning_sp.masks import AttentionMask

MODEL_BACKENDS = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal", "megatron_sp")
"""Backends the model knows (``megatron_sp``: Megatron TP+SP over the same ranks, attention half)."""

FWD_BWD_FACTOR = 3.5
"""fwd+bwd FLOPs of attention over the forward's (backward = 2.5x forward, flash-style recompute)."""

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

SCORE_MOD_ROWS = ("blockwise", "softcap", "alibi", "relative_bias")
"""``HardwareProfile.score_mod_factors``' modifiers: the score-modifying path alone, then each modifier alone
(Note [Cost model of score modifiers])."""


def score_mod_names(mask: "AttentionMask | None") -> tuple[str, ...]:
    """The score modifiers a call under ``mask`` runs with, by name (``AttentionMask.score_mods``, the kernel's
    choice): ``()`` when its calls run the plain kernel."""
    mods = None if mask is None else mask.score_mods()
    if mods is None:
        return ()
    fields = (("softcap", mods.softcap), ("alibi", mods.alibi_slopes), ("relative_bias", mods.relative_bias),
              ("score_mod", mods.score_mod), ("mask_mod", mods.mask_mod))
    return tuple(name for name, value in fields if value is not None)


@dataclass(kw_only=True, frozen=True)
class HardwareProfile:
    """What the model needs to know about one device type and its links."""

    name: str
    """Short name (``"a100-80gb"``, ``"cpu-calibrated"``)."""
    source: str
    """Where the numbers come from: ``"measured: ..."`` or ``"datasheet: ..."`` / ``"assumption: ..."``."""
    attention_curve: tuple[tuple[int, float], ...]
    """``(block tokens, attention fwd+bwd FLOP/s)`` points, block ascending; log-linear in between,
    flat outside."""
    matmul_flops: float
    """Sustained dense matmul FLOP/s for the linear layers (transformer-layer predictions)."""
    intra_bandwidth: float
    """Bytes/s one rank sends to a peer on its own node."""
    intra_latency: float
    """Seconds per message between ranks of one node."""
    inter_bandwidth: float
    """Bytes/s one rank sends off its node (its share of the node's network)."""
    inter_latency: float
    """Seconds per message between nodes."""
    ranks_per_node: int
    """Ranks (devices) per node."""
    compute_slots: int | None = None
    """Ranks of one node that can compute at the same time (CPU cores); ``None``: one device each."""
    memory_bytes: float | None = None
    """Device memory per rank (max-context predictions)."""
    # Calibrated per-call terms (Note [Per-call terms]); empty / 0 for the GPU presets (not measured).
    kernel_table: tuple[tuple[str, int, int, int, float, float], ...] = ()
    """``(kind, head_dim, q_len, k_len, fwd_s, bwd_s)``: one kernel call's time per query head, the fixed
    ``kernel_call_s`` removed (measured: ``experiments/cost_model/calibrate.py``); log-linear in between,
    time per element constant outside. Empty: ``attention_curve``."""
    kernel_call_s: tuple[float, float] = (0.0, 0.0)
    """Fixed time of one kernel forward / backward call (a tiny call)."""
    merge_s: tuple[float, float] = (0.0, 0.0)
    """``merge_into``: ``(seconds per call, seconds per element)``."""
    elementwise_s: tuple[float, float] = (0.0, 0.0)
    """An in-place ``+=`` or copy outside the kernel: ``(seconds per call, seconds per element)``."""
    message_s: tuple[tuple[int, float], ...] = ()
    """``(world, seconds)``: one ring exchange of a tiny tensor on ``world`` ranks (Python, gloo
    latency, the wait); empty: ``intra_latency``/``inter_latency``."""
    compute_sharing: tuple[tuple[int, float], ...] = ()
    """``(world, stretch)``: how much slower one rank's kernel loop runs when ``world`` ranks run it at
    once on this machine (measured, Note [Cost model of one attention layer]); replaces the
    ``compute_slots`` rule when given."""
    colossal_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """``colossal``'s materialised score path on one rank: ``a + E (b + c D)`` seconds fwd+bwd for ``E``
    score elements (``H x rows x keys``); all 0: its matmuls at ``matmul_flops`` instead."""
    colossal_table: tuple[tuple[int, int, float], ...] = ()
    """``(score elements of the rank, head_dim, seconds per score element)``: ``colossal``'s local
    compute (fwd+bwd) measured at several sizes, interpolated log-linearly in the rank's score elements
    ``H x S/P x N`` and in D (clamped outside); replaces ``colossal_s`` when given. Per element, the
    time grows once the ``[H, S/P, N]`` rows leave the caches, which one line cannot follow."""
    collective_fits: tuple[tuple[str, int, float, float], ...] = ()
    """``(op, group size, latency s, bandwidth B/s)`` measured for ``"all_to_all"`` (bytes of the send
    buffer) and ``"all_gather"`` (bytes of one rank's input); empty: the link model."""
    collective_busy_s: tuple[tuple[str, int, float], ...] = ()
    """``(op, group size, seconds)``: the fixed cost of one tiny ``"all_to_all"`` / ``"all_gather"`` with
    every rank computing between collectives (measured: ``calibrate.busy_worker``); replaces the
    ``collective_fits`` latency (measured on idle ranks) when given."""
    layer_latency_s: tuple[tuple[str, int, float], ...] = ()
    """``(backend, world, seconds)``: one layer call's fwd+bwd time beyond the other terms, measured with the
    kernel stubbed out at a tiny shape (Note [Per-call terms]); spread over the layer's steps on each rank's path."""
    sync_delay_s: tuple[tuple[int, float], ...] = ()
    """``(world, seconds)``: how far a step timed in rounds sits, at its median round, above its fastest, per
    synchronisation that ends a stretch of compute (measured: ``calibrate.measure_sync_delay``; Note [Per-call
    terms]); added once per such synchronisation on the layer's path. Empty: none."""

    score_mod_factors: tuple[tuple[str, str, int, int, float, float], ...] = ()
    """``(modifier, kind, head_dim, side, fwd factor, bwd factor)``: a call with score modifiers over the plain call
    (Note [Cost model of score modifiers]); ``modifier`` one of ``SCORE_MOD_ROWS``. Empty: priced as the plain call."""
    sinks_s: tuple[tuple[int, float], ...] = ()
    """``(output elements, seconds)``: attention sinks fwd+bwd on one rank over that many output elements
    (``absorb_sinks`` + ``sink_grad``); per element log-linear in between, constant outside. Empty: not priced."""

    def __post_init__(self) -> None:
        if not self.attention_curve:
            raise ValueError("attention_curve needs at least one (block tokens, FLOP/s) point")
        blocks = [b for b, _ in self.attention_curve]
        if blocks != sorted(blocks) or any(b <= 0 or r <= 0 for b, r in self.attention_curve):
            raise ValueError(f"attention_curve must have positive, ascending blocks and rates, got {self.attention_curve}")
        for name in ("matmul_flops", "intra_bandwidth", "inter_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.intra_latency < 0 or self.inter_latency < 0:
            raise ValueError("latencies must be >= 0")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.compute_slots is not None and self.compute_slots < 1:
            raise ValueError(f"compute_slots must be >= 1 or None, got {self.compute_slots}")

    def attention_rate(self, block_tokens: float) -> float:
        """Attention fwd+bwd FLOP/s of one kernel call on ``block_tokens`` query tokens."""
        pts = self.attention_curve
        if block_tokens <= pts[0][0]:
            return pts[0][1]
        if block_tokens >= pts[-1][0]:
            return pts[-1][1]
        for (b0, r0), (b1, r1) in zip(pts, pts[1:]):
            if b0 <= block_tokens <= b1:
                w = math.log(block_tokens / b0) / math.log(b1 / b0)
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
        raise AssertionError("unreachable")

    def compute_stretch(self, world: int) -> float:
        """How much slower each rank computes because ranks of a node share ``compute_slots``."""
        if self.compute_slots is None:
            return 1.0
        on_node = min(world, self.ranks_per_node)
        return max(1.0, on_node / self.compute_slots)

    def link(self, ranks: int, stride: int = 1) -> tuple[float, float]:
        """``(bandwidth, latency)`` of the slowest hop among ``ranks`` ranks ``stride`` apart."""
        if ranks <= 1 or (ranks - 1) * stride + 1 <= self.ranks_per_node:  # consecutive ranks share a node
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        d = dict(d)
        d["attention_curve"] = tuple((int(b), float(r)) for b, r in d["attention_curve"])
        d["kernel_table"] = tuple((str(k), int(dd), int(q), int(kl), float(f), float(b))
                                  for k, dd, q, kl, f, b in d.get("kernel_table", ()))
        for name in ("kernel_call_s", "merge_s", "elementwise_s"):
            d[name] = tuple(float(x) for x in d.get(name, (0.0, 0.0)))
        d["message_s"] = tuple((int(w), float(t)) for w, t in d.get("message_s", ()))
        d["colossal_s"] = tuple(float(x) for x in d.get("colossal_s", (0.0, 0.0, 0.0)))
        d["colossal_table"] = tuple((int(e), int(dd), float(t)) for e, dd, t in d.get("colossal_table", ()))
        d["compute_sharing"] = tuple((int(w), float(x)) for w, x in d.get("compute_sharing", ()))
        d["collective_fits"] = tuple((str(o), int(g), float(la), float(bw)) for o, g, la, bw in d.get("collective_fits", ()))
        d["collective_busy_s"] = tuple((str(o), int(g), float(t)) for o, g, t in d.get("collective_busy_s", ()))
        d["layer_latency_s"] = tuple((str(b), int(w), float(t)) for b, w, t in d.get("layer_latency_s", ()))
        d["sync_delay_s"] = tuple((int(w), float(t)) for w, t in d.get("sync_delay_s", ()))
        d["score_mod_factors"] = tuple((str(m), str(k), int(dd), int(sd), float(f), float(b))
                                       for m, k, dd, sd, f, b in d.get("score_mod_factors", ()))
        d["sinks_s"] = tuple((int(e), float(t)) for e, t in d.get("sinks_s", ()))
        return cls(**d)

    def score_mod_factor(self, mods: tuple[str, ...], kind: str, head_dim: int, q_len: int, k_len: int,
                         backward: bool) -> float:
        """How much longer a ``kind`` call of ``q_len x k_len`` runs with the score modifiers ``mods``
        (``score_mod_names``) than without (Note [Cost model of score modifiers]); 1 without ``mods`` or rows."""
        if not mods or not self.score_mod_factors:
            return 1.0
        side = (q_len * k_len) ** 0.5
        base = self._score_mod_row(SCORE_MOD_ROWS[0], kind, head_dim, side, backward) or 1.0
        extra = 0.0
        for m in dict.fromkeys(mods):
            f = self._score_mod_row(m, kind, head_dim, side, backward) if m in SCORE_MOD_ROWS[1:] else None
            extra += 0.0 if f is None else max(0.0, f - base)
        return base + extra

    def _score_mod_row(self, modifier: str, kind: str, head_dim: int, side: float, backward: bool) -> float | None:
        """``modifier``'s factor at ``side`` and ``head_dim`` from ``score_mod_factors`` (``None``: no rows)."""
        rows = [r for r in self.score_mod_factors if r[0] == modifier]
        kind = "causal" if kind == "causal" else "full"
        rows = [r for r in rows if r[1] == kind] or [r for r in rows if r[1] == "full"] or rows
        if not rows:
            return None
        col = 5 if backward else 4
        dims = sorted({r[2] for r in rows})
        per_dim = []
        for dd in dims:
            pts = sorted((r[3], r[col]) for r in rows if r[2] == dd)
            per_dim.append(_interp(side, [x for x, _ in pts], [y for _, y in pts]))
        return _interp(head_dim, dims, per_dim)

    def sinks_time(self, elements: float) -> float:
        """Seconds fwd+bwd of attention sinks over ``elements`` output elements on one rank (``sinks_s``)."""
        if not self.sinks_s or elements <= 0:
            return 0.0
        pts = sorted(self.sinks_s)
        return _interp(elements, [e for e, _ in pts], [t / e for e, t in pts]) * elements

    def kernel_time(self, call, head_dim: int) -> float:
        """Seconds of one kernel call (``ops.schedule.KernelCall``) on one rank, unshared."""
        fixed = self.kernel_call_s[1 if call.backward else 0]
        if self.kernel_table:
            return fixed + call.heads * _table_lookup(self.kernel_table, call.kind, head_dim, call.q_len, call.k_len,
                                                      call.backward)
        share = 0.5 if call.kind == "causal" else 1.0
        flops = 4.0 * call.q_len * call.k_len * call.heads * head_dim * share * FWD_BWD_FACTOR
        part = (FWD_BWD_FACTOR - 1) / FWD_BWD_FACTOR if call.backward else 1 / FWD_BWD_FACTOR
        return fixed + flops * part / self.attention_rate(call.q_len)

    def colossal_seconds_per_score(self, rank_scores: float, head_dim: int) -> float:
        """Seconds per score element of ``colossal``'s local fwd+bwd on a rank holding ``rank_scores``
        score elements (``colossal_table``; requires it)."""
        dims = sorted({dd for _, dd, _ in self.colossal_table})
        per_dim = []
        for dd in dims:
            pts = sorted((e, t) for e, d2, t in self.colossal_table if d2 == dd)
            per_dim.append(_interp(rank_scores, [e for e, _ in pts], [t for _, t in pts]))
        return _interp(head_dim, dims, per_dim)

    def message_time(self, world: int) -> float:
        """Fixed seconds of one ring exchange among ``world`` ranks (calibrated at the nearest world)."""
        if not self.message_s:
            return self.link(world)[1]
        return min(self.message_s, key=lambda wt: (abs(math.log(wt[0] / world)), wt[0]))[1]

    def sync_delay(self, world: int) -> float:
        """``sync_delay_s`` at the nearest calibrated world (0 where it was not measured, and on one rank)."""
        if not self.sync_delay_s or world <= 1:
            return 0.0
        return min(self.sync_delay_s, key=lambda wt: (abs(math.log(wt[0] / world)), wt[0]))[1]

    def layer_latency(self, backend: str, world: int) -> float:
        """``layer_latency_s`` of ``backend`` at the nearest calibrated world (0 where it was not measured)."""
        rows = [(w, t) for b, w, t in self.layer_latency_s if b == backend]
        if not rows or world <= 1:
            return 0.0
        return min(rows, key=lambda wt: (abs(math.log(wt[0] / world)), wt[0]))[1]

    def collective_time(self, op: str, nbytes: float, group: int) -> float:
        """One ``all_to_all`` (``nbytes``: this rank's send buffer) or ``all_gather`` (``nbytes``: this
        rank's input) over ``group`` consecutive ranks."""
        if group <= 1:
            return 0.0
        fits = [f for f in self.collective_fits if f[0] == op]
        if fits:
            _, _, lat, bw = min(fits, key=lambda f: (abs(math.log(f[1] / group)), f[1]))
            busy = [f for f in self.collective_busy_s if f[0] == op]
            if busy:  # the fixed cost as the layer sees it: ranks computing, not idle, between collectives
                lat = min(busy, key=lambda f: (abs(math.log(f[1] / group)), f[1]))[2]
            return lat + nbytes / bw
        if op == "all_to_all":
            return _all_to_all_time(nbytes, group, self)
        bw, lat = self.link(group)
        return (group - 1) * (lat + nbytes / bw)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Log-linear interpolation of ``ys`` over ascending ``xs`` (clamped outside)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = next(i for i in range(1, len(xs)) if xs[i] >= x)
    w = math.log(x / xs[i - 1]) / math.log(xs[i] / xs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


# Note [Kernel table below the smallest head dim]
#     A kernel call's time is not proportional to D at small D: the softmax's exp, max and rescale cost per score
#     (query x key), the two products per score x D, and the CPU flash kernel vectorises D in fixed-width blocks.
#     Measured on the 2-core VM (2026-11-28, 1024^2 and 2048^2 calls, full and causal): D = 16 costs 0.64-0.67 of
#     D = 32, and D = 8 0.94-1.06 of it, not 0.5 and 0.25. A table measured at the model's D answers exactly (the
#     planner's CPU calibration measures D = 8 and 16, ``experiments/planner/run.py --calibrate-kernel``). Below a
#     table's smallest D the time per score element is the line in D through its two smallest dims (a per-score part
#     plus a per-score-and-dim part: 0.61-0.64 of D = 32 at D = 16 from the cost model's 32/64 points), held between
#     the old proportional charge (a lower bound) and the smallest D's own time per score (an upper bound: the line is
#     an extrapolation, so a smaller D is never priced above a measured one).


def _table_lookup(table, kind: str, head_dim: int, q_len: int, k_len: int, backward: bool) -> float:
    """Seconds per head of a ``kind`` call of ``q_len x k_len`` at ``head_dim`` from the calibrated
    table: seconds per (query x key x dim) element interpolated log-linearly in q, k and D, times the
    call's elements; below the table's smallest D, Note [Kernel table below the smallest head dim].
    ``"dense"`` calls (never planned) count as ``"full"``."""
    kind = "causal" if kind == "causal" else "full"
    col = 5 if backward else 4
    rows = [r for r in table if r[0] == kind] or [r for r in table if r[0] == "full"]
    dims = sorted({r[1] for r in rows})
    per_dim = []
    for dd in dims:
        pts = {(r[2], r[3]): r[col] / (r[2] * r[3] * dd) for r in rows if r[1] == dd}
        if kind == "causal" and all(q == k for q, k in pts):  # squares only: by side
            sides = sorted(q for q, _ in pts)
            per_dim.append(_interp((q_len * k_len) ** 0.5, sides, [pts[(x, x)] for x in sides]))
            continue
        qs, ks = sorted({q for q, _ in pts}), sorted({k for _, k in pts})
        per_dim.append(_interp(q_len, qs, [_interp(k_len, ks, [pts[(q, k)] for k in ks]) for q in qs]))
    if head_dim < dims[0] and len(dims) > 1:  # Note [Kernel table below the smallest head dim]
        per_score = [rate * dd for rate, dd in zip(per_dim[:2], dims[:2])]  # seconds per query x key element
        line = per_score[0] - (per_score[1] - per_score[0]) / (dims[1] - dims[0]) * (dims[0] - head_dim)
        return min(max(line, per_dim[0] * head_dim), per_score[0]) * q_len * k_len
    return _interp(head_dim, dims, per_dim) * q_len * k_len * head_dim


def saturating_curve(peak: float, efficiency: float, half_block: int, blocks=(128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)):
    """``rate(c) = peak * efficiency * c / (c + half_block)``: a kernel that needs blocks of a few
    ``half_block`` tokens to fill the device (an assumption for GPUs, where we measured nothing)."""
    return tuple((b, peak * efficiency * b / (b + half_block)) for b in blocks)


# GPU presets. Peaks and link speeds are datasheet figures; the efficiencies are assumptions taken from
# papers (cited), since no GPU was measured here. Model output from them is labelled as such.
_A100_PEAK = 312e12  # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16 tensor core
_H100_PEAK = 989e12  # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16
PRESETS: dict[str, HardwareProfile] = {
    "a100-80gb": HardwareProfile(
        name="a100-80gb",
        source=("datasheet: A100 SXM 312 TFLOP/s bf16, NVLink3 600 GB/s total (300 GB/s per direction), "
                "80 GB; DGX A100: 8 GPUs/node, 8x HDR 200 Gb/s (25 GB/s per GPU). assumption: attention "
                "fwd+bwd reaches 60% of peak on large blocks (FlashAttention-2, arXiv 2307.08691: 50-73%), "
                "half of that at 1K-token blocks; matmuls 75% of peak; latency 10 us NVLink, 20 us IB"),
        attention_curve=saturating_curve(_A100_PEAK, 0.60, 1024),
        matmul_flops=0.75 * _A100_PEAK,
        intra_bandwidth=300e9, intra_latency=10e-6,
        inter_bandwidth=25e9, inter_latency=20e-6,
        ranks_per_node=8, memory_bytes=80e9,
    ),
    "h100-80gb": HardwareProfile(
        name="h100-80gb",
        source=("datasheet: H100 SXM 989 TFLOP/s bf16 dense, NVLink4 900 GB/s total (450 per direction), "
                "80 GB; DGX H100: 8 GPUs/node, 8x NDR 400 Gb/s (50 GB/s per GPU). assumption: attention "
                "fwd+bwd at 55% of peak on large blocks (FlashAttention-3, arXiv 2407.08608: up to 75% fwd), "
                "half of that at 2K-token blocks; matmuls 70% of peak; latency 10 us NVLink, 20 us IB"),
        attention_curve=saturating_curve(_H100_PEAK, 0.55, 2048),
        matmul_flops=0.70 * _H100_PEAK,
        intra_bandwidth=450e9, intra_latency=10e-6,
        inter_bandwidth=50e9, inter_latency=20e-6,
        ranks_per_node=8, memory_bytes=80e9,
    ),
    "h800-80gb": HardwareProfile(
        name="h800-80gb",
        source=("datasheet: H800 SXM = H100 SXM compute (989 TFLOP/s bf16 dense) with NVLink 400 GB/s total "
                "(200 per direction), 80 GB; 8 GPUs/node. assumption: as h100-80gb (attention 55% of peak, "
                "half at 2K-token blocks; matmuls 70%; 10 us NVLink, 20 us IB)"),
        attention_curve=saturating_curve(_H100_PEAK, 0.55, 2048),
        matmul_flops=0.70 * _H100_PEAK,
        intra_bandwidth=200e9, intra_latency=10e-6,
        inter_bandwidth=50e9, inter_latency=20e-6,
        ranks_per_node=8, memory_bytes=80e9,
    ),
    "cpu-default": HardwareProfile(
        name="cpu-default",
        source=("assumption (uncalibrated): one core per rank, ~20 GFLOP/s attention on large blocks, "
                "loopback 2 GB/s and 50 us per message; run experiments/cost_model/run.py to calibrate"),
        attention_curve=((64, 5e9), (256, 12e9), (1024, 20e9)),
        matmul_flops=40e9,
        intra_bandwidth=2e9, intra_latency=50e-6, inter_bandwidth=2e9, inter_latency=50e-6,
        ranks_per_node=1 << 16, compute_slots=None,
    ),
}


def assumed_cuda_score_mod_factors(hw: HardwareProfile, *, fp32_flops: float, memory_bandwidth: float,
                                   dims=(64, 128), sides=(1024, 8192)) -> tuple:
    """``score_mod_factors`` for a GPU where none was measured (an assumption, Note [Cost model of score modifiers]):
    ``ScoreModKernel`` on CUDA runs ``128 x 512`` tiles in the accumulation dtype (fp32): its matmuls (4 D FLOPs per
    pair forward, 10 D backward) at half the datasheet's fp32 CUDA-core rate ``fp32_flops`` (not the tensor cores),
    its score passes (about 40 bytes per pair forward, 80 backward: scale, exp, log-sum-exp, the modifiers, the
    gradient's passes) at ``memory_bandwidth``; over the plain call at the preset's flash-style rate. One
    ``blockwise`` row per (D, side): every modifier is priced as the path alone (their passes are in the 40/80 bytes)."""
    rows = []
    for d in dims:
        for side in sides:
            rate = hw.attention_rate(side)  # plain fwd+bwd FLOP/s: 4 D FLOPs a pair forward, 10 D backward
            fwd = (4 * d / (0.5 * fp32_flops) + 40 / memory_bandwidth) / (4 * d / rate)
            bwd = (10 * d / (0.5 * fp32_flops) + 80 / memory_bandwidth) / (10 * d / rate)
            rows.append(("blockwise", "full", d, side, fwd, bwd))
    return tuple(rows)


def with_assumed_cuda_score_mods(hw: HardwareProfile, *, fp32_flops: float, memory_bandwidth: float) -> HardwareProfile:
    """``hw`` with ``assumed_cuda_score_mod_factors`` and sinks at four fp32 passes over the output (32 bytes per
    element) at ``memory_bandwidth``, the assumption named in its ``source``."""
    return replace(hw, score_mod_factors=assumed_cuda_score_mod_factors(hw, fp32_flops=fp32_flops,
                                                                        memory_bandwidth=memory_bandwidth),
                   sinks_s=((1 << 20, (1 << 20) * 32 / memory_bandwidth),),
                   source=hw.source + (f"; score modifiers: assumption (ScoreModKernel's fp32 tiles at half of "
                                       f"{fp32_flops / 1e12:g} TFLOP/s fp32 and {memory_bandwidth / 1e12:g} TB/s; "
                                       f"not measured)"))


_CUDA_FP32 = {  # datasheets: fp32 (CUDA cores) FLOP/s and HBM bytes/s
    "a100-80gb": (19.5e12, 2.039e12),  # A100 SXM 80 GB
    "h100-80gb": (67e12, 3.35e12),  # H100 SXM
    "h800-80gb": (67e12, 3.35e12),  # H800 SXM: H100 SXM compute and memory
}
for _name, (_fp32, _hbm) in _CUDA_FP32.items():
    PRESETS[_name] = with_assumed_cuda_score_mods(PRESETS[_name], fp32_flops=_fp32, memory_bandwidth=_hbm)

# measured on the development VM (``experiments/cost_model/score_mods.py --part calibrate``, 2026-11-28,
# ``results/score_mods_calibration.json``): the uncalibrated CPU profile borrows them
_CPU_SCORE_MOD_FACTORS = (
    # (modifier, kind, D, side, fwd, bwd) rounded to 2 digits
    ("blockwise", "full", 32, 128, 3.27, 2.44), ("softcap", "full", 32, 128, 4.38, 3.34),
    ("alibi", "full", 32, 128, 3.92, 2.84), ("relative_bias", "full", 32, 128, 7.49, 5.47),
    ("blockwise", "causal", 32, 128, 4.66, 2.95), ("softcap", "causal", 32, 128, 5.78, 3.84),
    ("alibi", "causal", 32, 128, 5.35, 3.59), ("relative_bias", "causal", 32, 128, 8.54, 5.82),
    ("blockwise", "full", 32, 512, 2.70, 1.88), ("softcap", "full", 32, 512, 4.42, 3.18),
    ("alibi", "full", 32, 512, 3.28, 2.48), ("relative_bias", "full", 32, 512, 7.72, 5.23),
    ("blockwise", "causal", 32, 512, 4.79, 2.45), ("softcap", "causal", 32, 512, 6.56, 3.74),
    ("alibi", "causal", 32, 512, 5.23, 2.71), ("relative_bias", "causal", 32, 512, 10.12, 6.95),
    ("blockwise", "full", 32, 2048, 3.17, 2.39), ("softcap", "full", 32, 2048, 5.91, 2.95),
    ("alibi", "full", 32, 2048, 3.39, 2.47), ("relative_bias", "full", 32, 2048, 7.57, 6.40),
    ("blockwise", "causal", 32, 2048, 4.65, 2.31), ("softcap", "causal", 32, 2048, 6.11, 3.25),
    ("alibi", "causal", 32, 2048, 5.01, 2.95), ("relative_bias", "causal", 32, 2048, 9.80, 5.69),
    ("blockwise", "full", 128, 128, 1.90, 1.61), ("softcap", "full", 128, 128, 2.54, 1.94),
    ("alibi", "full", 128, 128, 2.21, 1.80), ("relative_bias", "full", 128, 128, 3.54, 2.58),
    ("blockwise", "causal", 128, 128, 2.45, 1.78), ("softcap", "causal", 128, 128, 3.08, 2.18),
    ("alibi", "causal", 128, 128, 2.84, 1.92), ("relative_bias", "causal", 128, 128, 4.26, 2.97),
    ("blockwise", "full", 128, 512, 1.71, 1.48), ("softcap", "full", 128, 512, 2.13, 1.83),
    ("alibi", "full", 128, 512, 2.06, 1.67), ("relative_bias", "full", 128, 512, 3.17, 2.50),
    ("blockwise", "causal", 128, 512, 2.15, 1.56), ("softcap", "causal", 128, 512, 2.64, 1.90),
    ("alibi", "causal", 128, 512, 2.36, 1.66), ("relative_bias", "causal", 128, 512, 3.71, 2.45),
    ("blockwise", "full", 128, 2048, 1.74, 1.42), ("softcap", "full", 128, 2048, 2.29, 1.80),
    ("alibi", "full", 128, 2048, 2.13, 1.69), ("relative_bias", "full", 128, 2048, 3.36, 2.58),
    ("blockwise", "causal", 128, 2048, 2.21, 1.66), ("softcap", "causal", 128, 2048, 2.74, 2.19),
    ("alibi", "causal", 128, 2048, 2.34, 1.82), ("relative_bias", "causal", 128, 2048, 3.92, 2.68),
)
PRESETS["cpu-default"] = replace(
    PRESETS["cpu-default"], score_mod_factors=_CPU_SCORE_MOD_FACTORS,
    sinks_s=((32768, 8.41e-05), (262144, 0.000199), (524288, 0.000401), (1048576, 0.000881), (8388608, 0.0412)),
    source=PRESETS["cpu-default"].source + "; score modifiers and sinks: measured on the development VM "
    "(experiments/cost_model/results/score_mods_calibration.json, 2026-11-28)")


def preset(name: str) -> HardwareProfile:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of {sorted(PRESETS)} or build a HardwareProfile")
    return PRESETS[name]


def default_profile(device_type: str = "cpu", device_name: str | None = None, ranks_per_node: int | None = None) -> HardwareProfile:
    """The profile ``backend="auto"`` uses when none is bound: a GPU preset matched by name, else the
    uncalibrated CPU one; ``ranks_per_node`` (the topology the strategy knows) replaces the preset's."""
    hw = PRESETS["cpu-default"]
    if device_type == "cuda":
        name = (device_name or "").lower()
        hw = PRESETS["h100-80gb"] if ("h100" in name or "h200" in name) else PRESETS["a100-80gb"]
    return replace(hw, ranks_per_node=ranks_per_node) if ranks_per_node else hw


@dataclass(kw_only=True, frozen=True)
class AttentionShape:
    """One attention layer's global problem."""

    seq_len: int
    """Global tokens ``N`` per sequence."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int = 1
    dtype_bytes: int = 2
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_heads", "num_kv_heads", "head_dim", "batch", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    def fwd_flops(self, n_q: float, n_k: float, heads: float) -> float:
        """Forward FLOPs of ``n_q`` queries against ``n_k`` keys on ``heads`` heads (no causal skipping)."""
        return 4.0 * self.batch * n_q * n_k * heads * self.head_dim


@dataclass(kw_only=True)
class Prediction:
    """Model output for one attention layer fwd+bwd on one rank (seconds, bytes)."""

    backend: str
    world: int
    ulysses_degree: int | None
    compute_s: float
    comm_s: float
    """Time the link is busy (fwd+bwd)."""
    exposed_comm_s: float
    """The part of ``comm_s`` not hidden behind compute."""
    total_s: float
    comm_bytes: float
    """Bytes sent per rank, fwd+bwd, on the modelled rank that sends most: counted from its schedule as
    ``CommStats`` counts them (``rank_counts``; dK/dV sums in the accumulation dtype); ``megatron_sp``: its
    closed form."""
    activation_bytes: float
    """Per-rank activation memory of one transformer layer with this attention (Note above)."""
    notes: str = ""
    attention_pairs: float = 0.0
    """Query-key pairs the forward's kernel calls compute on the most loaded modelled rank, over its query heads
    and the batch (``RankCounts.pairs``); 0 where not counted (``colossal``: every score)."""
    score_mods: tuple[str, ...] = ()
    """The score modifiers its kernel calls ran with (``score_mod_names``): ``()``, the plain kernel; else the
    score-modifying kernel (Note [Cost model of score modifiers])."""
    sinks: bool = False
    """Whether the sinks' per-row term was priced."""
    layout: str = ""
    """The ``SequenceLayout`` it was priced on when one was given (``str(layout)``, e.g. ``"chunks(0 1 1 0 1 0)"``);
    ``""``: the backend's own."""

    @property
    def kernel_path(self) -> str:
        """``"plain"`` or ``"score_mods(softcap+alibi)"``, ``" + sinks"`` with sinks: what the calls run."""
        path = f"score_mods({'+'.join(self.score_mods)})" if self.score_mods else "plain"
        return path + (" + sinks" if self.sinks else "")

    @property
    def label(self) -> str:
        return f"usp(ulysses={self.ulysses_degree})" if self.backend == "usp" else self.backend


def _ring_time(steps: int, compute_per_step: float, transfer: float, *, fwd_share: float) -> tuple[float, float]:
    """``(total, exposed comm)`` of a ring of ``steps`` ranks: fwd steps ``max(c, t)`` (last step: c
    only); bwd steps ``max(c, t) + t`` (K/V overlapped, dK/dV partial sums not)."""
    c_f, c_b = compute_per_step * fwd_share, compute_per_step * (1 - fwd_share)
    if steps <= 1:
        return compute_per_step, 0.0
    fwd = (steps - 1) * max(c_f, transfer) + c_f
    bwd = (steps - 1) * (max(c_b, transfer) + transfer) + c_b
    total = fwd + bwd
    return total, total - steps * compute_per_step


def _all_to_all_time(nbytes: float, ranks: int, hw: HardwareProfile) -> float:
    """One all-to-all over ``ranks`` consecutive ranks sending ``nbytes`` per rank in all."""
    if ranks <= 1:
        return 0.0
    n = min(ranks, hw.ranks_per_node)
    on_node = nbytes * (n - 1) / (ranks - 1)
    off_node = nbytes - on_node
    lat = hw.intra_latency if ranks <= hw.ranks_per_node else hw.inter_latency
    return (ranks - 1) * lat + max(on_node / hw.intra_bandwidth, off_node / hw.inter_bandwidth)


def activation_bytes_per_layer(shape: AttentionShape, backend: str, world: int, *, bytes_per_value: int | None = None) -> float:
    """Per-rank activations of one transformer layer (Korthikanti et al. Sec. 4, 16-bit; the ``34``
    term scales with the element size), flash-style attention except ``colossal``; see the Note."""
    s, b, a, d = shape.seq_len, shape.batch, shape.num_heads, shape.head_dim
    h = a * d
    scale = (bytes_per_value or shape.dtype_bytes) / 2
    scores = 5 * a * s / h if backend == "colossal" else 4 * a / h
    return s * b * h * (34 * scale + scores) / world


def attention_transient_bytes(backend: str, shape: AttentionShape, world: int, *,
                              ulysses_degree: int | None = None) -> float:
    """Per-rank bytes of the buffers ``backend`` holds during one attention call beyond the layer's stored
    activations: the rings' K/V blocks in flight, all-gather's whole K/V, Ulysses' gathered heads, Megatron's
    gathered layer input. ``ulysses_degree``: ``usp``'s inner degree."""
    p, n, h, hkv, d = world, shape.seq_len, shape.num_heads, shape.num_kv_heads, shape.head_dim
    eb = shape.dtype_bytes * shape.batch
    if p == 1:
        return 0.0
    if backend == "ulysses":
        return 3 * n / p * (h + 2 * replicated_kv_heads(h, hkv, p)) * d * eb
    if backend in ("ring", "zigzag_ring"):
        return 4 * n / p * hkv * d * eb
    if backend == "allgather_kv":
        return 2 * n * hkv * d * eb
    if backend == "usp":
        u = ulysses_degree
        h_kv = replicated_kv_heads(h, hkv, u)
        return 3 * n / p * (h + 2 * h_kv) * d * eb + 4 * (n / (p // u)) * (h_kv / u) * d * eb
    if backend == "colossal":
        return 2 * n / p * hkv * d * eb
    if backend == "megatron_sp":
        return n * h * d * eb  # the gathered layer input
    raise ValueError(f"backend must be one of {MODEL_BACKENDS}, got {backend!r}")


def predict_attention(backend: str, shape: AttentionShape, world: int, hw: HardwareProfile, *,
                      ulysses_degree: int | None = None, kv_pieces: int = 1, mask: "AttentionMask | None" = None,
                      cu_seqlens=None, sinks: bool = False, layout=None) -> Prediction:
    """Model fwd+bwd time of one attention layer on one of ``world`` ranks (Note [Cost model of one
    attention layer]). ``ulysses_degree``: ``usp``'s inner degree (required for ``usp``);
    ``kv_pieces``: as ``SequenceParallelAttention(kv_pieces=)``, resolved to an int. ``mask`` (an
    ``AttentionMask``) and ``cu_seqlens`` (packed documents' global bounds ``[0, ..., seq_len]``): priced as the
    backends run them (Note [Cost model under a mask]); its score modifiers and ``sinks`` (gpt-oss's per-head sink
    logits) as Note [Cost model of score modifiers]. ``layout``: a ``SequenceLayout`` (e.g.
    ``SequenceLayout.balanced_for``) the backend runs on, as ``SequenceParallelAttention(layout=)``, for ``ring``,
    ``zigzag_ring``, ``allgather_kv`` and ``usp`` (Note [Cost model on a given layout]); ``None``: the backend's
    own."""
    if backend not in MODEL_BACKENDS:
        raise ValueError(f"backend must be one of {MODEL_BACKENDS}, got {backend!r}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    layout = checked_layout(backend, world, ulysses_degree, layout)
    p, n, h, hkv, d = world, shape.seq_len, shape.num_heads, shape.num_kv_heads, shape.head_dim
    eb = shape.dtype_bytes * shape.batch
    u = None
    notes = ""
    masking = dict(mask=mask, cu_seqlens=None if cu_seqlens is None else tuple(int(b) for b in cu_seqlens))
    path = dict(score_mods=score_mod_names(mask), sinks=bool(sinks))
    if p == 1:
        total, compute, comm = _schedule_time("local", shape, 1, hw, None, kv_pieces, sinks=sinks, **masking)
        pairs = max(c.pairs for c in rank_counts("local", shape, 1, **masking))
        return Prediction(backend=backend, world=1, ulysses_degree=None, compute_s=compute, comm_s=0.0, exposed_comm_s=0.0,
                          total_s=total, comm_bytes=0.0, activation_bytes=activation_bytes_per_layer(shape, backend, 1),
                          attention_pairs=pairs, **path)
    if backend in ("ulysses", "megatron_sp") and h % p:
        what = "world" if backend == "ulysses" else "the TP degree"
        raise ValueError(f"{backend} needs num_heads ({h}) divisible by {what} ({p})")
    if backend == "usp":
        u = ulysses_degree
        if u is None or p % u or not 1 <= u <= p:
            raise ValueError(f"usp needs ulysses_degree dividing world={p}, got {u}")
        if h % u:
            raise ValueError(f"usp needs num_heads ({h}) divisible by ulysses_degree ({u})")
        notes = f"U={u} x R={p // u}"
    pairs = 0.0
    if backend != "megatron_sp":
        total, compute, comm = _schedule_time(backend, shape, p, hw, u, kv_pieces, sinks=sinks, layout=layout,
                                              **masking)
        exposed = total - compute
        counts = rank_counts(backend, shape, p, ulysses_degree=u, kv_pieces=kv_pieces, layout=layout, **masking)
        comm_bytes = max(sum(c.bytes_by_op.values()) for c in counts)  # counted (Note [Cost model under a mask])
        pairs = 0.0 if backend == "colossal" else max(c.pairs for c in counts)  # colossal: every score
    else:  # megatron_sp: TP+SP over the same ranks, attention half of the layer
        local = replace(shape, num_heads=h // p, num_kv_heads=max(1, hkv // p))
        compute, _, _ = _schedule_time("local", local, 1, hw, None, 1, sinks=sinks, **masking)
        pairs = max(c.pairs for c in rank_counts("local", local, 1, **masking))
        compute *= hw.compute_stretch(p)
        hidden = h * d
        # all-gather of [N, h] before QKV and reduce-scatter after the projection, fwd and bwd
        bw, lat = hw.link(p)
        one = (p - 1) * (lat + n / p * hidden * eb / bw)
        comm = 4 * one
        total, exposed = compute + comm, comm
        comm_bytes = 4 * (p - 1) / p * n * hidden * eb
    act = activation_bytes_per_layer(shape, backend, p) + attention_transient_bytes(backend, shape, p, ulysses_degree=u)
    return Prediction(backend=backend, world=p, ulysses_degree=u, compute_s=compute, comm_s=comm,
                      exposed_comm_s=max(exposed, 0.0), total_s=total, comm_bytes=comm_bytes,
                      activation_bytes=act, notes=notes, attention_pairs=pairs,
                      layout="" if layout is None else str(layout), **path)


@dataclass(frozen=True)
class RankCounts:
    """What one rank's schedule (``ops.schedule.rank_schedule``) does for one layer fwd+bwd, in the units
    ``CommStats`` and a counting kernel see (model output: counted from the plans, not measured)."""

    rank: int
    pairs: float
    """Query-key pairs the forward's kernel calls compute, summed over the rank's query heads (a CAUSAL square of
    side ``s``: ``s (s + 1) / 2``; a DENSE tile: all of it, as the kernel computes it)."""
    bytes_by_op: dict[str, float]
    """Bytes this rank sends, fwd+bwd, by ``CommStats`` operation: ``ring_send`` (K/V, input dtype),
    ``ring_send_grad`` (dK/dV sums and contributions, accumulation dtype), ``all_to_all`` (send buffers),
    ``all_gather`` (``P - 1`` copies of the rank's input)."""
    score_mod_pairs: float = 0.0
    """Of ``pairs``, those the score-modifying kernel computes (all of them when the mask has score modifiers,
    Note [Cost model of score modifiers])."""


def rank_counts(backend: str, shape: AttentionShape, world: int, *, ulysses_degree: int | None = None,
                kv_pieces: int = 1, mask=None, cu_seqlens=None, ranks=None, layout=None) -> list[RankCounts]:
    """Pairs computed and bytes sent per rank (``ranks``; default ``_modelled_ranks``), counted from each rank's
    schedule under ``mask`` / ``cu_seqlens`` (Note [Cost model under a mask]) on ``layout`` (``None``: the
    backend's own; Note [Cost model on a given layout]), and which of the pairs run the score-modifying kernel
    (Note [Cost model of score modifiers])."""
    from lightning_sp.ops.schedule import rank_schedule  # here, not at import: ops loads torch

    layout = checked_layout(backend, world, ulysses_degree, layout)

    modified = bool(score_mod_names(mask))
    eb = shape.dtype_bytes * shape.batch
    acc_b = max(shape.dtype_bytes, 4) * shape.batch
    out = []
    for r in (_modelled_ranks(world) if ranks is None else ranks):
        s = rank_schedule(backend, seq_len=shape.seq_len, world=world, rank=r, heads=shape.num_heads,
                          kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, causal=shape.causal,
                          ulysses_degree=ulysses_degree, kv_pieces=kv_pieces, mask=mask, layout=layout,
                          doc_bounds=None if cu_seqlens is None else tuple(cu_seqlens))
        pairs = sum((c.q_len * (c.q_len + 1) / 2 if c.kind == "causal" else c.q_len * c.k_len) * c.heads
                    for c in s.calls() if not c.backward) * shape.batch
        sent = {"ring_send": 0.0, "ring_send_grad": 0.0, "all_to_all": 0.0, "all_gather": 0.0}
        for st in s.forward + s.backward:
            sent["ring_send"] += st.overlapped_send * eb
            sent["ring_send_grad"] += st.exposed_send_acc * acc_b
            if st.collective is not None:
                op, elems, group = st.collective
                sent[op] += elems * eb * (group - 1 if op == "all_gather" else 1)
        out.append(RankCounts(rank=r, pairs=pairs, bytes_by_op={k: v for k, v in sent.items() if v},
                              score_mod_pairs=pairs if modified else 0.0))
    return out


LAYOUT_BACKENDS = ("ring", "zigzag_ring", "allgather_kv", "usp")
"""Backends that run on any ``SequenceLayout`` given as ``SequenceParallelAttention(layout=)`` (their plans work on the
layout's runs of global positions), e.g. ``SequenceLayout.balanced_for`` for a prefix-LM span; priced on it here."""


def layout_backend_error(layout, backend: str) -> str:
    """The error for ``layout=`` given with a backend outside ``LAYOUT_BACKENDS``."""
    return (f"layout={layout} needs a backend that runs on any layout, one of {LAYOUT_BACKENDS}; backend {backend!r} "
            f"shards its own way: drop layout= or use one of those backends")


def checked_layout(backend: str, world: int, ulysses_degree: int | None, layout):
    """``layout`` as ``SequenceParallelAttention(layout=)`` takes it for ``backend`` on ``world`` ranks (Note [Cost
    model on a given layout]), with the module's errors: another backend, a Ulysses split other than the backend's,
    a chunk table for another group size. ``None`` (the backend's own) for ``None`` and on one rank."""
    if layout is None:
        return None
    from lightning_sp.layout import as_layout, padded_length  # here, not at import: layout loads torch

    layout = as_layout(layout)
    if backend not in LAYOUT_BACKENDS:
        raise ValueError(layout_backend_error(layout, backend))
    if world == 1:
        return None  # one rank attends over the whole sequence, as the module does
    u = (ulysses_degree or 1) if backend == "usp" else 1
    if layout.ulysses_degree != u:
        raise ValueError(
            f"layout {layout} splits each ring rank over ulysses_degree={layout.ulysses_degree} ranks, but backend "
            f"{backend!r} here runs " + (f"usp with ulysses_degree={u}" if backend == "usp" else
                                         "its ring over every rank (ulysses_degree=1)")
            + f": build the layout with ulysses_degree={u} (SequenceLayout.balanced_for(..., ulysses_degree={u}))")
    padded_length(1, world, layout)  # a chunk table for another group size raises, naming the fix
    return layout


def _modelled_ranks(world: int) -> list[int]:
    """Every rank up to 16; beyond, the first, second, middle and last (the backends' extremes)."""
    return list(range(world)) if world <= 16 else sorted({0, 1, world // 2, world - 1})


def _schedule_time(backend: str, shape: AttentionShape, world: int, hw: HardwareProfile, u: int | None,
                   kv_pieces: int, mask=None, cu_seqlens=None, sinks: bool = False,
                   layout=None) -> tuple[float, float, float]:
    """``(total, compute, link busy)`` seconds from the ranks' ``ops.schedule`` steps (Note [Per-call terms]) on
    ``layout`` (``None``: the backend's own; Note [Cost model on a given layout]); the calls under ``mask``'s score
    modifiers and the ``sinks`` priced as Note [Cost model of score modifiers]."""
    from lightning_sp.ops.schedule import rank_schedule  # here, not at import: ops loads torch (a light import)

    d, batch = shape.head_dim, shape.batch
    eb = shape.dtype_bytes * batch
    acc_b = max(shape.dtype_bytes, 4) * batch  # accumulation dtype: fp32 for half types
    slots = hw.compute_slots
    sharing = (min(hw.compute_sharing, key=lambda wx: (abs(math.log(wx[0] / world)), wx[0]))[1]
               if hw.compute_sharing and world > 1 else None)
    ring = world // u if backend == "usp" else world
    stride = u if backend == "usp" else 1
    bw, lat = hw.link(ring, stride=stride)
    msg = hw.message_time(world) if hw.message_s else 0.0
    overlapped_lat = 0.0 if hw.message_s else lat
    layout = checked_layout(backend, world, u, layout)
    scheds = [rank_schedule(backend, seq_len=shape.seq_len, world=world, rank=r, heads=shape.num_heads,
                            kv_heads=shape.num_kv_heads, head_dim=d, causal=shape.causal, ulysses_degree=u,
                            kv_pieces=kv_pieces, mask=mask, doc_bounds=cu_seqlens, layout=layout)
              for r in _modelled_ranks(world)]
    ew_call, ew_elem = hw.elementwise_s
    mg_call, mg_elem = hw.merge_s
    mods = score_mod_names(mask)  # every call of the layer runs the score-modifying kernel (or none does)
    # the sinks: each rank's output rows once, at the forward's end (Note [Cost model of score modifiers])
    sink_work = hw.sinks_time(batch * shape.seq_len / world * shape.num_heads * d) if sinks else 0.0

    def call_time(c) -> float:
        t = hw.kernel_call_s[c.backward] + batch * (hw.kernel_time(c, d) - hw.kernel_call_s[c.backward])
        return t * hw.score_mod_factor(mods, c.kind, d, c.q_len, c.k_len, c.backward) if mods else t

    def cpu(step) -> float:
        t = sum(call_time(c) for c in step.calls)
        t += sum(mg_call + mg_elem * e * batch for e in step.merges)
        t += sum(ew_call + ew_elem * e * batch for e in step.accumulates)
        t += ew_elem * step.copies * batch + (ew_call if step.copies else 0.0)
        if step.scores and hw.colossal_table:  # colossal's local compute, per element at the rank's size
            return t + hw.colossal_seconds_per_score(step.scores / step.score_share, d) * step.scores * batch
        if step.scores and any(hw.colossal_s):  # colossal's score path, calibrated per element
            a, b, c = hw.colossal_s
            return t + a * step.score_share + (b + c * d) * step.scores * batch
        t += ew_elem * step.elementwise * batch
        t += sum(2.0 * bb * m * nn * k * batch / hw.matmul_flops for bb, m, nn, k in step.matmuls)
        return t

    total = compute = busy = 0.0
    # the layer call's own latency (Note [Per-call terms]), a share on each rank's path at every step
    latency = hw.layer_latency(backend, world) / max(1, len(scheds[0].forward) + len(scheds[0].backward))
    # the delay a synchronisation meets after a stretch of compute, once per such synchronisation (Note [Per-call terms])
    delay, computed = hw.sync_delay(world), False
    for phase in ("forward", "backward"):
        last = len(getattr(scheds[0], phase)) - 1
        for i, steps in enumerate(zip(*(getattr(s, phase) for s in scheds))):
            work = [cpu(st) + (sink_work if phase == "forward" and i == last else 0.0) for st in steps]
            computed = computed or any(st.calls or st.scores for st in steps)
            if computed and (steps[0].collective is not None or any(st.messages for st in steps)):
                total += delay  # this step ends in a wait for other ranks, after compute
                computed = False
            if sharing:  # measured: the mean rank's work, stretched as P ranks running at once are
                shared = sum(work) / len(steps) * sharing
            else:
                shared = sum(work) / slots * (world / len(steps)) if slots else 0.0
            step_compute = max(max(work), shared)
            if steps[0].collective is not None:
                op, elems, group = steps[0].collective
                stretch = max(1.0, world / slots) / max(1.0, group / slots) if slots and group < world else 1.0
                link = hw.collective_time(op, elems * eb, group) * stretch
                total += max(max(work) + latency, shared) + link
                compute += step_compute
                busy += link
                continue
            ranks_t, comm_t, busy_r = [], [], 0.0
            for st, w in zip(steps, work):
                # a ring that follows the mask may receive other rows than it sends: the larger side
                exposed_msgs = 1 if st.exposed_send_acc or st.exposed_recv_acc else 0
                over = ((st.messages - exposed_msgs) * overlapped_lat
                        + max(st.overlapped_send, st.overlapped_recv) * eb / bw)
                exposed = (exposed_msgs * lat * (overlapped_lat > 0)
                           + max(st.exposed_send_acc, st.exposed_recv_acc) * acc_b / bw)
                fixed = st.messages * msg
                ranks_t.append(max(w, over) + fixed + exposed + latency)
                comm_t.append(fixed + exposed)
                busy_r = max(busy_r, over + fixed + exposed)
            step_t = max(max(ranks_t), shared + max(comm_t))
            total += step_t
            compute += step_compute
            busy += busy_r
    if computed:
        total += delay  # the layer's end: the caller's next synchronisation waits for the slowest rank's compute
    return total, min(compute, total), busy


# ------------------------------------------------------------------------------------------------
# backend="auto"
# ------------------------------------------------------------------------------------------------

AUTO_LAYOUT_BACKENDS = ("ulysses", "zigzag_ring", "allgather_kv", "usp")
"""What ``backend="auto"`` may run: the backends exact on the zigzag layout ``auto`` shards for
(Ulysses reorders the gathered sequence; ``usp`` runs its ring over coarse zigzag chunks; see
``choose_backend``). ``ring`` (contiguous) and ``colossal`` (O(N^2/P) memory, the baseline) are never
chosen."""


@dataclass(kw_only=True)
class AutoChoice:
    """What ``backend="auto"`` runs, and the predictions it chose from (model output)."""

    backend: str
    ulysses_degree: int | None
    predictions: list[Prediction]
    excluded: dict[str, str] = field(default_factory=dict)
    """Backend label -> why it was not a candidate."""
    hardware: str = ""
    measured: dict[str, float] = field(default_factory=dict)
    """Label -> measured fwd+bwd seconds (max over ranks) when ``auto`` timed its candidates."""
    source: str = "cost model"
    """``"cost model"``, ``"measured"`` or ``"cached measurement"``: what decided ``backend``."""
    cache_key: str = ""
    """Measured decisions: the key of the per-machine cache (``choices.auto_cache_path()``)."""

    @property
    def label(self) -> str:
        return f"usp(ulysses={self.ulysses_degree})" if self.backend == "usp" else self.backend

    def summary(self) -> str:
        """One line: the choice, every candidate's measured (or predicted) fwd+bwd time, and the exclusions."""
        if self.measured:
            times = "; ".join(f"{k} {t * 1e3:.3g} ms" for k, t in sorted(self.measured.items(), key=lambda kv: kv[1]))
            out = f"{self.label} (measured on this machine, fwd+bwd per layer, slowest rank: {times}"
        elif self.source != "cost model":
            out = f"{self.label} ({self.source} on this machine, among {', '.join(p.label for p in self.predictions)}"
        else:
            preds = "; ".join(f"{p.label} {p.total_s * 1e3:.3g} ms" for p in sorted(self.predictions, key=lambda p: p.total_s))
            out = f"{self.label} (cost model on {self.hardware}, predicted fwd+bwd per layer: {preds}"
        if self.excluded:
            out += "; not candidates: " + ", ".join(f"{k} ({v})" for k, v in self.excluded.items())
        return out + ")"


def choose_backend(shape: AttentionShape, world: int, hw: HardwareProfile, *, usp_allowed: bool = True,
                   mask: "AttentionMask | None" = None, cu_seqlens=None, sinks: bool = False,
                   layout=None) -> AutoChoice:
    """The fastest backend by the model among those exact on ``auto``'s zigzag layout: ``ulysses``
    (heads divisible by ``world``), ``zigzag_ring``, ``allgather_kv`` and ``usp`` for every inner
    degree ``1 < U < world`` dividing ``world`` and the heads (``usp_allowed=False`` when its
    sub-groups cannot be built). Ties go to the earlier of ``AUTO_LAYOUT_BACKENDS``. ``mask``,
    ``cu_seqlens``: every candidate priced under them (Note [Cost model under a mask]), score modifiers and
    ``sinks`` too (Note [Cost model of score modifiers]). ``layout``: a ``SequenceLayout`` the data is sharded
    for (e.g. ``SequenceLayout.balanced_for``): the candidates are then those that run on it, each priced on it (Note
    [Cost model on a given layout]): ``zigzag_ring`` and ``allgather_kv`` for a layout without a Ulysses split,
    ``usp`` at the layout's ``ulysses_degree`` otherwise; the others are listed in ``excluded`` with the reason."""
    if world < 2:
        raise ValueError(f"choose_backend needs a group of >= 2 ranks, got {world}")
    preds, excluded = [], {}
    masking = dict(mask=mask, cu_seqlens=cu_seqlens, sinks=sinks)
    if layout is not None:
        from lightning_sp.layout import as_layout, padded_length  # here, not at import: layout loads torch

        layout = as_layout(layout)
        padded_length(1, world, layout)  # a chunk table for another group size raises, naming the fix
        return _choose_on_layout(shape, world, hw, layout, usp_allowed, masking)
    if shape.num_heads % world == 0:
        preds.append(predict_attention("ulysses", shape, world, hw, **masking))
    else:
        excluded["ulysses"] = f"num_heads={shape.num_heads} not divisible by {world}"
    preds.append(predict_attention("zigzag_ring", shape, world, hw, **masking))
    preds.append(predict_attention("allgather_kv", shape, world, hw, **masking))
    degrees = [u for u in range(2, world) if world % u == 0]
    for u in degrees:
        if not usp_allowed:
            excluded[f"usp(ulysses={u})"] = "its sub-groups are not available"
        elif shape.num_heads % u:
            excluded[f"usp(ulysses={u})"] = f"num_heads={shape.num_heads} not divisible by {u}"
        else:
            preds.append(predict_attention("usp", shape, world, hw, ulysses_degree=u, **masking))
    order = {b: i for i, b in enumerate(AUTO_LAYOUT_BACKENDS)}
    best = min(preds, key=lambda p: (p.total_s, order[p.backend], p.ulysses_degree or 0))
    return AutoChoice(backend=best.backend, ulysses_degree=best.ulysses_degree, predictions=preds,
                      excluded=excluded, hardware=hw.name)


def _choose_on_layout(shape: AttentionShape, world: int, hw: HardwareProfile, layout, usp_allowed: bool,
                      masking: dict) -> AutoChoice:
    """``choose_backend(layout=)``: the candidates that run on ``layout``, each priced on it."""
    preds, excluded = [], {}
    u = layout.ulysses_degree
    why = f"does not run on the given layout {layout}"
    excluded["ulysses"] = f"shards its own way: {why}"
    for backend in ("zigzag_ring", "allgather_kv"):
        if u == 1:
            preds.append(predict_attention(backend, shape, world, hw, layout=layout, **masking))
        else:
            excluded[backend] = f"runs its ring over every rank: the layout splits each ring rank over {u} ranks"
    for v in (v for v in range(2, world) if world % v == 0):
        label = f"usp(ulysses={v})"
        if v != u:
            excluded[label] = f"the layout's ulysses_degree is {u}"
        elif not usp_allowed:
            excluded[label] = "its sub-groups are not available"
        elif shape.num_heads % v:
            excluded[label] = f"num_heads={shape.num_heads} not divisible by {v}"
        else:
            preds.append(predict_attention("usp", shape, world, hw, ulysses_degree=v, layout=layout, **masking))
    if not preds:
        raise ValueError(f"no backend runs on layout {layout} over {world} ranks here: "
                         + "; ".join(f"{k}: {v}" for k, v in excluded.items()))
    order = {b: i for i, b in enumerate(AUTO_LAYOUT_BACKENDS)}
    best = min(preds, key=lambda p: (p.total_s, order[p.backend], p.ulysses_degree or 0))
    return AutoChoice(backend=best.backend, ulysses_degree=best.ulysses_degree, predictions=preds,
                      excluded=excluded, hardware=hw.name)
