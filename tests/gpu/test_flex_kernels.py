"""``ops/flex.py``'s FlexAttention kernel on CUDA against dense float64 attention, forward and dQ/dK/dV. Skipped
without CUDA (CI checks the same calls through a stand-in in tests/unit/test_flex_kernel.py).

Each case is a row of queries at global positions ``[128, 384)`` over two key blocks ``[0, 192)`` and
``[192, 384)`` (block offsets in every closure; rows merged over both blocks, then each block differentiated
against the merged row, as the ring backends do), GQA 8:2, head dim 64: the boolean mask kinds (windows, spans,
chunks, packed documents) and every score modifier at once (soft-cap, ALiBi, ``score_mod``, ``mask_mod``) in bf16,
the modifiers in fp16 and fp32, a square causal diagonal block, ``SequenceParallelAttention`` on one rank with the
modifiers and sinks, and block offsets that do not recompile. Each modifier on its own is checked on CPU
(tests/unit/test_flex_kernel.py, the real op's forward and a stand-in's backward): here every distinct closure
structure costs a compilation (seconds), so the cases share as few as possible."""

import math

import pytest
import torch

from lightning_sp import SequenceParallelAttention
from lightning_sp.masks import AttentionMask
from lightning_sp.ops import flex
from lightning_sp.ops.kernels import make_kernel, score_mod_kernel
from lightning_sp.ops.merge import merge_into
from lightning_sp.ops.plan import MaskKind
from tests.reference import dense_attention, key_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not CI coverage)"),
]

@pytest.fixture(autouse=True)
def _many_graphs(monkeypatch):
    """This module compiles one graph per mask kind, dtype and direction (~30): more than Dynamo's per-function
    limit (8), past which it would run the uncompiled op and test that instead. A model has one mask."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            monkeypatch.setattr(dynamo_config, name, 64)


TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}  # as tests/gpu/test_cuda_kernels.py
N, Q0, K_SPLIT, H, H_KV, D = 384, 128, 192, 8, 2, 64


def user_score_mod(s, b, h, q, k):
    return s + 0.05 * ((q - k) % 7).to(s.dtype) - 0.02 * h.to(s.dtype)


def user_mask_mod(b, h, q, k):
    return ((q + 2 * k + h) % 5 != 0) | (q == k)  # keeps the diagonal: no row of the reference is empty


SLOPES = tuple(0.01 * (i + 1) for i in range(H))
ALL = AttentionMask(window=(200, 0), softcap=2.0, alibi_slopes=SLOPES, score_mod=user_score_mod, mask_mod=user_mask_mod)
CASES = {  # name: (mask, causal, document bounds). Boolean kinds share one graph; the modifiers are one more
    "window": (AttentionMask(window=(100, 0)), True, None),
    "window_two_sided": (AttentionMask(window=(60, 40)), False, None),
    "spans": (AttentionMask(bidirectional_spans=((150, 230),)), True, None),
    "chunks": (AttentionMask(chunk_size=96), True, None),
    "packed_docs": (AttentionMask(), True, (0, 100, 101, 277, N)),
    "all_modifiers": (ALL, True, (0, 150, N)),  # window, documents, softcap, ALiBi, score_mod, mask_mod at once
}


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().abs().max()).item()


def _blocks(mask, causal, docs, q_start, key_ranges):
    vis = mask.structured(causal=causal, doc_bounds=docs, padded_len=N).visible(torch.arange(N), torch.arange(N))
    return [(k0, k1, kind, None if m is None else m.cuda()) for k0, k1, kind, m in key_blocks(vis, q_start, key_ranges)]


def _run_row(mask, q, k, v, blocks, dout, q_start):
    """Blocks forward, merged, each block's backward against the merged row -> ``out, dq, dk, dv``."""
    mods = mask.score_mods()
    if mods is None:  # windows, chunks, spans, documents: kernel="flex"
        make = lambda k0: make_kernel("flex")  # noqa: E731
    else:  # what a call with score modifiers runs under kernel="flex"
        make = lambda k0: score_mod_kernel(make_kernel("flex"), mods, q_global=q_start, k_global=k0,  # noqa: E731
                                           head_offset=0)
    scale = 1.0 / math.sqrt(D)
    out = torch.zeros(*q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full((q.size(0), H, q.size(1)), -math.inf, dtype=torch.float32, device="cuda")
    for k0, k1, kind, m in blocks:
        kern = make(k0)
        assert kern.why_not(q, k, v) is None
        o_b, l_b = kern.forward(q, k[:, k0:k1], v[:, k0:k1], scale=scale, kind=kind, mask=m)
        merge_into(out, lse, o_b, l_b)
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
        torch.zeros_like(v, dtype=torch.float32)
    for k0, k1, kind, m in blocks:
        g = make(k0).backward(dout, q, k[:, k0:k1], v[:, k0:k1], out, lse, scale=scale, kind=kind, mask=m)
        dq += g[0]
        dk[:, k0:k1] += g[1]
        dv[:, k0:k1] += g[2]
    return out, dq, dk, dv


def _check(case, dtype, q_start=Q0, key_ranges=((0, K_SPLIT), (K_SPLIT, N))):
    mask, causal, docs = CASES[case]
    torch.manual_seed(len(case))
    q = torch.randn(1, N, H, D, dtype=dtype, device="cuda")
    k = torch.randn(1, N, H_KV, D, dtype=dtype, device="cuda")
    v = torch.randn(1, N, H_KV, D, dtype=dtype, device="cuda")
    dout = torch.randn(1, N - q_start, H, D, dtype=dtype, device="cuda")
    got = _run_row(mask, q[:, q_start:], k, v, _blocks(mask, causal, docs, q_start, key_ranges), dout, q_start)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    cu = None if docs is None else torch.tensor(docs)
    ref = dense_attention(*leaves, causal=causal, cu_seqlens=cu, mask=mask)[:, q_start:]
    want = [ref, *torch.autograd.grad(ref, leaves, dout.cpu().double())]
    want[1] = want[1][:, q_start:]
    tol = TOL[dtype]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all() and _rel(g, w) < tol, (case, dtype, name, _rel(g, w))
    control = dense_attention(*(t.detach() for t in leaves), causal=causal)[:, q_start:]
    assert _rel(got[0], control) > 3 * tol, (case, "control: the mask and documents ignored")


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_mask_kind_bf16(case):
    _check(case, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    _check("all_modifiers", dtype)


def test_causal_diagonal_block():
    """A square diagonal block runs as CAUSAL (kv_idx <= q_idx on local indices), after a FULL block."""
    _check("all_modifiers", torch.bfloat16, q_start=K_SPLIT, key_ranges=((0, K_SPLIT), (K_SPLIT, N)))


def test_through_the_module(monkeypatch):
    """``SequenceParallelAttention`` on one rank with score modifiers and sinks runs FlexAttention blocks."""
    calls = []
    original = flex.FlexKernel._flex
    monkeypatch.setattr(flex.FlexKernel, "_flex", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    mask = ALL  # the graphs compiled above serve the module's blocks too
    torch.manual_seed(0)
    leaves = [torch.randn(1, N, hh, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
              for hh in (H, H_KV, H_KV)]
    sinks = torch.randn(H, dtype=torch.float32, device="cuda", requires_grad=True)
    cu = torch.tensor([0, 100, 101, 277, N], dtype=torch.int32, device="cuda")
    out = SequenceParallelAttention(causal=True, mask=mask, kernel="flex")(*leaves, cu_seqlens=cu, sinks=sinks)
    dout = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, [*leaves, sinks], dout)]
    assert calls, "FlexAttention was not used"
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (*leaves, sinks)]
    ref = dense_attention(*ref_leaves[:3], causal=True, cu_seqlens=cu.cpu(), mask=mask, sinks=ref_leaves[3])
    want = [ref, *torch.autograd.grad(ref, ref_leaves, dout.cpu().double())]
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert torch.isfinite(g).all() and _rel(g, w) < TOL[torch.bfloat16], (name, _rel(g, w))


def test_new_offsets_do_not_recompile():
    """Block offsets reach the closures as tensors: the same shapes at other global positions reuse the graph."""
    from torch._dynamo.utils import counters

    def only_here(s, b, h, q, k):  # a callable no other test compiled
        return s - 0.01 * (q - k).abs().to(s.dtype)

    mask = AttentionMask(score_mod=only_here)
    q, k, v = (torch.randn(1, 128, hh, D, dtype=torch.bfloat16, device="cuda") for hh in (H, H_KV, H_KV))
    before, graphs = counters["stats"]["unique_graphs"], []
    for q_global, k_global in ((0, 0), (128, 0), (512, 256), (1024, 896)):
        kern = score_mod_kernel(make_kernel("flex"), mask.score_mods(), q_global=q_global, k_global=k_global,
                                head_offset=0)
        with torch.no_grad():
            kern.forward(q, k, v, scale=0.125, kind=MaskKind.FULL, mask=None)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > before and graphs[1:] == [graphs[0]] * 3, (before, graphs)  # the first call compiled
