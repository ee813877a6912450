"""``lightning_sp.planner``: the parameter counts of real models, the memory parts, the recommendation's rules,
the JSON schema and the command line on fixed inputs."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_sp.planner import (Candidate, LayerRates, ModelSpec, PlannerProfile, hardware_profile, main,
                                  memory_bytes, memory_phases, plan, step_time, sync_points, with_layer_rates)

ESM2_650M = {"architectures": ["EsmForMaskedLM"], "model_type": "esm", "hidden_size": 1280, "num_hidden_layers": 33,
             "num_attention_heads": 20, "intermediate_size": 5120, "vocab_size": 33, "hidden_act": "gelu",
             "tie_word_embeddings": True}
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "hidden_act": "silu", "tie_word_embeddings": False}


def _hf_models():
    import transformers as T

    yield "llama", T.LlamaForCausalLM, T.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=100, tie_word_embeddings=False)
    yield "qwen3", T.Qwen3ForCausalLM, T.Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=96, vocab_size=100)
    yield "esm", T.EsmForMaskedLM, T.EsmConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=33,
        position_embedding_type="rotary", pad_token_id=1, mask_token_id=32)
    yield "mixtral", T.MixtralForCausalLM, T.MixtralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=100, num_local_experts=4, num_experts_per_tok=2)
    yield "deepseek_v3", T.DeepseekV3ForCausalLM, T.DeepseekV3Config(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, vocab_size=100, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1)


def test_parameter_counts_of_real_models_from_their_configs():
    """Dense GQA, per-head norms, an encoder with biases and an LM-head transform, MoE, MLA: the count from the
    config is the real model's within 0.2% (what is left: per-head q/k norms, MLA's latent norms, ESM's contact
    head)."""
    for name, cls, cfg in _hf_models():
        real = sum(p.numel() for p in cls(cfg).parameters())
        spec = ModelSpec.from_hf_config(cfg.to_dict())
        assert abs(spec.params / real - 1) < 2e-3, (name, spec.params, real)
        # negative control: MoE and MLA read as a dense MHA model miss by far more
        if name in ("mixtral", "deepseek_v3"):
            dense = ModelSpec(num_layers=spec.num_layers, hidden=spec.hidden, num_heads=spec.num_heads,
                              ffn_hidden=spec.ffn, gated_mlp=True, vocab=spec.vocab, tied_embeddings=False)
            assert abs(dense.params / real - 1) > 0.05, name


def test_project_yaml_models_count_exactly(tmp_path):
    from lightning_sp.models import MultimodalDecoder, ProteinEncoder

    for cls, init in ((ProteinEncoder, dict(d_model=96, n_layers=3, n_heads=4)),
                      (MultimodalDecoder, dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2))):
        path = tmp_path / f"{cls.__name__}.yaml"
        args = "\n".join(f"    {k}: {v}" for k, v in init.items())
        path.write_text(f"model:\n  class_path: lightning_sp.models.{cls.__name__}\n  init_args:\n{args}\n")
        spec = ModelSpec.from_file(path)
        assert spec.params == sum(p.numel() for p in cls(**init).parameters()), cls.__name__
        assert spec.causal == (cls is MultimodalDecoder)


def test_memory_parts_follow_the_layout():
    spec = ModelSpec.from_hf_config(LLAMA3_8B)
    hw = hardware_profile("h100")
    kw = dict(seq_len=131072, batch=1, precision="bf16-mixed", hw=hw)
    base = Candidate(backend="zigzag_ring", sequence_parallel_size=8, data_parallel_size=1, tensor_parallel_size=1,
                     ulysses_degree=None, kv_pieces=1, activation_checkpointing=False, tiled_loss=False)
    ddp = memory_bytes(spec, base, data_parallel="ddp", **kw)
    fsdp = memory_bytes(spec, base, data_parallel="fsdp", **kw)
    assert ddp["parameters"] == pytest.approx(4 * spec.params)
    assert ddp["optimizer"] == pytest.approx(8 * spec.params)
    assert fsdp["optimizer"] == pytest.approx(8 * spec.params / 8)  # sharded over dp x sp
    assert fsdp["ddp_buckets"] == 0 and ddp["ddp_buckets"] > 0
    ckpt = memory_bytes(spec, Candidate(**{**base.__dict__, "activation_checkpointing": True}), data_parallel="ddp", **kw)
    assert ckpt["stored_activations"] < ddp["stored_activations"] / 10
    _, phases = memory_phases(spec, base, data_parallel="ddp", **kw)
    _, tiled = memory_phases(spec, Candidate(**{**base.__dict__, "tiled_loss": True}), data_parallel="ddp", **kw)
    # [N/P, V] logits and their gradient in bf16 + two float32 chunks of the loss; tiled: four float32 tiles
    assert phases["loss"]["logits"] == pytest.approx(2 * 16384 * 128256 * 2 + 2 * (1 << 24) * 4)
    assert tiled["loss"]["logits"] == pytest.approx(4 * (1 << 24) * 4)
    assert ddp["logits"] == phases["loss"]["logits"]  # 128K tokens of a 128K vocabulary: the loss is the peak
    _, allgather = memory_phases(spec, Candidate(**{**base.__dict__, "backend": "allgather_kv"}), data_parallel="ddp", **kw)
    # the whole K/V against the ring's blocks in flight
    assert allgather["attention_backward"]["attention"] > 3 * phases["attention_backward"]["attention"]


def test_the_peak_is_the_largest_moment_not_their_sum():
    """The activations of the loss, a layer's MLP backward and its attention backward are not alive at once:
    the peak is the states plus the largest moment (negative control: their sum is far larger)."""
    spec = ModelSpec.from_hf_config(LLAMA3_8B)
    kw = dict(seq_len=131072, batch=1, precision="bf16-mixed", data_parallel="ddp", hw=hardware_profile("h100"))
    c = Candidate(backend="ring", sequence_parallel_size=8, data_parallel_size=1, tensor_parallel_size=1,
                  ulysses_degree=None, kv_pieces=1, activation_checkpointing=True, tiled_loss=True)
    states, phases = memory_phases(spec, c, **kw)
    peak = sum(memory_bytes(spec, c, **kw).values())
    assert peak == pytest.approx(sum(states.values()) + max(sum(p.values()) for p in phases.values()))
    assert peak < sum(states.values()) + sum(sum(p.values()) for p in phases.values()) - 2**30


def test_pure_bf16_states_and_the_tiled_mlp():
    """``bf16-true``: 2 + 2 + 4 bytes per parameter and no float32 master or weight copies; the tiled MLP
    keeps only its input and recomputes the MLP's forward once more."""
    spec = ModelSpec.from_hf_config(ESM2_650M)
    hw = hardware_profile("h200")
    c = Candidate(backend="local", sequence_parallel_size=1, data_parallel_size=1, tensor_parallel_size=1,
                  ulysses_degree=None, kv_pieces=1, activation_checkpointing=True, tiled_loss=False)
    kw = dict(seq_len=65536, batch=1, data_parallel="ddp", hw=hw)
    pure = memory_bytes(spec, c, precision="bf16-true", **kw)
    mixed = memory_bytes(spec, c, precision="bf16-mixed", **kw)
    assert pure["parameters"] + pure["gradients"] + pure["optimizer"] == pytest.approx(8 * spec.params)
    assert mixed["parameters"] + mixed["gradients"] + mixed["optimizer"] == pytest.approx(16 * spec.params)
    assert pure["weight_copies"] == 0 < mixed["weight_copies"]
    tiled_c = Candidate(**{**c.__dict__, "mlp_chunk_tokens": 8192})
    _, whole = memory_phases(spec, c, precision="bf16-true", **kw)
    _, tiled = memory_phases(spec, tiled_c, precision="bf16-true", **kw)
    # the recomputed layer in its MLP backward: without the 4 x 5120 MLP activations of 64K tokens (ESM's erf
    # GELU) and the 3 x 5120 its backward adds, with one tile's four [8192, 5120]
    saved_mlp = (4 + 3) * 5120 * 65536 * 2
    tile = 4 * 8192 * 5120 * 2
    assert (whole["mlp_backward"]["layer_in_backward"] - tiled["mlp_backward"]["layer_in_backward"]
            == pytest.approx(saved_mlp - tile))
    t_whole = step_time(spec, c, precision="bf16-true", seq_len=65536, batch=1, data_parallel="ddp", hw=hw)
    t_tiled = step_time(spec, tiled_c, precision="bf16-true", seq_len=65536, batch=1, data_parallel="ddp", hw=hw)
    assert t_tiled["other_compute_s"] > t_whole["other_compute_s"]
    assert step_time(spec, c, precision="bf16-true", seq_len=65536, batch=1, data_parallel="ddp", hw=hw,
                     step_overhead_s=0.25)["fixed_s"] == 0.25


def test_saved_tensors_follow_the_code_that_runs_the_layer():
    """Note [Saved tensors]: transformers' ESM keeps two more [T, ffn] tensors (its erf GELU), Qwen3 its q/k
    norms' inputs and outputs, this project's layer the q/k part of its fused projection."""
    esm = ModelSpec.from_hf_config(ESM2_650M)
    fused = ModelSpec(**{**esm.__dict__, "implementation": "fused", "python_gelu": False})
    assert sum(esm.saved_per_token(act_bytes=2)) - sum(fused.saved_per_token(act_bytes=2)) == 2 * 5120
    project = ModelSpec(**{**fused.__dict__, "implementation": "project"})
    assert sum(project.saved_per_token(act_bytes=2)) - sum(fused.saved_per_token(act_bytes=2)) == 2 * 1280
    qwen = ModelSpec.from_hf_config({"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32})
    assert qwen.qk_norm and not ModelSpec.from_hf_config(LLAMA3_8B).qk_norm
    with pytest.raises(ValueError, match="implementation must be one of"):
        ModelSpec(num_layers=1, hidden=8, num_heads=2, implementation="jax")


def test_h200_measured_profile_is_a_hardware():
    hw = hardware_profile("h200-measured")
    assert hw.source.startswith("measured") and hw.memory_bytes == pytest.approx(139.8 * 2**30)
    assert plan(ESM2_650M, seq_len=32768, devices=1, hardware="h200-measured", precision="bf16-true").recommended.fits


def test_esm2_650m_on_8_h100_at_64k():
    """ESM-2 650M has 20 heads: Ulysses alone cannot split them 8 ways, so sp = 8 needs a ring or usp."""
    p = plan(ESM2_650M, seq_len=65536, devices=8, hardware="h100")
    assert not any(c.backend == "ulysses" and c.sequence_parallel_size == 8 for c in p.candidates)
    assert any(c.backend == "usp" and c.sequence_parallel_size == 8 and c.ulysses_degree in (2, 4)
               for c in p.candidates)
    rec = p.recommended
    assert rec is not None and rec.fits
    assert not p.model.causal and all(c.backend != "zigzag_ring" for c in p.candidates)  # encoders: no zigzag
    fitting = [c for c in p.candidates if c.fits]
    assert rec.tokens_per_s_per_device >= 0.97 * max(c.tokens_per_s_per_device for c in fitting)
    assert rec.peak_bytes_per_rank == pytest.approx(sum(rec.memory.values()))
    assert rec.step_time_s == pytest.approx(sum(rec.time.values()))


def test_llama_8b_at_128k_recommends_the_tiled_loss_and_says_what_lets_longer_fit():
    p = plan(LLAMA3_8B, seq_len=131072, devices=8, hardware="h100")
    assert p.recommended.fits and p.recommended.tiled_loss
    assert "up to N=" in p.cheapest_change
    longer = int(p.cheapest_change.split("up to N=")[1].split()[0])
    assert longer > p.recommended.max_seq_len


def test_cheapest_change_from_a_local_recommendation():
    """Without sequence parallelism (``local``) and every cheaper change already taken (FSDP asked for), the
    last suggestion is a sequence-parallel split; doubling ``local``'s degree once raised a ValueError."""
    p = plan(ESM2_650M, seq_len=131072, devices=1, hardware="h100", data_parallel="fsdp")
    assert p.recommended.backend == "local"
    assert "sp=2, backend='zigzag_ring'" in p.cheapest_change
    assert int(p.cheapest_change.split("up to N=")[1].split()[0]) > p.recommended.max_seq_len


def test_no_layout_fits_says_so_and_what_would_help():
    p = plan(LLAMA3_8B, seq_len=1 << 21, devices=8, hardware="h100")
    assert not any(c.fits for c in p.candidates)
    assert p.reason.startswith("no layout fits")
    assert p.recommended.max_seq_len == max(c.max_seq_len for c in p.candidates)


def test_json_schema_and_summary_on_fixed_inputs(capsys):
    assert main(["--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "2", "--vocab", "1000",
                 "--seq-len", "8192", "--devices", "4", "--hardware", "a100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"].startswith("prediction")
    rec = doc["recommended"]
    for key in ("backend", "sequence_parallel_size", "data_parallel_size", "tensor_parallel_size", "kv_pieces",
                "activation_checkpointing", "peak_bytes_per_rank", "step_time_s", "max_seq_len"):
        assert key in rec, key
    assert rec["sequence_parallel_size"] * rec["data_parallel_size"] * rec["tensor_parallel_size"] == 4
    assert doc["candidates"] and all("memory" in c and "time" in c for c in doc["candidates"])
    assert main(["--layers", "4", "--hidden", "256", "--heads", "8", "--seq-len", "8192", "--devices", "4",
                 "--hardware", "h200", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "PREDICTED from datasheet parameters (not measured)" in text and "Recommended:" in text


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "1024", "--devices", "2"], "pass --model PATH, or --layers, --hidden and --heads"),
    (["--model", "/nonexistent/config.json", "--seq-len", "1024", "--devices", "2"], "no model file"),
    (["--layers", "2", "--hidden", "64", "--heads", "6", "--kv-heads", "4", "--seq-len", "1024", "--devices", "2"],
     "multiple of num_kv_heads"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "1024", "--devices", "2", "--hardware", "tpu9"],
     "unknown hardware"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "1024", "--devices", "2", "--hardware", "cpu"],
     "has no memory size"),
])
def test_bad_input_says_what_to_change(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_calibrated_profile_file_is_a_hardware(tmp_path):
    profile = hardware_profile("h100").to_dict()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"profile": profile}))
    assert hardware_profile(path).name == "h100-80gb"
    assert plan(ESM2_650M, seq_len=4096, devices=2, hardware=path).recommended.fits


RATES = dict(matmul_table=[[64, 32, 1e9], [64, 128, 4e9], [1024, 32, 2e9], [1024, 128, 8e9]],
             elementwise_s=2e-9, loss_s=5e-9, optimizer_s=3e-9)


def test_layer_rates_interpolate_on_the_measured_grid():
    """Note [Layer rates]: the measured points exactly, log-log bilinear between them, clamped outside; a partial
    grid or a negative cost is refused."""
    rates = LayerRates.from_dict(RATES)
    for t, c, r in RATES["matmul_table"]:
        assert rates.matmul_rate(t, c) == pytest.approx(r)
    assert rates.matmul_rate(256, 64) == pytest.approx((1e9 * 4e9 * 2e9 * 8e9) ** 0.25)  # the log-midpoint of both
    assert rates.matmul_rate(1 << 20, 1) == pytest.approx(2e9)  # clamped: the most tokens, the narrowest width
    assert rates.matmul_rate(1, 1 << 20) == pytest.approx(4e9)
    with pytest.raises(ValueError, match="full grid"):
        LayerRates.from_dict({**RATES, "matmul_table": RATES["matmul_table"][:3]}).matmul_rate(100, 100)
    with pytest.raises(ValueError, match="optimizer_s must be >= 0"):
        LayerRates.from_dict({**RATES, "optimizer_s": -1.0})
    with pytest.raises(ValueError, match="matmul_table"):
        LayerRates.from_dict({**RATES, "matmul_table": []})


def test_layer_rates_price_the_layers_loss_and_optimizer(tmp_path):
    """A profile with layer rates (a file's ``"layer_rates"`` key) prices the non-attention work from them: the
    linear FLOPs at the table's rate, the elementwise passes, the loss per logit, AdamW per parameter (FSDP: the
    rank's shard); without them, the profile's matmul rate as before. Attention and communication do not move."""
    base = hardware_profile("cpu")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"profile": base.to_dict(), "layer_rates": RATES}))
    hw = hardware_profile(path)
    assert isinstance(hw, PlannerProfile) and hw.layer_rates == LayerRates.from_dict(RATES)
    assert with_layer_rates(base, RATES) == hw and hw.matmul_flops == base.matmul_flops
    spec = ModelSpec(num_layers=2, hidden=64, num_heads=4, vocab=1000)
    c = Candidate(backend="ring", sequence_parallel_size=2, data_parallel_size=1, tensor_parallel_size=1,
                  ulysses_degree=None, kv_pieces=1, activation_checkpointing=False, tiled_loss=False)
    kw = dict(seq_len=2048, batch=1, precision="32-true")
    tokens, params = 1024, spec.layer_params() + spec.embedding_params()
    saved = sum(spec.saved_per_token(tp=1, act_bytes=4))
    flops = 2.0 * tokens * spec.layer_params() * 3 + 2.0 * tokens * 64 * 1000 * 3
    rate = LayerRates.from_dict(RATES).matmul_rate(tokens, 64)
    expected = flops / rate + 2e-9 * 2 * tokens * saved * 3 + 5e-9 * tokens * 1000
    stretch = hw.compute_stretch(2)
    ddp = step_time(spec, c, data_parallel="ddp", hw=hw, **kw)
    fsdp = step_time(spec, c, data_parallel="fsdp", hw=hw, **kw)
    assert ddp["other_compute_s"] == pytest.approx((expected + 3e-9 * params) * stretch)
    assert fsdp["other_compute_s"] == pytest.approx((expected + 3e-9 * params / 2) * stretch)
    plain = step_time(spec, c, data_parallel="ddp", hw=base, **kw)
    assert plain["other_compute_s"] == pytest.approx(
        (flops / base.matmul_flops + base.elementwise_s[1] * 2 * tokens * saved * 3) * stretch)
    assert plain["attention_compute_s"] == ddp["attention_compute_s"]
    # the rates are a time model only: the memory is the profile's
    assert memory_bytes(spec, c, data_parallel="ddp", hw=hw, **kw) == memory_bytes(spec, c, data_parallel="ddp",
                                                                                    hw=base, **kw)


def _kernel_table(dims_and_scores):
    """A kernel table of FULL rectangles whose time per (query x key) element at D is ``dims_and_scores[D]``
    (forward) and twice that (backward), on a 2 x 2 grid of sides."""
    return tuple(("full", d, q, k, per_score * q * k, 2 * per_score * q * k)
                 for d, per_score in dims_and_scores.items() for q in (512, 2048) for k in (512, 2048))


def test_kernel_table_below_its_smallest_head_dim_is_not_proportional_to_d():
    """Note [Kernel table below the smallest head dim]: a table measured at D answers its points; below its smallest D
    the time per score element follows the line through the two smallest dims, between the proportional charge
    (lower bound) and the smallest D's own time (upper bound). The control: the proportional charge, what the lookup
    answered before, is half of D = 32's at D = 16, well under the line."""
    from lightning_sp.cost_model import _table_lookup

    t32, t64 = 3.0e-9, 5.0e-9  # seconds per query x key element: 1e-9 per score + 6.25e-11 per score and dim
    table = _kernel_table({32: t32, 64: t64})
    at = lambda d, tab=table, backward=False: _table_lookup(tab, "full", d, 1024, 1024, backward)  # noqa: E731
    assert at(32) == pytest.approx(t32 * 1024 ** 2) and at(64) == pytest.approx(t64 * 1024 ** 2)
    line16 = t32 - (t64 - t32) / 32 * 16  # 2e-9: two thirds of D = 32, not one half
    assert at(16) == pytest.approx(line16 * 1024 ** 2)
    assert at(16, backward=True) == pytest.approx(2 * line16 * 1024 ** 2)
    proportional = t32 * 16 / 32 * 1024 ** 2  # the control
    assert at(16) > 1.3 * proportional
    assert at(1) == pytest.approx(max(t32 - (t64 - t32) / 32 * 31, t32 / 32) * 1024 ** 2)  # held at the lower bound
    # measured small dims answer exactly, and a smaller D never costs more than the smallest measured one's time
    measured = _kernel_table({8: 3.1e-9, 16: 2.0e-9, 32: t32, 64: t64})
    assert _table_lookup(measured, "full", 16, 1024, 1024, False) == pytest.approx(2.0e-9 * 1024 ** 2)
    assert _table_lookup(measured, "full", 8, 2048, 2048, False) == pytest.approx(3.1e-9 * 2048 ** 2)
    assert _table_lookup(measured, "full", 4, 1024, 1024, False) == pytest.approx(3.1e-9 * 1024 ** 2)
    # one measured dim: the proportional charge, as before (no line to draw)
    single = _kernel_table({32: t32})
    assert _table_lookup(single, "full", 16, 1024, 1024, False) == pytest.approx(proportional)


def test_committed_cpu_kernel_table_measures_small_head_dims():
    """The planner's CPU kernel table (``run.py --calibrate-kernel``) has D = 8 and 16 rows, and on this CPU D = 16
    costs well over half of D = 32 (the proportional charge's answer)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments/planner/results/cpu_kernel_table.json"
    table = [tuple(r) for r in json.loads(path.read_text())["kernel_table"]]
    assert {r[1] for r in table} >= {8, 16, 32, 64}
    from lightning_sp.cost_model import _table_lookup

    for kind in ("full", "causal"):
        ratio = (_table_lookup(table, kind, 16, 2048, 2048, True) / _table_lookup(table, kind, 32, 2048, 2048, True))
        assert 0.55 < ratio < 0.9, (kind, ratio)


def test_the_hf_small_op_charge_scales_with_tokens_and_layers():
    """Note [Layer rates]: ``implementation="hf"`` pays its measured small-op charge per saved element and pass, the
    others ``elementwise_s``; the difference grows with the tokens and the layers (x2 each), and checkpointing adds
    one pass. The control: a ``project`` model of the same sizes pays ``elementwise_s``."""
    rates = dict(RATES, implementation_elementwise_s=[["hf", 7e-9]])
    hw = with_layer_rates(hardware_profile("cpu"), rates)
    assert hw.layer_rates.elementwise_for("hf") == 7e-9 and hw.layer_rates.elementwise_for("project") == 2e-9
    c = Candidate(backend="ring", sequence_parallel_size=2, data_parallel_size=1, tensor_parallel_size=1,
                  ulysses_degree=None, kv_pieces=1, activation_checkpointing=False, tiled_loss=False)
    kw = dict(batch=1, precision="32-true", data_parallel="ddp", hw=hw)

    def extra(layers: int, seq_len: int, cand=c) -> float:
        sizes = dict(num_layers=layers, hidden=64, num_heads=4, vocab=1000)
        hf, project = ModelSpec(**sizes, implementation="hf"), ModelSpec(**sizes, implementation="project")
        # the same saved elements in both (no qk norm, no python GELU, project's extra q + k counted apart)
        saved_hf = sum(hf.saved_per_token(tp=1, act_bytes=4))
        saved_project = sum(project.saved_per_token(tp=1, act_bytes=4))
        got = (step_time(hf, cand, seq_len=seq_len, **kw)["other_compute_s"]
               - step_time(project, cand, seq_len=seq_len, **kw)["other_compute_s"])
        passes = 3 + cand.activation_checkpointing
        tokens = seq_len // 2
        assert got == pytest.approx(layers * tokens * passes * (7e-9 * saved_hf - 2e-9 * saved_project)
                                    * hw.compute_stretch(2))
        return got

    one = extra(2, 2048)
    assert extra(4, 2048) == pytest.approx(2 * one) and extra(2, 4096) == pytest.approx(2 * one)
    from dataclasses import replace

    assert extra(2, 2048, replace(c, activation_checkpointing=True)) > one
    with pytest.raises(ValueError, match="implementation_elementwise_s"):
        LayerRates.from_dict(dict(RATES, implementation_elementwise_s=[["flash", 1e-9]]))


SMALL_LLAMA = LLAMA3_8B | {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 8,
                           "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 4096}


def test_the_step_time_split_adds_up():
    """A step is the sum of its parts, each >= 0, and ``other_compute_s`` is its terms' sum (Note [Layer rates]): the
    linear FLOPs at the table's rate (one more forward with checkpointing), the HF small-op charge per saved element
    and pass, the loss per logit and AdamW per parameter, stretched for ranks sharing the cores. The plan's candidates
    carry the same split. The control: the project's ``elementwise_s`` in place of the HF charge misses it."""
    from dataclasses import replace

    hw = with_layer_rates(replace(hardware_profile("cpu"), kernel_table=_kernel_table({16: 2e-9, 32: 3e-9, 64: 5e-9})),
                          dict(RATES, implementation_elementwise_s=[["hf", 7e-9]]))
    spec = ModelSpec.from_hf_config(SMALL_LLAMA)
    tokens, params = 1024, spec.layer_params() + spec.embedding_params()
    saved = sum(spec.saved_per_token(tp=1, act_bytes=4))
    for backend in ("zigzag_ring", "ulysses", "allgather_kv"):
        for ckpt in (False, True):
            c = Candidate(backend=backend, sequence_parallel_size=2, data_parallel_size=1, tensor_parallel_size=1,
                          ulysses_degree=None, kv_pieces=1, activation_checkpointing=ckpt, tiled_loss=False)
            t = step_time(spec, c, seq_len=2048, batch=1, precision="32-true", data_parallel="ddp", hw=hw,
                          step_overhead_s=0.01)
            assert set(t) == {"attention_compute_s", "exposed_comm_s", "other_compute_s", "sync_wait_s", "fixed_s"}
            assert t["sync_wait_s"] == 0.0  # RATES has no rank-skew points
            assert min(t.values()) >= 0 and t["attention_compute_s"] > 0 and t["fixed_s"] == 0.01
            flops = 2.0 * tokens * spec.layer_params(active=True) * (3 + ckpt) + 2.0 * tokens * 128 * 4096 * 3
            terms = (flops / hw.layer_rates.matmul_rate(tokens, 128), 7e-9 * 2 * tokens * saved * (3 + ckpt),
                     5e-9 * tokens * 4096, 3e-9 * params)
            assert t["other_compute_s"] == pytest.approx(sum(terms) * hw.compute_stretch(2)), (backend, ckpt)
            control = sum(terms) - terms[1] + 2e-9 * 2 * tokens * saved * (3 + ckpt)
            assert t["other_compute_s"] != pytest.approx(control * hw.compute_stretch(2))
    p = plan(SMALL_LLAMA, seq_len=2048, devices=2, hardware="cpu", memory_budget_bytes=2**34, step_overhead_s=0.01)
    for cand in p.candidates:
        assert cand.step_time_s == pytest.approx(sum(cand.time.values())) and min(cand.time.values()) >= 0


def test_the_loss_chunk_is_the_loss_modules():
    from lightning_sp import loss, planner

    assert planner.LOSS_CHUNK_ELEMENTS == loss._CHUNK_ELEMENTS


def test_plan_is_exported_lazily():
    import lightning_sp

    assert lightning_sp.plan is plan
    assert torch is not None


def test_lightning_sp_plan_subcommand(capsys):
    from lightning_sp.cli import main as cli_main

    assert cli_main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "4096", "--devices", "2",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"]["sequence_parallel_size"] in (1, 2)
    assert cli_main(["plan", "--seq-len", "4096", "--devices", "2"]) == 2


def test_the_papers_table_has_a_finite_ratio_on_every_row():
    """The planner against the papers (docs/guides/planning.md): every setup renders a row with the paper's
    figure, the planner's and a finite ratio, and every row points at a note that says its assumptions."""
    import math

    from experiments.planner.render import ALST, PAPER_NOTES, RING_TABLE3, ULYSSES_SEQ, ULYSSES_TFLOPS, papers

    table = papers()
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(ULYSSES_SEQ) * len(ULYSSES_TFLOPS) + len(RING_TABLE3) + len(ALST)
    for cells in rows:
        paper, predicted, ratio = (float(c.strip().lstrip("~").replace(",", "")) for c in cells[2:5])
        assert paper > 0 and math.isfinite(ratio) and ratio >= 0, cells
        assert abs(ratio - predicted / paper) <= 0.01 + 0.01 * ratio, cells  # the printed figures are rounded
        assert cells[6].strip() in PAPER_NOTES, cells
    assert "**prediction**" in table and all(key + " " in table for key in PAPER_NOTES)


SYNC_WAIT = [[2, 0.001, 0.0003], [2, 0.004, 0.0006], [2, 0.016, 0.0012], [4, 0.004, 0.0015], [4, 0.016, 0.003]]


def test_sync_points_count_a_steps_synchronizations():
    """Note [Rank skew]: per layer and pass (forward, backward, recomputed forward) the ring's P - 1 exchanges,
    all-gather's one, Ulysses' two, USP's both, FSDP's block all-gather; DDP's all-reduce once per step."""
    spec = ModelSpec(num_layers=3, hidden=64, num_heads=4, vocab=100)

    def cand(backend, sp, ckpt=False, ulysses=None):
        return Candidate(backend=backend, sequence_parallel_size=sp, data_parallel_size=1, tensor_parallel_size=1,
                         ulysses_degree=ulysses, kv_pieces=1, activation_checkpointing=ckpt, tiled_loss=False)

    assert sync_points(spec, cand("ring", 4), "ddp") == 3 * 2 * 3 + 1
    assert sync_points(spec, cand("ring", 4, ckpt=True), "ddp") == 3 * 3 * 3 + 1
    assert sync_points(spec, cand("allgather_kv", 4), "ddp") == 3 * 2 * 1 + 1
    assert sync_points(spec, cand("ulysses", 4), "fsdp") == 3 * 2 * (2 + 1)
    assert sync_points(spec, cand("usp", 4, ulysses=2), "ddp") == 3 * 2 * (1 + 2) + 1
    assert sync_points(spec, cand("ring", 1), "ddp") == 0  # one rank waits for nobody


def test_rank_skew_wait_is_priced_per_synchronization():
    """A calibrated profile with ``sync_wait`` points adds, per synchronization, the wait measured after the step's
    compute / its synchronizations, at the nearest measured world at or below P (log-log interpolated); the other
    parts do not move, and the profile without the points (the control) has no wait. GPU presets have none."""
    import math

    spec = ModelSpec(num_layers=2, hidden=64, num_heads=4, vocab=1000)
    kw = dict(seq_len=2048, batch=1, precision="32-true", data_parallel="ddp")
    hw = with_layer_rates(hardware_profile("cpu"), dict(RATES, sync_wait=SYNC_WAIT))
    control = with_layer_rates(hardware_profile("cpu"), RATES)
    rates = hw.layer_rates
    assert rates.wait_per_sync(2, 0.004) == pytest.approx(0.0006)
    assert rates.wait_per_sync(2, 0.002) == pytest.approx(math.exp(0.5 * math.log(0.0003) + 0.5 * math.log(0.0006)))
    assert rates.wait_per_sync(2, 1.0) == pytest.approx(0.0012)  # clamped
    assert rates.wait_per_sync(8, 0.004) == pytest.approx(0.0015)  # the nearest measured world below
    assert rates.wait_per_sync(1, 0.004) == 0.0
    assert rates.wait_per_sync(2, 0.0005) == pytest.approx(0.0003 / 2)  # below the points: in proportion
    for backend, sp in (("ring", 2), ("ulysses", 4), ("allgather_kv", 4)):
        c = Candidate(backend=backend, sequence_parallel_size=sp, data_parallel_size=1, tensor_parallel_size=1,
                      ulysses_degree=None, kv_pieces=1, activation_checkpointing=True, tiled_loss=False)
        t, t0 = step_time(spec, c, hw=hw, **kw), step_time(spec, c, hw=control, **kw)
        n = sync_points(spec, c, "ddp")
        compute = t["attention_compute_s"] + t["other_compute_s"]
        assert t["sync_wait_s"] == pytest.approx(n * rates.wait_per_sync(sp, compute / n)) and t["sync_wait_s"] > 0
        assert t0["sync_wait_s"] == 0.0
        assert {k: v for k, v in t.items() if k != "sync_wait_s"} == {k: v for k, v in t0.items() if k != "sync_wait_s"}
        assert sum(t.values()) - sum(t0.values()) == pytest.approx(t["sync_wait_s"])
        gpu = step_time(spec, c, hw=hardware_profile("h200-measured"), **kw)
        assert gpu["sync_wait_s"] == 0.0
    with pytest.raises(ValueError, match="sync_wait"):
        LayerRates.from_dict(dict(RATES, sync_wait=[[1, 0.001, 0.0001]]))


def test_loss_is_priced_at_its_vocabularys_rate():
    """``loss_by_vocab`` prices the loss per logit at the model's vocabulary (log-interpolated, clamped) in place of
    ``loss_s``: the prediction moves by exactly (rate(V) - loss_s) x logits x stretch; without it (the control),
    ``loss_s``."""
    import math

    by_vocab = [[256, 2e-9], [4096, 8e-9]]
    hw = with_layer_rates(hardware_profile("cpu"), dict(RATES, loss_by_vocab=by_vocab))
    control = with_layer_rates(hardware_profile("cpu"), RATES)
    assert hw.layer_rates.loss_per_logit(1024) == pytest.approx(math.exp(0.5 * math.log(2e-9) + 0.5 * math.log(8e-9)))
    assert hw.layer_rates.loss_per_logit(31) == pytest.approx(2e-9)
    assert control.layer_rates.loss_per_logit(1024) == RATES["loss_s"]
    c = Candidate(backend="ring", sequence_parallel_size=2, data_parallel_size=1, tensor_parallel_size=1,
                  ulysses_degree=None, kv_pieces=1, activation_checkpointing=False, tiled_loss=False)
    for vocab in (31, 1024, 4096):
        spec = ModelSpec(num_layers=2, hidden=64, num_heads=4, vocab=vocab)
        kw = dict(seq_len=2048, batch=1, precision="32-true", data_parallel="ddp")
        got = step_time(spec, c, hw=hw, **kw)["other_compute_s"] - step_time(spec, c, hw=control, **kw)["other_compute_s"]
        expected = (hw.layer_rates.loss_per_logit(vocab) - RATES["loss_s"]) * 1024 * vocab * hw.compute_stretch(2)
        assert got == pytest.approx(expected) and abs(got) > 0
    with pytest.raises(ValueError, match="loss_by_vocab"):
        LayerRates.from_dict(dict(RATES, loss_by_vocab=[[0, 1e-9]]))
