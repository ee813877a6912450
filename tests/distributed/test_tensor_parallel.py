"""Megatron tensor(+sequence)-parallel layers on 4 gloo ranks, float64, against the one-process model.

One spawn runs every case: the demo ``Transformer`` (GQA, vocabulary 31 and length 13, which no
degree divides) split over tp=4 and over two tp=2 groups, with and without sequence parallelism:
logits (this rank's vocabulary slice), loss, argmax and every parameter gradient equal the unsplit
model's; the bytes each layer sends equal the analytic volume ``4 (t-1)/t * N h`` forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.harness import run_on_ranks

pytestmark = pytest.mark.distributed

WORLD = 4
B, S, VOCAB = 2, 13, 31
TOL = 1e-12


def _model(n_heads: int, n_kv_heads: int, causal: bool):
    from lightning_sp.models.layers import Transformer, TransformerConfig

    torch.manual_seed(7)
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=8 * n_heads, n_layers=2, n_heads=n_heads,
                            n_kv_heads=n_kv_heads, causal=causal)
    return Transformer(cfg).double()


def _grads_sliced_like(ref, ctx):
    """The reference gradients, split over ``ctx`` exactly as the parameters were."""
    from lightning_sp.tensor_parallel import bind_tensor_parallel

    g = copy.deepcopy(ref)
    for (n, p), (_, rp) in zip(g.named_parameters(), ref.named_parameters()):
        p.data = rp.grad.clone()
    bind_tensor_parallel(g, ctx)
    return dict(g.named_parameters())


def _run_case(rank, name, tp_ranks, *, heads, kv, sequence_parallel, causal, out):
    from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel

    groups = [dist.new_group(r) for r in tp_ranks]  # every rank creates every group, same order
    group = next(g for g, r in zip(groups, tp_ranks) if rank in r)
    ctx = TensorParallelContext(group=group, sequence_parallel=sequence_parallel)
    ref = _model(heads, kv, causal)
    model = copy.deepcopy(ref)
    sharded = set(bind_tensor_parallel(model, ctx))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(VOCAB, (B, S), generator=gen)
    labels = torch.randint(VOCAB, (B, S), generator=gen)
    labels[0, :4] = -100

    ref_logits = ref(ids)  # [B, S, V]
    ref_loss = ref.cross_entropy(ref_logits, labels)
    ref_loss.backward()
    logits = model(ids)  # [B, S, V_r]
    loss = model.cross_entropy(logits, labels)
    loss.backward()
    # replicated parameters: partial gradients under SP, summed over tp (the strategy's job)
    grads, unsummed = {}, {}
    for n, p in model.named_parameters():
        unsummed[n] = p.grad.clone()
        if sequence_parallel and n not in sharded:
            dist.all_reduce(p.grad, group=group)
        grads[n] = p.grad
    ref_grads = _grads_sliced_like(ref, ctx)
    start, stop = model.embed.vocab_start, model.embed.vocab_stop
    res = {
        "logits": (logits - ref_logits[..., start:stop]).abs().max().item(),
        "loss": abs(loss.item() - ref_loss.item()),
        "argmax": bool(torch.equal(model.argmax(logits), ref_logits.argmax(-1))),
        "grad": max((grads[n] - ref_grads[n].data).abs().max().item() for n in grads),
        "grad_scale": max(ref_grads[n].data.abs().max().item() for n in grads),
        "control": max((unsummed[n] - ref_grads[n].data).abs().max().item() for n in grads if n not in sharded),
        "shapes_split": model.blocks[0].qkv.weight.shape[0] < ref.blocks[0].qkv.weight.shape[0],
    }
    out[name] = res
    for g in groups:
        dist.destroy_process_group(g)


def _comm_case(rank, out):
    """One block on tp=4 with SP: forward bytes = 2 all-gathers + 2 reduce-scatters of [B, S_pad, h]."""
    from lightning_sp.comm.volume import tensor_parallel_elements
    from lightning_sp.models.layers import Block, TransformerConfig
    from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel

    for s in (16, 13):  # 13: padded to 16 inside the sequence-parallel region
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4)
        blk = Block(cfg).double()
        ctx = TensorParallelContext(group=None if WORLD == 1 else dist.group.WORLD, sequence_parallel=True)
        bind_tensor_parallel(blk, ctx)
        s_t = -(-s // WORLD)
        x = torch.randn(B, s_t, 32, dtype=torch.float64, requires_grad=True)
        pos = torch.arange(s).expand(B, s)
        y = blk(x, pos, None)
        fwd = ctx.comm.snapshot()
        ctx.comm.reset()
        y.sum().backward()
        bwd = ctx.comm.snapshot()
        out[f"comm/{s}"] = {
            "fwd": sum(fwd.values()), "bwd": sum(bwd.values()), "ops_fwd": dict(fwd),
            "analytic": tensor_parallel_elements(tokens=B * s_t * WORLD, hidden=32, world=WORLD) * 8,
        }


def _autocast_case(rank, out):
    """tp=4 with SP under CPU bf16 autocast (float32 weights): close to the float64 model, finite."""
    from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel

    ref = _model(8, 4, True)
    model = copy.deepcopy(ref).float()
    bind_tensor_parallel(model, TensorParallelContext(group=dist.group.WORLD))
    gen = torch.Generator().manual_seed(4)
    ids, labels = torch.randint(VOCAB, (B, S), generator=gen), torch.randint(VOCAB, (B, S), generator=gen)
    ref_loss = ref.cross_entropy(ref(ids), labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.cross_entropy(model(ids), labels)
    loss.backward()
    out["autocast"] = {"diff": abs(loss.item() - ref_loss.item()),
                       "finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()),
                       "dtypes": sorted({str(p.grad.dtype) for p in model.parameters()})}


def _clip_without_grads_case(rank, out):
    """``clip_grad_norm_`` on a tp group where one rank has no gradient at all (a layer it did not use): every
    rank returns the same global norm instead of the gradient-less rank skipping the all-reduces its peers wait in
    (a hang until the process-group timeout)."""
    from lightning_sp.tensor_parallel.grads import clip_grad_norm_

    module = nn.Module()
    module.w, module.b = nn.Parameter(torch.zeros(3, dtype=torch.float64)), nn.Parameter(torch.zeros(2, dtype=torch.float64))
    split = [torch.full((3,), float(r + 1), dtype=torch.float64) for r in range(WORLD)]
    if rank != WORLD - 1:
        module.w.grad, module.b.grad = split[rank].clone(), torch.full((2,), 0.5, dtype=torch.float64)
    norm = clip_grad_norm_(module, module.parameters(), 1e-3, sharded={"w"}, tp_group=dist.group.WORLD)
    split_sq = sum(float(g.pow(2).sum()) for g in split[:-1])
    want = (split_sq + (0.5 if rank != WORLD - 1 else 0.0)) ** 0.5  # replicated b counted once, locally
    out["clip_without_grads"] = abs(float(norm) - want)


def _worker(rank: int, world_size: int) -> dict:
    out: dict = {}
    _clip_without_grads_case(rank, out)
    pairs = [[0, 1], [2, 3]]
    _run_case(rank, "tp4/sp/gqa/causal", [[0, 1, 2, 3]], heads=8, kv=4, sequence_parallel=True, causal=True, out=out)
    _run_case(rank, "tp2/sp/gqa/bidirectional", pairs, heads=4, kv=2, sequence_parallel=True, causal=False, out=out)
    _run_case(rank, "tp2/no-sp/gqa/causal", pairs, heads=4, kv=2, sequence_parallel=False, causal=True, out=out)
    _comm_case(rank, out)
    _autocast_case(rank, out)
    # bad input: heads that tp does not divide fail at bind time, saying what would work
    from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel

    try:
        bind_tensor_parallel(_model(4, 2, True), TensorParallelContext(group=dist.group.WORLD))
        out["error"] = None
    except ValueError as err:
        out["error"] = str(err)
    # heads divide across TP first, then Ulysses: 8 heads / tp 4 = 2 per rank, which ulysses 4 cannot split
    try:
        bind_tensor_parallel(_model(8, 4, True), TensorParallelContext(group=dist.group.WORLD, ulysses_degree=4))
        out["ulysses_error"] = None
    except ValueError as err:
        out["ulysses_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, WORLD, timeout_s=240, pg_timeout_s=30)


CASES = ["tp4/sp/gqa/causal", "tp2/sp/gqa/bidirectional", "tp2/no-sp/gqa/causal"]


@pytest.mark.parametrize("name", CASES)
def test_tensor_parallel_equals_one_process(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert r["shapes_split"]
        assert r["logits"] < TOL, (rank, name, r)
        assert r["loss"] < TOL, (rank, name, r)
        assert r["argmax"], (rank, name)
        assert r["grad"] < 1e-10, (rank, name, r)
        assert r["grad_scale"] > 1e-3  # the comparison is not vacuous


@pytest.mark.parametrize("name", CASES[:2])
def test_negative_control_replicated_grads_need_tp_sum(results, name):
    # under SP, a norm's gradient on one rank covers only its S/t rows: without the sum over tp it is wrong
    for res in results:
        assert res[name]["control"] > 1e-4, res[name]


@pytest.mark.parametrize("s", [16, 13])
def test_comm_bytes_equal_analytic_volume(results, s):
    for res in results:
        c = res[f"comm/{s}"]
        assert c["fwd"] == c["analytic"], c  # 4 (t-1)/t * N h elements, N padded to a multiple of t
        assert set(c["ops_fwd"]) == {"all_gather", "reduce_scatter"}, c
        # backward: 2 reduce-scatters + 2 all-gathers of the gradients, and 2 re-gathers of the saved shards
        assert c["bwd"] == 1.5 * c["analytic"], c
    assert results[0]["comm/13"]["fwd"] == results[0]["comm/16"]["fwd"]  # padding rows are sent too
    assert results[0]["comm/16"]["fwd"] != 4 * 16 * B * 32 * 8  # negative control: not the t -> inf volume


def test_bf16_autocast_runs_close(results):
    for res in results:
        a = res["autocast"]
        assert a["finite"] and a["dtypes"] == ["torch.float32"], a
        assert a["diff"] < 5e-2, a


def test_heads_not_divisible_fail_with_fix(results):
    msg = results[0]["error"]
    assert msg is not None and "tensor_parallel_size=4 must divide both n_heads=4 and n_kv_heads=2" in msg
    assert "[1, 2] would work" in msg
    msg = results[0]["ulysses_error"]
    assert msg is not None and "n_heads/tensor_parallel_size = 8/4 = 2 query heads, which ulysses_degree=4" in msg
    assert "ulysses_degree in [1, 2] or tensor_parallel_size in [1, 2] would work" in msg


def test_clip_grad_norm_with_a_rank_without_gradients(results):
    assert all(res["clip_without_grads"] < 1e-12 for res in results), [r["clip_without_grads"] for r in results]
