"""Hugging Face ``transformers`` models under exact sequence parallelism, in one call.

    model = apply_sequence_parallel(AutoModelForCausalLM.from_config(cfg), group=sp_group, backend="zigzag_ring")
    shard = shard_inputs({"input_ids": ids, "labels": ids}, model)      # global batch -> this rank's shard
    labels = shard.pop("labels")                                         # [B, S_local], shifted globally
    logits = model(**shard).logits                                       # [B, S_local, V]
    loss = sequence_parallel_cross_entropy(logits, labels, group=sp_group)
    # or, labels left in the shard (as HF's Trainer calls it): loss = model(**shard).loss, the same value

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
      custom attention without a mask function     drops padding on either side (rows of different
                                                   lengths: packed documents); an unsharded call
                                                   gets ``AttentionMask(key_padding=...)``
    4-D ``attention_mask`` ``[B, 1|H, N, N]``      recognised (causal / bidirectional, window, padding,
                                                   block-diagonal documents -> ``cu_seqlens``) or each
                                                   rank's query rows as a ``mask_mod``
                                                   (Note [Recognising a 4-D mask])
    causal-LM loss shifts labels inside a shard  labels shifted over the global sequence first
    ``position_ids`` default to local positions  global ``position_ids`` always passed
    positions by cumulative sums (RoBERTa/ESM-1b) computed over the global sequence (``_FIXES``)
    ESM token dropout ratio over the local shard computed over the global sequence (``_FIXES``)
    labels of ``GPT2LMHeadModel`` / ``*LMHeadModel``  causal LMs recognised by the registry and HF's loss
      not shifted (no ``ForCausalLM`` in the name)  rule (``is_causal_lm``), not by class name
    dynamic / LongRoPE frequencies from the      HF's update run with the global ``max_position``,
      shard's own largest position                 then the plain rotary (``_FIXES``)
    Llama-4 NoPE temperature from local columns  rescaled to global columns (``token_index``)
    Llama-4 chunked attention (only in the mask)  packed documents cut at chunk boundaries
    MLA: value head dim != query/key head dim    zero-padded to one head dim, sliced after
    ``sliding_window`` / ``softcap`` / ``s_aux``  an ``AttentionMask`` and sinks per layer call
      per layer (Gemma, Mistral, gpt-oss)          (Note [Hugging Face's mask kwargs])
    T5's ``position_bias`` from local positions   the bucket table itself, on global positions, with
      (T5, MT5, UMT5 encoders)                     its gradient (Note [T5's relative-position bias])
    convolutions / SSMs mix tokens per shard     refused, naming the module (``token_mixers_...``)
    ==========================================  ==================================================

    Per-batch facts (``ShardInfo``) travel in the shard dict under ``"sequence_parallel"`` and stay with
    the forward they belong to: Note [Per-forward shard info]. Labels passed to ``model(**shard)`` are
    the ones ``shard_inputs`` made (already shifted over the global sequence): the loss is the token
    mean over the whole global batch, Note [The loss of model(**shard)]. A PEFT model (LoRA, DoRA, ...)
    is unwrapped to the transformers model under it.

Note [Per-forward shard info]
    Gradient checkpointing recomputes a layer's forward in backward, possibly after other forwards of
    the same model ran (a ``no_grad`` forward for reference log-probs, an evaluation, a second micro-batch
    alive at once). So no forward's facts are kept in state the whole model shares:

    - the model's forward pre-hook pops the ``ShardInfo`` and hands it back to the forward as a keyword
      argument; transformers passes a forward's keyword arguments down to ``AttentionInterface``
      functions (as it does for flash-attention's ``cu_seq_lens_q``), and its checkpointed layers are
      ``partial(forward, **kwargs)``: the recompute gets the ShardInfo of the forward it recomputes;
    - modules that get no keyword arguments (ESM's embeddings, length-dependent rotary) read the
      ShardInfo of the forward that is running: a stack of running forwards, pushed by the pre-hook and
      popped by an always-called forward hook, empty between forwards;
    - a model that does not pass its keyword arguments down (its attention gets no ShardInfo, only the
      running forward's) is refused under gradient checkpointing at the forward, and an attention call
      with no ShardInfo outside any forward (a recompute of such a model) raises: never another
      forward's facts.

Note [The loss of model(**shard)]
    HF's causal-LM loss shifts labels inside what it is given, i.e. inside each shard, and takes the
    mean over the shard's tokens. ``shard_inputs`` already shifted them over the global row (masked LMs:
    no shift). So when a sharded forward gets ``labels`` (or ``shift_labels``), the pre-hook takes them
    out of HF's hands and the forward hook sets ``output.loss`` to the cross-entropy of the logits
    against them with no further shift, summed over the sequence-parallel group and divided by the
    global count of labelled tokens (or by ``num_items_in_batch`` when given, as HF's ``Trainer`` does
    for gradient accumulation, if the model's own loss is HF's ``loss_function``: ESM's and RoBERTa's
    ignore it): the same value on every rank, equal to the unsharded ``model(**batch).loss``;
    its backward sums over the group, so averaging gradients over all ranks gives the unsharded gradient
    (as ``sequence_parallel_cross_entropy``, which it equals when ``num_items_in_batch`` is not given).
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_sp.attention import SequenceParallelAttention
from lightning_sp.comm.collectives import all_reduce_sum
from lightning_sp.layout import SequenceLayout, group_size_and_rank, padded_length, shard_sequence, token_indices
from lightning_sp.loss import cross_entropy_sum
from lightning_sp.masks import AttentionMask, padding_ranges

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
    "token_mixers_outside_attention",
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
    max_position: int | None = None
    """The largest position id HF would see on the global batch (its ``max(position_ids) + 1`` picks the
    frequencies of length-dependent RoPE: dynamic NTK, LongRoPE), the same on every rank."""
    token_index: torch.Tensor | None = None
    """int64 ``[B', S_local]``: each of this shard's tokens' column in its row of the global batch (HF's
    ``arange`` over the row; Llama-4's attention temperature)."""
    chunk_cu_seqlens: torch.Tensor | None = None
    """int32 global document boundaries of chunked-attention layers (Llama-4): ``cu_seqlens`` (or
    ``[0, N]``) split further wherever a row's column is a multiple of ``config.attention_chunk_size``."""
    ignore_index: int = -100
    """The label value that predicts nothing (``shard_inputs(ignore_index=...)``): the loss of
    ``model(**shard)`` ignores it (Note [The loss of model(**shard)])."""
    given_mask: "_GivenMask | None" = None
    """What a 4-D ``attention_mask`` became (Note [Recognising a 4-D mask]): its causality and window, or
    this rank's rows of it; ``None`` for 2-D masks (their padding is dropped) and no mask."""


@dataclass(kw_only=True)
class _Forward:
    """One running forward of the model, from its pre-hook to its forward hook (Note [Per-forward shard info])."""

    info: ShardInfo | None
    checkpointed: bool
    """HF gradient checkpointing will recompute this forward's layers in backward."""
    labels: torch.Tensor | None = None
    """``[B', S_local]`` labels of a sharded forward, taken from HF's loss (Note [The loss of model(**shard)])."""
    num_items_in_batch: Any = None


@dataclass(kw_only=True)
class _State:
    """What the model, its attention layers and fixed modules share (not a module-level global): what
    ``apply_sequence_parallel`` found, and the forwards running now (none between forwards)."""

    forwards: list[_Forward] = field(default_factory=list)
    hooks: tuple = ()
    fixes: list[str] = field(default_factory=list)
    token_mixers: list[str] = field(default_factory=list)
    """``token_mixers_outside_attention(model)``, found once by ``apply_sequence_parallel``."""
    passes_kwargs: bool = True
    """The model's ``forward`` takes ``**kwargs`` (transformers hands them down to the attention)."""
    loss_takes_num_items: bool = True
    """The model's loss is HF's ``loss_function`` (which divides by ``num_items_in_batch``), not a mean of
    its own (ESM's and RoBERTa's ``CrossEntropyLoss()`` ignore ``num_items_in_batch``)."""

    last_given_mask: tuple | None = None
    """``(weakref to HF's attention_mask, its _version, query shape, _GivenMask)`` of the last unsharded call: HF
    hands every layer the same mask tensor, which is read (O(B N^2) for a 4-D mask) once, not once per layer."""

    def running_info(self) -> ShardInfo | None:
        """The ShardInfo of the forward running now (``None`` between forwards or for an unsharded call)."""
        return self.forwards[-1].info if self.forwards else None


# ------------------------------------------------------------------------------------ the attention


def _reject_unsupported(module: nn.Module, dropout: float, kwargs: dict) -> None:
    """Everything the exact backends cannot do raises here, naming the alternative (STYLE 9)."""
    if dropout and module.training:
        raise NotImplementedError(
            f"attention dropout ({dropout}) is not supported under sequence parallelism (every rank would need the "
            "same RNG stream); set config.attention_dropout = 0 (for ESM: attention_probs_dropout_prob = 0)"
        )
    for name in ("sinks",):  # position_bias: _relative_position_bias (T5's learned buckets, or refused there)
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


def _shard_info_of_call(module: nn.Module, state: _State, kwargs: dict) -> ShardInfo | None:
    """The ShardInfo of the forward this attention call belongs to (Note [Per-forward shard info]):
    the one handed down with the call, else the running forward's; never another forward's."""
    info = kwargs.pop(SHARD_INFO_KEY, None)
    if info is not None:
        if not isinstance(info, ShardInfo):
            raise TypeError(f"{SHARD_INFO_KEY}= must be the ShardInfo shard_inputs made, got {type(info).__name__}")
        return info
    running = state.forwards[-1] if state.forwards else None
    if running is not None and running.info is not None and running.checkpointed:
        raise NotImplementedError(
            f"{type(module).__name__} gets no keyword arguments from its model's forward, so under gradient "
            "checkpointing the recompute in backward could not know which batch's shard it recomputes (another "
            "forward may have run in between); turn gradient checkpointing off for this model "
            "(model.gradient_checkpointing_disable()), or use a model class whose forward passes **kwargs to its "
            "attention layers (transformers' Llama, Qwen, Mistral, ESM, ... do)"
        )
    return running.info if running is not None else None


def _checked_arguments(module: nn.Module, sp: SequenceParallelAttention, state: _State, query: torch.Tensor,
                       key: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
                       kwargs: dict) -> tuple[int, torch.Tensor | None, ShardInfo | None]:
    """``(seq_len, cu_seqlens, info)`` of this call; raises what the exact backends cannot do."""
    info = _shard_info_of_call(module, state, kwargs)
    _reject_unsupported(module, dropout, kwargs)
    if key.size(2) != query.size(2):
        raise NotImplementedError(
            f"query and key lengths differ ({query.size(2)} vs {key.size(2)}): cross-attention and KV caches "
            "(generation) are not supported under sequence parallelism; use the model's own attention for them"
        )
    if attention_mask is not None and attention_mask.dim() not in (2, 4):
        raise NotImplementedError(
            f"a {attention_mask.dim()}-D attention mask {tuple(attention_mask.shape)} is neither a padding mask [B, N] "
            "nor a token-to-token mask [B, 1 or H, N, N]; pass one of those"
        )
    world, _ = group_size_and_rank(sp.process_group)
    if sp.resolved_backend() == "local":
        world = 1
    s_local = query.size(2)
    if info is None:
        if world > 1:
            raise ValueError(
                "the model runs sequence parallel but got no ShardInfo: build its inputs with "
                "shard_inputs(global_batch, model) and call model(**shard), so the attention knows the global length"
                + ("" if state.forwards else " (this call came outside any forward of the model: a recompute in "
                   "backward by activation checkpointing of a model whose forward does not pass **kwargs down to "
                   "its attention layers cannot know its batch; checkpoint with transformers' "
                   "model.gradient_checkpointing_enable() on a model that does, or turn checkpointing off)")
            )
        seq_len = s_local
        if attention_mask is not None and attention_mask.dim() == 2:  # unsharded call with a padding mask
            ranges = _padding_ranges(attention_mask)  # other padding: key_padding (_given_mask_of_call)
            if ranges is not None and all(r == (0, ranges[0][1]) for r in ranges):
                seq_len = ranges[0][1]  # right padding of one length: a global length
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
    # a 4-D mask is every layer's whole mask, chunked layers' too (HF hands it to every layer as given)
    four_d = info.given_mask is not None if info is not None else attention_mask is not None and attention_mask.dim() == 4
    if _is_chunked_layer(module) and not four_d:  # Note [Chunked attention is packed documents]
        if info is None:
            cu_seqlens = _chunk_boundaries(None, seq_len, torch.arange(seq_len)[None], module.config.attention_chunk_size)
        elif info.chunk_cu_seqlens is None:
            raise ValueError("a chunked-attention layer got a ShardInfo without chunk_cu_seqlens: build the shard "
                             "with shard_inputs(global_batch, model) after apply_sequence_parallel(model)")
        else:
            cu_seqlens = info.chunk_cu_seqlens
    return seq_len, cu_seqlens, info


def _mask_and_sinks(query: torch.Tensor, causal: bool, kwargs: dict) -> tuple[AttentionMask | None, torch.Tensor | None]:
    """Note [Hugging Face's mask kwargs]: the per-layer kwargs HF passes to the attention function, as an
    ``AttentionMask`` and sinks (each layer call carries its own, so local and global layers differ):

    - ``sliding_window=W`` (Mistral, Qwen2/3, Gemma-2/3, Cohere2, gpt-oss, ModernBERT): HF's masks let ``q`` see
      ``k`` iff ``q - k < W`` (causal; ``sliding_window_overlay``) or ``|q - k| < W`` (bidirectional: Gemma-3's
      bidirectional overlay; ModernBERT passes ``config.sliding_window + 1`` for its mask ``|q - k| <= half``),
      i.e. ``window=(W - 1, 0)`` causal and ``(W - 1, W - 1)`` bidirectional, on global positions;
    - ``softcap=c`` (Gemma-2): ``c * tanh(s / c)`` on the scaled scores, as HF's eager attention;
    - ``s_aux`` (gpt-oss): one learned logit per query head joining each row's softmax (HF's eager
      ``cat([scores, sinks])``), passed as the module's parameter so its gradient reaches it.

    ``None`` where a kwarg is absent, so layers without them run the plain kernels."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise NotImplementedError(f"sliding_window={window!r} is not a positive int; cannot map it to a window")
        window = (window - 1, 0 if causal else window - 1)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.numel() != query.size(1):
            raise NotImplementedError(
                f"s_aux of shape {tuple(getattr(sinks, 'shape', ()))} is not one sink logit per query head "
                f"([{query.size(1)}], gpt-oss's); only per-head attention sinks are supported")
    if window is None and softcap is None:
        return None, sinks
    return AttentionMask(window=window, softcap=None if softcap is None else float(softcap)), sinks


_BIAS_OWNER_ATTR = "_lightning_sp_relative_bias_owner"


def _relative_position_bias(module: nn.Module, query: torch.Tensor, kwargs: dict):
    """Note [T5's relative-position bias]: a layer call's ``position_bias`` kwarg as the ``RelativePositionBias``
    of the table that made it (``None`` without one); raises where that table is not known.

    T5 (MT5, ``T5EncoderModel``...) computes ``position_bias [1, H, S, S]`` in the first layer of a stack from its
    ``relative_attention_bias`` table (buckets of ``k - q``, HF's ``_relative_position_bucket``) and hands the
    tensor on to every later layer; UMT5 computes it in every layer from the layer's own table. Under sequence
    parallelism that tensor is wrong twice over: it is built from the shard's local positions, and a rank holds
    no ``[S, N]`` block of it. So the tensor is dropped, and the attention gets the table itself
    (``AttentionMask(relative_bias=...)``), which adds ``table[bucket(k - q), h]`` on global positions and gives
    the table its exact gradient (Note [Relative-position bias gradient] in ``masks.py``): from every layer that
    uses it, as HF's autograd does through the shared tensor. The owner of the table is the layer itself
    (``has_relative_attention_bias``) or the stack's first layer (``_link_relative_bias_owners``, at
    ``apply_sequence_parallel``). Bidirectional buckets unless the owner is a decoder's (HF's rule)."""
    from lightning_sp.masks import RelativePositionBias

    position_bias = kwargs.pop("position_bias", None)
    if position_bias is None:
        return None
    owner = module if getattr(module, "has_relative_attention_bias", False) else module.__dict__.get(_BIAS_OWNER_ATTR)
    table = getattr(getattr(owner, "relative_attention_bias", None), "weight", None)
    if owner is None or not isinstance(table, torch.Tensor):
        if hasattr(module, "has_relative_attention_bias"):  # T5's cross-attention: no table, a zero bias
            raise NotImplementedError(
                f"{type(module).__name__} gets a position_bias but no relative_attention_bias table (of its own or of "
                "its stack's first layer): T5's cross-attention (encoder-decoder models) is not supported under "
                "sequence parallelism; run the encoder alone (T5EncoderModel, MT5EncoderModel, UMT5EncoderModel)"
            )
        raise NotImplementedError(
            f"{type(module).__name__} passes an additive position_bias whose source lightning_sp does not know (only "
            "T5-style learned relative-position buckets, relative_attention_bias of the layer or of its stack's first "
            "layer, are mapped); use a model with rotary or absolute positions"
        )
    if table.dim() != 2 or table.size(1) != query.size(1):
        raise NotImplementedError(f"{type(owner).__name__}.relative_attention_bias is {tuple(table.shape)}, not "
                                  f"[num_buckets, {query.size(1)}] (one column per query head)")
    return RelativePositionBias(table, num_buckets=int(owner.relative_attention_num_buckets),
                                max_distance=int(owner.relative_attention_max_distance),
                                bidirectional=not bool(getattr(owner, "is_decoder", False)))


def _with_relative_position_bias(mask: AttentionMask | None, module: nn.Module, query: torch.Tensor,
                                 kwargs: dict) -> AttentionMask | None:
    """``mask`` with the layer's relative-position bias (``_relative_position_bias``) added, if it has one."""
    bias = _relative_position_bias(module, query, kwargs)
    if bias is None:
        return mask
    return (mask or AttentionMask()).merged(AttentionMask(relative_bias=bias))


def _has_relative_bias_stacks(model: nn.Module) -> bool:
    return any(getattr(m, "has_relative_attention_bias", False) for m in model.modules())


def _link_relative_bias_owners(model: nn.Module, state: _State) -> None:
    """Note [T5's relative-position bias]: in each stack of blocks (``T5Stack.block``), the self-attention of a
    block without a table of its own uses the first block's: record it (outside ``_modules``, so it is no
    submodule and state dicts are unchanged; ``copy.deepcopy`` maps it to the copy's first layer)."""
    for blocks in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
        firsts = [next((a for a in blk.modules() if hasattr(a, "has_relative_attention_bias")), None) for blk in blocks]
        # a stack of like blocks (a block's own list of sub-layers mixes attention with feed-forward: skipped)
        if (not firsts or any(a is None for a in firsts) or len({type(a) for a in firsts}) != 1
                or not firsts[0].has_relative_attention_bias):
            continue
        for attn in firsts[1:]:
            if attn is not None and not attn.has_relative_attention_bias:
                attn.__dict__[_BIAS_OWNER_ATTR] = firsts[0]


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
    causal = bool(is_causal) if is_causal is not None else bool(getattr(module, "is_causal", True))
    try:  # a rejection on one rank must not leave its peers waiting in their attention's collectives
        seq_len, cu_seqlens, info = _checked_arguments(module, sp, state, query, key, attention_mask, dropout, kwargs)
        given = _given_mask_of_call(sp, attention_mask, info, query, state)  # padding, 4-D masks
        if given is not None and given.causal is not None:  # a 4-D mask is the whole mask (HF's eager / sdpa)
            causal = given.causal
            kwargs.pop("sliding_window", None)
        mask, sinks = _mask_and_sinks(query, causal, kwargs)  # Note [Hugging Face's mask kwargs]
        if given is not None and given.mask is not None:
            mask = given.mask if mask is None else mask.merged(given.mask)
        if given is not None and given.cu_seqlens is not None:  # an unsharded call's block-diagonal 4-D mask
            cu_seqlens = given.cu_seqlens
        mask = _with_relative_position_bias(mask, module, query, kwargs)  # Note [T5's relative-position bias]
    except (ValueError, NotImplementedError, TypeError) as err:
        sp.raise_on_every_rank(err, query)
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        query = _global_attention_temperature(module, query, info)  # Llama-4 NoPE layers: global positions
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as autocast runs HF's sdpa: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)  # (rotary often leaves q, k in float32 and v in bf16)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    sp.causal = causal  # HF decides causality per call (e.g. is_causal=False turns a decoder bidirectional)
    head_dim, value_dim = query.size(-1), value.size(-1)
    if scaling is None:
        scaling = head_dim**-0.5  # HF's default, fixed before any padding below
    width = max(head_dim, value_dim)
    if width != head_dim or width != value_dim:
        # MLA (DeepSeek-V2/V3: value head dim != query/key head dim): zero columns change neither q.k nor
        # softmax(q.k) @ v's first value_dim columns, so every backend runs one head dim and the extra
        # output columns (and their gradients) are dropped
        query, key = (F.pad(t, (0, width - head_dim)) for t in (query, key))
        value = F.pad(value, (0, width - value_dim))
    out = sp(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),  # [B, H, S, D] -> [B, S, H, D]
        cu_seqlens=cu_seqlens, seq_len=seq_len, softmax_scale=scaling, mask=mask, sinks=sinks,
    )
    return out[..., :value_dim], None  # [B, S_local, H, D_v], no weights


def _is_chunked_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a chunked-attention layer (Llama-4: ``config.layer_types[layer_idx]``)."""
    cfg = getattr(module, "config", None)
    layer_types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if layer_types is None or idx is None or idx >= len(layer_types):
        return False
    return layer_types[idx] == "chunked_attention" and getattr(cfg, "attention_chunk_size", None) is not None


def _chunk_boundaries(cu_seqlens: torch.Tensor | None, seq_len: int, token_index: torch.Tensor, chunk: int) -> torch.Tensor:
    """Note [Chunked attention is packed documents]: HF's chunked causal mask lets column ``q`` see
    column ``k`` iff ``k <= q`` and ``k // C == q // C`` (columns of the row). That is causal attention
    over documents that end at every multiple of ``C`` as well as at the real document ends, so it is
    exact on every backend that supports ``cu_seqlens``::

        C = 4, N = 10:   | a a a a | b b b b | c c |     cu_seqlens [0, 4, 8, 10]

    ``token_index [1, N]``: each packed token's column in its original row (rows of different lengths
    packed by ``shard_inputs`` restart at 0). -> int32 ``[n_docs + 1]``. A 4-D ``attention_mask`` replaces
    the chunking (HF hands a 4-D mask to every layer as given, chunked layers included)."""
    starts: set[int] = set()
    starts.update(int(i) for i in torch.nonzero(token_index[0, :seq_len] % int(chunk) == 0).flatten())
    if cu_seqlens is not None:
        starts.update(int(b) for b in cu_seqlens[:-1])
    starts.add(0)
    return torch.tensor(sorted(starts) + [seq_len], dtype=torch.int32)


def _temperature(module: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """Llama-4's NoPE-layer query temperature at row columns ``positions`` (HF's formula, float32)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def _global_attention_temperature(module: nn.Module, query: torch.Tensor, info: ShardInfo | None) -> torch.Tensor:
    """``query [B, H, S_local, D]`` as HF scaled it (temperature of the LOCAL columns ``0..S_local-1``)
    -> scaled by the temperature of each token's GLOBAL column instead. ``t >= 1``, so the ratio is
    well conditioned (float64: agrees with HF's own scaling to round-off)."""
    if info is None or info.token_index is None:
        return query  # unsharded call: HF's local columns are the global ones
    s_local = query.size(2)
    # HF multiplies by float32 temperatures; the ratio of the same float32 values, taken in query's dtype
    local = _temperature(module, torch.arange(s_local, device=query.device)).to(query.dtype)  # [S_local]
    index = info.token_index.to(query.device)  # [B', S_local]
    if index.shape != (query.size(0), s_local):
        raise ValueError(f"ShardInfo.token_index {tuple(index.shape)} does not match the shard [{query.size(0)}, {s_local}]")
    ratio = _temperature(module, index).to(query.dtype) / local  # [B', S_local]
    return (query * ratio[:, None, :, None]).to(query.dtype)


def _padding_mask_only(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any,
) -> torch.Tensor | None:
    """``AttentionMaskInterface["lightning_sp"]``: hand the 2-D padding mask ``[B, N]`` through (``None``
    if it has no padding) so the attention can turn it into a length or ``key_padding`` (or refuse holes), instead of HF
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
    info = state.running_info()  # embeddings get no keyword arguments (Note [Per-forward shard info])
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


def _rope_types(module: nn.Module) -> list[str]:
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, Mapping):
        return [str(t) for t in rope_type.values()]
    return [str(rope_type)] if rope_type is not None else []


def _length_dependent_rope_modules(model: nn.Module) -> list[nn.Module]:
    """Rotary modules whose frequencies depend on the sequence length (``dynamic`` NTK / YaRN, LongRoPE):
    HF picks them from ``max(position_ids) + 1`` of the tokens it sees, i.e. of the shard."""
    return [m for m in model.modules() if any("dynamic" in t or t == "longrope" for t in _rope_types(m))]


def _global_length_rope_forward(self, x, position_ids, layer_type=None):
    """A rotary module's forward with HF's length-dependent frequency update run for the GLOBAL length
    (``ShardInfo.max_position``, the same on every rank), then HF's rotary on this shard's positions."""
    state: _State = getattr(self, _STATE_ATTR)
    forward = type(self).forward  # HF's dynamic_rope_update wrapper around the plain rotary forward
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    info = state.running_info()  # rotary modules get no keyword arguments (Note [Per-forward shard info])
    if info is None or info.max_position is None:
        return forward(self, x, position_ids, **kwargs)
    longest = torch.full((1, 1), info.max_position, dtype=position_ids.dtype, device=position_ids.device)
    forward(self, x, longest, **kwargs)  # updates inv_freq / attention_scaling as the unsharded model would
    with torch.no_grad():  # rotary of the local positions without a second (local) update; HF's forward is no_grad
        return inspect.unwrap(forward)(self, x, position_ids, **kwargs)


def _patch_length_dependent_rope(model: nn.Module, state: _State) -> None:
    import types

    for rope in _length_dependent_rope_modules(model):
        if inspect.unwrap(type(rope).forward) is type(rope).forward:
            raise NotImplementedError(
                f"{type(rope).__name__} uses a length-dependent RoPE ({_rope_types(rope)}) without transformers' "
                "dynamic_rope_update, so lightning_sp cannot give it the global length; use rope_type 'default', "
                "'linear' or 'yarn' (fixed frequencies) or train without sequence parallelism"
            )
        setattr(rope, _STATE_ATTR, state)
        if getattr(rope.forward, "__func__", None) is not _global_length_rope_forward:
            rope.forward = types.MethodType(_global_length_rope_forward, rope)


_FIXES: tuple[_Fix, ...] = (
    _Fix(name="cumsum_position_ids", applies=_uses_cumsum_positions, prepare=_cumsum_positions),
    _Fix(name="esm_token_dropout", applies=_is_esm_token_dropout, patch=_patch_esm, prepare=_esm_ratio),
    _Fix(name="global_length_rope", applies=lambda model: bool(_length_dependent_rope_modules(model)),
         patch=_patch_length_dependent_rope),
    _Fix(name="relative_position_bias", applies=_has_relative_bias_stacks, patch=_link_relative_bias_owners),
)


# ------------------------------------------------------------------------------------ refusals

_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
_TOKEN_MIXER_NAMES = ("Mamba", "Mixer", "SSM", "ShortConv", "LinearAttention", "LightningAttention", "DeltaNet",
                      "RWKV", "Retention", "Recurrent", "RgLru", "LSTM")
_NOT_TOKEN_MIXERS = ("Norm", "Embedding", "MLP", "Head", "Cache", "Output", "Intermediate")


def token_mixers_outside_attention(model: nn.Module) -> list[str]:
    """``"path (Class)"`` of every module that mixes tokens along the sequence outside attention: a
    convolution with a kernel longer than 1 (LFM2's short causal convolutions), an SSM / linear-attention
    / recurrent block (by class name), or a layer whose ``config.layer_types`` entry is not attention.
    Under sequence parallelism such a layer sees only its shard, so it is refused, not run."""
    from transformers import PreTrainedModel

    paths: dict[str, str] = {}  # module path -> class, outermost match only
    for name, module in model.named_modules():
        cls = type(module).__name__
        if isinstance(module, PreTrainedModel):
            continue  # the model itself (MambaForCausalLM): what matters is the layer inside it
        conv = isinstance(module, nn.modules.conv._ConvNd) and any(k > 1 for k in module.kernel_size)
        named = any(word.lower() in cls.lower() for word in _TOKEN_MIXER_NAMES) and not any(
            word in cls for word in _NOT_TOKEN_MIXERS)  # MambaRMSNorm is a norm, not a mixer
        mixer = conv or named
        if mixer and not any(name.startswith(outer + ".") for outer in paths):
            paths[name] = cls
    found = [f"{name} ({cls})" for name, cls in paths.items()]
    cfg = _base_config(model)
    for idx, layer_type in enumerate(getattr(cfg, "layer_types", None) or ()):
        if layer_type not in _ATTENTION_LAYER_TYPES:
            found.append(f"layer {idx} (config.layer_types[{idx}] = {layer_type!r})")
    return found


def _refuse_token_mixers(model: nn.Module, mixers: list[str] | None = None) -> None:
    mixers = token_mixers_outside_attention(model) if mixers is None else mixers
    if mixers:
        shown = ", ".join(mixers[:4]) + (f", ... ({len(mixers)} in all)" if len(mixers) > 4 else "")
        raise NotImplementedError(
            f"{type(model).__name__} mixes tokens outside attention ({shown}): under sequence parallelism such a "
            "layer sees only its rank's shard and would silently drop the tokens across shard boundaries. Train it "
            "without sequence parallelism (backend='local'), or use a model whose every token-mixing layer is attention"
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
    """Whether HF's loss for ``model`` shifts labels (position ``i`` predicts token ``i + 1``), judged by
    what the model does, not by its class name:

    1. a class transformers lists as a causal LM (``MODEL_FOR_CAUSAL_LM_MAPPING``: ``GPT2LMHeadModel``,
       ``BertLMHeadModel``, ``CTRLLMHeadModel``, every ``*ForCausalLM``) -> causal; one it lists as a
       masked LM -> not;
    2. otherwise HF's own loss rule: ``loss_type == "ForCausalLM"``, or no recognised ``loss_type`` (HF's
       ``loss_function`` then falls back to the causal-LM loss) while every attention layer is causal.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    def names(mapping) -> set[str]:
        out: set[str] = set()
        for value in mapping.values():
            out.update(value if isinstance(value, (tuple, list)) else (value,))
        return out

    model = _unwrap(model)
    cls = type(model).__name__
    if cls in names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return True
    if cls in names(MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        return False
    loss_type = getattr(model, "loss_type", None)
    if loss_type == "ForCausalLM":
        return True
    if loss_type in LOSS_MAPPING:
        return False
    layers = attention_layers(model)
    return bool(layers) and all(bool(layer.is_causal) for layer in layers)


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict):
    """The model's forward pre-hook: this forward's ShardInfo handed down with it, its labels taken from
    HF's loss (Notes [Per-forward shard info], [The loss of model(**shard)]). The state is read from the
    module, so a deep copy of the model (an EMA or SWA copy) keeps to its own."""
    state: _State = getattr(module, _STATE_ATTR)
    running = _Forward(info=None, checkpointed=False)
    state.forwards.append(running)  # first: the always-called forward hook pops it even if this hook raises
    kwargs = dict(kwargs)
    info = kwargs.pop(SHARD_INFO_KEY, None)
    if info is not None and not isinstance(info, ShardInfo):
        raise TypeError(f"{SHARD_INFO_KEY}= must be the ShardInfo shard_inputs made, got {type(info).__name__}")
    if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
        _reject_unsupported(module, 0.0, {"output_attentions": True})
    if state.token_mixers and _runs_sharded(module):
        _refuse_token_mixers(module, state.token_mixers)
    if info is not None:
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        running.labels = shift_labels if shift_labels is not None else labels  # HF's precedence
        if running.labels is not None:
            num_items = kwargs.pop("num_items_in_batch", None)
            running.num_items_in_batch = num_items if state.loss_takes_num_items else None  # as the model does
        if state.passes_kwargs:
            kwargs[SHARD_INFO_KEY] = info  # down to the attention, and into checkpointed layers' partials
    running.info = info
    running.checkpointed = _is_checkpointing(module) and module.training and torch.is_grad_enabled()
    return args, kwargs


def _is_checkpointing(model: nn.Module) -> bool:
    """HF's activation (gradient) checkpointing flag, under its name in the installed transformers."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def _post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    """The model's forward hook, called even when the forward (or the pre-hook) raises: ends this
    forward's entry and sets ``loss`` for a sharded forward given labels (Note [The loss of model(**shard)])."""
    state: _State = getattr(module, _STATE_ATTR)
    if not state.forwards:
        return None
    running = state.forwards.pop()
    if running.labels is None or output is None:
        return None
    return _with_loss(module, output, running)


def _with_loss(model: nn.Module, output: Any, running: _Forward) -> Any:
    """``output`` (a ``ModelOutput`` or, with ``return_dict=False``, a tuple) with the loss of the shard's
    labels in front: the global token mean over the sequence-parallel group (Note [The loss of model(**shard)])."""
    from transformers.utils import ModelOutput

    logits = output.get("logits") if isinstance(output, ModelOutput) else output[0] if isinstance(output, tuple) else None
    labels, info = running.labels, running.info
    if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != labels.shape:
        shape = None if not isinstance(logits, torch.Tensor) else tuple(logits.shape)
        raise ValueError(
            f"labels {tuple(labels.shape)} do not match the shard's logits {shape} ([B, S_local, V]): pass model(**shard) "
            "the labels shard_inputs returned (this rank's shard, shifted over the global sequence for causal LMs); "
            "model(**shard) computes the token cross-entropy of causal and masked LMs"
        )
    total = cross_entropy_sum(logits, labels.to(logits.device), ignore_index=info.ignore_index)  # this shard's sum
    count = (labels != info.ignore_index).sum().to(device=total.device, dtype=total.dtype)
    group = _sequence_parallel_group(model)
    if group is not None:  # [sum, count] over the group in one collective; backward sums over the group
        totals = all_reduce_sum(torch.stack([total, count]), group)
        total, count = totals[0], totals[1].detach()
    if running.num_items_in_batch is not None:  # HF's Trainer: the count of the whole accumulated batch
        loss = total / torch.as_tensor(running.num_items_in_batch, device=total.device).to(total.dtype)
    else:
        loss = total / count.clamp_min(1)
    if isinstance(output, tuple):
        return (loss, *output)
    return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})


def _sequence_parallel_group(model: nn.Module):
    """The group the model's attention runs over, or ``None`` when it runs locally (unbound, or one rank)."""
    sps = _sp_modules(model)
    if not sps or sps[0].resolved_backend() == "local":
        return None
    group = sps[0].process_group
    return group if group_size_and_rank(group)[0] > 1 else None


def _runs_sharded(model: nn.Module) -> bool:
    """Whether the model's attention runs over more than one rank (a structural fact, the same on every rank)."""
    return _sequence_parallel_group(model) is not None


def _loss_takes_num_items(model: nn.Module) -> bool:
    """Whether the model's forward computes its loss with HF's ``self.loss_function`` (read from its source;
    ``True``, HF's default, when the source cannot be read)."""
    try:
        return "self.loss_function" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True


_PEFT_DEPTH = 4  # PeftModel -> tuner (LoraModel, ...) -> transformers model, with room to spare


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper, else ``model`` itself. Duck-typed, so ``peft`` is
    never imported: ``PeftModel.get_base_model()`` (for adapters such as LoRA/DoRA/IA3: the tuner's
    ``.model``, the transformers model with the adapters injected), or a tuner's ``.model``."""
    from transformers import PreTrainedModel

    inner = model
    for _ in range(_PEFT_DEPTH):
        if isinstance(inner, PreTrainedModel):
            return inner
        if getattr(getattr(inner, "active_peft_config", None), "is_prompt_learning", False):
            raise NotImplementedError(
                f"{type(inner).__name__} uses prompt learning (prompt / prefix / p-tuning): its virtual tokens would "
                "be added to every rank's shard of the sequence; use an adapter method (LoRA, DoRA, IA3, ...) "
                "under sequence parallelism, or train without it"
            )
        if callable(getattr(type(inner), "get_base_model", None)):
            inner = inner.get_base_model()
        elif hasattr(inner, "peft_config") and isinstance(getattr(inner, "model", None), nn.Module):
            inner = inner.model  # a PEFT tuner (LoraModel, ...) without its PeftModel
        else:
            break
    return model


def apply_sequence_parallel(
    model: nn.Module,
    *,
    group=None,
    backend: str = "auto",
    ulysses_degree: int | None = None,
    kernel: str = "auto",
    layout: "SequenceLayout | str | None" = None,
) -> nn.Module:
    """Make every attention layer of a transformers model run ``SequenceParallelAttention``. Idempotent.

    Args:
        model: a ``transformers.PreTrainedModel`` whose attention goes through ``AttentionInterface``
            (Llama, Qwen2, Mistral, ESM, RoBERTa, ... in transformers >= 5), or a PEFT model around one
            (``get_peft_model(...)``: the adapters' model is made sequence parallel, the wrapper returned).
        group: the sequence-parallel process group. ``None``: the backend of a ``SequenceParallelStrategy``
            that binds the model, plain local attention when nothing binds it.
        backend: with ``group``, the backend (``"ulysses"``, ``"ring"``, ``"zigzag_ring"``, ``"allgather_kv"``,
            ``"usp"``, ``"colossal"``, ``"local"``, ``"auto"``). Without ``group`` only ``"auto"`` (the strategy's
            choice) or ``"local"``.
        ulysses_degree, kernel: as for ``SequenceParallelAttention``.
        layout: as ``SequenceParallelAttention(layout=)``, given to every replaced attention: the
            ``SequenceLayout`` to shard for with ``backend`` ``"ring"``, ``"zigzag_ring"``, ``"allgather_kv"`` or
            ``"usp"`` (e.g. ``SequenceLayout.balanced_for(N, P, AttentionMask(bidirectional_spans=...))`` for a
            prefix-LM span); ``None``: the backend's own. ``shard_inputs`` shards with it. The same errors as the
            module's: another backend raises here, a table for another group size or Ulysses degree raises here
            when ``group`` is given (else when the strategy binds the model); the model is left unchanged.

    Returns the same model (modified in place): ``attn_implementation="lightning_sp"``, each attention
    layer with an ``sp_attention`` child (no parameters, so state dicts are unchanged), forward hooks
    taking the ``ShardInfo`` of ``shard_inputs`` (and the labels: Note [The loss of model(**shard)]), and
    the per-model fixes of ``model_fixes``.

    Raises ``NotImplementedError`` naming the module when the model mixes tokens outside attention
    (``token_mixers_outside_attention``: convolutions over the sequence, SSM / linear-attention blocks)
    and runs over more than one rank: here with a ``group`` of size > 1, else at its first sharded forward.
    """
    _register()
    from transformers import PreTrainedModel

    wrapper, model = model, _unwrap(model)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"apply_sequence_parallel needs a transformers PreTrainedModel (or a PEFT model around one), "
                        f"got {type(model).__name__}")
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
        _refuse_token_mixers(model)  # an SSM / RNN model (Mamba, RWKV): name what mixes its tokens
        raise ValueError(f"found no attention layers (modules with is_causal and config) in {type(model).__name__}")
    # every module built (and, with a group, its layout checked) before the model changes: bad input leaves it as it was
    replacements = [SequenceParallelAttention(
        causal=bool(layer.is_causal), backend=None if group is None and backend == "auto" else backend,
        group=group, ulysses_degree=ulysses_degree, kernel=kernel, layout=layout,
    ) for layer in layers]
    if layout is not None and group is not None:
        replacements[0].layout  # a table for another group size or Ulysses degree raises, naming the fix
    state = getattr(model, _STATE_ATTR, None)
    if not isinstance(state, _State):
        state = _State()
        setattr(model, _STATE_ATTR, state)
    for layer, attention in zip(layers, replacements):
        layer.sp_attention = attention
        setattr(layer, _STATE_ATTR, state)
    state.token_mixers = token_mixers_outside_attention(model)
    if group is not None and backend != "local" and group_size_and_rank(group)[0] > 1:
        _refuse_token_mixers(model, state.token_mixers)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if not state.hooks:
        state.hooks = (model.register_forward_pre_hook(_pre_forward, with_kwargs=True),
                       model.register_forward_hook(_post_forward, with_kwargs=True, always_call=True))
    state.passes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD
                              for p in inspect.signature(model.forward).parameters.values())
    state.loss_takes_num_items = _loss_takes_num_items(model)
    state.fixes = []
    for fix in _FIXES:
        if fix.applies(model):
            fix.patch(model, state)
            state.fixes.append(fix.name)
    return wrapper


_TOKEN_INDEX_KEY = "_lightning_sp_token_index"
_CONSUMED_KEYS = ("attention_mask", "cu_seqlens", "labels", "position_ids", SHARD_INFO_KEY)


# ------------------------------------------------------------------------------------ padding and 4-D masks


def _padding_ranges(mask: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """``mask [B, N]`` (1 = real token) -> each row's ``(start, end)`` of real tokens, or ``None`` without
    padding; raises unless every row is one run of tokens with padding on its left and/or right."""
    if bool(mask.bool().all()):
        return None
    try:
        return padding_ranges(mask)
    except ValueError as err:
        raise NotImplementedError(
            f"{err}. Only padding on the left and/or right of each row can be expressed exactly (the attention knows "
            "per-row padding, packed documents and 4-D masks, not holes in a 2-D mask): pad on one side "
            "(tokenizer.padding_side), pass the token-to-token mask as a 4-D attention_mask [B, 1, N, N], or pack "
            "the sequences into one row with 'position_ids' restarting at 0 per sequence (causal LMs) or a global "
            "'cu_seqlens'"
        ) from None


def _pack_rows(rows: dict[str, torch.Tensor], ranges: tuple[tuple[int, int], ...]) -> dict[str, torch.Tensor]:
    """Note [Packing padded rows]: rows of different unpadded lengths ``L_i`` cannot share one global
    length, so their real tokens (``[start_i, end_i)``, padding on either side) are packed into one row
    ``[1, sum L_i, ...]`` and become documents (``cu_seqlens = [0, L_0, L_0 + L_1, ...]``); padding is
    dropped. Per-row facts (HF's positions, which count the left padding; globally shifted labels; ESM's
    mask ratio) are computed on the rows first, so every real token sees exactly what the padded batch
    gives it; a padded position predicts nothing (its logits are not returned, its loss term is dropped)::

        row 0:  a a a . .        packed:  a a a b b b b      cu_seqlens [0, 3, 7]
        row 1:  . b b b b        (positions of b: 1 2 3 4, as HF numbers them)
    """
    return {k: torch.cat([t[i, s:e] for i, (s, e) in enumerate(ranges)], dim=0).unsqueeze(0) for k, t in rows.items()}


@dataclass(frozen=True)
class _GivenMask:
    """What an attention call takes from the batch's mask beyond the layer's own kwargs: ``causal`` (a 4-D
    mask replaces the layer's causality and sliding window, as HF's eager and sdpa attention apply it;
    ``None``: the layer's) and an ``AttentionMask`` (key padding, a recognised window, or a 4-D mask's rows)."""

    causal: bool | None
    mask: AttentionMask | None
    cu_seqlens: torch.Tensor | None = None
    """int32 document boundaries over the call's ``N`` tokens (a block-diagonal 4-D mask given to an unsharded
    call); a sharded call's documents are ``ShardInfo.cu_seqlens``."""


def _four_d_visible(mask: torch.Tensor, bsz: int, n: int, num_heads: int) -> torch.Tensor:
    """HF's 4-D ``attention_mask`` ``[B, 1 or H, N, N]``, bool (True = attend) or additive float (0 = attend,
    ``-inf`` / ``finfo.min`` = masked) -> bool ``[B, 1 or H, N, N]`` (True = visible)."""
    expected = f"[B, 1 or H, N, N] = [{bsz}, 1 or {num_heads}, {n}, {n}] (batch, heads, query, key)"
    if mask.dim() != 4 or mask.size(0) != bsz or mask.size(1) not in (1, num_heads) or tuple(mask.shape[2:]) != (n, n):
        raise ValueError(f"a 4-D attention_mask must be {expected}; got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"a 4-D attention_mask must be bool (True = attend) or an additive float mask (0 = attend, "
                         f"-inf or torch.finfo(dtype).min = masked); got {mask.dtype}")
    visible = mask == 0
    if not bool((mask[~visible] <= torch.finfo(mask.dtype).min / 2).all()):  # -inf and finfo.min are "masked"
        raise NotImplementedError(
            "an additive float 4-D attention_mask with values other than 0 (attend) and -inf / torch.finfo(dtype).min "
            "(masked) is a score bias, which the exact sequence-parallel backends do not apply; pass a bool mask "
            "(True = attend) or one of 0 / -inf, or add the bias as AttentionMask(score_mod=...) in your own attention"
        )
    return visible


@dataclass(frozen=True)
class _Pattern:
    """A 4-D mask recognised (Note [Recognising a 4-D mask])."""

    causal: bool
    window: tuple[int, int] | None
    real: torch.Tensor
    """bool ``[B, N]``: each row's real tokens (one run; padding on either side)."""
    documents: tuple[tuple[int, ...], ...] | None = None
    """Each row's documents as cumulative lengths over its real tokens, ``(0, ..., L_b)``; ``None``: one
    document per row."""


def _document_starts(seen: torch.Tensor) -> torch.Tensor:
    """``seen [B, N, N]`` (query sees key) -> bool ``[B, N]``: where a document starts, i.e. the boundaries
    no visible pair crosses. A pair ``(q, k)`` crosses the boundary before ``i`` iff ``min(q, k) < i <=
    max(q, k)``, so with ``far[p]`` the farthest position ``p`` sees or is seen by (at least ``p``), ``i``
    starts a document iff ``max(far[:i]) < i`` (a prefix maximum)."""
    b, n, _ = seen.shape
    pos = torch.arange(n, device=seen.device)
    far_key = torch.where(seen, pos[None, None, :], -1).amax(-1)  # [B, N] per query
    far_query = torch.where(seen, pos[None, :, None], -1).amax(-2)  # [B, N] per key
    reach = torch.maximum(torch.maximum(far_key, far_query), pos[None]).cummax(-1).values  # [B, N]
    return torch.cat([torch.ones(b, 1, dtype=torch.bool, device=seen.device), reach[:, :-1] < pos[None, 1:]], dim=1)


def _recognised_pattern(visible: torch.Tensor) -> _Pattern | None:
    """Note [Recognising a 4-D mask]: ``visible [B, Hm, N, N]`` -> the ``_Pattern`` it is, or ``None``:
    causal or bidirectional attention, with or without a window, over each row's real tokens (one run,
    padding on either side), either as one document per row or as contiguous documents covering the
    row's real tokens (block-diagonal: packed sequences; each row its own boundaries).

    ``real`` are the keys some query sees; every other position is padding (dropped from the batch like a
    2-D mask's padding, so only the real queries' rows must match). Causality and the window are read off
    the pairs the real queries see (the window: the farthest pair on each side), the documents off the
    boundaries no such pair crosses (``_document_starts``). Candidates are built from these parts, the
    fewest parts first (no window before a window, one document per row before documents), and one must
    equal the mask on every real row, entry for entry: a mask is never guessed. Documents become
    ``cu_seqlens`` (``shard_inputs`` packs the rows into one, each row its own boundaries)::

        row 0:  a a a b b . .     (a: causal within a, b: within b, .: padding)   ->  a a a b b c c c c
        row 1:  c c c c . . .                                                          cu_seqlens [0, 3, 5, 9]

    Every rank recognises the same pattern from the same global batch; before any collective the attention's
    input check compares causality, ``hash(cu_seqlens)`` and the mask's signature across ranks (STYLE 17) and
    raises on every rank if a rank was given another batch."""
    if visible.size(1) > 1 and not bool((visible == visible[:, :1]).all()):
        return None  # heads that differ: rows
    v = visible[:, 0]  # [B, N, N]
    n = v.size(-1)
    real = v.any(1)  # [B, N] keys some query sees
    if not bool(real.any(-1).all()):
        return None
    try:
        ranges = padding_ranges(real)
    except ValueError:
        return None
    rows = real[:, :, None]  # [B, N, 1]: compare real query rows only
    seen = v & rows  # [B, N, N] what the real queries see
    pos = torch.arange(n, device=v.device)
    diff = pos[:, None] - pos[None, :]  # q - k
    causal = not bool((seen & (diff < 0)).any())
    base = (diff >= 0) if causal else torch.ones(n, n, dtype=torch.bool, device=v.device)
    left = int(diff.masked_fill(~seen, -n).amax())
    right = 0 if causal else int((-diff).masked_fill(~seen, -n).amax())
    starts = _document_starts(seen)  # [B, N]
    doc = starts.long().cumsum(-1)
    same_document = doc[:, :, None] == doc[:, None, :]  # [B, N, N]
    for documents in (False, True):
        for window in (None, (left, right)):
            cand = base if window is None else base & (diff <= window[0]) & (-diff <= window[1])
            cand = cand[None] & real[:, None, :]  # [B, N, N]
            if documents:
                cand = cand & same_document
            if bool(((cand == v) | ~rows).all()):
                if not documents:
                    return _Pattern(causal, window, real)
                cumulative = tuple(
                    tuple(int(i) for i in torch.nonzero(starts[r, s:e]).flatten()) + (e - s,)
                    for r, (s, e) in enumerate(ranges))
                one_each = all(len(c) == 2 for c in cumulative)  # (0, L): not block-diagonal after all
                return _Pattern(causal, window, real, None if one_each else cumulative)
    return None


class _DenseRows:
    """A 4-D mask no pattern describes, as a ``mask_mod``: this rank's query rows ``rows [B, Hm, R, N_pad]``
    (bool) of the global positions ``positions [R]`` its attention computes, looked up by global position.
    Memory ``O(B Hm R N)``: ``R = N / P`` on the ring backends, ``N`` for Ulysses (every rank computes every
    position, for its heads)."""

    def __init__(self, rows: torch.Tensor, positions: torch.Tensor, padded_len: int, digest: str):
        self.rows = rows
        self.digest = digest  # of the global mask, the same on every rank given the same batch
        self.row_of = torch.full((padded_len,), -1, dtype=torch.long)
        self.row_of[positions] = torch.arange(positions.numel())
        self._on_device: dict = {}  # device -> (rows, row_of): copied once, not per block

    def signature(self) -> str:
        """What ranks compare (``AttentionMask.signature``): each holds other rows of the same global mask."""
        return self.digest

    def __call__(self, b, h, q, k):
        if k.device not in self._on_device:
            self._on_device[k.device] = (self.rows.to(k.device), self.row_of.to(k.device))
        rows, row_of = self._on_device[k.device]
        row_of = row_of[q]  # [1, 1, Sq, 1]
        if bool((row_of < 0).any()):
            raise RuntimeError("a 4-D attention mask was asked for query rows this rank does not hold: the backend "
                               "computes other positions than the shard_inputs of this batch expected")
        heads = h if rows.size(1) > 1 else torch.zeros_like(h)
        return rows[b, heads, row_of, k]  # [B, H or 1, Sq, Sk]


def _query_positions(sp: SequenceParallelAttention, world: int, rank: int, padded_len: int) -> torch.Tensor:
    """Global positions whose query rows this rank's attention computes (``[R]``, its layout order)."""
    backend = sp.resolved_backend()
    if world == 1 or backend not in ("ring", "zigzag_ring", "allgather_kv", "colossal", "usp"):
        return torch.arange(padded_len)  # Ulysses (every position, a slice of heads) or a per-call choice
    members = [rank]
    if backend == "usp":  # the ring rank's tokens, gathered over its Ulysses group
        u = sp.layout.ulysses_degree
        members = list(range(rank // u * u, rank // u * u + u))
    return torch.cat([token_indices(sp.layout, world, padded_len, m) for m in members])


_NOT_RECOGNISED = ("a 4-D attention_mask that is not causal / bidirectional attention with padding, a window and/or "
                   "contiguous documents (block-diagonal)")


def _dense_rows_mask(visible: torch.Tensor, positions: torch.Tensor, padded_len: int,
                     what: str = _NOT_RECOGNISED) -> AttentionMask:
    """``visible [B, Hm, N, N]`` -> an ``AttentionMask`` whose ``mask_mod`` holds the rows of ``positions``
    (with a warning that says ``what`` the mask is and what it costs)."""
    b, hm, n, _ = visible.shape
    warnings.warn(
        f"{what} is applied as each rank's query rows: O(N^2 / P) memory per rank (O(N^2) under Ulysses), and the "
        "per-score kernel",
        stacklevel=3,
    )
    padded = visible.new_zeros(b, hm, padded_len, padded_len)
    padded[:, :, :n, :n] = visible
    import numpy as np  # transformers' own dependency

    digest = hashlib.sha1(np.packbits(visible.cpu().numpy()).tobytes() + repr(tuple(visible.shape)).encode()).hexdigest()
    return AttentionMask(mask_mod=_DenseRows(padded[:, :, positions.to(visible.device)].clone(), positions, padded_len,
                                             digest))


def _given_mask_of_call(sp: SequenceParallelAttention, attention_mask: torch.Tensor | None, info: "ShardInfo | None",
                        query: torch.Tensor, state: _State | None = None) -> _GivenMask | None:
    """The batch's mask for this attention call: from the ShardInfo (sharded), else from the mask HF hands
    an unsharded call (2-D padding -> ``key_padding``; 4-D -> a recognised pattern or its rows), read once
    per mask tensor (``state.last_given_mask``), not once per layer."""
    if info is not None:
        return info.given_mask
    if attention_mask is None:
        return None
    try:
        key = (attention_mask._version, tuple(query.shape[:3]))
    except RuntimeError:  # an inference tensor keeps no version counter: read it every call
        return _read_given_mask(attention_mask, query)
    last = state.last_given_mask if state is not None else None
    if last is not None and last[0]() is attention_mask and last[1:3] == key:
        return last[3]
    given = _read_given_mask(attention_mask, query)
    if state is not None:
        state.last_given_mask = (weakref.ref(attention_mask), *key, given)
    return given


def _read_given_mask(attention_mask: torch.Tensor, query: torch.Tensor) -> _GivenMask | None:
    """``_given_mask_of_call``'s reading of HF's ``attention_mask`` for an unsharded call."""
    if attention_mask.dim() == 2:
        ranges = _padding_ranges(attention_mask)
        if ranges is None or all(r == (0, ranges[0][1]) for r in ranges):
            return None  # no padding, or right padding of one length: the call's seq_len says it
        return _GivenMask(None, AttentionMask(key_padding=ranges))
    b, h, n = query.size(0), query.size(1), query.size(2)
    visible = _four_d_visible(attention_mask, b, n, h)
    pattern = _recognised_pattern(visible)
    if pattern is None:
        return _GivenMask(False, _dense_rows_mask(visible, torch.arange(n), n))
    if pattern.documents is not None and b > 1:
        return _GivenMask(False, _dense_rows_mask(
            visible, torch.arange(n), n, "a block-diagonal 4-D attention_mask over several rows, given to the model "
            "directly (documents need one row: shard_inputs packs the rows into one)"))
    ranges = None if bool(pattern.real.all()) else padding_ranges(pattern.real)
    cu_seqlens = None
    if pattern.documents is not None:  # one row: its documents, the padding on either side documents of their own
        (start, end), = padding_ranges(pattern.real)
        bounds = {0, n, *(start + d for d in pattern.documents[0])}
        cu_seqlens = torch.tensor(sorted(bounds), dtype=torch.int32)
    return _GivenMask(pattern.causal, AttentionMask(window=pattern.window, key_padding=ranges), cu_seqlens)


def shard_inputs(batch: Mapping[str, Any], model: nn.Module, *, causal_lm: bool | None = None, ignore_index: int = -100) -> dict:
    """This rank's shard of a global HF batch, as keyword arguments for ``model(**shard)``.

    ``batch`` (the same on every rank of the group): ``input_ids [B, N]`` (or ``inputs_embeds [B, N, E]``),
    optional ``labels [B, N]`` in HF's convention (the tokens themselves, ``ignore_index`` to ignore; NOT
    shifted), optional ``attention_mask``: padding ``[B, N]`` (left and/or right) or a 4-D token-to-token mask
    ``[B, 1 or H, N, N]`` (bool, or additive 0 / -inf; Note [Recognising a 4-D mask]), optional packed
    ``position_ids [B, N]``
    (restarting at 0 per document; causal LMs) or a global ``cu_seqlens [n_docs + 1]`` (``B == 1``).
    Other tensors ``[B, N, ...]`` are sharded along dim 1, anything else passes through.

    Returns ``input_ids [B', S_local]``, global ``position_ids``, ``labels`` (for causal LMs shifted over
    the global sequence as HF's loss does; each row's last token ``ignore_index``) and a ``ShardInfo``
    under ``"sequence_parallel"``. The attention mask is not passed on: padding (left and/or right) is
    dropped (rows of one length ``L`` are cut to ``L`` columns; rows of different lengths are packed into
    one row of documents, ``B' = 1``, Note [Packing padded rows]), positions staying HF's; a recognised
    4-D mask likewise, plus its causality and window in the ShardInfo; a block-diagonal one (packed
    sequences) becomes documents (``ShardInfo.cu_seqlens``, the rows packed into one, ``B' = 1``; the
    given ``position_ids`` stay what HF's RoPE sees); any other 4-D mask stays whole and each rank gets
    its query rows (``ShardInfo.given_mask``); a 2-D mask with holes raises. Logits therefore cover the
    real tokens only, in row order.

    Either pop ``labels`` and take ``sequence_parallel_cross_entropy(model(**shard).logits, labels, group=...)``,
    or leave them in: ``model(**shard).loss`` is then the same global token mean, HF's ``num_items_in_batch``
    honoured (Note [The loss of model(**shard)]). ``model`` may be a PEFT model around a transformers model.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_inputs takes a dict batch (input_ids, labels, attention_mask, ...), got {type(batch).__name__}")
    sps = _sp_modules(model)
    if not sps:
        raise ValueError("call apply_sequence_parallel(model) before shard_inputs(batch, model)")
    model = _unwrap(model)  # a PEFT model: its transformers model decides labels, positions and fixes
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
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() not in (2, 4):
        raise NotImplementedError(
            f"a {mask.dim()}-D attention_mask {tuple(mask.shape)} is neither a padding mask [B, N] = [{bsz}, {n}] nor "
            f"a token-to-token mask [B, 1 or H, N, N]; pass one of those (or pack documents with position_ids "
            "restarting at 0 (causal LMs) or a global cu_seqlens)"
        )
    for key in ("labels", "attention_mask", "position_ids"):
        if key in batch and batch[key] is not None and tuple(batch[key].shape[:2]) != (bsz, n) and not (
                key == "attention_mask" and mask.dim() == 4):
            raise ValueError(f"{key} has shape {tuple(batch[key].shape)} but input_ids is [B, N] = [{bsz}, {n}]")
    causal = is_causal_lm(model) if causal_lm is None else causal_lm
    given_mask, documents = None, None
    if mask is not None and mask.dim() == 4:  # Note [Recognising a 4-D mask]
        mask, given_mask, documents = _shard_four_d_mask(mask, model, sp, world, bsz, n)
    ranges = _padding_ranges(mask) if mask is not None else None
    if ranges is None:
        mask = None  # all ones: nothing to describe (HF's own src_lengths then equal the row length)
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is not None and documents is not None:
        raise ValueError("the batch has both a global cu_seqlens and a block-diagonal 4-D attention_mask (documents): "
                         "pass one of them")
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
    max_position = int(position_ids.max()) if position_ids.numel() else 0  # what HF's dynamic RoPE would see
    column = torch.arange(n, device=main.device).unsqueeze(0).expand(bsz, -1)
    rows: dict[str, torch.Tensor] = {"position_ids": position_ids, _TOKEN_INDEX_KEY: column}
    if (causal and position_ids is batch.get("position_ids") and mask is None and cu_seqlens is None and bsz == 1
            and given_mask is None):  # a 4-D mask says where documents are (HF then ignores restarts too)
        # packed position_ids: documents start where positions do not count up (HF's causal-mask rule)
        starts = torch.nonzero(position_ids[0, 1:] - position_ids[0, :-1] != 1).flatten() + 1
        if starts.numel():
            cu_seqlens = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([n])])
    labels = batch.get("labels")
    if labels is not None:
        if causal:  # HF's causal-LM loss predicts token i+1 at position i: shift over the GLOBAL row
            labels = torch.cat([labels[:, 1:], labels.new_full((bsz, 1), ignore_index)], dim=1)
        if ranges is not None:  # padding predicts nothing (and nothing predicts padding)
            col = torch.arange(n, device=labels.device)[None, :]
            start, end = torch.tensor(ranges, device=labels.device).unbind(-1)  # [B] each
            keep = (col >= start[:, None]) & (col < end[:, None] - (1 if causal else 0))
            labels = labels.masked_fill(~keep, ignore_index)
        rows["labels"] = labels
    ratio = extra.get("token_dropout_ratio")  # float32 [B]
    if ratio is not None:
        rows["token_dropout_ratio"] = ratio[:, None].expand(bsz, n)  # per token, so it can be sharded/packed
    for key, value in batch.items():
        if key not in _CONSUMED_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (bsz, n):
            rows[key] = value
    passthrough = {k: v for k, v in batch.items() if k not in _CONSUMED_KEYS and k not in rows}

    lengths = None if ranges is None else [e - s for s, e in ranges]
    if documents is not None:  # a block-diagonal 4-D mask: each row's documents, the rows packed into one
        ranges = ranges or tuple((0, n) for _ in range(bsz))
        offsets = [0, *torch.tensor([e - s for s, e in ranges]).cumsum(0).tolist()]
        cu_seqlens = torch.tensor([0, *(offsets[r] + d for r, docs in enumerate(documents) for d in docs[1:])])
        rows = _pack_rows(rows, ranges)  # Note [Packing padded rows]
        bsz, n = 1, offsets[-1]
    elif lengths is not None and len(set(lengths)) > 1:
        rows = _pack_rows(rows, ranges)  # Note [Packing padded rows]
        cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
        bsz, n = 1, sum(lengths)
    elif lengths is not None:  # rows of one length L: the padding columns are dropped (exact, and cheaper)
        n = lengths[0]
        rows = {k: torch.stack([t[i, s:e] for i, (s, e) in enumerate(ranges)]) for k, t in rows.items()}
        if cu_seqlens is not None and int(torch.as_tensor(cu_seqlens)[-1]) > n:
            raise ValueError(f"cu_seqlens ends at {int(torch.as_tensor(cu_seqlens)[-1])} but the mask leaves {n} tokens")
    seq_len = n  # no padding is left; only the layout pads (to N_pad), and the attention knows N
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens).to(dtype=torch.int32).flatten().cpu()
        if int(cu_seqlens[-1]) != seq_len:
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but the batch has {seq_len} unpadded tokens")

    chunk_cu_seqlens = None
    cfg = _base_config(model)
    if "chunked_attention" in (getattr(cfg, "layer_types", None) or ()) and getattr(cfg, "attention_chunk_size", None):
        chunk_cu_seqlens = _chunk_boundaries(cu_seqlens, seq_len, rows[_TOKEN_INDEX_KEY], cfg.attention_chunk_size)

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
        max_position=max_position, token_index=shard.pop(_TOKEN_INDEX_KEY), chunk_cu_seqlens=chunk_cu_seqlens,
        ignore_index=ignore_index, given_mask=given_mask,
    )
    return shard


def _shard_four_d_mask(mask: torch.Tensor, model: nn.Module, sp: SequenceParallelAttention, world: int, bsz: int,
                       n: int) -> tuple[torch.Tensor | None, _GivenMask, tuple[tuple[int, ...], ...] | None]:
    """Note [Recognising a 4-D mask]: a global 4-D ``attention_mask`` -> ``(padding mask [B, N] or None, given
    mask, each row's documents or None)``: a recognised pattern becomes padding (dropped like a 2-D mask's) plus
    causality, a window and documents (``_Pattern.documents``: cumulative lengths over each row's real tokens);
    any other mask, this rank's query rows (no padding dropped)."""
    visible = _four_d_visible(mask, bsz, n, int(getattr(_base_config(model), "num_attention_heads", 1) or 1))
    pattern = _recognised_pattern(visible)
    if pattern is not None:
        window = None if pattern.window is None else AttentionMask(window=pattern.window)
        return pattern.real.long(), _GivenMask(pattern.causal, window), pattern.documents
    rank = group_size_and_rank(sp.process_group)[1] if world > 1 else 0
    n_pad = padded_length(n, world, sp.layout)
    return None, _GivenMask(False, _dense_rows_mask(visible, _query_positions(sp, world, rank, n_pad), n_pad)), None
