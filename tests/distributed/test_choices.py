"""The choices the library makes for users (``lightning_sp/choices.py``), attacked from outside on 4 gloo ranks:

- ``backend="auto"`` measures its candidates at the first call of a shape bucket: every rank ends on the same
  backend with the same measured times, the result is exact (fp64 vs dense), and a second process reads the
  decision from the per-machine cache instead of measuring;
- ranks whose caches disagree (one rank's file planted with another backend, one rank's unreadable) all
  measure instead of deadlocking on different collectives;
- close calls get ``EXTRA_ROUNDS`` more rounds, the same trials on every rank even when each rank's own times
  would call a different pair close;
- ``kv_pieces="auto"``: whole blocks without a budget (the same collectives as ``kv_pieces=1``), the fewest
  pieces that fit a ``memory_budget`` otherwise (exact), and the predicted peak bounds the allocator's
  measured peak from above, within 1.8x, at shapes that are not the model's calibration shapes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.reference import dense_attention

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]  # the spawns time out first (a hang fails fast)

WORLD = 4


def _exact(attn, n, h, h_kv, d, causal, seed, **call):
    """Max |error| of out, dq, dk, dv against dense fp64 attention, and the same for the other mask (a control)."""
    import torch.distributed as dist

    from lightning_sp import shard_sequence

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, n, x, d, generator=g, dtype=torch.float64) for x in (h, h_kv, h_kv, h))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qr, kr, vr, causal=causal)
    ref.backward(dout)
    ql, kl, vl, dl = (shard_sequence(t, group, layout=attn.layout) for t in (q, k, v, dout))
    ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
    out = attn(ql, kl, vl, seq_len=n, **call)
    out.backward(dl)
    errs = [(mine.detach() - shard_sequence(full.detach(), group, layout=attn.layout)).abs().max().item()
            for mine, full in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad))]
    wrong = dense_attention(q, k, v, causal=not causal)  # negative control: the other mask
    control = (out.detach() - shard_sequence(wrong, group, layout=attn.layout)).abs().max().item()
    return max(errs), control


def _auto_worker(rank, world, cache_root):
    import torch.distributed as dist

    from lightning_sp import SequenceParallelAttention, choices

    out = {}
    # 1. a fresh cache: measured, agreed, exact; 2. a new module (a new process's view): the cached decision
    os.environ["LIGHTNING_SP_CACHE_DIR"] = os.path.join(cache_root, "shared")
    for run in ("fresh", "cached"):
        attn = SequenceParallelAttention(causal=True, backend="auto", group=dist.group.WORLD, kernel="torch")
        err, control = _exact(attn, 75, 4, 2, 8, True, seed=1)
        choice = attn.context.auto_choice
        out[run] = {"label": choice.label, "source": choice.source, "measured": choice.measured,
                    "err": err, "control": control}
    # 3. caches that disagree: rank 2 planted with another label, rank 3's file unreadable, ranks 0 and 1 agree
    probe = SequenceParallelAttention(causal=False, backend="auto", group=dist.group.WORLD, kernel="torch")
    _exact(probe, 40, 4, 4, 8, False, seed=2)
    first = probe.context.auto_choice
    os.environ["LIGHTNING_SP_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")
    path = choices.auto_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    other = next(label for label in first.measured if label != first.label)
    planted = {0: first.label, 1: first.label, 2: other}
    path.write_text(json.dumps({first.cache_key: planted[rank]}) if rank in planted else "{not json")
    attn = SequenceParallelAttention(causal=False, backend="auto", group=dist.group.WORLD, kernel="torch")
    err, control = _exact(attn, 40, 4, 4, 8, False, seed=3)
    choice = attn.context.auto_choice
    out["disagree"] = {"label": choice.label, "source": choice.source, "measured": choice.measured,
                       "err": err, "control": control}
    # 4. close calls get more rounds, decided from the agreed medians: each rank alone would call a different
    # pair close (rank 3 sees "b" fastest, the others "a"), yet every rank runs the same trials
    import time

    for case, delays in {"close": {"a": 0.010, "b": 0.0105, "c": 0.03}, "clear": {"a": 0.010, "b": 0.03, "c": 0.03}}.items():
        mine = dict(delays, b=0.009) if rank == 3 and case == "close" else delays
        calls = {label: 0 for label in mine}

        def fake_run(label, mine=mine, calls=calls):
            calls[label] += 1
            time.sleep(mine[label])

        measured = choices.measure_candidates(fake_run, list(mine), dist.group.WORLD, torch.device("cpu"))
        out[case] = {"calls": calls, "measured": measured}
    return out


def _pieces_worker(rank, world):
    import torch.distributed as dist

    from experiments.common.memory import attention_peak_bytes
    from lightning_sp import SequenceParallelAttention, choices, shard_sequence
    from lightning_sp.ops import ring_attention

    ring_attention.MIN_PIECE_TOKENS = 16
    group = dist.group.WORLD
    out = {}
    # whole blocks without a budget: the same collectives as kv_pieces=1, fewer than kv_pieces=4
    calls = {}
    for name, kw in (("auto", {}), ("one", {"kv_pieces": 1}), ("four", {"kv_pieces": 4})):
        attn = SequenceParallelAttention(causal=True, backend="zigzag_ring", group=group, kernel="torch", **kw)
        _exact(attn, 256, 4, 2, 8, True, seed=4)
        calls[name] = dict(attn.comm_stats.calls_by_op)
    out["calls"] = calls
    # a budget: the fewest pieces whose predicted peak fits; exact
    chosen = {}
    for backend in ("ring", "zigzag_ring", "usp"):
        shard = 256 // world
        peak = lambda p, b=backend: choices.predicted_peak_bytes(  # noqa: E731
            b, batch=1, shard_len=shard, num_heads=4, num_kv_heads=2, head_dim=8, element_size=8, world=world, pieces=p)
        budget = (peak(2) + peak(4)) // 2  # 2 pieces do not fit, 4 do
        attn = SequenceParallelAttention(causal=True, backend=backend, group=group, kernel="torch",
                                         memory_budget=budget)
        err, control = _exact(attn, 256, 4, 2, 8, True, seed=5)
        chosen[backend] = (sorted(attn.context.kv_pieces_choices.values()), err, control)
    out["chosen"] = chosen
    # the model bounds the allocator's peak at shapes other than its calibration shape
    ring_attention.MIN_PIECE_TOKENS = 128
    ratios = {}
    for n, h, h_kv, d in ((2048, 8, 8, 64), (2048, 16, 4, 32)):  # not the calibration shapes
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, n, x, d, generator=g) for x in (h, h_kv, h_kv, h)]
        for backend in ("ring", "zigzag_ring", "allgather_kv", "ulysses", "usp"):
            for pieces in (1, 4):
                attn = SequenceParallelAttention(causal=True, backend=backend, group=group, kernel="sdpa",
                                                 kv_pieces=pieces, validate_inputs=False,
                                                 memory_budget=1 << 40)  # the model serves budgets: a budget in
                # force, as when it is used (whole-block rings then make no head-major copies: Note [Head-major blocks])
                q, k, v, dout = (shard_sequence(t, group, layout=attn.layout).clone() for t in full)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                peak, inputs = attention_peak_bytes(attn, q, k, v, dout, seq_len=n, group=group)
                actual = peak + inputs
                predicted = choices.predicted_peak_bytes(
                    backend, batch=1, shard_len=n // world, num_heads=h, num_kv_heads=h_kv, head_dim=d,
                    element_size=4, world=world, pieces=pieces)
                ratios[(n, h, h_kv, d, backend, pieces)] = predicted / actual
    out["ratios"] = ratios
    return out


@pytest.fixture(scope="module")
def auto_results(tmp_path_factory):
    return run_on_ranks(_auto_worker, WORLD, args=(str(tmp_path_factory.mktemp("auto_cache")),), timeout_s=400,
                        pg_timeout_s=60)


@pytest.fixture(scope="module")
def pieces_results():
    return run_on_ranks(_pieces_worker, WORLD, timeout_s=800, pg_timeout_s=120)


def test_auto_measures_agrees_and_is_exact(auto_results):
    fresh = [r["fresh"] for r in auto_results]
    assert fresh[0]["source"] == "measured" and len(fresh[0]["measured"]) >= 3, fresh[0]
    assert all(r["label"] == fresh[0]["label"] and r["measured"] == fresh[0]["measured"] for r in fresh), fresh
    assert fresh[0]["label"] == min(fresh[0]["measured"], key=fresh[0]["measured"].get)
    for r in fresh:
        assert r["err"] < 1e-10 and r["control"] > 1e-3, r


def test_auto_reads_the_machines_cache(auto_results):
    for r in auto_results:
        assert r["cached"]["source"] == "cached measurement", r["cached"]
        assert r["cached"]["label"] == r["fresh"]["label"]
        assert r["cached"]["err"] < 1e-10 and r["cached"]["control"] > 1e-3


def test_caches_that_disagree_make_every_rank_measure(auto_results):
    rows = [r["disagree"] for r in auto_results]
    assert all(r["source"] == "measured" for r in rows), rows
    assert len({r["label"] for r in rows}) == 1 and all(r["measured"] == rows[0]["measured"] for r in rows)
    for r in rows:
        assert r["err"] < 1e-10 and r["control"] > 1e-3, r


def test_no_budget_means_whole_blocks(pieces_results):
    calls = pieces_results[0]["calls"]
    assert calls["auto"] == calls["one"], calls
    assert sum(calls["four"].values()) > sum(calls["one"].values()), calls  # the control sees pieces


def test_a_budget_picks_the_fewest_pieces_that_fit(pieces_results):
    for r in pieces_results:
        for backend, (pieces, err, control) in r["chosen"].items():
            assert pieces == [4], (backend, pieces)
            assert err < 1e-10 and control > 1e-3, (backend, err)


def test_predicted_peak_bounds_the_measured_one(pieces_results):
    worst = {}
    for r in pieces_results:  # max over ranks of measured = min over ranks of the ratio
        for key, ratio in r["ratios"].items():
            worst[key] = min(worst.get(key, ratio), ratio)
    bad = {k: round(v, 3) for k, v in worst.items() if not 1.0 <= v <= 1.8}
    assert not bad, f"predicted / measured peak outside [1, 1.8]: {bad}"


def test_close_calls_get_more_rounds_on_every_rank(auto_results):
    from lightning_sp.choices import CLOSE, EXTRA_ROUNDS, ROUNDS

    assert 0.0105 / 0.010 < CLOSE < 0.03 / 0.0105  # the delays below make a close pair and a clear winner
    base, more = 1 + ROUNDS, 1 + ROUNDS + EXTRA_ROUNDS
    for r in auto_results:
        assert r["close"]["calls"] == {"a": more, "b": more, "c": base}, r["close"]
        assert r["clear"]["calls"] == {"a": base, "b": base, "c": base}, r["clear"]  # control: no extra rounds
        assert r["close"]["measured"] == auto_results[0]["close"]["measured"]  # agreed: MAX over the ranks
        assert r["close"]["measured"]["a"] >= 0.010 and r["close"]["measured"]["b"] >= 0.0105
