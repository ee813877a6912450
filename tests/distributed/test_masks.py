"""Every mask kind on every backend, exact against dense float64 attention with the same mask on the whole
sequence (forward, dq/dk/dv, the sinks' gradient), on real gloo ranks; a negative control per kind (the mask
ignored must miss); and traffic that follows the mask, counted by ``CommStats``.

One spawn per world size (2 and 4) runs the whole grid; the parent asserts per case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_sp import AttentionMask, SequenceParallelAttention, gather_sequence, shard_sequence
from lightning_sp.layout import SequenceLayout, padded_length, token_indices
from tests.distributed import multimodal_spans
from tests.distributed.harness import run_on_ranks
from tests.reference import dense_attention

pytestmark = pytest.mark.distributed

BACKENDS = ["ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal"]
N = 43  # no degree divides it
H, H_KV, D = 4, 2, 8
TOL = 1e-10
DOCS = (0, 11, 12, 30, N)  # packed documents: one of a single token, none aligned to a shard


def _score_mod(score, b, h, q, k):
    return score + 0.3 * torch.sin(0.7 * (q - k).to(score.dtype) + h)


def _mask_mod(b, h, q, k):
    return ((q + k + h) % 3 != 0) | (q == k)


# kind -> (causal, AttentionMask or None, with sinks, with documents)
KINDS = {
    "window_causal": (True, AttentionMask(window=(6, 0)), False, False),
    "window_two_sided": (False, AttentionMask(window=(5, 3)), False, False),
    "chunked": (True, AttentionMask(chunk_size=9), False, False),
    "prefix_lm_spans": (True, AttentionMask(bidirectional_spans=((0, 8), (17, 29))), False, False),
    "softcap": (True, AttentionMask(softcap=0.8), False, False),
    "alibi": (False, AttentionMask(alibi_slopes=(0.5, 0.25, 0.125, 0.0625)), False, False),
    "sinks": (True, None, True, False),
    "mask_mod": (False, AttentionMask(mask_mod=_mask_mod), False, False),
    "score_mod": (True, AttentionMask(score_mod=_score_mod), False, False),
    "docs_window_spans_softcap_sinks": (True, AttentionMask(window=(7, 0), bidirectional_spans=((13, 20),), softcap=1.5),
                                        True, True),
    "docs_window_two_sided_alibi": (False, AttentionMask(window=(4, 4), alibi_slopes=(0.3, 0.2, 0.1, 0.05)), False, True),
}


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, N, hh, D, generator=g, dtype=torch.float64) for hh in (H, H_KV, H_KV, H))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return q, k, v, dout, sinks


def _err(a, b):
    return float((a.detach() - b.detach()).abs().max())


def _run_case(group, world, backend, kind, seed, pieces=1):
    causal, mask, with_sinks, with_docs = KINDS[kind]
    q, k, v, dout, sinks = _tensors(seed)
    cu = torch.tensor(DOCS, dtype=torch.int32) if with_docs else None
    u = 2 if backend == "usp" and world == 4 else None
    attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, ulysses_degree=u, mask=mask,
                                     kv_pieces=pieces)
    local = [shard_sequence(t, group, layout=attn.layout) for t in (q, k, v, dout)]
    for t in local[:3]:
        t.requires_grad_()
    s = sinks.clone().requires_grad_() if with_sinks else None
    out = attn(*local[:3], cu_seqlens=cu, sinks=s)
    out.backward(local[3])
    got = [gather_sequence(t, group, layout=attn.layout, seq_len=N)
           for t in (out.detach(), local[0].grad, local[1].grad, local[2].grad)]
    if with_sinks:  # each rank holds its rows' share of the parameter's gradient: summed over the group
        dsinks = s.grad.clone()
        dist.all_reduce(dsinks, group=group)
        got.append(dsinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if with_sinks else [])
    ref = dense_attention(*leaves[:3], causal=causal, cu_seqlens=cu, mask=mask, sinks=leaves[3] if with_sinks else None)
    refs = [ref, *torch.autograd.grad(ref, leaves, dout)]
    errors = [_err(a, b) for a, b in zip(got, refs)]
    # negative control: the same check with this kind's mask (or sinks) ignored must miss
    ignored = dense_attention(q, k, v, causal=causal, cu_seqlens=cu)
    control = _err(got[0], ignored)
    return errors, control


def _traffic(group, world):
    """Bytes each rank sends (fwd + bwd) under masks that leave most rank pairs empty, next to the plain call; the
    same masks with K/V in 4 pieces (``"/pieces"``: 8-token pieces of the 32-token contiguous blocks, so the window's
    11 rows span two pieces), and the K/V send calls of each."""
    from lightning_sp.ops import ring_attention

    out = {}
    n = 32 * world
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, hh, D, generator=g, dtype=torch.float64) for hh in (H, H_KV, H_KV, H))
    # documents of 8 tokens never cross a zigzag chunk (16 tokens) nor a contiguous shard (32)
    docs = torch.arange(0, n + 1, 8, dtype=torch.int32)
    cases = [(b, "docs") for b in ("ring", "zigzag_ring", "allgather_kv")] + [("ring", "window"), ("ring", "plain")]
    if world == 4:
        cases.append(("usp", "docs"))  # 2 x 2: the ring of 2 over chunks of 32 tokens
    cases += [(b, what + "/pieces") for b, what in cases if what != "plain"]
    for backend, what in cases:
        pieces = 4 if what.endswith("/pieces") else 1
        ring_attention.MIN_PIECE_TOKENS = 1 if pieces > 1 else 256
        mask = AttentionMask(window=(11, 0)) if what.startswith("window") else None
        attn = SequenceParallelAttention(causal=True, backend=backend, group=group, mask=mask, kv_pieces=pieces,
                                         ulysses_degree=2 if backend == "usp" else None)
        local = [shard_sequence(t, group, layout=attn.layout) for t in (q, k, v, dout)]
        for t in local[:3]:
            t.requires_grad_()
        attn.comm_stats.reset()
        cu = docs if what.startswith("docs") else None
        o = attn(*local[:3], cu_seqlens=cu)
        o.backward(local[3])
        got = [gather_sequence(t, group, layout=attn.layout, seq_len=n)
               for t in (o.detach(), local[0].grad, local[1].grad, local[2].grad)]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = dense_attention(*leaves, causal=True, cu_seqlens=cu, mask=mask)
        refs = [ref, *torch.autograd.grad(ref, leaves, dout)]
        out[(backend, what)] = (dict(attn.comm_stats.bytes_by_op), max(_err(a, b) for a, b in zip(got, refs)),
                                attn.comm_stats.calls_by_op.get("ring_send", 0))
    ring_attention.MIN_PIECE_TOKENS = 256
    return out


PIECES_CASES = [(b, kd) for b in ("ring", "zigzag_ring", "allgather_kv", "usp")
                for kd in ("prefix_lm_spans", "docs_window_spans_softcap_sinks")]
"""K/V in pieces (``kv_pieces=3``) under masks: each piece carries the rows the mask needs, exact too."""


def _disagreeing_masks(group, rank):
    """Rank 0 passes another window than its peers: every rank raises, naming the mask (no hang)."""
    attn = SequenceParallelAttention(causal=True, backend="ring", group=group,
                                     mask=AttentionMask(window=(6 if rank == 0 else 7, 0)))
    q = torch.randn(1, 8, H, D, dtype=torch.float64)
    try:
        attn(q, q[:, :, :H_KV], q[:, :, :H_KV], seq_len=8 * dist.get_world_size(group))
    except ValueError as e:
        return str(e)
    return None


def _worker(rank, world):
    from lightning_sp.ops import ring_attention

    group = dist.group.WORLD
    cases = {}
    for i, (backend, kind) in enumerate((b, kd) for b in BACKENDS for kd in KINDS):
        cases[(backend, kind)] = _run_case(group, world, backend, kind, seed=i)
    ring_attention.MIN_PIECE_TOKENS = 1  # pieces on 11-token blocks
    pieces = {case: _run_case(group, world, *case, seed=i, pieces=3) for i, case in enumerate(PIECES_CASES)}
    ring_attention.MIN_PIECE_TOKENS = 256
    return {"cases": cases, "pieces": pieces, "traffic": _traffic(group, world),
            "disagree": _disagreeing_masks(group, rank), "multimodal": multimodal_spans.span_cases(group, world),
            "padding": _padding_worker(group, world, rank), "relative_bias": _relative_bias_cases(group, world),
            "bad_bucket_fn": _bucket_fn_out_of_range(group), "balanced": _balanced_cases(group, world, rank)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def grid(request):
    return request.param, run_on_ranks(_worker, request.param, timeout_s=300, pg_timeout_s=60)


def test_every_mask_kind_on_every_backend_matches_dense_fp64(grid):
    world, per_rank = grid
    failures = []
    results = per_rank[0]["cases"]
    assert len(results) == len(BACKENDS) * len(KINDS)
    assert len(per_rank[0]["pieces"]) == len(PIECES_CASES)
    results = {**results, **{(*key, "kv_pieces=3"): value for key, value in per_rank[0]["pieces"].items()}}
    for key, (errors, control) in results.items():
        if max(errors) > TOL:
            failures.append(f"{key}: out/dq/dk/dv(/dsinks) errors {errors} > {TOL}")
        if control < 1e-3:
            failures.append(f"{key}: negative control passed ({control}): the mask made no difference")
    assert not failures, f"world={world}:\n" + "\n".join(failures)


def test_traffic_follows_the_mask(grid):
    """Documents that never cross a shard: no K/V (nor gradient) byte on the rings, allgather_kv and the ring of
    usp (2 x 2; its all-to-alls move the heads whatever the mask). A causal
    window of 11 keys on the contiguous ring: each rank sends only its last 11 K/V rows to the next rank
    (forward and again in backward) and gets those rows' dK/dV back, nothing to any other rank. K/V in pieces
    (``kv_pieces=4``): the same bytes in every case, each piece carrying only its share of the rows."""
    world, per_rank = grid
    row = H_KV * D * 8  # bytes of one token's K (or V) in fp64
    for rank, result in enumerate(per_rank):
        traffic = result["traffic"]
        for key, (sent, err, _calls) in traffic.items():
            assert err < TOL, f"rank {rank} {key}: out/dq/dk/dv error {err}"
        for backend in ("ring", "zigzag_ring", "allgather_kv") + (("usp",) if world == 4 else ()):
            for what in ("docs", "docs/pieces"):
                sent = traffic[(backend, what)][0]
                kv = {op: b for op, b in sent.items() if op != "all_to_all"}
                assert sum(kv.values()) == 0, f"rank {rank} {backend} {what} with shard-local documents sent {kv}"
        last = rank == world - 1
        for what in ("window", "window/pieces"):
            sent = traffic[("ring", what)][0]
            assert sent.get("ring_send", 0) == (0 if last else 2 * 2 * 11 * row), (rank, what, sent)  # K, V; fwd, bwd
            assert sent.get("ring_send_grad", 0) == (0 if rank == 0 else 2 * 11 * row), (rank, what, sent)  # dK, dV
        # in pieces the window's rows travel as the two pieces they lie in: 2 K/V messages (K and V) per piece
        # per pass instead of per block, the same bytes
        whole_calls, piece_calls = traffic[("ring", "window")][2], traffic[("ring", "window/pieces")][2]
        assert (whole_calls, piece_calls) == ((0, 0) if last else (4, 8)), (rank, whole_calls, piece_calls)
        # the plain causal ring (no mask) passes every block on: (P - 1) blocks of K and V per pass
        plain = traffic[("ring", "plain")][0]
        assert plain["ring_send"] >= 2 * (world - 1) * 2 * 32 * row


def test_ranks_with_different_masks_raise_together(grid):
    world, per_rank = grid
    for rank, result in enumerate(per_rank):
        assert result["disagree"] is not None and "hash(mask, sinks)" in result["disagree"], (rank, result["disagree"])


def test_multimodal_decoder_with_bidirectional_images_matches_dense_fp64(grid):
    """``MultimodalDecoder(image_attention="bidirectional")`` sharded by the strategy's sharder (zigzag_ring,
    allgather_kv; padded: 51 tokens) equals one process with dense float64 attention and the same image spans:
    loss and every parameter's gradient; the reference without the spans misses. ``"causal"`` equals the plain
    causal reference and misses the bidirectional one. A batch whose labels sit inside a span raises on every rank
    (tests/distributed/multimodal_spans.py)."""
    world, per_rank = grid
    for rank, result in enumerate(per_rank):
        cases = result["multimodal"]["cases"]
        assert len(cases) == len(multimodal_spans.BACKENDS) + 1
        for key, (loss_err, grad_err, control) in cases.items():
            assert loss_err < 1e-12 and grad_err < 1e-12, (world, rank, key, loss_err, grad_err)
            assert control > 1e-4, (world, rank, key, f"control {control}: the image spans made no difference")
        leak = result["multimodal"]["leak"]
        assert leak is not None and "inside a bidirectional image span" in leak, (rank, leak)


# ------------------------------------------------------------------------ key padding (AttentionMask.key_padding)

# kind -> (causal, key_padding ranges per batch row, AttentionMask fields besides, with sinks, with documents)
PADDING_KINDS = {
    # rows padded differently: told apart per block (a mask_mod); row 0's first 5 causal queries see no key
    "left_rows_causal": (True, ((5, N), (0, N)), {}, False, False),
    "left_and_right_rows_bidirectional": (False, ((3, 40), (0, 31)), {}, False, False),
    # rows padded alike: the structured mask alone (StructuredMask.keys); 24 padded keys cover whole shards
    "shared_left_window": (True, ((24, N), (24, N)), {"window": (6, 0)}, False, False),
    "left_docs_sinks": (True, ((4, 40),), {"softcap": 2.0}, True, True),
}


def _dense_padded(q, k, v, causal, ranges, fields, cu, sinks):
    """Dense float64 attention with each row's keys outside ``[start, end)`` hidden; a query row that sees no
    key (and has no sink) gives zeros. Written from the definitions, apart from ``lightning_sp.masks``."""
    import math

    from tests.reference import dense_visibility

    b, n, h, d = q.shape
    k, v = (t.repeat_interleave(h // t.size(2), dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if fields.get("softcap"):
        scores = fields["softcap"] * torch.tanh(scores / fields["softcap"])
    visible = dense_visibility(n, causal=causal, cu_seqlens=cu, mask=AttentionMask(window=fields.get("window")))
    pos = torch.arange(n)
    real = torch.stack([(pos >= s) & (pos < e) for s, e in ranges])  # [B, N]
    visible = visible[None, None] & real[:, None, None, :]  # [B, 1, N, N]
    if sinks is not None:
        scores = torch.cat([scores.masked_fill(~visible, -math.inf), sinks.view(1, h, 1, 1).expand(b, h, n, 1)], -1)
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1)[..., :n], v)
    seen = visible.any(-1, keepdim=True)
    scores = torch.where(seen, scores.masked_fill(~visible, -math.inf), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1) * seen, v)


def _padding_case(group, world, backend, kind, seed):
    causal, ranges, fields, with_sinks, with_docs = PADDING_KINDS[kind]
    g = torch.Generator().manual_seed(100 + seed)
    b = len(ranges)
    q, k, v, dout = (torch.randn(b, N, hh, D, generator=g, dtype=torch.float64) for hh in (H, H_KV, H_KV, H))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    cu = torch.tensor(DOCS, dtype=torch.int32) if with_docs else None
    u = 2 if backend == "usp" and world == 4 else None
    mask = AttentionMask(key_padding=ranges, **fields)
    attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, ulysses_degree=u, mask=mask)
    local = [shard_sequence(t, group, layout=attn.layout) for t in (q, k, v, dout)]
    for t in local[:3]:
        t.requires_grad_()
    s = sinks.clone().requires_grad_() if with_sinks else None
    attn.comm_stats.reset()
    out = attn(*local[:3], cu_seqlens=cu, sinks=s)
    out.backward(local[3])
    sent = dict(attn.comm_stats.bytes_by_op)
    got = [gather_sequence(t, group, layout=attn.layout, seq_len=N)
           for t in (out.detach(), local[0].grad, local[1].grad, local[2].grad)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if with_sinks else [])
    ref = _dense_padded(*leaves[:3], causal, ranges, fields, cu, leaves[3] if with_sinks else None)
    refs = [ref, *torch.autograd.grad(ref, leaves[:3], dout)]
    errors = [_err(a, b) for a, b in zip(got, refs)]
    finite = all(bool(torch.isfinite(t).all()) for t in got)
    # negative control: the padding ignored must miss
    control = _err(got[0], _dense_padded(q, k, v, causal, ((0, N),) * b, fields, cu, sinks if with_sinks else None))
    # rows that see no key: zeros out, zero dq (row 0's causal queries before its first real token)
    unseen = float(max(got[0][0, :ranges[0][0]].abs().max(), got[1][0, :ranges[0][0]].abs().max())) \
        if causal and not with_sinks and ranges[0][0] else 0.0
    return {"errors": errors, "control": control, "finite": finite, "unseen": unseen, "sent": sent}


def _padding_worker(group, world, rank):
    cases = {(backend, kind): _padding_case(group, world, backend, kind, seed=i)
             for i, (backend, kind) in enumerate((b, kd) for b in BACKENDS for kd in PADDING_KINDS)}
    try:  # one range per batch row: a wrong count is refused by every rank, naming the fix
        attn = SequenceParallelAttention(causal=True, backend="ring", group=group,
                                         mask=AttentionMask(key_padding=((0, 8),)))
        q = torch.randn(2, 8, H, D, dtype=torch.float64)
        attn(q, q[:, :, :H_KV], q[:, :, :H_KV], seq_len=8 * world)
        wrong_count = None
    except ValueError as e:
        wrong_count = str(e)
    return {"cases": cases, "wrong_count": wrong_count, "rank": rank}


def test_key_padding_on_every_backend_matches_dense_fp64(grid):
    """Left, right and both-sided padding per batch row, alone and with windows, documents, soft-capping and
    sinks: forward and dq/dk/dv against dense float64; finite everywhere; the causal queries in the left
    padding give exactly zero output and zero dq; the padding ignored must miss. Rows padded alike are
    skipped block by block: on the contiguous ring, a rank whose keys are all padding sends no K/V."""
    world, per_rank = grid
    failures = []
    for rank, result in enumerate(per_rank):
        padding = result["padding"]
        assert len(padding["cases"]) == len(BACKENDS) * len(PADDING_KINDS)
        for key, r in padding["cases"].items():
            if not r["finite"]:
                failures.append(f"rank {rank} {key}: a NaN or inf in out/dq/dk/dv")
            if max(r["errors"]) > TOL:
                failures.append(f"rank {rank} {key}: out/dq/dk/dv errors {r['errors']} > {TOL}")
            if r["control"] < 1e-3:
                failures.append(f"rank {rank} {key}: the padding ignored passed ({r['control']})")
            if r["unseen"] != 0.0:
                failures.append(f"rank {rank} {key}: queries that see no key give {r['unseen']}, not 0")
        shard = padded_length(N, world) // world
        sent = padding["cases"][("ring", "shared_left_window")]["sent"]
        if (rank + 1) * shard <= 24 and sent.get("ring_send", 0):
            failures.append(f"rank {rank}: holds only padded keys but sent {sent} on the ring")
        assert padding["wrong_count"] is not None and "one range of real tokens per batch row" in padding["wrong_count"]
    assert not failures, f"world={world}:\n" + "\n".join(failures)


# ------------------------------------------------------------------------------ learned relative-position bias

# kind -> (causal, RelativePositionBias kwargs, other AttentionMask fields, with sinks, with documents)
BIAS_KINDS = {
    "t5_bidirectional_docs": (False, dict(num_buckets=8, max_distance=12), {}, False, True),
    "t5_unidirectional": (True, dict(num_buckets=6, max_distance=20, bidirectional=False), {}, False, False),
    "bucket_fn_softcap_window_sinks": (True, dict(bucket_fn=lambda rel: (rel.abs() % 5) + 5 * (rel < -9)),
                                       dict(softcap=1.5, window=(17, 0)), True, False),
}
BIAS_ROWS = {"t5_bidirectional_docs": 8, "t5_unidirectional": 6, "bucket_fn_softcap_window_sinks": 10}


def _bias_reference_mod(bias):
    """The bias as a plain ``score_mod`` over the whole sequence: dense attention differentiates the table by
    autograd (an independent reference for ``d table``)."""
    def score_mod(s, b, h, q, k):
        return s + bias.table[bias.buckets(k - q)[0, 0]][..., h.flatten()].permute(2, 0, 1).unsqueeze(0)
    return score_mod


def _relative_bias_case(group, world, backend, kind, seed):
    """Errors of out/dq/dk/dv/d(table summed over the group)(/dsinks) against dense fp64, and two controls: the
    bias ignored (forward), and this rank's table gradient not summed over the group."""
    from lightning_sp import RelativePositionBias

    causal, bias_kw, extra, with_sinks, with_docs = BIAS_KINDS[kind]
    q, k, v, dout, sinks = _tensors(seed)
    table = torch.randn(BIAS_ROWS[kind], H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cu = torch.tensor(DOCS, dtype=torch.int32) if with_docs else None
    u = 2 if backend == "usp" and world == 4 else None
    attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, ulysses_degree=u)
    local = [shard_sequence(t, group, layout=attn.layout) for t in (q, k, v, dout)]
    for t in local[:3]:
        t.requires_grad_()
    leaf = table.clone().requires_grad_()
    s = sinks.clone().requires_grad_() if with_sinks else None
    mask = AttentionMask(relative_bias=RelativePositionBias(leaf, **bias_kw), **extra)
    out = attn(*local[:3], cu_seqlens=cu, mask=mask, sinks=s)
    out.backward(local[3])
    got = [gather_sequence(t, group, layout=attn.layout, seq_len=N)
           for t in (out.detach(), local[0].grad, local[1].grad, local[2].grad)]
    dtable = leaf.grad.clone()
    dist.all_reduce(dtable, group=group)  # each rank holds its rows' share: summed over the group, as the sinks'
    got.append(dtable)
    if with_sinks:
        dsinks = s.grad.clone()
        dist.all_reduce(dsinks, group=group)
        got.append(dsinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    leaves += [sinks.clone().requires_grad_()] if with_sinks else []
    ref_mask = AttentionMask(score_mod=_bias_reference_mod(RelativePositionBias(leaves[3], **bias_kw)), **extra)
    ref = dense_attention(*leaves[:3], causal=causal, cu_seqlens=cu, mask=ref_mask,
                          sinks=leaves[4] if with_sinks else None)
    refs = [ref, *torch.autograd.grad(ref, leaves, dout)]
    errors = [_err(a, b) for a, b in zip(got, refs)]
    ignored = dense_attention(q, k, v, causal=causal, cu_seqlens=cu, mask=AttentionMask(**extra),
                              sinks=sinks if with_sinks else None)
    return {"errors": errors, "bias_ignored": _err(got[0], ignored), "not_reduced": _err(leaf.grad, refs[4]),
            "table_grad_norm": float(refs[4].abs().max())}


def _relative_bias_cases(group, world):
    return {(backend, kind): _relative_bias_case(group, world, backend, kind, seed=100 + i)
            for i, (backend, kind) in enumerate((b, kd) for b in BACKENDS for kd in BIAS_KINDS)}


def _bucket_fn_out_of_range(group):
    """Buckets ``|k - q|`` over a 30-row table: in range within any shard (at most 21 tokens), not over the whole
    sequence (N = 43, padded to 44): every rank raises before any collective, naming it (no hang)."""
    from lightning_sp import RelativePositionBias

    bias = RelativePositionBias(torch.zeros(30, H, dtype=torch.float64), bucket_fn=lambda rel: rel.abs())
    q, k, v, _, _ = _tensors(0)
    attn = SequenceParallelAttention(causal=False, backend="ring", group=group)
    local = [shard_sequence(t, group, layout=attn.layout) for t in (q, k, v)]
    try:
        attn(*local, mask=AttentionMask(relative_bias=bias))
    except ValueError as e:
        return str(e)
    return None


def test_relative_position_bias_on_every_backend_matches_dense_fp64_with_its_table_gradient(grid):
    """T5 buckets (bidirectional over packed documents, unidirectional causal) and a custom ``bucket_fn`` beside a
    soft-cap, a window and sinks, on every backend (Ulysses and usp: each rank's heads are the table's global
    columns), N = 43: out, dq/dk/dv and the table's gradient summed over the group within 1e-10 of dense float64.
    Controls on the same runs: the bias ignored misses, and one rank's table gradient alone (not summed) misses."""
    world, per_rank = grid
    failures = []
    for rank, result in enumerate(per_rank):
        cases = result["relative_bias"]
        assert len(cases) == len(BACKENDS) * len(BIAS_KINDS)
        for key, r in cases.items():
            if max(r["errors"]) > TOL:
                failures.append(f"rank {rank} {key}: out/dq/dk/dv/dtable(/dsinks) errors {r['errors']} > {TOL}")
            if r["bias_ignored"] < 1e-3:
                failures.append(f"rank {rank} {key}: the bias ignored only differs by {r['bias_ignored']}")
            if r["not_reduced"] < 1e-3 or r["table_grad_norm"] < 1e-2:
                failures.append(f"rank {rank} {key}: one rank's table gradient alone passes ({r['not_reduced']}, "
                                f"gradient size {r['table_grad_norm']})")
    assert not failures, f"world={world}:\n" + "\n".join(failures)


def test_a_bucket_fn_out_of_the_table_raises_on_every_rank(grid):
    world, per_rank = grid
    for rank, result in enumerate(per_rank):
        message = result["bad_bucket_fn"]
        assert message is not None and "outside the table's [0, 30) rows" in message, (world, rank, message)


# ------------------------------------------------------------ balanced layouts (SequenceLayout.balanced_for, layout=)

# name -> (bidirectional spans, with documents, kv_pieces, spans in the call): a 10% and a 50% prefix, two spans
# among packed documents, K/V in pieces, and plain causal attention on the 50% prefix's table (no mask structure:
# allgather_kv then gathers all K/V, the path the masked calls skip)
BALANCED_MASKS = {
    "prefix_10": (((0, 5),), False, 1, True),
    "prefix_50": (((0, 21),), False, 1, True),
    "two_spans_docs": (((0, 8), (17, 29)), True, 1, True),
    "prefix_50_pieces": (((0, 21),), False, 3, True),
    "causal_on_prefix_50_table": (((0, 21),), False, 1, False),
}
BALANCED_BACKENDS = ("ring", "zigzag_ring", "allgather_kv", "usp")
N_BALANCED = 45  # no degree divides it; zigzag pads it to 48, which tables of 2 to 6 chunks per rank split too
DOCS_BALANCED = (0, 11, 12, 30, N_BALANCED)


def _balanced_case(group, world, backend, name, seed):
    """One prefix-LM call on ``SequenceLayout.balanced_for``'s table: out, dq, dk, dv against dense fp64 attention
    with the same spans; controls: the spans ignored, and the output gathered as if the layout were contiguous."""
    n = N_BALANCED
    spans, with_docs, pieces, spans_in_call = BALANCED_MASKS[name]
    u = 2 if backend == "usp" else 1
    mask = AttentionMask(bidirectional_spans=spans)
    layout = SequenceLayout.balanced_for(n, world, mask, ulysses_degree=u)
    if not spans_in_call:
        mask = None
    attn = SequenceParallelAttention(causal=True, backend=backend, group=group, mask=mask, kv_pieces=pieces,
                                     ulysses_degree=u if backend == "usp" else None, layout=layout)
    assert attn.layout == layout
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, n, hh, D, generator=g, dtype=torch.float64) for hh in (H, H_KV, H_KV, H))
    cu = torch.tensor(DOCS_BALANCED, dtype=torch.int32) if with_docs else None
    local = [shard_sequence(t, group, layout=layout) for t in (q, k, v, dout)]
    for t in local[:3]:
        t.requires_grad_()
    out = attn(*local[:3], cu_seqlens=cu)
    out.backward(local[3])
    got = [gather_sequence(t, group, layout=layout, seq_len=n)
           for t in (out.detach(), local[0].grad, local[1].grad, local[2].grad)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*leaves, causal=True, cu_seqlens=cu, mask=mask)
    refs = [ref, *torch.autograd.grad(ref, leaves, dout)]
    errors = [_err(a, b) for a, b in zip(got, refs)]
    spans_ignored = _err(got[0], dense_attention(q, k, v, causal=True, cu_seqlens=cu)) if spans_in_call else None
    as_contiguous = _err(gather_sequence(out.detach(), group, layout="contiguous", seq_len=n), ref)
    n_pad = padded_length(n, world, layout)
    zigzag = SequenceLayout("zigzag", u)
    differs_from_zigzag = n_pad != padded_length(n, world, zigzag) or any(
        not torch.equal(token_indices(layout, world, n_pad, r), token_indices(zigzag, world, n_pad, r))
        for r in range(world))
    return errors, spans_ignored, as_contiguous, differs_from_zigzag


def _balanced_hf(group, world):
    """A tiny float64 Llama through ``apply_sequence_parallel`` whose attention modules shard for a balanced table:
    ``shard_inputs`` follows the modules' layout, so logits, loss and every gradient equal one process's; the
    logits gathered as if zigzag miss."""
    import torch.nn.functional as F

    from lightning_sp import sequence_parallel_cross_entropy
    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, max_grad_diff, tiny_batch, tiny_model

    n = N_BALANCED
    base = tiny_model("llama")
    batch = tiny_batch("llama", n)
    ref = clone(base)
    logits_ref = ref(input_ids=batch["input_ids"]).logits  # [1, N, V]
    loss_ref = F.cross_entropy(logits_ref[:, : n - 1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    loss_ref.backward()
    out = {}
    # the 10% prefix's tables (N = 45) differ from zigzag at every degree here, so the control can miss
    for backend, u in (("zigzag_ring", 1),) + ((("usp", 2),) if world == 4 else ()):
        layout = SequenceLayout.balanced_for(n, world, AttentionMask(bidirectional_spans=((0, 5),)), ulysses_degree=u)
        model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend, layout=layout,
                                                    **({"ulysses_degree": u} if backend == "usp" else {}))
        shard = integration.shard_inputs(batch, model)
        labels = shard.pop("labels")
        logits = model(**shard).logits  # [1, S_local, V]
        loss = sequence_parallel_cross_entropy(logits, labels, group=group)
        loss.backward()
        full = gather_sequence(logits.detach(), group, layout=layout, seq_len=n)
        as_zigzag = gather_sequence(logits.detach(), group, layout=SequenceLayout("zigzag", u), seq_len=n)
        out[backend] = {"logits": _err(full, logits_ref), "loss": abs(float(loss.detach() - loss_ref.detach())),
                        "grads": max_grad_diff(model, ref, group), "as_zigzag": _err(as_zigzag, logits_ref)}
    # bad layouts raise in apply_sequence_parallel, as SequenceParallelAttention(layout=) does, and leave the model as it was
    span = AttentionMask(bidirectional_spans=((0, 5),))
    bad = {"ulysses": dict(backend="ulysses", layout=SequenceLayout.balanced_for(n, world, span)),
           "wrong_size": dict(backend="zigzag_ring", layout=SequenceLayout.balanced_for(n, 2 * world, span))}
    out["errors"] = {}
    for name, kwargs in bad.items():
        model = clone(base)
        try:
            integration.apply_sequence_parallel(model, group=group, **kwargs)
            out["errors"][name] = None
        except ValueError as e:
            out["errors"][name] = (str(e), integration._sp_modules(model) == [])
    return out


def _balanced_cases(group, world, rank):
    from lightning_sp.binding import bind_attention_modules
    from lightning_sp.context import SequenceParallelContext
    from lightning_sp.ops import ring_attention

    out = {"cases": {}}
    ring_attention.MIN_PIECE_TOKENS = 1  # pieces on short blocks
    for i, backend in enumerate(BALANCED_BACKENDS):
        if backend == "usp" and world != 4:
            continue  # usp 2 x 2 only: at P = 2 its ring has one rank
        for j, name in enumerate(BALANCED_MASKS):
            out["cases"][(backend, name)] = _balanced_case(group, world, backend, name, seed=100 + 10 * i + j)
    ring_attention.MIN_PIECE_TOKENS = 256
    # the strategy's binding returns the modules' layout, the one batches are then sharded with
    mask = AttentionMask(bidirectional_spans=((0, 32),))
    layout = SequenceLayout.balanced_for(64, world, mask)
    model = torch.nn.Sequential(SequenceParallelAttention(causal=True, mask=mask, layout=layout))
    out["bound"] = bind_attention_modules(model, SequenceParallelContext(group=group, backend="zigzag_ring"),
                                          backend="zigzag_ring", sequence_parallel_size=world) == layout
    try:  # a strategy backend that shards its own way: raises at binding, naming the fix
        bind_attention_modules(model, SequenceParallelContext(group=group, backend="ulysses"), backend="ulysses",
                               sequence_parallel_size=world)
        out["bound_ulysses"] = None
    except ValueError as e:
        out["bound_ulysses"] = str(e)
    try:  # a table built for another group size
        SequenceParallelAttention(causal=True, backend="ring", group=group,
                                  layout=SequenceLayout.balanced_for(64, 2 * world, mask)).layout
        out["wrong_size"] = None
    except ValueError as e:
        out["wrong_size"] = str(e)
    # a table whose Ulysses split does not match the backend's: ring over every rank, and usp 2 x 2 with a plain table
    mismatched = [SequenceParallelAttention(causal=True, backend="ring", group=group,
                                            layout=SequenceLayout.balanced_for(64, world, mask, ulysses_degree=2))]
    if world == 4:
        mismatched.append(SequenceParallelAttention(causal=True, backend="usp", group=group, ulysses_degree=2,
                                                    layout=SequenceLayout.balanced_for(64, world, mask)))
    out["ulysses_mismatch"] = []
    for attn in mismatched:
        try:
            attn.layout
            out["ulysses_mismatch"].append(None)
        except ValueError as e:
            out["ulysses_mismatch"].append(str(e))
    out["hf"] = _balanced_hf(group, world)
    # ranks that shard with different tables raise together (the layout is part of the cross-rank signature)
    table = tuple(range(world)) + tuple(reversed(range(world)))
    mine = SequenceLayout.from_chunks(table if rank == 0 else tuple((r + 1) % world for r in table))
    attn = SequenceParallelAttention(causal=True, backend="zigzag_ring", group=group, layout=mine)
    q = torch.randn(1, 8, H, D, dtype=torch.float64)
    try:
        attn(q, q[:, :, :H_KV], q[:, :, :H_KV], seq_len=8 * world)
        out["disagree"] = None
    except ValueError as e:
        out["disagree"] = str(e)
    return out


def test_balanced_layout_prefix_lm_matches_dense_fp64_on_every_backend_that_takes_it(grid):
    """``SequenceLayout.balanced_for`` a prefix-LM mask (10%, 50%, two spans among packed documents, K/V in
    pieces, plain causal on a span's table; N = 45), passed as ``layout=`` to ring, zigzag_ring, allgather_kv and usp (2 x 2): out, dq, dk, dv equal dense
    float64 attention with the same spans; ignoring the spans, or reading the shards as contiguous, misses."""
    world, per_rank = grid
    result = per_rank[0]["balanced"]
    cases = result["cases"]
    assert len(cases) == len(BALANCED_MASKS) * (len(BALANCED_BACKENDS) - (world != 4))
    failures = []
    for key, (errors, spans_ignored, as_contiguous, _) in cases.items():
        if max(errors) > TOL:
            failures.append(f"{key}: out/dq/dk/dv errors {errors} > {TOL}")
        if (spans_ignored is not None and spans_ignored < 1e-3) or as_contiguous < 1e-3:
            failures.append(f"{key}: a control passed (spans ignored {spans_ignored}, read as contiguous "
                            f"{as_contiguous})")
    assert not failures, f"world={world}:\n" + "\n".join(failures)
    assert any(case[3] for case in cases.values()), "every balanced table was zigzag's: the test tests nothing new"


def test_hf_shard_inputs_follows_a_balanced_layout(grid):
    world, per_rank = grid
    for rank, result in enumerate(per_rank):
        hf = dict(result["balanced"]["hf"])
        errors = hf.pop("errors")  # apply_sequence_parallel(layout=) with a bad layout: the module's error, model untouched
        assert errors["ulysses"] is not None and "drop layout=" in errors["ulysses"][0] and errors["ulysses"][1], errors
        assert (errors["wrong_size"] is not None and f"world_size={world}" in errors["wrong_size"][0]
                and errors["wrong_size"][1]), errors
        assert set(hf) == ({"zigzag_ring", "usp"} if world == 4 else {"zigzag_ring"}), hf
        for backend, r in hf.items():
            assert r["logits"] < 1e-12 and r["loss"] < 1e-12 and r["grads"] < 1e-12, (rank, backend, r)
            assert r["as_zigzag"] > 1e-3, (rank, backend, r)


def test_balanced_layout_binds_and_bad_layouts_raise_on_every_rank(grid):
    world, per_rank = grid
    for rank, result in enumerate(per_rank):
        result = result["balanced"]
        assert result["bound"], rank
        assert result["bound_ulysses"] is not None and "drop layout=" in result["bound_ulysses"], result["bound_ulysses"]
        assert result["wrong_size"] is not None and f"world_size={world}" in result["wrong_size"], result["wrong_size"]
        assert result["disagree"] is not None and "hash(layout)" in result["disagree"], (rank, result["disagree"])
        fixes = ["build the layout with ulysses_degree=1", "build the layout with ulysses_degree=2"][:world // 2]
        assert len(result["ulysses_mismatch"]) == len(fixes), result["ulysses_mismatch"]
        for message, fix in zip(result["ulysses_mismatch"], fixes):
            assert message is not None and fix in message, (rank, message)
