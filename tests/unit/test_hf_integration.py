"""lightning_sp.integrations.transformers without a process group: an unbound model equals HF's own
sdpa model (float64), and everything that cannot be done exactly raises with the alternative."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from lightning_sp.integrations.transformers import (  # noqa: E402
    SHARD_INFO_KEY,
    apply_sequence_parallel,
    shard_inputs,
)
from tests.hf_tiny import PAD_ID, clone, reference, tiny_batch, tiny_model, tiny_rows  # noqa: E402

TOL = 1e-12


def _sp_logits(model, batch):
    shard = shard_inputs(batch, model)
    shard.pop("labels", None)
    return model(**shard).logits


def test_import_lightning_sp_does_not_import_the_integration():
    # (torchmetrics, imported by lightning, imports transformers itself when it is installed; what
    # lightning_sp controls is that its integration, and so its registrations, stay lazy)
    code = ("import sys, lightning_sp; mods = [m for m in sys.modules if m.startswith('lightning_sp.integrations')]; "
            "assert not mods, mods")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "esm", "esm_abs", "roberta"])
@pytest.mark.parametrize("padded", [False, True])
def test_unbound_model_equals_hf_sdpa(name, padded):
    base = tiny_model(name)
    batch = tiny_batch(name, 9 if padded else 12, pad_to=12 if padded else None)
    ref_logits, _ = reference(clone(base), name, batch)
    model = apply_sequence_parallel(clone(base))
    assert model.config._attn_implementation == "lightning_sp"
    real = 9 if padded else 12
    logits = _sp_logits(model, batch)
    assert logits.size(1) == real  # right padding is dropped
    diff = (logits - ref_logits[:, :real]).abs().max()
    assert diff < TOL
    # negative control: the same comparison against a model that attends to the padding / other weights
    other = tiny_model(name)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    assert (_sp_logits(apply_sequence_parallel(other), batch) - ref_logits[:, :real]).abs().max() > 1e-6


def test_apply_is_idempotent():
    base = tiny_model("llama")
    batch = tiny_batch("llama", 12)
    model = apply_sequence_parallel(clone(base))
    once = _sp_logits(model, batch)
    model = apply_sequence_parallel(apply_sequence_parallel(model))
    assert len(model._forward_pre_hooks) == 1
    assert sum(1 for n, _ in model.named_modules() if n.endswith("sp_attention")) == base.config.num_hidden_layers
    assert torch.equal(_sp_logits(model, batch), once)
    assert set(model.state_dict()) == set(base.state_dict())  # nothing added to checkpoints


def test_packed_position_ids_match_hf_packing():
    """A causal LM with position_ids restarting at 0 attends within each document, as HF's sdpa mask does."""
    base = tiny_model("llama")
    ids = torch.randint(4, 30, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    ref = clone(base)(input_ids=ids, position_ids=pos, use_cache=False).logits  # HF packs only without a cache
    model = apply_sequence_parallel(clone(base))
    shard = shard_inputs({"input_ids": ids, "position_ids": pos}, model)
    assert shard[SHARD_INFO_KEY].cu_seqlens.tolist() == [0, 5, 8, 12]
    assert (model(**shard).logits - ref).abs().max() < TOL
    # control: without the documents the later ones see the earlier ones
    unpacked = clone(base)(input_ids=ids, position_ids=pos).logits  # with a cache HF ignores the packing
    assert (model(**shard).logits - unpacked).abs().max() > 1e-6


def test_equal_length_rows_batch():
    base = tiny_model("esm")
    batch = {k: torch.cat([v, tiny_batch("esm", 9, pad_to=12, seed=2)[k]]) for k, v in tiny_batch("esm", 9, pad_to=12).items()}
    ref_logits, _ = reference(clone(base), "esm", batch)
    diff = (_sp_logits(apply_sequence_parallel(clone(base)), batch) - ref_logits[:, :9]).abs().max()
    assert diff < TOL


def test_causal_labels_are_shifted_globally_and_padding_ignored():
    model = apply_sequence_parallel(tiny_model("llama"))
    batch = tiny_batch("llama", 9, pad_to=12)
    labels = shard_inputs(batch, model)["labels"]
    assert labels.shape == (1, 9) and labels[0, :8].tolist() == batch["input_ids"][0, 1:9].tolist()
    assert labels[0, 8] == -100  # the last real token predicts nothing (its successor is padding)
    mlm = apply_sequence_parallel(tiny_model("esm"))
    batch = tiny_batch("esm", 12)
    assert torch.equal(shard_inputs(batch, mlm)["labels"], batch["labels"])  # masked LM: no shift


# ------------------------------------------------------------------------------ loud refusals
def test_sliding_window_shorter_than_the_sequence_is_exact():
    batch = tiny_batch("mistral", 12)
    base = tiny_model("mistral", sliding_window=5)  # HF: q sees k iff q - k < 5, so the window changes the result
    ref_logits, _ = reference(clone(base), "mistral", batch)
    full_logits, _ = reference(tiny_model("mistral"), "mistral", batch)
    logits = _sp_logits(apply_sequence_parallel(clone(base)), batch)
    assert (logits - ref_logits).abs().max() < TOL
    assert (logits - full_logits).abs().max() > 1e-6  # negative control: the window is not a no-op here


def test_unknown_sinks_and_position_bias_refused():
    from lightning_sp.integrations.transformers import _reject_unsupported, _relative_position_bias

    module = torch.nn.Linear(1, 1)
    with pytest.raises(NotImplementedError, match="attention with 'sinks' .* not supported"):
        _reject_unsupported(module, 0.0, {"sinks": torch.zeros(4)})
    query = torch.zeros(1, 4, 8, 8)
    with pytest.raises(NotImplementedError, match="position_bias whose source lightning_sp does not know"):
        _relative_position_bias(module, query, {"position_bias": torch.zeros(1, 4, 8, 8)})
    module.has_relative_attention_bias = False  # T5's cross-attention: a zero bias, no table
    with pytest.raises(NotImplementedError, match=r"T5.s cross-attention .*\(T5EncoderModel"):
        _relative_position_bias(module, query, {"position_bias": torch.zeros(1, 4, 8, 8)})


def test_attention_dropout_refused_in_training_only():
    model = apply_sequence_parallel(tiny_model("llama", attention_dropout=0.1))
    batch = tiny_batch("llama", 12)
    with pytest.raises(NotImplementedError, match=r"attention dropout .* config.attention_dropout = 0"):
        _sp_logits(model.train(), batch)
    _sp_logits(model.eval(), batch)


def test_output_attentions_refused():
    model = apply_sequence_parallel(tiny_model("llama"))
    shard = shard_inputs(tiny_batch("llama", 12), model)
    shard.pop("labels")
    with pytest.raises(NotImplementedError, match="output_attentions .* attn_implementation='eager'"):
        model(**shard, output_attentions=True)


def test_4d_score_bias_refused():
    """A float 4-D mask with values other than 0 / -inf is a score bias: refused, naming the alternatives."""
    model = apply_sequence_parallel(tiny_model("llama"))
    with pytest.raises(NotImplementedError, match="score bias.* bool mask"):
        model(input_ids=torch.randint(4, 30, (1, 6)), attention_mask=torch.full((1, 1, 6, 6), 0.5, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(1, 1, 6, 5), (2, 1, 6, 6), (1, 3, 6, 6), (1, 6, 6)])
def test_4d_mask_of_the_wrong_shape_names_the_expected_one(shape):
    model = apply_sequence_parallel(tiny_model("llama"))
    batch = {"input_ids": torch.randint(4, 30, (1, 6)), "attention_mask": torch.ones(shape, dtype=torch.bool)}
    error = ValueError if len(shape) == 4 else NotImplementedError
    expected = r"\[B, 1 or H, N, N\] = \[1, 1 or 4, 6, 6\]" if len(shape) == 4 else r"\[B, 1 or H, N, N\]"
    with pytest.raises(error, match=expected):
        shard_inputs(batch, model)


@pytest.mark.parametrize("mask, match", [
    ([[1, 0, 1, 1, 1, 1]], "not one run of real tokens"),
    ([[0, 1, 1, 0, 1, 0]], "not one run of real tokens"),
])
def test_holes_in_a_padding_mask_refused(mask, match):
    model = apply_sequence_parallel(tiny_model("llama"))
    batch = {"input_ids": torch.randint(4, 30, (1, 6)), "attention_mask": torch.tensor(mask)}
    with pytest.raises(NotImplementedError, match=match):
        shard_inputs(batch, model)
    with pytest.raises(NotImplementedError, match=match):  # passed to the model directly: not silently dropped
        model(**batch)


@pytest.mark.parametrize("name", ["llama", "esm", "roberta"])
def test_rows_of_different_lengths_are_packed(name):
    """Note [Packing padded rows]: B = 2 rows of 7 and 12 tokens -> one row of two documents, exact."""
    base = tiny_model(name)
    batch = tiny_rows(name, (7, 12), pad_to=12)
    ref_logits, ref_loss = reference(clone(base), name, batch)
    model = apply_sequence_parallel(clone(base))
    shard = shard_inputs(batch, model)
    assert shard["input_ids"].shape == (1, 19) and shard[SHARD_INFO_KEY].cu_seqlens.tolist() == [0, 7, 19]
    labels = shard.pop("labels")
    logits = model(**shard).logits
    real = torch.cat([ref_logits[0, :7], ref_logits[1, :12]])[None]
    assert (logits - real).abs().max() < TOL
    loss = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100)
    assert abs(float(loss.detach() - ref_loss.detach())) < TOL
    # the padded batch given straight to the (unsharded) model: per-row key padding, exact on the real tokens
    direct = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert (torch.cat([direct[0, :7], direct[1, :12]])[None] - real).abs().max() < TOL


def test_bad_arguments():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        apply_sequence_parallel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="backend='ring' needs group="):
        apply_sequence_parallel(tiny_model("llama"), backend="ring")
    with pytest.raises(ValueError, match="call apply_sequence_parallel"):
        shard_inputs({"input_ids": torch.ones(1, 4, dtype=torch.long)}, tiny_model("llama"))
    model = apply_sequence_parallel(tiny_model("llama"))
    with pytest.raises(ValueError, match="add the batch dim"):
        shard_inputs({"input_ids": torch.ones(4, dtype=torch.long)}, model)
    with pytest.raises(ValueError, match="labels has shape"):
        shard_inputs({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 5, dtype=torch.long)}, model)
    with pytest.raises(ValueError, match="cu_seqlens. need batch size 1"):
        shard_inputs({"input_ids": torch.ones(2, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0, 2, 4])}, model)


def test_attention_mask_with_shard_refused():
    model = apply_sequence_parallel(tiny_model("llama"))
    shard = shard_inputs(tiny_batch("llama", 9, pad_to=12), model)
    shard.pop("labels")
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[:, 9:] = 0
    with pytest.raises(ValueError, match="pass the attention_mask to shard_inputs"):
        model(**shard, attention_mask=mask)


def test_pad_token_used_for_layout_padding():
    assert PAD_ID == tiny_model("esm").config.pad_token_id


@pytest.mark.parametrize("name", ["llama", "esm"])
def test_bf16_autocast_like_hf_sdpa(name):
    """Under autocast, rotary leaves q, k in float32 and v in bf16: cast as HF's sdpa is cast."""
    base = tiny_model(name).float()
    batch = tiny_batch(name, 12)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    other = clone(base)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1 * torch.randn_like(p))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = clone(base)(**inputs).logits.float()
        out = _sp_logits(apply_sequence_parallel(clone(base)), batch).float()
        control = _sp_logits(apply_sequence_parallel(other), batch).float()
    assert (out - ref).abs().max() < 2e-2
    assert (control - ref).abs().max() > 5e-2


# ------------------------------------------------------------------ exact or refused (no process group)


def test_a_4d_mask_with_a_bias_in_the_batch_refused_naming_the_alternative():
    model = apply_sequence_parallel(tiny_model("llama"))
    batch = {"input_ids": torch.randint(4, 30, (1, 6)), "attention_mask": torch.ones(1, 1, 6, 6)}
    with pytest.raises(NotImplementedError, match=r"additive float 4-D attention_mask .*bool mask"):
        shard_inputs(batch, model)


@pytest.mark.parametrize("model_type, causal", [
    ("gpt2", True), ("ctrl", True), ("bert", True), ("llama", True), ("esm", False), ("modernbert", False)])
def test_causal_lm_recognised_by_what_the_model_does(model_type, causal):
    from lightning_sp.integrations.transformers import is_causal_lm
    from tests.hf_tiny import registry_model

    overrides = {"is_decoder": True} if model_type == "bert" else {}
    model, _ = registry_model(model_type, overrides)
    assert is_causal_lm(model) is causal
    # a user's subclass under a name transformers does not know: HF's loss rule (no loss_type ->
    # causal-LM loss) and the attention layers' is_causal decide
    renamed = type("MyOwnModel", (type(model),), {})
    assert is_causal_lm(renamed(model.config)) is causal


def test_token_mixers_outside_attention_named():
    from lightning_sp.integrations.transformers import token_mixers_outside_attention
    from tests.hf_tiny import registry_model

    lfm2, _ = registry_model("lfm2", {"layer_types": ["conv", "full_attention"]})
    found = token_mixers_outside_attention(lfm2)
    assert found == ["model.layers.0.conv (Lfm2ShortConv)", "layer 0 (config.layer_types[0] = 'conv')"], found
    for clean in ("llama", "gpt2", "deepseek_v3"):  # GPT-2's Conv1D is a linear layer, not a convolution
        assert token_mixers_outside_attention(registry_model(clean)[0]) == [], clean
    mamba, _ = registry_model("mamba")
    with pytest.raises(NotImplementedError, match=r"MambaForCausalLM mixes tokens outside attention \(backbone.layers.0 \(MambaBlock\)"):
        apply_sequence_parallel(mamba)


@pytest.mark.parametrize("case", ["llama4_text", "llama[dynamic]", "phi3[longrope]", "deepseek_v3", "gpt2"])
def test_unbound_registry_models_equal_hf_on_packed_rows(case):
    """Without a group: rows of different lengths, packed by shard_inputs, equal HF's padded batch (its
    sdpa, float64, HF's own float32 roundings kept in float64: ``KeepFloat64``). Llama-4's temperature and chunk
    boundaries must restart with each packed row; the negative control drops them (Llama-4) or perturbs the
    weights."""
    from tests.hf_tiny import KeepFloat64

    with KeepFloat64():
        _packed_rows_equal_hf(case)


def _packed_rows_equal_hf(case):
    import dataclasses

    from tests.hf_tiny import SWEEP, registry_model, sweep_case_id

    overrides = dict((sweep_case_id(mt, ov), ov) for mt, ov in SWEEP)[case]
    base, _ = registry_model(case.split("[")[0], overrides)
    lengths, width = (7, 11), 11
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 60, (2, width), generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD_ID)
    ref = clone(base)(input_ids=ids, attention_mask=mask).logits.detach()
    ref_real = torch.cat([ref[i, :n] for i, n in enumerate(lengths)])[None]
    model = apply_sequence_parallel(clone(base))
    shard = shard_inputs({"input_ids": ids, "attention_mask": mask}, model)
    assert (model(**shard).logits - ref_real).abs().max() < TOL
    if case == "llama4_text":
        info = shard[SHARD_INFO_KEY]
        for edit in ({"token_index": torch.arange(sum(lengths))[None]}, {"chunk_cu_seqlens": info.cu_seqlens}):
            control = dict(shard, **{SHARD_INFO_KEY: dataclasses.replace(info, **edit)})
            assert (model(**control).logits - ref_real).abs().max() > 1e-6, edit


def test_keep_float64_keeps_only_transformers_own_float32_roundings():
    """``tests.hf_tiny.KeepFloat64``: HF's RMSNorm (``hidden_states.to(torch.float32)``) stays float64 under it, and
    equals the same norm computed in float64 by hand; outside it the norm rounds through float32 (control). A cast
    from any other code (this test, standing for ``lightning_sp``) still rounds: the mode cannot hide a float32
    rounding in the library."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from tests.hf_tiny import KeepFloat64

    norm = LlamaRMSNorm(16).double()
    x = torch.randn(3, 16, dtype=torch.float64) * (1 + 1e-9 * torch.rand(3, 16, dtype=torch.float64))
    by_hand = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    with KeepFloat64():
        kept = norm(x)
        ours = x.to(torch.float32)
        ours_float = x.float()
    assert kept.dtype == torch.float64 and (kept - by_hand).abs().max() < 1e-15
    assert (norm(x) - by_hand).abs().max() > 1e-9  # control: as HF wrote it, the norm rounds through float32
    assert ours.dtype == torch.float32 and ours_float.dtype == torch.float32


def test_mask_kwargs_map_to_hf_conventions():
    from lightning_sp.integrations.transformers import _mask_and_sinks

    q = torch.zeros(1, 4, 3, 8)  # [B, H, S, D]
    assert _mask_and_sinks(q, True, {}) == (None, None)
    mask, sinks = _mask_and_sinks(q, True, {"sliding_window": 5, "softcap": 30.0})
    assert mask.window == (4, 0) and mask.softcap == 30.0 and sinks is None  # causal: q - k < 5
    assert _mask_and_sinks(q, False, {"sliding_window": 5})[0].window == (4, 4)  # bidirectional: |q - k| < 5
    s_aux = torch.zeros(4)
    assert _mask_and_sinks(q, True, {"s_aux": s_aux}) == (None, s_aux)
    with pytest.raises(NotImplementedError, match=r"s_aux of shape \(2,\) is not one sink logit per query head"):
        _mask_and_sinks(q, True, {"s_aux": torch.zeros(2)})
    with pytest.raises(NotImplementedError, match="sliding_window=0 is not a positive int"):
        _mask_and_sinks(q, True, {"sliding_window": 0})
