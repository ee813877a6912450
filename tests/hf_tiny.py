"""Tiny random transformers models in float64 and their unsharded references (HF's own ``sdpa``).

The reference loss is HF's definition computed in float64: HF's loss functions upcast logits with
``.float()`` (float32), which would hide float64 agreement behind float32 round-off.
"""

from __future__ import annotations

import copy
import os
import re
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

VOCAB = 33
MASK_ID, PAD_ID = 32, 1


def tiny_model(name: str, **overrides):
    """``llama`` (GQA 4/2, causal), ``qwen2`` (GQA 4/1 = MQA, qkv bias), ``mistral``, ``esm`` (rotary,
    token dropout on, bidirectional), ``esm_abs`` (ESM-1b-style absolute cumsum positions), ``roberta``."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    if name == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, **overrides)
        cls = tf.LlamaForCausalLM
    elif name == "qwen2":
        cfg = tf.Qwen2Config(**common, num_key_value_heads=1, **overrides)
        cls = tf.Qwen2ForCausalLM
    elif name == "mistral":
        cfg = tf.MistralConfig(**common, num_key_value_heads=2, **{"sliding_window": None, **overrides})
        cls = tf.MistralForCausalLM
    elif name in ("esm", "esm_abs"):
        cfg = tf.EsmConfig(**common, position_embedding_type="rotary" if name == "esm" else "absolute",
                           token_dropout=True, mask_token_id=MASK_ID, pad_token_id=PAD_ID,
                           attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, **overrides)
        cls = tf.EsmForMaskedLM
    elif name == "roberta":
        cfg = tf.RobertaConfig(**common, pad_token_id=PAD_ID, attention_probs_dropout_prob=0.0,
                               hidden_dropout_prob=0.0, **overrides)
        cls = tf.RobertaForMaskedLM
    else:
        raise ValueError(name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg).double()


def is_mlm(name: str) -> bool:
    return name in ("esm", "esm_abs", "roberta")


def tiny_batch(name: str, n: int, *, pad_to: int | None = None, seed: int = 1) -> dict:
    """Global batch ``B = 1``: ``input_ids``, ``labels`` (HF convention), optional right padding
    ``attention_mask`` (``n`` real tokens padded to ``pad_to``)."""
    g = torch.Generator().manual_seed(seed)
    total = pad_to or n
    ids = torch.randint(4, MASK_ID, (1, total), generator=g)
    if is_mlm(name):
        labels = torch.full_like(ids, -100)
        picked = torch.randperm(n, generator=g)[: max(2, n // 4)]
        labels[0, picked] = ids[0, picked]
        ids[0, picked[: len(picked) // 2 + 1]] = MASK_ID  # some <mask> tokens (ESM token dropout)
    else:
        labels = ids.clone()
    batch = {"input_ids": ids, "labels": labels}
    if pad_to is not None:
        mask = torch.zeros_like(ids)
        mask[:, :n] = 1
        ids[:, n:] = PAD_ID
        labels[:, n:] = -100
        batch["attention_mask"] = mask
    return batch


def tiny_rows(name: str, lengths: tuple[int, ...], pad_to: int, seed: int = 1) -> dict:
    """Global batch of ``len(lengths)`` right-padded rows of different lengths (always with a mask)."""
    rows = [tiny_batch(name, n, pad_to=pad_to, seed=seed + i) for i, n in enumerate(lengths)]
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def reference(model, name: str, batch: dict):
    """Unsharded HF forward (its own sdpa) -> ``(logits [B, N, V], loss)``, loss as HF defines it, in float64."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**kwargs).logits
    labels = batch["labels"]
    if not is_mlm(name):  # HF's causal-LM loss: position i predicts token i + 1
        logits_l, labels = logits[:, :-1], labels[:, 1:]
    else:
        logits_l = logits
    loss = F.cross_entropy(logits_l.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return logits, loss


def clone(model):
    return copy.deepcopy(model)


# ------------------------------------------------------------------------------ the registry sweep

SWEEP_VOCAB = 64
SWEEP_N = 13  # global length no degree divides
SWEEP_BACKENDS = ("zigzag_ring", "ulysses")
# (model_type, config overrides): causal LMs from MODEL_FOR_CAUSAL_LM_MAPPING and masked LMs from
# MODEL_FOR_MASKED_LM_MAPPING, chosen to cover every trap the integration once fell into (label shift of *LMHeadModel,
# length-dependent RoPE, Llama-4 temperature and chunked attention, LFM2-style convolutions, SSM
# hybrids, MLA, soft-capping, sliding windows, sinks, ALiBi) plus the common families
SWEEP: tuple[tuple[str, dict], ...] = (
    ("llama", {}),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "max_position_embeddings": 8}),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
              "long_factor": [3.0] * 4, "original_max_position_embeddings": 8}, "max_position_embeddings": 32,
              "original_max_position_embeddings": 8}),  # Phi-3 copies its own field into rope_parameters
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
               "original_max_position_embeddings": 8}}),
    ("mistral", {"sliding_window": 4}),  # windows shorter than the sequence (13)
    ("mixtral", {"sliding_window": None}),
    ("qwen3", {}),
    ("qwen3_moe", {}),
    ("qwen2_moe", {}),
    ("gemma", {}),
    ("gemma2", {"sliding_window": 4}),  # soft-capping, local and global layers
    ("gemma3_text", {"sliding_window": 4}),
    ("cohere2", {"sliding_window": 4}),
    ("gpt_oss", {"sliding_window": 4}),  # sinks and windows
    ("phi", {}),
    ("gpt2", {}),
    ("gpt_neox", {}),
    ("gptj", {"rotary_dim": 4}),
    ("codegen", {"rotary_dim": 4}),
    ("opt", {}),
    ("bloom", {}),
    ("falcon", {}),
    ("starcoder2", {"sliding_window": None}),
    ("olmo", {}),
    ("olmo2", {}),
    ("cohere", {}),
    ("granite", {}),
    ("smollm3", {}),
    ("nemotron", {}),
    ("biogpt", {}),
    ("ctrl", {}),
    ("bert", {"is_decoder": True}),
    ("deepseek_v2", {"head_dim": 4, "num_key_value_heads": 4}),  # head_dim = qk_rope_head_dim, no GQA
    ("deepseek_v3", {"head_dim": 4, "num_key_value_heads": 4}),
    ("llama4_text", {}),
    ("lfm2", {"layer_types": ["conv", "full_attention"]}),
    ("jamba", {}),
    ("mamba", {}),
    ("roberta", {}),
    ("esm", {}),
    ("modernbert", {}),
    ("gpt_neo", {}),
)

# (model_type, config overrides): encoders transformers maps to a text-encoding class
# (MODEL_FOR_TEXT_ENCODING_MAPPING: T5EncoderModel, ...) with T5's learned relative-position bias; buckets and a reach
# smaller than the sequence, so distances past max_distance share a bucket
_T5_TINY = {"d_kv": 8, "d_ff": 48, "num_heads": 4, "dropout_rate": 0.0, "relative_attention_num_buckets": 8,
            "relative_attention_max_distance": 6}
ENCODER_SWEEP: tuple[tuple[str, dict], ...] = (
    ("t5", _T5_TINY),
    ("mt5", _T5_TINY),
    ("umt5", _T5_TINY),  # a table in every layer
)


class KeepFloat64(TorchFunctionMode):
    """HF's modelling code rounds to float32 inside a float64 model: RMSNorm (``hidden_states.to(torch.float32)``
    in Llama, DeepSeek-V3 and most others, ``x.float()`` in Gemma), MoE routers (``F.linear(x.type(torch.float32),
    ...)``), softmax with ``dtype=torch.float32``, Llama-4's complex rotary (``xq.float()``). A sharded run's
    activations differ from the unsharded run's by float64 round-off (~1e-16); where such a difference straddles a
    float32 rounding step, one value moves by a float32 step and the logits by ~1e-8. Which values straddle depends
    on the CPU's vector paths: deepseek_v3 on the zigzag layouts and Llama-4's packed rows did on this workplace's
    AVX-512 machine (2026-11-24), not before. Under this mode, a call made *from transformers' own code* that would
    round a float64 tensor to float32 keeps float64 (``.float()`` returns the tensor, ``torch.float32`` passed as
    a dtype becomes ``torch.float64``), in the reference and the sharded run alike, so the comparison sees
    float64's round-off only. Calls from any other code (``lightning_sp`` included) are untouched: a float32
    rounding in the library still shows."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _called_from_transformers():
            if func is torch.Tensor.float and args[0].dtype == torch.float64:
                return args[0]
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _called_from_transformers() -> bool:
    """Whether the nearest frame outside torch (above ``KeepFloat64.__torch_function__``) is transformers' code."""
    import transformers

    package = os.path.dirname(transformers.__file__) + os.sep
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(package)


_TINY = dict(
    vocab_size=SWEEP_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
    n_ctx=64, d_model=32, n_inner=48, ffn_dim=48, num_layers=2,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    # MLA (DeepSeek): value head dim != query/key head dim
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
    # Llama-4: a NoPE layer with temperature tuning and a chunked layer, chunks shorter than the sequence
    attention_chunk_size=4, floor_scale=4, attn_scale=0.5, no_rope_layer_interval=2, interleave_moe_layer_step=1,
    # hybrids / SSMs
    conv_L_cache=3, mamba_d_state=4, mamba_d_conv=3, mamba_n_heads=4, mamba_d_head=8, state_size=4, conv_kernel=3,
    expand=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
    # ModernBERT
    global_attn_every_n_layers=2, local_attention=8,
    # gpt_neo
    attention_types=[[["global", "local"], 1]], window_size=8,
)
_NO_DROPOUT = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "hidden_dropout_prob",
               "attention_probs_dropout_prob", "dropout", "activation_dropout", "embedding_dropout", "mlp_dropout",
               "attention_dropout_prob", "classifier_dropout", "ffn_dropout", "summary_first_dropout")


def sweep_case_id(model_type: str, overrides: dict) -> str:
    rope = (overrides.get("rope_parameters") or {}).get("rope_type")
    return f"{model_type}[{rope}]" if rope else model_type


def _tiny_config(model_type: str, overrides: dict | None):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls()
    settable = lambda k: hasattr(defaults, k) and not isinstance(getattr(config_cls, k, None), property)  # noqa: E731
    kwargs = {k: v for k, v in _TINY.items() if settable(k)}
    kwargs.update({k: 0.0 for k in _NO_DROPOUT if isinstance(getattr(defaults, k, None), float)})
    for key, value in (("pad_token_id", PAD_ID), ("bos_token_id", 2), ("eos_token_id", 3), ("mask_token_id", MASK_ID),
                       ("decoder_start_token_id", 2), ("sep_token_id", 3), ("cls_token_id", 2)):
        if hasattr(defaults, key):
            kwargs[key] = value
    kwargs.update(overrides or {})
    return config_cls(**kwargs)


def registry_encoder(model_type: str, overrides: dict | None = None):
    """A tiny random float64 encoder of ``model_type``: the class transformers' ``MODEL_FOR_TEXT_ENCODING_MAPPING``
    maps it to (``T5EncoderModel``, ...), HF's ``eager`` attention (the reference)."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES

    cls = getattr(tf, MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES[model_type])
    torch.manual_seed(0)
    return cls._from_config(_tiny_config(model_type, overrides), attn_implementation="eager").double().eval()


def registry_model(model_type: str, overrides: dict | None = None):
    """A tiny random float64 model of ``model_type`` from transformers' own registry: the class
    ``AutoModelForCausalLM`` maps it to, else ``AutoModelForMaskedLM``'s, with HF's ``eager``
    attention (plain softmax over the mask HF builds: the reference), else ``sdpa``.
    ``-> (model, is_masked_lm)``."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    cfg = _tiny_config(model_type, overrides)
    masked = model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    cls_name = (MODEL_FOR_MASKED_LM_MAPPING_NAMES if masked else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[model_type]
    cls = getattr(tf, cls_name)
    torch.manual_seed(0)
    for impl in ("sdpa", "eager"):
        try:
            # eager experts: grouped_mm has no float64 kernel
            model = cls._from_config(cfg, attn_implementation=impl, experts_implementation="eager")
            break
        except ValueError:
            if impl == "eager":
                raise
    return model.double().eval(), masked


def sweep_batch(masked: bool, n: int = SWEEP_N, seed: int = 1) -> dict:
    """``input_ids [1, n]`` and HF-convention ``labels`` (every token for a causal LM, a quarter of
    them, masked, for a masked LM)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, SWEEP_VOCAB - 1, (1, n), generator=g)
    if not masked:
        return {"input_ids": ids, "labels": ids.clone()}
    labels = torch.full_like(ids, -100)
    picked = torch.randperm(n, generator=g)[: max(2, n // 4)]
    labels[0, picked] = ids[0, picked]
    ids[0, picked] = MASK_ID
    return {"input_ids": ids, "labels": labels}


def max_grad_diff(model, ref, group) -> float:
    """Largest |mean over the group of ``model``'s gradient - ``ref``'s| over every parameter (a parameter
    without a gradient counts as zeros)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    diff = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        g_ref = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
        diff = max(diff, float((g / world - g_ref).abs().max()))
    return diff


def sweep_case(model_type: str, overrides: dict, group, backends=SWEEP_BACKENDS) -> dict:
    """One architecture of the sweep on this rank: ``{backend: result}``, each result either
    ``{"refused": message}`` (a ``NotImplementedError``) or the max differences of the
    sequence-parallel run from the unsharded float64 model: ``logits``, ``loss``, ``grads`` (every
    parameter, summed over ranks / P) and ``control`` (the same logits vs the reference with the first
    token changed: must differ, so the tolerance cannot pass vacuously). Other errors propagate. HF's own
    float32 roundings stay float64 in every run (``KeepFloat64``)."""
    with KeepFloat64():
        return _sweep_case(model_type, overrides, group, backends)


def first_token_changed(input_ids: torch.Tensor) -> torch.Tensor:
    """A copy of ``input_ids [1, N]`` with its first token replaced: the negative control's input."""
    other = input_ids.clone()
    other[0, 0] = 4 if int(other[0, 0]) != 4 else 5
    return other


def _sweep_case(model_type: str, overrides: dict, group, backends) -> dict:

    from lightning_sp import gather_sequence, sequence_parallel_cross_entropy
    from lightning_sp.integrations.transformers import _sp_modules, apply_sequence_parallel, shard_inputs

    base, masked = registry_model(model_type, overrides)
    batch = sweep_batch(masked)
    ref = clone(base)
    logits_ref = ref(input_ids=batch["input_ids"]).logits  # [1, N, V]
    shift = 0 if masked else 1
    loss_ref = F.cross_entropy(logits_ref[:, : logits_ref.size(1) - shift].flatten(0, 1), batch["labels"][:, shift:].flatten())
    loss_ref.backward()
    with torch.no_grad():  # (on a copy: a forward may change state, e.g. dynamic RoPE's cached length)
        logits_other = clone(base)(input_ids=first_token_changed(batch["input_ids"])).logits
    out: dict = {"class": type(base).__name__, "masked_lm": masked}
    for backend in backends:
        model = clone(base)
        try:
            apply_sequence_parallel(model, group=group, backend=backend)
            shard = shard_inputs(batch, model)
            labels = shard.pop("labels")
            logits = model(**shard).logits  # [1, S_local, V]
        except NotImplementedError as err:
            out[backend] = {"refused": str(err)}
            continue
        loss = sequence_parallel_cross_entropy(logits, labels, group=group)
        loss.backward()
        grad_diff = max_grad_diff(model, ref, group)
        full = gather_sequence(logits.detach(), group, layout=_sp_modules(model)[0].layout, seq_len=SWEEP_N)
        out[backend] = {
            "logits": float((full - logits_ref.detach()).abs().max()),
            "loss": abs(float(loss.detach() - loss_ref.detach())),
            "grads": grad_diff,
            "control": float((full - logits_other).abs().max()),
        }
    return out


def encoder_case(model_type: str, overrides: dict, group, backends=SWEEP_BACKENDS) -> dict:
    """One encoder of ``ENCODER_SWEEP`` on this rank, judged as ``sweep_case`` judges a language model:
    ``{backend: {"refused": message}}`` or the max differences from the unsharded float64 encoder on the full
    sequence: ``logits`` (the last hidden states ``[1, N, d]``), ``loss`` (``sum(hidden * weight)``, a fixed random
    weight), ``grads`` (every parameter, the ranks' shares summed) and ``control`` (the reference with the first
    token changed: must differ)."""
    with KeepFloat64():
        return _encoder_case(model_type, overrides, group, backends)


def _encoder_case(model_type: str, overrides: dict, group, backends) -> dict:
    import torch.distributed as dist

    from lightning_sp import gather_sequence, shard_sequence
    from lightning_sp.integrations.transformers import _sp_modules, apply_sequence_parallel, shard_inputs

    base = registry_encoder(model_type, overrides)
    ids = sweep_batch(False)["input_ids"]  # [1, N]
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(1, ids.size(1), base.config.d_model, generator=g, dtype=torch.float64)
    ref = clone(base)
    hidden_ref = ref(input_ids=ids).last_hidden_state  # [1, N, d]
    loss_ref = (hidden_ref * weight).sum()
    loss_ref.backward()
    with torch.no_grad():
        hidden_other = clone(base)(input_ids=first_token_changed(ids)).last_hidden_state
    out: dict = {"class": type(base).__name__, "masked_lm": False}
    for backend in backends:
        model = clone(base)
        try:
            apply_sequence_parallel(model, group=group, backend=backend)
            shard = shard_inputs({"input_ids": ids}, model)
            hidden = model(**shard).last_hidden_state  # [1, S_local, d]
        except NotImplementedError as err:
            out[backend] = {"refused": str(err)}
            continue
        layout = _sp_modules(model)[0].layout
        loss = (hidden * shard_sequence(weight, group, layout=layout)).sum()  # this rank's share of the loss
        loss.backward()
        loss_total = loss.detach().clone()
        dist.all_reduce(loss_total, group=group)
        grads = 0.0
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=group)
            grad_ref = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
            grads = max(grads, float((grad - grad_ref).abs().max()))
        full = gather_sequence(hidden.detach(), group, layout=layout, seq_len=ids.size(1))
        out[backend] = {"logits": float((full - hidden_ref.detach()).abs().max()),
                        "loss": abs(float(loss_total - loss_ref.detach())), "grads": grads,
                        "control": float((full - hidden_other).abs().max())}
    return out


def sweep_worker(rank: int, world: int) -> dict:
    """``run_on_ranks`` target: every ``SWEEP`` and ``ENCODER_SWEEP`` case on this rank -> ``{case_id: result}``."""
    import torch.distributed as dist

    out = {sweep_case_id(mt, ov): sweep_case(mt, ov, dist.group.WORLD) for mt, ov in SWEEP}
    out.update({mt: encoder_case(mt, ov, dist.group.WORLD) for mt, ov in ENCODER_SWEEP})
    return out


TABLE_BEGIN = "<!-- hf-support-table:begin (written by scripts/hf_support_table.py) -->"
TABLE_END = "<!-- hf-support-table:end -->"


def refusal_reason(message: str) -> str:
    """The first clause of a refusal (up to ``:`` or ``;``), for the README table."""
    cut = min((i for i in (message.find(": "), message.find("; ")) if i >= 0), default=len(message))
    return message[:cut].replace("|", "/").strip()


TABLE_VERSION = re.compile(r"^Swept with transformers (\S+)\.$", re.M)
"""The table's first line: which transformers it was swept with (what constraints.txt pins)."""


def support_table(results: dict) -> str:
    """Markdown table of the sweep (``{case_id: sweep_case(...)}`` of one rank), one row per case, after a line
    naming the installed transformers version (the outcome of a case can change with it: 5.24 moved GPT-J and
    CodeGen onto ``AttentionInterface``)."""
    import transformers

    lines = [f"Swept with transformers {transformers.__version__}.", "",
             "| model_type | class | " + " | ".join(SWEEP_BACKENDS) + " | refused because |",
             "|---|---|" + "---|" * len(SWEEP_BACKENDS) + "---|"]
    for case_id, res in results.items():
        cells, reasons = [], []
        for backend in SWEEP_BACKENDS:
            r = res[backend]
            cells.append("refused" if "refused" in r else "exact")
            if "refused" in r and refusal_reason(r["refused"]) not in reasons:
                reasons.append(refusal_reason(r["refused"]))
        lines.append(f"| `{case_id}` | `{res['class']}` | " + " | ".join(cells) + " | " + "; ".join(reasons) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ a PEFT stand-in

class LoraLinear(torch.nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen, as PEFT's LoRA ``Linear`` (``B`` starts non-zero
    here, so the adapter changes the output and its gradients are not trivially zero)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2, scale: float = 0.5):
        super().__init__()
        self.base_layer, self.scale = base, scale
        base.requires_grad_(False)
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        torch.nn.init.normal_(self.lora_B.weight, std=0.1)

    def forward(self, x):
        return self.base_layer(x) + self.scale * self.lora_B(self.lora_A(x))


class _PeftConfigLike:
    def __init__(self, is_prompt_learning: bool):
        self.is_prompt_learning = is_prompt_learning


class TunerLike(torch.nn.Module):
    """PEFT's ``LoraModel``: holds the transformers model with adapters injected (``.model``, ``peft_config``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.peft_config = {"default": _PeftConfigLike(False)}

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class PeftModelLike(torch.nn.Module):
    """What apply_sequence_parallel sees of ``peft.PeftModel``: ``base_model`` (the tuner), ``get_base_model()``,
    ``active_peft_config.is_prompt_learning``, and a forward that hands everything to the tuner."""

    def __init__(self, model, *, prompt_learning: bool = False):
        super().__init__()
        self.base_model = TunerLike(model)
        self.active_peft_config = _PeftConfigLike(prompt_learning)

    def get_base_model(self):
        return self.base_model if self.active_peft_config.is_prompt_learning else self.base_model.model

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                               labels=labels, **kwargs)


def lora_like(model, *, targets=("q_proj", "v_proj"), prompt_learning: bool = False) -> PeftModelLike:
    """``model`` with LoRA-style adapters on ``targets`` (the rest frozen), wrapped like ``get_peft_model``."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name in targets:
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.Linear):
                torch.manual_seed(len(name))
                setattr(module, name, LoraLinear(child))
    return PeftModelLike(model, prompt_learning=prompt_learning)
