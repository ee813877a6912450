"""Hugging Face ``transformers`` models under exact sequence parallelism, in one call.

    model = apply_sequence_parallel(AutoModelForCausalLM.from_config(cfg), group=sp_group, backend="zigzag_ring")
    shard = shard_inputs({"input_ids": ids, "labels": ids}, model)      # global batch -> this rank's shard
    labels = shard.pop("labels")                                         # [B, S_local], shifted globally
    logits = model(**shard).logits                                       # [B, S_local, V]
    loss = sequence_parallel_cross_entropy(logits, labels, group=sp_group)

Needs ``transformers >= 5`` (the ``hf`` extra). See Note [Hugging Face under sequence parallelism] for
what is done and why; what cannot be done exactly raises ``NotImplementedError`` naming the alternative.

Note [Hugging Face under sequence parallelism]
    transformers routes every attention layer through ``AttentionInterface[config._attn_implementation]``
    (called with the layer module, ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]``, the mask, ``scaling`` and
    the layer's ``is_causal``). ``apply_sequence_parallel`` registers ``"lightning_sp"`` there and gives
    every attention layer a ``SequenceParallelAttention`` child (``layer.sp_attention``), so the process
    group reaches the function through the module and ``SequenceParallelStrategy`` binds it like any
    other. What a sharded HF model would otherwise get wrong, and the fix:

    ==========================================  ==================================================
    trap                                         fix
    ==========================================  ==================================================
    global length unknown to the attention       ``shard_inputs`` records it (``ShardInfo.seq_len``);
      (bidirectional models attend to padding)     the attention passes it on every call
    ``scaling`` per call (ESM passes 1.0)        passed as ``softmax_scale`` per call
    padding ``attention_mask`` dropped for a     a mask function is registered too; ``shard_inputs``
      custom attention without a mask function     drops right padding (rows of different lengths:
                                                   packed documents); others raise
    causal-LM loss shifts labels inside a shard  labels shifted over the global sequence first
    ``position_ids`` default to local positions  global ``position_ids`` always passed
    positions by cumulative sums (RoBERTa/ESM-1b) computed over the global sequence (``_FIXES``)
    ESM token dropout ratio over the local shard computed over the global sequence (``_FIXES``)
    ==========================================  ==================================================

    Per-batch facts (``ShardInfo``) travel in the shard dict under ``"sequence_parallel"``; a forward
    pre-hook on the model pops them and keeps them on a state object the layers share, for the
    attention function and the embedding fixes to read. With HF gradient checkpointing the recompute
    in backward reads the last forward's facts, so forward and backward must alternate (as in any
    training loop).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sp.attention import SequenceParallelAttention
from lightning_sp.layout import group_size_and_rank, padded_length, shard_sequence

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SHARD_INFO_KEY",
    "ShardInfo",
    "apply_sequence_parallel",
    "attention_layers",
    "is_causal_lm",
    "model_fixes",
    "sequence_parallel_attention",
    "shard_inputs",
]

ATTN_IMPLEMENTATION = "lightning_sp"
"""The name registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``."""
SHARD_INFO_KEY = "sequence_parallel"
"""Key of the ``ShardInfo`` in the dict ``shard_inputs`` returns (popped by the model's pre-hook)."""
_STATE_ATTR = "_lightning_sp_state"
_HF_MIN_VERSION = (5, 0)


def _require_transformers():
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "lightning_sp.integrations.transformers needs the `transformers` package: pip install 'lightning-sp[hf]'"
        ) from err
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if major_minor < _HF_MIN_VERSION:
        raise ImportError(
            f"lightning_sp.integrations.transformers needs transformers >= 5.0 (AttentionInterface with per-layer "
            f"is_causal/scaling); found {transformers.__version__}: pip install -U 'transformers>=5'"
        )
    return transformers


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """Facts about the global batch a shard came from, which no rank can see in its own shard."""

    seq_len: int
    """Global length ``N`` of the (unpadded) sequence: positions ``>= seq_len`` (the layout's padding to an
    even split) are never attended."""
    padded_len: int
    """Global length after layout padding (``S_local * P``); checks that a shard and its info match."""
    cu_seqlens: torch.Tensor | None = None
    """int32 ``[n_docs + 1]`` global document boundaries (packed documents, ``B == 1``), or ``None``."""
    token_dropout_ratio: torch.Tensor | None = None
    """ESM: float32 ``[B, S_local]``: for each of this shard's tokens, the fraction of ``<mask>`` tokens
    in its row of the global batch (HF's ratio, computed over the whole row)."""


@dataclass(kw_only=True)
class _State:
    """Shared by the model and all its attention layers and fixed modules (not a module-level global)."""

    info: ShardInfo | None = None
    hook: Any = None
    fixes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ the attention


def _reject_unsupported(module: nn.Module, dropout: float, kwargs: dict) -> None:
    """Everything the exact backends cannot do raises here, naming the alternative (STYLE 9)."""
    if dropout and module.training:
        raise NotImplementedError(
            f"attention dropout ({dropout}) is not supported under sequence parallelism (every rank would need the "
            "same RNG stream); set config.attention_dropout = 0 (for ESM: attention_probs_dropout_prob = 0)"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(
            "attention logit soft-capping is not supported; use a model config without it (e.g. "
            "attn_logit_softcapping=None) or train without sequence parallelism"
        )
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attention with {name!r} (sinks / additive position biases) is not supported by the exact backends; "
                "use a model with rotary or absolute positions"
            )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "output_attentions is not available under sequence parallelism (no rank holds the [N, N] weights); "
            "run the unsharded model with attn_implementation='eager' to inspect attention weights"
        )
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{name} passed to the model directly is not used by lightning_sp; put the global 'cu_seqlens' "
                "(or packed position_ids) in the batch given to shard_inputs"
            )


def _longest_document(info_seq_len: int, cu_seqlens: torch.Tensor | None) -> int:
    if cu_seqlens is None:
        return info_seq_len
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _checked_arguments(module: nn.Module, sp: SequenceParallelAttention, state: "_State", query: torch.Tensor,
                       key: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
                       kwargs: dict) -> tuple[int, torch.Tensor | None]:
    """``(seq_len, cu_seqlens)`` of this call; raises what the exact backends cannot do."""
    _reject_unsupported(module, dropout, kwargs)
    if key.size(2) != query.size(2):
        raise NotImplementedError(
            f"query and key lengths differ ({query.size(2)} vs {key.size(2)}): cross-attention and KV caches "
            "(generation) are not supported under sequence parallelism; use the model's own attention for them"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"an arbitrary {attention_mask.dim()}-D attention mask cannot be applied exactly by the sequence-parallel "
            "backends (they know causality, a global length and packed documents); pass a right-padding 2-D "
            "attention_mask or packed position_ids/cu_seqlens to shard_inputs instead"
        )
    world, _ = group_size_and_rank(sp.process_group)
    if sp.resolved_backend() == "local":
        world = 1
    info = state.info
    s_local = query.size(2)
    if info is None:
        if world > 1:
            raise ValueError(
                "the model runs sequence parallel but got no ShardInfo: build its inputs with "
                "shard_inputs(global_batch, model) and call model(**shard), so the attention knows the global length"
            )
        seq_len = s_local
        if attention_mask is not None:  # unsharded call with a padding mask: right padding only
            lengths = _right_padding_lengths(attention_mask)
            if lengths is not None and bool((lengths != lengths[0]).any()):
                raise NotImplementedError(
                    f"rows of the batch have different unpadded lengths ({lengths.tolist()}): pass the batch through "
                    "shard_inputs(batch, model), which packs them into one row of documents"
                )
            seq_len = s_local if lengths is None else int(lengths[0])
        cu_seqlens = None
    else:
        if attention_mask is not None:
            raise ValueError(
                "pass the attention_mask to shard_inputs, not to the model: it has already been turned into the "
                "shard's global length (ShardInfo.seq_len)"
            )
        if s_local * world != info.padded_len:
            raise ValueError(
                f"the shard holds {s_local} tokens x {world} ranks but its ShardInfo says {info.padded_len}: "
                "the ShardInfo belongs to another batch; call model(**shard) with the dict shard_inputs returned"
            )
        seq_len, cu_seqlens = info.seq_len, info.cu_seqlens
    window = kwargs.get("sliding_window")
    if window is not None and _longest_document(seq_len, cu_seqlens) > int(window):
        raise NotImplementedError(
            f"sliding_window={window} would change the result for a sequence of {_longest_document(seq_len, cu_seqlens)} "
            "tokens and is not supported by the exact backends; use sequences (documents) of at most that length, "
            "or set config.sliding_window = None (and use_sliding_window = False) to attend over the whole sequence"
        )
    return seq_len, cu_seqlens


def sequence_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``AttentionInterface["lightning_sp"]``.

    ``query [B, H, S_local, D]``, ``key, value [B, H_kv, S_local, D]`` (HF's layout) ->
    ``(out [B, S_local, H, D], None)``. Causality as HF's ``sdpa`` decides it: ``is_causal`` if given,
    else the layer's ``is_causal``.
    """
    sp = getattr(module, "sp_attention", None)
    state: _State | None = getattr(module, _STATE_ATTR, None)
    if not isinstance(sp, SequenceParallelAttention) or state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} but apply_sequence_parallel "
            "did not give it a SequenceParallelAttention; call apply_sequence_parallel(model) on the whole model"
        )
    try:  # a rejection on one rank must not leave its peers waiting in their attention's collectives
        seq_len, cu_seqlens = _checked_arguments(module, sp, state, query, key, attention_mask, dropout, kwargs)
    except (ValueError, NotImplementedError) as err:
        sp.raise_on_every_rank(err, query)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as autocast runs HF's sdpa: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)  # (rotary often leaves q, k in float32 and v in bf16)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    causal = bool(is_causal) if is_causal is not None else bool(getattr(module, "is_causal", True))
    sp.causal = causal  # HF decides causality per call (e.g. is_causal=False turns a decoder bidirectional)
    out = sp(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),  # [B, H, S, D] -> [B, S, H, D]
        cu_seqlens=cu_seqlens, seq_len=seq_len, softmax_scale=scaling,
    )
    return out, None  # [B, S_local, H, D], no weights


def _padding_mask_only(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any,
) -> torch.Tensor | None:
    """``AttentionMaskInterface["lightning_sp"]``: hand the 2-D padding mask ``[B, N]`` through (``None``
    if it has no padding) so the attention can turn it into a length or refuse it, instead of HF
    silently dropping it. Causality, windows and packing are the attention function's business."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def _register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    _require_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, sequence_parallel_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask_only)


# ------------------------------------------------------------------------------------ model fixes


@dataclass(frozen=True, kw_only=True)
class _Fix:
    """A per-model correction: ``applies(model)``; ``patch(model, state)`` (idempotent) changes modules;
    ``prepare(model, batch, seq_len)`` adds global facts to the shard (``position_ids`` and/or
    ``token_dropout_ratio``) from the global batch."""

    name: str
    applies: Callable[[nn.Module], bool]
    patch: Callable[[nn.Module, _State], None] = lambda model, state: None
    prepare: Callable[[nn.Module, dict, torch.Tensor | None], dict] = lambda model, batch, mask: {}


def _base_config(model: nn.Module):
    return getattr(model, "config", None)


_CUMSUM_POSITION_MODELS = frozenset({
    "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod",
    "longformer", "ibert", "mpnet", "luke", "esm",
})


def _uses_cumsum_positions(model: nn.Module) -> bool:
    cfg = _base_config(model)
    if cfg is None or getattr(cfg, "model_type", None) not in _CUMSUM_POSITION_MODELS:
        return False
    return getattr(cfg, "position_embedding_type", "absolute") == "absolute"


def _cumsum_positions(model: nn.Module, batch: dict, mask: torch.Tensor | None) -> dict:
    """BERT/RoBERTa-style ``create_position_ids_from_input_ids`` over the GLOBAL sequence: non-padding
    tokens count up from ``padding_idx + 1``, padding keeps ``padding_idx`` (HF computes this from the
    input_ids it sees, i.e. over the local shard, which is wrong after the first shard)."""
    if "position_ids" in batch or "input_ids" not in batch:
        return {}
    pad = _base_config(model).pad_token_id
    token = batch["input_ids"].ne(pad).int()
    return {"position_ids": (torch.cumsum(token, dim=1).type_as(token) * token).long() + pad}


def _is_esm_token_dropout(model: nn.Module) -> bool:
    cfg = _base_config(model)
    return getattr(cfg, "model_type", None) == "esm" and bool(getattr(cfg, "token_dropout", False))


def _esm_embeddings(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "EsmEmbeddings"]


def _esm_token_dropout_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None):
    """``EsmEmbeddings.forward`` with the token-dropout rescaling done with the GLOBAL mask ratio.

    HF rescales by ``(1 - 0.15 * 0.8) / (1 - ratio)`` with ``ratio = n_mask / length`` of the row it sees;
    under sequence parallelism that is the local shard. Same float32 arithmetic, global ratio."""
    state: _State = getattr(self, _STATE_ATTR)
    info = state.info
    original = type(self).forward
    if info is None or info.token_dropout_ratio is None or not self.token_dropout or input_ids is None:
        return original(self, input_ids, attention_mask, position_ids, inputs_embeds)
    if position_ids is None:
        raise ValueError("sharded ESM inputs need global position_ids: build them with shard_inputs")
    if inputs_embeds is None:
        inputs_embeds = self.word_embeddings(input_ids)
    embeddings = inputs_embeds.masked_fill((input_ids == self.mask_token_id).unsqueeze(-1), 0.0)
    mask_ratio_train = 0.15 * 0.8  # HF's (and ESM's) constant
    ratio = info.token_dropout_ratio.to(embeddings.device)  # float32 [B, S_local]: the row's ratio at every token
    if ratio.shape != input_ids.shape:
        raise ValueError(f"ShardInfo.token_dropout_ratio {tuple(ratio.shape)} does not match input_ids {tuple(input_ids.shape)}")
    embeddings = (embeddings * (1 - mask_ratio_train) / (1 - ratio)[..., None]).to(embeddings.dtype)
    # input_ids=None: HF's forward skips its own (local) token dropout and takes the embeddings as given
    return original(self, None, attention_mask, position_ids, embeddings)


def _patch_esm(model: nn.Module, state: _State) -> None:
    import types

    for emb in _esm_embeddings(model):
        setattr(emb, _STATE_ATTR, state)
        if getattr(emb.forward, "__func__", None) is not _esm_token_dropout_forward:
            emb.forward = types.MethodType(_esm_token_dropout_forward, emb)


def _esm_ratio(model: nn.Module, batch: dict, mask: torch.Tensor | None) -> dict:
    """HF's ratio, float32 ``[B]``: ``(input_ids == mask).sum(-1).float() / src_lengths``, where
    ``src_lengths`` is ``attention_mask.sum(-1)`` if a mask is given, else the row length."""
    if "input_ids" not in batch:
        return {}
    ids = batch["input_ids"]
    src_lengths = mask.sum(-1) if mask is not None else ids.shape[1]
    ratio = (ids == _base_config(model).mask_token_id).sum(-1).float() / src_lengths
    return {"token_dropout_ratio": ratio}


_FIXES: tuple[_Fix, ...] = (
    _Fix(name="cumsum_position_ids", applies=_uses_cumsum_positions, prepare=_cumsum_positions),
    _Fix(name="esm_token_dropout", applies=_is_esm_token_dropout, patch=_patch_esm, prepare=_esm_ratio),
)


def model_fixes(model: nn.Module) -> list[str]:
    """Names of the per-model fixes that apply to ``model``."""
    return [f.name for f in _FIXES if f.applies(model)]


# ------------------------------------------------------------------------------------ public API


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that call transformers' ``AttentionInterface``: they carry an ``is_causal`` flag and
    the model config (``LlamaAttention``, ``EsmSelfAttention``, ...)."""
    return [
        m for m in model.modules()
        if "Attention" in type(m).__name__ and hasattr(m, "is_causal") and hasattr(m, "config")
        and not isinstance(m, SequenceParallelAttention)
    ]


def _sp_modules(model: nn.Module) -> list[SequenceParallelAttention]:
    return [m.sp_attention for m in attention_layers(model) if isinstance(getattr(m, "sp_attention", None), SequenceParallelAttention)]


def is_causal_lm(model: nn.Module) -> bool:
    """Whether HF's loss for ``model`` shifts labels (``*ForCausalLM``)."""
    return getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith("ForCausalLM")


def _pre_forward(state: _State):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        info = kwargs.pop(SHARD_INFO_KEY, None)
        if info is not None and not isinstance(info, ShardInfo):
            raise TypeError(f"{SHARD_INFO_KEY}= must be the ShardInfo shard_inputs made, got {type(info).__name__}")
        if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
            _reject_unsupported(module, 0.0, {"output_attentions": True})
        state.info = info
        return args, kwargs

    return hook


def apply_sequence_parallel(
    model: nn.Module,
    *,
    group=None,
    backend: str = "auto",
    ulysses_degree: int | None = None,
    kernel: str = "auto",
) -> nn.Module:
    """Make every attention layer of a transformers model run ``SequenceParallelAttention``. Idempotent.

    Args:
        model: a ``transformers.PreTrainedModel`` whose attention goes through ``AttentionInterface``
            (Llama, Qwen2, Mistral, ESM, RoBERTa, ... in transformers >= 5).
        group: the sequence-parallel process group. ``None``: the backend of a ``SequenceParallelStrategy``
            that binds the model, plain local attention when nothing binds it.
        backend: with ``group``, the backend (``"ulysses"``, ``"ring"``, ``"zigzag_ring"``, ``"allgather_kv"``,
            ``"usp"``, ``"colossal"``, ``"local"``, ``"auto"``). Without ``group`` only ``"auto"`` (the strategy's
            choice) or ``"local"``.
        ulysses_degree, kernel: as for ``SequenceParallelAttention``.

    Returns the same model (modified in place): ``attn_implementation="lightning_sp"``, each attention
    layer with an ``sp_attention`` child (no parameters, so state dicts are unchanged), a forward
    pre-hook taking the ``ShardInfo`` of ``shard_inputs``, and the per-model fixes of ``model_fixes``.
    """
    _register()
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"apply_sequence_parallel needs a transformers PreTrainedModel, got {type(model).__name__}")
    if not model._can_set_attn_implementation():
        raise NotImplementedError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so its "
            "attention cannot be replaced; use a model class that supports attn_implementation='sdpa'/'flex_attention'"
        )
    if group is None and backend not in ("auto", "local"):
        raise ValueError(
            f"backend={backend!r} needs group= (the sequence-parallel process group); without a group the model "
            "uses the backend of SequenceParallelStrategy(backend=...) that binds it (keep backend='auto')"
        )
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"found no attention layers (modules with is_causal and config) in {type(model).__name__}")
    state = getattr(model, _STATE_ATTR, None)
    if not isinstance(state, _State):
        state = _State()
        setattr(model, _STATE_ATTR, state)
    for layer in layers:
        layer.sp_attention = SequenceParallelAttention(
            causal=bool(layer.is_causal), backend=None if group is None and backend == "auto" else backend,
            group=group, ulysses_degree=ulysses_degree, kernel=kernel,
        )
        setattr(layer, _STATE_ATTR, state)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if state.hook is None:
        state.hook = model.register_forward_pre_hook(_pre_forward(state), with_kwargs=True)
    state.fixes = []
    for fix in _FIXES:
        if fix.applies(model):
            fix.patch(model, state)
            state.fixes.append(fix.name)
    return model


_CONSUMED_KEYS = ("attention_mask", "cu_seqlens", "labels", "position_ids", SHARD_INFO_KEY)


def _right_padding_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    """``mask [B, N]`` -> unpadded length per row ``[B]``, or ``None`` without padding; raises unless
    every row is tokens followed by padding."""
    mask = mask.bool()
    if bool(mask.all()):
        return None
    lengths = mask.sum(-1)
    if not torch.equal(mask, torch.arange(mask.size(1), device=mask.device)[None, :] < lengths[:, None]):
        raise NotImplementedError(
            "only right padding can be expressed exactly (the attention knows a global length and packed documents, "
            "not arbitrary masks): pad on the right (tokenizer.padding_side = 'right'), or pack the sequences into "
            "one row with 'position_ids' restarting at 0 per sequence (causal LMs) or a global 'cu_seqlens'"
        )
    return lengths


def _pack_rows(rows: dict[str, torch.Tensor], lengths: list[int]) -> dict[str, torch.Tensor]:
    """Note [Packing padded rows]: rows of different unpadded lengths ``L_i`` cannot share one global
    length, so their real tokens are packed into one row ``[1, sum L_i, ...]`` and become documents
    (``cu_seqlens = [0, L_0, L_0 + L_1, ...]``); padding is dropped. Per-row facts (positions,
    globally shifted labels, ESM's mask ratio) are computed on the rows first, so every real token
    sees exactly what the padded batch gives it::

        row 0:  a a a . .        packed:  a a a b b b b      cu_seqlens [0, 3, 7]
        row 1:  b b b b .
    """
    return {k: torch.cat([t[i, :n] for i, n in enumerate(lengths)], dim=0).unsqueeze(0) for k, t in rows.items()}


def shard_inputs(batch: Mapping[str, Any], model: nn.Module, *, causal_lm: bool | None = None, ignore_index: int = -100) -> dict:
    """This rank's shard of a global HF batch, as keyword arguments for ``model(**shard)`` (pop ``labels`` first).

    ``batch`` (the same on every rank of the group): ``input_ids [B, N]`` (or ``inputs_embeds [B, N, E]``),
    optional ``labels [B, N]`` in HF's convention (the tokens themselves, ``ignore_index`` to ignore; NOT
    shifted), optional right-padding ``attention_mask [B, N]``, optional packed ``position_ids [B, N]``
    (restarting at 0 per document; causal LMs) or a global ``cu_seqlens [n_docs + 1]`` (``B == 1``).
    Other tensors ``[B, N, ...]`` are sharded along dim 1, anything else passes through.

    Returns ``input_ids [B', S_local]``, global ``position_ids``, ``labels`` (for causal LMs shifted over
    the global sequence as HF's loss does; each row's last token ``ignore_index``) and a ``ShardInfo``
    under ``"sequence_parallel"``. The attention mask is not passed on: right padding is dropped (rows of
    one length ``L`` are cut to ``L`` columns; rows of different lengths are packed into one row of
    documents, ``B' = 1``, Note [Packing padded rows]); any other mask raises. Logits therefore cover
    the real tokens only, in row order.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_inputs takes a dict batch (input_ids, labels, attention_mask, ...), got {type(batch).__name__}")
    sps = _sp_modules(model)
    if not sps:
        raise ValueError("call apply_sequence_parallel(model) before shard_inputs(batch, model)")
    sp = sps[0]
    group = sp.process_group
    world, _ = group_size_and_rank(group)
    if sp.resolved_backend() == "local":
        world = 1
    layout = sp.layout
    if ("input_ids" in batch) == ("inputs_embeds" in batch):
        raise ValueError(f"the batch needs exactly one of input_ids / inputs_embeds; got keys {sorted(batch)}")
    main = batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]
    if main.dim() < 2:
        raise ValueError(f"input_ids must be [B, N]; got shape {tuple(main.shape)} (add the batch dim: x[None])")
    bsz, n = main.shape[:2]
    for key in ("labels", "attention_mask", "position_ids"):
        if key in batch and batch[key] is not None and tuple(batch[key].shape[:2]) != (bsz, n):
            raise ValueError(f"{key} has shape {tuple(batch[key].shape)} but input_ids is [B, N] = [{bsz}, {n}]")
    causal = is_causal_lm(model) if causal_lm is None else causal_lm
    mask = batch.get("attention_mask")
    lengths = _right_padding_lengths(mask) if mask is not None else None
    if lengths is None:
        mask = None  # all ones: nothing to describe (HF's own src_lengths then equal the row length)
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is not None and bsz != 1:
        raise ValueError(f"packed documents (cu_seqlens) need batch size 1 (pack the rows into one); got B={bsz}")

    # per-row facts over the GLOBAL rows: fixes (positions, ESM mask ratio), positions, shifted labels
    extra: dict = {}
    for fix in _FIXES:
        if fix.applies(model):
            extra.update(fix.prepare(model, dict(batch), mask))
    position_ids = batch.get("position_ids")
    fixed_positions = extra.pop("position_ids", None)
    if position_ids is None:
        position_ids = fixed_positions
    if position_ids is None:
        position_ids = torch.arange(n, device=main.device).unsqueeze(0).expand(bsz, -1)
    rows: dict[str, torch.Tensor] = {"position_ids": position_ids}
    if causal and position_ids is batch.get("position_ids") and mask is None and cu_seqlens is None and bsz == 1:
        # packed position_ids: documents start where positions do not count up (HF's causal-mask rule)
        starts = torch.nonzero(position_ids[0, 1:] - position_ids[0, :-1] != 1).flatten() + 1
        if starts.numel():
            cu_seqlens = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([n])])
    labels = batch.get("labels")
    if labels is not None:
        if causal:  # HF's causal-LM loss predicts token i+1 at position i: shift over the GLOBAL row
            labels = torch.cat([labels[:, 1:], labels.new_full((bsz, 1), ignore_index)], dim=1)
        if lengths is not None:  # padding predicts nothing (and nothing predicts padding)
            keep = torch.arange(n, device=labels.device)[None, :] < (lengths[:, None] - (1 if causal else 0))
            labels = labels.masked_fill(~keep, ignore_index)
        rows["labels"] = labels
    ratio = extra.get("token_dropout_ratio")  # float32 [B]
    if ratio is not None:
        rows["token_dropout_ratio"] = ratio[:, None].expand(bsz, n)  # per token, so it can be sharded/packed
    for key, value in batch.items():
        if key not in _CONSUMED_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (bsz, n):
            rows[key] = value
    passthrough = {k: v for k, v in batch.items() if k not in _CONSUMED_KEYS and k not in rows}

    if lengths is not None and bool((lengths != lengths[0]).any()):
        rows = _pack_rows(rows, lengths.tolist())  # Note [Packing padded rows]
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        bsz, n = 1, int(lengths.sum())
    elif lengths is not None:  # rows of one length L: the padding columns are dropped (exact, and cheaper)
        n = int(lengths[0])
        rows = {k: t[:, :n] for k, t in rows.items()}
        if cu_seqlens is not None and int(torch.as_tensor(cu_seqlens)[-1]) > n:
            raise ValueError(f"cu_seqlens ends at {int(torch.as_tensor(cu_seqlens)[-1])} but the mask leaves {n} tokens")
    seq_len = n  # no padding is left; only the layout pads (to N_pad), and the attention knows N
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens).to(dtype=torch.int32).flatten().cpu()
        if int(cu_seqlens[-1]) != seq_len:
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but the batch has {seq_len} unpadded tokens")

    n_pad = padded_length(n, world, layout)
    pad_token = getattr(_base_config(model), "pad_token_id", None) or 0
    if n_pad > n:  # padded positions repeat the last real one, so absolute-position lookups stay in range
        pos = rows["position_ids"]
        rows["position_ids"] = torch.cat([pos, pos[:, -1:].expand(bsz, n_pad - n)], dim=1)
    shard: dict = dict(passthrough)
    for key, value in rows.items():
        if world > 1:  # local attention (no group) does not shard, even under a process group (plain DDP)
            pad_value = ignore_index if key == "labels" else pad_token if key == "input_ids" else 0
            value = shard_sequence(value, group, dim=1, layout=layout, pad_value=pad_value)
        shard[key] = value
    if "use_cache" in inspect.signature(model.forward).parameters:
        shard["use_cache"] = False
    shard[SHARD_INFO_KEY] = ShardInfo(
        seq_len=seq_len, padded_len=n_pad, cu_seqlens=cu_seqlens, token_dropout_ratio=shard.pop("token_dropout_ratio", None),
    )
    return shard
