"""The planner under bidirectional spans (Note [Layouts for bidirectional spans] in ``lightning_sp/planner.py``):
``plan(mask=AttentionMask(bidirectional_spans=...))`` and ``lightning-sp plan --bidirectional-span START:END`` price
each candidate that can take a layout on zigzag and on ``SequenceLayout.balanced_for`` the spans, keep the faster,
and say which; bad spans raise naming the fix. Predictions, no processes (the pricing itself is counted against
real ranks in ``tests/distributed/test_cost_model_counts.py``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_sp import cost_model as cm
from lightning_sp.layout import SequenceLayout
from lightning_sp.masks import AttentionMask
from lightning_sp.planner import (Candidate, ModelSpec, attention_pairs_per_layer, attention_per_layer, choose_layout,
                                  main, plan)

N = 65536
PREFIX = AttentionMask(bidirectional_spans=((0, N // 2),))
# 6 heads: no ulysses at sp = 4, so the candidates are the rings, allgather_kv and usp(ulysses=2)
MODEL = ModelSpec(name="prefix-lm", num_layers=2, hidden=384, num_heads=6, vocab=1000)
KW = dict(seq_len=N, devices=4, hardware="h100", sequence_parallel=4, tensor_parallel=1)
H100 = cm.preset("h100-80gb")


def test_a_half_prefix_at_p4_is_priced_below_zigzag_on_the_busiest_rank_and_recommended():
    p = plan(MODEL, mask=PREFIX, **KW)
    priced = [c for c in p.candidates if c.backend in cm.LAYOUT_BACKENDS]
    assert priced and all(len(c.layout_prices) == 2 for c in priced)
    for c in priced:
        u = c.ulysses_degree or 1
        table = SequenceLayout.balanced_for(N, 4, PREFIX, ulysses_degree=u)
        own = "zigzag" if u == 1 else f"zigzag(ulysses={u})"
        assert set(c.layout_prices) == {own, str(table)}
        # the busiest rank computes fewer pairs on the table than on zigzag (a 50% span unbalances zigzag)
        assert c.layout_prices[str(table)]["busiest_rank_pairs"] < c.layout_prices[own]["busiest_rank_pairs"], c.label
        # the kept layout is the faster one, and the candidate's layout is the one it was priced on
        faster = min(c.layout_prices, key=lambda k: (c.layout_prices[k]["attention_s"], k != own))
        assert c.layout == faster, c.label
        assert (c.chunk_ranks is None) == (c.layout == own)
        if c.chunk_ranks is not None:
            assert c.sequence_layout() == table
    # h100 preset, N = 64K (docs/guides/planning.md quotes these): whole-block rings keep zigzag (fewer pairs on the
    # busiest rank, but more and smaller calls), usp(ulysses=2) takes the table and is the fastest (model output)
    kept = {(c.backend, c.kv_pieces): c.layout for c in priced if c.backend != "allgather_kv"}
    assert kept[("zigzag_ring", 1)] == "zigzag" and kept[("usp", 1)].startswith("chunks("), kept
    rec = p.recommended
    assert (rec.backend, rec.ulysses_degree, rec.chunk_ranks) == ("usp", 2, SequenceLayout.balanced_for(
        N, 4, PREFIX, ulysses_degree=2).chunk_ranks)
    assert "layout: the chunk table balanced for the bidirectional spans" in p.reason
    assert "ulysses_degree=2" in p.reason and "layout=balanced" in rec.label
    doc = p.to_dict()
    assert doc["recommended"]["layout"] == rec.layout and doc["recommended"]["chunk_ranks"] == list(rec.chunk_ranks)
    # control: the same plan without the spans prices nothing twice and keeps every backend's own layout
    plain = plan(MODEL, **KW)
    assert all(not c.layout_prices and c.chunk_ranks is None for c in plain.candidates)
    assert {c.layout for c in plain.candidates} <= {"zigzag", "zigzag(ulysses=2)", "contiguous"}
    assert "layout:" not in plain.reason


def test_the_candidate_is_priced_on_its_layout():
    """The step time follows the layout: the same candidate on zigzag and on the table prices what
    ``cost_model.predict_attention(layout=)`` prices (the table's chunk runs), not the same number twice."""
    c = next(c for c in plan(MODEL, mask=PREFIX, **KW).candidates if c.backend == "zigzag_ring")
    on_zigzag = replace(c, chunk_ranks=None, layout="zigzag")
    on_table = replace(c, chunk_ranks=SequenceLayout.balanced_for(N, 4, PREFIX).chunk_ranks)
    args = (replace(MODEL, bidirectional_spans=PREFIX.bidirectional_spans), N, 1, 2, H100)
    shape = cm.AttentionShape(seq_len=N, num_heads=6, num_kv_heads=6, head_dim=64, dtype_bytes=2)
    for cand, layout in ((on_zigzag, None), (on_table, on_table.sequence_layout())):
        pred = cm.predict_attention("zigzag_ring", shape, 4, H100, kv_pieces=c.kv_pieces, mask=PREFIX, layout=layout)
        assert attention_per_layer(args[0], cand, *args[1:]) == (pred.compute_s, pred.exposed_comm_s)
        assert attention_pairs_per_layer(args[0], cand, *args[1:]) == pred.attention_pairs
    assert attention_pairs_per_layer(args[0], on_table, *args[1:]) < attention_pairs_per_layer(args[0], on_zigzag,
                                                                                                 *args[1:])


def test_plain_causal_keeps_zigzag():
    """Control: causal work that zigzag already balances (no span, or a one-token span, which is causal) keeps
    zigzag without pricing a table; the balanced table of a real span is another one."""
    cand = Candidate(backend="zigzag_ring", sequence_parallel_size=4, data_parallel_size=1, tensor_parallel_size=1,
                     ulysses_degree=None, kv_pieces=1, activation_checkpointing=False, tiled_loss=False)
    kw = dict(seq_len=N, batch=1, act_bytes=2, hw=H100)
    for spans in ((), ((0, 1),)):
        c = choose_layout(replace(MODEL, bidirectional_spans=spans), replace(cand), **kw)
        assert (c.layout, c.chunk_ranks, c.layout_prices) == ("zigzag", None, {}), spans
    c = choose_layout(replace(MODEL, bidirectional_spans=PREFIX.bidirectional_spans), replace(cand), **kw)
    assert len(c.layout_prices) == 2


def test_spans_alone_keep_the_configs_windows_and_a_window_with_spans_replaces_them():
    windowed = replace(MODEL, sliding_windows=((511, 0),) * 2)
    kw = dict(KW, seq_len=8192)
    spans = AttentionMask(bidirectional_spans=((0, 1024),))
    assert plan(windowed, mask=spans, **kw).model.sliding_windows == ((511, 0),) * 2
    both = plan(windowed, mask=AttentionMask(window=(255, 0), bidirectional_spans=((0, 1024),)), **kw).model
    assert both.sliding_windows == ((255, 0),) * 2 and both.bidirectional_spans == ((0, 1024),)
    assert "bidirectional [0, 1024)" in plan(windowed, mask=spans, **kw).to_dict()["attention_layers"][0]["attention"]


def test_plan_command_takes_bidirectional_spans_into_the_json(capsys):
    argv = ["--layers", "2", "--hidden", "384", "--heads", "6", "--vocab", "1000", "--seq-len", str(N), "--devices", "4",
            "--sequence-parallel", "4", "--tensor-parallel", "1", "--hardware", "h100", "--json"]
    assert main(argv + ["--bidirectional-span", f"0:{N // 2}"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["bidirectional_spans"] == [[0, N // 2]]
    assert all("layout" in c and "chunk_ranks" in c and "layout_prices" in c for c in doc["candidates"])
    direct = plan(MODEL, mask=PREFIX, **KW).to_dict()
    assert doc["recommended"]["layout"] == direct["recommended"]["layout"] != "zigzag(ulysses=2)"
    assert doc["recommended"]["chunk_ranks"] == direct["recommended"]["chunk_ranks"]
    # control: without the flag, no spans and the backend's own layouts
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["model"]["bidirectional_spans"] == [] and plain["recommended"]["chunk_ranks"] is None
    # two spans, given in any order
    assert main(argv + ["--bidirectional-span", "4096:8192", "--bidirectional-span", "0:1024"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["bidirectional_spans"] == [[0, 1024], [4096, 8192]]


@pytest.mark.parametrize("extra, message", [
    (["--bidirectional-span", f"0:{N + 1}"], f"reaches past the sequence (seq_len={N})"),
    (["--bidirectional-span", "100"], "--bidirectional-span takes START:END"),
    (["--bidirectional-span", "a:b"], "--bidirectional-span takes START:END"),
    (["--bidirectional-span", "500:100"], "0 <= start < end"),
    (["--bidirectional-span", "0:100", "--bidirectional-span", "50:200"], "sorted and disjoint"),
    (["--bidirectional-span", "0:100", "--encoder"], "need a causal model"),
])
def test_bad_spans_say_what_to_change(extra, message, capsys):
    argv = ["--layers", "2", "--hidden", "384", "--heads", "6", "--seq-len", str(N), "--devices", "4",
            "--hardware", "h100"]
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err


def test_plan_mask_with_spans_checks_them():
    with pytest.raises(ValueError, match="reaches past the sequence"):
        plan(MODEL, mask=AttentionMask(bidirectional_spans=((0, N + 8),)), **KW)
    with pytest.raises(ValueError, match="need a causal model"):
        plan(replace(MODEL, causal=False), mask=PREFIX, **KW)
