"""The cost model counts what the backends do: on 4 gloo ranks every backend runs one
fwd+bwd with a counting kernel, and each rank's kernel calls (q length, k length, mask, heads,
direction) and point-to-point / reduce-scatter bytes equal ``ops.schedule.rank_schedule``'s, for
whole K/V blocks and pieces, causal and bidirectional, GQA. Negative control: the schedule with the
other mask differs from what ran, so equality is not vacuous.

Under a mask (Note [Cost model under a mask] in ``lightning_sp/cost_model.py``): sliding windows (causal,
left/right), chunks, a bidirectional span, packed documents and documents with a window, on every backend
``auto`` may run plus ``ring``, at P = 2 (a sub-group of ranks 0, 1) and P = 4, the call resolved by the
module's own ``_doc_bounds``/``_mask_fields``: every rank's calls, the query-key pairs its forward computes and
its bytes by ``CommStats`` operation equal ``cost_model.rank_counts``'; the pairs the calls leave visible sum,
over the ranks, to the dense mask's. Negative control: the model without the mask misses the calls or bytes
of every masked case, and the bytes of every case whose traffic follows the mask. On a given layout (Note [Cost
model on a given layout]): a 50% prefix-LM span on ``SequenceLayout.balanced_for`` its mask, zigzag_ring at P = 2
and 4, allgather_kv and usp (2 x 2) at P = 4: calls, pairs and bytes equal ``rank_counts(layout=)``'s and the
busiest rank computes fewer pairs than on zigzag; control: priced on zigzag, the pairs differ.

``backend="auto"`` prices the mask: on links slow enough that bytes decide, a causal sliding window makes it run
``zigzag_ring`` (whose traffic follows the window) where the same call without the mask runs ``ulysses`` (whose
all-to-alls move every row); both exact against dense fp64 attention, and the window's bytes are the model's. Its
measured policy times the candidates under the call's mask.

Cost (2 cores): one spawn of 4 ranks, 16 plain + 58 masked + 4 balanced-layout small cases (N = 2048, D = 8), 2 auto calls and
two rounds of measured-policy trials: 32 s (2026-11-28, under load).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from lightning_sp.layout import SequenceLayout
from lightning_sp.masks import AttentionMask
from tests.distributed.harness import run_on_ranks

pytestmark = pytest.mark.distributed

N, H, H_KV, D = 2048, 4, 2, 8
CASES = [(b, u, causal, pieces) for b, u in (("ulysses", None), ("ring", None), ("zigzag_ring", None),
                                             ("allgather_kv", None), ("usp", 2))
         for causal, pieces in ((True, 1), (True, 2), (False, 2))] + [("colossal", None, True, 1)]


class CountingKernel:
    """Wraps a ``LocalKernel`` and records every call as ``ops.schedule.KernelCall`` fields."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def forward(self, q, k, v, *, scale, kind, mask):
        self.calls.append((q.size(1), k.size(1), kind.value, q.size(2), k.size(2), False))
        return self.inner.forward(q, k, v, scale=scale, kind=kind, mask=mask)

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        self.calls.append((q.size(1), k.size(1), kind.value, q.size(2), k.size(2), True))
        return self.inner.backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)


def _run(backend, u, causal, pieces, rank, world):
    from lightning_sp.comm.stats import CommStats
    from lightning_sp.ops import backends
    from lightning_sp.ops.kernels import make_kernel
    from lightning_sp.ops.schedule import backend_layout

    layout = backend_layout(backend, u)
    kernel, stats = CountingKernel(make_kernel("sdpa")), CommStats()
    call = backends.AttentionCall(kernel=kernel, scale=D ** -0.5, causal=causal, layout=layout, padded_len=N,
                                  doc_bounds=None, stats=stats, kv_pieces=pieces)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, N // world, H, D, generator=g, requires_grad=True)
    k, v = (torch.randn(1, N // world, H_KV, D, generator=g, requires_grad=True) for _ in range(2))
    group = dist.group.WORLD
    if backend == "usp":
        ulysses_group = ring_group = None
        for i in range(world // u):  # every rank creates every group, in the same order
            grp = dist.new_group(list(range(i * u, (i + 1) * u)))
            ulysses_group = grp if rank // u == i else ulysses_group
        for j in range(u):
            grp = dist.new_group(list(range(j, world, u)))
            ring_group = grp if rank % u == j else ring_group
        out = backends.usp_attention(q, k, v, call, ulysses_group=ulysses_group, ring_group=ring_group)
    else:
        fn = {"ulysses": backends.ulysses_attention, "ring": backends.ring_attention,
              "zigzag_ring": backends.ring_attention, "allgather_kv": backends.allgather_kv_attention,
              "colossal": backends.colossal}[backend]
        out = fn(q, k, v, call, group=group)
    out.backward(torch.randn(out.shape, generator=g))
    return kernel.calls, dict(stats.bytes_by_op)


def _expected(backend, u, causal, pieces, rank, world):
    from lightning_sp.ops.schedule import rank_schedule

    s = rank_schedule(backend, seq_len=N, world=world, rank=rank, heads=H, kv_heads=H_KV, head_dim=D, causal=causal,
                      ulysses_degree=u, kv_pieces=pieces)
    calls = [(c.q_len, c.k_len, c.kind, c.heads, c.kv_heads, c.backward) for c in s.calls()]
    steps = s.forward + s.backward
    p2p = 4 * sum(st.overlapped_send for st in steps)  # fp32 inputs: K/V blocks and pieces
    grads = 4 * sum(st.exposed_send_acc for st in steps)  # fp32 partial sums / contributions
    return calls, p2p, grads


def _worker(rank, world):
    torch.set_num_threads(1)
    masked, balanced = _masked_cases(rank, world)
    return {"plain": _plain_cases(rank, world), "masked": masked, "balanced": balanced, "auto": _auto_cases(rank, world)}


def _plain_cases(rank, world):
    results = []
    for backend, u, causal, pieces in CASES:
        calls, by_op = _run(backend, u, causal, pieces, rank, world)
        want_calls, want_p2p, want_grads = _expected(backend, u, causal, pieces, rank, world)
        other = _expected(backend, u, not causal, pieces, rank, world)  # the other mask
        ring_bytes = by_op.get("ring_send", 0)
        grad_bytes = by_op.get("ring_send_grad", 0) + by_op.get("reduce_scatter", 0)
        results.append({
            "case": (backend, u, causal, pieces), "calls_equal": Counter(calls) == Counter(want_calls),
            "n_calls": len(calls), "want_n_calls": len(want_calls), "ring_bytes": (ring_bytes, want_p2p),
            "grad_bytes": (grad_bytes, want_grads),
            "negative_differs": Counter(other[0]) != Counter(calls) or other[1:] != (want_p2p, want_grads),
        })
    return results


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 4, timeout_s=300)


def test_schedule_counts_equal_what_the_backends_do(results):
    out = [r["plain"] for r in results]
    for rank, rows in enumerate(out):
        for r in rows:
            backend = r["case"][0]
            assert r["calls_equal"], (rank, r)
            assert r["n_calls"] > 0 or backend == "colossal", (rank, r)  # colossal calls no kernel
            if backend in ("ring", "zigzag_ring", "usp", "colossal"):
                assert r["ring_bytes"][0] == r["ring_bytes"][1], (rank, r)
            assert r["grad_bytes"][0] == r["grad_bytes"][1], (rank, r)
            if backend != "colossal":
                assert r["negative_differs"], (rank, r)
    # the grid reaches both code paths: whole blocks and pieces give different call counts
    rows = {r["case"]: r for r in out[0]}
    assert rows[("zigzag_ring", None, True, 2)]["n_calls"] > rows[("zigzag_ring", None, True, 1)]["n_calls"]


# ------------------------------------------------------------------------------------------------
# under a mask
# ------------------------------------------------------------------------------------------------

MASKS = {  # name -> (causal, AttentionMask fields or None, cu_seqlens or None)
    "window": (True, dict(window=(299, 0)), None),
    "window_lr": (False, dict(window=(150, 90)), None),
    "chunks": (True, dict(chunk_size=512), None),
    "span": (True, dict(bidirectional_spans=((100, 700),)), None),
    "docs": (True, None, (0, 300, 1100, 2048)),
    "docs_window": (True, dict(window=(199, 0)), (0, 900, 2048)),
}
MASKED_BACKENDS = {2: (("ring", None), ("zigzag_ring", None), ("allgather_kv", None), ("ulysses", None)),
                   4: (("ring", None), ("zigzag_ring", None), ("allgather_kv", None), ("ulysses", None),
                       ("usp", 2))}
MASKED_PIECES = ((2, "window", "zigzag_ring"), (2, "docs_window", "allgather_kv"), (2, "span", "ring"))
"""Cases run again with ``kv_pieces=4``: the traffic follows the mask piece by piece."""
FOLLOWS = ("ring", "zigzag_ring", "allgather_kv", "usp")
"""Backends whose K/V traffic follows the mask (whole blocks; usp: its ring part)."""
PREFIX = dict(bidirectional_spans=((0, N // 2),))
"""A 50% prefix-LM span, run on ``SequenceLayout.balanced_for`` its mask (Note [Cost model on a given layout])."""
BALANCED_CASES = ((2, "zigzag_ring", None), (4, "zigzag_ring", None), (4, "allgather_kv", None), (4, "usp", 2))


def _masked_call(backend, u, world, kernel, stats, causal, fields, cu, pieces=1, layout=None):
    from lightning_sp.attention import _doc_bounds, _mask_fields
    from lightning_sp.masks import AttentionMask
    from lightning_sp.ops import backends
    from lightning_sp.ops.schedule import backend_layout

    mask = None if fields is None else AttentionMask(**fields)
    doc_bounds = _doc_bounds(cu, N, N)  # the module's own resolution of documents and masks
    return backends.AttentionCall(kernel=kernel, scale=D ** -0.5, causal=causal,
                                  layout=layout or backend_layout(backend, u),
                                  padded_len=N, doc_bounds=doc_bounds, stats=stats, kv_pieces=pieces,
                                  **_mask_fields(mask, None, causal, doc_bounds, N, follow=cu is not None)), mask


def _visible(kind: str, q_len: int, k_len: int, mask_tensor) -> int:
    """Pairs one call leaves visible: a DENSE tile its mask's, a CAUSAL square its triangle, a FULL block all."""
    if kind == "dense":
        return int(mask_tensor.sum())
    return q_len * (q_len + 1) // 2 if kind == "causal" else q_len * k_len


class PairCountingKernel(CountingKernel):
    """Also sums the forward's computed and visible query-key pairs over the heads."""

    def __init__(self, inner):
        super().__init__(inner)
        self.computed = self.visible = 0

    def forward(self, q, k, v, *, scale, kind, mask):
        sq, sk, h = q.size(1), k.size(1), q.size(2)
        self.computed += h * (sq * (sq + 1) // 2 if kind.value == "causal" else sq * sk)
        self.visible += h * _visible(kind.value, sq, sk, mask)
        return super().forward(q, k, v, scale=scale, kind=kind, mask=mask)


def _masked_cases(rank, world):
    from lightning_sp.comm.stats import CommStats
    from lightning_sp.cost_model import AttentionShape, rank_counts
    from lightning_sp.ops import backends
    from lightning_sp.ops.kernels import make_kernel
    from lightning_sp.ops.schedule import rank_schedule

    pair = dist.new_group([0, 1])  # P = 2: ranks 0 and 1 (every rank creates every group, in the same order)
    ulysses_groups = [dist.new_group(list(range(i * 2, i * 2 + 2))) for i in range(2)]
    ring_groups = [dist.new_group(list(range(j, 4, 2))) for j in range(2)]
    shape = AttentionShape(seq_len=N, num_heads=H, num_kv_heads=H_KV, head_dim=D, dtype_bytes=4)
    rows = []
    grid = [(p, name, backend, u, 1) for p, cases in MASKED_BACKENDS.items() for name in MASKS for backend, u in cases]
    grid += [(p, name, backend, None, 4) for p, name, backend in MASKED_PIECES]
    grid += [(p, "prefix_balanced", backend, u, 1) for p, backend, u in BALANCED_CASES]
    balanced_rows = []
    for p, name, backend, u, pieces in grid:
        if rank >= p:
            continue
        group = pair if p == 2 else dist.group.WORLD
        causal, fields, cu = MASKS[name] if name in MASKS else (True, PREFIX, None)
        layout = None
        if name == "prefix_balanced":
            layout = SequenceLayout.balanced_for(N, p, AttentionMask(**PREFIX), ulysses_degree=u or 1)
        kernel, stats = PairCountingKernel(make_kernel("sdpa")), CommStats()
        call, mask = _masked_call(backend, u, p, kernel, stats, causal, fields, cu, pieces, layout)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, N // p, H, D, generator=g, requires_grad=True)
        k, v = (torch.randn(1, N // p, H_KV, D, generator=g, requires_grad=True) for _ in range(2))
        if backend == "usp":
            out = backends.usp_attention(q, k, v, call, ulysses_group=ulysses_groups[rank // u],
                                         ring_group=ring_groups[rank % u])
        else:
            fn = {"ulysses": backends.ulysses_attention, "ring": backends.ring_attention,
                  "zigzag_ring": backends.ring_attention,
                  "allgather_kv": backends.allgather_kv_attention}[backend]
            out = fn(q, k, v, call, group=group)
        out.backward(torch.randn(out.shape, generator=g))
        m_shape = shape if causal else AttentionShape(seq_len=N, num_heads=H, num_kv_heads=H_KV, head_dim=D,
                                                        dtype_bytes=4, causal=False)
        model = rank_counts(backend, m_shape, p, ulysses_degree=u, kv_pieces=pieces, mask=mask, cu_seqlens=cu,
                            ranks=[rank])[0]
        blind = rank_counts(backend, m_shape, p, ulysses_degree=u, ranks=[rank])[0]  # ignores the mask
        sched = rank_schedule(backend, seq_len=N, world=p, rank=rank, heads=H, kv_heads=H_KV, head_dim=D,
                              causal=causal, ulysses_degree=u, kv_pieces=pieces, mask=mask, doc_bounds=cu)
        blind_sched = rank_schedule(backend, seq_len=N, world=p, rank=rank, heads=H, kv_heads=H_KV,
                                    head_dim=D, causal=causal, ulysses_degree=u)
        key = lambda c: (c.q_len, c.k_len, c.kind, c.heads, c.kv_heads, c.backward)  # noqa: E731
        counted = {op: float(b) for op, b in stats.bytes_by_op.items() if b}
        ran = Counter(kernel.calls)
        if layout is not None:  # priced on the table (the model), and on the backend's own layout (the control)
            model = rank_counts(backend, shape, p, ulysses_degree=u, mask=mask, layout=layout, ranks=[rank])[0]
            on_zigzag = rank_counts(backend, shape, p, ulysses_degree=u, mask=mask, ranks=[rank])[0]
            sched = rank_schedule(backend, seq_len=N, world=p, rank=rank, heads=H, kv_heads=H_KV, head_dim=D,
                                  causal=True, ulysses_degree=u, mask=mask, layout=layout)
            key = lambda c: (c.q_len, c.k_len, c.kind, c.heads, c.kv_heads, c.backward)  # noqa: E731
            balanced_rows.append({
                "case": (p, backend, u), "layout": str(layout), "calls_equal": ran == Counter(map(key, sched.calls())),
                "pairs": (kernel.computed, model.pairs), "visible": kernel.visible, "bytes": (counted, model.bytes_by_op),
                "zigzag_pairs": on_zigzag.pairs, "zigzag_bytes": on_zigzag.bytes_by_op,
            })
            continue
        rows.append({
            "case": (p, name, backend, u, pieces), "calls_equal": ran == Counter(map(key, sched.calls())),
            "n_calls": len(kernel.calls), "pairs": (kernel.computed, model.pairs), "visible": kernel.visible,
            "bytes": (counted, model.bytes_by_op),
            "blind_misses_calls": ran != Counter(map(key, blind_sched.calls())),
            "blind_bytes": blind.bytes_by_op, "blind_pairs": blind.pairs,
        })
    return rows, balanced_rows


def _dense_visible(causal, fields, cu) -> int:
    """Visible pairs of the whole mask over all heads, from ``StructuredMask.visible`` on the full sequence."""
    from lightning_sp.attention import _doc_bounds
    from lightning_sp.masks import AttentionMask

    mask = AttentionMask(**(fields or {}))
    structured = mask.structured(causal=causal, doc_bounds=_doc_bounds(cu, N, N), padded_len=N)
    pos = torch.arange(N)
    return H * int(structured.visible(pos, pos).sum())


def test_cost_model_counts_equal_what_the_backends_do_under_masks(results):
    rows = [r for out in results for r in out["masked"]]
    assert len(rows) == 2 * 4 * len(MASKS) + 4 * 5 * len(MASKS) + 2 * len(MASKED_PIECES)  # every rank of every case
    by_case = {}
    for r in rows:
        p, name, backend = r["case"][:3]
        assert r["calls_equal"], r
        assert r["n_calls"] > 0, r
        assert r["pairs"][0] == r["pairs"][1], r
        assert r["bytes"][0] == r["bytes"][1], r  # every operation, exactly
        # negative control: the model blind to the mask misses what ran
        assert r["blind_misses_calls"] or r["blind_bytes"] != r["bytes"][0], r
        if backend in FOLLOWS:
            assert r["blind_bytes"] != r["bytes"][0], r
        by_case.setdefault(r["case"], []).append(r)
    for (p, name, backend, _, _), case_rows in by_case.items():
        causal, fields, cu = MASKS[name]
        # the calls leave visible exactly the dense mask's pairs, and compute no fewer
        assert sum(r["visible"] for r in case_rows) == _dense_visible(causal, fields, cu), (p, name, backend)
        assert sum(r["pairs"][0] for r in case_rows) >= sum(r["visible"] for r in case_rows)
    # the mask-following traffic is far below the traffic the mask-blind model predicts: window at P = 4
    zig = by_case[(4, "window", "zigzag_ring", None, 1)][0]
    assert sum(zig["bytes"][0].values()) < 0.5 * sum(zig["blind_bytes"].values()), zig
    ring_docs = by_case[(2, "docs", "ring", None, 1)]
    assert sum(sum(r["bytes"][0].values()) for r in ring_docs) < sum(sum(r["blind_bytes"].values()) for r in ring_docs)


def test_cost_model_prices_a_balanced_layout_as_the_backends_run_it(results):
    """A 50% prefix-LM span on ``SequenceLayout.balanced_for`` its mask, ``layout=`` to the backend: every rank's
    calls, pairs and bytes equal ``rank_counts(..., layout=)``'s; the busiest rank computes fewer pairs than on
    zigzag. Control: the model on the backend's own layout (zigzag) misses the pairs."""
    rows = [r for out in results for r in out["balanced"]]
    assert len(rows) == sum(p for p, _, _ in BALANCED_CASES)
    by_case = {}
    for r in rows:
        assert r["calls_equal"], r
        assert r["pairs"][0] == r["pairs"][1] and r["bytes"][0] == r["bytes"][1], r
        by_case.setdefault(r["case"], []).append(r)
    dense = _dense_visible(True, PREFIX, None)
    for case, case_rows in by_case.items():
        assert sum(r["visible"] for r in case_rows) == dense, case
        p, _, u = case
        ring = p // (u or 1)
        table = SequenceLayout.balanced_for(N, p, AttentionMask(**PREFIX), ulysses_degree=u or 1)
        assert case_rows[0]["layout"] == str(table), case
        assert table.chunk_ranks != tuple(range(ring)) + tuple(reversed(range(ring))), case  # not zigzag's table
        # control: priced on zigzag, the same rank computes other pairs; the busiest rank computes more there
        assert any(r["pairs"][1] != r["zigzag_pairs"] for r in case_rows), case
        assert max(r["pairs"][1] for r in case_rows) < max(r["zigzag_pairs"] for r in case_rows), case


# ------------------------------------------------------------------------------------------------
# backend="auto" under a mask
# ------------------------------------------------------------------------------------------------

WINDOW = (127, 0)


def _slow_links():
    from dataclasses import replace

    from lightning_sp.cost_model import preset

    return replace(preset("cpu-default"), name="slow-links", intra_bandwidth=1e7, inter_bandwidth=1e7)


def _auto_cases(rank, world):
    from lightning_sp import AttentionMask, SequenceParallelAttention, gather_sequence, shard_sequence
    from lightning_sp.cost_model import AttentionShape, rank_counts
    from tests.reference import dense_attention

    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, N, hh, D, generator=g, dtype=torch.float64) for hh in (H, H_KV, H_KV, H))
    out = {}
    for name, mask in (("plain", None), ("window", AttentionMask(window=WINDOW))):
        attn = SequenceParallelAttention(causal=True, backend="auto", group=dist.group.WORLD, kernel="torch", mask=mask,
                                         kv_pieces=1)
        attn.context.hardware = _slow_links()
        local = [shard_sequence(t, dist.group.WORLD, layout=attn.layout) for t in (q, k, v, dout)]
        for t in local[:3]:
            t.requires_grad_()
        attn.comm_stats.reset()
        o = attn(*local[:3], seq_len=N)
        o.backward(local[3])
        sent = {op: float(b) for op, b in attn.comm_stats.bytes_by_op.items() if b}
        got = [gather_sequence(t, dist.group.WORLD, layout=attn.layout, seq_len=N) for t in (o.detach(), local[0].grad)]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = dense_attention(*leaves, causal=True, mask=mask)
        err = max(float((got[0] - ref.detach()).abs().max()),
                  float((got[1] - torch.autograd.grad(ref, leaves[0], dout)[0]).abs().max()))
        chosen = attn.context.resolved_backend
        shape = AttentionShape(seq_len=N, num_heads=H, num_kv_heads=H_KV, head_dim=D, dtype_bytes=8)
        model = rank_counts(chosen, shape, world, mask=mask, ranks=[rank])[0].bytes_by_op if "(" not in chosen else {}
        out[name] = {"chosen": chosen, "err": err, "sent": sent, "model": model}
    out["measured_trials"] = _measured_trials(q, k, v)
    return out


def _measured_trials(q, k, v):
    """``auto``'s measured policy runs its candidates with the call's mask: each candidate once (the timing and the
    agreement replaced by a stub, the same on every rank), a counting kernel: how many DENSE (window) tiles ran."""
    from lightning_sp import AttentionMask, SequenceParallelAttention, choices, shard_sequence
    from lightning_sp.ops.kernels import make_kernel

    in_trials = []

    def once_each(key, labels, run, group, device):
        for label in labels:
            run(label)
        in_trials.append(sum(1 for c in kernel.calls if c[2] == "dense"))  # the trials' calls only
        return labels[0], {label: 1.0 for label in labels}

    real, choices.agreed_fastest = choices.agreed_fastest, once_each
    try:
        out = {}
        for name, mask in (("plain", None), ("window", AttentionMask(window=WINDOW))):
            attn = SequenceParallelAttention(causal=True, backend="auto", group=dist.group.WORLD, kernel="torch",
                                             mask=mask, kv_pieces=1)
            attn.context.auto_policy = "measure"
            kernel = attn._kernel_cache[("torch", "cpu")] = PairCountingKernel(make_kernel("torch"))
            local = [shard_sequence(t, dist.group.WORLD, layout=attn.layout) for t in (q, k, v)]
            attn(*local, seq_len=N)
            out[name] = in_trials.pop()
        return out
    finally:
        choices.agreed_fastest = real


def test_auto_prices_the_mask(results):
    from lightning_sp.attention import auto_choice
    from lightning_sp.masks import AttentionMask

    for out in results:
        plain, window = out["auto"]["plain"], out["auto"]["window"]
        assert plain["chosen"] == "ulysses", plain  # the same shapes without the mask: as before
        assert window["chosen"] == "zigzag_ring", window
        assert plain["err"] < 1e-10 and window["err"] < 1e-10, (plain, window)
        # the bytes the window's ring sent (the cross-rank check's gather aside) are the model's, exactly
        ring_ops = {op: b for op, b in window["sent"].items() if op.startswith("ring_")}
        assert ring_ops == window["model"], window
        assert sum(ring_ops.values()) < 0.25 * sum(plain["sent"].values()), (plain, window)
    for out in results:  # the measured trials ran under the window (its DENSE tiles), the unmasked ones did not
        trials = out["auto"]["measured_trials"]
        assert trials["plain"] == 0 and trials["window"] > 0, trials
    # negative control: the model blind to the mask picks Ulysses for the windowed call too
    blind = auto_choice(H, 4, seq_len=N, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64, hardware=_slow_links(),
                        usp_allowed=True)
    assert blind.backend == "ulysses", blind.summary()
    seen = auto_choice(H, 4, seq_len=N, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64, hardware=_slow_links(),
                       usp_allowed=True, mask=AttentionMask(window=WINDOW))
    assert seen.backend == "zigzag_ring", seen.summary()


def test_cost_model_counts_pieces_under_masks(results):
    """K/V in pieces follows the mask piece by piece: the same bytes as whole blocks, counted exactly."""
    rows = {r["case"]: r for r in results[0]["masked"]}
    for p, name, backend in MASKED_PIECES:
        whole, pieces = rows[(p, name, backend, None, 1)], rows[(p, name, backend, None, 4)]
        assert pieces["bytes"][0] == pieces["bytes"][1] and pieces["calls_equal"], pieces
        assert sum(pieces["bytes"][0].values()) == sum(whole["bytes"][0].values()), (whole, pieces)
