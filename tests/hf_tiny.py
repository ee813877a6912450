"""Tiny random transformers models in float64 and their unsharded references (HF's own ``sdpa``).

The reference loss is HF's definition computed in float64: HF's loss functions upcast logits with
``.float()`` (float32), which would hide float64 agreement behind float32 round-off.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

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
