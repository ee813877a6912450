"""The cost model under a mask (Note [Cost model under a mask] in ``lightning_sp/cost_model.py``), without
processes: the mask resolved as the module resolves it, the bytes the committed measurement counted, the compute
a window leaves, and ``backend="auto"``'s choice with and without a window. (Counted against real ranks:
``tests/distributed/test_cost_model_counts.py``.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_sp import cost_model as cm
from lightning_sp.attention import _doc_bounds, _mask_fields, auto_choice
from lightning_sp.masks import AttentionMask, RelativePositionBias
from lightning_sp.ops.schedule import resolve_masking

H100 = cm.preset("h100-80gb")
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/masks/results/2026-11-28_traffic-and-window.json"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len,padded", [(1000, 1000), (1000, 1024)])
@pytest.mark.parametrize("mask,cu", [
    (None, None), (None, (0, 300, 1000)), (AttentionMask(window=(99, 0)), None),
    (AttentionMask(window=(40, 40)), (0, 500, 1000)), (AttentionMask(chunk_size=256), None),
    (AttentionMask(bidirectional_spans=((10, 200),)), None), (AttentionMask(softcap=30.0), None), (AttentionMask(), None),
])
def test_masking_is_resolved_as_the_module_resolves_it(mask, cu, causal, seq_len, padded):
    got = resolve_masking(mask, cu, causal=causal, seq_len=seq_len, padded_len=padded)
    if mask is not None and mask.signature() == AttentionMask().signature():
        mask = None  # the module drops an empty mask before it resolves one
    if mask is None and cu is None:  # unmasked: the model as before (padding computed like tokens)
        assert got == resolve_masking(None, None, causal=causal, seq_len=seq_len, padded_len=padded)
        assert got.mask is None and got.doc_bounds is None and not got.follow
        return
    bounds = _doc_bounds(cu, seq_len, padded)
    want = _mask_fields(mask, None, causal, bounds, padded, follow=cu is not None)
    assert got.doc_bounds == (None if bounds is None else tuple(bounds))
    assert got.mask == want.get("mask") and got.follow == want["follow_mask"]


def test_resolve_masking_rejects_documents_that_do_not_cover_the_sequence():
    with pytest.raises(ValueError, match="doc_bounds must run from 0 to seq_len=1000"):
        resolve_masking(None, (0, 300, 900), causal=True, seq_len=1000, padded_len=1000)


def _benchmark_inputs(row, meta):
    from benchmarks.masks.run import protein_docs

    shape = cm.AttentionShape(seq_len=row["N"], num_heads=meta["heads"], num_kv_heads=meta["kv_heads"],
                              head_dim=meta["head_dim"], dtype_bytes=4, causal=meta["causal"])
    if row["case"] == "docs":
        return shape, dict(cu_seqlens=tuple(protein_docs(row["N"])))
    return shape, dict(mask=AttentionMask(window=(511, 0)))


def test_model_counts_the_bytes_the_mask_benchmark_measured():
    data = json.loads(RESULTS.read_text())
    assert len(data["rows"]) >= 30  # every rank of packed documents and of the window at three lengths
    for row in data["rows"]:
        shape, masking = _benchmark_inputs(row, data["meta"])
        got = cm.rank_counts(row["backend"], shape, row["P"], ranks=[row["rank"]], **masking)[0].bytes_by_op
        ring = got.get("ring_send", 0) + got.get("ring_send_grad", 0)
        assert ring == row["fwd_bwd_bytes"] and set(got) <= {"ring_send", "ring_send_grad"}, (row, got)
        # negative control: the model blind to the mask counts the traffic before it followed the mask
        blind = cm.rank_counts(row["backend"], shape, row["P"], ranks=[row["rank"]])[0].bytes_by_op
        if row["backend"] != "allgather_kv":  # (all-gather + reduce-scatter without the mask: other operations)
            assert blind["ring_send"] + blind["ring_send_grad"] == row["today_fwd_bwd_bytes"] != ring, (row, blind)
    # a sliding window's bytes per rank do not grow with N; the blind model's do
    window = {(r["N"], r["P"], r["rank"]): r["fwd_bwd_bytes"] for r in data["rows"] if r["case"] == "window"}
    assert window[(16384, 4, 1)] == window[(65536, 4, 1)] > 0


def test_window_prices_the_compute_it_leaves():
    shape = cm.AttentionShape(seq_len=65536, num_heads=32, num_kv_heads=8, head_dim=128)
    window = AttentionMask(window=(4095, 0))
    for backend, u in (("zigzag_ring", None), ("ulysses", None), ("usp", 2), ("allgather_kv", None)):
        full = cm.predict_attention(backend, shape, 4, H100, ulysses_degree=u)
        win = cm.predict_attention(backend, shape, 4, H100, ulysses_degree=u, mask=window)
        # every rank computes about its share of N W H pairs, not its share of the causal N^2 / 2 H
        share = 65536 / 4 * 4096 * 32
        assert 0.95 * share <= win.attention_pairs < 1.1 * share, (backend, win.attention_pairs / share)
        assert full.attention_pairs >= 65536 ** 2 / 2 * 32 / 4
        # time falls less than the pairs: the window's partial tiles are small DENSE calls (MASK_TILE = 128),
        # which the GPU presets price at a small block's rate
        assert win.compute_s < 0.6 * full.compute_s, backend
    # traffic: the ring's follows the window, Ulysses' all-to-alls do not shrink
    ring = [cm.predict_attention("zigzag_ring", shape, 4, H100, mask=m).comm_bytes for m in (None, window)]
    uly = [cm.predict_attention("ulysses", shape, 4, H100, mask=m).comm_bytes for m in (None, window)]
    assert ring[1] < 0.5 * ring[0] and uly[1] == uly[0]
    # K/V in pieces follows the mask too, with the bytes of whole blocks (Note [Traffic follows the mask])
    pieces = [cm.predict_attention("zigzag_ring", shape, 4, H100, kv_pieces=4, mask=m).comm_bytes for m in (None, window)]
    assert pieces[1] == ring[1] < 0.5 * pieces[0]
    # one rank: the local call's compute under the window too
    one = [cm.predict_attention("zigzag_ring", shape, 1, H100, mask=m) for m in (None, window)]
    assert one[1].attention_pairs < 0.2 * one[0].attention_pairs


def test_auto_follows_a_sliding_window_and_is_unchanged_without_one():
    shape = cm.AttentionShape(seq_len=131072, num_heads=32, num_kv_heads=8, head_dim=128)
    hw = replace(H100, ranks_per_node=4)
    plain = cm.choose_backend(shape, 4, hw)
    window = cm.choose_backend(shape, 4, hw, mask=AttentionMask(window=(511, 0)))
    # without a mask: Ulysses, as before (the mask-blind pricing); an empty mask and mask=None are that too
    assert plain.backend == "ulysses", plain.summary()
    for same in (cm.choose_backend(shape, 4, hw, mask=None), cm.choose_backend(shape, 4, hw, mask=AttentionMask())):
        assert [(p.label, p.total_s) for p in same.predictions] == [(p.label, p.total_s) for p in plain.predictions]
    # W << N: the ring that sends the window's rows, not the all-to-alls that move every row
    assert window.backend == "zigzag_ring", window.summary()
    by = {p.label: p for p in window.predictions}
    assert by["zigzag_ring"].comm_bytes < 0.05 * by["ulysses"].comm_bytes
    # the module's entry point passes the mask on
    got = auto_choice(32, 4, seq_len=131072, num_kv_heads=8, head_dim=128, hardware=hw,
                      mask=AttentionMask(window=(511, 0)))
    assert got.backend == "zigzag_ring"


# ------------------------------------------------------------------------------------------------ the planner

MISTRAL = {"model_type": "mistral", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 2816, "vocab_size": 32000, "sliding_window": 512,
           "hidden_act": "silu"}


def _hf_configs():
    """transformers' own configs (their ``layer_types`` are the truth), as dicts without ``layer_types``."""
    tf = pytest.importorskip("transformers")
    cases = {
        "mistral": tf.MistralConfig(num_hidden_layers=4, sliding_window=4096),
        "qwen2": tf.Qwen2Config(num_hidden_layers=6, use_sliding_window=True, sliding_window=4096, max_window_layers=2),
        "qwen2-off": tf.Qwen2Config(num_hidden_layers=6, sliding_window=4096, max_window_layers=2),
        "gemma2": tf.Gemma2Config(num_hidden_layers=5, sliding_window=4096),
        "gemma3": tf.Gemma3TextConfig(num_hidden_layers=12, sliding_window=1024),
        "modernbert": tf.ModernBertConfig(num_hidden_layers=7, local_attention=128),
    }
    out = {}
    for name, cfg in cases.items():
        d = cfg.to_dict()
        truth = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
        if name == "qwen2-off":
            truth = ["full_attention"] * cfg.num_hidden_layers
        d.pop("layer_types", None)
        if name == "gemma3":
            d["sliding_window_pattern"] = 6  # as the Hub's Gemma-3 configs write it
        out[name] = (d, truth)
    return out


def test_hf_configs_give_each_layers_window_as_transformers_does():
    from lightning_sp.planner import ModelSpec, hf_sliding_windows

    expected_window = {"mistral": (4095, 0), "qwen2": (4095, 0), "gemma2": (4095, 0), "gemma3": (1023, 0),
                       "modernbert": (64, 64), "qwen2-off": None}
    for name, (cfg, truth) in _hf_configs().items():
        layers = len(truth)
        want = tuple(expected_window[name] if t == "sliding_attention" else None for t in truth)
        if name == "qwen2-off":
            want = ()
        got = hf_sliding_windows(cfg, layers, cfg["model_type"])  # the model type's rule
        assert got == want, (name, got, truth)
        listed = hf_sliding_windows({**cfg, "layer_types": truth}, layers, cfg["model_type"])  # the config's list
        assert (listed if any(listed) else ()) == want, name  # every layer full: () or all None alike
        assert ModelSpec.from_hf_config(cfg).sliding_windows == want, name
    # the mixes the task is about: Gemma-3 five local of six, Gemma-2 every other, ModernBERT two of three
    cfgs = _hf_configs()
    assert sum(w is not None for w in hf_sliding_windows(cfgs["gemma3"][0], 12, "gemma3_text")) == 10
    assert sum(w is not None for w in hf_sliding_windows(cfgs["gemma2"][0], 5, "gemma2")) == 3
    assert hf_sliding_windows({"model_type": "llama", "sliding_window": None}, 4, "llama") == ()


def test_planner_prices_each_layers_window():
    from lightning_sp import planner
    from lightning_sp.planner import ModelSpec, attention_per_layer

    windowed = ModelSpec.from_hf_config(MISTRAL)
    full = replace(windowed, sliding_windows=())
    assert windowed.sliding_windows == ((511, 0),) * 4
    kw = dict(seq_len=32768, devices=4, hardware="h100", sequence_parallel=4, tensor_parallel=1)
    got = {c.label: c for c in planner.plan(windowed, **kw).candidates}
    before = {c.label: c for c in planner.plan(full, **kw).candidates}
    assert got.keys() == before.keys()
    for label, c in got.items():  # a window of 512 at N = 32K: far less attention compute on every layout
        assert c.time["attention_compute_s"] < 0.5 * before[label].time["attention_compute_s"], label
        assert c.peak_bytes_per_rank == before[label].peak_bytes_per_rank  # memory: not the mask's business
    # the mean over the layers: half windowed is the mean of all windowed and none
    c = next(iter(planner.plan(windowed, **kw).candidates))
    half = replace(windowed, sliding_windows=((511, 0), None) * 2)
    args = (32768, 1, 2, cm.preset("h100-80gb"))
    mixed, win, none = (attention_per_layer(m, c, *args) for m in (half, windowed, full))
    assert mixed[0] == pytest.approx((win[0] + none[0]) / 2, rel=1e-12) and win[0] < none[0]
    # plan(mask=) puts one window on every layer, and mask=None keeps the config's
    from lightning_sp.masks import AttentionMask

    masked = planner.plan(full, mask=AttentionMask(window=(511, 0)), **kw)
    assert masked.model.sliding_windows == windowed.sliding_windows
    assert [x.step_time_s for x in masked.candidates] == [x.step_time_s for x in planner.plan(windowed, **kw).candidates]
    with pytest.raises(ValueError, match="key padding, mask_mod and score_mod callables are not planned"):
        planner.plan(full, mask=AttentionMask(key_padding=((0, 64),)), **kw)
    with pytest.raises(ValueError, match="one per layer"):
        attention_per_layer(replace(windowed, sliding_windows=((511, 0),)), c, *args)


def test_plan_command_takes_a_sliding_window(capsys, tmp_path):
    from lightning_sp import planner

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MISTRAL, "sliding_window": None}))
    base = ["--model", str(path), "--seq-len", "32768", "--devices", "4", "--sequence-parallel", "4",
            "--tensor-parallel", "1", "--json"]
    assert planner.main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert planner.main(base + ["--sliding-window", "512"]) == 0
    windowed = json.loads(capsys.readouterr().out)
    assert plain["model"]["sliding_windows"] == [] and windowed["model"]["sliding_windows"] == [[511, 0]] * 4
    times = [{c["backend"] + str(c["kv_pieces"]): c["time"]["attention_compute_s"] for c in p["candidates"]}
             for p in (plain, windowed)]
    assert all(times[1][k] < times[0][k] for k in times[0])
    assert planner.main(base[:-1] + ["--sliding-window", "512"]) == 0
    assert "attention per layer (priced per layer): layers 0-3 (4 of 4): window (511, 0), plain kernel" in \
        capsys.readouterr().out
    assert planner.main(base + ["--sliding-window", "0"]) == 2
    assert "--sliding-window must be >= 1" in capsys.readouterr().err


def test_masks_docs_example_runs_and_shows_auto_following_the_window(capsys):
    import re

    text = (Path(__file__).resolve().parents[2] / "docs/guides/planning.md").read_text()
    block = re.search(r"<!-- test: masks example[^>]*-->\s*```python\n(.*?)```", text, re.DOTALL).group(1)
    exec(compile(block, "docs/guides/planning.md", "exec"), {"__name__": "docs_example"})  # noqa: S102
    out = capsys.readouterr().out
    assert re.findall(r"auto would run: (\w+)", out) == ["ulysses", "zigzag_ring"], out
    assert re.search(r"zigzag_ring .* sends +16 MiB", out) and re.search(r"zigzag_ring .* sends +1792 MiB", out), out


# ------------------------------------------------------------------------ chunked layers, score modifiers, sinks

CHUNK_SHAPE = cm.AttentionShape(seq_len=1536, num_heads=4, num_kv_heads=2, head_dim=16, dtype_bytes=4)
CHUNK_BACKENDS = (("zigzag_ring", None), ("ring", None), ("ulysses", None), ("allgather_kv", None), ("usp", 2))


@pytest.mark.parametrize("chunk", [384, 200])
def test_chunked_layer_is_counted_as_the_library_plans_it(chunk):
    """Llama-4's chunked layers as the Hugging Face integration runs them (documents cut at every multiple of the
    chunk, ``_chunk_boundaries``) and as the planner prices them (``LayerAttention.cu_seqlens``) count per rank the
    pairs and bytes of ``AttentionMask(chunk_size=)`` (checked on real ranks in ``test_cost_model_counts.py``)."""
    import torch

    from lightning_sp.integrations.transformers import _chunk_boundaries
    from lightning_sp.planner import LayerAttention

    n, h = CHUNK_SHAPE.seq_len, CHUNK_SHAPE.num_heads
    bounds = tuple(int(b) for b in _chunk_boundaries(None, n, torch.arange(n)[None], chunk))
    assert LayerAttention(chunk_size=chunk).cu_seqlens(n) == bounds
    for backend, u in CHUNK_BACKENDS:
        for world in (2, 4):
            if backend == "usp" and world == 2:
                continue
            by_mask = cm.rank_counts(backend, CHUNK_SHAPE, world, ulysses_degree=u, mask=AttentionMask(chunk_size=chunk))
            by_docs = cm.rank_counts(backend, CHUNK_SHAPE, world, ulysses_degree=u, cu_seqlens=bounds)
            full = cm.rank_counts(backend, CHUNK_SHAPE, world, ulysses_degree=u)
            assert [(c.pairs, c.bytes_by_op) for c in by_mask] == [(c.pairs, c.bytes_by_op) for c in by_docs], backend
            # negative control: the layer priced as full attention computes more on some rank
            assert max(c.pairs for c in by_mask) < max(c.pairs for c in full), (backend, world)
            if chunk % 128 == 0:  # chunks on MASK_TILE bounds: no partial tile, every rank's pairs add up to the
                lengths = [b - a for a, b in zip(bounds, bounds[1:])]  # causal squares of the chunks
                assert sum(c.pairs for c in by_mask) == h * sum(c * (c + 1) / 2 for c in lengths), (backend, world)
    one = cm.rank_counts("local", CHUNK_SHAPE, 1, cu_seqlens=bounds)[0].pairs
    assert one == h * sum((b - a) * (b - a + 1) / 2 for a, b in zip(bounds, bounds[1:]))
    # priced exactly as documents: the same prediction either way, below the full layer's
    by = [cm.predict_attention("zigzag_ring", CHUNK_SHAPE, 4, H100, **m).total_s
          for m in (dict(mask=AttentionMask(chunk_size=chunk)), dict(cu_seqlens=bounds), {})]
    assert by[0] == by[1] < by[2]


def _constant_factors(**factors):
    """A profile whose score-modifier factors are constants (one row each: interpolation clamps to it)."""
    rows = tuple((m, "full", 64, 1024, f, f) for m, f in factors.items())
    return replace(H100, score_mod_factors=rows, sinks_s=())


SOFTCAP, ALIBI = AttentionMask(softcap=30.0), AttentionMask(softcap=30.0, alibi_slopes=(0.5,) * 32)


def test_score_modified_calls_are_priced_at_the_factor_on_every_backend():
    hw = _constant_factors(blockwise=3.0, softcap=4.0, alibi=3.5)
    shape = cm.AttentionShape(seq_len=16384, num_heads=32, num_kv_heads=8, head_dim=128)
    for backend, u in (("zigzag_ring", None), ("ulysses", None), ("usp", 2), ("allgather_kv", None)):
        plain = cm.predict_attention(backend, shape, 4, hw, ulysses_degree=u)
        window = AttentionMask(window=(1023, 0))
        for mask, factor in ((SOFTCAP, 4.0), (ALIBI, 3.0 + 1.0 + 0.5)):  # the path, plus each modifier's extra
            got = cm.predict_attention(backend, shape, 4, hw, ulysses_degree=u, mask=mask)
            # control: the modifiers ignored (no factors) price the same calls (a mask plans on global ranges) plainly
            blind = cm.predict_attention(backend, shape, 4, replace(hw, score_mod_factors=()), ulysses_degree=u,
                                         mask=mask)
            assert got.compute_s == pytest.approx(factor * blind.compute_s, rel=1e-9), backend  # every call's time
            assert got.total_s > 2 * blind.total_s and blind.kernel_path == got.kernel_path  # (what runs is the same)
            assert (got.attention_pairs, got.comm_bytes) == (plain.attention_pairs, plain.comm_bytes)  # the same pairs
            assert got.kernel_path.startswith("score_mods(softcap") and plain.kernel_path == "plain"
        # with a window: the window's calls, each at the factor
        win = cm.predict_attention(backend, shape, 4, hw, ulysses_degree=u, mask=window)
        both = cm.predict_attention(backend, shape, 4, hw, ulysses_degree=u,
                                    mask=AttentionMask(window=(1023, 0), softcap=30.0))
        assert both.compute_s == pytest.approx(4.0 * win.compute_s, rel=1e-9) and both.comm_bytes == win.comm_bytes
        assert both.attention_pairs == win.attention_pairs < 0.2 * plain.attention_pairs
    counts = cm.rank_counts("zigzag_ring", shape, 4, mask=SOFTCAP)
    assert all(c.score_mod_pairs == c.pairs > 0 for c in counts)
    assert all(c.score_mod_pairs == 0 for c in cm.rank_counts("zigzag_ring", shape, 4, mask=AttentionMask(window=(9, 0))))


def test_calibrated_factor_prices_a_layer_above_the_plain_one():
    """The uncalibrated CPU profile carries the measured factors (``score_mods_calibration.json``); a layer of one
    CAUSAL call at a measured point (D = 32, side 512) costs its forward and backward times their factors."""
    from lightning_sp.ops.schedule import KernelCall

    data = json.loads((Path(__file__).resolve().parents[2]
                       / "experiments/cost_model/results/score_mods_calibration.json").read_text())
    measured = {(m, k, d, s): (f, b) for m, k, d, s, f, b in data["score_mod_factors"]}
    hw = cm.preset("cpu-default")
    assert {r[:4]: tuple(r[4:]) for r in hw.score_mod_factors} == {
        k: (round(f, 2), round(b, 2)) for k, (f, b) in measured.items()}  # the preset is the measurement, rounded
    shape = cm.AttentionShape(seq_len=512, num_heads=4, num_kv_heads=2, head_dim=32, dtype_bytes=4)
    fwd, bwd = (hw.kernel_time(KernelCall(512, 512, "causal", 4, 2, backward), 32) for backward in (False, True))
    plain = cm.predict_attention("zigzag_ring", shape, 1, hw)
    assert plain.total_s == pytest.approx(fwd + bwd, rel=1e-12)
    bias = AttentionMask(relative_bias=RelativePositionBias(torch.zeros(32, 4, requires_grad=True)))
    for mask, name in ((SOFTCAP, "softcap"), (bias, "relative_bias")):
        f, b = hw.score_mod_factors[[r[:4] for r in hw.score_mod_factors].index((name, "causal", 32, 512))][4:]
        got = cm.predict_attention("zigzag_ring", shape, 1, hw, mask=mask)
        assert got.total_s == pytest.approx(f * fwd + b * bwd, rel=1e-12), name
        assert got.total_s > 2 * plain.total_s
        # control: the same layer with the modifiers ignored (no factors) is the plain price, not the measured one
        blind = cm.predict_attention("zigzag_ring", shape, 1, replace(hw, score_mod_factors=()), mask=mask)
        assert blind.total_s == plain.total_s != got.total_s
    # sinks: the per-row term, once per rank, on top of the plain or the modified layer
    with_sinks = cm.predict_attention("zigzag_ring", shape, 1, hw, sinks=True)
    assert with_sinks.total_s - plain.total_s == pytest.approx(hw.sinks_time(512 * 4 * 32), rel=1e-9)
    assert with_sinks.kernel_path == "plain + sinks" and hw.sinks_time(512 * 4 * 32) > 0
    assert cm.predict_attention("zigzag_ring", shape, 1, replace(hw, sinks_s=()), sinks=True).total_s == plain.total_s
    # a profile round-trips its factors and sinks, and the calibration step adds them to a calibrated profile
    assert cm.HardwareProfile.from_dict(hw.to_dict()) == hw
    from experiments.cost_model.score_mods import with_score_mods

    calibrated = with_score_mods(replace(hw, score_mod_factors=(), sinks_s=()), data)
    assert [r[:4] for r in calibrated.score_mod_factors] == [r[:4] for r in hw.score_mod_factors]
    assert calibrated.sinks_time(512 * 4 * 32) == pytest.approx(hw.sinks_time(512 * 4 * 32), rel=0.01)
    # every GPU preset the planner knows prices them (an assumption, named in its source)
    from lightning_sp.planner import hardware_profile

    for name in ("a100", "h100", "h800", "h200", "b200", "h200-measured"):
        gpu = hardware_profile(name)
        assert gpu.score_mod_factors and gpu.sinks_s and "score modifiers: assumption" in gpu.source, name


def test_auto_prices_score_modifiers():
    shape = cm.AttentionShape(seq_len=65536, num_heads=32, num_kv_heads=8, head_dim=128)
    hw = replace(H100, ranks_per_node=4)
    plain = {p.label: p for p in cm.choose_backend(shape, 4, hw).predictions}
    modded = cm.choose_backend(shape, 4, hw, mask=SOFTCAP, sinks=True)
    for p in modded.predictions:  # every candidate at the score-modifying kernel's price (an assumption on GPUs)
        assert p.compute_s > 5 * plain[p.label].compute_s and p.kernel_path == "score_mods(softcap) + sinks"
    assert "assumption (ScoreModKernel" in H100.source
    # the module's entry point passes the mask's modifiers on
    got = auto_choice(32, 4, seq_len=65536, num_kv_heads=8, head_dim=128, hardware=hw, mask=SOFTCAP)
    same = cm.choose_backend(shape, 4, hw, mask=SOFTCAP, usp_allowed=False)
    assert [p.total_s for p in got.predictions] == [p.total_s for p in same.predictions]


def _tiny_hf_configs():
    """transformers' own configs of the families whose layers attend differently (tiny sizes)."""
    tf = pytest.importorskip("transformers")
    small = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)
    return {
        "gemma2": tf.Gemma2Config(num_hidden_layers=4, sliding_window=512, **small),
        "gpt_oss": tf.GptOssConfig(num_hidden_layers=4, num_local_experts=4, **small),
        "llama4": tf.Llama4TextConfig(num_hidden_layers=8, attention_chunk_size=1024, **small),
        "t5": tf.T5Config(num_layers=3, d_model=256, num_heads=4, d_kv=64, d_ff=512),
    }


def test_planner_reads_each_layers_attention_path_from_hf_configs(capsys):
    from lightning_sp import planner
    from lightning_sp.planner import ModelSpec, attention_layers, attention_per_layer

    cfgs = _tiny_hf_configs()
    want = {
        "gemma2": [([0, 2], "window (511, 0), score-modifying kernel (softcap)"),
                   ([1, 3], "full, score-modifying kernel (softcap)")],
        "gpt_oss": [([0, 2], "window (127, 0), plain kernel + sinks"), ([1, 3], "full, plain kernel + sinks")],
        "llama4": [([0, 1, 2, 4, 5, 6], "chunks of 1024, plain kernel"), ([3, 7], "full, plain kernel")],
        "t5": [([0, 1, 2], "full, score-modifying kernel (relative_bias)")],
    }
    c = planner.Candidate(backend="zigzag_ring", sequence_parallel_size=4, data_parallel_size=1,
                          tensor_parallel_size=1, ulysses_degree=None, kv_pieces=1, activation_checkpointing=False,
                          tiled_loss=False)
    args = (16384, 1, 2, H100)
    for name, cfg in cfgs.items():
        d = cfg.to_dict()
        m = ModelSpec.from_hf_config(d)
        assert [(g["layers"], g["attention"]) for g in attention_layers(m)] == want[name], name
        if name in ("llama4", "gpt_oss"):  # transformers' rule without the listed layer_types
            d.pop("layer_types")
            assert attention_layers(ModelSpec.from_hf_config(d)) == attention_layers(m), name
        # each path priced: the modifiers and sinks above the same layers without them, chunks below full
        bare = replace(m, attention_softcap=None, relative_bias=False, attention_sinks=False, chunk_sizes=())
        priced, control = attention_per_layer(m, c, *args)[0], attention_per_layer(bare, c, *args)[0]
        # (the GPU preset's assumed score-modifier factor is ~20; sinks add a per-row term)
        low, high = {"llama4": (0.0, 0.5), "gpt_oss": (1.0, 1.5)}.get(name, (3.0, 1e3))
        assert low * control < priced < high * control, (name, priced / control)
        plan = planner.plan(d, seq_len=16384, devices=4, hardware="h100", sequence_parallel=4, tensor_parallel=1)
        assert plan.to_dict()["attention_layers"] == attention_layers(m)
        assert "attention per layer (priced per layer): " + "; ".join(
            f"layer{'s' if len(i) > 1 else ''} {planner._layer_ranges(i)} ({len(i)} of {m.num_layers}): {what}"
            for i, what in want[name]) in plan.summary()
    # T5: the encoder (what sequence parallelism runs), T5's sizes
    t5 = ModelSpec.from_hf_config(cfgs["t5"].to_dict())
    assert (t5.causal, t5.hidden, t5.num_heads, t5.qk_dim, t5.ffn, t5.num_layers, t5.biases) == (
        False, 256, 4, 64, 512, 3, False)
    # plan(mask=) adds a softcap and chunks to every layer
    mistral = ModelSpec.from_hf_config({**MISTRAL, "sliding_window": None})
    masked = planner.plan(mistral, mask=AttentionMask(softcap=30.0, chunk_size=4096), seq_len=16384, devices=4,
                          hardware="h100", sequence_parallel=4, tensor_parallel=1)
    assert attention_layers(masked.model) == [{"layers": [0, 1, 2, 3],
                                               "attention": "chunks of 4096, score-modifying kernel (softcap)"}]


# ------------------------------------------------------------------------------------------------ on a given layout


def test_a_balanced_layout_is_priced_on_its_own_runs_and_auto_picks_among_the_backends_that_take_it():
    """Note [Cost model on a given layout]: a 50% prefix-LM span at P = 2 and 4 on ``balanced_for`` its mask: the
    busiest rank computes fewer pairs than on zigzag, the total over the ranks is the same visible work plus what
    the calls compute beyond it; ``layout="zigzag"`` prices exactly as the default (control). ``choose_backend``
    on the table prices only the backends that run on it."""
    from lightning_sp.layout import SequenceLayout

    n = 4096
    mask = AttentionMask(bidirectional_spans=((0, n // 2),))
    shape = cm.AttentionShape(seq_len=n, num_heads=8, num_kv_heads=4, head_dim=64)
    for p in (2, 4):
        table = SequenceLayout.balanced_for(n, p, mask)
        for backend in ("ring", "zigzag_ring", "allgather_kv"):
            own = cm.predict_attention(backend, shape, p, H100, mask=mask)
            zig = cm.predict_attention(backend, shape, p, H100, mask=mask, layout="zigzag")
            bal = cm.predict_attention(backend, shape, p, H100, mask=mask, layout=table)
            if backend != "ring":  # control: the backend's own layout given explicitly prices the same
                assert (zig.attention_pairs, zig.total_s, zig.comm_bytes) == (own.attention_pairs, own.total_s,
                                                                             own.comm_bytes)
            assert bal.layout == str(table) and own.layout == ""
            assert bal.attention_pairs < zig.attention_pairs, (p, backend)
        choice = cm.choose_backend(shape, p, H100, mask=mask, layout=table)
        assert {pr.backend for pr in choice.predictions} == {"zigzag_ring", "allgather_kv"}
        assert all(pr.layout == str(table) for pr in choice.predictions)
        assert "ulysses" in choice.excluded
    usp_table = SequenceLayout.balanced_for(n, 4, mask, ulysses_degree=2)
    choice = cm.choose_backend(shape, 4, H100, mask=mask, layout=usp_table)
    assert [(pr.backend, pr.ulysses_degree) for pr in choice.predictions] == [("usp", 2)]
    with pytest.raises(ValueError, match="no backend runs on layout .* its sub-groups are not available"):
        cm.choose_backend(shape, 4, H100, mask=mask, layout=usp_table, usp_allowed=False)


@pytest.mark.parametrize("backend,kw,layout,match", [
    ("ulysses", {}, "table", "drop layout= or use one of those backends"),
    ("colossal", {}, "table", "drop layout="),
    ("zigzag_ring", {}, "usp_table", "build the layout with ulysses_degree=1"),
    ("usp", {"ulysses_degree": 2}, "table", "build the layout with ulysses_degree=2"),
    ("zigzag_ring", {}, "table_for_8", "world_size=4"),
])
def test_a_layout_the_backend_cannot_take_raises_as_the_module_does(backend, kw, layout, match):
    from lightning_sp.layout import SequenceLayout

    mask = AttentionMask(bidirectional_spans=((0, 512),))
    layouts = {"table": SequenceLayout.balanced_for(1024, 4, mask),
               "usp_table": SequenceLayout.balanced_for(1024, 4, mask, ulysses_degree=2),
               "table_for_8": SequenceLayout.balanced_for(1024, 8, mask)}
    shape = cm.AttentionShape(seq_len=1024, num_heads=8, num_kv_heads=4, head_dim=64)
    with pytest.raises(ValueError, match=match):
        cm.predict_attention(backend, shape, 4, H100, mask=mask, layout=layouts[layout], **kw)
    with pytest.raises(ValueError, match=match):
        cm.rank_counts(backend, shape, 4, mask=mask, layout=layouts[layout], **kw)
    if layout == "table_for_8":
        with pytest.raises(ValueError, match=match):
            cm.choose_backend(shape, 4, H100, mask=mask, layout=layouts[layout])


def test_the_cost_models_layout_backends_are_the_modules():
    from lightning_sp.attention import LAYOUT_BACKENDS

    assert cm.LAYOUT_BACKENDS == LAYOUT_BACKENDS
